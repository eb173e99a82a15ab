"""The runs' effects around the batch function (stream_app/worker/effects.py) without Kafka: the lag gauge
read from end offsets, the sweep's turns with batches, and the runs' records kept from batch to batch
until a flush (on the real RunStore over RocksDB, see test_worker_store)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

pytest.importorskip("faust")

from aiokafka.errors import KafkaTimeoutError
from aiokafka.structs import ConsumerRecord
from faust.types import TP

from stream_app.core import Detector
from stream_app.core.stored import decode_run
from stream_app.worker import effects as effects_module
from stream_app.worker.batch import BatchFold, NativeBatchFold
from stream_app.worker.delivery import FatalStop, PublishFailed
from stream_app.worker.effects import Effects
from stream_app.worker.metrics import WorkerMetrics

from .test_worker_store import open_store

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
    """Stored runs by partition, nothing kept but the sweep's deletions; what was scanned and kept, in order."""

    def __init__(self) -> None:
        self.data: dict[int, dict[bytes, bytes]] = {}
        self.kept: dict[int, dict[bytes, bytes | None]] = {}
        self.log: list[str] = []

    def drop(self, partitions: set[int]) -> int:
        return 0

    def scan(self, partition: int, start: bytes, limit: int) -> tuple[list[tuple[bytes, bytes]], bytes]:
        self.log.append(f"scan {partition}")
        return sorted(self.data.get(partition, {}).items())[:limit], b""

    def latest(self, partition: int, key: bytes, stored: bytes) -> bytes | None:
        return self.kept.get(partition, {}).get(key, stored)

    def keep(self, changes: dict[int, list[tuple[bytes, bytes | None]]]) -> None:
        for partition, items in changes.items():
            self.log.append(f"keep {partition}")
            self.kept.setdefault(partition, {}).update(items)


def _effects(consumer: _Consumer, store: Any = None) -> tuple[Effects, WorkerMetrics]:
    store = _Store() if store is None else store
    metrics = WorkerMetrics()
    topics: Any = SimpleNamespace(telemetry=SimpleNamespace(get_topic_name=lambda: TOPIC))
    fold: Any = SimpleNamespace(detector=Detector())
    app: Any = SimpleNamespace(consumer=consumer)
    effects = Effects(app, topics, store, fold, metrics, None, None, "/test", 256, None,  # type: ignore[arg-type]
                      fatal=FatalStop(stop=lambda: None))
    effects._sweep_rest_s = 0.0  # a partition's next pass at once (its own test below)
    return effects, metrics


def _lag(metrics: WorkerMetrics) -> dict[str, float]:
    return {sample.labels["partition"]: sample.value for metric in metrics.consumer_lag.collect()
            for sample in metric.samples}


async def test_a_partition_whose_pass_reached_its_last_run_rests_before_the_next() -> None:
    """The next pass of a partition swept to its end waits 5% of run_ttl_ms (at most 30 s, wall clock): the
    turns go to the other partitions meanwhile, and a revoke forgets the rest."""
    consumer = _Consumer({0, 1})
    store = _Store()
    effects, _ = _effects(consumer, store)
    effects._sweep_rest_s = min(effects_module.SWEEP_REST_MAX_S,
                                effects._run_ttl_ms / 1000 * effects_module.SWEEP_REST_SHARE)
    assert effects._sweep_rest_s == 30.0  # the default run_ttl_ms, 1 h: capped
    now = [1000.0]
    effects._monotonic = lambda: now[0]
    effects._watermark_ms = {0: 10**10, 1: 10**10}
    for _ in range(4):
        await effects.sweep()
    assert store.log == ["scan 0", "scan 1"]  # both passes reached their last run at once: resting
    now[0] += 29.9
    await effects.sweep()
    assert store.log == ["scan 0", "scan 1"]
    now[0] += 0.2
    await effects.sweep()
    await effects.sweep()
    assert store.log == ["scan 0", "scan 1", "scan 0", "scan 1"]
    await effects.forget({1})
    consumer.partitions.discard(1)
    assert 1 not in effects._resting_until


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
    await effects.forget({0})  # revoked: its lag is the next owner's to report
    await effects.report_lag()
    assert _lag(metrics) == {"1": 0, "2": 9}


