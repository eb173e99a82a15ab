"""One test (or table) per detector rule, with the examples from the product definition."""

from __future__ import annotations

import pytest

from stream_app.core import Policy

from .conftest import Run, event


def test_fourth_identical_failing_call_halts_with_default_budget(run: Run) -> None:
    """With no declared budget (default 3), the 4th identical failing call halts as recursion."""
    run.feed_all([event(ts_ms=1000 + i) for i in range(6)])
    assert run.halts() == [(4, "recursion")]


def test_declared_budget_moves_the_halt(run: Run) -> None:
    """A declared retry_budget of 5 halts on the 6th identical failing call, not before."""
    run.feed_all([event(retry_budget=5, ts_ms=1000 + i) for i in range(8)])
    assert run.halts() == [(6, "recursion")]


def test_retry_that_succeeds_within_budget_never_halts(run: Run) -> None:
    """4 identical 503s then a success, under budget 5, is a legitimate retry."""
    calls = [event(retry_budget=5, result={"status": 503}, ts_ms=i) for i in range(4)]
    calls.append(event(outcome="success", retry_budget=5, result={"total": 1}, ts_ms=5))
    run.feed_all(calls)
    assert run.decisions == []


@pytest.mark.parametrize(
    ("outcomes", "results"),
    [
        # error, error, success: the outcome changes, the streak breaks
        (["error", "error", "success", "error", "error", "success"], ["x"] * 6),
        # the error body changes every time, in a kept token: not the same failure (a changing duration
        # is volatile, and the same failure: tests/unit/test_volatile.py)
        (["error"] * 6, [f"row {i} is locked" for i in range(6)]),
        # empty then error alternate: the outcome class is part of the signature
        (["empty", "error"] * 3, ["nothing"] * 6),
    ],
)
def test_any_change_of_outcome_or_result_breaks_the_streak(run: Run, outcomes: list[str],
                                                           results: list[str]) -> None:
    """A changing outcome or result hash is progress of a kind: no recursion halt."""
    run.feed_all([event(outcome=o, result=r, ts_ms=i) for i, (o, r) in enumerate(zip(outcomes, results, strict=False))])
    assert [v for _, v in run.halts() if v in ("recursion", "semantic_loop")] == []


def test_mutating_arguments_with_identical_error_halt_as_semantic_loop(run: Run) -> None:
    """A search whose payload carries an incrementing attempt and an unknown random token, failing with a
    byte-identical error 340 times, halts at the 4th call as a semantic loop, not at the ceiling."""
    calls = [
        event(args={"query": "q3 report", "attempt": i, "token": f"{i * 7919:08x}"},
              result={"error": "index unavailable"}, ts_ms=1000 + i)
        for i in range(340)
    ]
    run.feed_all(calls)
    assert run.halts() == [(4, "semantic_loop")]


def test_normalisation_makes_noise_fields_identical(run: Run) -> None:
    """Key order, whitespace, timestamps, nonces and request ids do not make calls distinct."""
    variants = [
        {"query": "refund  policy", "timestamp": 1, "nonce": "a"},
        {"nonce": "b", "query": " refund policy ", "requestId": "r-2"},
        {"query": "refund\tpolicy", "X-Request-ID": "r-3", "sent_at": "2026-11-30"},
        {"attempt": 4, "query": "refund policy"},
    ]
    run.feed_all([event(args=a, ts_ms=i) for i, a in enumerate(variants)])
    assert run.halts() == [(4, "recursion")]


def test_two_call_cycle_halts_on_its_fourth_occurrence(run: Run) -> None:
    """read (ok) / patch (error) repeating halts with verdict cycle on the 8th call."""
    calls = []
    for i in range(6):
        calls.append(event("read_file", "success", {"p": "a.py"}, "text", ts_ms=2 * i))
        calls.append(event("apply_patch", "error", {"p": "a.py"}, "hunk failed", ts_ms=2 * i + 1))
    run.feed_all(calls)
    assert run.halts() == [(8, "cycle")]
    assert run.decisions[0][1].evidence["period"] == 2


def test_three_call_cycle_halts_on_its_fourth_occurrence(run: Run) -> None:
    """A 3-call cycle with one failing step halts on the 12th call."""
    calls = []
    for i in range(5):
        calls.append(event("plan", "success", {"goal": "x"}, "plan", ts_ms=3 * i))
        calls.append(event("run_tests", "error", {"suite": "all"}, "2 failed", ts_ms=3 * i + 1))
        calls.append(event("edit", "success", {"file": "a"}, "ok", ts_ms=3 * i + 2))
    run.feed_all(calls)
    assert run.halts() == [(12, "cycle")]


