"""The runtime SDK against the real local broker: telemetry out, decisions in, the guard obeying them.

Control messages are written the way the worker writes them (``wire.encode_control`` of a core
``Decision``, signed with a worker key) by a plain aiokafka producer, so these tests need no worker and
mock nothing. Forged, tampered and replayed halts are written the same way, as an attacker with write
access to the control topic would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions
from aiokafka.structs import ConsumerRecord

from scripts.kafka_local import TopicSpec, create_topics
from stream_app.bus.clock import wall_clock_ms
from stream_app.bus.signing import KeyRing, Signer, generate
from stream_app.bus.wire import Headers, encode_control
from stream_app.client import (
    Guard,
    HaltListener,
    KafkaClientConfig,
    KafkaConfigError,
    RunHalted,
    TelemetryBuilder,
    TelemetryPublisher,
)
from stream_app.core import (
    Action,
    Decision,
    Detector,
    RunTable,
    Verdict,
    decision_id,
    decode_event,
    semantic_hash,
)

from .tools import Counted

pytestmark = pytest.mark.integration

TIMEOUT_S = 20.0
SECRET = "card-4111-1111-1111-1111"


def make_decision(
    run_id: str,
    action: Action = "halt",
    verdict: Verdict = "recursion",
    trigger: str = "ev-1",
    **evidence: Any,
) -> Decision:
    """A decision as the detector would make it, triggered now."""
    return Decision(
        run_id=run_id,
        action=action,
        verdict=verdict,
        trigger_event_id=trigger,
        decision_id=decision_id(run_id, trigger, action, verdict),
        ts_ms=wall_clock_ms(),
        reason=f"test {action} of {run_id}",
        evidence={
            "tool": "search_docs",
            "args_hash": "0" * 64,
            "args_verified": True,
            "outcome": "error",
            "result_hash": "1" * 64,
            "count": 4,
            **evidence,
        },
    )


@functools.cache
def keys() -> Path:
    """Key pairs for this module: ``worker`` (trusted by the runtimes here) and ``attacker``."""
    folder = Path(tempfile.mkdtemp(prefix="loopwarden-keys-"))
    for name in ("worker", "attacker"):
        generate(folder, name)
    return folder


def trusted() -> KeyRing:
    return KeyRing.from_paths([keys() / "worker.pub"])


async def produce(bootstrap: str, topic: str, *messages: Decision | bytes,
                  sign: Callable[[bytes], Headers] | None = None) -> None:
    """Write decisions (CloudEvents, as the worker does) or raw bytes (keyed run-x) to ``topic``, signed
    with the worker key unless ``sign`` gives other headers."""
    signer = Signer.from_file(keys() / "worker.key")
    sign = sign or signer.headers
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for message in messages:
            if isinstance(message, Decision):
                key, value, headers = encode_control(message, "/loopwarden/test")
                await producer.send_and_wait(topic, value, key=key, headers=[*headers, *sign(value)])
            else:
                await producer.send_and_wait(topic, message, key=b"run-x", headers=sign(message))
    finally:
        await producer.stop()


async def read(bootstrap: str, topic: str, count: int) -> list[ConsumerRecord[bytes, bytes]]:
    """The first ``count`` records of every partition of ``topic``."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    records: list[ConsumerRecord[bytes, bytes]] = []
    try:
        async with asyncio.timeout(TIMEOUT_S):
            while len(records) < count:
                for batch in (await consumer.getmany(timeout_ms=200)).values():
                    records.extend(batch)
    finally:
        await consumer.stop()
    return records


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait until ``condition()`` holds; fail naming ``what`` after TIMEOUT_S."""
    try:
        async with asyncio.timeout(TIMEOUT_S):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        pytest.fail(f"timed out waiting until {what}")


@pytest.fixture
def topics(topic_factory: Callable[..., str]) -> tuple[str, str]:
    """Fresh (telemetry, control) topics, 3 partitions each."""
    return topic_factory(3, prefix="telemetry"), topic_factory(3, prefix="control")


@pytest.fixture
async def guard(kafka_bootstrap: str, topics: tuple[str, str]) -> AsyncIterator[Guard]:
    async with Guard.fleet(KafkaClientConfig(kafka_bootstrap), *topics, trusted_keys=trusted()) as started:
        yield started


async def test_telemetry_arrives_keyed_by_run_with_client_side_hashes(
    kafka_bootstrap: str, topics: tuple[str, str]
) -> None:
    """Each call becomes one message keyed by its run id, all of a run's in one partition, carrying the
    semantic hashes of arguments and result and not their content; each decodes as telemetry v1."""
    telemetry, _ = topics
    async with Guard.fleet(KafkaClientConfig(kafka_bootstrap), *topics, trusted_keys=trusted()) as guard:
        for run_id in ("run-a", "run-b"):
            run = guard.run(run_id, agent_id="billing-agent")
            await run.call("charge_card", Counted({"charged": SECRET}), {"card": SECRET, "amount": 10})
            await run.call("charge_card", Counted({"charged": SECRET}), {"card": SECRET, "amount": 20})
    assert guard.counters["published"] == 4

    records = await read(kafka_bootstrap, telemetry, 4)
    by_run: dict[bytes, list[ConsumerRecord[bytes, bytes]]] = {}
    for record in records:
        by_run.setdefault(record.key, []).append(record)
    assert sorted(by_run) == [b"run-a", b"run-b"]
    for key, run_records in by_run.items():
        assert len({r.partition for r in run_records}) == 1
        events = [decode_event(orjson.loads(r.value)) for r in run_records]
        assert all(SECRET.encode() not in r.value for r in run_records)
        assert [e.run_id for e in events] == [key.decode()] * 2
        assert [e.seq for e in events] == [0, 1]
        assert [e.args for e in events] == [None, None]
        assert [e.args_hash for e in events] == [
            semantic_hash({"card": SECRET, "amount": 10}),
            semantic_hash({"card": SECRET, "amount": 20}),
        ]
        assert {e.result_hash for e in events} == {semantic_hash({"charged": SECRET})}
        assert {e.agent_id for e in events} == {"billing-agent"}


async def test_flush_returns_once_every_call_so_far_is_on_the_broker(
    kafka_bootstrap: str, topics: tuple[str, str]
) -> None:
    """A guard that goes on (not stopped) waits for its telemetry: calls made while the producer lingers
    (2 s) are not acknowledged yet; after ``flush`` every one is, and readable."""
    telemetry, _ = topics
    config = KafkaClientConfig(kafka_bootstrap)
    async with Guard.fleet(config, *topics, trusted_keys=trusted(), linger_ms=2_000) as guard:
        run = guard.run("run-f", agent_id="billing-agent")
        for amount in range(5):
            await run.call("charge_card", Counted({"charged": 1}), {"amount": amount})
        assert guard.counters["published"] == 0  # lingering: nothing acknowledged yet
        await guard.flush()
        assert guard.counters["published"] == 5 and guard.counters["publish_failed"] == 0
        records = await read(kafka_bootstrap, telemetry, 5)
        assert sorted(orjson.loads(r.value)["seq"] for r in records) == [0, 1, 2, 3, 4]
    await Guard.in_process().flush()  # nothing to wait for


async def test_halt_stops_the_run_cancels_its_task_and_notifies(
    kafka_bootstrap: str, topics: tuple[str, str], guard: Guard
) -> None:
    """A halt on the control topic marks the run halted, fires the callback, cancels the bound task, and
    the next call raises RunHalted without running the tool."""
    _, control = topics
    seen: list[dict[str, Any]] = []
    guard.on_decision(seen.append)
    run = guard.run("run-h")
    bound = asyncio.create_task(asyncio.sleep(3600))
    run.bind_task(bound)
    halt = make_decision("run-h")

    await produce(kafka_bootstrap, control, halt)
    await until(lambda: run.halted, "the run is halted")

    assert seen == [halt.to_control()]
    await asyncio.sleep(0)
    assert bound.cancelled()
    tool = Counted("never")
    with pytest.raises(RunHalted) as raised:
        await run.call("search_docs", tool, {"q": "x"})
    assert tool.calls == 0
    assert raised.value.decision_id == halt.decision_id and raised.value.verdict == "recursion"


async def test_same_decision_delivered_twice_is_applied_once(
    kafka_bootstrap: str, topics: tuple[str, str], guard: Guard
) -> None:
    """A redelivered decision (same decision id) is counted as a duplicate and changes nothing."""
    _, control = topics
    seen: list[dict[str, Any]] = []
    guard.on_decision(seen.append)
    guard.run("run-d")
    halt = make_decision("run-d")

    await produce(kafka_bootstrap, control, halt, halt)
    await until(lambda: guard.counters["duplicate"] == 1, "the second copy is seen")

    assert (guard.counters["applied"], len(seen)) == (1, 1)


async def test_malformed_control_messages_are_counted_and_do_not_stop_the_listener(
    kafka_bootstrap: str, topics: tuple[str, str], guard: Guard
) -> None:
    """Garbage, a non-object and an object without a decision id are counted; the halt after them applies."""
    _, control = topics
    run = guard.run("run-m")

    await produce(
        kafka_bootstrap,
        control,
        b"\xff not json",
        b"[1, 2, 3]",
        b'{"run_id": "run-m"}',
        make_decision("run-m"),
    )
    await until(lambda: run.halted, "the halt after the malformed messages applies")

    assert guard.counters["malformed"] == 3


async def test_only_a_validly_signed_recent_halt_stops_a_run(
    kafka_bootstrap: str, topics: tuple[str, str], guard: Guard
) -> None:
    """Written straight to the control topic by a raw producer: a halt signed by another key, one that
    claims the worker's key id, an unsigned one, a tampered one and a replayed old one change nothing
    (each counted by reason); the worker-signed halt after them stops the run."""
    _, control = topics
    run = guard.run("run-s")
    tool = Counted("ok")
    worker, attacker = Signer.from_file(keys() / "worker.key"), Signer.from_file(keys() / "attacker.key")
    halt = make_decision("run-s", trigger="ev-forged")
    await produce(kafka_bootstrap, control, halt, sign=attacker.headers)
    await produce(kafka_bootstrap, control, make_decision("run-s", trigger="ev-claimed"),
                  sign=lambda value: [("lw_key_id", worker.key_id.encode()), attacker.headers(value)[1]])
    await produce(kafka_bootstrap, control, make_decision("run-s", trigger="ev-unsigned"), sign=lambda _: [])
    original = make_decision("run-other", trigger="ev-tampered")
    _, value, headers = encode_control(original, "/loopwarden/test")
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(control, value.replace(b"run-other", b"run-s"), key=b"run-s",
                                     headers=[*headers, *worker.headers(value)])
    finally:
        await producer.stop()
    old = dataclasses.replace(make_decision("run-s", trigger="ev-old"), ts_ms=wall_clock_ms() - 3_600_000)
    await produce(kafka_bootstrap, control, old)
    await until(lambda: guard.counters["expired"] == 1, "the replayed halt is read")

    assert await run.call("search_docs", tool, {"q": "x"}) == "ok"
    assert {k: guard.counters[k] for k in ("unknown_key", "bad_signature", "unsigned", "expired", "applied")} == {
        "unknown_key": 1, "bad_signature": 2, "unsigned": 1, "expired": 1, "applied": 0}
    await produce(kafka_bootstrap, control, make_decision("run-s", trigger="ev-real"))
    await until(lambda: run.halted, "the worker-signed halt applies")
    with pytest.raises(RunHalted):
        await run.call("search_docs", tool, {"q": "x"})
    assert tool.calls == 1


async def test_suppress_hands_back_the_earlier_result(
    kafka_bootstrap: str, topics: tuple[str, str], guard: Guard
) -> None:
    """After the fleet's suppress for (tool, args hash), repeating that call returns the earlier result
    without running the tool, and the repetition is still reported (marked suppressed)."""
    telemetry, control = topics
    run = guard.run("run-s")
    receipt = {"message_id": "m-1"}
    send = Counted(receipt)
    args = {"to": "customer@example.com", "body": "Approved."}
    assert await run.call("send_email", send, args, side_effect=True) is receipt
    args_hash = TelemetryBuilder().args_hash(None, "send_email", args)

    suppress = make_decision(
        "run-s", "suppress", "duplicate_call", tool="send_email", args_hash=args_hash, window_ms=60_000
    )
    await produce(kafka_bootstrap, control, suppress)
    await until(lambda: guard.counters["applied"] == 1, "the suppress applies")

    assert await run.call("send_email", send, args, side_effect=True) is receipt
    assert send.calls == 1
    other = await run.call("send_email", send, {**args, "to": "someone@example.com"}, side_effect=True)
    assert other is receipt and send.calls == 2  # other arguments: not suppressed
    await guard.stop()
    events = [orjson.loads(r.value) for r in await read(kafka_bootstrap, telemetry, 3)]
    assert sorted((e["seq"], e.get("attrs")) for e in events) == [
        (0, None),
        (1, {"suppressed": True}),
        (2, None),
    ]


async def test_halt_for_another_run_does_not_affect_this_one(
    kafka_bootstrap: str, topics: tuple[str, str], guard: Guard
) -> None:
    """A halt keyed to a run this process does not run is ignored."""
    _, control = topics
    run = guard.run("run-mine")

    await produce(kafka_bootstrap, control, make_decision("run-theirs"))
    await until(lambda: guard.counters["ignored"] == 1, "the other run's halt is read")

    assert not run.halted
    tool = Counted("ok")
    assert await run.call("search_docs", tool, {"q": "x"}) == "ok"
    assert tool.calls == 1


async def test_halt_issued_before_start_is_obeyed_after_a_restart(
    kafka_bootstrap: str, topics: tuple[str, str]
) -> None:
    """A runtime restarting within the lookback finds its run halted before the first call: the listener
    rewinds, catches up before start() returns, and parks the halt until the run is created."""
    _, control = topics
    await produce(kafka_bootstrap, control, make_decision("run-restarted"))

    async with Guard.fleet(KafkaClientConfig(kafka_bootstrap), *topics, trusted_keys=trusted(),
                           lookback_ms=60_000) as guard:
        run = guard.run("run-restarted")
        tool = Counted("ok")
        with pytest.raises(RunHalted):
            await run.call("search_docs", tool, {"q": "x"})
        assert tool.calls == 0


async def test_without_lookback_only_new_decisions_count(
    kafka_bootstrap: str, topics: tuple[str, str]
) -> None:
    """lookback_ms=0 starts at the end of the topic: an old halt is not replayed."""
    _, control = topics
    await produce(kafka_bootstrap, control, make_decision("run-old"))

    async with Guard.fleet(KafkaClientConfig(kafka_bootstrap), *topics, trusted_keys=trusted(),
                           lookback_ms=0) as guard:
        assert not guard.run("run-old").halted
        assert set(guard.counters.values()) == {0}


async def test_listener_follows_partitions_added_to_the_control_topic(
    kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    """Partitions added while a runtime runs are picked up (from their start) without losing positions."""
    control = topic_factory(1, prefix="control")
    listener = HaltListener(
        KafkaClientConfig(kafka_bootstrap), control, trusted_keys=trusted(), watch_all=True, metadata_max_age_ms=300
    )
    async with listener:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            await admin.create_partitions({control: NewPartitions(total_count=3)})
        finally:
            await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        await producer.start()
        try:
            signer = Signer.from_file(keys() / "worker.key")
            for partition, run_id in ((2, "run-p2"), (0, "run-p0")):
                key, value, headers = encode_control(make_decision(run_id), "/loopwarden/test")
                await producer.send_and_wait(control, value, key=key, headers=[*headers, *signer.headers(value)],
                                             partition=partition)
        finally:
            await producer.stop()
        await until(lambda: listener.counters["applied"] == 2, "both halts apply")
        assert listener.board.halt_decision("run-p2") is not None


async def test_missing_control_topic_is_reported_at_start(kafka_bootstrap: str) -> None:
    """A wrong control topic name fails start() with the operator's next step, and leaves nothing running."""
    listener = HaltListener(KafkaClientConfig(kafka_bootstrap), "no-such-control-topic", trusted_keys=trusted())
    with pytest.raises(KafkaConfigError, match=r"'no-such-control-topic' does not exist, or this principal may not see it.*Operator action"):
        await listener.start()


