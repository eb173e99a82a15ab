"""``fetch_plan``: aiokafka's fetcher deciding what to fetch, against the real broker's metadata, decides
what aiokafka's own ``_get_actions_per_node`` decides in every state a partition can be in, waits on one
future for all paused partitions, and a consumer with it still fetches and wakes when a partition
resumes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.consumer.fetcher import Fetcher
from aiokafka.producer import AIOKafkaProducer
from aiokafka.structs import TopicPartition

from stream_app.worker import fetch_plan

pytestmark = pytest.mark.integration

PARTITIONS = 4


def _comparable(actions: tuple[Any, ...]) -> tuple[Any, ...]:
    """A ``_get_actions_per_node`` result without the order the fetch requests' partitions were shuffled
    into, and without the futures (compared apart)."""
    requests, awaiting_reset, backoff, invalid_metadata, _ = actions
    fetch = {node: sorted((topic, sorted(parts)) for topic, parts in request.topics) for node, request in requests}
    return fetch, {node: sorted(tps) for node, tps in awaiting_reset.items()}, backoff, invalid_metadata


@pytest.fixture
async def stopped_fetcher(kafka_bootstrap: str, topic_factory: Callable[..., str]
                          ) -> AsyncIterator[tuple[AIOKafkaConsumer, Fetcher, list[TopicPartition]]]:
    """A consumer assigned two topics' partitions at their ends, its fetch routine stopped (the test
    sets the fetcher's state by hand), aiokafka's method and fetch_plan's side by side."""
    topics = [topic_factory(partitions=PARTITIONS) for _ in range(2)]
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=None, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for topic in topics for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        for tp in tps:
            await consumer.position(tp)
        fetcher: Any = consumer._fetcher
        fetcher._fetch_task.cancel()
        await asyncio.gather(fetcher._fetch_task, return_exceptions=True)
        fetcher._records.clear()
        fetcher._in_flight.clear()
        fetch_plan.install(fetcher)
        yield consumer, fetcher, tps
    finally:
        await consumer.stop()


def _both(fetcher: Any, assignment: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    return Fetcher._get_actions_per_node(fetcher, assignment), fetcher._get_actions_per_node(assignment)


async def test_it_decides_what_aiokafka_decides_in_every_state_of_a_partition(
        stopped_fetcher: tuple[AIOKafkaConsumer, Any, list[TopicPartition]]) -> None:
    consumer, fetcher, tps = stopped_fetcher
    assignment = consumer._subscription.subscription.assignment
    node = fetcher._client.cluster.leader_for_partition(tps[0])

    theirs, ours = _both(fetcher, assignment)  # every partition fetchable
    assert _comparable(ours) == _comparable(theirs)
    assert len(ours[0]) == 1 and ours[4] == theirs[4] == []

    consumer.pause(*tps[PARTITIONS:])  # the second topic paused (as a recovered table's changelog)
    theirs, ours = _both(fetcher, assignment)
    assert _comparable(ours) == _comparable(theirs)
    assert len(theirs[4]) == PARTITIONS and len(ours[4]) == 1  # one future stands for the four
    fetched = sorted((tp.partition, assignment.state_value(tp).position, fetcher._max_partition_fetch_bytes)
                     for tp in tps[:PARTITIONS])
    assert _comparable(ours)[0] == {node: [(tps[0].topic, fetched)]}  # the first topic's, from where it is

    fetcher._in_flight.add(node)  # a fetch in flight to the node: nothing to do, nothing to wait on
    theirs, ours = _both(fetcher, assignment)
    assert _comparable(ours) == _comparable(theirs) == ({}, {}, fetcher._fetcher_timeout, False)
    assert ours[4] == theirs[4] == []
    fetcher._in_flight.clear()

    class Buffered:  # records still held for the user: a backoff, and no fetch to their node
        def calculate_backoff(self) -> float:
            return 0.25

    fetcher._records[tps[1]] = Buffered()
    theirs, ours = _both(fetcher, assignment)
    assert _comparable(ours) == _comparable(theirs) == ({}, {}, 0.25, False)
    del fetcher._records[tps[1]]

    assignment.state_value(tps[2]).await_reset(0)  # a position to look up: the leader resets it first
    theirs, ours = _both(fetcher, assignment)
    assert _comparable(ours) == _comparable(theirs)
    assert _comparable(ours)[1] == {node: [tps[2]]} and ours[0] == []


async def test_the_one_future_is_done_when_any_paused_partition_resumes_and_then_stands_for_the_rest(
        stopped_fetcher: tuple[AIOKafkaConsumer, Any, list[TopicPartition]]) -> None:
    consumer, fetcher, tps = stopped_fetcher
    assignment = consumer._subscription.subscription.assignment
    consumer.pause(*tps[PARTITIONS:])
    (first,) = fetcher._get_actions_per_node(assignment)[4]
    assert fetcher._get_actions_per_node(assignment)[4] == [first]  # the same one while nothing changed
    assert not first.done()
    consumer.resume(tps[-1])
    await asyncio.sleep(0)
    assert first.done()  # the routine wakes: a partition can be fetched again
    (second,) = fetcher._get_actions_per_node(assignment)[4]
    assert second is not first and not second.done()  # the three still paused: a fresh future, not done
    consumer.resume(*tps[PARTITIONS:-1])
    await asyncio.sleep(0)
    assert second.done()
    assert fetcher._get_actions_per_node(assignment)[4] == []


async def test_a_resume_seen_after_the_set_changed_does_not_wake_the_new_future(
        stopped_fetcher: tuple[AIOKafkaConsumer, Any, list[TopicPartition]]) -> None:
    consumer, fetcher, tps = stopped_fetcher
    assignment = consumer._subscription.subscription.assignment
    consumer.pause(*tps[PARTITIONS:])
    fetcher._get_actions_per_node(assignment)
    consumer.resume(tps[-1])  # its future's callback queued, not run yet
    (rest,) = fetcher._get_actions_per_node(assignment)[4]  # the set without it, at once
    await asyncio.sleep(0)
    assert not rest.done()  # the three are still paused: the routine sleeps on


async def test_a_consumer_with_it_fetches_and_wakes_when_a_paused_partition_resumes(
        kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    topic = topic_factory(partitions=2)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await producer.start()
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=None, enable_auto_commit=False,
                                fetch_max_wait_ms=100)
    await consumer.start()
    try:
        fetch_plan.install(consumer._fetcher)
        tps = [TopicPartition(topic, 0), TopicPartition(topic, 1)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        consumer.pause(tps[1])
        for p in (0, 1):
            await producer.send_and_wait(topic, f"m{p}".encode(), partition=p)
        got: list[tuple[int, bytes | None]] = []
        async with asyncio.timeout(15):
            while not got:
                got += [(r.partition, r.value) for rs in (await consumer.getmany(timeout_ms=200)).values() for r in rs]
            assert got == [(0, b"m0")]
            await asyncio.sleep(0.5)  # the paused partition stays unfetched
            assert not any((await consumer.getmany(timeout_ms=100)).values())
            consumer.resume(tps[1])
            while len(got) < 2:
                got += [(r.partition, r.value) for rs in (await consumer.getmany(timeout_ms=200)).values() for r in rs]
        assert got == [(0, b"m0"), (1, b"m1")]
        # this broker is asked with the hand-encoded request (version 11), not aiokafka's generic one
        versions = next(conn for conn in consumer._client._conns.values())._versions
        assert type(fetch_plan.FastFetchRequest(100, 1, 1024, 0, []).prepare(versions)) is fetch_plan._FetchV11
    finally:
        await consumer.stop()
        await producer.stop()
