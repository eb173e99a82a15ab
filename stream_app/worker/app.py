"""The Faust app's wiring: configuration, topics (made once), the runs table, the agents and the timer.

Telemetry in, decisions out, per-run state in a RocksDB table with a changelog. Where each part lives:

- ``batch``: the batch algorithm, a pure function (decode, dead letters, re-keys, the detector fold
  with the per-run offset guard, new stored records);
- ``effects``: the I/O around it (stored runs in; DLQ, re-keys, signed decisions awaited *before* the
  state write; the expiry sweep);
- ``delivery``: every input message processed once, in offset order, before its offset is committed
  (faust's consumer left alone drops and skips messages around rebalances and recoveries);
- ``store``: the table's RocksDB partitions and changelog, written a batch at a time;
- ``relay``: foreign sources (``LOOPWARDEN_OTLP_TOPIC``) re-published as telemetry keyed by run id.

One detection agent (concurrency 1, faust #606) takes telemetry in batches (``take_events`` acks a batch
only after it was processed). Windows live in the core's event-time state, not in Faust windowed tables
(their expiry uses the wall clock and never fires after recovery).

A stored record this release cannot read (a newer format, or damage) stops the worker with the reason
and the operator action (``delivery.FatalStop``): folding on a state it cannot read would make wrong
decisions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, cast

import faust
from faust.types import EventT, StreamT

from ..bus.signing import KeyRing, Signer
from ..core import Detector, Policy
from ..sources import Decoded
from . import delivery
from .batch import BatchFold
from .effects import DeadLetters, Effects, Topics
from .metrics import WorkerMetrics
from .relay import SourceRelay
from .settings import SettingsError, WorkerSettings
from .store import RunStore

log = logging.getLogger(__name__)

RUNS_TABLE = "runs"
#: How often stored runs are checked for expiry (a timer, off the per-batch path).
SWEEP_INTERVAL_S = 0.5


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


def raw_topic(app: faust.App, name: str, partitions: int | None = None) -> faust.TopicT:
    """A topic of raw bytes keys and values (the worker encodes and decodes itself)."""
    return app.topic(name, partitions=partitions, key_serializer="raw", value_serializer="raw")


def telemetry_topic(app: faust.App, settings: WorkerSettings) -> faust.TopicT:
    return raw_topic(app, settings.telemetry_topic, settings.partitions)


def create_app(settings: WorkerSettings, policy: Policy, metrics: WorkerMetrics, signer: Signer | None = None,
               operator_keys: KeyRing | None = None, fatal: delivery.FatalStop | None = None) -> faust.App:
    """A configured Faust app with its topics, the runs table, the agents and the sweep. Decisions are
    signed with ``signer`` (None: unsigned, development only); operator commands are accepted from
    ``operator_keys`` only."""
    fatal = fatal or delivery.FatalStop()
    app = configured_app(settings)
    topics = Topics(
        telemetry=telemetry_topic(app, settings),
        control=raw_topic(app, settings.control_topic),
        alerts=raw_topic(app, settings.alerts_topic),
        dlq=raw_topic(app, settings.dlq_topic),
    )
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
    fold = BatchFold(Detector(policy), operator_keys=operator_keys,
                     operator_max_age_ms=int(settings.operator_max_age_s * 1000),
                     max_event_bytes=settings.max_event_bytes, write_version=settings.state_write_version)
    dead_letters = DeadLetters(topics.dlq, metrics)
    effects = Effects(app, topics, RunStore(app, runs, settings.changelog_topic), fold, metrics, dead_letters,
                      signer, settings.event_source, settings.evict_scan_per_sweep)

    # Offsets are committed only for processed messages, in sequence (see delivery's docstring).
    inputs = [settings.telemetry_topic] + ([settings.otlp_topic] if settings.otlp_topic else [])
    processed = delivery.install(app, inputs, metrics.refetched.labels(reason="skipped").inc)
    sequencer = delivery.Sequencer(app, metrics.refetched.labels(reason="gap").inc)

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]  # faust's signal type wants a signal= keyword
    async def forget_revoked(sender: faust.App, revoked: set[faust.types.TP], **_: object) -> None:
        sequencer.forget(revoked)
        effects.forget({tp.partition for tp in revoked if tp.topic == settings.telemetry_topic})

    runs.on_recover(effects.recount)  # loopwarden_runs_tracked: exact, for the active partitions

    if settings.evict_scan_per_sweep:

        async def expire_silent_runs() -> None:
            await fatal.run(effects.sweep())

        app.timer(SWEEP_INTERVAL_S)(expire_silent_runs)

    def agent(name: str, topic: faust.TopicT,
              handle: Callable[[Sequence[EventT[Any]]], Coroutine[Any, Any, None]]) -> None:
        async def consume(stream: StreamT[Any]) -> None:
            await delivery.in_order(stream, sequencer, processed, fatal, handle, settings.batch_max,
                                    settings.batch_within_s)

        app.agent(topic, concurrency=1, name=name)(consume)

    agent("loopwarden.detect", topics.telemetry, effects.process)
    if settings.otlp_topic:
        relay = SourceRelay(topics.telemetry, _otlp_decoder(settings), dead_letters)
        agent("loopwarden.otlp", raw_topic(app, settings.otlp_topic), relay.relay)
    return app


def _otlp_decoder(settings: WorkerSettings) -> Callable[[bytes], Decoded]:
    try:
        from ..sources import otlp
    except ImportError as exc:
        raise SettingsError("LOOPWARDEN_OTLP_TOPIC is set but the OTLP decoder is not installed. Operator "
                            "action: pip install 'loopwarden[worker]' (it includes opentelemetry-proto)") from exc
    # Both settings are checked against the source's choices when the settings are read.
    return otlp.decoder(cast(Any, settings.otlp_encoding), cast(Any, settings.otlp_run_id), settings.max_event_bytes)
