"""The local broker from scripts/kafka_local: round trip, restart on the same port, fast failures, and its
synchronous admin calls inside and outside an event loop, on plain and secured brokers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from scripts.kafka_local import (
    REPO,
    BrokerSecurity,
    BrokerStartError,
    BrokerUnreachable,
    ClusterInfo,
    KafkaLocalError,
    TopicSpec,
    create_topics,
    describe_cluster,
    make_tls_files,
    run_sync,
)
from scripts.kafka_local import broker as broker_module

pytestmark = pytest.mark.integration


async def _produce(bootstrap: str, topic: str, key: bytes, value: bytes) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()


async def _consume_one(bootstrap: str, topic: str) -> tuple[bytes | None, bytes | None]:
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"test-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        record = await asyncio.wait_for(consumer.getone(), timeout=30)
    finally:
        await consumer.stop()
    return record.key, record.value


def test_produce_and_consume_round_trip(kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    topic = topic_factory(partitions=3)
    asyncio.run(_produce(kafka_bootstrap, topic, b"run-1", b"hello loopwarden"))
    assert asyncio.run(_consume_one(kafka_bootstrap, topic)) == (b"run-1", b"hello loopwarden")


def test_topic_factory_is_idempotent_and_checks_partitions(kafka_bootstrap: str) -> None:
    name = f"idem-{uuid.uuid4().hex[:8]}"
    create_topics(kafka_bootstrap, [TopicSpec(name, 2, compact=True)])
    create_topics(kafka_bootstrap, [TopicSpec(name, 2, compact=True)])
    with pytest.raises(KafkaLocalError, match="exists with 2 partitions, wanted 4"):
        create_topics(kafka_bootstrap, [TopicSpec(name, 4)])


def test_restart_after_kill_keeps_port_and_data(kafka_broker_factory: Callable[..., Any]) -> None:
    broker = kafka_broker_factory().start()
    broker.create_topics([("restart", 1)])
    asyncio.run(_produce(broker.bootstrap, "restart", b"k", b"survives a SIGKILL"))
    bootstrap = broker.bootstrap

    broker.kill()
    assert not broker.running()
    broker.start()

    assert broker.bootstrap == bootstrap
    assert asyncio.run(_consume_one(broker.bootstrap, "restart")) == (b"k", b"survives a SIGKILL")


def test_occupied_port_fails_fast_with_the_broker_log(kafka_broker_factory: Callable[..., Any]) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        broker = kafka_broker_factory(port=squatter.getsockname()[1], start_timeout=60)
        began = time.monotonic()
        with pytest.raises(BrokerStartError) as failure:
            broker.start()
    message = str(failure.value)
    assert time.monotonic() - began < 30
    assert "exited with code" in message
    assert "lines of" in message and "broker.log" in message
    assert "Address already in use" in message
    assert not broker.running()


def test_bogus_property_fails_fast_with_the_tool_output(kafka_broker_factory: Callable[..., Any]) -> None:
    broker = kafka_broker_factory(extra_properties={"num.network.threads": "lots"}, start_timeout=60)
    began = time.monotonic()
    with pytest.raises(BrokerStartError, match=r"num\.network\.threads"):
        broker.start()
    assert time.monotonic() - began < 30
    assert not broker.running()


async def _partitions(bootstrap: str, topic: str, **client: Any) -> int:
    """How many partitions ``topic`` has, asked by an aiokafka admin client on the running loop."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **client)
    await admin.start()
    try:
        [described] = await admin.describe_topics([topic])
    finally:
        await admin.close()
    assert described["error_code"] == 0, described
    return len(described["partitions"])


def test_run_sync_without_a_loop_runs_in_the_calling_thread() -> None:
    async def where() -> int:
        return threading.get_ident()

    assert run_sync(where) == threading.get_ident()


async def test_run_sync_inside_a_loop_uses_a_private_loop_in_another_thread() -> None:
    """The caller's loop cannot run the coroutine while the caller blocks on it: a worker thread runs it
    on its own loop, which is closed after; errors come back as they were raised."""

    async def where() -> tuple[int, asyncio.AbstractEventLoop]:
        await asyncio.sleep(0.01)
        return threading.get_ident(), asyncio.get_running_loop()

    async def fail() -> None:
        raise KafkaLocalError("raised on the private loop")

    thread, loop = run_sync(where)
    assert thread != threading.get_ident()
    assert loop is not asyncio.get_running_loop() and loop.is_closed()
    with pytest.raises(KafkaLocalError, match="raised on the private loop"):
        run_sync(fail)
    await asyncio.sleep(0)  # and this loop carries on


async def test_create_topics_inside_a_running_event_loop(kafka_bootstrap: str) -> None:
    """An ``async def`` test (any coroutine) may call the synchronous API, e.g. through ``topic_factory``."""
    name = f"in-loop-{uuid.uuid4().hex[:8]}"
    create_topics(kafka_bootstrap, [TopicSpec(name, 3)])
    assert await _partitions(kafka_bootstrap, name) == 3
    create_topics(kafka_bootstrap, [TopicSpec(name, 3)])
    with pytest.raises(KafkaLocalError, match="exists with 3 partitions, wanted 1"):
        create_topics(kafka_bootstrap, [TopicSpec(name, 1)])
    assert describe_cluster(kafka_bootstrap).brokers


def test_create_topics_outside_an_event_loop(kafka_bootstrap: str) -> None:
    name = f"no-loop-{uuid.uuid4().hex[:8]}"
    create_topics(kafka_bootstrap, [TopicSpec(name, 2, compact=True)])
    assert asyncio.run(_partitions(kafka_bootstrap, name)) == 2