async def test_each_sweep_scans_the_next_partition_in_turn_after_the_batch_in_hand() -> None:
    """One partition per sweep (the timer ticks once per partition per interval): the event loop never runs
    the scans of every partition back to back while batches wait; a revoked partition is skipped."""
    consumer = _Consumer({0, 1, 2})
    store = _Store()
    old = orjson.dumps({"v": 1, "last_ts_ms": 0})
    store.data = {0: {b"run-a": old}, 1: {b"run-b": old}, 2: {b"run-c": old}}
    effects, _ = _effects(consumer, store)
    effects._watermark_ms = {0: 10**10, 1: 10**10, 2: 10**10}  # every run silent for longer than the ttl
    await effects._state_lock.acquire()  # a batch in hand: the sweep waits for it
    sweep = asyncio.create_task(effects.sweep())
    await asyncio.sleep(0)
    store.log.append("batch done")
    effects._state_lock.release()
    await sweep
    assert store.log == ["batch done", "scan 0", "keep 0"]
    await effects.sweep()
    consumer.partitions.discard(2)  # revoked: the turn goes back to partition 0 (its run deleted already)
    await effects.sweep()
    consumer.partitions.add(2)
    await effects.sweep()
    await effects.sweep()
    assert store.log[3:] == ["scan 1", "keep 1", "scan 0", "scan 1", "scan 2", "keep 2"]
    assert store.kept == {0: {b"run-a": None}, 1: {b"run-b": None}, 2: {b"run-c": None}}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Any]:
    """A RunStore on RocksDB, its DBs and its changelog's producer (test_worker_store)."""
    yield from open_store(tmp_path)


class _Decisions:
    """The decisions producer: every send acknowledged at once, or held (``held``) until the test answers
    it; what was sent, in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.hold = False
        self.held: list[asyncio.Future[None]] = []

    async def send(self, topic: str, key: bytes, value: bytes | None, headers: Any) -> asyncio.Future[None]:
        self.sent.append((topic, key))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.hold:
            self.held.append(done)
        else:
            done.set_result(None)
        return done

    def flush_now(self) -> None:
        pass

    async def flush(self) -> None:
        pass


def _calls(partition: int, run_id: str, first: int, count: int) -> list[ConsumerRecord[bytes, bytes]]:
    """``count`` identical failing calls of ``run_id`` at offsets ``first``..."""
    out = []
    for n in range(first, first + count):
        value = orjson.dumps({"schema_version": "1", "run_id": run_id, "event_id": f"{run_id}-{n}", "tool": "search",
                              "ts_ms": 1_764_000_000_000 + n, "seq": n, "outcome": "error", "args": {"q": "x"},
                              "result": {"error": "down"}})
        out.append(ConsumerRecord(TOPIC, partition, n, 0, 0, run_id.encode(), value, None, 5, len(value), ()))
    return out


def _folding(store: Any, fatal: FatalStop | None = None, fold: BatchFold | None = None) -> tuple[Effects, _Decisions]:
    consumer = _Consumer({0, 1})
    decisions = _Decisions()
    topics: Any = SimpleNamespace(telemetry=SimpleNamespace(get_topic_name=lambda: TOPIC),
                                  control=SimpleNamespace(get_topic_name=lambda: "control"),
                                  alerts=SimpleNamespace(get_topic_name=lambda: "alerts"))
    app: Any = SimpleNamespace(consumer=consumer)
    fold = fold or BatchFold(Detector(), facts=False)
    effects = Effects(app, topics, store, fold, WorkerMetrics(), None, None, "/test",
                      256, decisions, fatal=fatal or FatalStop(stop=lambda: None))  # type: ignore[arg-type]
    effects._sweep_rest_s = 0.0  # a partition's next pass at once
    return effects, decisions


def _halts_counted(effects: Effects) -> float:
    return sum(sample.value for metric in effects.metrics.decisions.collect() for sample in metric.samples
               if sample.name.endswith("_total") and sample.labels["action"] == "halt")


async def test_a_batch_folds_on_the_records_kept_by_the_last_and_a_flush_writes_each_run_once(store: Any) -> None:
    """Runs split over three batches are halted at the same call as in one batch, with nothing written until
    the flush, which writes each run's latest record once (RocksDB and its changelog)."""
    runs, data, producer = store
    effects, decisions = _folding(runs)
    for first in (1, 3, 5):  # calls 1-2, 3-4, 5-6 of each run
        await effects.process(_calls(0, "run-a", first, 2) + _calls(1, "run-b", first, 2))
    assert producer.sent == [] and b"run-a" not in data._dbs[0] and runs.kept == 2
    halts = [key for topic, key in decisions.sent if topic == "alerts"]
    assert halts == [b"run-a", b"run-b"]  # the 4th call of each halts it, once
    await effects.flush()
    assert [(partition, [key for key, _ in records]) for partition, records in producer.sent] == [
        (0, [b"run-a"]), (1, [b"run-b"])]
    assert data._dbs[0][b"run-a"] == producer.sent[0][1][0][1] and runs.kept == 0


