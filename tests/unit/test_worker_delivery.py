"""Batch delivery on top of faust (stream_app.worker.delivery).

The consumer tests drive the real faust consumer object and its bookkeeping (commit offsets, active and
buffered partitions, flow, generation); nothing here talks to Kafka: the few calls that would reach the
broker (seek, position, the fetch, the commit itself) are replaced on the instance. The sequencer tests
give it a stand-in for the consumer's ``seek``, which is all it calls there.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import pytest

faust = pytest.importorskip("faust")

from aiokafka import AIOKafkaConsumer  # noqa: E402
from aiokafka.errors import IllegalStateError  # noqa: E402
from aiokafka.structs import ConsumerRecord, TopicPartition  # noqa: E402
from faust.types import TP  # noqa: E402

from stream_app.core.stored import StateVersionError  # noqa: E402
from stream_app.worker import delivery  # noqa: E402
from stream_app.worker.app import configured_app  # noqa: E402
from stream_app.worker.loop_consumer import FETCH_MAX_WAIT_MS, LoopConsumerThread  # noqa: E402
from stream_app.worker.settings import WorkerSettings  # noqa: E402

TOPIC = "agent.telemetry"
CHANGELOG = "loopwarden-runs-changelog"
PARTITION = TP(TOPIC, 0)
BATCH_MAX = 100


def _record(offset: int, partition: int = 0, topic: str = TOPIC) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(topic, partition, offset, 0, 0, b"run-1", b"{}", None, 5, 2, ())


def _records(*offsets: int, partition: int = 0) -> delivery.Records:
    return {TP(TOPIC, partition): [_record(o, partition) for o in offsets]}


def _offsets(batch: delivery.Records) -> list[tuple[int, int]]:
    return [(tp.partition, r.offset) for tp, records in batch.items() for r in records]


# --- the consumer: seeded, acknowledged in bulk, in its generation ------------------------------------

class Harness:
    """A real app and its BatchConsumer, not started; Kafka calls replaced, flow resumed as after a
    recovery, partition 0 assigned with offset 100 committed."""

    def __init__(self, tmp_path: Any, name: str) -> None:
        settings = WorkerSettings.from_env({"LOOPWARDEN_APP_ID": name, "LOOPWARDEN_STATE_DIR": str(tmp_path),
                                            "LOOPWARDEN_ALLOW_UNSIGNED": "true"})
        self.app = configured_app(settings)
        self.app.topics.acking_topics.add(TOPIC)  # as the conductor does once the agent subscribes
        self.stale: list[int] = []
        self.gap_seeks: list[int] = []
        self.sink = delivery.BatchSink(TOPIC, BATCH_MAX, self.stale.append)
        delivery.install(self.app, [self.sink], lambda: self.gap_seeks.append(1))
        consumer = self.app.consumer
        assert isinstance(consumer, delivery.BatchConsumer)
        self.consumer = consumer
        self.seeks: list[tuple[TP, int]] = []
        self.commits: list[int] = []
        self.committed: dict[TP, int | None] = {PARTITION: 100}
        self.beginning = 40  # the first offset retention left
        self.fetched: dict[Any, list[Any]] = {}  # what the next fetch returns
        consumer._thread = _Thread(self)  # the consumer thread: where every call to Kafka goes

        async def commit_and_end_transactions() -> None:
            self.commits.append(1)

        consumer.commit_and_end_transactions = commit_and_end_transactions  # type: ignore[method-assign]
        consumer._set_active_tps(set(self.committed))
        self.app.consumer_generation_id = 1
        self.app.flow_control.resume()
        self.handled: list[list[int]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.fatal = delivery.FatalStop(stop=lambda: None)

    async def handle(self, records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        self.handled.append([r.offset for r in records])
        await self.release.wait()

    async def seeded(self) -> Harness:
        await self.consumer.perform_seek()  # what every assignment's recovery ends with
        assert self.seeks == [(PARTITION, 100)]  # to the committed offset, with the sequencer's seed
        self.seeks.clear()
        return self

    def start(self) -> asyncio.Task[None]:
        return asyncio.create_task(delivery.drain(self.app, self.sink, self.fatal, self.handle, self.stale.append))

    async def settle(self) -> None:
        for _ in range(20):
            await asyncio.sleep(0)

    async def offered(self, batch: delivery.Records) -> None:
        """Offer ``batch`` to a running drain and wait until it is handled or dropped (after the pause that
        follows a failed batch: at most 0.8 s)."""
        seen = len(self.handled) + len(self.stale)
        self.sink.offer(1, batch)
        for _ in range(400):
            await asyncio.sleep(0.01)
            if len(self.handled) + len(self.stale) > seen:
                break
        await self.settle()

    def commit_offset(self) -> int | None:
        return self.consumer._new_offset(PARTITION)


class _Thread:
    """Stands in for faust's consumer thread (aiokafka behind a thread hop), answering from the harness."""

    def __init__(self, h: Harness) -> None:
        self.h = h

    async def seek_to_committed(self) -> dict[TopicPartition, int | None]:
        return {TopicPartition(tp.topic, tp.partition): offset for tp, offset in self.h.committed.items()}

    def seek(self, tp: Any, offset: int) -> None:
        self.h.seeks.append((TP(tp.topic, tp.partition), offset))

    async def earliest_offsets(self, *partitions: TopicPartition) -> dict[TopicPartition, int]:
        assert all(isinstance(tp, TopicPartition) for tp in partitions)
        return dict.fromkeys(partitions, self.h.beginning)

    def assignment(self) -> set[TP]:
        return set(self.h.committed)

    def highwater(self, tp: TP) -> int:
        return 1000

    async def getmany(self, active_partitions: set[TP] | None, timeout: float) -> dict[Any, list[Any]]:
        fetched, self.h.fetched = self.h.fetched, {}
        return fetched


