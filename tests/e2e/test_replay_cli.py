"""``loopwarden replay`` run as a user runs it: a subprocess over a file with good and bad lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

REPO = Path(__file__).resolve().parents[2]


def _loopwarden(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "stream_app", *args], input=stdin, capture_output=True,
                          cwd=REPO, timeout=120)


def _call(i: int, **extra) -> bytes:
    raw = {"run_id": "r1", "event_id": f"e{i}", "tool": "search", "ts_ms": 1000 + i, "outcome": "error",
           "args": {"q": "x", "attempt": i}, "result": {"error": "503"}, **extra}
    return orjson.dumps(raw)


ENGINES = pytest.mark.parametrize("engine", ["python", "native"])


@ENGINES
def test_replay_reports_bad_lines_and_keeps_going(tmp_path: Path, engine: str) -> None:
    """Bad lines are reported with their number and reason, skipped, and the run is still halted on its
    4th identical failing call; exit status is non-zero because lines were bad (either engine)."""
    lines = [
        _call(0),
        b"{not json",
        _call(1),
        b"[1, 2]",
        orjson.dumps({"run_id": "r1", "event_id": "x", "tool": "search", "ts_ms": "soon", "outcome": "error",
                      "args": {}, "result": 1}),
        _call(2),
        orjson.dumps({"run_id": "r1", "event_id": "y", "tool": "search", "ts_ms": 5, "outcome": "kaput",
                      "args": {}, "result": 1}),
        b"",
        _call(3),
        _call(4),
    ]
    path = tmp_path / "telemetry.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    result = _loopwarden("replay", "--engine", engine, str(path))
    stderr = result.stderr.decode()
    assert result.returncode == 1
    assert "line 2: not JSON: unexpected character, expected a string key at byte 2" in stderr
    assert "line 4: event must be a JSON object, got array" in stderr
    assert "line 5: ts_ms: must be an integer, got string" in stderr
    assert "line 7: outcome: must be one of" in stderr
    assert "5 events (0 duplicates) in 1 run; 2 decisions: advise/recursion 1, halt/recursion 1; 4 bad lines" in stderr
    assert "\nhalted: r1\n" in stderr
    assert "warning: every ts_ms is below 10^11, which looks like seconds" in stderr  # these say 1,000 ms
    decisions = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(d["action"], d["verdict"], d["trigger_event_id"]) for d in decisions] == [
        ("advise", "recursion", "e2"), ("halt", "recursion", "e3")
    ]


@ENGINES
def test_replay_reads_stdin_and_exits_zero_on_clean_input(engine: str) -> None:
    """``-`` reads stdin; with no bad line the exit status is 0."""
    stdin = b"\n".join(_call(i) for i in range(4)) + b"\n"
    result = _loopwarden("replay", "--engine", engine, "-", stdin=stdin)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["trigger_event_id"] for line in result.stdout.splitlines()] == ["e2", "e3"]


@ENGINES
def test_the_summary_names_the_halted_runs_and_trusts_millisecond_times(engine: str) -> None:
    """Twelve runaways: the summary lists the first ten halted run ids and counts the rest; epoch
    milliseconds raise no warning."""
    stdin = b"".join(orjson.dumps({"run_id": f"r{run:02d}", "event_id": f"r{run}-{i}", "tool": "search",
                                   "ts_ms": 1_764_000_000_000 + i, "outcome": "error", "args": {"q": run},
                                   "result": {"error": "503"}}) + b"\n" for run in range(12) for i in range(4))
    result = _loopwarden("replay", "--engine", engine, "-", stdin=stdin)
    stderr = result.stderr.decode()
    assert ("48 events (0 duplicates) in 12 runs; 24 decisions: advise/recursion 12, halt/recursion 12; "
            "0 bad lines") in stderr
    assert f"halted: {', '.join(f'r{run:02d}' for run in range(10))} and 2 more runs" in stderr
    assert "warning" not in stderr


def test_replay_applies_a_policy_file(tmp_path: Path) -> None:
    """--policy raises the budget for the tool, so four failures no longer halt."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("tools:\n  search:\n    retry_budget: 5\n")
    stdin = b"\n".join(_call(i) for i in range(6)) + b"\n"
    result = _loopwarden("replay", "-", "--policy", str(policy), stdin=stdin)
    assert [(d["action"], d["trigger_event_id"]) for d in map(json.loads, result.stdout.splitlines())] == [
        ("advise", "e4"), ("halt", "e5")]


def test_bad_policy_is_named_and_refused(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("tools:\n  search:\n    retry_budgt: 5\n")
    result = _loopwarden("replay", "-", "--policy", str(policy), stdin=b"")
    assert result.returncode == 2
    assert "tools.search.retry_budgt: unknown setting" in result.stderr.decode()


@ENGINES
def test_golden_fleet_decisions_are_byte_identical(engine: str) -> None:
    """The bundled example fleet replays to exactly the committed decisions, byte for byte."""
    result = _loopwarden("replay", "--engine", engine, "schemas/examples/fleet.jsonl")
    assert result.returncode == 0, result.stderr
    assert result.stdout == (REPO / "tests" / "golden" / "fleet.decisions.jsonl").read_bytes()
