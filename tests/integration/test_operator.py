"""Operator overrides end to end: `loopwarden halt|resume` as a user runs it, a real worker, the real
broker. Only commands signed by a configured operator key act; every decision is signed by the worker
and recorded on the alerts topic with who and why."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from stream_app.bus.signing import KeyRing, Signer, generate
from stream_app.bus.wire import encode_operator
from stream_app.core import OperatorCommand

from .workers import REPO, Fleet, consume, decisions_of, produce, run

pytestmark = pytest.mark.integration


def _failing_call(run_id: str, n: int) -> dict[str, Any]:
    return {"run_id": run_id, "event_id": f"{run_id}-{n}", "tool": "search_docs",
            "ts_ms": int(time.time() * 1000) + n, "outcome": "error", "args": {"query": "q3"},
            "result": {"error": "index down"}}


def _cli(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": fleet.bootstrap,
           "LOOPWARDEN_TELEMETRY_TOPIC": fleet.telemetry_topic,
           "LOOPWARDEN_OPERATOR_KEY": str(fleet.keys / "operator.key"), "LOOPWARDEN_OPERATOR": "alice"}
    return subprocess.run([sys.executable, "-m", "stream_app", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60, check=False)


async def _send_forged(fleet: Fleet, key_path: Path) -> None:
    """A resume signed with a key the workers do not trust, written straight to the telemetry topic."""
    command = OperatorCommand("run-op", "resume", "forged-1", "mallory", "let me in", int(time.time() * 1000))
    key, value, headers = encode_operator(command)
    producer = AIOKafkaProducer(bootstrap_servers=fleet.bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(fleet.telemetry_topic, value, key=key,
                                     headers=[*headers, *Signer.from_file(key_path).headers(value)])
    finally:
        await producer.stop()


def test_resume_and_halt_by_operators(kafka_bootstrap: str, tmp_path: Path) -> None:
    fleet = Fleet(kafka_bootstrap, tmp_path, partitions=2)
    fleet.start_worker()
    generate(tmp_path / "mallory", "mallory")
    try:
        run(produce(kafka_bootstrap, fleet.telemetry_topic, [_failing_call("run-op", n) for n in range(4)]))
        assert len(run(consume(kafka_bootstrap, fleet.control_topic, 2, settle=0.5))) == 2  # warning and halt

        run(_send_forged(fleet, tmp_path / "mallory" / "mallory.key"))
        resumed = _cli(fleet, "resume", "run-op", "--reason", "false positive: export job")
        assert resumed.returncode == 0, resumed.stderr
        run(produce(kafka_bootstrap, fleet.telemetry_topic, [_failing_call("run-op", n) for n in range(4, 8)]))
        halted = _cli(fleet, "halt", "run-calm", "--reason", "burning tokens")
        assert halted.returncode == 0, halted.stderr

        control = run(consume(kafka_bootstrap, fleet.control_topic, 6))
        alerts = run(consume(kafka_bootstrap, fleet.alerts_topic, 4))
        dlq = run(consume(kafka_bootstrap, fleet.dlq_topic, 1, settle=0.5))
    finally:
        fleet.stop()

    decisions = decisions_of(control)  # in order per run (one partition each)
    assert [(d["action"], d["verdict"]) for d in decisions if d["run_id"] == "run-op"] == [
        ("advise", "recursion"),
        ("halt", "recursion"),
        ("resume", "operator_resume"),
        ("advise", "recursion"),  # fresh streaks after the resume: warned at the 3rd failure again...
        ("halt", "recursion"),  # ...and halted at the 4th
    ]
    assert [(d["action"], d["verdict"]) for d in decisions if d["run_id"] == "run-calm"] == [
        ("halt", "operator_halt")]
    resume = next(d for d in decisions if d["verdict"] == "operator_resume")
    assert resume["evidence"] | {"command_id": ""} == {
        "operator": "alice", "reason": "false positive: export job", "command_id": "",
        "key_id": KeyRing.from_paths([fleet.keys / "operator.pub"]).key_ids[0]}
    assert resume["trigger_event_id"] == resume["evidence"]["command_id"]
    assert sorted(d["verdict"] for d in decisions_of(alerts)) == sorted(
        d["verdict"] for d in decisions if d["action"] != "advise")  # warnings are for the model, not on-call
    trusted = fleet.trusted_keys()
    assert all(trusted.verify(r.value, r.headers) for r in [*control, *alerts])
    assert [dict(r.headers)["error_field"] for r in dlq] == [b"signature"]
    assert b"unknown_key" in dict(dlq[0].headers)["error"]