async def _stopped(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_stock_faust_commits_past_a_missing_first_message(tmp_path) -> None:
    """The hazard: faust's _new_offset refuses a head gap of 2 or more only; committed 100, acknowledged
    [101, 102] commits 103 (and with nothing committed, anything goes)."""
    consumer = configured_app(WorkerSettings.from_env({
        "LOOPWARDEN_APP_ID": "stock", "LOOPWARDEN_STATE_DIR": str(tmp_path), "LOOPWARDEN_ALLOW_UNSIGNED": "true",
    })).consumer
    consumer._committed_offset[PARTITION] = 100
    consumer._acked[PARTITION].extend([101, 102])
    assert consumer._new_offset(PARTITION) == 103


async def test_a_missing_first_record_is_fetched_again_not_committed_past(tmp_path) -> None:
    """Seeded from the position after the seek to the committed offset (100), the sequencer holds back
    a batch starting at 101 and seeks back to 100; nothing is handled or acknowledged until 100 comes."""
    h = await Harness(tmp_path, "head-gap").seeded()
    assert h.consumer.sequencer.expected(PARTITION) == 100
    task = h.start()
    try:
        h.sink.offer(1, _records(101, 102))
        await h.settle()
        assert h.handled == [] and h.seeks == [(PARTITION, 100)] and h.gap_seeks == [1]
        assert h.commit_offset() is None
        h.sink.offer(1, _records(100, 101, 102))
        await h.settle()
        assert h.handled == [[100, 101, 102]]
        assert h.commit_offset() == 103
    finally:
        await _stopped(task)


async def test_a_partition_with_nothing_committed_starts_at_its_first_offset(tmp_path) -> None:
    """aiokafka leaves such a partition where the fetcher got to (past records fetched before the
    recovery and dropped); it is sought to its first offset and the sequencer expects that offset,
    whatever the position has moved to since."""
    h = Harness(tmp_path, "fresh")
    h.committed[PARTITION] = None
    await h.consumer.perform_seek()
    assert h.seeks == [(PARTITION, 40)] and h.consumer.sequencer.expected(PARTITION) == 40


async def test_records_fetched_while_the_committed_offsets_are_read_are_fetched_again(tmp_path) -> None:
    """aiokafka seeks each partition as its committed offset comes back, while the fetch loop runs: a
    fetch after that seek and before the sequencer's seed is dropped as stale (the rebalance lasts) with
    no expected offset to seek back to. The partition must be sought to the committed offset after that
    (the chaos trial's restarted worker, its partitions' tails fetched in that window, stopped there)."""
    h = Harness(tmp_path, "seek-window")
    h.app.rebalancing = True
    task = h.start()
    thread = h.consumer._thread

    async def seek_to_committed() -> dict[TopicPartition, int | None]:
        thread.seek(PARTITION, 100)  # aiokafka's own seek, at once
        h.sink.offer(1, _records(100, 101, 102))  # the fetch loop meanwhile: the whole tail
        await h.settle()
        return {TopicPartition(TOPIC, 0): 100}

    thread.seek_to_committed = seek_to_committed
    try:
        await h.consumer.perform_seek()
        assert h.stale == [3] and h.seeks == [(PARTITION, 100)] * 2  # sought again after the drop
        h.app.rebalancing = False
        h.sink.offer(1, _records(100, 101, 102))
        await h.settle()
        assert h.handled == [[100, 101, 102]]
    finally:
        await _stopped(task)


async def test_records_before_the_expected_offset_were_handled_already(tmp_path) -> None:
    """After a seek back, records already handled come again: they are left out, not handled twice."""
    h = await Harness(tmp_path, "again").seeded()
    task = h.start()
    try:
        h.sink.offer(1, _records(100, 101, 102))
        await h.settle()
        h.sink.offer(1, _records(101, 102, 103))
        await h.settle()
        assert h.handled == [[100, 101, 102], [103]]
        assert h.commit_offset() == 104
    finally:
        await _stopped(task)


async def test_a_batch_of_an_older_generation_is_dropped_unacknowledged(tmp_path) -> None:
    h = await Harness(tmp_path, "generation").seeded()
    h.sink.offer(1, _records(100, 101))
    h.app.consumer_generation_id = 2  # a rebalance happened after the fetch
    task = h.start()
    try:
        await h.settle()
        assert h.handled == [] and h.stale == [2] and h.commit_offset() is None
    finally:
        await _stopped(task)


async def test_nothing_is_processed_until_the_rebalance_and_its_recovery_completed(tmp_path) -> None:
    """Records fetched after a new assignment, before faust paused its partitions for recovery, must not
    be folded on state not recovered yet."""
    h = await Harness(tmp_path, "rebalancing").seeded()
    h.app.rebalancing = True
    task = h.start()
    try:
        h.sink.offer(1, _records(100, 101))
        await h.settle()
        assert h.handled == [] and h.stale == [2]
        # and fetched again: the consumer's position is past them, and with nothing after them in the
        # partition no gap would ever show (found by the chaos suite: a restarted worker left a
        # partition's tail unprocessed)
        assert h.seeks == [(PARTITION, 100)]
        h.app.rebalancing = False  # on_rebalance_end: recovery completed
        h.sink.offer(1, _records(100, 101))
        await h.settle()
        assert h.handled == [[100, 101]]
    finally:
        await _stopped(task)


async def test_a_batch_admitted_as_a_rebalance_begins_is_expected_and_fetched_again(tmp_path) -> None:
    """The sequencer admitted 100 and sought back over a hole at 101; meanwhile a rebalance began. The
    admitted record is not processed, so the sequencer must expect it again (else 100 would be skipped
    when it comes back and the commit would stall at the hole) and the consumer fetch it again."""
    h = await Harness(tmp_path, "rebalance-mid-admit").seeded()
    thread = h.consumer._thread
    seek = thread.seek

    def seek_as_rebalance_begins(tp: Any, offset: int) -> None:
        h.app.rebalancing = True
        seek(tp, offset)

    thread.seek = seek_as_rebalance_begins  # type: ignore[method-assign]
    task = h.start()
    try:
        h.sink.offer(1, _records(100, 102))
        await h.settle()
        assert h.handled == [] and h.stale == [1]
        assert h.seeks == [(PARTITION, 101), (PARTITION, 100)]
        assert h.consumer.sequencer.expected(PARTITION) == 100
        assert h.commit_offset() is None
    finally:
        await _stopped(task)


async def test_a_generation_change_while_a_batch_is_handled_leaves_it_unacknowledged(tmp_path) -> None:
    h = await Harness(tmp_path, "generation-mid").seeded()
    h.release.clear()
    task = h.start()
    try:
        h.sink.offer(1, _records(100, 101))
        await h.settle()
        assert h.handled == [[100, 101]]
        h.app.consumer_generation_id = 2
        h.release.set()
        await h.settle()
        assert h.commit_offset() is None
    finally:
        await _stopped(task)


async def test_a_revoke_waits_for_the_batch_in_hand_and_drops_the_pending_ones(tmp_path) -> None:
    """As faust's App._on_partitions_revoked does it: flow stopped, flow control suspended and cleared,
    then wait_empty. The batch being handled finishes inside wait_empty and is acknowledged (its state
    and decisions are written, so it must be committed before the partition moves); the batch waiting
    behind it is dropped, never handled nor acknowledged."""
    h = await Harness(tmp_path, "revoke").seeded()
    h.release.clear()
    task = h.start()
    try:
        h.sink.offer(1, _records(*range(100, 150)))
        await h.settle()
        assert h.handled == [list(range(100, 150))]
        h.sink.offer(1, _records(*range(150, 200)))
        h.consumer.stop_flow()
        h.app.flow_control.suspend()
        h.app.flow_control.clear()
        assert h.stale == [50]
        waiting = asyncio.create_task(h.consumer.wait_empty())
        await h.settle()
        assert not waiting.done()  # the batch in hand is not finished
        h.release.set()
        await asyncio.wait_for(waiting, 2)
        assert h.commits == [1]
        assert h.handled == [list(range(100, 150))]
        assert h.commit_offset() == 150
    finally:
        await _stopped(task)


async def test_a_revoke_writes_the_state_kept_in_memory_after_the_batch_in_hand_and_before_the_commit(tmp_path) -> None:
    """``install``'s state writers (the folds across runs keep their records until the next commit): in a
    revoke's ``wait_empty`` they run once the batch in hand finished, and before faust's commit (and its
    producer flush), so a partition's next owner recovers them from the changelog."""
    h = await Harness(tmp_path, "revoke-state").seeded()
    seen: list[tuple[int, int]] = []

    async def write() -> None:
        seen.append((len(h.handled), len(h.commits)))

    h.consumer.state_writers = [write]
    h.release.clear()
    task = h.start()
    try:
        h.sink.offer(1, _records(*range(100, 150)))
        await h.settle()
        h.consumer.stop_flow()
        h.app.flow_control.suspend()
        h.app.flow_control.clear()
        waiting = asyncio.create_task(h.consumer.wait_empty())
        await h.settle()
        assert seen == []  # the batch in hand is not finished
        h.release.set()
        await asyncio.wait_for(waiting, 2)
        assert seen == [(1, 0)] and h.commits == [1]
    finally:
        await _stopped(task)


async def test_with_state_kept_in_memory_a_batch_is_acknowledged_once_the_writers_ran_after_it(tmp_path) -> None:
    """A commit runs the state writers first, then acknowledges the batches processed before they started
    and works out its offsets; a batch processed while a writer awaited (the runs' flush goes a partition at
    a time, the writers one after the other: it may have kept its state after its writer was done) waits
    for the next commit; a failed writer acknowledges nothing. A partition's first acknowledgement, made by
    the commit itself, is committed by it (faust lists the partitions to commit before)."""
    h = await Harness(tmp_path, "commit-state").seeded()
    consumer = h.consumer
    hold = asyncio.Event()
    hold.set()
    failing = False

    async def write() -> None:
        await hold.wait()
        if failing:
            raise ConnectionError("broker away")

    async def commit_offsets(offsets: dict[TP, int], start_new_transaction: bool = True) -> bool:
        committed.append(dict(offsets))
        consumer._committed_offset.update(offsets)  # what faust's does once the broker has them
        return True

    committed: list[dict[TP, int]] = []
    consumer.state_writers = [write]
    consumer._commit_offsets = commit_offsets  # type: ignore[method-assign]
    task = h.start()
    try:
        h.sink.offer(1, _records(100, 101))
        await h.settle()
        assert h.handled == [[100, 101]] and h.commit_offset() is None  # processed, not acknowledged
        hold.clear()
        committing = asyncio.create_task(consumer.commit())
        await h.settle()  # the writer awaits...
        h.sink.offer(1, _records(102, 103))  # ...while the next batch is processed
        await h.settle()
        assert h.handled == [[100, 101], [102, 103]]
        hold.set()
        assert await committing
        assert committed == [{PARTITION: 102}]  # the batch processed during the write: not yet
        failing = True
        with pytest.raises(ConnectionError):
            await consumer.commit()
        assert committed == [{PARTITION: 102}] and h.commit_offset() is None  # nothing acknowledged
        failing = False
        assert await consumer.commit()
        assert committed == [{PARTITION: 102}, {PARTITION: 104}]
    finally:
        await _stopped(task)


async def test_batches_waiting_for_their_state_write_keep_their_offsets_not_their_records(tmp_path) -> None:
    """Until the next commit's state writers run, a processed batch is remembered by its offsets only: its
    records (a commit interval's input: 40,000 of them at a saturated worker's rate) are freed once
    processed, instead of filling the garbage collector's oldest generation until the commit."""
    h = await Harness(tmp_path, "unwritten").seeded()
    consumer = h.consumer

    async def write() -> None:
        pass

    consumer.state_writers = [write]
    task = h.start()
    try:
        first = _records(100, 101)
        alive = [weakref.ref(record) for record in first[PARTITION]]
        h.sink.offer(1, first)
        del first
        await h.settle()
        h.sink.offer(1, _records(102))  # the drain loop lets go of the batch before once it takes the next
        await h.settle()
        gc.collect()
        assert h.handled == [[100, 101], [102]] and h.commit_offset() is None
        assert [ref() for ref in alive] == [None, None]
        assert consumer._unwritten == [(1, {PARTITION: (100, 101)}), (1, {PARTITION: (102, 102)})]
        assert await consumer._write_state() == {PARTITION} and h.commit_offset() == 103
    finally:
        await _stopped(task)


async def test_a_tail_the_flow_controls_resume_drops_is_fetched_again(tmp_path) -> None:
    """faust ends an assignment's recovery by resuming the partitions, seeking them to the committed
    offsets and only then resuming its flow control, which clears the sinks. Records fetched after the
    seek were dropped there, and with nothing after them in the partition no gap ever showed: found by
    the chaos suite, a restarted worker that never processed some of its partitions' backlog."""
    h = await Harness(tmp_path, "resume-clears").seeded()
    h.seeks.clear()
    h.sink.offer(1, _records(100, 101))
    h.app.flow_control.resume()  # Recovery.on_recovery_completed, after perform_seek
    assert h.stale == [2] and h.sink.pending() == 0
    assert [m async for m in h.consumer.getmany(1.0)] == []
    assert h.seeks == [(PARTITION, 100)]  # sought back before the next fetch
    assert [m async for m in h.consumer.getmany(1.0)] == []
    assert h.seeks == [(PARTITION, 100)]  # once
    task = h.start()
    try:
        h.fetched = {TopicPartition(TOPIC, 0): [_record(100), _record(101)]}
        assert [m async for m in h.consumer.getmany(1.0)] == []
        await h.settle()
        assert h.handled == [[100, 101]]
    finally:
        await _stopped(task)


async def test_records_of_a_partition_paused_during_the_fetch_are_fetched_again(tmp_path) -> None:
    """A fetch asked for partition 0; it was paused before the records came back (faust pauses an
    assignment's partitions for its recovery). They are not handed over, and the partition is sought
    back to them before the next fetch."""
    h = await Harness(tmp_path, "paused-mid-fetch").seeded()
    h.seeks.clear()
    fetched = {TopicPartition(TOPIC, 0): [_record(100), _record(101)]}

    async def wait_next_records(timeout: float) -> tuple[Any, set[TP]]:
        return fetched, set()  # the live active set, without partition 0 now

    h.consumer._wait_next_records = wait_next_records  # type: ignore[method-assign]
    assert [m async for m in h.consumer.getmany(1.0)] == []
    assert h.sink.pending() == 0 and h.sink.dropped == {PARTITION}
    del h.consumer._wait_next_records
    assert [m async for m in h.consumer.getmany(1.0)] == []
    assert h.seeks == [(PARTITION, 100)] and h.sink.dropped == set()


async def test_nothing_is_handed_over_while_flow_is_stopped(tmp_path) -> None:
    """A fetch that returns while flow is stopped seeks back to the committed offsets (faust's rule);
    a batch met while flow control is suspended is dropped."""
    h = await Harness(tmp_path, "flow").seeded()
    h.seeks.clear()
    fetched = {TopicPartition(TOPIC, 0): [_record(100), _record(101)]}

    async def wait_next_records(timeout: float) -> tuple[Any, set[TP]]:
        return fetched, {PARTITION}

    h.consumer._wait_next_records = wait_next_records  # type: ignore[method-assign]
    h.consumer.flow_active = False
    assert [m async for m in h.consumer.getmany(1.0)] == []
    assert h.sink.pending() == 0 and h.consumer.sequencer.expected(PARTITION) == 100  # sought and seeded again
    h.consumer.flow_active = True
    assert [m async for m in h.consumer.getmany(1.0)] == []  # input records go to the sink, not to faust
    assert h.sink.pending() == 2
    h.app.flow_control.suspend()
    task = h.start()
    try:
        await h.settle()
        assert h.handled == [] and h.stale == [2]
    finally:
        await _stopped(task)


async def test_other_topics_keep_faust_per_message_path(tmp_path) -> None:
    h = await Harness(tmp_path, "changelog").seeded()
    changelog = TopicPartition(CHANGELOG, 0)

    async def wait_next_records(timeout: float) -> tuple[Any, set[TP]]:
        return {changelog: [_record(7, topic=CHANGELOG)], TopicPartition(TOPIC, 0): [_record(100)]}, {
            TP(CHANGELOG, 0), PARTITION}

    h.consumer._wait_next_records = wait_next_records  # type: ignore[method-assign]
    messages = [m async for m in h.consumer.getmany(1.0)]
    assert [(tp.topic, m.offset) for tp, m in messages] == [(CHANGELOG, 7)]
    assert h.sink.pending() == 1


# --- standby changelogs: written a fetch at a time, as faust's standby path writes them -----------------

class Standby:
    """A harness with the runs table and partition 0 of its changelog assigned as a standby."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.table = h.app.Table("runs", default=None, partitions=8, key_type=bytes, value_type=bytes,
                                 options={"driver": "rocksdict"})
        self.tp = TP(self.table.changelog_topic.get_topic_name(), 0)
        self.recovery = h.app.tables.recovery
        self.recovery.add_standby(self.table, self.tp)
        self.recovery.standby_highwaters[self.tp] = 9
        self.fetches: list[dict[Any, list[ConsumerRecord[bytes, bytes]]]] = []

        async def wait_next_records(timeout: float) -> tuple[Any, set[TP]]:
            return self.fetches.pop(0), {self.tp, PARTITION}

        h.consumer._wait_next_records = wait_next_records  # type: ignore[method-assign]

    def record(self, offset: int, key: bytes, value: bytes | None) -> ConsumerRecord[bytes, bytes]:
        return ConsumerRecord(self.tp.topic, 0, offset, 0, 0, key, value, None, 5, 2, ())

    async def fetch(self, *records: ConsumerRecord[bytes, bytes]) -> list[tuple[str, int]]:
        self.fetches.append({TopicPartition(self.tp.topic, 0): list(records)})
        return [(tp.topic, m.offset) async for tp, m in self.h.consumer.getmany(1.0)]

    def stored(self, key: bytes) -> bytes | None:
        value: bytes | None = self.table.data._db_for_partition(0).get(key)
        return value


async def test_standby_changelog_records_are_written_a_fetch_at_a_time_not_one_message_each(tmp_path) -> None:
    st = Standby(await Harness(tmp_path, "standby").seeded())
    assert await st.fetch(st.record(5, b"run-a", b"A1"), st.record(6, b"run-b", b"B1"),
                          st.record(7, b"run-a", b"A2")) == []  # none of them on faust's per-message path
    assert (st.stored(b"run-a"), st.stored(b"run-b")) == (b"A2", b"B1")
    assert st.table.persisted_offset(st.tp) == 7 == st.recovery.standby_offsets[st.tp]
    assert not st.h.app.tables.standbys_ready  # highwater 9: two records to go
    # fetched again after a seek: what was written is not written again; a tombstone deletes
    assert await st.fetch(st.record(7, b"run-a", b"stale"), st.record(8, b"run-b", None),
                          st.record(9, b"run-c", b"C1")) == []
    assert (st.stored(b"run-a"), st.stored(b"run-b"), st.stored(b"run-c")) == (b"A2", None, b"C1")
    assert st.h.consumer.standby.applied == 5 and st.table.persisted_offset(st.tp) == 9
    assert st.h.app.tables.standbys_ready


async def test_standby_records_keep_faust_path_while_it_may_hold_earlier_ones(tmp_path) -> None:
    """Out of order is never possible: while faust's changelog queue holds records (an assignment's
    recovery), they all take faust's path; records faust took but has not written yet are written first."""
    st = Standby(await Harness(tmp_path, "standby-order").seeded())
    queue = st.h.app.tables.changelog_queue
    queue.put_nowait(object())
    assert await st.fetch(st.record(5, b"run-a", b"A1")) == [(st.tp.topic, 5)]
    queue.get_nowait()
    # faust's slurp loop took offset 5 into its buffer (offset noted, not yet written) ...
    st.recovery.standby_offsets[st.tp] = 5
    st.recovery.buffers[st.table].append(delivery._ChangelogRecord(st.tp, st.record(5, b"run-a", b"A1")))
    assert await st.fetch(st.record(6, b"run-a", b"A2")) == []
    assert st.stored(b"run-a") == b"A2" and not st.recovery.buffers[st.table]  # ... written before offset 6


