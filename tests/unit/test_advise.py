"""A warning before the halt (action ``advise``): where each rule warns, at most once per streak, before the
halt on the same call, never moving a halt; and what the runtime's ControlBoard does with it."""

from __future__ import annotations

import contextlib
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from stream_app.client import ControlBoard, Guard
from stream_app.core import Policy

from .conftest import Run, event


def advice(run: Run) -> list[tuple[int, str]]:
    return [(n, d.verdict) for n, d in run.advice]


def test_recursion_warns_at_the_last_failure_the_budget_allows(run: Run) -> None:
    run.feed_all([event(ts_ms=i) for i in range(4)])
    assert (advice(run), run.halts()) == ([(3, "recursion")], [(4, "recursion")])
    warning = run.advice[0][1]
    assert warning.action == "advise" and warning.evidence["advice_for"] == "recursion"
    assert warning.reason.startswith("search failed the same way 3 times; the next identical failure stops this run")
    assert warning.decision_id != run.decisions[0][1].decision_id


def test_no_warning_when_the_budget_is_0() -> None:
    run = Run(Policy.from_mapping({"defaults": {"retry_budget": 0}}))
    run.feed_all([event(ts_ms=i) for i in range(2)])
    assert (advice(run), run.halts()) == ([], [(1, "recursion")])


def test_a_streak_is_warned_once(run: Run) -> None:
    """Old members leaving the window bring the count back to the budget: no second warning."""
    run = Run(Policy.from_mapping({"defaults": {"window_ms": 10, "retry_budget": 3}}))
    run.feed_all([event(ts_ms=t) for t in (0, 1, 2, 20, 21, 22, 23)])
    assert advice(run) == [(3, "recursion")]
    assert run.halts() == [(7, "recursion")]


def test_a_cycle_warns_one_occurrence_short(run: Run) -> None:
    run.feed_all([event("read_file", "success", {"p": "/a"}, "x", ts_ms=2 * i) if i % 2 == 0 else
                  event("apply_patch", "error", {"p": "/a"}, "hunk failed", ts_ms=2 * i) for i in range(8)])
    assert (advice(run), run.halts()) == ([(6, "cycle")], [(8, "cycle")])


def test_reads_and_oscillations_warn_one_short() -> None:
    reads = Run()
    reads.feed_all([event("read_file", "success", {"p": "/a"}, "x", tool_class="read", target="/a", ts_ms=i)
                    for i in range(4)])
    assert (advice(reads), reads.halts()) == ([(3, "no_progress")], [(4, "no_progress")])
    edits = Run()
    edits.feed_all([event("apply_patch", "success", {"p": s}, "ok", tool_class="write", target="/a",
                          state_hash=s * 64, ts_ms=i) for i, s in enumerate("10101")])
    assert (advice(edits), edits.halts()) == ([(4, "oscillation")], [(5, "oscillation")])


def test_budgets_warn_at_the_first_call_reaching_80_percent() -> None:
    run = Run(Policy.from_mapping({"defaults": {"max_cost_usd": 1}}))
    run.feed_all([event(outcome="success", result=i, cost_usd=0.3, ts_ms=i) for i in range(4)])
    assert (advice(run), run.halts()) == ([(3, "budget_exceeded")], [(4, "budget_exceeded")])
    assert run.advice[0][1].reason.startswith("this run has used 90% of its cost budget")


def test_the_warning_goes_out_before_another_rules_decision_on_the_same_call() -> None:
    """The 4th identical failure halts by recursion and is also the first call past 80% of the cost
    budget: both decisions go out, the advice first."""
    run = Run(Policy.from_mapping({"defaults": {"max_cost_usd": 1}}))
    decisions = [d for i in range(4) for d in run.feed(event(cost_usd=0.1 if i < 3 else 0.55, ts_ms=i))]
    assert [(d.action, d.verdict) for d in decisions] == [
        ("advise", "recursion"), ("advise", "budget_exceeded"), ("halt", "recursion")]


def test_switched_off_there_is_no_warning() -> None:
    run = Run(Policy.from_mapping({"defaults": {"advise": False}}))
    run.feed_all([event(ts_ms=i) for i in range(4)])
    assert (advice(run), run.halts()) == ([], [(4, "recursion")])


calls = st.lists(st.tuples(st.sampled_from(["search", "read_file", "apply_patch"]),
                           st.sampled_from(["success", "error"]), st.sampled_from(["a", "b"]),
                           st.sampled_from([0.0, 0.2])), max_size=40)


@given(calls)
@settings(max_examples=300, deadline=None)
def test_warnings_never_move_a_halt(steps: list[tuple[str, str, str, float]]) -> None:
    policies = [Policy.from_mapping({"defaults": {"max_cost_usd": 2, "advise": on},
                                     "tools": {"read_file": {"tool_class": "read"}}}) for on in (True, False)]
    runs = [Run(policy) for policy in policies]
    for i, (tool, outcome, value, cost) in enumerate(steps):
        for run in runs:
            run.feed(event(tool, outcome, {"v": value}, value, cost_usd=cost, ts_ms=i, event_id=f"e{i}"))
    with_advice, without = runs
    assert with_advice.decisions == without.decisions and without.advice == []


def test_a_warning_changes_no_runs_state_in_the_runtime() -> None:
    """The ControlBoard keeps the latest warning for the model and nothing else: the run is neither halted
    nor suppressed, and a runtime that does not know the action ignores it (the enum is open)."""
    board = ControlBoard(watch_all=True)
    message: dict[str, Any] = {"schema_version": "1", "decision_id": "d" * 32, "run_id": "run-1",
                               "action": "advise", "verdict": "recursion", "trigger_event_id": "e3", "ts_ms": 3,
                               "reason": "search failed the same way 3 times", "evidence": {"tool": "search",
                               "args_hash": "a", "args_verified": True, "outcome": "error", "result_hash": "b",
                               "count": 3}}
    assert board.apply(message) == "applied"
    assert board.halt_decision("run-1") is None
    assert not board.is_suppressed("run-1", "search", "a", 4)
    assert board.advice("run-1") == message
    future = ControlBoard(watch_all=True)
    assert future.apply({**message, "decision_id": "e" * 32, "action": "quarantine"}) == "ignored"


async def test_the_guarded_run_exposes_the_advice_for_the_model() -> None:
    run = Guard.in_process().run("run-advised")

    def search(**_: Any) -> None:
        raise ConnectionError("index unavailable")

    for _ in range(3):
        with contextlib.suppress(ConnectionError):
            await run.call("search", search, {"q": "x"})
    assert run.advice is not None and "the next identical failure stops this run" in run.advice
    assert not run.halted


def test_a_warning_at_a_budget_of_1_says_1_time() -> None:
    run = Run(Policy.from_mapping({"defaults": {"retry_budget": 1}}))
    run.feed_all([event(ts_ms=n) for n in range(2)])
    (_, warning), = run.advice
    assert "failed the same way 1 time;" in warning.reason
