"""Real worker processes for the integration tests, and helpers to talk to them over the real broker.

Each ``Fleet`` gets its own app id, topic names, state dirs and metrics ports, so tests share one
broker without sharing anything else. Workers run as ``python -m stream_app worker`` subprocesses, the
way an operator runs them, so they can be SIGKILLed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from stream_app.signing import KeyRing, ensure_pairs
from stream_app.wire import encode_telemetry

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class WorkerProcess:
    process: subprocess.Popen[bytes]
    metrics_port: int
    log_path: Path

    def metrics(self) -> dict[str, float]:
        """The worker's metrics as {'name{labels}': value}."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if self.metrics().get("loopwarden_worker_ready") == 1:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"worker not ready after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Fleet:
    """One isolated loopwarden deployment on the shared broker."""

    bootstrap: str
    workdir: Path
    partitions: int = 4
    extra_env: dict[str, str] = field(default_factory=dict)
    name: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:10]}")
    workers: list[WorkerProcess] = field(default_factory=list)

    @property
    def telemetry_topic(self) -> str:
        return f"{self.name}.telemetry"

    @property
    def control_topic(self) -> str:
        return f"{self.name}.control"

    @property
    def alerts_topic(self) -> str:
        return f"{self.name}.alerts"

    @property
    def dlq_topic(self) -> str:
        return f"{self.name}.dlq"

    @property
    def keys(self) -> Path:
        """The deployment's key pairs (worker: signs control messages; operator: signs overrides),
        generated on first use, as `loopwarden keys generate` would."""
        return ensure_pairs(self.workdir / "keys", "worker", "operator")

    def trusted_keys(self) -> KeyRing:
        """What a runtime of this deployment trusts: the workers' public key."""
        return KeyRing.from_paths([self.keys / "worker.pub"])

    def env(self, index: int, metrics_port: int) -> dict[str, str]:
        return {
            **os.environ,
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "LOOPWARDEN_APP_ID": self.name,
            "LOOPWARDEN_TELEMETRY_TOPIC": self.telemetry_topic,
            "LOOPWARDEN_CONTROL_TOPIC": self.control_topic,
            "LOOPWARDEN_ALERTS_TOPIC": self.alerts_topic,
            "LOOPWARDEN_DLQ_TOPIC": self.dlq_topic,
            "LOOPWARDEN_PARTITIONS": str(self.partitions),
            "LOOPWARDEN_STATE_DIR": str(self.workdir / f"state-{index}"),
            "LOOPWARDEN_METRICS_PORT": str(metrics_port),
            "LOOPWARDEN_METRICS_HOST": "127.0.0.1",
            "LOOPWARDEN_COMMIT_INTERVAL_S": "0.5",
            "LOOPWARDEN_SESSION_TIMEOUT_S": "6",
            "LOOPWARDEN_HEARTBEAT_S": "1",
            "LOOPWARDEN_SIGNING_KEY": str(self.keys / "worker.key"),
            "LOOPWARDEN_OPERATOR_KEYS": str(self.keys / "operator.pub"),
            **self.extra_env,
        }

    def start_worker(self, index: int | None = None, wait: bool = True) -> WorkerProcess:
        index = len(self.workers) if index is None else index
        port = free_port()
        log_path = self.workdir / f"worker-{index}-{len(self.workers)}.log"
        log = log_path.open("wb")
        process = subprocess.Popen([sys.executable, "-m", "stream_app", "worker"], cwd=REPO,
                                   env=self.env(index, port), stdout=log, stderr=subprocess.STDOUT)
        worker = WorkerProcess(process, port, log_path)
        self.workers.append(worker)
        if wait:
            worker.wait_ready()
        return worker

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()


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