async def test_an_active_changelog_partition_keeps_faust_recovery_path(tmp_path) -> None:
    st = Standby(await Harness(tmp_path, "standby-active").seeded())
    st.recovery.add_active(st.table, st.tp)  # promoted: recovering it is faust's
    assert await st.fetch(st.record(5, b"run-a", b"A1")) == [(st.tp.topic, 5)]
    assert st.stored(b"run-a") is None


async def test_changelog_partitions_faust_pauses_are_paused_in_aiokafka_too(tmp_path) -> None:
    """faust pauses partitions on its side only; aiokafka went on fetching the changelog partitions of
    active tables (the worker's own writes came back in every fetch, and a record held for a paused
    partition held back every fetch for 100 ms). Changelog partitions follow faust's pauses in the real
    aiokafka consumer; stream partitions are left to faust's handling."""
    h = Harness(tmp_path, "pause-changelogs")
    table = h.app.Table("runs", default=None, partitions=2, key_type=bytes, value_type=bytes,
                        options={"driver": "rocksdict"})
    changelog = table.changelog_topic.get_topic_name()
    aio = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1")  # never started: only its subscription is used
    try:
        aio.assign([TopicPartition(changelog, 0), TopicPartition(changelog, 1), TopicPartition(TOPIC, 0)])
        h.consumer._thread._consumer = aio  # type: ignore[attr-defined]
        h.consumer.pause_partitions({TP(changelog, 0), TP(changelog, 1), PARTITION})  # as on every assignment
        assert aio.paused() == {TopicPartition(changelog, 0), TopicPartition(changelog, 1)}
        h.consumer.resume_partitions({TP(changelog, 1)})  # a standby (or an active one's recovery)
        assert aio.paused() == {TopicPartition(changelog, 0)}
        h.consumer.resume_partitions({PARTITION})  # streams resumed: the paused changelog stays paused
        assert aio.paused() == {TopicPartition(changelog, 0)}
        h.consumer.pause_partitions({TP(changelog, 1)})  # its recovery done
        assert aio.paused() == {TopicPartition(changelog, 0), TopicPartition(changelog, 1)}
    finally:
        await aio.stop()


