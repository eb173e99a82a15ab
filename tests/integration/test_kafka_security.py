"""Kafka security on a real secured broker: who may write and read what, refused logins, host name
checks, and a runaway halted while every client is authenticated.

``secure_kafka`` (tests/conftest.py) is a SASL_SSL broker that requires client certificates and
enforces ACLs. Here one deployment's topics are created by the admin and loopwarden's ACLs granted for
them: ``LoopwardenAcls``, the same commands docs/security.md gives for a shared cluster. Then a real
worker runs as ``worker``, the SDK as ``runtime-a`` and the notifier as ``notify``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shlex
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError, for_code
from aiokafka.structs import TopicPartition

from scripts.kafka_local import BrokerSecurity, LoopwardenAcls, TopicSpec, make_tls_files
from stream_app.bus.clock import wall_clock_ms
from stream_app.bus.wire import encode_control, encode_telemetry
from stream_app.client import Guard, KafkaClientConfig, RunHalted
from stream_app.commands.notify import Notifier, NotifySettings
from stream_app.core import Decision, decision_id

from ..conftest import SecureKafka
from .workers import REPO, Fleet

pytestmark = pytest.mark.integration

PARTITIONS = 2
TIMEOUT_S = 20.0


def halt_of(run_id: str) -> Decision:
    """A halt as a worker would publish it (what a rogue runtime would forge)."""
    return Decision(run_id=run_id, action="halt", verdict="recursion", trigger_event_id="ev-4",
                    decision_id=decision_id(run_id, "ev-4", "halt", "recursion"), ts_ms=wall_clock_ms(),
                    reason="forged", evidence={"tool": "search_docs", "count": 4})


def telemetry_of(run_id: str) -> tuple[bytes, bytes]:
    return encode_telemetry({"run_id": run_id, "event_id": f"{run_id}-1", "tool": "probe", "ts_ms": wall_clock_ms(),
                             "outcome": "success", "args": {}, "result": "ok"})


@pytest.fixture(scope="module")
def deployment(secure_kafka: SecureKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, LoopwardenAcls]]:
    """One deployment on the secured broker: its topics created by the admin (each with one record, so
    that a read proves data flows), loopwarden's ACLs granted, the worker not started yet."""
    fleet = Fleet(secure_kafka.bootstrap, tmp_path_factory.mktemp("secure-fleet"), partitions=PARTITIONS,
                  env=secure_kafka.env("worker"), settings={"fleet_rules": True})  # every topic needs its ACL
    acls = LoopwardenAcls(worker="worker", runtimes=["runtime-a"], notify=["notify"], operators=["operator"],
                          app_id=fleet.name, telemetry_topic=fleet.telemetry_topic, control_topic=fleet.control_topic,
                          alerts_topic=fleet.alerts_topic, dlq_topic=fleet.dlq_topic,
                          facts_topic=fleet.facts_topic, scopes_topic=fleet.scopes_topic)
    secure_kafka.broker.create_topics(acls.topic_specs(PARTITIONS))
    secure_kafka.broker.add_acls(acls.commands())
    seed = halt_of("run-seed")
    key, value, headers = encode_control(seed, "/loopwarden/test")
    asyncio.run(write(secure_kafka.config("admin"), [
        (fleet.telemetry_topic, *telemetry_of("run-seed"), []),
        (fleet.control_topic, key, value, headers),
        (fleet.alerts_topic, key, value, headers),
        (fleet.dlq_topic, b"run-seed", b"{not json", []),
    ]))
    try:
        yield fleet, acls
    finally:
        fleet.stop()


async def write(config: KafkaClientConfig, records: list[tuple[str, bytes, bytes, list[tuple[str, bytes]]]]) -> None:
    """Produce ``(topic, key, value, headers)`` to partition 0, waiting for each acknowledgement."""
    producer = AIOKafkaProducer(**config.aiokafka_kwargs(), acks="all")
    await producer.start()
    try:
        for topic, key, value, headers in records:
            await producer.send_and_wait(topic, value, key=key, headers=headers, partition=0)
    finally:
        await producer.stop()


