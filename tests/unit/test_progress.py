"""Tool classes: successful calls that make no progress (reads), oscillating edits and writes that change
nothing (stream_app.core.detector rules 5 and 6), with the issue's examples."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_app.core import InvalidEvent, Policy, PolicyError, TelemetryEvent, decode_event
from stream_app.core.stored import StoredRun, decode_run, encode_run

from .conftest import Run, event, replay_both


def read(path: str = "/src/app.py", text: str = "v1", **extra: Any) -> TelemetryEvent:
    return event("read_file", "success", {"path": path}, {"text": text}, tool_class="read", target=path, **extra)


def write(path: str, state: str, outcome: str = "success", **extra: Any) -> TelemetryEvent:
    return event("apply_patch", outcome, {"path": path, "patch": f"to {state}"}, {"ok": True},
                 tool_class="write", target=path, state_hash=state * 16, **extra)


# --- no progress: the same read again and again ------------------------------------------------------

def test_the_4th_identical_read_with_no_write_between_halts(run: Run) -> None:
    """Not necessarily in a row: other reads between do not reset the count."""
    run.feed_all([read(), read("/b.py"), read(), read("/c.py"), read(), read("/b.py"), read()])
    assert run.halts() == [(7, "no_progress")]
    evidence = run.decisions[0][1].evidence
    assert (evidence["rule"], evidence["count"], evidence["target"]) == ("reads", 4, "/src/app.py")


def test_a_successful_write_or_a_plan_step_is_progress(run: Run) -> None:
    run.feed_all([read(), read(), read(), write("/other.py", "a"), read(), read(), read()])
    assert run.halts() == []
    stepped = Run()
    stepped.feed_all([read(plan_step=1), read(plan_step=1), read(plan_step=1), read(plan_step=2), read(plan_step=2)])
    assert stepped.halts() == []


def test_a_failed_or_unchanged_write_is_not_progress(run: Run) -> None:
    run.feed_all([write("/src/app.py", "a"), read(), read(), read(), write("/src/app.py", "b", outcome="error"),
                  write("/src/app.py", "a"), read()])  # the last write is a's 2nd in a row: a noop
    assert run.halts() == []  # the failed write revisited nothing; still: the reads count on
    assert Run().feed_all([read(), read(), write("/x", "a", outcome="error"), read(), read()]).halts() == [
        (5, "no_progress")]


def test_a_changed_result_is_a_different_read(run: Run) -> None:
    run.feed_all([read(text=f"v{i % 3}") for i in range(9)])
    assert run.halts() == []
    run.feed(read(text="v0"))
    assert run.halts() == [(10, "no_progress")]


def test_poll_class_calls_are_exempt_and_only_alert(run: Run) -> None:
    run.feed_all([event("job_status", "success", {"job": "j1"}, {"state": "running"}, tool_class="poll",
                        ts_ms=i) for i in range(30)])
    assert run.actions() == [(20, "alert", "polling")]


def test_the_class_can_come_from_the_policy_and_the_event_wins() -> None:
    policy = Policy.from_mapping({"tools": {"read_file": {"tool_class": "read"}, "cat": {"tool_class": "read"}}})
    plain = [event("read_file", "success", {"path": "/a"}, {"text": "x"}) for _ in range(4)]
    assert Run(policy).feed_all(plain).halts() == [(4, "no_progress")]
    other = [event("cat", "success", {"path": "/a"}, {"text": "x"}, tool_class="other") for _ in range(4)]
    assert Run(policy).feed_all(other).halts() == []
    with pytest.raises(PolicyError, match="tool_class"):
        Policy.from_mapping({"tools": {"cat": {"tool_class": "reader"}}})


def test_no_progress_at_0_disables_it() -> None:
    policy = Policy.from_mapping({"defaults": {"no_progress_at": 0}})
    assert Run(policy).feed_all([read() for _ in range(10)]).halts() == []


def test_the_read_table_keeps_the_16_most_recently_seen() -> None:
    """17 distinct reads push the first out: read again, it counts from 1."""
    run = Run()
    run.feed_all([read(), read(), read()])
    run.feed_all([read(f"/f{i}.py") for i in range(16)])
    run.feed(read())
    assert run.halts() == []
    again = Run()
    again.feed_all([read(), read(), read()])
    again.feed_all([read(f"/f{i}.py") for i in range(15)])
    again.feed(read())
    assert again.halts() == [(19, "no_progress")]


# --- oscillation: edits undone and redone ------------------------------------------------------------

def test_s1_s0_s1_s0_s1_halts_at_the_5th_write(run: Run) -> None:
    run.feed_all([write("/a.py", s) for s in ("1", "0", "1", "0", "1")])
    assert run.halts() == [(5, "oscillation")]
    evidence = run.decisions[0][1].evidence
    assert (evidence["count"], evidence["target"], evidence["oscillation_revisits"]) == (3, "/a.py", 3)


def test_targets_oscillate_separately(run: Run) -> None:
    run.feed_all([write("/a.py", "1"), write("/b.py", "1"), write("/a.py", "0"), write("/b.py", "0"),
                  write("/a.py", "1"), write("/b.py", "1"), write("/a.py", "0")])
    assert run.halts() == []
    run.feed(write("/a.py", "1"))
    assert run.halts() == [(8, "oscillation")]


@given(st.lists(st.sampled_from(["/a", "/b", "/c"]), min_size=1, max_size=40))
@settings(max_examples=200, deadline=None)
def test_progressive_edits_never_oscillate(paths: list[str]) -> None:
    """Every write leaves its target in a state it never had: no revisit, no halt, however they interleave."""
    run = Run(Policy.from_mapping({"defaults": {"iteration_ceiling": 1000}}))
    run.feed_all([write(path, f"{path}-{i}") for i, path in enumerate(paths)])
    assert run.halts() == []


def test_a_write_that_changes_nothing_is_a_noop_and_repeating_it_is_recursion(run: Run) -> None:
    """The metrics and telemetry keep "success"; the rules see noop: the 4th identical noop halts."""
    run.feed_all([write("/a.py", "1") for _ in range(5)])
    assert run.halts() == [(5, "recursion")]  # write 1 changed the file; writes 2-5 are the noops
    evidence = run.decisions[0][1].evidence
    assert (evidence["outcome"], evidence["effective_outcome"]) == ("success", "noop")
    assert "noop result" in run.decisions[0][1].reason


def test_oscillation_revisits_0_disables_it() -> None:
    policy = Policy.from_mapping({"defaults": {"oscillation_revisits": 0}})
    assert Run(policy).feed_all([write("/a.py", s) for s in "10101010"]).halts() == []


def test_the_state_is_bounded_and_survives_the_stored_record() -> None:
    """8 targets x 8 states at most; the record round-trips the tables in their order."""
    run = Run(Policy.from_mapping({"defaults": {"iteration_ceiling": 1000}}))
    run.feed_all([write(f"/t{t}", f"{t}-{s}", ts_ms=t * 100 + s) for t in range(12) for s in range(12)][:140])
    run.feed_all([read(f"/r{i}") for i in range(20)])
    targets, reads = run.state.targets, run.state.reads
    assert targets is not None and reads is not None
    assert len(targets) == 8 and all(len(states) == 8 * 8 for states, _ in targets.values())
    assert len(reads) == 16
    restored = decode_run(encode_run(StoredRun(run.state, 3)))
    assert restored.state == run.state
    assert list(restored.state.targets or {}) == list(targets) and list(restored.state.reads or {}) == list(reads)


# --- the contract ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value", "reason"), [
    ("tool_class", "reader", "must be one of read, write"),
    ("tool_class", 3, "must be one of read, write"),
    ("state_hash", 7, "must be a non-empty string"),
    ("target", ["a"], "must be a string"),
])
def test_bad_class_fields_are_named(field: str, value: Any, reason: str) -> None:
    raw = {"run_id": "r", "event_id": "e", "tool": "t", "ts_ms": 1, "outcome": "success", "args": {}, "result": 1,
           field: value}
    with pytest.raises(InvalidEvent, match=reason) as error:
        decode_event(raw)
    assert error.value.field == field


def test_both_engines_decide_the_examples_alike() -> None:
    """The examples above as one telemetry file, replayed by the native engine and the reference."""
    def line(run_id: str, n: int, tool: str, outcome: str, args: dict[str, Any], **extra: Any) -> bytes:
        return orjson.dumps({"run_id": run_id, "event_id": f"{run_id}-{n}", "tool": tool, "ts_ms": 1_000 * n,
                             "outcome": outcome, "args": args, "result": {"text": "v1"}, **extra}) + b"\n"

    lines = []
    for n in range(5):
        lines.append(line("reads", n, "read_file", "success", {"path": "/a"}, tool_class="read", target="/a"))
        lines.append(line("edits", n, "apply_patch", "success", {"patch": n % 2}, tool_class="write", target="/a",
                          state_hash=str(n % 2) * 64))
        lines.append(line("noops", n, "apply_patch", "success", {"patch": 1}, tool_class="write", target="/a",
                          state_hash="1" * 64))
    output = replay_both(lines, Policy())
    decisions = [d for d in map(orjson.loads, output.splitlines()) if d["action"] != "advise"]
    assert sorted((d["run_id"], d["verdict"], d["trigger_event_id"]) for d in decisions) == [
        ("edits", "oscillation", "edits-4"), ("noops", "recursion", "noops-4"), ("reads", "no_progress", "reads-3")]
