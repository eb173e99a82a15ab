"""``loopwarden worker``: topics, metrics endpoint, then the Faust worker until a signal stops it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Callable
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError
from prometheus_client import start_http_server

from ..bus import logs
from ..bus.kafka import KafkaUnreachable
from ..bus.policy_file import load_policy
from ..bus.signing import KeyRing, Signer
from ..core import LoopwardenError
from . import versions
from .metrics import WorkerMetrics
from .settings import WorkerSettings

log = logging.getLogger(__name__)


class TopicMismatch(LoopwardenError, RuntimeError):
    """An existing topic has the wrong partition count. Operator action: recreate it or change
    LOOPWARDEN_PARTITIONS to match (the state table must have as many partitions as its input)."""


async def ensure_topics(settings: WorkerSettings) -> None:
    """Create the worker's topics if missing (the broker should not auto-create them), and refuse to
    start when the input or changelog topic has a different partition count than the table."""
    specs = {
        settings.telemetry_topic: {},
        settings.control_topic: {},
        settings.alerts_topic: {},
        settings.dlq_topic: {},
        settings.changelog_topic: {"cleanup.policy": "compact"},
    }
    if settings.fleet_rules:  # the facts (an input, co-partitioned with the keyed folds' tables), changelogs
        specs[settings.facts_topic] = {}
        for changelog in settings.fleet_changelog_topics.values():
            specs[changelog] = {"cleanup.policy": "compact"}
        specs[settings.scopes_topic] = {"cleanup.policy": "compact"}
    if settings.otlp_topic:  # the collector's topic; any partition count works (its records are relayed)
        specs[settings.otlp_topic] = {}
    admin = AIOKafkaAdminClient(**settings.kafka.aiokafka_kwargs())
    await admin.start()
    try:
        if settings.create_topics:
            existing = set(await admin.list_topics())
            missing = [
                NewTopic(name, settings.partitions, settings.replication_factor, topic_configs=configs)
                for name, configs in specs.items() if name not in existing
            ]
            if missing:
                with contextlib.suppress(TopicAlreadyExistsError):  # another worker created them first
                    await admin.create_topics(missing)
                log.info("created topics %s", [t.name for t in missing])
        await _wait_for_partitions(admin, settings)
    finally:
        await admin.close()


async def _wait_for_partitions(admin: AIOKafkaAdminClient, settings: WorkerSettings, timeout_s: float = 30.0) -> None:
    """Wait until the input and changelog topics are visible with their partitions (a topic just created
    takes a moment to appear in metadata); refuse a partition count that differs from the table's."""
    topics = [settings.telemetry_topic, settings.changelog_topic]
    if settings.fleet_rules:
        topics += [settings.facts_topic, *settings.fleet_changelog_topics.values()]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        described = await admin.describe_topics(topics)
        missing = [t["topic"] for t in described if t.get("error_code") or not t.get("partitions")]
        if not missing:
            break
        if asyncio.get_running_loop().time() > deadline:
            raise TopicMismatch(f"topic(s) {', '.join(missing)} missing after {timeout_s:.0f} s; create them "
                                "or set LOOPWARDEN_CREATE_TOPICS=true")
        await asyncio.sleep(0.2)
    for topic in described:
        count = len(topic["partitions"])
        if count != settings.partitions:
            raise TopicMismatch(f"topic {topic['topic']} has {count} partitions, LOOPWARDEN_PARTITIONS is "
                                f"{settings.partitions}")


def run_worker(settings: WorkerSettings) -> int:
    """Run one worker in this process until SIGINT/SIGTERM; returns the exit status."""
    from .app import create_app
    from .delivery import FatalStop

    level = settings.log_level.upper()
    logs.configure(level, settings.log_format)
    for notice in settings.notices:
        log.warning(notice)
    untested = versions.check(settings.allow_untested_faust)  # UntestedFramework unless allowed
    if untested:
        log.warning(untested)
    policy = load_policy(settings.policy_path)
    signer = Signer.from_file(settings.signing_key) if settings.signing_key else None
    operator_keys = KeyRing.from_setting(settings.operator_keys) if settings.operator_keys else None
    if signer is None:
        log.warning("LOOPWARDEN_ALLOW_UNSIGNED=true: control messages are unsigned; runtimes that verify "
                    "signatures refuse them, and anyone who can write the control topic can forge them")
    asyncio.run(settings.kafka.check_connection())  # KafkaUnreachable says what to check
    try:
        asyncio.run(ensure_topics(settings))
    except KafkaError as exc:
        raise KafkaUnreachable(f"Kafka at {settings.kafka.bootstrap_servers} refused the topic set-up as "
                               f"{settings.kafka.sasl_username or 'anonymous'}: {exc}; check the ACLs "
                               "(docs/security.md) or create the topics and set LOOPWARDEN_CREATE_TOPICS=false"
                               ) from exc
    metrics = WorkerMetrics()
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr=settings.metrics_host, registry=metrics.registry)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    fatal = FatalStop()
    app = create_app(settings, policy, metrics, signer, operator_keys, fatal)
    try:
        serve(app, level, on_ready=lambda: metrics.ready.set(1))
    except SystemExit as exc:  # mode's worker always leaves this way
        status = exc.code if isinstance(exc.code, int) else 1
    else:
        status = 0
    if fatal.reason is not None:
        logs.fatal("worker", f"stopped: {fatal.reason}", settings.log_format)
        return 3
    return status


def serve(app: Any, level: str, on_ready: Callable[[], None]) -> None:
    """Run ``app`` (a faust.App) in a Faust worker until a signal stops it; ``on_ready`` once state is
    recovered and partitions are assigned (tests and probes wait for that)."""
    import faust

    class Worker(faust.Worker):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # No terminal spinner: it writes escape codes among the log lines, and its log handler lowers
            # the root logger to DEBUG, so every debug call in faust and aiokafka would build a record.
            self.spinner = None

        async def on_startup_finished(self) -> None:
            await super().on_startup_finished()
            freeze_startup_objects()
            on_ready()

    # override_logging=False: logging stays as run_worker configured it (one format for every line);
    # mode would install its own handlers on stdout.
    Worker(app, loglevel=level, quiet=True, redirect_stdouts=False, override_logging=False).execute_from_commandline()


def freeze_startup_objects() -> None:
    """Move what start-up made (modules, classes, functions, faust's services, aiokafka's clients: ~54,000
    objects) out of the garbage collector's reach (``gc.freeze``), once the worker has started.

    Every full collection walks every tracked object, and a batch worker triggers full collections in bursts:
    a batch's records and results live through the young collections, so they are promoted as long-lived,
    and CPython starts a full collection every tenth middle one once those promoted since the last exceed a
    quarter of the long-lived. Measured on the halt bench's worker (2-core machine, 2,000 events/s): full
    collections of 46-90 ms (up to 206 ms at 10,000 events/s), often four within half a second, each stopping
    the event loop (a halt waits for it); with the start-up objects frozen, 0.2-1.3 ms. The collection just before
    frees start-up's garbage; objects made later are collected as usual. A frozen object that later becomes
    garbage only a collection could free (a cycle) stays: at most what start-up made, once."""
    gc.collect()
    gc.freeze()