async def read_one(config: KafkaClientConfig, topic: str) -> None:
    """Read the first record of partition 0, without a consumer group (as runtimes read control).

    A principal that may not even describe the topic gets no error from aiokafka's consumer (it logs
    the metadata error and waits), so the broker's answer to describing the topic is checked first.
    """
    admin = AIOKafkaAdminClient(**config.aiokafka_kwargs())
    await admin.start()
    try:
        [described] = await admin.describe_topics([topic])
    finally:
        await admin.close()
    if described["error_code"]:
        raise for_code(described["error_code"])(topic)
    consumer = AIOKafkaConsumer(**config.aiokafka_kwargs(), group_id=None, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        await consumer.seek_to_beginning()
        async with asyncio.timeout(TIMEOUT_S):
            while not await consumer.getmany(timeout_ms=200):
                pass
    finally:
        await consumer.stop()


@pytest.mark.parametrize(
    ("user", "action", "topic", "allowed"),
    [
        # Runtimes publish telemetry and obey control ...
        ("runtime-a", "write", "telemetry", True),
        ("runtime-a", "read", "control", True),
        # ... but cannot raise alerts, nor read other runs' telemetry.
        ("runtime-a", "write", "alerts", False),
        ("runtime-a", "read", "telemetry", False),
        # The notifier reads alerts, and cannot stop agents.
        ("notify", "read", "alerts", True),
        ("notify", "write", "control", False),
        # Operators send (signed) overrides through telemetry and read the outputs; control is the worker's.
        ("operator", "write", "telemetry", True),
        ("operator", "read", "dlq", True),
        ("operator", "read", "control", True),
        ("operator", "write", "control", False),
        ("operator", "read", "telemetry", False),
        # An authenticated user without ACLs can do nothing.
        ("stranger", "write", "telemetry", False),
        ("stranger", "read", "control", False),
    ],
)
def test_each_principal_reaches_only_its_topics(deployment: tuple[Fleet, LoopwardenAcls], secure_kafka: SecureKafka,
                                                 user: str, action: str, topic: str, allowed: bool) -> None:
    """With loopwarden's ACLs, each principal may do exactly what its role needs; the broker refuses the
    rest with a topic authorization error."""
    fleet, _ = deployment
    name = getattr(fleet, f"{topic}_topic")
    config = secure_kafka.config(user)
    if action == "write":
        key, value, headers = encode_control(halt_of("run-probe"), "/loopwarden/test")
        if topic == "telemetry":
            (key, value), headers = telemetry_of("run-probe"), []
        probe = write(config, [(name, key, value, headers)])
    else:
        probe = read_one(config, name)
    if allowed:
        asyncio.run(probe)
    else:
        with pytest.raises(TopicAuthorizationFailedError):
            asyncio.run(probe)


def test_a_runtime_cannot_write_a_halt(deployment: tuple[Fleet, LoopwardenAcls], secure_kafka: SecureKafka) -> None:
    """A runtime's credentials cannot stop other agents: its halt (from an idempotent producer, as the
    SDK's) is refused by the broker and never reaches the control topic."""
    fleet, _ = deployment

    async def forge() -> None:
        producer = AIOKafkaProducer(**secure_kafka.config("runtime-a").aiokafka_kwargs(), acks="all",
                                    enable_idempotence=True)
        await producer.start()
        try:
            key, value, headers = encode_control(halt_of("run-victim"), "/loopwarden/forged")
            await producer.send_and_wait(fleet.control_topic, value, key=key, headers=headers)
        finally:
            await producer.stop()

    async def control_end_offsets() -> dict[TopicPartition, int]:
        consumer = AIOKafkaConsumer(**secure_kafka.config("admin").aiokafka_kwargs(), group_id=None)
        await consumer.start()
        try:
            return await consumer.end_offsets([TopicPartition(fleet.control_topic, p) for p in range(PARTITIONS)])
        finally:
            await consumer.stop()

    before = asyncio.run(control_end_offsets())
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(forge())
    assert asyncio.run(control_end_offsets()) == before


@pytest.mark.parametrize(
    ("mechanism", "user", "password", "client_cert", "logged"),
    [
        ("SCRAM-SHA-512", "runtime-a", "not-the-password", True, "Authentication failed"),
        ("PLAIN", "runtime-a", "not-the-password", True, "Authentication failed"),
        ("SCRAM-SHA-512", "nobody", "whatever", True, "Authentication failed"),
        # The right password, but no client certificate: mutual TLS refuses the connection first.
        ("SCRAM-SHA-512", "runtime-a", None, False, "Unable connect to"),
    ],
)
def test_bad_credentials_are_refused(deployment: tuple[Fleet, LoopwardenAcls], secure_kafka: SecureKafka,
                                     caplog: pytest.LogCaptureFixture, mechanism: str, user: str,
                                     password: str | None, client_cert: bool, logged: str) -> None:
    """A guard started with a wrong password, an unknown user or no client certificate fails at start,
    promptly, with the broker's reason in the client's log."""
    fleet, _ = deployment
    env = secure_kafka.env("runtime-a", mechanism, password=password, client_cert=client_cert)
    config = KafkaClientConfig.from_env({**env, "KAFKA_SASL_USERNAME": user})

    async def start() -> None:
        async with Guard.fleet(config, fleet.telemetry_topic, fleet.control_topic, trusted_keys=fleet.trusted_keys()):
            pass

    began = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="aiokafka"), pytest.raises(KafkaConnectionError):
        asyncio.run(start())
    assert time.monotonic() - began < 10
    assert logged in caplog.text


