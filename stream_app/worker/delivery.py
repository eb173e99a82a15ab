"""Input records in batches straight from faust's consumer, each processed once, in offset order, before
its offset is committed.

faust keeps what it does well here: group membership and partition assignment (telemetry co-partitioned
with the runs table), the table's changelog, recovery and standbys, timers, the producer and commits. Its
per-message delivery (``Consumer._drain_messages``: one ``Service.wait_first`` per message, four tasks
made and three cancelled; then the conductor, a channel, the stream, ``take_events`` and one ack per
event) cost ~115 us of main-thread CPU per event, most of the worker's time. So the input topics (the
agents' topics: telemetry, OTLP) skip it:

* ``BatchConsumer.getmany`` (faust's drain loop still calls it) hands each fetch's records of an input
  topic to that topic's ``BatchSink`` as per-partition lists, writes standby changelog records to the
  local table a fetch at a time (``StandbyApplier``) and yields only the rest (the changelog while an
  assignment recovers) to faust's per-message path. It keeps faust's rules: nothing while flow is
  stopped (a fetch then seeks back to the committed offsets, as faust does), only active or buffered
  partitions, nothing across a consumer generation change.
* each input's agent drains its sink (``drain``): a batch is what the consumer has buffered (capped by
  ``broker_max_poll_records``; pending fetches are merged up to ``LOOPWARDEN_BATCH_MAX``), no batch
  window. A batch of an older consumer generation, or one met while faust's flow control is suspended
  (revoke, stop) or a rebalance is in progress (until the state's recovery completed), is dropped
  unacknowledged, and its partitions are sought back to their next expected offsets: it is fetched again
  (without the seek, records dropped at the tail of a partition were never fetched again).
* ``Sequencer`` admits each partition's records only in sequence from the consumer's position, seeded
  when faust seeks to the committed offsets (every assignment ends with that seek; a partition with
  nothing committed is sought to its beginning, as a new group's consumer starts). A jump past the next
  expected offset holds the partition back (not processed, not acknowledged) and seeks the consumer back;
  a jump that persists (``GAP_CONFIRM_SEEKS`` seeks over at least ``GAP_CONFIRM_S``) is real (records
  deleted by retention, transaction markers): it is accepted, logged and handed to faust's gap
  bookkeeping so commits can pass it. Without the seed, the first record after an assignment was taken
  as the start, and faust's ``_new_offset`` commits past a single missing first message (committed 100,
  acknowledged [101, 102] commits 103).
* a batch is acknowledged once the handler returned (its state and changelog queued: faust flushes the
  producer before it commits), in the generation it was fetched in; faust's commit timer does the rest.
  An input partition's acknowledged offsets are a prefix of its log (the sequencer admits them in
  sequence, skipping only confirmed gaps), so the consumer keeps one number per partition, the offset
  after the last one acknowledged, and that is what it commits (``_new_offset``): faust's bookkeeping kept
  every offset in a list and a set, and each commit took its ``max``, sorted it and grouped it into runs
  of consecutive numbers (at 17,500 events/s over 8 partitions, a second's acknowledgements took 1.9 ms and
  the commit's offsets 2.8 ms of the event loop; now 0.2 and 0.02 ms). Handlers
  may keep their batches' state in memory past them (the runs and the folds across runs do, so that a
  key busy in every batch is written once a commit): their writers (``install``'s ``state_writers``)
  are awaited at the start of every commit (``_commit_tps``), before the committed offsets are worked
  out, and in ``wait_empty``; a processed batch is acknowledged only once the writers ran after it
  (``processed``, ``_write_state``), so no offset is committed, and no partition handed to another
  worker, ahead of the state of what was processed, whatever batches run while the writers await.
* back-pressure: a sink holding more than ``4 x batch_max`` records marks the partitions it holds as
  buffered (faust's ``on_buffer_full``: no more fetches for them) until it drained below half of that
  (then the fetch starts at once; faust would sleep a second when no partition is left to fetch, and
  while others are left, it waited up to a second for their records: here ``BUFFERED_POLL_S``).
* revoke and stop: faust suspends and clears its flow control (which clears the sinks: pending batches
  are dropped unacknowledged), then waits in ``wait_empty``, which here first waits for the batch in
  hand to finish, so that no state, changelog or decision of a revoked partition is written after it.
* every record of an input topic that left aiokafka and is not processed is fetched again: the
  partitions of batches a sink's ``clear`` dropped, and of records fetched for a partition paused while
  the fetch was under way, are sought back to their expected offsets before the next fetch. faust ends an
  assignment's recovery by seeking to the committed offsets and only then resuming its flow control,
  which clears the sinks: a backlog's tail fetched in between was never fetched again (chaos trials: a
  restarted worker that never processed some of its partitions).
* the livelock monitor reads ``stream_inbound_time[tp]``: set for each partition of each batch.
* a stall watch (``BatchConsumer._watch_stalls``) logs, once per stuck offset, an input partition whose
  expected offset is below its high-water mark and has not moved for ``STALL_S``, with the consumer's
  and the sink's view of it (position, paused, active, buffered, pending): a worker that stopped
  processing some partitions says which and why.

``FatalStop`` is the error the worker must not work around (a stored record it cannot read): from then
on nothing is processed or committed.

faust internals this relies on (faust-streaming 0.15.3, mode-streaming 0.7.1, aiokafka 0.14.0, checked
at start-up by ``versions``): ``Consumer._wait_next_records``, ``_buffered_partitions``, ``_new_offset``,
``_filter_tps_with_pending_acks``, ``on_partitions_revoked`` (its app callback commits), ``_committed_offset``,
``_to_message``, ``scheduler``, ``seek_to_committed`` (and
aiokafka's: it seeks only committed offsets above 0), ``_thread`` (``earliest_offsets``, ``seek``),
``on_buffer_full``/``on_buffer_drop``, ``_get_active_partitions``, ``_paused_partitions``, ``wait_empty``,
``_add_gap`` (no-op here), ``_commit_tps`` (every commit passes it: ``commit``, ``force_commit``); aiokafka's
``_subscription`` (the stall watch's diagnostic only); ``App.flow_control.manage_queue`` and ``is_active``;
``App.consumer_generation_id`` and ``rebalancing``; ``Monitor.stream_inbound_time`` and
``track_tp_end_offset``; ``App.transport.Consumer`` (how the consumer class is installed); for standbys
``TableManager.changelog_queue``, ``changelog_topics``, ``standbys_ready``, ``on_standbys_ready`` and
``Recovery.standby_tps``, ``active_tps``, ``standby_offsets``, ``tp_to_table``, ``buffers``,
``flush_buffers``, ``standby_remaining_total``, ``Table.apply_changelog_batch``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, TypeAlias

import faust
from aiokafka.errors import IllegalStateError
from aiokafka.structs import ConsumerRecord
from faust.transport.drivers.aiokafka import Consumer
from faust.types import TP, Message
from mode import Service
from mode.utils.times import Seconds

from ..core import LoopwardenError
from ..core.stored import StoredRecordError
from .loop_consumer import LoopConsumerThread

log = logging.getLogger(__name__)

Record: TypeAlias = "ConsumerRecord[bytes, bytes]"
#: One fetch's (or several merged) records of one input topic, by partition, each list in offset order.
Records = dict[TP, list[Record]]
#: A batch's first and last offset by partition (what acknowledging it needs; the records are not kept).
Offsets = dict[TP, tuple[int, int]]
Handler = Callable[[Sequence[Record]], Coroutine[Any, Any, None]]

#: A jump past the expected offset is taken as real only after this many seeks back to it...
GAP_CONFIRM_SEEKS = 20
#: ...spread over at least this long (stale records fetched before a seek can still arrive after it).
GAP_CONFIRM_S = 5.0
#: How long ``wait_empty`` (revoke, stop) waits for the batch in hand before giving up on it.
IN_FLIGHT_WAIT_S = 60.0
#: While a full sink holds partitions back, the longest the consumer waits for records of the others before
#: it looks again at which partitions are active: faust waits up to a second, and a partition the sink
#: released meanwhile waited with it (one worker on a backlog idled up to 0.8 s every few batches).
BUFFERED_POLL_S = 0.01
#: An input partition with records waiting and nothing admitted for this long is reported as stalled.
STALL_S = 15.0
#: Failures in a row of an input partition's batches at one offset (none processed past it between) that
#: stop the worker, and the pause before the first retry (doubled for each next one: 0.1, 0.2, 0.4, 0.8 s).
FAILED_IN_A_ROW = 5
RETRY_PAUSE_S = 0.1


class ProducerFailed(LoopwardenError, RuntimeError):
    """A producer the worker publishes through failed for good: aiokafka failed every send it held and
    refuses new ones (its sender task died). Nothing more can be published by it, so the worker stops
    (exit status 3) and its orchestrator starts it again with a fresh producer; the batches not published
    are not committed, so they are folded again."""


class BatchFailing(LoopwardenError, RuntimeError):
    """An input topic's batch failed ``FAILED_IN_A_ROW`` times in a row (fetched again and retried after a
    pause each time): not a passing error but one the records bring back.
    The worker stops (exit status 3) instead of crashing on them for ever while it reports ready; the
    error is logged with the batch's offsets. (Telemetry a fold fails on is dead-lettered by the batch
    function itself: ``batch.FoldFailed``.)"""


class PublishFailed(LoopwardenError, RuntimeError):
    """A decision or fact of a processed batch was not acknowledged: the producer gave up on it (its
    retries and ``request_timeout_ms`` spent, a broker away that long). A batch does not wait for its
    sends before the next one folds on its state (``effects.Effects``), so the state of every batch since
    is in doubt: none of it is written and no offset committed, and the worker stops (exit status 3); its
    restart folds those batches again from the last commit, with the same decision ids."""


class FatalStop:
    """Stops the worker for an error it must not work around (a stored record this release cannot read,
    ``StoredRecordError``; a producer that failed for good, ``ProducerFailed``; a send of a processed
    batch that was never acknowledged, ``PublishFailed``), and remembers why (``run_worker`` exits with it).

    From the first such error on, nothing more is processed or committed: the batch that met it is not
    acknowledged, every later one is dropped unacknowledged, and the agent does not crash (its
    supervisor would restart it and go on taking records while the worker stops).
    """

    def __init__(self, stop: Callable[[], object] = lambda: os.kill(os.getpid(), signal.SIGTERM)) -> None:
        #: How the worker is stopped: by default the way an operator stops it, faust's graceful
        #: shutdown, which commits acknowledged offsets only.
        self.stop = stop
        self.reason: BaseException | None = None

    async def run(self, step: Coroutine[Any, Any, None]) -> bool:
        """Await ``step``; whether it completed (False: the worker is stopping, or ``step`` met an error
        that stops it)."""
        if self.reason is not None:
            step.close()
            return False
        try:
            await step
        except (StoredRecordError, ProducerFailed, PublishFailed) as exc:
            self.fail(exc)
            return False
        return True

    def fail(self, exc: BaseException) -> None:
        """Stop the worker for ``exc`` (the first reason is the one kept and logged)."""
        if self.reason is None:
            self.reason = exc
            log.critical("stopping the worker: %s", exc, exc_info=exc)
            self.stop()


@dataclass
class _Repair:
    """A partition held back at ``offset`` until the consumer delivers it."""

    offset: int
    seeks: int
    since: float


class Sequencer:
    """Admits each partition's records in offset order from its seeded position, seeking back over
    anything the consumer left out."""

    def __init__(self, consumer: BatchConsumer, on_seek: Callable[[], object],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.consumer = consumer
        self.on_seek = on_seek
        self.clock = clock
        self._next: dict[TP, int] = {}
        self._repairs: dict[TP, _Repair] = {}
        #: When each partition's expected offset last moved (seeded or admitted past), for ``stalled``.
        self.moved_at: dict[TP, float] = {}

    def seed(self, tp: TP, offset: int) -> None:
        """``tp``'s next record is ``offset`` (the consumer was just sought there)."""
        self._next[tp] = offset
        self._repairs.pop(tp, None)
        self.moved_at[tp] = self.clock()

    def stalled(self, highwater: Callable[[TP], int | None], after_s: float) -> list[tuple[TP, int, int, float]]:
        """Partitions whose expected offset is below their high-water mark and has not moved for
        ``after_s``: (tp, expected, high-water, seconds since it moved)."""
        now = self.clock()
        out = []
        for tp, expected in self._next.items():
            high = highwater(tp)
            since = now - self.moved_at.get(tp, now)
            if high is not None and high > expected and since >= after_s:
                out.append((tp, expected, high, since))
        return out

    def expected(self, tp: TP) -> int | None:
        return self._next.get(tp)

    def forget(self, partitions: Iterable[TP] | None = None) -> None:
        """Partitions were revoked: a later assignment seeds them again."""
        for tp in list(self._next) if partitions is None else partitions:
            self._next.pop(tp, None)
            self._repairs.pop(tp, None)
            self.moved_at.pop(tp, None)

    async def admit(self, batch: Records) -> Records:
        """The records of ``batch`` that are next in their partitions, each partition's in order.

        Records below the expected offset were admitted before (fetched again after a seek back) and
        are left out. A partition whose records jump past the expected offset is held back from the
        jump on and the consumer is sought back (until the gap is confirmed as real). A partition never
        seeded (every assignment seeds them) is held back and the consumer sought to the committed offsets."""
        admitted: Records = {}
        for tp, records in batch.items():
            expected = self._next.get(tp)
            if expected is None:
                log.warning("%s: records delivered before its position was known: seeking every partition "
                            "to its committed offset", tp)
                self.on_seek()
                await self.consumer.perform_seek()  # seeds every assigned partition
                continue
            run: list[Record] = []
            for record in records:
                offset = record.offset
                if offset < expected:
                    continue
                if offset > expected and not await self._gap_is_real(tp, expected, offset):
                    await self._seek(tp, expected)
                    break
                self._repairs.pop(tp, None)
                run.append(record)
                expected = offset + 1
            if run:
                admitted[tp] = run
                self._next[tp] = expected
                self.moved_at[tp] = self.clock()
        return admitted

    async def refetch(self, partitions: Iterable[TP]) -> None:
        """Records of ``partitions`` were dropped before admission: seek them back to their expected
        offsets."""
        for tp in partitions:
            expected = self._next.get(tp)
            if expected is not None:
                await self._seek(tp, expected)

    async def rewind(self, batch: Records) -> None:
        """``batch`` was admitted but not processed (its handler failed): expect and fetch it again."""
        for tp, records in batch.items():
            if records and tp in self._next:
                self._next[tp] = records[0].offset
                await self._seek(tp, records[0].offset)

    async def _seek(self, tp: TP, offset: int) -> None:
        try:
            await self.consumer.seek(tp, offset)
        except IllegalStateError:  # revoked meanwhile: its next owner starts from the committed offset
            self.forget([tp])

    async def _gap_is_real(self, tp: TP, expected: int, offset: int) -> bool:
        repair = self._repairs.get(tp)
        if repair is None or repair.offset != expected:
            repair = self._repairs[tp] = _Repair(expected, 0, self.clock())
        repair.seeks += 1
        if repair.seeks <= GAP_CONFIRM_SEEKS or self.clock() - repair.since < GAP_CONFIRM_S:
            self.on_seek()
            if repair.seeks == 1:
                log.info("%s: offset %d expected, %d delivered: holding the partition back and seeking to %d",
                         tp, expected, offset, expected)
            return False
        log.warning("%s: offsets %d..%d are not in the log (deleted by retention, or transaction markers); "
                    "going on from %d", tp, expected, offset - 1, offset)
        del self._repairs[tp]
        await self.consumer.confirm_gap(tp, expected, offset - 1)
        return True