async def test_the_consumer_runs_on_the_apps_loop_without_a_thread(tmp_path) -> None:
    """faust's consumer thread is replaced by the same class on the app's loop: a call into it runs here,
    on this thread, with sync and async functions alike."""
    app = configured_app(WorkerSettings.from_env({
        "LOOPWARDEN_APP_ID": "in-loop", "LOOPWARDEN_STATE_DIR": str(tmp_path), "LOOPWARDEN_ALLOW_UNSIGNED": "true"}))
    delivery.install(app, [delivery.BatchSink(TOPIC, BATCH_MAX, lambda _: None)], lambda: None)
    thread = app.consumer._thread  # type: ignore[attr-defined]
    assert isinstance(thread, LoopConsumerThread) and thread.thread_loop is asyncio.get_running_loop()

    async def where() -> int:
        return threading.get_ident()

    assert await thread.call_thread(where) == threading.get_ident() == await thread.call_thread(threading.get_ident)


async def test_a_zero_sleep_only_yields_and_a_longer_one_still_ends_when_the_consumer_stops(tmp_path) -> None:
    """faust's drain loop calls ``sleep(0)`` once per fetch: it makes no task (mode's made one and cancelled
    it); a longer sleep is still mode's, cut short by the consumer's stop."""
    h = Harness(tmp_path, "zero-sleep")
    loop = asyncio.get_running_loop()
    made: list[object] = []
    factory = loop.get_task_factory()
    loop.set_task_factory(lambda loop, coro, **kw: made.append(coro) or asyncio.Task(coro, loop=loop, **kw))
    try:
        await h.consumer.sleep(0)
    finally:
        loop.set_task_factory(factory)
    assert made == []
    started = time.monotonic()
    sleeping = asyncio.create_task(h.consumer.sleep(30))
    await asyncio.sleep(0.01)
    h.consumer._stopped.set()
    await asyncio.wait_for(sleeping, 5)
    assert time.monotonic() - started < 5


