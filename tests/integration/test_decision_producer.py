"""The worker's decisions producer against the real broker: ``flush_now`` writes queued messages to the
broker before it returns (aiokafka's sender takes three turns of the event loop; without a connection,
the loop's next turn), and loses, reorders or stalls nothing around aiokafka's own sender."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from aiokafka.producer.sender import SendProduceReqHandler
from aiokafka.structs import TopicPartition

pytest.importorskip("faust")

from stream_app.bus.kafka import KafkaClientConfig
from stream_app.core.contract import Decision
from stream_app.worker.delivery import ProducerFailed
from stream_app.worker.effects import DecisionProducer, Effects

pytestmark = pytest.mark.integration


def _in_flight(producer: DecisionProducer) -> int:
    """Requests written to the broker connections and not answered yet."""
    aio: Any = producer._producer
    return sum(len(conn._requests) for conn in aio.client._conns.values())


@contextlib.asynccontextmanager
async def _warm(bootstrap: str, topic: str) -> AsyncIterator[tuple[DecisionProducer, Any]]:
    """A started decisions producer (and its aiokafka producer) with the broker's connection and ``topic``'s
    metadata in place: one message sent and acknowledged, and the sender idle again."""
    producer = DecisionProducer(KafkaClientConfig(bootstrap))
    aio: Any = await producer.start()
    try:
        await (await producer.send(topic, b"warm", b"up", []))
        await asyncio.sleep(0.05)
        yield producer, aio
    finally:
        await producer.stop()


async def _read(bootstrap: str, topic: str, count: int) -> list[bytes]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        values: list[bytes] = []
        async with asyncio.timeout(20):
            while len(values) < count:
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    values.extend(record.value for record in records)
        return values
    finally:
        await consumer.stop()


@pytest.mark.parametrize("flush", [True, False])
async def test_a_flushed_send_is_on_the_wire_when_the_flush_returns(
        kafka_bootstrap: str, topic_factory: Callable[..., str], flush: bool) -> None:
    topic = topic_factory()
    async with _warm(kafka_bootstrap, topic) as (producer, _):
        assert _in_flight(producer) == 0
        sent = await producer.send(topic, b"run-1", b"halt", [])
        if flush:
            assert producer.flush_now() is False  # written here: nothing left for the loop's next turn
        assert _in_flight(producer) == (1 if flush else 0)
        await asyncio.sleep(0)
        assert _in_flight(producer) == (1 if flush else 0)  # without the flush the sender needs 3 turns
        metadata = await asyncio.wait_for(sent, 10)
        assert metadata.offset == 1


async def test_without_a_connection_the_flush_leaves_the_request_to_aiokafka_for_the_next_turn(
        kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    """A closed connection (a broker restart, an idle timeout) is aiokafka's to open again: the request goes
    through its own task, written once the connection is up, and delivered."""
    topic = topic_factory()
    async with _warm(kafka_bootstrap, topic) as (producer, aio):
        for conn in list(aio.client._conns.values()):
            conn.close()
        sent = await producer.send(topic, b"run-1", b"halt", [])
        assert producer.flush_now() is True
        assert _in_flight(producer) == 0  # not written yet
        assert (await asyncio.wait_for(sent, 10)).offset == 1
        second = await producer.send(topic, b"run-2", b"halt", [])
        assert producer.flush_now() is False  # the connection is back: written at once
        assert (await asyncio.wait_for(second, 10)).offset == 2


async def test_flushed_and_unflushed_sends_all_arrive_in_order(
        kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    """Two tasks send to one partition, one flushing after every few sends, while aiokafka's sender
    sends the rest: one request in flight per broker at a time, whoever sends it, so nothing is
    reordered, and every send is acknowledged (a request the flush started wakes the sender for what
    was queued meanwhile)."""
    topic = topic_factory()
    producer = DecisionProducer(KafkaClientConfig(kafka_bootstrap))
    await producer.start()
    order: list[bytes] = []

    async def sender(name: str, flush_every: int) -> list[asyncio.Future[Any]]:
        pending = []
        for i in range(300):
            value = f"{name}-{i}".encode()
            order.append(value)
            pending.append(await producer.send(topic, name.encode(), value, []))
            if flush_every and i % flush_every == 0:
                producer.flush_now()
            if i % 50 == 0:
                await asyncio.sleep(0)
        return pending

    try:
        flushed, plain = await asyncio.gather(sender("a", 3), sender("b", 0))
        results = await asyncio.wait_for(asyncio.gather(*flushed, *plain), 30)
        assert len(results) == 600
    finally:
        await producer.stop()
    assert await _read(kafka_bootstrap, topic, 600) == order


async def test_a_send_queued_behind_a_flushed_request_goes_out_when_it_is_answered(
        kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    """aiokafka's sender keeps one request in flight per broker; the one the flush started is not its
    own task, so its answer must wake the sender for what was queued meanwhile (else that waits for the
    next send, or forever)."""
    topic = topic_factory()
    producer = DecisionProducer(KafkaClientConfig(kafka_bootstrap))
    await producer.start()
    try:
        await (await producer.send(topic, b"warm", b"up", []))
        first = await producer.send(topic, b"run-1", b"halt", [])
        producer.flush_now()  # on the wire
        second = await producer.send(topic, b"run-2", b"halt", [])  # the broker is busy: queued
        assert (await asyncio.wait_for(first, 10)).offset == 1
        assert (await asyncio.wait_for(second, 10)).offset == 2
    finally:
        await producer.stop()


async def test_a_flushed_request_in_flight_at_stop_is_delivered(
        kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    topic = topic_factory()
    producer = DecisionProducer(KafkaClientConfig(kafka_bootstrap))
    await producer.start()
    sent = [await producer.send(topic, b"run-1", f"decision-{i}".encode(), []) for i in range(5)]
    producer.flush_now()
    await producer.stop()  # the batch in hand at a worker's stop publishes like this
    assert all(future.done() and future.exception() is None for future in sent)
    assert await _read(kafka_bootstrap, topic, 5) == [f"decision-{i}".encode() for i in range(5)]


async def test_a_write_on_a_broken_connection_is_retried_by_aiokafka(
        kafka_bootstrap: str, topic_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket refuses the flush's write (aiokafka closes the connection and raises): the batch is
    re-queued as aiokafka's handler does with a failed send, goes out again on a new connection, and is
    delivered once."""
    topic = topic_factory()
    async with _warm(kafka_bootstrap, topic) as (producer, aio):
        (conn,) = aio.client._conns.values()

        def refused(data: bytes) -> None:
            raise ConnectionResetError("reset by peer")

        monkeypatch.setattr(conn._writer, "write", refused)
        sent = await producer.send(topic, b"run-1", b"halt", [])
        assert producer.flush_now() is False
        assert not conn.connected()
        assert (await asyncio.wait_for(sent, 10)).offset == 1
    assert await _read(kafka_bootstrap, topic, 2) == [b"up", b"halt"]


