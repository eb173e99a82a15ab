"""The Faust app's wiring: configuration, topics (made once), the runs table, the agents and the timer.

Telemetry in, decisions out, per-run state in a RocksDB table with a changelog. Where each part lives:

- ``batch``: the batch algorithm, a pure function (decode, dead letters, re-keys, the detector fold
  with the per-run offset guard, new stored records);
- ``effects``: the I/O around it (stored runs in; DLQ, re-keys, signed decisions awaited *before* the
  state write; the expiry sweep);
- ``delivery``: input records in batches straight from faust's consumer (past its per-message path),
  each processed once, in offset order, before its offset is committed;
- ``store``: the table's RocksDB partitions and changelog, written a batch at a time;
- ``relay``: foreign sources (``LOOPWARDEN_OTLP_TOPIC``) re-published as telemetry keyed by run id;
- ``fleet``: the rules across runs (sub-agent trees, threads, tool storms): the batch's facts re-keyed by scope key,
  folded by an agent of their own into the trees and threads tables (``LOOPWARDEN_FLEET_RULES``).

One detection agent (concurrency 1, faust #606) drains the telemetry batches; the OTLP relay, when
configured, is a second. Windows live in the core's event-time state, not in Faust windowed tables
(their expiry uses the wall clock and never fires after recovery).

A stored record this release cannot read (a newer format, or damage) stops the worker with the reason
and the operator action (``delivery.FatalStop``): folding on a state it cannot read would make wrong
decisions.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

import faust
from faust.types import StreamT

from ..bus.signing import KeyRing, Signer
from ..core import Detector, Policy
from ..sources import Decoded
from . import delivery
from .batch import BatchFold, NativeBatchFold
from .effects import DeadLetters, DecisionProducer, Effects, Topics
from .facts import KINDS
from .facts import decoder as facts_decoder
from .fleet import FactsPublisher, FleetEffects
from .metrics import WorkerMetrics
from .relay import SourceRelay
from .settings import SettingsError, WorkerSettings
from .store import RunStore

log = logging.getLogger(__name__)

RUNS_TABLE = "runs"
#: How often each stored run's partition (and the keys of the folds across runs) is checked for expiry (timers,
#: off the per-batch path).
SWEEP_INTERVAL_S = 0.5
#: How often the input partitions' end offsets are read for loopwarden_consumer_lag.
LAG_INTERVAL_S = 0.5


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
        # A batch is what the consumer has buffered, at most this many records per fetch.
        broker_max_poll_records=settings.batch_max,
        producer_acks=-1,
        producer_linger_ms=1,
        # Batches of hundreds of changelog records (~0.8 KB each) per partition: 16 KiB held ~20.
        producer_max_batch_size=256 * 1024,
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
    runs = _table(app, RUNS_TABLE, settings)
    # Trees, threads and tools are few next to runs, and small: together they get a quarter of the RocksDB memory
    # budget.
    fleet_tables = {kind.name: _table(app, kind.name, settings, share=4 * len(KINDS)) for kind in KINDS} \
        if settings.fleet_rules else {}
    fold = batch_fold(settings, Detector(policy), operator_keys)
    metrics.engine.labels(engine="native" if isinstance(fold, NativeBatchFold) else "python").set(1)
    dead_letters = DeadLetters(topics.dlq, metrics)
    decisions = DecisionProducer(settings.kafka)
    facts = FactsPublisher(settings.facts_topic, settings.partitions, decisions) if fleet_tables else None
    effects = Effects(app, topics, RunStore(app, runs, settings.changelog_topic), fold, metrics, dead_letters,
                      signer, settings.event_source, settings.evict_scan_per_sweep, decisions, facts, fatal=fatal)

    @app.task  # type: ignore[untyped-decorator]  # faust's decorator is untyped
    async def start_decision_producer() -> None:
        await decisions.start()

    # faust's App.on_stop stops the consumer (the batch in hand finishes, publishing), then sends this.
    @app.on_before_shutdown.connect  # type: ignore[arg-type]  # faust's signal type wants a signal= keyword
    async def stop_decision_producer(sender: faust.App, **_: object) -> None:
        await decisions.stop()

    # Input records reach the agents in batches straight from the consumer, and offsets are committed only
    # for processed records, in sequence (see delivery's docstring).
    stale = metrics.refetched.labels(reason="stale").inc
    sinks = [delivery.BatchSink(settings.telemetry_topic, settings.batch_max, stale)]
    if settings.otlp_topic:
        sinks.append(delivery.BatchSink(settings.otlp_topic, settings.batch_max, stale))
    if fleet_tables:
        facts_sink = delivery.BatchSink(settings.facts_topic, settings.batch_max, stale)
        sinks.append(facts_sink)
    state_writers: list[Callable[[], Awaitable[None]]] = [effects.flush]  # and the folds across runs' (below)
    delivery.install(app, sinks, metrics.refetched.labels(reason="gap").inc, state_writers)

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]  # faust's signal type wants a signal= keyword
    async def forget_revoked(sender: faust.App, revoked: set[faust.types.TP], **_: object) -> None:
        cast(delivery.BatchConsumer, app.consumer).sequencer.forget(revoked)
        await effects.forget({tp.partition for tp in revoked if tp.topic == settings.telemetry_topic})

    runs.on_recover(effects.recount)  # loopwarden_runs_tracked: exact, for the active partitions

    fleet_effects = None
    if fleet_tables:
        changelogs = settings.fleet_changelog_topics
        fleet_effects = FleetEffects(topics, {name: RunStore(app, table, changelogs[name])
                                              for name, table in fleet_tables.items()},
                                     policy.fleet, metrics, dead_letters, signer, settings.event_source, decisions,
                                     settings.evict_scan_per_sweep, settings.scopes_topic, operator_keys,
                                     int(settings.operator_max_age_s * 1000),
                                     decode=facts_decoder(isinstance(fold, NativeBatchFold)))

        state_writers.append(fleet_effects.flush)

        @app.on_partitions_revoked.connect  # type: ignore[arg-type]  # faust's signal type wants a signal= keyword
        async def forget_revoked_keys(sender: faust.App, revoked: set[faust.types.TP], **_: object) -> None:
            await fleet_effects.forget({tp.partition for tp in revoked if tp.topic == settings.facts_topic})

        def facts_partitions() -> set[int]:
            return {tp.partition for tp in app.consumer.assignment() if tp.topic == settings.facts_topic}

        for name, table in fleet_tables.items():
            async def recount(name: str = name) -> None:
                fleet_effects.recount(name, facts_partitions())

            table.on_recover(recount)

    if settings.evict_scan_per_sweep:

        async def expire_silent_runs() -> None:
            await fatal.run(effects.sweep())

        # one partition per tick: each one every interval when this worker owns them all
        app.timer(SWEEP_INTERVAL_S / settings.partitions)(expire_silent_runs)
        if fleet_effects is not None:
            async def expire_silent_keys() -> None:
                await fatal.run(fleet_effects.sweep(facts_partitions()))

            app.timer(SWEEP_INTERVAL_S)(expire_silent_keys)

    async def report_lag() -> None:
        await effects.report_lag()

    app.timer(LAG_INTERVAL_S)(report_lag)

    def agent(name: str, topic: faust.TopicT, sink: delivery.BatchSink, handle: delivery.Handler) -> None:
        # The agent subscribes its topic (faust's conductor does that for agents' streams); its records
        # never reach the stream: the consumer hands them to the sink.
        async def consume(stream: StreamT[Any]) -> None:
            await delivery.drain(app, sink, fatal, handle, stale)

        app.agent(topic, concurrency=1, name=name)(consume)

    agent("loopwarden.detect", topics.telemetry, sinks[0], effects.process)
    if fleet_effects is not None:
        agent("loopwarden.fleet", raw_topic(app, settings.facts_topic, settings.partitions), facts_sink,
              fleet_effects.process)
    if settings.otlp_topic:
        relay = SourceRelay(topics.telemetry, _otlp_decoder(settings), dead_letters)
        agent("loopwarden.otlp", raw_topic(app, settings.otlp_topic), sinks[1], relay.relay)
    return app


def _table(app: faust.App, name: str, settings: WorkerSettings, share: int = 1) -> Any:
    """A raw-bytes table in RocksDB with its changelog; ``share``: it gets 1/share of the configured
    block cache and write buffer per partition."""
    return app.Table(
        name,
        default=None,
        partitions=settings.partitions,
        key_type=bytes,
        value_type=bytes,
        options={
            "driver": "rocksdict",
            "block_cache_size": _share(settings.rocksdb_block_cache_mb, share) << 20,
            "write_buffer_size": _share(settings.rocksdb_write_buffer_mb, share) << 20,
            "max_open_files": settings.rocksdb_max_open_files,
        },
    )


def _share(mb: int, share: int) -> int:
    return mb if share == 1 else max(1, mb // share)


def batch_fold(settings: WorkerSettings, detector: Detector, operator_keys: KeyRing | None) -> BatchFold:
    """The batch function of ``LOOPWARDEN_ENGINE``: the native engine (``auto``: when installed) or the
    reference; both read and write the same stored records, so workers of a group may differ."""
    options: dict[str, Any] = {
        "operator_keys": operator_keys, "operator_max_age_ms": int(settings.operator_max_age_s * 1000),
        "max_event_bytes": settings.max_event_bytes, "write_version": settings.state_write_version,
        "facts": settings.fleet_rules}
    if settings.state_write_version < 2:
        log.warning("LOOPWARDEN_STATE_WRITE_VERSION=%d: records of format %d cannot hold fingerprint streaks, "
                    "read and write history, spending or per-tool counts, so budgets, max_calls and "
                    "max_model_calls_without_tool cannot fire; raise it to 2 once every worker runs this release",
                    settings.state_write_version, settings.state_write_version)
    if settings.engine != "python":
        try:
            fold = NativeBatchFold(detector, **options)
        except ImportError as exc:
            if settings.engine == "native":
                raise SettingsError("LOOPWARDEN_ENGINE=native but the native engine (loopwarden_native) is not "
                                    "installed. Operator action: pip install ./native (the Docker image has it), "
                                    "or set LOOPWARDEN_ENGINE=python") from exc
            log.warning("the native engine (loopwarden_native) is not installed: telemetry is folded by the "
                        "Python reference (about 1.6x the worker CPU per event, BENCHMARKS.md); pip install ./native")
        else:
            log.info("telemetry is folded by the native engine")
            return fold
    return BatchFold(detector, **options)


def _otlp_decoder(settings: WorkerSettings) -> Callable[[bytes], Decoded]:
    try:
        from ..sources import otlp
    except ImportError as exc:
        raise SettingsError("LOOPWARDEN_OTLP_TOPIC is set but the OTLP decoder is not installed. Operator "
                            "action: pip install 'loopwarden[worker]' (it includes opentelemetry-proto)") from exc
    # Both settings are checked against the source's choices when the settings are read.
    return otlp.decoder(cast(Any, settings.otlp_encoding), cast(Any, settings.otlp_run_id), settings.max_event_bytes)