async def test_a_full_sink_holds_its_partitions_back_until_it_drained(tmp_path) -> None:
    """Past 4 x batch_max pending records the partitions are marked buffered (faust fetches no more of
    them); once the sink drained to half, they are active again, and a fetch waiting on them starts at
    once (faust would sleep a second with no active partition)."""
    h = await Harness(tmp_path, "pressure").seeded()
    consumer = h.consumer
    for start in range(0, 5 * BATCH_MAX, BATCH_MAX):
        h.sink.offer(1, _records(*range(100 + start, 100 + start + BATCH_MAX)))
    assert PARTITION in consumer._buffered_partitions and PARTITION not in consumer._get_active_partitions()
    fetch = asyncio.create_task(consumer._wait_next_records(1.0))
    await h.settle()
    assert not fetch.done()
    for _ in range(3):
        await h.sink.next()
        h.sink.done()
    assert PARTITION in consumer._get_active_partitions() and not consumer._buffered_partitions
    records, active = await asyncio.wait_for(fetch, 0.2)
    assert records == {} and PARTITION in active


async def test_while_a_sink_holds_partitions_back_the_wait_for_the_others_is_short(tmp_path) -> None:
    """faust waits up to a second for records of the partitions active when the wait began; a partition
    the sink released meanwhile waited with it (a saturated worker idled up to 0.8 s every few batches).
    While a sink holds partitions back, the consumer asks for the others' records with a short wait;
    otherwise faust's wait is kept."""
    h = await Harness(tmp_path, "short-wait").seeded()
    consumer = h.consumer
    other = TP(TOPIC, 1)
    h.committed[other] = 0
    consumer._set_active_tps(set(h.committed))
    waits: list[tuple[set[TP] | None, float]] = []

    async def getmany(active_partitions: set[TP] | None, timeout: float) -> dict[Any, list[Any]]:
        waits.append((set(active_partitions or ()), timeout))  # a copy: faust mutates its set
        return {}

    h.consumer._thread.getmany = getmany  # type: ignore[attr-defined]
    await consumer._wait_next_records(1.0)
    for start in range(0, 5 * BATCH_MAX, BATCH_MAX):
        h.sink.offer(1, _records(*range(100 + start, 100 + start + BATCH_MAX)))
    assert consumer._buffered_partitions == {PARTITION}
    await consumer._wait_next_records(1.0)
    assert waits == [({PARTITION, other}, 1.0), ({other}, delivery.BUFFERED_POLL_S)]
    assert delivery.BUFFERED_POLL_S <= 0.05