class BatchSink:
    """The batches of one input topic between the consumer and its agent (``drain``).

    ``offer`` never blocks the consumer's drain loop; faust's flow control clears the sink on revoke,
    stop and resume (it is managed like faust's own channel queues)."""

    def __init__(self, topic: str, batch_max: int, on_dropped: Callable[[int], object]) -> None:
        self.topic = topic
        self.batch_max = batch_max
        self.on_dropped = on_dropped
        self.high = 4 * batch_max
        self.consumer: BatchConsumer | None = None
        self._pending: deque[tuple[int, Records]] = deque()
        self._pending_records = 0
        self._buffered: set[TP] = set()
        #: Partitions whose records were dropped without a seek back (``clear``): the consumer seeks
        #: them back to their expected offsets before its next fetch (``BatchConsumer.getmany``).
        self.dropped: set[TP] = set()
        #: Per partition, the offset its failing batches start at and how many failed there in a row
        #: (``drain``): a partition's count ends only when a batch processes that offset, so batches of other
        #: partitions going through meanwhile do not reset it.
        self.failed: dict[TP, tuple[int, int]] = {}
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def offer(self, generation: int, records: Records) -> None:
        self._pending.append((generation, records))
        self._pending_records += sum(map(len, records.values()))
        self._ready.set()
        if self._pending_records > self.high and self.consumer is not None:
            for tp in records:
                if tp not in self._buffered:
                    self._buffered.add(tp)
                    self.consumer.on_buffer_full(tp)

    def clear(self) -> None:
        """Drop every pending batch, unacknowledged (faust's flow control calls this); their partitions
        are fetched again from their expected offsets (``dropped``)."""
        if self._pending_records:
            self.on_dropped(self._pending_records)
        for _, records in self._pending:
            self.dropped.update(records)
        self._pending.clear()
        self._pending_records = 0
        self._ready.clear()
        self._release_buffered()

    def pending(self) -> int:
        return self._pending_records

    def holds(self, tp: TP) -> bool:
        """Whether this sink marked ``tp`` buffered (no fetches until it drains)."""
        return tp in self._buffered

    def idle(self) -> bool:
        return self._idle.is_set()

    async def next(self) -> tuple[int, Records]:
        """The oldest pending batch merged with the later ones of its generation, up to ``batch_max``
        records (more only when one fetch held more); the sink is busy until ``done``."""
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        self._idle.clear()
        generation, merged = self._pending.popleft()
        count = sum(map(len, merged.values()))
        merged = {tp: list(records) for tp, records in merged.items()}
        while self._pending and self._pending[0][0] == generation:
            more = sum(map(len, self._pending[0][1].values()))
            if count + more > self.batch_max:
                break
            for tp, records in self._pending.popleft()[1].items():
                merged.setdefault(tp, []).extend(records)
            count += more
        self._pending_records -= count
        if not self._pending:
            self._ready.clear()
        if self._buffered and self._pending_records <= self.high // 2:
            self._release_buffered()
        return generation, merged

    def done(self) -> None:
        self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait for the batch in hand, if any; whether it finished within ``timeout``."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _release_buffered(self) -> None:
        if self.consumer is not None:
            for tp in self._buffered:
                self.consumer.on_buffer_drop(tp)
        self._buffered.clear()