async def test_a_batch_does_not_wait_for_its_decisions_but_no_state_is_written_before_they_are_acknowledged(
        store: Any) -> None:
    """The next batch folds while the last one's halts are in flight (waiting for them made every batch's
    cycle a broker round trip longer); a flush, the commit's state write, waits for every one of them, so
    no state is written (and no offset committed) ahead of a decision it made."""
    runs, data, producer = store
    effects, decisions = _folding(runs)
    decisions.hold = True
    await asyncio.wait_for(effects.process(_calls(0, "run-a", 1, 4)), 5)  # the 4th call halts it: not answered
    await asyncio.wait_for(effects.process(_calls(1, "run-b", 1, 4)), 5)  # folds all the same
    assert [key for topic, key in decisions.sent if topic == "alerts"] == [b"run-a", b"run-b"]
    assert _halts_counted(effects) == 0  # counted once the broker has them
    flushing = asyncio.create_task(effects.flush())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not flushing.done() and producer.sent == [] and b"run-a" not in data._dbs[0]
    decisions.held[0].set_result(None)  # run-a's control message: its alert copy and run-b's still in flight
    for _ in range(20):
        await asyncio.sleep(0)
    assert not flushing.done() and producer.sent == []
    for sent in decisions.held[1:]:
        sent.set_result(None)
    await asyncio.wait_for(flushing, 5)
    assert sorted(partition for partition, _ in producer.sent) == [0, 1] and runs.kept == 0
    assert _halts_counted(effects) == 2


async def test_a_decision_never_acknowledged_stops_the_worker_and_no_state_is_written_after_it(store: Any) -> None:
    """The producer gave up on a halt (a broker away past its timeout): the batches folded on its batch's
    state may not be written, so the worker stops, and every later write of state refuses."""
    runs, data, producer = store
    stops: list[int] = []
    fatal = FatalStop(stop=lambda: stops.append(1))
    effects, decisions = _folding(runs, fatal)
    await effects.process(_calls(0, "run-z", 1, 1))
    await effects.flush()  # written: nothing was in doubt
    written = len(producer.sent)
    decisions.hold = True
    await effects.process(_calls(0, "run-a", 1, 4))
    await effects.process(_calls(1, "run-b", 1, 2))
    decisions.held[0].set_exception(KafkaTimeoutError())
    for sent in decisions.held[1:]:
        sent.set_result(None)
    for _ in range(5):  # the gathering future's callbacks
        await asyncio.sleep(0)
    assert stops == [1] and isinstance(fatal.reason, PublishFailed)
    assert "KafkaTimeoutError" in str(fatal.reason)
    for _ in range(2):
        with pytest.raises(PublishFailed):
            await effects.flush()
    await effects.sweep()  # writes nothing itself
    assert len(producer.sent) == written and b"run-a" not in data._dbs[0] and b"run-b" not in data._dbs[1]
    assert stops == [1] and _halts_counted(effects) == 0


