"""Only a processed message may move a committed offset: a guard around a faust-streaming hazard.

faust skips a message that a stream dequeues while flow control is suspended (a rebalance is under way)
or that was fetched in an older consumer generation, and acknowledges it as if it had been processed, so
that lag does not grow (``Stream._py_aiter``, the ``skipped_value`` path). By then the rebalance has
cleared the partition's acknowledgement list and forgotten its committed offset, so the stale
acknowledgement becomes the head of the new generation's list and the next commit jumps past offsets
the worker is only about to re-process; a crash in that window loses those events for good. Seen as
halts one call late in ``make chaos`` (a worker SIGKILLed 1.3 s into its start-up rebalances).

``install`` makes the app's consumer count an acknowledgement only for messages that a batch handler
``mark_processed``; a skipped message is marked acknowledged (so nothing waits for it) but never enters
the commit bookkeeping, and the new generation fetches it again from the committed offset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any
from weakref import WeakSet

import faust
from faust.transport.drivers.aiokafka import Consumer
from faust.types import EventT, Message
from faust.types.tuples import ack_lock
from mode.utils.futures import notify


class ProcessedMessages:
    """The messages a handler finished with, until the consumer has counted their acknowledgement."""

    def __init__(self, topics: Iterable[str], on_skipped: Callable[[], object]) -> None:
        #: Topics whose acknowledgements are guarded (the agents' inputs).
        self.topics = frozenset(topics)
        self.on_skipped = on_skipped
        self._done: WeakSet[Message] = WeakSet()

    def mark_processed(self, batch: Iterable[EventT]) -> None:
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


def install(app: faust.App, topics: Iterable[str], on_skipped: Callable[[], object]) -> ProcessedMessages:
    """Give ``app`` a consumer that commits only processed messages of ``topics`` (``on_skipped`` counts
    the others); call before the app starts (its consumer is created on start)."""
    processed = ProcessedMessages(topics, on_skipped)
    consumer_class: Any = type("ProcessedOnlyConsumer", (_GuardedConsumer,), {"processed": processed})
    app.transport.Consumer = consumer_class
    return processed
