"""The local broker from scripts/kafka_local.py: round trip, restart on the same port, fast failures."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

# scripts/ is not a package: tests/integration/conftest.py loads scripts/kafka_local.py under this name.
from kafka_local import BrokerStartError, KafkaLocalError, TopicSpec, create_topics

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