def test_host_name_checks_refuse_a_certificate_for_another_name(kafka_broker_factory: Callable[..., Any],
                                                                tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A broker whose certificate names only 127.0.0.1, reached as ``localhost``: with host name checks
    on (the default) the client refuses it at once; with them off, the same CA lets it through, so the
    name was the only fault."""
    security = BrokerSecurity(make_tls_files(tmp_path / "tls", hosts=["127.0.0.1"]), {"runtime-a": "runtime-pw"},
                              acls=False)
    broker = kafka_broker_factory(security=security).start()
    broker.create_topics([TopicSpec("telemetry", 1)])
    env = {"KAFKA_BOOTSTRAP_SERVERS": f"localhost:{broker.port}", "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
           "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "KAFKA_SASL_USERNAME": "runtime-a",
           "KAFKA_SASL_PASSWORD": "runtime-pw", "KAFKA_SSL_CAFILE": str(security.tls.ca)}
    record = [("telemetry", *telemetry_of("run-1"), [])]

    began = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="aiokafka"), pytest.raises(KafkaConnectionError):
        asyncio.run(write(KafkaClientConfig.from_env(env), record))
    assert time.monotonic() - began < 10
    assert re.search(r"certificate verify failed: Hostname mismatch", caplog.text)

    asyncio.run(write(KafkaClientConfig.from_env({**env, "KAFKA_SSL_CHECK_HOSTNAME": "false"}), record))


def test_a_runaway_is_halted_with_every_client_authenticated(deployment: tuple[Fleet, LoopwardenAcls],
                                                              secure_kafka: SecureKafka) -> None:
    """Over SASL_SSL with client certificates and ACLs: the worker (SCRAM-SHA-512, as ``worker``) halts a
    runaway the SDK (PLAIN, as ``runtime-a``) publishes, the guard refuses the next call, and the
    notifier (as ``notify``, in its group) posts the halt from the alerts topic."""
    fleet, acls = deployment
    fleet.start_worker()
    executed = 0

    async def search_docs(query: str) -> None:
        nonlocal executed
        executed += 1
        raise RuntimeError("index unavailable")  # not transient: a loop, no pause

    async def runaway() -> tuple[RunHalted, int]:
        config = secure_kafka.config("runtime-a", "PLAIN")
        async with Guard.fleet(config, fleet.telemetry_topic, fleet.control_topic,
                               trusted_keys=fleet.trusted_keys()) as guard:
            run = guard.run("run-secure-runaway", agent_id="support-agent")
            for _ in range(100):
                try:
                    await run.call("search_docs", search_docs, {"query": "q3 report"})
                except RuntimeError:
                    await asyncio.sleep(0.05)  # the model's turn
                except RunHalted as halted:
                    refused_at = executed
                    with pytest.raises(RunHalted):
                        await run.call("search_docs", search_docs, {"query": "q3 report"})
                    return halted, refused_at
        raise AssertionError("the runaway was never halted")

    halted, refused_at = asyncio.run(runaway())
    assert (halted.verdict, halted.decision["evidence"]["seq"]) == ("recursion", 3)  # the 4th call
    assert 4 <= refused_at <= 6 and executed == refused_at

    posted: list[dict[str, Any]] = []

    def post(url: str, body: bytes, content_type: str, idempotency_key: str, timeout_s: float) -> int:
        posted.append(orjson.loads(body))
        return 200

    async def notify() -> None:
        settings = NotifySettings.from_env({
            **secure_kafka.env("notify"), "LOOPWARDEN_NOTIFY_URL": "http://127.0.0.1:9/hook",
            "LOOPWARDEN_ALERTS_TOPIC": fleet.alerts_topic, "LOOPWARDEN_NOTIFY_GROUP": acls.notify_group,
            "LOOPWARDEN_NOTIFY_START": "earliest", "LOOPWARDEN_WORKER_KEYS": str(fleet.keys / "worker.pub")})
        notifier = Notifier(settings, post=post)
        task = asyncio.create_task(notifier.run())
        try:
            async with asyncio.timeout(TIMEOUT_S):
                while not any(p["data"]["run_id"] == "run-secure-runaway" for p in posted):
                    await asyncio.sleep(0.05)
        finally:
            notifier.stop()
            await task

    asyncio.run(notify())
    assert [p["data"]["decision_id"] for p in posted if p["data"]["run_id"] == "run-secure-runaway"] == [
        halted.decision["decision_id"]]


def test_the_documented_acls_are_the_tested_ones() -> None:
    """docs/security.md's kafka-acls commands are exactly ``LoopwardenAcls`` for the default names, the
    set this module proves on a real broker."""
    text = (REPO / "docs" / "security.md").read_text()
    documented = [shlex.split(line.replace("\\\n", " "))
                  for line in re.findall(r"^kafka-acls\.sh (?:.*\\\n)*.*$", text, flags=re.MULTILINE)]
    expected = LoopwardenAcls(worker="loopwarden-worker", runtimes=["agent-runtime"], notify=["loopwarden-notify"],
                              operators=["oncall"]).commands()
    assert [command[command.index("--add") + 1:] for command in documented] == expected
