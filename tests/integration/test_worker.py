"""The fleet worker against the real broker: same decisions as replay, DLQ, metrics, recovery, scale-out."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
import rocksdict
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

from stream_app.bus.wire import header
from stream_app.client import Guard, KafkaClientConfig, RunHalted
from stream_app.core import Detector, RunTable, decode_event
from stream_app.devtools.fleet_sim import simulate_fleet

from .workers import Fleet, consume, decisions_of, produce, produce_raw, run

pytestmark = pytest.mark.integration

BAD_MESSAGES: list[tuple[bytes | None, bytes, str]] = [
    (b"run-bad-1", b"{not json", "json"),
    (b"run-bad-2", b"[1, 2, 3]", "payload"),
    (b"run-bad-3", orjson.dumps({"run_id": "run-bad-3", "event_id": "e", "tool": "t", "ts_ms": "noon",
                                 "outcome": "error", "args": {}, "result": 1}), "ts_ms"),
    (b"run-bad-4", orjson.dumps({"run_id": "run-bad-4", "event_id": "e", "tool": "t", "ts_ms": 1,
                                 "outcome": "exploded", "args": {}, "result": 1}), "outcome"),
    (b"run-bad-5", b"{" + b'"pad": "' + b"x" * 100_000 + b'"}', "payload"),
]


def replay_decisions(stream: list[dict[str, Any]]) -> list[dict[str, Any]]:
    table = RunTable(Detector())
    return [d.to_control() for raw in stream for d in table.observe(decode_event(raw)).decisions]


@pytest.fixture(scope="module")
def corpus_run(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One worker fed a mixed corpus (with redeliveries), bad messages in the middle, and a wrongly keyed
    event; everything it wrote, collected."""
    fleet = Fleet(kafka_bootstrap, tmp_path_factory.mktemp("corpus"),
                  settings={"max_event_bytes": 65536})
    worker = fleet.start_worker()
    try:
        _, stream = simulate_fleet(150, seed=21)
        misrouted = [_failing_call("run-misrouted", n) for n in range(5)]
        expected = replay_decisions(stream + misrouted)
        half = len(stream) // 2
        run(produce(kafka_bootstrap, fleet.telemetry_topic, stream[:half]))
        run(produce_raw(kafka_bootstrap, fleet.telemetry_topic, [(k, v) for k, v, _ in BAD_MESSAGES]))
        run(produce(kafka_bootstrap, fleet.telemetry_topic, stream[half:]))
        # A runtime that keys by its agent name: the worker re-keys by run id and still halts the run.
        run(produce_raw(kafka_bootstrap, fleet.telemetry_topic, [(b"agent-7", orjson.dumps(e)) for e in misrouted]))
        control = run(consume(kafka_bootstrap, fleet.control_topic, len(expected)))
        alerts = run(consume(kafka_bootstrap, fleet.alerts_topic,
                             sum(d["action"] == "halt" for d in expected), settle=0.5))
        dlq = run(consume(kafka_bootstrap, fleet.dlq_topic, len(BAD_MESSAGES), settle=0.5))
        time.sleep(1.0)  # let the metrics of the last batch land
        metrics = worker.metrics()
        return {"stream": stream + misrouted, "expected": expected, "control": control, "alerts": alerts, "dlq": dlq,
                "metrics": metrics, "log": worker.log_tail()}
    finally:
        fleet.stop()


def test_fleet_decisions_equal_replay_decisions(corpus_run: dict[str, Any]) -> None:
    """Same input, same decisions: every control message equals the replay CLI's, none missing, none extra,
    and each run's decisions arrive in the order replay made them."""
    got = decisions_of(corpus_run["control"])
    expected = corpus_run["expected"]
    key = lambda d: (d["run_id"], d["ts_ms"], d["decision_id"])  # noqa: E731
    missing = [key(d) for d in expected if d not in got]
    extra = [key(d) for d in got if d not in expected]
    assert (missing, extra) == ([], []), corpus_run["log"]
    assert sorted(got, key=key) == sorted(expected, key=key)
    for run_id in {d["run_id"] for d in expected}:
        assert [d["decision_id"] for d in got if d["run_id"] == run_id] == [
            d["decision_id"] for d in expected if d["run_id"] == run_id]


