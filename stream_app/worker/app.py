"""The Faust app: telemetry in, decisions out, per-run state in a RocksDB table with a changelog.

One agent (concurrency 1, faust #606) takes telemetry in batches (``take_events``, which acks a batch
only after it was processed), admits each partition's messages in offset order with none left out
(``delivery``: faust can drop or skip messages around rebalances and recoveries; only processed offsets
are committed) and hands them to ``BatchProcessor``, which:

1. decodes every message; bad ones go to the DLQ with the reason in a header, wrongly keyed ones are
   re-published keyed by run id; an operator command (``loopwarden halt|resume``) is applied only if
   signed by one of the operator keys and recent (else DLQ), in order with the run's calls;
2. folds each run's events through the core, reading and writing the run's table value once per batch
   (one changelog message per run per batch instead of one per event), straight to the table's
   RocksDB partitions and changelog (``state.RunStore``: Faust's Table API costs 2x the throughput);
3. publishes the decisions, signed with the worker's Ed25519 key (CloudEvents on the control topic;
   halts and operator decisions also on the alerts topic), and waits for the broker to acknowledge
   them *before* writing the new state, so a crash can duplicate a
   decision (same id, deduplicated by runtimes) but never lose one;
4. skips messages at or below the offset stored with the run: Faust re-delivers everything after the
   last commit, and re-applying an event must not change state or decisions.

Windows live in the core's event-time state, not in Faust windowed tables (their expiry uses the wall
clock and never fires after recovery).

With ``LOOPWARDEN_OTLP_TOPIC`` set, a second agent (``OtlpRelay``) reads the OpenTelemetry Collector's
trace records. Those are keyed by trace id, but state is partitioned by run id, so the relay does not
fold them: it re-publishes each tool span as native telemetry keyed by run id (``stream_app.otlp``)
and lets a batch's offsets be committed only once the broker has acknowledged what it published. The
detection agent then sees them like any runtime's telemetry: same order, dedupe (event id = trace id +
span id), recovery and decisions, and the native hot path is untouched.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import faust
import orjson
from faust.types import EventT, StreamT

from ..core import (
    Decision,
    Detector,
    InvalidEvent,
    OperatorCommand,
    Policy,
    TelemetryEvent,
    decode_operator_command,
    parse_event,
)
from ..signing import KeyRing, SignatureRejected, Signer
from ..wire import KIND_HEADER, OPERATOR_KIND, Headers, encode_control, encode_telemetry, header
from . import delivery
from .codecs import decode_run, encode_run
from .metrics import WorkerMetrics
from .settings import SettingsError, WorkerSettings
from .state import Change, RunStore

log = logging.getLogger(__name__)

RUNS_TABLE = "runs"
SWEEP_INTERVAL_S = 0.5
#: Dead-lettered values are cut to this many bytes (header ``value_bytes``: the original size), below the
#: producer's 1 MB request limit: the telemetry topic may allow larger messages than the DLQ does.
DLQ_VALUE_LIMIT = 256 * 1024  # how often stored runs are checked for expiry (a timer, off the per-batch path)


def configured_app(settings: WorkerSettings) -> faust.App:
    """A Faust app with the worker's broker, consumer, producer and store configuration, and nothing
    else (the benchmarks measure a no-op agent on it as the framework's own ceiling)."""
    return faust.App(
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


def telemetry_topic(app: faust.App, settings: WorkerSettings) -> faust.TopicT:
    return app.topic(settings.telemetry_topic, partitions=settings.partitions,
                     key_serializer="raw", value_serializer="raw")


def create_app(settings: WorkerSettings, policy: Policy, metrics: WorkerMetrics, signer: Signer | None = None,
               operator_keys: KeyRing | None = None) -> faust.App:
    """A configured Faust app with its topics, the runs table and the detection agent. Decisions are
    signed with ``signer`` (None: unsigned, development only); operator commands are accepted from
    ``operator_keys`` only."""
    app = configured_app(settings)
    telemetry = telemetry_topic(app, settings)
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
    processor = BatchProcessor(app, telemetry, runs, Detector(policy), settings, metrics, signer, operator_keys)
    # Offsets are committed only for processed messages, in sequence (see delivery's docstring).
    inputs = [settings.telemetry_topic] + ([settings.otlp_topic] if settings.otlp_topic else [])
    processed = delivery.install(app, inputs, metrics.refetched.labels(reason="skipped").inc)
    sequencer = delivery.Sequencer(app, metrics.refetched.labels(reason="gap").inc)

    @app.on_partitions_revoked.connect
    async def forget_revoked(sender: faust.App, revoked: set[faust.types.TP], **_: object) -> None:
        sequencer.forget(revoked)

    if settings.evict_scan_per_sweep:

        async def expire_silent_runs() -> None:
            await processor.sweep()

        app.timer(SWEEP_INTERVAL_S)(expire_silent_runs)

    async def in_order(stream: StreamT, handle: Callable[[list[EventT]], Awaitable[None]]) -> None:
        """Hand ``stream``'s batches to ``handle``, each partition in offset order, and mark what it
        finished as processed (only that gets committed)."""
        async for batch in stream.take_events(settings.batch_max, within=settings.batch_within_s):
            events = await sequencer.admit(batch)
            if events:
                await handle(events)
                processed.mark_processed(events)

    @app.agent(telemetry, concurrency=1, name="loopwarden.detect")
    async def detect(stream: StreamT) -> None:
        await in_order(stream, processor.process)

    if settings.otlp_topic:
        relay = OtlpRelay(telemetry, settings, processor.dead_letter)
        spans = app.topic(settings.otlp_topic, key_serializer="raw", value_serializer="raw")

        @app.agent(spans, concurrency=1, name="loopwarden.otlp")
        async def relay_tool_spans(stream: StreamT) -> None:
            await in_order(stream, relay.relay)

    return app


class BatchProcessor:
    """Applies one batch of telemetry messages; see the module docstring for the order of things."""

    def __init__(self, app: faust.App, telemetry: faust.TopicT, runs: faust.Table, detector: Detector,
                 settings: WorkerSettings, metrics: WorkerMetrics, signer: Signer | None,
                 operator_keys: KeyRing | None) -> None:
        self.app = app
        self.signer = signer
        self.operator_keys = operator_keys
        self.telemetry = telemetry
        self.store = RunStore(app, runs, settings.changelog_topic)
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
        #: A batch and a sweep both read, then write stored runs, awaiting in between: one at a time.
        self._state_lock = asyncio.Lock()

    async def process(self, batch: Sequence[EventT]) -> None:
        async with self._state_lock:
            await self._process(batch)

    async def _process(self, batch: Sequence[EventT]) -> None:
        self.metrics.batch_size.observe(len(batch))
        by_run: dict[tuple[int, bytes], list[tuple[int, TelemetryEvent | OperatorCommand]]] = {}
        last_of_partition: dict[int, EventT] = {}
        for event in batch:
            message = event.message
            last_of_partition[message.partition] = event
            if message.headers and header(message.headers, KIND_HEADER) == OPERATOR_KIND:
                item: TelemetryEvent | OperatorCommand | None = await self._operator_command(event)
            else:
                item = await self._decode(event)
            if item is None:
                continue
            key = item.run_id.encode()
            if message.key != key:
                self.metrics.rekeyed.inc()
                await self.telemetry.send(key=key, value=event.value, headers=list(message.headers or ()))
                continue
            by_run.setdefault((message.partition, key), []).append((message.offset, item))
            watermarks = self._watermark_ms
            if item.ts_ms > watermarks.get(message.partition, 0):
                watermarks[message.partition] = item.ts_ms

        decisions: list[Decision] = []
        changes: dict[int, list[Change]] = {}
        for (partition, key), items in by_run.items():
            stored = decode_run(self.store.get(partition, key))
            applied = False
            for offset, item in items:
                if offset <= stored.offset:
                    self.metrics.duplicates.inc()
                    continue
                if isinstance(item, OperatorCommand):
                    evaluation = self.detector.operate(stored.state, item)
                else:
                    evaluation = self.detector.evaluate(stored.state, item)
                    if not evaluation.duplicate:
                        self._events_by_outcome[item.outcome].inc()
                stored.offset = offset
                applied = True
                if evaluation.duplicate:
                    self.metrics.duplicates.inc()
                decisions.extend(evaluation.decisions)
            if applied:
                changes.setdefault(partition, []).append((key, encode_run(stored)))

        if decisions:
            await self._publish(decisions)
        await self.store.write(changes)
        for event in last_of_partition.values():
            self._report_lag(event)

    async def sweep(self) -> None:
        """Expire silent runs in every assigned partition (called on a timer, off the per-batch path):
        a few stored runs per partition per sweep, resuming where the last sweep stopped."""
        async with self._state_lock:
            await self._sweep()

    async def _sweep(self) -> None:
        topic = self.telemetry.get_topic_name()
        assigned = {tp.partition for tp in self.app.consumer.assignment() if tp.topic == topic}
        expired: dict[int, list[Change]] = {}
        for partition in assigned & self._watermark_ms.keys():
            horizon = self._watermark_ms[partition] - self._run_ttl_ms
            found, self._sweep_from[partition] = self.store.scan(
                partition, self._sweep_from.get(partition, b""), self.settings.evict_scan_per_sweep)
            stale = [(key, None) for key, value in found if orjson.loads(value)["last_ts_ms"] < horizon]
            if stale:
                expired[partition] = stale
        if expired:
            await self.store.write(expired)
            self.metrics.evictions.inc(sum(map(len, expired.values())))
        self.metrics.runs_tracked.set(self.store.estimated_keys())

    async def _decode(self, event: EventT) -> TelemetryEvent | None:
        """The telemetry event, or None after dead-lettering a bad message."""
        raw = event.value
        try:
            if not isinstance(raw, bytes | bytearray):
                raise InvalidEvent("", "message has no value")
            return parse_event(raw, self.settings.max_event_bytes)
        except InvalidEvent as exc:
            await self.dead_letter(event, exc)
            return None

    async def _operator_command(self, event: EventT) -> OperatorCommand | None:
        """The operator command, or None after dead-lettering one that is unsigned, signed by an unknown
        key, tampered with, malformed or too old (a replay)."""
        raw = event.value
        try:
            if not isinstance(raw, bytes | bytearray):
                raise InvalidEvent("", "message has no value")
            if self.operator_keys is None:
                raise InvalidEvent("signature", "operator commands are disabled: LOOPWARDEN_OPERATOR_KEYS is empty")
            try:
                key_id = self.operator_keys.verify(bytes(raw), event.message.headers)
            except SignatureRejected as exc:
                raise InvalidEvent("signature", f"operator command refused ({exc.reason}): {exc}") from exc
            command = decode_operator_command(bytes(raw), key_id)
            age_s = time.time() - command.ts_ms / 1000
            if age_s > self.settings.operator_max_age_s:
                raise InvalidEvent("ts_ms", f"operator command is {age_s:.0f} s old, over "
                                            "LOOPWARDEN_OPERATOR_MAX_AGE_S: refused as a replay")
            return command
        except InvalidEvent as exc:
            await self.dead_letter(event, exc)
            return None

    async def dead_letter(self, event: EventT, error: InvalidEvent) -> None:
        """Send a rejected message to the DLQ with the reason in its headers, and count it."""
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
        value = bytes(event.value) if isinstance(event.value, bytes | bytearray) else b""
        if len(value) > DLQ_VALUE_LIMIT:  # a multi-megabyte payload must not fail the DLQ send too
            headers.append(("value_bytes", str(len(value)).encode()))
            value = value[:DLQ_VALUE_LIMIT]
        await self.dlq.send(key=message.key, value=value, headers=headers)

    async def _publish(self, decisions: list[Decision]) -> None:
        """Send decisions and wait until the broker has them all."""
        pending = []
        source = self.settings.event_source
        for decision in decisions:
            key, value, headers = encode_control(decision, source)
            if self.signer is not None:
                headers.extend(self.signer.headers(value))
            pending.append(await self.control.send(key=key, value=value, headers=headers))
            if decision.action == "halt" or decision.verdict in ("operator_halt", "operator_resume"):
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


class OtlpRelay:
    """OTLP trace records in (``LOOPWARDEN_OTLP_TOPIC``), native telemetry out: see the module docstring.

    A record that is not OTLP goes to the DLQ. A record with some invalid tool spans has its valid ones
    relayed and is then dead-lettered once, with the first reason (redriving it re-relays the valid
    spans, which the detector counts once by event id).
    """

    def __init__(self, telemetry: faust.TopicT, settings: WorkerSettings,
                 dead_letter: Callable[[EventT, InvalidEvent], Awaitable[None]]) -> None:
        try:
            from ..otlp import tool_calls_of
        except ImportError as exc:
            raise SettingsError("LOOPWARDEN_OTLP_TOPIC is set but the OTLP decoder is not installed. Operator "
                                "action: pip install 'loopwarden[worker]' (it includes opentelemetry-proto)") from exc
        self._tool_calls_of = tool_calls_of
        self.telemetry = telemetry
        self.settings = settings
        self.dead_letter = dead_letter

    async def relay(self, batch: Sequence[EventT]) -> None:
        """Publish every tool span of the batch as telemetry and wait for the broker's acknowledgements
        (the agent acknowledges the batch, so its offsets get committed, only after this returns)."""
        settings = self.settings
        pending = []
        for event in batch:
            raw = event.value
            try:
                if not isinstance(raw, bytes | bytearray):
                    raise InvalidEvent("", "message has no value")
                calls, errors = self._tool_calls_of(bytes(raw), settings.otlp_encoding, settings.otlp_run_id,
                                                    settings.max_event_bytes)
            except InvalidEvent as exc:
                await self.dead_letter(event, exc)
                continue
            for call in calls:
                key, value = encode_telemetry(call.telemetry())
                pending.append(await self.telemetry.send(key=key, value=value))
            if errors:
                first = errors[0]
                more = f" (and {len(errors) - 1} more tool spans)" if len(errors) > 1 else ""
                await self.dead_letter(event, InvalidEvent(first.field, f"tool span rejected: {first.reason}{more}"))
        await asyncio.gather(*pending)