def test_successful_cycle_is_not_a_loop(run: Run) -> None:
    """A cycle whose steps all succeed (e.g. a batch walking pages with identical answers) never halts
    before the ceiling."""
    calls = []
    for i in range(10):
        calls.append(event("list", "success", {"page": "next"}, "rows", ts_ms=2 * i))
        calls.append(event("store", "success", {"rows": "rows"}, "stored", ts_ms=2 * i + 1))
    run.feed_all(calls)
    assert run.halts() == []


def test_polling_never_halts_before_the_ceiling_and_alerts_once(run: Run) -> None:
    """Identical successful calls (a job that keeps answering running) alert once at 20, never halt."""
    run.feed_all([event("check_job", "success", {"job": "j1"}, {"state": "running"}, ts_ms=i) for i in range(45)])
    assert run.actions() == [(20, "alert", "polling")]


def test_advancing_plan_step_resets_streaks(run: Run) -> None:
    """Each identical failure comes with an advancing plan step: progress, no halt."""
    run.feed_all([event(plan_step=i, ts_ms=i) for i in range(10)])
    assert run.halts() == []


def test_plan_step_that_does_not_advance_is_not_progress(run: Run) -> None:
    """A repeated plan step is no progress: the streak keeps counting."""
    run.feed_all([event(plan_step=2, ts_ms=i) for i in range(5)])
    assert run.halts() == [(4, "recursion")]


def test_window_counts_only_recent_calls_in_event_time(run: Run) -> None:
    """Identical failures 250 s apart never have 4 within 600 s, so they never halt as recursion."""
    run.feed_all([event(ts_ms=i * 250_000) for i in range(10)])
    assert run.halts() == []


def test_slow_loop_still_halts_inside_the_window(run: Run) -> None:
    """Six identical failing calls 100 s apart halt at the 4th (300 s < 600 s)."""
    run.feed_all([event(ts_ms=i * 100_000) for i in range(6)])
    assert run.halts() == [(4, "recursion")]


def test_window_in_calls_bounds_the_streak() -> None:
    """With window_calls 3, at most 3 calls are counted: a budget of 3 can never be exceeded."""
    run = Run(Policy.from_mapping({"defaults": {"window_calls": 3}}))
    run.feed_all([event(ts_ms=i) for i in range(10)])
    assert run.halts() == []


def test_iteration_ceiling_halts_the_51st_call(run: Run) -> None:
    """50 distinct successful calls are fine; the 51st is halted whatever it is."""
    run.feed_all([event("browse", "success", {"page": i}, f"page {i}", ts_ms=i) for i in range(60)])
    assert run.halts() == [(51, "iteration_ceiling")]


def test_iteration_ceiling_is_configurable_per_agent() -> None:
    """A coding agent with a ceiling of 200 is not halted at 51."""
    policy = Policy.from_mapping({"agents": {"coder-*": {"iteration_ceiling": 200}}})
    run = Run(policy)
    calls = [event("edit", "success", {"n": i}, i, agent_id="coder-7", ts_ms=i) for i in range(201)]
    run.feed_all(calls)
    assert run.halts() == [(201, "iteration_ceiling")]


def test_side_effect_duplicates_suppress_then_open_the_circuit(run: Run) -> None:
    """The same e-mail within 60 s: suppress on the 2nd and 3rd, halt circuit_open on the 4th."""
    calls = [event("send_email", "success", {"to": "a@x", "body": "hi"}, f"sent {i}", side_effect=True,
                   ts_ms=i * 10_000) for i in range(5)]
    run.feed_all(calls)
    assert run.actions() == [(2, "suppress", "duplicate_call"), (3, "suppress", "duplicate_call"),
                             (4, "halt", "circuit_open")]


def test_side_effect_call_is_new_again_after_its_window(run: Run) -> None:
    """After 60 s from its first occurrence the same e-mail is a new call."""
    calls = [event("send_email", "success", {"to": "a@x"}, "sent", side_effect=True, ts_ms=t)
             for t in (0, 30_000, 61_000, 70_000)]
    run.feed_all(calls)
    assert run.actions() == [(2, "suppress", "duplicate_call"), (4, "suppress", "duplicate_call")]


