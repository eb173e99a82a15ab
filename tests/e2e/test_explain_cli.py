"""``loopwarden explain`` as on-call runs it: from the alerts topic of the real broker, and from a
telemetry file."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from stream_app.bus.wire import encode_control
from tests.notify_support import SOURCE, WORKER_KEYS, as_records, halts, publish, signed

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def _explain(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stream_app", "explain", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_a_halt_is_told_from_the_alerts_topic_and_forged_alerts_are_not(
        kafka_bootstrap: str, topic_factory: Callable[..., str]) -> None:
    decisions = halts()
    loop = next(d for d in decisions if d.verdict == "semantic_loop")
    forged = dataclasses.replace(loop, decision_id="f" * 32, reason="forged: ignore the runbook")
    topic = topic_factory(3, prefix="alerts")
    records = as_records(decisions)
    records.append(signed(encode_control(forged, SOURCE), "stranger"))
    records.append(as_records([loop])[0])  # published twice (at-least-once): told once
    asyncio.run(publish(kafka_bootstrap, topic, records))
    env = {"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "LOOPWARDEN_ALERTS_TOPIC": topic,
           "LOOPWARDEN_WORKER_KEYS": WORKER_KEYS}

    told = _explain(loop.run_id, env=env)
    assert told.returncode == 0, told.stderr
    assert told.stdout.startswith(f"halt semantic_loop run {loop.run_id}")
    assert told.stdout.count("\nhalt ") == 0 and "forged" not in told.stdout
    assert f"  events     {', '.join(loop.evidence['event_ids'])}\n" in told.stdout
    assert "  arguments  session_token: \"***\" -> \"***\" (first call of the streak -> this one)\n" in told.stdout
    assert f"  decision   {loop.decision_id} (trigger {loop.trigger_event_id}" in told.stdout
    assert "1 matching alert(s) skipped" in told.stderr

    as_json = _explain(loop.decision_id, "--json", env=env)
    assert [orjson.loads(line) for line in as_json.stdout.splitlines()] == [loop.to_control()]

    unsigned = _explain(loop.run_id, "--json", env={**env, "LOOPWARDEN_WORKER_KEYS": ""})
    assert len(unsigned.stdout.splitlines()) == 2 and "signatures not checked" in unsigned.stderr

    missing = _explain("no-such-run", env=env)
    assert missing.returncode == 1 and "no decision or run 'no-such-run'" in missing.stderr


def test_a_run_is_told_from_a_telemetry_file_with_its_calls() -> None:
    told = _explain("run-000045", "--telemetry", "schemas/examples/fleet.jsonl")
    assert told.returncode == 0, told.stderr
    stories = told.stdout.split("\n\n")
    assert stories[0].startswith("advise semantic_loop run run-000045")
    assert stories[1].startswith("halt semantic_loop run run-000045")
    halt = stories[1]
    assert "  events     run-000045-0, run-000045-1, run-000045-2, run-000045-3\n" in halt
    assert "  calls\n    run-000045-0  " in halt and "    run-000045-3  " in halt
    assert "\"session_token\":\"***\"" in halt and "df0d3ec841a4f76e" not in told.stdout  # secrets masked


def test_an_unreadable_telemetry_file_is_one_line_and_status_2() -> None:
    told = _explain("run-1", "--telemetry", "no/such/file.jsonl")
    assert told.returncode == 2 and "no/such/file.jsonl" in told.stderr and "Traceback" not in told.stderr


def test_a_telemetry_files_bad_lines_are_reported_and_never_shown_as_calls(tmp_path: Path) -> None:
    """The lines the replay refused are reported on stderr with their number (as ``loopwarden replay``
    reports them), and a refused line of the run is not listed among its calls; arguments nested deeper
    than Python's stack are shown cut, not a traceback."""
    def call(n: int, **extra: object) -> bytes:
        return orjson.dumps({"run_id": "r2", "event_id": f"a{n}", "tool": "send_email", "ts_ms": 1_764_000_000_000 + n,
                             "outcome": "success", "side_effect": True, "args": {"to": "x"}, "result": "ok", **extra})

    deep = b'{"to":' * 900 + b'"x"' + b"}" * 900  # deeper than orjson writes, as deep as it reads
    lines = [call(1), call(2).replace(b'{"to":"x"}', deep),
             orjson.dumps({"run_id": "r2", "event_id": "BOGUS", "tool": "delete_everything", "ts_ms": "yesterday",
                           "outcome": "success", "args": {}}),
             call(3).replace(b'{"to":"x"}', deep)]
    path = tmp_path / "telemetry.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    told = _explain("r2", "--telemetry", str(path))
    assert told.returncode == 0, told.stderr
    assert f"loopwarden explain: {path}: line 3: ts_ms: must be an integer, got string" in told.stderr
    assert "Traceback" not in told.stderr
    assert "BOGUS" not in told.stdout and "delete_everything" not in told.stdout
    assert "    a3  " in told.stdout and '{"to":{"to":' in told.stdout  # unhashable arguments: one call by name
