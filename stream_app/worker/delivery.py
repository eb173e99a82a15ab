"""Every input message processed once, in offset order, before its offset is committed.

The worker's restart safety rests on two assumptions about delivery: each partition's messages reach the
batch processor in offset order with none left out (a skipped message of a run whose later messages were
applied is never applied: the per-run offset guard takes it for a redelivery), and no offset is
committed before its message was processed. faust-streaming 0.15 breaks both in edge cases, all seen
as halts made one call late in ``make chaos``:

* at the end of a recovery it seeks the stream partitions back to their committed offsets while its
  fetcher is already delivering them; its read-offset bookkeeping then drops some re-fetched messages
  as already read although they never reached the stream (``Consumer._drain_messages``);
* it fills "gaps" in the offsets it read (meant for transaction markers and compacted records) into
  the committed offset, so the commit passes those dropped messages;
* it acknowledges, as if processed, a message it skips during a rebalance (``Stream._py_aiter``).

So, here, with faust kept for everything else:

* ``Sequencer`` admits a partition's messages only in sequence: when a batch jumps past the next
  expected offset, that partition's messages in it are held back (not processed, not committed) and the
  consumer is sought back to the expected offset. A jump that persists (``GAP_CONFIRM_SEEKS`` seeks over
  at least ``GAP_CONFIRM_S``) is real (records deleted by retention, transaction markers): it is
  accepted, logged and handed to faust's gap bookkeeping so commits can pass it.
* the consumer installed by ``install`` counts an acknowledgement only for messages a handler
  ``mark_processed``, and takes gaps only from the sequencer.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast
from weakref import WeakSet

import faust
from aiokafka.errors import IllegalStateError
from faust.streams import Stream
from faust.transport.drivers.aiokafka import Consumer
from faust.types import TP, EventT, Message, StreamT
from faust.types.tuples import ack_lock
from mode.utils.futures import notify

from ..core.stored import StoredRecordError

log = logging.getLogger(__name__)

#: A jump past the expected offset is taken as real only after this many seeks back to it...
GAP_CONFIRM_SEEKS = 20
#: ...spread over at least this long (stale messages fetched before a seek can still arrive after it).
GAP_CONFIRM_S = 5.0


class ProcessedMessages:
    """The messages a handler finished with, until the consumer has counted their acknowledgement."""

    def __init__(self, topics: Iterable[str], on_skipped: Callable[[], object]) -> None:
        #: Topics whose acknowledgements are guarded (the agents' inputs).
        self.topics = frozenset(topics)
        self.on_skipped = on_skipped
        self._done: WeakSet[Message] = WeakSet()

    def mark_processed(self, batch: Iterable[EventT[Any]]) -> None:
        for event in batch:
            self._done.add(event.message)

    def take(self, message: Message) -> bool:
        """Whether ``message`` was processed (its acknowledgement counts); forgets it either way."""
        if message.topic not in self.topics:
            return True
        if message in self._done:
            self._done.discard(message)
            return True
        self.on_skipped()
        return False


class _GuardedConsumer(Consumer):
    processed: ProcessedMessages

    def ack(self, message: Message) -> bool:
        if self.processed.take(message):
            return super().ack(message)
        with ack_lock:  # faust's own bookkeeping of a finished message, minus the committable offset
            message.acked = True
            self._unacked_messages.discard(message)
            notify(self._waiting_for_ack)
        return False

    async def _add_gap(self, tp: TP, offset_from: int, offset_to: int) -> None:
        """faust's own gap detection also fires on offsets it dropped: gaps come from the Sequencer."""

    async def confirm_gap(self, tp: TP, offset_from: int, offset_to: int) -> None:
        """Offsets ``offset_from..offset_to`` are absent from the log: commits may pass them."""
        await super()._add_gap(tp, offset_from, offset_to)


