"""The runs table's storage (stream_app/worker/store.py) on real RocksDB: records kept for the next flush are
read first, written once a flush (the latest of each key, to RocksDB and the changelog), kept again when a
flush fails, and dropped for revoked partitions. faust's table and producer are stood in for by what
RunStore asks of them; the changelog batches are aiokafka's own BatchBuilder."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("faust")

import rocksdict
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.record.default_records import DefaultRecordBatch
from aiokafka.structs import RecordMetadata

from stream_app.worker.store import RunStore

CHANGELOG = "runs-changelog"


class _Data:
    """faust's RocksDB store as RunStore uses it: a DB per partition and the persisted offsets."""

    def __init__(self, root: Path) -> None:
        self._dbs = {p: rocksdict.Rdict(str(root / f"runs-{p}.db"), options=rocksdict.Options(raw_mode=True))
                     for p in (0, 1)}
        self.persisted: dict[int, int] = {}

    def _db_for_partition(self, partition: int) -> rocksdict.Rdict:
        return self._dbs[partition]

    def set_persisted_offset(self, tp: Any, offset: int) -> None:
        self.persisted[tp.partition] = offset

    def close(self) -> None:
        for db in self._dbs.values():
            db.close()


class _Producer:
    """aiokafka's batch API: real BatchBuilders; sent batches listed as (partition, [(key, value)])."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, list[tuple[bytes, bytes | None]]]] = []
        self.fail = False

    def hold(self, first_only: bool = False) -> asyncio.Event:
        """From now on every ``send_batch`` (``first_only``: the next one only) waits for the event returned."""
        event = asyncio.Event()
        send = self.send_batch
        calls = 0

        async def held(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1 or not first_only:
                await event.wait()
            return await send(*args, **kwargs)

        self.send_batch = held  # type: ignore[method-assign]
        return event

    def create_batch(self) -> Any:
        return BatchBuilder(16384, 0)

    async def send_batch(self, batch: Any, topic: str, *, partition: int) -> asyncio.Future[RecordMetadata]:
        if self.fail:
            raise ConnectionError("broker away")
        assert topic == CHANGELOG
        records = [(r.key, r.value) for r in _records_of(batch)]
        self.sent.append((partition, records))
        done: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
        done.set_result(RecordMetadata(topic, partition, None, 100 * len(self.sent), -1, -1, 0))
        return done


def _records_of(batch: Any) -> list[Any]:
    return list(DefaultRecordBatch(bytes(batch._builder.build())))


def open_store(tmp_path: Path) -> Iterator[tuple[RunStore, _Data, _Producer]]:
    """A RunStore on RocksDB in ``tmp_path`` (two partitions), its DBs and its changelog's producer."""
    data = _Data(tmp_path)
    producer = _Producer()
    app: Any = SimpleNamespace(producer=SimpleNamespace(_ensure_producer=lambda: producer))
    runs = RunStore(app, SimpleNamespace(data=data), CHANGELOG)  # type: ignore[arg-type]
    yield runs, data, producer
    data.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[RunStore, _Data, _Producer]]:
    yield from open_store(tmp_path)


async def test_kept_records_are_read_first_and_written_once_a_flush(store: Any) -> None:
    runs, data, producer = store
    data._dbs[0][b"run-a"] = b"a0"
    data._dbs[0][b"run-c"] = b"c0"
    runs.keep({0: [(b"run-a", b"a1"), (b"run-b", b"b1")]})
    runs.keep({0: [(b"run-a", b"a2"), (b"run-c", None)], 1: [(b"run-d", b"d1")], 2: []})
    assert runs.kept == 4
    assert [runs.get(0, b"run-a"), runs.get(0, b"run-b"), runs.get(0, b"run-c"), runs.get(1, b"run-d")] == [
        b"a2", b"b1", None, b"d1"]  # the kept delete hides the stored record
    assert data._dbs[0][b"run-a"] == b"a0" and producer.sent == []  # nothing written before the flush
    await runs.flush()
    assert runs.kept == 0
    assert producer.sent == [(0, [(b"run-a", b"a2"), (b"run-b", b"b1"), (b"run-c", None)]),
                             (1, [(b"run-d", b"d1")])]  # one record per key, its latest
    assert data._dbs[0][b"run-a"] == b"a2" and b"run-c" not in data._dbs[0] and data._dbs[1][b"run-d"] == b"d1"
    assert runs.get(0, b"run-b") == b"b1"  # now from RocksDB
    await asyncio.sleep(0)
    assert data.persisted == {0: 100 + 2, 1: 200}  # each partition's last changelog record (base + index)
    await runs.flush()  # nothing kept: nothing sent
    assert len(producer.sent) == 2