class _ChangelogRecord:
    """A changelog record as faust's ``Table.apply_changelog_batch`` reads an event: ``event.message``'s
    tp, partition, offset, key and value (raw bytes, as faust's own standby path writes them)."""

    __slots__ = ("key", "offset", "partition", "tp", "value")

    def __init__(self, tp: TP, record: Record) -> None:
        self.tp = tp
        self.partition = tp.partition
        self.offset = record.offset
        self.key = record.key
        self.value = record.value

    @property
    def message(self) -> _ChangelogRecord:
        return self


class StandbyApplier:
    """Standby changelog records written to the local table a fetch at a time (see the module docstring).

    faust's own standby path costs one message through the drain loop, the conductor and
    ``Recovery._slurp_changelogs`` (an ``asyncio.wait_for``) per record: ~96 us per telemetry event on
    each peer with ``standby_replicas=1``, about three times the worker's whole cost per event. This
    writes exactly what that path writes (``Table.apply_changelog_batch``: the records' raw keys and
    values in one RocksDB write batch per partition, then the persisted offset recovery resumes from),
    keeps faust's standby offsets (records at or below them were applied before), and tells the tables
    when the standbys caught up, as the slurp loop does.

    Records keep faust's path (returned by ``apply``) whenever that path may hold earlier records of the
    same partition, so nothing is applied out of order: while faust's changelog queue is not empty (an
    assignment's recovery, the first fetches of a new standby), and for partitions not (or not only)
    standby ones. Before writing, faust's recovery buffers (records it took but has not written yet) are
    written first.
    """

    def __init__(self, app: Any) -> None:
        self.app = app  # a faust.App (typed Any: the TableManager attributes used are not in faust's types)
        self.applied = 0

    def apply(self, records: dict[Any, list[Record]]) -> dict[Any, list[Record]]:
        """Write the standby partitions' records of ``records``; returns the rest, for faust's path."""
        tables = self.app.tables
        recovery: Any = tables.recovery
        standby_tps = recovery.standby_tps
        if not standby_tps or not tables.changelog_queue.empty():
            return records
        active_tps = recovery.active_tps
        changelogs = tables.changelog_topics
        rest: dict[Any, list[Record]] = {}
        taken: dict[TP, list[Record]] = {}
        for tp, tp_records in records.items():
            ftp = TP(tp.topic, tp.partition)
            if tp.topic in changelogs and ftp in standby_tps and ftp not in active_tps:
                taken[ftp] = tp_records
            else:
                rest[tp] = tp_records
        if not taken:
            return records
        if any(recovery.buffers.values()):
            recovery.flush_buffers()
        offsets = recovery.standby_offsets
        for tp, tp_records in taken.items():
            seen = offsets.get(tp)
            fresh = [_ChangelogRecord(tp, r) for r in tp_records if seen is None or r.offset > seen]
            if fresh:
                recovery.tp_to_table[tp].apply_changelog_batch(fresh)
                offsets[tp] = fresh[-1].offset
                self.applied += len(fresh)
        if not tables.standbys_ready and not recovery.standby_remaining_total():
            tables.on_standbys_ready()
        return rest