def test_policy_can_mark_a_tool_side_effecting() -> None:
    """A tool declared side-effecting in the policy is deduplicated even if events do not say so."""
    run = Run(Policy.from_mapping({"tools": {"charge_card": {"side_effect": True}}}))
    run.feed_all([event("charge_card", "success", {"amount": 5}, "ok", ts_ms=i) for i in range(2)])
    assert run.actions() == [(2, "suppress", "duplicate_call")]


def test_redelivered_event_counts_once(run: Run) -> None:
    """The same event_id delivered three times counts as one call."""
    first = [event(event_id=f"e{i}", ts_ms=i) for i in range(3)]
    run.feed_all([*first, event(event_id="e2", ts_ms=2), event(event_id="e1", ts_ms=1)])
    assert run.halts() == []
    run.feed(event(event_id="e3", ts_ms=3))
    assert run.halts() == [(6, "recursion")]


def test_runs_are_independent() -> None:
    """Two runs failing identically, interleaved, each halt on their own 4th call."""
    from stream_app.core import Detector, RunTable

    table = RunTable(Detector())
    verdicts = [(run_id, i + 1, d.verdict) for i in range(4) for run_id in ("a", "b")
                for d in table.observe(event(run_id=run_id, ts_ms=i)).decisions if d.action == "halt"]
    assert verdicts == [("a", 4, "recursion"), ("b", 4, "recursion")]


def test_halted_run_stays_halted(run: Run) -> None:
    """After a halt, later events of the run produce no further decisions."""
    run.feed_all([event(ts_ms=i) for i in range(20)])
    assert run.halts() == [(4, "recursion")]


def test_operator_resume_starts_fresh_streaks(run: Run) -> None:
    """A resumed run needs a full new streak to halt again."""
    run.feed_all([event(ts_ms=i) for i in range(4)])
    run.detector.resume(run.state)
    run.feed_all([event(ts_ms=10 + i) for i in range(4)])
    assert run.halts() == [(4, "recursion"), (8, "recursion")]


def test_strict_tool_with_only_a_hash_fails_closed() -> None:
    """A strict tool whose arguments arrive only as hashes is compared by name: distinct hashes with an
    identical failure still halt at the 4th call (fail closed), flagged as unverified."""
    run = Run(Policy.from_mapping({"tools": {"sql": {"strict_args": True}}}))
    from stream_app.core import decode_event

    calls = [decode_event({"run_id": "r", "event_id": f"e{i}", "tool": "sql", "ts_ms": i, "outcome": "error",
                           "args_hash": f"h{i}", "result": "syntax error"}) for i in range(4)]
    run.feed_all(calls)
    assert run.halts() == [(4, "recursion")]
    assert run.decisions[0][1].evidence["args_verified"] is False


def test_unnormalisable_arguments_fail_closed(run: Run) -> None:
    """Arguments with no canonical form (NaN from an in-process runtime) never make calls look distinct."""
    calls = [event(args={"x": float("nan"), "n": i}, ts_ms=i) for i in range(4)]
    run.feed_all(calls)
    assert run.halts() == [(4, "recursion")]


def test_non_strict_hash_only_calls_compare_by_hash(run: Run) -> None:
    """Runtimes may send only args_hash/result_hash; identical hashes are identical calls."""
    from stream_app.core import decode_event

    calls = [decode_event({"run_id": "r", "event_id": f"e{i}", "tool": "t", "ts_ms": i, "outcome": "empty",
                           "args_hash": "abc", "result_hash": "def"}) for i in range(4)]
    run.feed_all(calls)
    assert run.halts() == [(4, "recursion")]


def test_decision_ids_are_stable_and_distinct() -> None:
    """The same input yields the same decision id; different runs yield different ids."""
    def halt_id(run_id: str) -> str:
        r = Run()
        r.feed_all([event(run_id=run_id, event_id=f"{run_id}-{i}", ts_ms=i) for i in range(4)])
        return r.decisions[0][1].decision_id

    assert halt_id("a") == halt_id("a")
    assert halt_id("a") != halt_id("b")


def test_state_round_trips_through_its_record(run: Run) -> None:
    """A state saved mid-streak and restored continues exactly: the 4th call still halts."""
    from stream_app.core.stored import StoredRun, decode_run, encode_run

    run.feed_all([event(ts_ms=i, side_effect=True) for i in range(2)])
    restored = decode_run(encode_run(StoredRun(run.state, 7))).state
    assert restored == run.state
    run.state = restored
    run.feed_all([event(ts_ms=2, side_effect=True), event(ts_ms=3, side_effect=True)])
    assert run.halts() == [(4, "circuit_open")]