async def test_a_batch_leaving_too_many_records_kept_writes_them_at_once(store: Any, monkeypatch: Any) -> None:
    runs, _, producer = store
    effects, _ = _folding(runs)
    monkeypatch.setattr(effects_module, "KEEP_MAX_RECORDS", 2)
    await effects.process(_calls(0, "run-a", 1, 1) + _calls(0, "run-b", 1, 1))
    assert runs.kept == 2 and producer.sent == []
    await effects.process(_calls(1, "run-c", 1, 1))
    assert runs.kept == 0 and sorted(len(records) for _, records in producer.sent) == [1, 2]


async def test_the_sweep_judges_a_run_by_its_kept_record_and_keeps_its_deletion_for_the_next_flush(
        store: Any) -> None:
    """A run whose stored record is stale but whose kept one is recent is not expired: the sweep judges the
    latest record. It writes nothing itself: the expired run reads as gone at once and is deleted from
    RocksDB and the changelog by the next flush (the commit's)."""
    runs, data, producer = store
    effects, _ = _folding(runs)
    await effects.process(_calls(0, "run-a", 1, 1) + _calls(0, "run-b", 1, 1))
    await effects.flush()
    written = len(producer.sent)
    await effects.process(_calls(0, "run-b", 10**9 - 3, 1) + _calls(0, "run-z", 10**9, 1))  # kept, not written
    effects._run_ttl_ms = 10**9 - 5  # expires what is silent since call 5's time
    await effects.sweep()
    assert runs.get(0, b"run-a") is None and b"run-a" in data._dbs[0] and len(producer.sent) == written
    assert effects.metrics.evictions._value.get() == 0  # counted once its deletion is written
    await effects.sweep()  # judged again before its deletion is written: not counted twice
    await effects.flush()
    assert b"run-a" not in data._dbs[0] and (b"run-a", None) in producer.sent[-1][1]
    assert effects.metrics.evictions._value.get() == 1  # run-a only
    assert data._dbs[0][b"run-b"] == runs.get(0, b"run-b") and runs.kept == 0


async def test_runs_expired_in_a_partition_revoked_before_their_deletion_was_written_are_not_counted(
        store: Any) -> None:
    """The deletions are dropped with the revoke: the partition's next owner expires the same runs and counts
    them (counted at the sweep, a run was counted by both workers)."""
    runs, _, _ = store
    effects, _ = _folding(runs)
    await effects.process(_calls(0, "run-a", 1, 1) + _calls(1, "run-b", 1, 1))
    await effects.flush()
    await effects.process(_calls(0, "run-y", 10**9, 1) + _calls(1, "run-z", 10**9, 1))
    effects._run_ttl_ms = 10**9 - 5
    await effects.sweep()
    await effects.sweep()  # both partitions swept: run-a and run-b expired, their deletions kept
    assert runs.get(0, b"run-a") is None and runs.get(1, b"run-b") is None
    await effects.forget({1})
    await effects.flush()
    assert effects.metrics.evictions._value.get() == 1  # run-a: written; run-b: its partition's next owner's


async def test_a_batch_leaving_too_many_records_kept_counts_the_expired_runs_it_writes(store: Any,
                                                                                      monkeypatch: Any) -> None:
    runs, data, _ = store
    effects, _ = _folding(runs)
    await effects.process(_calls(0, "run-a", 1, 1))
    await effects.flush()
    effects._run_ttl_ms = 10**9 - 5
    await effects.process(_calls(0, "run-y", 10**9, 1))
    await effects.sweep()
    assert effects.metrics.evictions._value.get() == 0
    monkeypatch.setattr(effects_module, "KEEP_MAX_RECORDS", 1)
    await effects.process(_calls(0, "run-z", 10**9, 1))  # three kept: written at once
    assert b"run-a" not in data._dbs[0] and effects.metrics.evictions._value.get() == 1


