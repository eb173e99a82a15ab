"""The Faust app: telemetry in, decisions out, per-run state in a RocksDB table with a changelog.

One agent (concurrency 1, faust #606) takes telemetry in batches (``take_events``, which acks a batch
only after it was processed) and hands each batch to ``BatchProcessor``, which:

1. decodes every message; bad ones go to the DLQ with the reason in a header, wrongly keyed ones are
   re-published keyed by run id;
2. folds each run's events through the core, reading and writing the run's table value once per batch
   (one changelog message per run per batch instead of one per event);
3. publishes the decisions (CloudEvents on the control topic, halts also on the alerts topic) and waits
   for the broker to acknowledge them *before* writing the new state, so a crash can duplicate a
   decision (same id, deduplicated by runtimes) but never lose one;
4. skips messages at or below the offset stored with the run: Faust re-delivers everything after the
   last commit, and re-applying an event must not change state or decisions.

Windows live in the core's event-time state, not in Faust windowed tables (their expiry uses the wall
clock and never fires after recovery).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

import faust
import orjson
from faust.streams import _current_event
from faust.types import EventT, StreamT

from ..core import Decision, Detector, InvalidEvent, Policy, TelemetryEvent, parse_event
from ..wire import Headers, encode_control
from .codecs import StoredRun, decode_run, encode_run
from .metrics import WorkerMetrics
from .settings import WorkerSettings

log = logging.getLogger(__name__)

RUNS_TABLE = "runs"
SWEEP_INTERVAL_S = 0.5  # how often stored runs are checked for expiry (a timer, off the per-batch path)
_FAUST_RESERVED = b"__faust"  # faust keeps its own bookkeeping (the persisted offset) in the same DB


def create_app(settings: WorkerSettings, policy: Policy, metrics: WorkerMetrics) -> faust.App:
    """A configured Faust app with its topics, the runs table and the detection agent."""
    app = faust.App(
        settings.app_id,
        broker=[f"kafka://{server}" for server in settings.kafka.bootstrap_servers.split(",")],
        broker_credentials=settings.kafka.faust_credentials(),
        store="rocksdb://",
        datadir=str(settings.state_dir),
        topic_partitions=settings.partitions,
        topic_replication_factor=settings.replication_factor,
        topic_disable_leader=True,
        key_serializer="raw",
        value_serializer="raw",
        broker_commit_interval=settings.commit_interval_s,
        broker_session_timeout=settings.session_timeout_s,
        broker_heartbeat_interval=settings.heartbeat_s,
        consumer_auto_offset_reset="earliest",
        table_standby_replicas=settings.standby_replicas,
        producer_acks=-1,
        producer_linger_ms=1,
        web_enabled=False,
    )
    telemetry = app.topic(settings.telemetry_topic, partitions=settings.partitions,
                          key_serializer="raw", value_serializer="raw")
    runs = app.Table(
        RUNS_TABLE,
        default=None,
        partitions=settings.partitions,
        key_type=bytes,
        value_type=bytes,
        options={
            "driver": "rocksdict",
            "block_cache_size": settings.rocksdb_block_cache_mb << 20,
            "write_buffer_size": settings.rocksdb_write_buffer_mb << 20,
            "max_open_files": settings.rocksdb_max_open_files,
        },
    )
    processor = BatchProcessor(app, telemetry, runs, Detector(policy), settings, metrics)

    if settings.evict_scan_per_sweep:

        async def expire_silent_runs() -> None:
            processor.sweep()

        app.timer(SWEEP_INTERVAL_S)(expire_silent_runs)

    @app.agent(telemetry, concurrency=1, name="loopwarden.detect")
    async def detect(stream: StreamT) -> None:
        async for batch in stream.take_events(settings.batch_max, within=settings.batch_within_s):
            await processor.process(batch)

    return app


class BatchProcessor:
    """Applies one batch of telemetry messages; see the module docstring for the order of things."""

    def __init__(self, app: faust.App, telemetry: faust.TopicT, runs: faust.Table, detector: Detector,
                 settings: WorkerSettings, metrics: WorkerMetrics) -> None:
        self.app = app
        self.telemetry = telemetry
        self.runs = runs
        self.detector = detector
        self.settings = settings
        self.metrics = metrics
        self.control = app.topic(settings.control_topic, key_serializer="raw", value_serializer="raw")
        self.alerts = app.topic(settings.alerts_topic, key_serializer="raw", value_serializer="raw")
        self.dlq = app.topic(settings.dlq_topic, key_serializer="raw", value_serializer="raw")
        self._events_by_outcome = {o: metrics.events.labels(outcome=o) for o in ("success", "error", "empty", "noop")}
        self._run_ttl_ms = detector.policy.defaults.run_ttl_ms
        self._watermark_ms: dict[int, int] = {}
        self._sweep_from: dict[int, bytes] = {}
        #: The latest message of each partition: the context (partition) for the sweep's table deletes.
        self._last_event: dict[int, EventT] = {}

    async def process(self, batch: Sequence[EventT]) -> None:
        self.metrics.batch_size.observe(len(batch))
        by_run: dict[bytes, list[tuple[EventT, TelemetryEvent]]] = {}
        last_of_partition: dict[int, EventT] = {}
        for event in batch:
            message = event.message
            last_of_partition[message.partition] = event
            telemetry = await self._decode(event)
            if telemetry is None:
                continue
            key = telemetry.run_id.encode()
            if message.key != key:
                self.metrics.rekeyed.inc()
                await self.telemetry.send(key=key, value=event.value)
                continue
            by_run.setdefault(key, []).append((event, telemetry))
            watermarks = self._watermark_ms
            if telemetry.ts_ms > watermarks.get(message.partition, 0):
                watermarks[message.partition] = telemetry.ts_ms

        decisions: list[Decision] = []
        updates: list[tuple[EventT, bytes, StoredRun]] = []
        for key, items in by_run.items():
            _enter_partition_of(items[-1][0])
            stored = decode_run(self.runs.get(key))
            applied = False
            for event, telemetry in items:
                if event.message.offset <= stored.offset:
                    self.metrics.duplicates.inc()
                    continue
                evaluation = self.detector.evaluate(stored.state, telemetry)
                stored.offset = event.message.offset
                applied = True
                if evaluation.duplicate:
                    self.metrics.duplicates.inc()
                else:
                    self._events_by_outcome[telemetry.outcome].inc()
                    decisions.extend(evaluation.decisions)
            if applied:
                updates.append((items[-1][0], key, stored))

        if decisions:
            await self._publish(decisions)
        for event, key, stored in updates:
            _enter_partition_of(event)
            self.runs[key] = encode_run(stored)
        for event in last_of_partition.values():
            self._report_lag(event)
        self._last_event.update(last_of_partition)

    def sweep(self) -> None:
        """Expire silent runs in every assigned partition (called on a timer, off the per-batch path)."""
        assigned = {tp.partition for tp in self.app.consumer.assignment() if tp.topic == self.telemetry.get_topic_name()}
        for partition, event in list(self._last_event.items()):
            if partition in assigned:
                self._sweep(partition, event)
            else:
                del self._last_event[partition]  # revoked: its DB belongs to another worker now

    async def _decode(self, event: EventT) -> TelemetryEvent | None:
        """The telemetry event, or None after dead-lettering a bad message."""
        raw = event.value
        try:
            if not isinstance(raw, bytes | bytearray):
                raise InvalidEvent("", "message has no value")
            return parse_event(raw, self.settings.max_event_bytes)
        except InvalidEvent as exc:
            await self._dead_letter(event, exc)
            return None

    async def _dead_letter(self, event: EventT, error: InvalidEvent) -> None:
        message = event.message
        reason = error.field or ("json" if str(error).startswith("not JSON") else "payload")
        self.metrics.dlq.labels(reason=reason).inc()
        log.info("dead-lettered %s[%d]@%d: %s", message.topic, message.partition, message.offset, error)
        headers: Headers = [
            ("error", str(error)[:1024].encode()),
            ("error_field", error.field.encode()),
            ("source_topic", message.topic.encode()),
            ("source_partition", str(message.partition).encode()),
            ("source_offset", str(message.offset).encode()),
        ]
        value = event.value if isinstance(event.value, bytes | bytearray) else b""
        await self.dlq.send(key=message.key, value=bytes(value), headers=headers)

    async def _publish(self, decisions: list[Decision]) -> None:
        """Send decisions and wait until the broker has them all."""
        pending = []
        source = self.settings.event_source
        for decision in decisions:
            key, value, headers = encode_control(decision, source)
            pending.append(await self.control.send(key=key, value=value, headers=headers))
            if decision.action == "halt":
                pending.append(await self.alerts.send(key=key, value=value, headers=headers))
        await asyncio.gather(*pending)
        now = time.time()
        for decision in decisions:
            self.metrics.decisions.labels(action=decision.action, verdict=decision.verdict).inc()
            self.metrics.decision_latency.observe(max(0.0, now - decision.ts_ms / 1000))

    def _report_lag(self, event: EventT) -> None:
        message = event.message
        highwater = self.app.consumer.highwater(message.tp)
        if highwater is not None:
            self.metrics.consumer_lag.labels(partition=str(message.partition)).set(
                max(0, highwater - message.offset - 1))

    def _sweep(self, partition: int, event: EventT) -> None:
        """Check a few stored runs of ``partition`` for expiry, resuming where the last sweep stopped.

        Reaches into the pinned faust RocksDB store for the partition's DB (faust has no public
        per-partition iterator); deletes go through the table so they reach the changelog.
        """
        store: Any = self.runs.data
        db = store._db_for_partition(partition)
        horizon = self._watermark_ms.get(partition, 0) - self._run_ttl_ms
        cursor = db.iter()
        cursor.seek(self._sweep_from.get(partition, b""))
        expired: list[bytes] = []
        for _ in range(self.settings.evict_scan_per_sweep):
            if not cursor.valid():
                cursor.seek_to_first()  # wrap around: the next batch starts a new pass
                break
            key = cursor.key()
            if not key.startswith(_FAUST_RESERVED) and orjson.loads(cursor.value())["last_ts_ms"] < horizon:
                expired.append(key)
            cursor.next()
        self._sweep_from[partition] = cursor.key() if cursor.valid() else b""
        if expired:
            _enter_partition_of(event)
            for key in expired:
                del self.runs[key]
            self.metrics.evictions.inc(len(expired))
        self.metrics.runs_tracked.set(sum(
            d.property_int_value("rocksdb.estimate-num-keys") or 0 for d in store._dbs.values()))


def _enter_partition_of(event: EventT) -> None:
    """Make ``event`` current for table access: faust picks the RocksDB partition DB and the changelog
    partition of a read or write from the current event, and a batch spans partitions while a run's
    state must stay in its own. Only the context variable is set (in this task's context): touching
    ``Stream.current_event`` would corrupt ``take_events``, which reads it to fill the next batch."""
    _current_event.set(weakref.ref(event))
