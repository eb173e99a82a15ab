"""Put what an aiokafka producer has queued on the wire from the event loop's next turn.

aiokafka's sender task takes three turns to send a message queued with no linger (its waiter's callback,
its own wake-up, the produce request's task), and each turn waits behind everything else ready on the
loop: a worker's fetches and batches, a runtime's agent tasks and listener. ``SendNow`` does what one pass
of the sender's loop does, with aiokafka's own request coroutine, and wakes the sender when the request is
answered (retries and batches queued meanwhile are the sender's again). Batches still lingering are left
to the sender, so it is harmless with a linger, and a node with a request in flight is skipped as the
sender skips it (one request in flight per node, which an idempotent producer's sequence numbers need).

Used by the worker's decisions producer (``worker.effects.DecisionProducer``) and the SDK's telemetry
publisher (``client.publisher.TelemetryPublisher``). aiokafka 0.14.0's private attributes used (the
worker's ``versions.PINNED``; the ``kafka`` extra pins the same release): ``AIOKafkaProducer._sender``
and ``._message_accumulator``; ``Sender._in_flight``, ``._muted_partitions``, ``._txn_manager`` and
``._send_produce_req``; ``TransactionManager.has_pid``; ``MessageAccumulator.drain_by_nodes``,
``._waiter_future`` and ``.fail_all``. ``supported`` says whether a producer has them all (another
aiokafka release may not): without them a caller leaves sending to aiokafka's sender.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError


def supported(producer: AIOKafkaProducer) -> bool:
    """Whether ``producer`` has the private attributes ``SendNow`` uses."""
    sender = getattr(producer, "_sender", None)
    accumulator = getattr(producer, "_message_accumulator", None)
    return (all(hasattr(sender, name) for name in ("_in_flight", "_muted_partitions", "_txn_manager",
                                                   "_send_produce_req"))
            and all(hasattr(accumulator, name) for name in ("drain_by_nodes", "_waiter_future", "fail_all")))


class SendNow:
    """Sends an aiokafka producer's queued, ready batches at once (see the module docstring)."""

    def __init__(self) -> None:
        #: Produce requests started here (held so they are not garbage-collected mid-flight).
        self._requests: set[asyncio.Future[None]] = set()

    def __call__(self, producer: AIOKafkaProducer) -> None:
        sender: Any = producer._sender
        accumulator: Any = producer._message_accumulator
        txn = sender._txn_manager
        if txn is not None and not txn.has_pid():  # the sender waits for an idempotent producer's id first
            return
        ready, _ = accumulator.drain_by_nodes(ignore_nodes=sender._in_flight, muted_partitions=sender._muted_partitions)
        for node_id, batches in ready.items():
            sender._in_flight.add(node_id)
            sender._muted_partitions.update(batches)
            request = asyncio.ensure_future(sender._send_produce_req(node_id, batches))
            self._requests.add(request)
            request.add_done_callback(functools.partial(self._answered, accumulator))

    def _answered(self, accumulator: Any, request: asyncio.Future[None]) -> None:
        self._requests.discard(request)
        if not request.cancelled() and (error := request.exception()) is not None:
            # what aiokafka's sender does when its own loop fails: every pending send fails with it
            failed = KafkaError("Unexpected error during batch delivery")
            failed.__cause__ = error
            accumulator.fail_all(failed)
        waiter = accumulator._waiter_future  # the sender's turn: batches queued meanwhile, retries
        if not waiter.done():
            waiter.set_result(None)