def install(app: faust.App, topics: Iterable[str], on_skipped: Callable[[], object]) -> ProcessedMessages:
    """Give ``app`` a consumer that commits only processed messages of ``topics`` (``on_skipped`` counts
    the others) and only gaps the Sequencer confirmed; call before the app starts."""
    processed = ProcessedMessages(topics, on_skipped)
    consumer_class: Any = type("ProcessedOnlyConsumer", (_GuardedConsumer,), {"processed": processed})
    # faust makes the consumer from this attribute of the transport when the app starts.
    app.transport.Consumer = consumer_class  # type: ignore[misc]
    return processed


@dataclass
class _Repair:
    """A partition held back at ``offset`` until the consumer delivers it."""

    offset: int
    seeks: int
    since: float


class Sequencer:
    """Admits each partition's messages in offset order, seeking back over anything faust left out."""

    def __init__(self, app: faust.App, on_seek: Callable[[], object],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.on_seek = on_seek
        self.clock = clock
        self._next: dict[TP, int] = {}
        self._repairs: dict[TP, _Repair] = {}

    def forget(self, partitions: Iterable[TP] | None = None) -> None:
        """Partitions were revoked: a later assignment starts again from the committed offset."""
        for tp in list(self._next) if partitions is None else partitions:
            self._next.pop(tp, None)
            self._repairs.pop(tp, None)

    async def admit(self, batch: Sequence[EventT[Any]]) -> list[EventT[Any]]:
        """The events of ``batch`` that are next in their partitions (earlier offsets, redeliveries,
        pass too: the processor's offset guard skips them)."""
        admitted: list[EventT[Any]] = []
        held: dict[TP, int] = {}
        for event in batch:
            message = event.message
            tp = message.tp
            if tp in held:
                continue
            expected = self._next.get(tp)
            if expected is None or message.offset <= expected:
                admitted.append(event)
                self._next[tp] = max(expected or 0, message.offset + 1)
                self._repairs.pop(tp, None)
            elif await self._gap_is_real(tp, expected, message.offset):
                admitted.append(event)
                self._next[tp] = message.offset + 1
            else:
                held[tp] = expected
        for tp, offset in held.items():
            try:
                await self.app.consumer.seek(tp, offset)
            except IllegalStateError:  # revoked meanwhile: its next owner starts from the committed offset
                self.forget([tp])
        return admitted

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
        await self.app.consumer.confirm_gap(tp, expected, offset - 1)  # type: ignore[attr-defined]
        return True


class FatalStop:
    """Stops the worker for an error it must not work around, and remembers why (``run_worker`` exits
    with it).

    From the first such error on, nothing more is processed or committed: the batch that met it is not
    marked processed, every later one is dropped unprocessed (its messages acknowledged without
    counting, so faust's shutdown does not wait for them), and the agent does not crash (its
    supervisor would restart it and go on taking messages while the worker stops).
    """

    def __init__(self, stop: Callable[[], object] = lambda: os.kill(os.getpid(), signal.SIGTERM)) -> None:
        #: How the worker is stopped: by default the way an operator stops it, faust's graceful
        #: shutdown, which commits processed offsets only.
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
        except StoredRecordError as exc:
            self.reason = exc
            log.critical("stopping the worker: %s", exc, exc_info=exc)
            self.stop()
            return False
        return True


async def in_order(stream: StreamT[Any], sequencer: Sequencer, processed: ProcessedMessages, fatal: FatalStop,
                   handle: Callable[[Sequence[EventT[Any]]], Coroutine[Any, Any, None]], batch_max: int,
                   within_s: float) -> None:
    """Hand ``stream``'s batches to ``handle``, each partition in offset order, and mark what it finished
    as processed (only that gets committed): the body of every agent of the worker. Once ``fatal``
    stopped the worker, batches are dropped unprocessed."""
    # faust's StreamT interface lacks take_events; the Stream every agent gets has it.
    async for batch in cast("Stream[Any]", stream).take_events(batch_max, within=within_s):
        if fatal.reason is not None:
            continue
        events = await sequencer.admit(batch)
        if events and await fatal.run(handle(events)):
            processed.mark_processed(events)
