"""Worker deployments for the integration and chaos tests, and helpers to talk to them over the real
broker.

``Fleet`` is the harness's ``Deployment`` (``stream_app.devtools.harness``: isolated names, topics, state
dirs, keys and metrics ports, workers as ``python -m stream_app worker`` subprocesses that can be
SIGKILLed) with settings that make a killed worker's partitions move within seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from stream_app.bus.wire import encode_telemetry
from stream_app.devtools.harness import Deployment, WorkerProcess, free_ports

__all__ = ["REPO", "TEST_SETTINGS", "Fleet", "WorkerProcess", "consume", "decisions_of", "free_ports", "produce",
           "produce_raw", "run"]

REPO = Path(__file__).resolve().parents[2]

#: Quick failover: commits twice a second, and a dead worker's partitions move after 6 s. The rules
#: across runs cost each worker start about a second (three more topics, a second table to recover), so
#: the tests of other features run without them; the tree tests, the secured-broker test, the chaos suite
#: and the demo run the shipped default (on). Every integration test passed with them on as well.
TEST_SETTINGS: dict[str, object] = {"commit_interval_s": 0.5, "session_timeout_s": 6, "heartbeat_s": 1,
                                    "fleet_rules": False}


@dataclass
class Fleet(Deployment):
    """A deployment with ``TEST_SETTINGS`` under the test's own ``settings``."""

    def __post_init__(self) -> None:
        self.settings = {**TEST_SETTINGS, **self.settings}
        super().__post_init__()


async def produce(bootstrap: str, topic: str, events: Iterable[dict[str, Any]]) -> None:
    """Publish telemetry keyed by run id, the way the SDK does (idempotent, acks=all)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all", linger_ms=5)
    await producer.start()
    try:
        for event in events:
            key, value = encode_telemetry(event)
            await producer.send(topic, key=key, value=value)
        await producer.flush()
    finally:
        await producer.stop()


async def produce_raw(bootstrap: str, topic: str, records: Iterable[tuple[bytes | None, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for key, value in records:
            await producer.send(topic, key=key, value=value)
        await producer.flush()
    finally:
        await producer.stop()


async def consume(bootstrap: str, topic: str, expected: int, timeout: float = 60.0,
                  settle: float = 2.0) -> list[ConsumerRecord[bytes, bytes]]:
    """Read ``topic`` from the start until ``expected`` records arrived (then ``settle`` more seconds,
    to catch unwanted extras) or ``timeout`` passed."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    records: list[ConsumerRecord[bytes, bytes]] = []
    try:
        deadline = time.monotonic() + timeout
        settle_until: float | None = None
        while time.monotonic() < deadline and (settle_until is None or time.monotonic() < settle_until):
            batches = await consumer.getmany(timeout_ms=200)
            for batch in batches.values():
                records.extend(batch)
            if settle_until is None and len(records) >= expected:
                settle_until = time.monotonic() + settle
    finally:
        await consumer.stop()
    return records


def decisions_of(records: Iterable[ConsumerRecord[bytes, bytes]]) -> list[dict[str, Any]]:
    return [orjson.loads(record.value) for record in records]


def run(coro: Any) -> Any:
    return asyncio.run(coro)