async def test_a_failed_flush_keeps_its_records_under_newer_ones(store: Any) -> None:
    runs, data, producer = store
    runs.keep({0: [(b"run-a", b"a1"), (b"run-b", b"b1")]})
    producer.fail = True
    with pytest.raises(ConnectionError):
        await runs.flush()
    assert runs.kept == 2 and runs.get(0, b"run-a") == b"a1"
    runs.keep({0: [(b"run-a", b"a2")]})  # a batch folded meanwhile
    producer.fail = False
    await runs.flush()
    assert producer.sent == [(0, [(b"run-a", b"a2"), (b"run-b", b"b1")])]
    assert data._dbs[0][b"run-a"] == b"a2"


async def test_records_kept_while_a_flush_writes_wait_for_the_next_one(store: Any) -> None:
    runs, data, producer = store
    runs.keep({0: [(b"run-a", b"a1")]})
    hold = producer.hold()
    flushing = asyncio.create_task(runs.flush())
    await asyncio.sleep(0)
    runs.keep({0: [(b"run-a", b"a2")]})
    hold.set()
    await flushing
    assert producer.sent == [(0, [(b"run-a", b"a1")])] and runs.get(0, b"run-a") == b"a2" and runs.kept == 1
    await runs.flush()
    assert producer.sent[-1] == (0, [(b"run-a", b"a2")]) and data._dbs[0][b"run-a"] == b"a2"


async def test_a_revoked_partitions_kept_records_are_dropped(store: Any) -> None:
    runs, _, producer = store
    runs.keep({0: [(b"run-a", b"a1")], 1: [(b"run-b", b"b1"), (b"run-c", b"c1")]})
    assert runs.drop({1, 5}) == 2
    assert runs.kept == 1 and runs.get(1, b"run-b") is None
    await runs.flush()
    assert producer.sent == [(0, [(b"run-a", b"a1")])]


async def test_a_flush_of_some_partitions_leaves_the_others_kept(store: Any) -> None:
    runs, data, producer = store
    runs.keep({0: [(b"run-a", b"a1")], 1: [(b"run-b", b"b1")]})
    assert runs.kept_partitions() == {0, 1}
    await runs.flush([1, 7])
    assert producer.sent == [(1, [(b"run-b", b"b1")])] and runs.kept == 1 and runs.kept_partitions() == {0}
    assert b"run-a" not in data._dbs[0] and runs.get(0, b"run-a") == b"a1"


async def test_a_flush_writes_rocksdb_before_it_waits_for_the_producer(store: Any) -> None:
    """Every partition's records are in RocksDB when ``write_kept`` returns; their changelog batches go to
    the producer in a task of its own, so a caller may release its state lock while the producer waits."""
    runs, data, producer = store
    data._dbs[1][b"run-b"] = b"b0"
    runs.keep({0: [(b"run-a", b"a1")], 1: [(b"run-b", b"b1")]})
    hold = producer.hold()
    sending = runs.write_kept()
    assert data._dbs[0][b"run-a"] == b"a1" and data._dbs[1][b"run-b"] == b"b1" and runs.kept == 0
    assert runs.get(1, b"run-b") == b"b1" and runs.get(0, b"run-a") == b"a1"
    await asyncio.sleep(0)
    assert not sending.done() and producer.sent == []  # the producer holds the changelog
    hold.set()
    await sending
    assert producer.sent == [(0, [(b"run-a", b"a1")]), (1, [(b"run-b", b"b1")])]


