"""Stored run formats across releases, on the real broker: a worker recovers the state an older release
wrote to the changelog, and stops, saying what to do, at a record newer than it can read."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from scripts import kafka_local
from stream_app.core import Detector, RunTable, decode_event
from stream_app.core.stored import FORMAT_VERSION, StoredRun, decode_run, encode_run

from .workers import Fleet, consume, decisions_of, produce, run

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "state"
PARTITIONS = 4  # as the fixture was made


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


async def _produce_at(bootstrap: str, topic: str, records: list[dict[str, Any]]) -> None:
    """Each record to its own partition, in order (the fixture's offsets are reproduced on a fresh topic)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for record in records:
            value = None if record["value"] is None else record["value"].encode()
            await producer.send_and_wait(topic, value, key=record["key"].encode(), partition=record["partition"])
    finally:
        await producer.stop()


def _topics(fleet: Fleet) -> None:
    kafka_local.create_topics(fleet.bootstrap, [kafka_local.TopicSpec(fleet.telemetry_topic, PARTITIONS),
                                                kafka_local.TopicSpec(fleet.changelog_topic, PARTITIONS,
                                                                      compact=True)])


def _call(run_id: str, n: int, tool: str, outcome: str, args: dict[str, Any], result: Any,
          **extra: Any) -> dict[str, Any]:
    return {"schema_version": "1", "run_id": run_id, "event_id": f"{run_id}-{n}", "tool": tool,
            "ts_ms": 1_764_000_000_000 + n * 1000, "seq": n, "outcome": outcome, "args": args, "result": result,
            **extra}


#: What the runtimes send after the upgrade; each only decides right on the recovered state.
AFTER = [
    _call("fx-recursion-4", 3, "search_docs", "error", {"query": "refund"}, {"error": "index down"}),  # 4th: halt
    _call("fx-halted-2", 4, "search_docs", "error", {"query": "q"}, {"error": "down"}),  # halted already
    _call("fx-side-effect-0", 1, "send_email", "error", {"to": "a@example.com", "subject": "hi"},
          {"error": "ETIMEDOUT"}, side_effect=True),  # the repeat of a side effect: suppressed
    _call("fx-cycle-1", 6, "read_file", "success", {"path": "/a.py"}, {"text": "x"}),
    _call("fx-cycle-1", 7, "apply_patch", "error", {"path": "/a.py", "patch": "p"}, {"error": "hunk failed"}),
    _call("fx-dedupe-4", 2, "lookup", "success", {"id": 2}, {"ok": 2}, plan_step=2),  # a resent event id
]


@pytest.mark.parametrize("version", [0, 1])
def test_a_worker_recovers_the_state_of_an_earlier_format(kafka_bootstrap: str, tmp_path: Path,
                                                          version: int) -> None:
    """The changelog and telemetry of an earlier release (format 0: before versioning; format 1: before
    fingerprint streaks), restored on a fresh deployment: the new worker recovers every run from the
    changelog, re-reads the old telemetry as redeliveries (no decision made twice), and the calls after
    the upgrade are decided on the recovered streaks, cycles, side effects, halts and event ids, exactly
    as replay decides them."""
    fixture = FIXTURES / f"v{version}"
    telemetry, changelog = _jsonl(fixture / "telemetry.jsonl"), _jsonl(fixture / "changelog.jsonl")
    assert all(orjson.loads(r["value"]).get("v", 0) == version for r in changelog)  # really that version
    fleet = Fleet(kafka_bootstrap, tmp_path, partitions=PARTITIONS)
    _topics(fleet)
    run(_produce_at(kafka_bootstrap, fleet.changelog_topic, changelog))
    run(_produce_at(kafka_bootstrap, fleet.telemetry_topic, telemetry))
    table = RunTable(Detector())
    for record in telemetry:
        table.observe(decode_event(orjson.loads(record["value"])))
    expected = [d.to_control() for e in AFTER for d in table.observe(decode_event(e)).decisions]
    assert [(d["run_id"], d["verdict"]) for d in expected] == [
        ("fx-recursion-4", "recursion"), ("fx-side-effect-0", "duplicate_call"), ("fx-cycle-1", "cycle")]

    worker = fleet.start_worker()
    try:
        run(produce(kafka_bootstrap, fleet.telemetry_topic, AFTER))
        control = decisions_of(run(consume(kafka_bootstrap, fleet.control_topic, len(expected) + 1, settle=3.0)))
        warnings = [d for d in control if d["action"] == "advise"]
        decided = sorted((d for d in control if d["action"] != "advise"), key=lambda d: d["decision_id"])
        assert [_without_story(d) for d in decided] == sorted(
            map(_without_story, expected), key=lambda d: d["decision_id"]), worker.log_tail()
        # The earlier formats keep no member ids or arguments of a streak: its story starts at the upgrade.
        recursion = next(d["evidence"] for d in decided if d["verdict"] == "recursion")
        assert (recursion["event_ids"], recursion["args_diff"]) == (
            ["fx-recursion-4-0", "fx-recursion-4-3"], "unavailable")
        # The earlier formats keep no record of warnings given (replay gave the cycle's in the old
        # telemetry): the cycle one short of its halt is warned about once more, never a recursion past it.
        assert [(d["run_id"], d["verdict"], d["trigger_event_id"]) for d in warnings] == [
            ("fx-cycle-1", "cycle", "fx-cycle-1-6")]
        time.sleep(1.0)
        metrics = worker.metrics()
        # 17 old messages skipped by their stored offsets, and the resent event id.
        assert metrics["loopwarden_duplicate_events_total"] == len(telemetry) + 1
        written = run(consume(kafka_bootstrap, fleet.changelog_topic, len(changelog) + 4, settle=1.0))
    finally:
        fleet.stop()
    old = {(r["partition"], r["offset"]) for r in changelog}
    rewritten = [orjson.loads(r.value) for r in written if (r.partition, r.offset) not in old]
    assert len(rewritten) >= 4 and all(r["v"] == FORMAT_VERSION for r in rewritten)


def _without_story(decision: dict[str, Any]) -> dict[str, Any]:
    evidence = {k: v for k, v in decision["evidence"].items() if k not in ("event_ids", "args_diff")}
    return {**decision, "evidence": evidence}


def test_a_record_newer_than_the_worker_stops_it_with_the_operator_action(kafka_bootstrap: str,
                                                                          tmp_path: Path) -> None:
    """A worker of an older release that meets a record of a newer format stops (exit status 3) with
    the version and what to do, and commits nothing for the batch that met it."""
    fleet = Fleet(kafka_bootstrap, tmp_path, partitions=PARTITIONS, settings={"log_level": "info"})
    _topics(fleet)
    newer = {**orjson.loads(encode_run(StoredRun(decode_run(None).state, 5))), "v": FORMAT_VERSION + 1}
    key = "run-from-the-future"
    partition = _partition_of(key)
    run(_produce_at(kafka_bootstrap, fleet.changelog_topic,
                    [{"partition": partition, "key": key, "value": orjson.dumps(newer).decode()}]))
    worker = fleet.start_worker()
    run(produce(kafka_bootstrap, fleet.telemetry_topic, [_call(key, n, "search", "error", {"q": n}, {"e": n})
                                                         for n in range(10)]))
    try:
        status = worker.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        fleet.stop()
        pytest.fail(f"the worker kept running:\n{worker.log_tail()}")
    log = worker.log_path.read_text()
    assert status == 3, log[-3000:]
    assert f"format version {FORMAT_VERSION + 1}" in log and "Operator action: a worker of a newer release" in log
    assert "KeyError" not in log
    # Every line the worker wrote, the agent's traceback and faust's and aiokafka's lines included, is one
    # JSON object (LOOPWARDEN_LOG_FORMAT=json, the default).
    records = [orjson.loads(line) for line in log.splitlines()]
    assert any("exc" in r and "StateVersionError" in r["exc"] for r in records)
    assert {r["logger"].split(".")[0] for r in records} >= {"loopwarden", "faust"}
    assert run(_committed(kafka_bootstrap, fleet.name, fleet.telemetry_topic, partition)) in (None, 0)


async def _committed(bootstrap: str, group: str, topic: str, partition: int) -> int | None:
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.structs import TopicPartition

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    found = offsets.get(TopicPartition(topic, partition))
    return None if found is None or found.offset < 0 else int(found.offset)


def _partition_of(key: str) -> int:
    from aiokafka.partitioner import DefaultPartitioner

    partitions = list(range(PARTITIONS))
    return int(DefaultPartitioner()(key.encode(), partitions, partitions))