async def test_a_fetch_waits_at_the_broker_at_most_the_workers_setting(tmp_path) -> None:
    """faust builds its aiokafka consumer with fetch_max_wait_ms=1500: a fetch for partitions with nothing
    new parked that long while partitions drained meanwhile could not be fetched. The worker's consumer
    is faust's with the shorter wait."""
    app = configured_app(WorkerSettings.from_env({
        "LOOPWARDEN_APP_ID": "fetch-wait", "LOOPWARDEN_STATE_DIR": str(tmp_path), "LOOPWARDEN_ALLOW_UNSIGNED": "true"}))
    delivery.install(app, [delivery.BatchSink(TOPIC, BATCH_MAX, lambda _: None)], lambda: None)
    thread = app.consumer._thread  # type: ignore[attr-defined]
    aio = thread._create_worker_consumer(app.transport)
    try:
        assert isinstance(aio, AIOKafkaConsumer)
        assert aio._fetch_max_wait_ms == FETCH_MAX_WAIT_MS <= 100
    finally:
        await aio.stop()


async def test_pending_fetches_are_merged_up_to_batch_max(tmp_path) -> None:
    h = await Harness(tmp_path, "merge").seeded()
    h.sink.offer(1, _records(100, 101))
    h.sink.offer(1, _records(10, partition=1))
    h.sink.offer(1, _records(*range(102, 102 + BATCH_MAX)))
    generation, batch = await h.sink.next()
    assert generation == 1 and _offsets(batch) == [(0, 100), (0, 101), (1, 10)]
    h.sink.done()
    assert h.sink.pending() == BATCH_MAX


