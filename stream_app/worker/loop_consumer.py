"""faust's aiokafka consumer, run on the worker's own event loop instead of a thread of its own.

faust runs aiokafka in a ``mode.ServiceThread``: a second Python thread with its own event loop, reached
through a method queue for every fetch, seek, position and commit (``call_thread``: a future handed to the
thread, resolved back on the main loop). In a worker both threads run Python code, so they take turns on
the GIL: a thread returning from a system call (a socket write, an epoll wait, a signature) while the other
runs Python waits up to the interpreter's switch interval (5 ms) for its turn, at every hop. Every stage
of a decision's way through the worker paid it: one worker on the fleet path at 1,000 events/s (traced
per stage, 2026-12-02) took 11-17 ms from a record's append to the consumer thread holding it and
8-12 ms to have a decision acknowledged, against a 3 ms produce-to-consume round trip on the same
broker; the consumer thread used ~30% of a core to hand a few records at a time across.

Here the same class (faust's ``AIOKafkaConsumerThread``: its aiokafka consumer, fetch, commit, seek and
rebalance listener, unchanged) is started and stopped as a plain ``mode.Service`` on the app's loop, and
``call_thread``/``cast_thread`` are plain awaits. The rebalance listener already reaches the app through
faust's main method queue, a service of the same loop. What the one loop costs: while a batch folds
(at most ``LOOPWARDEN_BATCH_MAX`` records, tens of milliseconds), fetches, heartbeats and commits wait for
it, as every other task of the worker already does; the group's session timeout is seconds.

One setting of that consumer differs from faust's: the longest a fetch waits at the broker for new records
(``FETCH_MAX_WAIT_MS``; faust hard-codes 1,500 ms). aiokafka keeps one fetch in flight per broker, and a
fetch leaves out the partitions whose records it still holds. So the fetch sent while a backlog's records
sat in aiokafka's buffer asked only for partitions with nothing new (the fleet facts, partitions drained
early), and parked at the broker; once the buffered records were taken, those partitions could not be
fetched again until it came back. One worker on a pre-produced backlog (2026-12-03, one broker on
loopback) idled up to 1.5 s after every fetch's ~9 batches: 13,000-14,000 events/s at 0.3 of a core.
With 100 ms (and ``delivery.BUFFERED_POLL_S``) the same probe gives 33,000-36,000 events/s at the same
CPU per event; 20 ms gave the same. What it costs: an idle worker fetches 10 times a second, not 0.7;
worker and broker together used 3.6% of a core idle, against 1.9% (8.2% at 20 ms). New records of a
partition in the parked fetch end it at once, as before.

mode internals this relies on (mode-streaming 0.7.1, faust-streaming 0.15.3; checked at start-up by
``versions``): ``ServiceThread.start``/``stop`` (which start and join the OS thread), its
``_stop_children``/``_stop_futures``/``_stop_exit_stacks`` (no-ops there: its thread runs the defaults),
``_stopped_set``, ``_thread_started``, ``wait_for_shutdown``; ``QueueServiceThread.call_thread``,
``cast_thread`` and ``on_thread_stop`` (stops the method queue, then faust's override the aiokafka
consumer); ``ThreadDelegateConsumer._new_consumer_thread``; faust's ``_create_worker_consumer`` and aiokafka's
``AIOKafkaConsumer._fetch_max_wait_ms`` (read when the consumer starts its fetcher) and ``._fetcher`` (given
``fetch_plan``'s way of deciding what to fetch once started).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from mode import Service
from mode.utils.futures import maybe_async

from . import fetch_plan

#: How long a fetch may wait at the broker for new records (see the module docstring); faust's is 1,500 ms.
FETCH_MAX_WAIT_MS = 100


class LoopConsumerThread(AIOKafkaConsumerThread):
    """faust's aiokafka consumer "thread", started as a service of the caller's event loop (see the module
    docstring)."""

    #: No thread sets the shutdown event: stopping is done when ``stop`` returns.
    wait_for_shutdown = False

    def __init__(self, consumer: Any, *, loop: asyncio.AbstractEventLoop, beacon: Any) -> None:
        # thread_loop is the app's loop: every future and task of the consumer lives on it.
        super().__init__(consumer, loop=loop, thread_loop=loop, beacon=beacon)

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS  # faust passes 1,500; its fetcher takes it at start
        return consumer

    async def on_start(self) -> None:
        await super().on_start()
        consumer: Any = self._consumer
        fetch_plan.install(consumer._fetcher)  # created by the consumer's start

    async def start(self) -> None:
        self._thread_started.set()  # as ServiceThread.start does, for its maybe_start
        await Service.start(self)

    async def stop(self) -> None:
        if self._started.is_set():
            await Service.stop(self)

    async def on_stop(self) -> None:
        # What the thread ran last (ServiceThread._shutdown_thread): the method queue, then the aiokafka
        # consumer (leaving the group).
        await self.on_thread_stop()

    async def _stop_children(self) -> None:
        await self._default_stop_children()

    async def _stop_futures(self) -> None:
        await self._default_stop_futures()

    async def _stop_exit_stacks(self) -> None:
        await self._default_stop_exit_stacks()

    def _stopped_set(self) -> None:
        self._stopped.set()

    async def call_thread(self, fun: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        return await maybe_async(fun(*args, **kwargs))

    async def cast_thread(self, fun: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> None:
        self.add_future(maybe_async(fun(*args, **kwargs)))