class BatchConsumer(Consumer):
    """faust's aiokafka consumer with the input topics' records diverted to batch sinks (see the
    module docstring). ``install`` makes the class with its sinks."""

    sinks: Mapping[str, BatchSink]
    on_seek: Callable[[], object]
    #: What writes state the handlers folded but keep in memory past their batches (``Effects.flush``,
    #: ``FleetEffects.flush``): awaited before every commit and after the last batch of a revoke or stop.
    #: With any, a processed batch is acknowledged only once they ran after it (``processed``).
    state_writers: Sequence[Callable[[], Awaitable[None]]] = ()
    sequencer: Sequencer
    standby: StandbyApplier

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sequencer = Sequencer(self, self.on_seek)
        self.standby = StandbyApplier(self.app)
        self._drained = asyncio.Event()
        self._stalls_reported: dict[TP, int] = {}
        #: Processed batches (generation, their offsets by partition) whose state may still be kept in
        #: memory: acknowledged once the state writers ran after them. Offsets, not the records: a commit
        #: interval's records held here (40,000 at a saturated worker's rate) were most of the objects
        #: the garbage collector traversed, and each one survived into its oldest generation.
        self._unwritten: list[tuple[int, Offsets]] = []
        #: Per input partition, the offset after the last one acknowledged: what a commit may commit.
        self._acked_to: dict[TP, int] = {}
        #: Per input partition, the gaps (first, last offset) the sequencer confirmed as absent from the log.
        self._confirmed_gaps: dict[TP, list[tuple[int, int]]] = {}
        for sink in self.sinks.values():
            sink.consumer = self
            self.app.flow_control.manage_queue(sink)  # type: ignore[arg-type]  # it only calls clear()

    def _new_consumer_thread(self) -> LoopConsumerThread:
        """aiokafka on the app's own loop, not in a thread of its own (``loop_consumer``)."""
        return LoopConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def sleep(self, n: Seconds) -> None:
        """mode's ``Service.sleep``, except that ``sleep(0)`` only yields to the event loop: faust's drain
        loop calls it once per fetch (and the livelock check once per partition), and mode's waits for the
        stop event with a timeout of 0, making a task and cancelling it: 22 us a call against 5."""
        if not n:
            await asyncio.sleep(0)
        else:
            await super().sleep(n)

    def pause_partitions(self, tps: Iterable[TP]) -> None:
        super().pause_partitions(tps)
        self._fetch_changelogs_as_faust_does()

    def resume_partitions(self, tps: Iterable[TP]) -> None:
        super().resume_partitions(tps)
        self._fetch_changelogs_as_faust_does()

    def _fetch_changelogs_as_faust_does(self) -> None:
        """Pause in aiokafka the changelog partitions faust has paused, resume the others.

        faust pauses a partition only on its side (``_paused_partitions``, left out of what it asks the
        fetcher for); aiokafka goes on fetching it. An active table's changelog is paused once its
        recovery is done, so every changelog record the worker writes came back in its own fetches: each
        fetch listed every changelog partition (40 partitions instead of 16 with the rules across runs),
        and a record fetched for a paused partition stays in aiokafka's buffer, where for its first
        100 ms (aiokafka's prefetch backoff) it holds back every fetch from that broker, the input's
        included. Stream partitions keep faust's own handling (their records are dropped and fetched
        again, ``getmany``)."""
        aio = getattr(self._thread, "_consumer", None)
        if aio is None:  # not started yet: faust pauses again on assignment
            return
        paused = self._paused_partitions  # faust's TP and aiokafka's TopicPartition are equal tuples
        changelogs = self.app.tables.changelog_topics
        already = aio.paused()
        for tp in aio.assignment():
            if tp.topic in changelogs and (tp in paused) != (tp in already):
                (aio.pause if tp in paused else aio.resume)(tp)

    async def getmany(self, timeout: float) -> AsyncIterator[tuple[TP, Message]]:
        records, active = await self._wait_next_records(timeout)
        if records is None or self.should_stop:
            return
        if not self.flow_active:
            # faust's rule: records fetched while flow is stopped are fetched again from the committed offsets.
            try:
                await self.perform_seek()
            except Exception as exc:  # noqa: BLE001 - as faust does: the next fetch seeks again
                self.log.warning("exception performing seek when flow not active: %r", exc)
            return
        generation = self.app.consumer_generation_id
        sinks = self.sinks
        buffered = self._buffered_partitions
        batches: dict[str, Records] = {}
        rest = {}
        monitor = self.app.monitor
        for tp, tp_records in records.items():
            if not tp_records:
                continue
            if tp.topic in sinks:
                tp = TP(tp.topic, tp.partition)  # faust's own tuple type (aiokafka hands its TopicPartition)
                if not (active is None or tp in active or tp in buffered):
                    # paused while the fetch was under way: the position is past these records now
                    sinks[tp.topic].dropped.add(tp)
                    continue
                batches.setdefault(tp.topic, {})[tp] = tp_records
                monitor.track_tp_end_offset(tp, self.highwater(tp))
            elif active is None or tp in active or tp in buffered:
                rest[tp] = tp_records
        for topic, batch in batches.items():
            sinks[topic].offer(generation, batch)
        if rest:
            rest = self.standby.apply(rest)
        if rest:
            to_message = self._to_message
            for tp, record in self.scheduler.iterate(rest):
                if not self.flow_active or self.app.consumer_generation_id != generation:
                    break
                yield tp, to_message(tp, record)

    async def _wait_next_records(self, timeout: float) -> tuple[Any, set[TP] | None]:
        """faust's, except that partitions whose records a sink dropped are first sought back to their
        expected offsets; when every partition is held back by a full sink (faust would sleep a whole
        second before fetching again) this waits until a sink has drained (at most that second); and while
        some are held back, the wait for records of the others lasts at most ``BUFFERED_POLL_S``."""
        if not self.flow_active:
            await self.wait(self.can_resume_flow)  # type: ignore[arg-type]  # as faust's: an asyncio.Event
        for sink in self.sinks.values():
            if sink.dropped:
                dropped, sink.dropped = sink.dropped, set()
                await self.sequencer.refetch(dropped)
        if self.flow_active and self._buffered_partitions and not self._get_active_partitions():
            self._drained.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), 1.0)
            return {}, self._get_active_partitions()
        if self._buffered_partitions:
            # faust's wait is for records of the partitions active now (up to a second): partitions a sink
            # releases meanwhile must not wait for it.
            timeout = min(timeout, BUFFERED_POLL_S)
        return await super()._wait_next_records(timeout)

    def on_buffer_drop(self, tp: TP) -> None:
        super().on_buffer_drop(tp)
        self._drained.set()

    @Service.timer(STALL_S / 3)
    async def _watch_stalls(self) -> None:
        """Say, once per stuck offset, why an input partition with records waiting has not moved for
        ``STALL_S`` (a worker that stopped processing some of its partitions must be diagnosable
        from its log)."""
        if not self.flow_active or self.app.rebalancing:
            return
        for tp, expected, high, since in self.sequencer.stalled(self._highwater_or_none, STALL_S):
            if self._stalls_reported.get(tp) == expected:
                continue
            self._stalls_reported[tp] = expected
            sink = self.sinks.get(tp.topic)
            log.warning("%s: offset %d expected for %.0f s, high-water %d; consumer %s; sink: %s", tp, expected,
                        since, high, self._partition_state(tp),
                        "none" if sink is None else f"{sink.pending()} records pending, holding it back "
                        f"{sink.holds(tp)}, dropped {tp in sink.dropped}, a batch in hand {not sink.idle()}")

    def _highwater_or_none(self, tp: TP) -> int | None:
        try:
            return self.highwater(tp)
        except Exception:  # noqa: BLE001 - a diagnostic: not assigned (any more), not fetched yet
            return None

    def _partition_state(self, tp: TP) -> str:
        thread: Any = self._thread
        state = "?"
        try:
            aio = thread._ensure_consumer()
            value = aio._subscription.subscription.assignment.state_value(tp)
            state = f"position {value.position if value.has_valid_position else None}, paused {value.paused}"
        except Exception as exc:  # noqa: BLE001 - a diagnostic
            state = f"position unknown ({type(exc).__name__})"
        return (f"{state}, active {tp in self._get_active_partitions()}, buffered {tp in self._buffered_partitions}, "
                f"paused by faust {tp in self._paused_partitions}, flow active {self.flow_active}, "
                f"in recovery {self.app.in_recovery}")

    async def seek_to_committed(self) -> Mapping[TP, int]:
        """faust's seek to the committed offsets (every assignment ends with it), plus: an input
        partition with nothing committed is sought to its first offset (a new group's start), and the
        sequencer is seeded with each input partition's offset sought to.

        aiokafka seeks only partitions with a committed offset above 0 and leaves the others where the
        fetcher got to, past records fetched before the assignment's recovery and dropped; and it seeks
        each one while the next one's committed offset is being read, so the fetch loop, running
        meanwhile, moves positions past records it hands over (dropped too, while the rebalance lasts).
        So every input partition is sought here once more, and seeded with the offset sought to, with no
        await between the two."""
        committed = await super().seek_to_committed()
        inputs = [tp for tp in committed if tp.topic in self.sinks]
        fresh = [tp for tp in inputs if not ((offset := committed[tp]) and offset > 0)]
        thread: Any = self._thread
        starts: dict[Any, int] = {}
        if fresh:
            starts = dict(await thread.earliest_offsets(*fresh))
        # Sought again, each with its seed and no await in between: aiokafka sought each partition as soon
        # as its committed offset came back, and records fetched after that seek, before the seed, were
        # dropped as stale (the rebalance lasts) with no expected offset to seek back to: the position was
        # past them, and at a partition's tail nothing else ever came (chaos: a restarted worker that
        # stopped after two batches).
        for tp in inputs:
            start = starts[tp] if tp in starts else committed[tp]
            thread.seek(tp, start)
            self.sequencer.seed(TP(tp.topic, tp.partition), start)
        return committed

    def processed(self, generation: int, batch: Records) -> None:
        """``batch`` was processed: acknowledged now, or, if the handlers keep state past their batches,
        once the state writers ran after it (at the next commit, or a revoke's or stop's ``wait_empty``)."""
        offsets = {tp: (records[0].offset, records[-1].offset) for tp, records in batch.items() if records}
        if self.state_writers:
            self._unwritten.append((generation, offsets))
        else:
            self.ack_batch(generation, offsets)

    def ack_batch(self, generation: int, offsets: Offsets) -> bool:
        """Acknowledge a processed batch (its first and last offset per partition), unless the consumer
        generation moved on since it was fetched. Synchronous: no await between check and ack.

        A partition's acknowledged offsets only ever extend its prefix: a batch starting past the offset
        after the last one acknowledged (or the committed one) is acknowledged only across gaps the
        sequencer confirmed; otherwise (never, while the sequencer admits in sequence) it is left
        unacknowledged and logged, and the commit stays where it was, as faust's stops at a hole."""
        if generation != self.app.consumer_generation_id:
            return False
        acked_to = self._acked_to
        for tp, (first, last) in offsets.items():
            base = acked_to.get(tp)
            if base is None:
                base = self._committed_offset[tp]
            if base is not None and first > base:
                base = self._past_confirmed_gaps(tp, base)
                if first > base:
                    log.error("%s: a processed batch starts at offset %d, past %d, the offset after the last one "
                              "acknowledged, with no confirmed gap between: left unacknowledged (a loopwarden bug: "
                              "please report it)", tp, first, base)
                    continue
            if base is None or last >= base:
                acked_to[tp] = last + 1
        return True

    def _past_confirmed_gaps(self, tp: TP, offset: int) -> int:
        """``offset``, moved past the confirmed gaps that start at or before it (and dropping those behind)."""
        gaps = self._confirmed_gaps.get(tp)
        if not gaps:
            return offset
        for first, last in sorted(gaps):
            if first <= offset <= last:
                offset = last + 1
        kept = [(first, last) for first, last in gaps if last >= offset]
        if kept:
            self._confirmed_gaps[tp] = kept
        else:
            del self._confirmed_gaps[tp]
        return offset

    def _new_offset(self, tp: TP) -> int | None:
        """What a commit may commit for ``tp``: for an input partition, the offset after the last one
        acknowledged, if above the committed one."""
        if tp.topic in self.sinks:
            offset = self._acked_to.get(tp)
            committed = self._committed_offset[tp]
            return offset if offset is not None and (committed is None or offset > committed) else None
        return super()._new_offset(tp)

    def _filter_tps_with_pending_acks(self, topics: Any = None) -> Iterator[TP]:
        yield from super()._filter_tps_with_pending_acks(topics)
        for tp in self._acked_to:
            if (topics is None or tp in topics or tp.topic in topics) and self._new_offset(tp) is not None:
                yield tp

    async def on_partitions_revoked(self, revoked: set[TP]) -> None:
        """faust's, then the input partitions' acknowledgements are forgotten as faust forgets its own. Not
        before: faust's callback in between waits for the batch in hand and commits (``wait_empty``), what
        was processed included."""
        try:
            await super().on_partitions_revoked(revoked)
        finally:
            for tp in revoked:
                self._acked_to.pop(tp, None)
                self._confirmed_gaps.pop(tp, None)

    async def wait_empty(self) -> None:
        """Revoke and stop: pending batches dropped, the batch in hand finished, the state handlers kept past
        their batches written (before faust flushes the producer: its changelog records are out before a
        new owner recovers the partition), then faust's own wait (it commits)."""
        for sink in self.sinks.values():
            sink.clear()
            if not await sink.wait_idle(IN_FLIGHT_WAIT_S):
                self.log.warning("a batch of %s did not finish within %.0f s of the revoke or stop; its offsets "
                                 "stay uncommitted", sink.topic, IN_FLIGHT_WAIT_S)
        await self._write_state()
        await super().wait_empty()

    async def _commit_tps(self, tps: Iterable[TP], start_new_transaction: bool) -> bool:
        """Every commit first writes the state handlers kept past their batches: the offsets it then
        commits (worked out after, with no wait in between) never run ahead of the state of what was
        processed."""
        acknowledged = await self._write_state()
        # faust listed ``tps`` (the partitions with acknowledged offsets) before: add those just acknowledged
        return bool(await super()._commit_tps({*tps, *acknowledged}, start_new_transaction))

    async def _write_state(self) -> set[TP]:
        """Run the state writers, then acknowledge the batches processed before they started: their state
        is written. A batch processed while they ran may have kept its state after a writer was done with
        it (the runs' flush goes a partition at a time; the writers run one after the other): it waits for
        the next time. If a writer fails, nothing is acknowledged. Returns the partitions acknowledged."""
        done, self._unwritten = self._unwritten, []
        try:
            for write in self.state_writers:
                await write()
        except BaseException:
            self._unwritten[:0] = done
            raise
        acknowledged: set[TP] = set()
        for generation, offsets in done:
            if self.ack_batch(generation, offsets):
                acknowledged.update(offsets)
        return acknowledged

    async def _add_gap(self, tp: TP, offset_from: int, offset_to: int) -> None:
        """faust's own gap detection fires on offsets it dropped: gaps come from the Sequencer."""

    async def confirm_gap(self, tp: TP, offset_from: int, offset_to: int) -> None:
        """Offsets ``offset_from..offset_to`` are absent from the log: acknowledgements (and so commits) may
        pass them."""
        self._confirmed_gaps.setdefault(tp, []).append((offset_from, offset_to))