async def test_a_revoked_partitions_kept_records_are_dropped_with_a_warning(store: Any, caplog: Any) -> None:
    runs, _, producer = store
    effects, _ = _folding(runs)
    await effects.process(_calls(0, "run-a", 1, 1) + _calls(1, "run-b", 1, 1))
    await effects.forget({1})
    await effects.flush()
    assert [partition for partition, _ in producer.sent] == [0]
    assert "1 run records of partitions [1] not written before their revoke" in caplog.text


async def test_a_flush_waits_for_acknowledgements_without_the_state_lock_and_batches_fold_on_what_it_took(
        store: Any) -> None:
    """A flush takes the kept records in one turn of the state lock and waits for the decisions of the batches
    before it without the lock: a batch folds meanwhile, on the records taken (not yet in RocksDB), and the
    flush writes what it took, not the newer record kept by that batch (the next flush does)."""
    runs, data, producer = store
    effects, decisions = _folding(runs)
    decisions.hold = True
    await effects.process(_calls(0, "run-a", 1, 4))  # halted at its 4th call; the halt not acknowledged
    flushing = asyncio.create_task(effects.flush())
    for _ in range(5):
        await asyncio.sleep(0)
    assert not flushing.done() and runs.kept == 0 and b"run-a" not in data._dbs[0]  # taken, waiting
    decisions.hold = False
    await asyncio.wait_for(effects.process(_calls(0, "run-a", 5, 1) + _calls(1, "run-c", 1, 1)), 1)
    assert [key for topic, key in decisions.sent if topic == "alerts"] == [b"run-a"]  # folded on the taken record:
    assert runs.kept == 2 and not flushing.done()  # run-a halted already, its 5th call no second halt
    for sent in decisions.held:
        sent.set_result(None)
    await asyncio.wait_for(flushing, 5)
    assert decode_run(data._dbs[0][b"run-a"]).offset == 4 and b"run-c" not in data._dbs[1]
    await effects.flush()
    assert decode_run(data._dbs[0][b"run-a"]).offset == 5 and decode_run(data._dbs[1][b"run-c"]).offset == 1
    assert [(partition, [decode_run(value).offset for _, value in records]) for partition, records in producer.sent] \
        == [(0, [4]), (0, [5]), (1, [1])]  # each run's changelog in order