def test_control_messages_are_binary_cloudevents_keyed_by_run(corpus_run: dict[str, Any]) -> None:
    for record in corpus_run["control"]:
        decision = orjson.loads(record.value)
        assert record.key == decision["run_id"].encode()
        assert header(record.headers, "ce_specversion") == b"1.0"
        assert header(record.headers, "ce_id") == decision["decision_id"].encode()
        assert header(record.headers, "ce_type") == f"dev.loopwarden.{decision['action']}".encode()
        assert header(record.headers, "content-type") == b"application/json"
        traceparent = header(record.headers, "ce_traceparent")
        if "trace_id" in decision:
            assert traceparent == f"00-{decision['trace_id']}-{decision['span_id']}-01".encode()
        else:
            assert traceparent is None


def test_halts_reach_the_alerts_topic(corpus_run: dict[str, Any]) -> None:
    """On-call people see every halt, with its reason and evidence."""
    halts = [d for d in corpus_run["expected"] if d["action"] == "halt"]
    alerts = decisions_of(corpus_run["alerts"])
    assert sorted(a["decision_id"] for a in alerts) == sorted(h["decision_id"] for h in halts)
    assert all(a["reason"] and a["evidence"]["tool"] for a in alerts)


def test_bad_input_lands_in_the_dlq_with_its_reason(corpus_run: dict[str, Any]) -> None:
    """Malformed messages go to the DLQ with the reason in a header, and the worker kept going (the
    decisions after them arrived, see the parity test)."""
    dlq = sorted(corpus_run["dlq"], key=lambda r: r.key)  # keyed like the input, so spread over partitions
    assert [r.key for r in dlq] == [k for k, _, _ in BAD_MESSAGES]
    fields = [header(r.headers, "error_field").decode() or None for r in dlq]
    assert fields == [None, None, "ts_ms", "outcome", None]
    errors = [header(r.headers, "error").decode() for r in dlq]
    assert errors[0].startswith("not JSON")
    assert "must be a JSON object" in errors[1]
    assert "over the 65536-byte limit" in errors[4]
    assert all(header(r.headers, "source_offset") for r in dlq)


def test_metrics_match_what_was_processed(corpus_run: dict[str, Any]) -> None:
    """The metrics endpoint counts events by outcome, decisions by action and verdict, the DLQ, and
    redeliveries, with the values the corpus implies."""
    metrics, stream, expected = corpus_run["metrics"], corpus_run["stream"], corpus_run["expected"]
    unique = {e["event_id"]: e for e in stream}
    for outcome, count in Counter(e["outcome"] for e in unique.values()).items():
        assert metrics[f'loopwarden_events_total{{outcome="{outcome}"}}'] == count
    assert metrics["loopwarden_duplicate_events_total"] == len(stream) - len(unique)
    for (action, verdict), count in Counter((d["action"], d["verdict"]) for d in expected).items():
        assert metrics[f'loopwarden_decisions_total{{action="{action}",verdict="{verdict}"}}'] == count
    assert sum(v for k, v in metrics.items() if k.startswith("loopwarden_dlq_total")) == len(BAD_MESSAGES)
    assert metrics["loopwarden_rekeyed_total"] == 5
    assert metrics["loopwarden_decision_latency_seconds_count"] == len(expected)
    assert metrics["loopwarden_runs_tracked"] == len({e["run_id"] for e in stream})  # exact, not an estimate
    # read from end offsets every 0.5 s: every partition reported, nothing left to process
    assert {k: v for k, v in metrics.items() if k.startswith("loopwarden_consumer_lag{")} == {
        f'loopwarden_consumer_lag{{partition="{p}"}}': 0 for p in range(4)}


def _failing_call(run_id: str, n: int) -> dict[str, Any]:
    return {"run_id": run_id, "event_id": f"{run_id}-{n}", "tool": "search_docs", "ts_ms": 1_764_000_000_000 + n,
            "outcome": "error", "args": {"query": "q3", "attempt": n}, "result": {"error": "index down"}}


def _wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