@pytest.mark.parametrize("connected", [True, False])
async def test_a_request_failing_unexpectedly_fails_the_producer_for_good(
        kafka_bootstrap: str, topic_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch,
        connected: bool) -> None:
    """A flushed request that raises what aiokafka does not handle (a bug: its sender's own loop would
    die of it) fails every pending send, as aiokafka does; from then on a send raises ``ProducerFailed``,
    which stops the worker, while a send that may work again (a timeout) stays a plain ``KafkaError``.
    Whether the request was written by the flush (``connected``) or left to aiokafka's task."""
    topic = topic_factory()
    producer = DecisionProducer(KafkaClientConfig(kafka_bootstrap))
    aio: Any = await producer.start()
    try:
        await (await producer.send(topic, b"warm", b"up", []))
        await asyncio.sleep(0.05)

        def broken(*args: Any) -> None:
            raise RuntimeError("unexpected")

        if connected:
            monkeypatch.setattr(SendProduceReqHandler, "handle_response", broken)
        else:
            for conn in list(aio.client._conns.values()):
                conn.close()

            async def broken_task(node_id: int, batches: Any) -> None:
                broken()

            aio._sender._send_produce_req = broken_task
        sent = await producer.send(topic, b"run-1", b"halt", [])
        assert producer.flush_now() is (not connected)
        with pytest.raises(KafkaError, match="Unexpected error during batch delivery"):
            await asyncio.wait_for(sent, 10)
        with pytest.raises(ProducerFailed, match="failed for good"):
            await producer.send(topic, b"run-2", b"halt", [])
        with pytest.raises(ProducerFailed):
            await producer.send_to(topic, 0, b"facts")
    finally:
        aio._message_accumulator._pending_batches.clear()  # failed above: nothing left to deliver at stop
        await producer.stop()