async def test_runaway_is_halted_through_the_bus_by_the_core_detector(
    kafka_bootstrap: str, topics: tuple[str, str], guard: Guard
) -> None:
    """The whole loop with the core standing in for the worker: telemetry from the guard, folded by the
    detector, its decision written back as a CloudEvent, and the guard refusing the run's next call.
    The client-side hashes are what the detector compares: the verdict is recursion on verified args."""
    telemetry, control = topics
    run = guard.run("run-loop", agent_id="support-agent")
    tool = Counted(RuntimeError("index unavailable"))
    for _ in range(4):
        with pytest.raises(RuntimeError):
            await run.call("search_docs", tool, {"query": "quarterly report", "nonce": wall_clock_ms()})

    table = RunTable(Detector())
    decisions = [
        d
        for r in await read(kafka_bootstrap, telemetry, 4)
        for d in table.observe(decode_event(orjson.loads(r.value))).decisions
    ]
    assert [(d.action, d.verdict, d.evidence["args_verified"]) for d in decisions] == [
        ("advise", "recursion", True), ("halt", "recursion", True)
    ]
    await produce(kafka_bootstrap, control, *decisions)
    await until(lambda: run.halted, "the detector's halt applies")

    with pytest.raises(RunHalted, match="recursion"):
        await run.call("search_docs", tool, {"query": "quarterly report"})
    assert tool.calls == 4