@pytest.mark.parametrize(("local_state", "sweep"), [("fresh", True), ("kept", True), ("fresh", False)])
def test_state_survives_a_killed_worker(kafka_bootstrap: str, tmp_path: Path, local_state: str, sweep: bool) -> None:
    """A worker SIGKILLed after the 2nd identical failing call; a new worker warns on the 3rd call and
    halts the run on the 4th, each exactly once: with fresh local state only the changelog can tell it;
    with the killed worker's RocksDB kept, recovery resumes from the offset persisted there. With the
    sweep off, only the commit writes the records the batches kept: its offsets then never pass them."""
    fleet = Fleet(kafka_bootstrap, tmp_path, partitions=2, settings={} if sweep else {"evict_scan_per_sweep": 0})
    first = fleet.start_worker()
    try:
        run(produce(kafka_bootstrap, fleet.telemetry_topic, [_failing_call("run-k", n) for n in (1, 2)]))
        _wait_for(lambda: first.metrics().get('loopwarden_events_total{outcome="error"}') == 2)
        time.sleep(1.5)  # past a commit interval, so the changelog holds the state
        first.kill()
        fleet.start_worker(index=0 if local_state == "kept" else None)
        run(produce(kafka_bootstrap, fleet.telemetry_topic, [_failing_call("run-k", n) for n in (3, 4, 5, 6)]))
        decisions = decisions_of(run(consume(kafka_bootstrap, fleet.control_topic, 2, settle=3.0)))
    finally:
        fleet.stop()
    assert [(d["action"], d["verdict"], d["trigger_event_id"]) for d in decisions] == [
        ("advise", "recursion", "run-k-3"), ("halt", "recursion", "run-k-4")]


async def _read_all(bootstrap: str, topic: str) -> list[ConsumerRecord[bytes, bytes]]:
    """Every record of ``topic``'s partition 0, up to its end offset now."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        records: list[ConsumerRecord[bytes, bytes]] = []
        while await consumer.position(tp) < end:
            records.extend((await consumer.getmany(tp, timeout_ms=1000)).get(tp, []))
        return records
    finally:
        await consumer.stop()


def test_the_changelog_holds_the_stored_runs_and_recovery_resumes_after_its_last_record(
        kafka_bootstrap: str, tmp_path: Path) -> None:
    """The runs' changelog, sent a batch of records per partition, holds every stored run's last value in
    order, and the offset persisted in RocksDB (where recovery resumes) is its last record's, not the
    batch's first or one past it."""
    fleet = Fleet(kafka_bootstrap, tmp_path, partitions=1, settings={"batch_max": 50})
    worker = fleet.start_worker()
    try:
        _, stream = simulate_fleet(300, seed=5)
        done = 0
        for third in (stream[::3], stream[1::3], stream[2::3]):  # several batches, several changelog batches each
            run(produce(kafka_bootstrap, fleet.telemetry_topic, third))
            done += len(third)
            _wait_for(lambda done=done: sum(v for k, v in worker.metrics().items()
                                            if k.startswith(("loopwarden_events_total{",
                                                             "loopwarden_duplicate_events_total"))) >= done)
            time.sleep(1.2)  # past a commit: the records kept by its batches written, the changelog acknowledged
    finally:
        fleet.stop()
    changelog = run(_read_all(kafka_bootstrap, fleet.changelog_topic))
    latest = {record.key: record.value for record in changelog}
    db_path = next((tmp_path / fleet.name).rglob("runs-0.db"))
    db = rocksdict.Rdict(str(db_path), options=rocksdict.Options(raw_mode=True),
                         access_type=rocksdict.AccessType.read_only())
    try:
        stored = {key: value for key, value in db.items() if not key.startswith(b"__faust")}
        persisted = db[b"__faust\x00offset__"]
    finally:
        db.close()
    assert len(changelog) > len(stored) > 100  # a run's record written again in later batches
    assert stored == {key: value for key, value in latest.items() if value is not None}
    assert int(persisted) == changelog[-1].offset