async def test_a_failed_batch_is_fetched_again(tmp_path) -> None:
    """The handler raised: the agent goes on (no crash), the sequencer expects the batch's first offset
    again and the consumer is sought there; nothing is committed."""
    h = await Harness(tmp_path, "failed").seeded()
    h.seeks.clear()

    async def failing(records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        raise ConnectionError("broker gone")

    task = asyncio.create_task(delivery.drain(h.app, h.sink, h.fatal, failing, h.stale.append))
    try:
        h.sink.offer(1, _records(100, 101))
        await h.settle()
        assert not task.done()
        assert h.seeks == [(PARTITION, 100)] and h.consumer.sequencer.expected(PARTITION) == 100
        assert h.commit_offset() is None
    finally:
        await _stopped(task)


async def test_only_confirmed_gaps_let_the_commit_pass(tmp_path) -> None:
    """faust's own gap detection (it fires on offsets it dropped itself) is ignored; a gap the sequencer
    confirmed (before the records after it are admitted) lets the acknowledgements, so the commit, pass it."""
    h = Harness(tmp_path, "gaps")
    consumer = h.consumer
    consumer._committed_offset[PARTITION] = 10
    assert consumer.ack_batch(1, {PARTITION: (10, 11)})
    await consumer._add_gap(PARTITION, 12, 14)  # what faust's drain loop would do
    assert consumer.ack_batch(1, {PARTITION: (15, 15)})
    assert consumer._new_offset(PARTITION) == 12  # not past 12..14
    await consumer.confirm_gap(PARTITION, 12, 14)
    await consumer.confirm_gap(PARTITION, 20, 29)  # ahead: kept for when the acknowledgements get there
    assert consumer.ack_batch(1, {PARTITION: (15, 19)})
    assert consumer._new_offset(PARTITION) == 20
    assert consumer.ack_batch(1, {PARTITION: (30, 31)})
    assert consumer._new_offset(PARTITION) == 32 and not consumer._confirmed_gaps


async def test_acknowledgements_extend_a_prefix_from_the_committed_offset(tmp_path) -> None:
    """One number per partition: the offset after the last one acknowledged. A batch starting past it (a
    head gap: committed 100, a batch of 101..102; a hole after it) is not acknowledged, where faust's
    bookkeeping committed 103; a batch again (a seek back after a failure further on) changes nothing;
    the consumer generation must be the batch's."""
    h = Harness(tmp_path, "prefix")
    consumer = h.consumer
    consumer._committed_offset[PARTITION] = 100
    assert consumer.ack_batch(1, {PARTITION: (101, 102)})
    assert h.commit_offset() is None and list(consumer._filter_tps_with_pending_acks()) == []
    assert consumer.ack_batch(1, {PARTITION: (100, 102)})
    assert h.commit_offset() == 103 and list(consumer._filter_tps_with_pending_acks()) == [PARTITION]
    assert consumer.ack_batch(1, {PARTITION: (100, 101)})  # processed again after a seek back
    assert consumer.ack_batch(1, {PARTITION: (105, 106)})  # a hole: 103, 104
    assert h.commit_offset() == 103
    assert not consumer.ack_batch(2, {PARTITION: (103, 110)})  # fetched in an older generation
    assert h.commit_offset() == 103
    other = TP(TOPIC, 1)  # nothing committed: its first acknowledged batch starts it
    assert consumer.ack_batch(1, {other: (7, 9)}) and consumer._new_offset(other) == 10
    consumer._committed_offset[PARTITION] = 103  # committed: nothing pending for it
    assert list(consumer._filter_tps_with_pending_acks()) == [other]
    assert list(consumer._filter_tps_with_pending_acks({CHANGELOG})) == []


async def test_a_commit_commits_the_acknowledged_prefix_and_a_revoke_forgets_it_after_its_commit(tmp_path) -> None:
    """faust's commit path (``force_commit``: the partitions with pending acknowledgements, their new
    offsets) commits the offset after the last one acknowledged; a revoke's callback commits what was
    processed until then, and only after it are the revoked partitions' acknowledgements forgotten (a
    later assignment starts from the committed offset)."""
    h = await Harness(tmp_path, "revoke-commit").seeded()
    consumer = h.consumer
    committed: list[dict[TP, int]] = []

    async def commit_offsets(offsets: dict[TP, int], start_new_transaction: bool = True) -> bool:
        committed.append(dict(offsets))
        consumer._committed_offset.update(offsets)
        return True

    async def revoked_callback(revoked: set[TP]) -> None:  # the app's: its wait_empty commits
        assert consumer.ack_batch(1, {PARTITION: (102, 103)})
        assert await consumer.commit()

    consumer._commit_offsets = commit_offsets  # type: ignore[method-assign]
    consumer._on_partitions_revoked = revoked_callback  # type: ignore[method-assign]
    assert consumer.ack_batch(1, {PARTITION: (100, 101)})
    assert await consumer.commit()
    assert committed == [{PARTITION: 102}]
    assert not await consumer.commit()  # nothing new
    await consumer.on_partitions_revoked({PARTITION})
    assert committed == [{PARTITION: 102}, {PARTITION: 104}]
    assert consumer._acked_to == {} and h.commit_offset() is None


# --- the sequencer ------------------------------------------------------------------------------------

class _Consumer:
    def __init__(self) -> None:
        self.seeks: list[tuple[TP, int]] = []
        self.gaps: list[tuple[TP, int, int]] = []
        self.assigned = True
        self.sequencer: delivery.Sequencer | None = None

    async def seek(self, tp: TP, offset: int) -> None:
        if not self.assigned:
            raise IllegalStateError(f"No current assignment for partition {tp}")
        self.seeks.append((tp, offset))

    async def confirm_gap(self, tp: TP, offset_from: int, offset_to: int) -> None:
        self.gaps.append((tp, offset_from, offset_to))

    async def perform_seek(self) -> None:
        assert self.sequencer is not None
        self.sequencer.seed(PARTITION, 0)


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _sequencer(seed: int | None = 5) -> tuple[delivery.Sequencer, _Consumer, _Clock, list[int]]:
    consumer, clock, seeks = _Consumer(), _Clock(), []
    sequencer = delivery.Sequencer(consumer, lambda: seeks.append(1), clock)  # type: ignore[arg-type]
    consumer.sequencer = sequencer
    if seed is not None:
        sequencer.seed(PARTITION, seed)
    return sequencer, consumer, clock, seeks


async def test_records_in_sequence_pass() -> None:
    sequencer, consumer, _, _ = _sequencer()
    assert _offsets(await sequencer.admit(_records(5, 6, 7))) == [(0, 5), (0, 6), (0, 7)]
    assert _offsets(await sequencer.admit(_records(3, 4, 5, 6, 7, 8))) == [(0, 8)]
    assert consumer.seeks == []


async def test_a_jump_holds_the_partition_back_and_seeks_to_the_first_missing_offset() -> None:
    """The chaos trial's case: 366 processed, then 370 is delivered (367-369 dropped)."""
    sequencer, consumer, _, seeks = _sequencer(365)
    await sequencer.admit(_records(365, 366))
    sequencer.seed(TP(TOPIC, 1), 40)
    batch = _records(370, 371) | _records(40, 41, partition=1)
    assert _offsets(await sequencer.admit(batch)) == [(1, 40), (1, 41)]  # other partitions go on
    assert consumer.seeks == [(PARTITION, 367)]
    assert _offsets(await sequencer.admit(_records(372))) == []  # stale ones fetched before the seek
    assert consumer.seeks == [(PARTITION, 367)] * 2
    assert _offsets(await sequencer.admit(_records(367, 368, 369, 370))) == [(0, o) for o in (367, 368, 369, 370)]
    assert len(seeks) == 2 and consumer.gaps == []


async def test_a_jump_inside_a_fetch_admits_the_part_before_it() -> None:
    sequencer, consumer, _, _ = _sequencer(5)
    assert _offsets(await sequencer.admit(_records(5, 6, 9, 10))) == [(0, 5), (0, 6)]
    assert consumer.seeks == [(PARTITION, 7)] and sequencer.expected(PARTITION) == 7


async def test_a_jump_that_persists_is_accepted_as_a_real_gap() -> None:
    """Records deleted by retention or transaction markers: after enough seeks over enough time the
    sequencer goes on, and tells the consumer the commit may pass the gap."""
    sequencer, consumer, clock, _ = _sequencer(9)
    await sequencer.admit(_records(9))
    for _ in range(delivery.GAP_CONFIRM_SEEKS):
        assert await sequencer.admit(_records(12)) == {}
    clock.now = delivery.GAP_CONFIRM_S - 0.1
    assert await sequencer.admit(_records(12)) == {}  # enough seeks, not yet long enough
    clock.now = delivery.GAP_CONFIRM_S
    assert _offsets(await sequencer.admit(_records(12, 13))) == [(0, 12), (0, 13)]
    assert consumer.gaps == [(PARTITION, 10, 11)]


async def test_a_partition_behind_its_high_water_that_does_not_move_is_reported_stalled() -> None:
    sequencer, _, clock, _ = _sequencer(5)
    highwater = {PARTITION: 9}
    assert sequencer.stalled(highwater.get, 15.0) == []  # just seeded
    clock.now = 14.0
    assert _offsets(await sequencer.admit(_records(5, 6))) == [(0, 5), (0, 6)]
    clock.now = 28.0
    assert sequencer.stalled(highwater.get, 15.0) == []  # it moved 14 s ago
    clock.now = 29.0
    assert sequencer.stalled(highwater.get, 15.0) == [(PARTITION, 7, 9, 15.0)]
    highwater[PARTITION] = 7
    assert sequencer.stalled(highwater.get, 15.0) == []  # nothing waiting: idle, not stalled


async def test_an_unseeded_partition_is_sought_to_the_committed_offsets() -> None:
    """Every assignment seeds its partitions; should records come first, nothing is taken as the start."""
    sequencer, _, _, seeks = _sequencer(None)
    assert await sequencer.admit(_records(50)) == {}
    assert sequencer.expected(PARTITION) == 0 and seeks == [1]


async def test_a_partition_revoked_before_its_seek_is_forgotten() -> None:
    sequencer, consumer, _, _ = _sequencer(5)
    await sequencer.admit(_records(5))
    consumer.assigned = False
    assert await sequencer.admit(_records(9)) == {}
    assert sequencer.expected(PARTITION) is None  # the next assignment seeds it again


# --- the fatal stop: nothing processed after a state this release cannot read -------------------------

async def test_a_fatal_stop_stops_once_and_runs_nothing_after_it() -> None:
    """The step that meets an unreadable stored record is not counted done, the worker is stopped once,
    the error does not escape (the agent's supervisor would restart it and go on), and no later step
    runs, the expiry sweep included."""
    stops: list[int] = []
    fatal = delivery.FatalStop(stop=lambda: stops.append(1))
    ran: list[str] = []

    async def step(name: str, fail: bool = False) -> None:
        ran.append(name)
        if fail:
            raise StateVersionError("stored run record has format version 2", "upgrade this worker")

    assert await fatal.run(step("first")) is True
    assert await fatal.run(step("meets v2", fail=True)) is False
    assert await fatal.run(step("later batch")) is False
    assert await fatal.run(step("sweep")) is False
    assert ran == ["first", "meets v2"] and stops == [1]
    assert isinstance(fatal.reason, StateVersionError)


async def test_after_a_fatal_stop_batches_are_dropped_unacknowledged(tmp_path) -> None:
    h = await Harness(tmp_path, "fatal").seeded()

    async def meets_v2(records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        h.handled.append([r.offset for r in records])
        raise StateVersionError("stored run record has format version 2", "upgrade this worker")

    task = asyncio.create_task(delivery.drain(h.app, h.sink, h.fatal, meets_v2, h.stale.append))
    try:
        h.sink.offer(1, _records(100, 101))
        await h.settle()
        h.sink.offer(1, _records(102))
        await h.settle()
        assert h.handled == [[100, 101]] and h.stale == [1] and not task.done()
        assert h.commit_offset() is None
    finally:
        await _stopped(task)


async def test_a_producer_failed_for_good_stops_the_worker_once() -> None:
    """Its agent crashing and restarting on every batch would keep the worker up while nothing is
    published (its metrics endpoint still answers the liveness probe)."""
    stops: list[int] = []
    fatal = delivery.FatalStop(stop=lambda: stops.append(1))

    async def step() -> None:
        raise delivery.ProducerFailed("the decisions producer failed for good")

    assert await fatal.run(step()) is False
    assert await fatal.run(step()) is False
    assert stops == [1] and isinstance(fatal.reason, delivery.ProducerFailed)


async def test_an_error_that_is_not_about_stored_state_still_crashes_the_step() -> None:
    fatal = delivery.FatalStop(stop=lambda: pytest.fail("stopped"))

    async def step() -> None:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        await fatal.run(step())
    assert fatal.reason is None


async def test_a_batch_that_fails_again_and_again_stops_the_worker_instead_of_crashing_for_ever(tmp_path) -> None:
    """A failing batch is fetched again and retried after a pause (0.1 s, doubled each time); the same
    batch failing ``FAILED_IN_A_ROW`` times in a row (nothing processed between) stops the worker once,
    naming the batch, and the agent stays up dropping batches unacknowledged. The agent never crashes: a
    worker stopping after faust had restarted a crashed agent hung in the supervisor's stop, ready for
    good. A processed batch starts the count again."""
    h = await Harness(tmp_path, "poison").seeded()
    stops: list[int] = []
    h.fatal = delivery.FatalStop(stop=lambda: stops.append(1))
    good = True

    async def handle(records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        h.handled.append([r.offset for r in records])
        if not good:
            raise KeyError("a bug")

    async def attempt(*offsets: int) -> None:
        await h.offered(_records(*offsets))

    task = asyncio.create_task(delivery.drain(h.app, h.sink, h.fatal, handle, h.stale.append))
    try:
        good = False
        for _ in range(delivery.FAILED_IN_A_ROW - 1):
            await attempt(100, 101)
        good = True  # one processed batch starts the count again
        await attempt(100, 101)
        good = False
        for _ in range(delivery.FAILED_IN_A_ROW - 1):
            await attempt(102)
        assert stops == [] and not task.done()
        assert h.handled == [[100, 101]] * delivery.FAILED_IN_A_ROW + [[102]] * (delivery.FAILED_IN_A_ROW - 1)
        await attempt(102)
        assert stops == [1] and not task.done()  # stopping, not crashed
        assert isinstance(h.fatal.reason, delivery.BatchFailing) and isinstance(h.fatal.reason.__cause__, KeyError)
        assert f"failed {delivery.FAILED_IN_A_ROW} times in a row" in str(h.fatal.reason)
        await attempt(103)
        assert h.handled[-1] == [102] and h.stale == [1]  # dropped unacknowledged
    finally:
        await _stopped(task)


async def test_a_partition_failing_at_one_offset_stops_the_worker_while_other_partitions_go_through(tmp_path) -> None:
    """Counted per partition at the offset its failing batches start at: batches of another partition
    processed in between do not start the count again (one count for the topic was reset by them, and
    a stuck partition was retried for ever)."""
    h = Harness(tmp_path, "poison-p0")
    h.committed[TP(TOPIC, 1)] = 10  # partition 1 assigned too
    h.consumer._set_active_tps(set(h.committed))
    await h.consumer.perform_seek()
    stops: list[int] = []
    h.fatal = delivery.FatalStop(stop=lambda: stops.append(1))

    async def handle(records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        h.handled.append([(r.partition, r.offset) for r in records])
        if any(r.partition == 0 for r in records):
            raise KeyError("a bug met in partition 0")

    task = asyncio.create_task(delivery.drain(h.app, h.sink, h.fatal, handle, h.stale.append))
    try:
        for n in range(delivery.FAILED_IN_A_ROW):
            assert stops == []
            await h.offered(_records(100))
            await h.offered(_records(10 + n, partition=1))  # goes through
        assert stops == [1] and isinstance(h.fatal.reason, delivery.BatchFailing)
        assert "0@100" in str(h.fatal.reason)
        assert [batch for batch in h.handled if batch[0][0] == 1] == [
            [(1, 10 + n)] for n in range(delivery.FAILED_IN_A_ROW - 1)]  # went through between (the 5th: stopping)
    finally:
        await _stopped(task)