async def test_a_later_flush_hands_its_changelog_over_after_the_earlier_one(store: Any) -> None:
    """A flush whose changelog waits for the producer, then a newer record of the same key flushed (or
    written, as a fold's sweep does): the changelog gets the older record first, so recovery ends on the
    newer one."""
    runs, data, producer = store
    runs.keep({0: [(b"run-a", b"a1")]})
    hold = producer.hold(first_only=True)  # the first flush's batch waits; a later one would not
    first = runs.write_kept()
    runs.keep({0: [(b"run-a", b"a2")]})
    second = runs.write_kept()
    third = asyncio.create_task(runs.write({0: [(b"run-a", None)]}))
    for _ in range(5):
        await asyncio.sleep(0)
    assert producer.sent == []  # the later ones wait for the first
    hold.set()
    await asyncio.gather(first, second, third)
    assert producer.sent == [(0, [(b"run-a", b"a1")]), (0, [(b"run-a", b"a2")]), (0, [(b"run-a", None)])]
    assert b"run-a" not in data._dbs[0]


async def test_a_flush_whose_changelog_fails_keeps_its_records_again(store: Any) -> None:
    """RocksDB was written, the changelog was not: the records are kept again (under newer ones), so the
    next flush writes both again."""
    runs, data, producer = store
    runs.keep({0: [(b"run-a", b"a1"), (b"run-b", b"b1")]})
    hold = producer.hold()
    sending = runs.write_kept()
    assert data._dbs[0][b"run-a"] == b"a1"
    runs.keep({0: [(b"run-a", b"a2")]})
    producer.fail = True
    hold.set()
    with pytest.raises(ConnectionError):
        await sending
    assert runs.kept == 2 and runs.get(0, b"run-a") == b"a2" and runs.get(0, b"run-b") == b"b1"
    producer.fail = False
    await runs.flush()
    assert producer.sent == [(0, [(b"run-a", b"a2"), (b"run-b", b"b1")])]


async def test_taken_records_are_read_until_written_and_a_failed_write_keeps_them_under_newer_taken_ones(
        store: Any) -> None:
    """``take`` empties the kept records into a snapshot ``get`` reads until ``write_taken`` wrote it; a write
    that failed (RocksDB written, the changelog not) keeps its records again, but never over a newer record
    taken since (a later snapshot still being written) nor a newer kept one."""
    runs, data, producer = store
    runs.keep({0: [(b"run-a", b"a1"), (b"run-b", b"b1")]})
    first = runs.take()
    assert runs.kept == 0 and runs.get(0, b"run-a") == b"a1" and b"run-a" not in data._dbs[0]
    runs.keep({0: [(b"run-a", b"a2")]})
    second = runs.take()  # a later write's, waiting for the first
    assert runs.get(0, b"run-a") == b"a2" and runs.get(0, b"run-b") == b"b1"
    hold = producer.hold()
    sending = runs.write_taken(first, 0)
    assert data._dbs[0][b"run-a"] == b"a1" and runs.get(0, b"run-a") == b"a2"
    producer.fail = True
    hold.set()
    with pytest.raises(ConnectionError):
        await sending
    assert runs.get(0, b"run-a") == b"a2" and runs.kept == 1  # run-b kept again; run-a's a1 is older than a2
    producer.fail = False
    await runs.write_taken(second, 0)
    runs.untake(second)
    await runs.flush()
    assert data._dbs[0][b"run-a"] == b"a2" and data._dbs[0][b"run-b"] == b"b1" and runs.kept == 0
    assert producer.sent[-2:] == [(0, [(b"run-a", b"a2")]), (0, [(b"run-b", b"b1")])]