def test_two_workers_split_the_partitions_and_halt_each_loop_once(kafka_bootstrap: str, tmp_path: Path) -> None:
    """Two workers in one group share the partitions; every loop of the corpus is halted exactly once."""
    fleet = Fleet(kafka_bootstrap, tmp_path, partitions=4)
    a = fleet.start_worker()
    b = fleet.start_worker()
    try:
        _, stream = simulate_fleet(200, seed=33)
        expected = replay_decisions(stream)
        run(produce(kafka_bootstrap, fleet.telemetry_topic, stream))
        got = decisions_of(run(consume(kafka_bootstrap, fleet.control_topic, len(expected))))
        time.sleep(1.0)
        processed = [sum(v for k, v in w.metrics().items() if k.startswith("loopwarden_events_total{"))
                     for w in (a, b)]
        tracked = [w.metrics()["loopwarden_runs_tracked"] for w in (a, b)]
    finally:
        fleet.stop()
    halts = Counter(d["run_id"] for d in got if d["action"] == "halt")
    assert halts == Counter(d["run_id"] for d in expected if d["action"] == "halt")
    assert set(halts.values()) == {1}
    assert sorted(d["decision_id"] for d in got) == sorted(d["decision_id"] for d in expected)
    assert all(count > 0 for count in processed), processed
    # Each worker counts its active partitions only (each also holds standby copies of the other's).
    assert sum(tracked) == len({e["run_id"] for e in stream}), tracked


def test_silent_runs_are_evicted_in_event_time(kafka_bootstrap: str, tmp_path: Path) -> None:
    """A run silent for longer than run_ttl_ms (event time) is forgotten: the eviction metric counts it
    and its next call starts a fresh streak."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("defaults:\n  run_ttl_ms: 60000\n")
    fleet = Fleet(kafka_bootstrap, tmp_path, partitions=1, settings={"policy_path": policy})
    worker = fleet.start_worker()
    try:
        old = [_failing_call("run-old", n) for n in (1, 2, 3)]
        later = [{**_failing_call(f"run-new-{i}", 1), "ts_ms": 1_764_000_000_000 + 120_000 + i} for i in range(3)]
        run(produce(kafka_bootstrap, fleet.telemetry_topic, old + later))
        _wait_for(lambda: worker.metrics().get("loopwarden_evicted_runs_total", 0) >= 1)
        # Had run-old kept its 3 failures, this 4th identical one would halt it.
        comeback = {**_failing_call("run-old", 4), "ts_ms": 1_764_000_000_000 + 120_010}
        run(produce(kafka_bootstrap, fleet.telemetry_topic, [comeback]))
        _wait_for(lambda: worker.metrics().get('loopwarden_events_total{outcome="error"}') == 7)
        decisions = decisions_of(run(consume(kafka_bootstrap, fleet.control_topic, 2, timeout=3.0, settle=0)))
    finally:
        fleet.stop()
    # Only the warning on run-old's 3rd failure, before it went silent; no halt on its comeback.
    assert [(d["action"], d["trigger_event_id"]) for d in decisions] == [("advise", "run-old-3")]


async def _runaway_through_the_sdk(fleet: Fleet) -> tuple[int, RunHalted, int]:
    """A runaway agent calling a failing tool through Guard.fleet until the guard refuses."""
    executed = 0

    async def search_docs(query: str) -> None:
        nonlocal executed
        executed += 1
        await asyncio.sleep(0.05)  # the tool's own time
        raise RuntimeError("index unavailable")  # not transient: a loop, no pause

    config = KafkaClientConfig(fleet.bootstrap)
    async with Guard.fleet(config, fleet.telemetry_topic, fleet.control_topic,
                           trusted_keys=fleet.trusted_keys()) as guard:
        run_ = guard.run("run-sdk-runaway", agent_id="support-agent")
        for _ in range(100):
            try:
                await run_.call("search_docs", search_docs, {"query": "q3 report"})
            except RuntimeError:
                await asyncio.sleep(0.05)  # the model's turn
            except RunHalted as halted:
                refused_at = executed
                with pytest.raises(RunHalted):
                    await run_.call("search_docs", search_docs, {"query": "q3 report"})
                return refused_at, halted, executed
    raise AssertionError("the runaway was never halted")


def test_runaway_through_the_sdk_is_halted_and_refused(kafka_bootstrap: str, tmp_path: Path) -> None:
    """A runaway published through the SDK is halted by the worker (recursion, on its 4th call), and the
    runtime's guard refuses the next call before the tool runs, and every call after that."""
    fleet = Fleet(kafka_bootstrap, tmp_path, partitions=2)
    fleet.start_worker()
    try:
        refused_at, halted, executed = run(_runaway_through_the_sdk(fleet))
    finally:
        fleet.stop()
    assert halted.verdict == "recursion"
    assert halted.decision["evidence"]["seq"] == 3  # the 4th call triggered it
    assert 4 <= refused_at <= 6, "the guard let the runaway run on long after its halt"
    assert executed == refused_at  # refused calls never reached the tool