async def test_a_write_of_kept_records_waits_for_the_one_before_it(store: Any, monkeypatch: Any) -> None:
    """A batch leaving too many records kept writes them while a flush still writes its own, a partition at a
    time: its newer records go to RocksDB and the changelog after the flush's older ones."""
    runs, data, producer = store
    effects, _ = _folding(runs)
    await effects.process(_calls(0, "run-a", 1, 1) + _calls(1, "run-b", 1, 1))
    hold = producer.hold()
    flushing = asyncio.create_task(effects.flush())
    for _ in range(5):
        await asyncio.sleep(0)
    assert data._dbs[0][b"run-a"] and b"run-b" not in data._dbs[1]  # partition 1 waits for 0's changelog
    monkeypatch.setattr(effects_module, "KEEP_MAX_RECORDS", 0)  # the next batch writes what it keeps at once
    batch = asyncio.create_task(effects.process(_calls(1, "run-b", 2, 1)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not batch.done() and b"run-b" not in data._dbs[1]  # after the flush, not before
    hold.set()
    await asyncio.wait_for(asyncio.gather(flushing, batch), 5)
    assert decode_run(data._dbs[1][b"run-b"]).offset == 2
    assert [(partition, decode_run(value).offset) for partition, records in producer.sent for _, value in records] \
        == [(0, 1), (1, 1), (1, 2)]


async def test_records_taken_by_a_flush_of_a_partition_revoked_meanwhile_are_not_written(store: Any,
                                                                                        caplog: Any) -> None:
    runs, data, producer = store
    effects, decisions = _folding(runs)
    decisions.hold = True
    await effects.process(_calls(0, "run-a", 1, 1) + _calls(1, "run-b", 1, 4))
    flushing = asyncio.create_task(effects.flush())
    await asyncio.sleep(0)
    await asyncio.wait_for(effects.forget({1}), 1)  # the lock is free while the flush waits
    for sent in decisions.held:
        sent.set_result(None)
    await asyncio.wait_for(flushing, 5)
    assert [partition for partition, _ in producer.sent] == [0] and b"run-b" not in data._dbs[1]
    assert "1 run records of partitions [1] not written before their revoke" in caplog.text
    assert runs.get(1, b"run-b") is None and runs.kept == 0


async def test_a_batch_takes_the_state_lock_while_a_flushs_changelog_waits_for_the_producer(store: Any) -> None:
    """aiokafka takes a partition's next changelog batch only once its previous one went out: the flush
    waits for that with the state lock released, so a batch folds meanwhile (it held the lock for up to
    25 ms at 50% load); the flush goes on to the next partition once the producer has the records."""
    runs, data, producer = store
    effects, _ = _folding(runs)
    await effects.process(_calls(0, "run-a", 1, 1) + _calls(1, "run-b", 1, 1))
    hold = producer.hold()
    flushing = asyncio.create_task(effects.flush())
    for _ in range(5):
        await asyncio.sleep(0)
    assert data._dbs[0][b"run-a"] and producer.sent == []  # written locally; the changelog waits

    async def batch() -> None:
        async with effects._state_lock:  # what Effects.process takes
            pass

    await asyncio.wait_for(batch(), 1)
    assert not flushing.done() and b"run-b" not in data._dbs[1]  # partition 1 after partition 0's changelog
    hold.set()
    await asyncio.wait_for(flushing, 5)
    assert [partition for partition, _ in producer.sent] == [0, 1] and data._dbs[1][b"run-b"]


async def test_an_event_dated_years_ahead_does_not_make_its_partitions_runs_silent(store: Any) -> None:
    """The sweep's watermark goes at most ``MAX_AHEAD_MS`` past the wall clock: one event dated in year 9999
    (a runtime's broken clock) made every run of its partition silent for longer than ``run_ttl_ms``, so
    each was forgotten after every batch and none was ever halted."""
    runs, _, _ = store
    effects, decisions = _folding(runs)
    future = orjson.dumps({"run_id": "broken-clock", "event_id": "e", "tool": "t", "ts_ms": 253_402_300_799_000,
                           "outcome": "success", "args": {}, "result": 1})
    await effects.process([ConsumerRecord(TOPIC, 0, 0, 0, 0, b"broken-clock", future, None, 5, len(future), ())])
    assert effects._watermark_ms[0] <= effects_module.wall_clock_ms() + effects_module.MAX_AHEAD_MS
    now = effects_module.wall_clock_ms()
    for n in range(1, 5):  # a runaway at the wall clock's time, a batch a call, each batch swept after it
        value = orjson.dumps({"run_id": "run-a", "event_id": f"a{n}", "tool": "search", "ts_ms": now + n,
                              "outcome": "error", "args": {"q": "x"}, "result": {"error": "down"}})
        await effects.process([ConsumerRecord(TOPIC, 0, n, 0, 0, b"run-a", value, None, 5, len(value), ())])
        await effects.sweep()
    assert [key for topic, key in decisions.sent if topic == "alerts"] == [b"run-a"]  # its 4th call halted it


async def test_a_batch_that_failed_and_was_folded_again_is_counted_once(store: Any) -> None:
    """The events of a batch whose decision could not be handed to the producer are counted when the
    batch goes through, not on every attempt (6 events counted 30 times over five attempts)."""
    runs, _, _ = store
    effects, decisions = _folding(runs)
    send = decisions.send

    async def refused(*args: Any) -> Any:
        raise KafkaTimeoutError()

    decisions.send = refused  # type: ignore[method-assign]
    with pytest.raises(KafkaTimeoutError):
        await effects.process(_calls(0, "run-a", 1, 4))  # the 4th call halts it: its send fails
    decisions.send = send  # type: ignore[method-assign]
    await effects.process(_calls(0, "run-a", 1, 4))  # fetched again: kept records were not, folds again
    counted = sum(sample.value for metric in effects.metrics.events.collect() for sample in metric.samples
                  if sample.name.endswith("_total"))
    assert counted == 4


@pytest.mark.parametrize("engine", ["python", "native"])
async def test_a_batch_over_the_part_size_folds_as_one_and_each_parts_decisions_go_before_the_next_folds(
        store: Any, tmp_path: Path, monkeypatch: Any, engine: str) -> None:
    """A batch of more than ``FOLD_PART`` records folds a part at a time: the same decisions, in the same order,
    and the same records as folded whole (runs crossing a part's end included), each part's decisions sent
    before the next part folds (the last part's with the batch's end)."""
    batch = (_calls(0, "run-a", 1, 4) + _calls(1, "run-b", 1, 8)  # run-b crosses the 1st part's end
             + _calls(0, "run-c", 1, 6) + _calls(1, "run-d", 1, 6))  # run-d crosses the 2nd part's end
    (tmp_path / "whole").mkdir()
    opened = open_store(tmp_path / "whole")
    whole_runs, _, _ = next(opened)
    make: Any = BatchFold
    if engine == "native":
        pytest.importorskip("loopwarden_native")
        make = NativeBatchFold
    whole, whole_decisions = _folding(whole_runs, fold=make(Detector(), facts=False))
    await whole.process(batch)

    monkeypatch.setattr(effects_module, "FOLD_PART", 10)
    runs, _, _ = store
    effects, decisions = _folding(runs, fold=make(Detector(), facts=False))
    sent_at_fold: list[int] = []
    fold = effects.fold.fold

    def counted(*args: Any) -> Any:
        sent_at_fold.append(len(decisions.sent))
        return fold(*args)

    effects.fold.fold = counted  # type: ignore[method-assign]
    await effects.process(batch)
    assert len(sent_at_fold) == 3  # records 0-9, 10-19, 20-23
    assert decisions.sent == whole_decisions.sent
    halts = [key for topic, key in decisions.sent if topic == "alerts"]
    assert halts == [b"run-a", b"run-b", b"run-c", b"run-d"]
    # run-a and run-b halted in the 1st part (sent before the 2nd folds), run-c in the 2nd, run-d in the last
    assert sent_at_fold[0] == 0
    assert [key for topic, key in decisions.sent[:sent_at_fold[1]] if topic == "alerts"] == [b"run-a", b"run-b"]
    assert [key for topic, key in decisions.sent[:sent_at_fold[2]] if topic == "alerts"] == [b"run-a", b"run-b",
                                                                                            b"run-c"]
    assert runs._kept == whole_runs._kept and runs.kept == whole_runs.kept == 4
    for _ in range(5):  # the acknowledgements' callbacks
        await asyncio.sleep(0)
    assert _halts_counted(effects) == _halts_counted(whole) == 4
    opened.close()


async def test_runs_expired_in_a_write_cancelled_before_it_wrote_them_are_counted_by_the_next(store: Any) -> None:
    """A flush cancelled while it waits for acknowledgements (a stop) keeps what it took again: the next one
    writes the deletion, and counts the expired run then, once."""
    runs, data, _ = store
    effects, decisions = _folding(runs)
    await effects.process(_calls(0, "run-a", 1, 1))
    await effects.flush()
    effects._run_ttl_ms = 10**9 - 5
    decisions.hold = True
    await effects.process(_calls(0, "run-y", 10**9, 4))  # halted: its decisions held
    await effects.sweep()  # run-a expired, its deletion kept
    flushing = asyncio.create_task(effects.flush())
    for _ in range(5):
        await asyncio.sleep(0)
    flushing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flushing
    assert runs.kept == 2 and effects.metrics.evictions._value.get() == 0 and data._dbs[0][b"run-a"]
    for sent in decisions.held:
        sent.set_result(None)
    await effects.flush()
    assert b"run-a" not in data._dbs[0] and effects.metrics.evictions._value.get() == 1