async def test_publisher_never_stalls_the_agent_when_the_broker_is_down(
    kafka_broker_factory: Callable[..., Any],
) -> None:
    """With the broker gone, publish still returns at once (events wait in the bounded local buffer for
    the broker to come back); a full buffer drops and counts; stop returns after close_timeout_s."""
    broker = kafka_broker_factory().start()
    create_topics(broker.bootstrap, [TopicSpec("telemetry", 1)])
    publisher = TelemetryPublisher(
        KafkaClientConfig(broker.bootstrap), "telemetry", buffer_events=5, close_timeout_s=0.5
    )
    await publisher.start()
    await publisher.publish({"run_id": "run-o", "seq": 0})
    await publisher.flush()
    assert publisher.published == 1
    broker.kill()

    started = time.perf_counter()
    for seq in range(1, 20):
        await publisher.publish({"run_id": "run-o", "seq": seq})
    assert time.perf_counter() - started < 1.0
    assert publisher.failed >= 19 - 5 - 1  # the buffer holds 5, the sender holds at most one more
    started = time.perf_counter()
    await publisher.stop()
    assert time.perf_counter() - started < 2.5
    assert not publisher.started


async def test_missing_telemetry_topic_is_reported_at_start(kafka_bootstrap: str) -> None:
    """A wrong telemetry topic name fails start() instead of the first tool call."""
    publisher = TelemetryPublisher(KafkaClientConfig(kafka_bootstrap), "no-such-telemetry-topic")
    with pytest.raises(KafkaConfigError, match=r"'no-such-telemetry-topic' does not exist, or this principal may not see it.*Operator action"):
        await publisher.start()
    assert not publisher.started


async def test_without_linger_bursts_arrive_complete_and_in_order(
    kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    """With no linger (the halt bench's fleet path), bursts published while a request is in flight (the
    next ones queue behind it) arrive once each, in order, none failed."""
    topic = topic_factory(1)
    publisher = TelemetryPublisher(KafkaClientConfig(kafka_bootstrap), topic, linger_ms=0)
    await publisher.start()
    try:
        for burst in range(40):
            for i in range(burst % 7 + 1):
                await publisher.publish({"run_id": "run-b", "seq": burst * 10 + i})
            await asyncio.sleep(0 if burst % 3 else 0.002)
        await publisher.flush()
    finally:
        await publisher.stop()
    expected = [burst * 10 + i for burst in range(40) for i in range(burst % 7 + 1)]
    assert publisher.published == len(expected) and publisher.failed == 0
    records = await read(kafka_bootstrap, topic, len(expected))
    assert [orjson.loads(record.value)["seq"] for record in records] == expected
