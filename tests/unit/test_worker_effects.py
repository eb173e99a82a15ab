"""The runs' effects around the batch function (stream_app/worker/effects.py) without Kafka: the lag gauge
read from end offsets, and the sweep's turns with batches."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

pytest.importorskip("faust")

from aiokafka.errors import KafkaTimeoutError
from faust.types import TP

from stream_app.core import Detector
from stream_app.worker.effects import Effects
from stream_app.worker.metrics import WorkerMetrics

TOPIC = "agent.telemetry"


class _Consumer:
    """What Effects asks faust's consumer: its assignment, the sequencer's next offsets, end offsets."""

    def __init__(self, partitions: set[int]) -> None:
        self.partitions = partitions
        self.next: dict[TP, int] = {}
        self.ends: dict[TP, int] = {}
        self.fail = False
        self.sequencer = SimpleNamespace(expected=self.next.get)

    def assignment(self) -> set[TP]:
        return {TP(TOPIC, p) for p in self.partitions} | {TP("loopwarden-runs-changelog", 0)}

    async def highwaters(self, *tps: TP) -> dict[TP, int]:
        if self.fail:
            raise KafkaTimeoutError()
        return {tp: self.ends[tp] for tp in tps}


class _Store:
    """Stored runs by partition; ``write`` records the order of writes and can be held."""

    def __init__(self) -> None:
        self.data: dict[int, dict[bytes, bytes]] = {}
        self.log: list[str] = []
        self.hold: asyncio.Event | None = None

    def scan(self, partition: int, start: bytes, limit: int) -> tuple[list[tuple[bytes, bytes]], bytes]:
        self.log.append(f"scan {partition}")
        return sorted(self.data.get(partition, {}).items())[:limit], b""

    async def write(self, changes: dict[int, list[tuple[bytes, bytes | None]]]) -> None:
        for partition, items in changes.items():
            self.log.append(f"write {partition}")
            for key, _ in items:
                self.data[partition].pop(key, None)
        if self.hold is not None:
            await self.hold.wait()


def _effects(consumer: _Consumer, store: Any = None) -> tuple[Effects, WorkerMetrics]:
    metrics = WorkerMetrics()
    topics: Any = SimpleNamespace(telemetry=SimpleNamespace(get_topic_name=lambda: TOPIC))
    fold: Any = SimpleNamespace(detector=Detector())
    app: Any = SimpleNamespace(consumer=consumer)
    effects = Effects(app, topics, store, fold, metrics, None, None, "/test", 256, None)  # type: ignore[arg-type]
    return effects, metrics


def _lag(metrics: WorkerMetrics) -> dict[str, float]:
    return {sample.labels["partition"]: sample.value for metric in metrics.consumer_lag.collect()
            for sample in metric.samples}


async def test_the_lag_gauge_is_the_end_offset_minus_the_next_offset_to_process() -> None:
    """Read from end offsets on a timer, not from a fetch's high-water mark (which stops moving while faust
    pauses a partition): a partition with nothing processed yet but records waiting shows them all."""
    consumer = _Consumer({0, 1, 2})
    effects, metrics = _effects(consumer)
    consumer.next.update({TP(TOPIC, 0): 100, TP(TOPIC, 1): 40})  # partition 2: its recovery not ended yet
    consumer.ends.update({TP(TOPIC, 0): 130, TP(TOPIC, 1): 40, TP(TOPIC, 2): 9})
    await effects.report_lag()
    assert _lag(metrics) == {"0": 30, "1": 0}
    consumer.next[TP(TOPIC, 2)] = 0
    consumer.fail = True  # a broker away: the gauge keeps its last values, nothing crashes
    await effects.report_lag()
    assert _lag(metrics) == {"0": 30, "1": 0}
    consumer.fail = False
    await effects.report_lag()
    assert _lag(metrics) == {"0": 30, "1": 0, "2": 9}
    consumer.partitions.discard(0)
    effects.forget({0})  # revoked: its lag is the next owner's to report
    await effects.report_lag()
    assert _lag(metrics) == {"1": 0, "2": 9}


async def test_a_batch_waits_for_one_partitions_sweep_not_the_whole_sweep() -> None:
    consumer = _Consumer({0, 1})
    store = _Store()
    old = orjson.dumps({"v": 1, "last_ts_ms": 0})
    store.data = {0: {b"run-a": old}, 1: {b"run-b": old}}
    effects, _ = _effects(consumer, store)
    effects._watermark_ms = {0: 10**10, 1: 10**10}  # both runs silent for longer than the ttl
    store.hold = asyncio.Event()
    sweep = asyncio.create_task(effects.sweep())
    await asyncio.sleep(0)  # partition 0 swept, its write held

    async def batch() -> None:
        async with effects._state_lock:  # what Effects.process takes
            store.log.append("batch")

    turn = asyncio.create_task(batch())
    store.hold.set()
    await asyncio.gather(sweep, turn)
    assert store.log == ["scan 0", "write 0", "batch", "scan 1", "write 1"]
    assert store.data == {0: {}, 1: {}}