def test_an_existing_topic_is_fine_with_its_partition_count(kafka_bootstrap: str) -> None:
    """As with the hand-written client before aiokafka's: a topic that exists with the requested partition
    count is accepted whatever its configs, and the rest of the batch is created; a different partition
    count is an error, raised after the rest of the batch was created."""
    existing, added, also_added = (f"exists-{uuid.uuid4().hex[:8]}" for _ in range(3))
    create_topics(kafka_bootstrap, [TopicSpec(existing, 2)])
    create_topics(kafka_bootstrap, [TopicSpec(existing, 2, compact=True), TopicSpec(added, 1)])
    assert asyncio.run(_partitions(kafka_bootstrap, added)) == 1
    with pytest.raises(KafkaLocalError, match=f"topic '{existing}' exists with 2 partitions, wanted 4"):
        create_topics(kafka_bootstrap, [TopicSpec(existing, 4), TopicSpec(also_added, 3)])
    assert asyncio.run(_partitions(kafka_bootstrap, also_added)) == 3


def test_create_topics_on_no_broker_says_so() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(BrokerUnreachable, match=f"cannot reach a broker at 127.0.0.1:{port}"):
        create_topics(f"127.0.0.1:{port}", [TopicSpec("nowhere", 1)], timeout=5)


def test_a_secured_broker_is_ready_for_its_admin(kafka_broker_factory: Callable[..., Any], tmp_path: Path) -> None:
    """``start()`` returns once the admin, over SASL_SSL with a client certificate, sees the cluster; the
    admin may log in with PLAIN or SCRAM-SHA-512; a wrong password is refused at once, not retried."""
    security = BrokerSecurity(make_tls_files(tmp_path / "tls"), {"runtime-a": "runtime-pw"}, client_auth="required")
    broker = kafka_broker_factory(security=security).start()
    cluster_id = json.loads((broker.data_dir / "node.json").read_text())["cluster_id"]
    assert describe_cluster(broker.bootstrap, login=broker.login) == ClusterInfo(cluster_id, [1])

    scram = security.admin_login("SCRAM-SHA-512")
    create_topics(broker.bootstrap, [TopicSpec("secured", 2)], login=scram)
    assert asyncio.run(_partitions(broker.bootstrap, "secured", **scram.client_options())) == 2

    for mechanism in ("PLAIN", "SCRAM-SHA-512"):
        wrong = dataclasses.replace(broker.login, mechanism=mechanism, password="not-the-password")
        began = time.monotonic()
        with pytest.raises(KafkaLocalError, match=f"SASL {mechanism} login as 'admin' refused") as refused:
            describe_cluster(broker.bootstrap, login=wrong)
        assert not isinstance(refused.value, BrokerUnreachable)
        assert time.monotonic() - began < 10


def test_a_certificate_for_another_name_fails_the_start_fast(kafka_broker_factory: Callable[..., Any],
                                                              tmp_path: Path) -> None:
    """The admin client checks the broker's certificate and host name (127.0.0.1); a certificate that
    names only ``localhost`` will not change while we wait, so ``start()`` gives up at once, with the
    reason and the broker's log."""
    security = BrokerSecurity(make_tls_files(tmp_path / "tls", hosts=["localhost"]), acls=False)
    broker = kafka_broker_factory(security=security, start_timeout=60)
    began = time.monotonic()
    with pytest.raises(BrokerStartError, match="TLS refused the broker's certificate: IP address mismatch") as failure:
        broker.start()
    assert time.monotonic() - began < 30
    assert "broker.log" in str(failure.value)
    assert not broker.running()


def test_cli_start_status_create_topics_stop(tmp_path: Path) -> None:
    """``python -m scripts.kafka_local``: ``start`` prints the variable to export, the other commands find
    the broker through the state file."""
    env = {key: value for key, value in os.environ.items() if key != "KAFKA_BOOTSTRAP_SERVERS"}
    state = ["--state-file", str(tmp_path / "state.json")]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "scripts.kafka_local", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120, check=False)

    started = cli("start", *state, "--data-dir", str(tmp_path / "broker"))
    try:
        assert started.returncode == 0, started.stderr
        [line] = started.stdout.splitlines()
        name, _, bootstrap = line.partition("=")
        assert name == "KAFKA_BOOTSTRAP_SERVERS" and bootstrap.startswith("127.0.0.1:")
        status = cli("status", *state)
        assert status.returncode == 0 and f"KAFKA_BOOTSTRAP_SERVERS={bootstrap}" in status.stdout
        assert cli("create-topics", *state, "events:3", "state:3:compact").returncode == 0
        assert asyncio.run(_partitions(bootstrap, "state")) == 3
        refused = cli("create-topics", *state, "events:5")
        assert refused.returncode == 1
        assert refused.stderr.strip() == "kafka_local: error: topic 'events' exists with 3 partitions, wanted 5"
    finally:
        stopped = cli("stop", *state)
    assert stopped.returncode == 0 and "stopped the broker" in stopped.stderr
    assert cli("status", *state).returncode == 1


def test_the_controller_port_is_never_the_client_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """The system may hand a port it just handed out again: the broker's two listeners on one port refuse to
    start (it happened in CI, every test of one pytest process failing at setup), so the second pick
    differs from the first."""
    handed = iter([41001, 41001, 41002])

    class _Socket:
        def __init__(self, *args: object) -> None:
            self.port = next(handed)

        def __enter__(self) -> _Socket:
            return self

        def __exit__(self, *args: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(broker_module.socket, "socket", _Socket)
    assert broker_module.free_port() == 41001
    assert broker_module.free_port(other_than=41001) == 41002