def install(app: faust.App, sinks: Iterable[BatchSink], on_seek: Callable[[], object],
            state_writers: Sequence[Callable[[], Awaitable[None]]] = ()) -> None:
    """Give ``app`` a consumer that diverts the sinks' topics to them (``on_seek`` counts seeks back over
    gaps) and awaits each of ``state_writers`` before every commit and in ``wait_empty`` (state a handler
    keeps in memory past its batch: it may be appended to until the app starts); call before the app
    starts."""
    consumer_class: Any = type("BatchConsumer", (BatchConsumer,), {
        "sinks": {sink.topic: sink for sink in sinks}, "on_seek": staticmethod(on_seek),
        "state_writers": state_writers})
    # faust makes the consumer from this attribute of the transport when the app starts.
    app.transport.Consumer = consumer_class  # type: ignore[misc]


async def drain(app: faust.App, sink: BatchSink, fatal: FatalStop, handle: Handler,
                on_stale: Callable[[int], object]) -> None:
    """Hand ``sink``'s batches to ``handle``, each partition in offset order, and acknowledge what it
    finished: the body of every input agent. A batch of an older generation, or met while flow control
    is suspended, during a rebalance or after a fatal stop, is dropped unacknowledged (``on_stale``
    counts its records)."""
    consumer = app.consumer
    if not isinstance(consumer, BatchConsumer):
        raise TypeError("delivery.install must run before the app starts")
    sequencer = consumer.sequencer
    inbound = app.monitor.stream_inbound_time
    stale_batches = 0
    pause_s = 0.0
    while True:
        if pause_s:
            await asyncio.sleep(pause_s)  # after a failed batch, outside it (a revoke waits for none)
            pause_s = 0.0
        generation, batch = await sink.next()
        admitted: Records = {}
        try:
            if fatal.reason is not None:
                on_stale(sum(map(len, batch.values())))
                continue
            if not _current(app, generation):
                # Dropped, so fetched again: the consumer's position is past these records, and if nothing
                # follows them in their partition no gap would ever show (the partition would sit idle,
                # its tail unprocessed, until a restart). A new assignment's seek re-seeds anyway.
                on_stale(sum(map(len, batch.values())))
                stale_batches += 1
                if stale_batches in (10, 100, 1000, 10_000):  # a worker stuck refusing every batch says why
                    log.warning("%d batches of %s dropped as stale in a row (partitions %s): batch generation %d, "
                                "consumer generation %s, flow control active %s, rebalancing %s", stale_batches,
                                sink.topic, sorted(tp.partition for tp in batch), generation,
                                app.consumer_generation_id, app.flow_control.is_active(), app.rebalancing)
                await sequencer.refetch(batch)
                continue
            stale_batches = 0
            admitted = await sequencer.admit(batch)
            if not admitted:
                continue
            if not _current(app, generation):  # a rebalance began while the sequencer sought
                on_stale(sum(map(len, admitted.values())))
                await sequencer.rewind(admitted)  # admitted but not processed: expected and fetched again
                admitted = {}
                continue
            now = time.monotonic()
            for tp in admitted:
                inbound[tp] = now
            records = admitted[next(iter(admitted))] if len(admitted) == 1 else [
                record for tp_records in admitted.values() for record in tp_records]
            if await fatal.run(handle(records)):
                consumer.processed(generation, admitted)
                for tp in admitted:
                    sink.failed.pop(tp, None)
        except Exception as exc:
            # Fetched again (the sequencer expects its first offset) and retried after a pause. The agent does
            # not crash: faust's supervisor restarting it worked, but a worker stopping after such restarts
            # hung in the supervisor's stop, alive and ready, for good (SIGTERM again did nothing).
            if admitted:
                await sequencer.rewind(admitted)
            failed = 1
            for tp, tp_records in admitted.items():
                if tp_records:
                    at, count = sink.failed.get(tp, (tp_records[0].offset, 0))
                    count = count + 1 if at == tp_records[0].offset else 1
                    sink.failed[tp] = (tp_records[0].offset, count)
                    failed = max(failed, count)
            offsets = ", ".join(f"{tp.partition}@{records[0].offset}" for tp, records in admitted.items() if records)
            if failed < FAILED_IN_A_ROW:
                log.error("a batch of %s failed (%r; partition@first offset: %s): fetched again, attempt %d of %d",
                          sink.topic, exc, offsets or "none admitted", failed + 1, FAILED_IN_A_ROW, exc_info=exc)
                pause_s = RETRY_PAUSE_S * 2 ** (failed - 1)
                continue
            stop = BatchFailing(f"a batch of {sink.topic} failed {failed} times in a row at the same offset ({exc!r}; "
                                f"partition@first offset: {offsets or 'none admitted'}): the worker stops")
            stop.__cause__ = exc
            fatal.fail(stop)  # the batches after it are dropped unacknowledged while the worker stops
        finally:
            sink.done()


def _current(app: faust.App, generation: int) -> bool:
    """Whether a batch fetched in ``generation`` may be processed now: same generation, flow control
    active, and no rebalance in progress (from its start until faust's recovery of the state completed:
    records fetched in between, before faust paused the new assignment's partitions, would be folded on
    state not recovered yet; dropped, they are fetched again)."""
    return generation == app.consumer_generation_id and app.flow_control.is_active() and not app.rebalancing