async def test_flush_returns_with_the_request_written(kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    """``flush`` returns with its request written: the caller (a batch) goes on, and the next batch folds, only
    once its decisions are on the wire."""
    topic = topic_factory()
    async with _warm(kafka_bootstrap, topic) as (producer, _):
        sent = await producer.send(topic, b"run-1", b"halt", [])
        await producer.flush()
        assert _in_flight(producer) == 1  # no other turn of the loop ran since
        assert (await asyncio.wait_for(sent, 10)).offset == 1


async def test_a_batchs_decisions_are_on_the_wire_when_publishing_returns(
        kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    """``Effects._publish`` (a batch's decisions) returns once their produce request is written, so a next
    batch already fetched does not fold first (it did: the decisions then waited for that batch too)."""
    control, alerts = topic_factory(), topic_factory()
    producer = DecisionProducer(KafkaClientConfig(kafka_bootstrap))
    await producer.start()
    effects: Any = Effects.__new__(Effects)
    effects.topics = SimpleNamespace(control=SimpleNamespace(get_topic_name=lambda: control),
                                     alerts=SimpleNamespace(get_topic_name=lambda: alerts))
    effects.decisions, effects.signer, effects.event_source = producer, None, "/test"
    halt = Decision(run_id="run-1", action="halt", verdict="recursion", trigger_event_id="e-4", decision_id="d-1",
                    ts_ms=1_764_000_000_000, reason="the same failing call 4 times")
    try:
        for topic in (control, alerts):  # metadata known: no send waits for it (the sender would go meanwhile)
            await (await producer.send(topic, b"warm", b"up", []))
        await asyncio.sleep(0.05)
        pending = await effects._publish([halt])
        assert len(pending) == 2  # control and alerts: one request
        assert _in_flight(producer) == 1
        await asyncio.wait_for(asyncio.gather(*pending), 10)
    finally:
        await producer.stop()


async def test_a_burst_of_decisions_is_queued_while_a_request_is_in_flight(
        kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    """aiokafka keeps one open record batch per partition, and a send that finds it full waits until the broker
    answered the request in flight. A batch's decisions must not: 100 decisions of ~1.2 KB to one partition (a
    big batch's parts, on a topic of few partitions) are all queued in the turn of the loop they are sent in,
    while the request of the ones before is in flight; all arrive, in order."""
    topic = topic_factory()
    async with _warm(kafka_bootstrap, topic) as (producer, _):
        first = await producer.send(topic, b"run-0", b"first", [])
        assert producer.flush_now() is False
        assert _in_flight(producer) == 1
        values = [f"{i:04d}".encode() * 300 for i in range(100)]

        async def burst() -> list[asyncio.Future[Any]]:
            return [await producer.send(topic, b"run-1", value, [("ce_id", b"d-%d" % i)])
                    for i, value in enumerate(values)]

        queued = asyncio.ensure_future(burst())
        await asyncio.sleep(0)  # the burst's one turn
        assert queued.done()  # no send waited for the request in flight
        assert _in_flight(producer) == 1
        producer.flush_now()
        await asyncio.wait_for(asyncio.gather(first, *queued.result()), 20)
    assert await _read(kafka_bootstrap, topic, 102) == [b"up", b"first", *values]
