"""Budgets and model calls (stream_app.core.detector: budget_exceeded, no_progress by model calls), on
both engines, through the SDK and from OTLP inference spans."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from stream_app.client import Guard, RunHalted
from stream_app.core import InvalidEvent, Policy, PolicyError, decode_event
from stream_app.core.contract import micro_usd, token_count
from stream_app.core.stored import StoredRun, decode_run, encode_run

from .conftest import Run, event, replay_both


def model(n: int, **extra: Any):
    return decode_event({"run_id": "run-1", "event_id": f"m{n}", "tool": "claude-x", "ts_ms": n,
                         "outcome": "success", "kind": "model_call", **extra})


def budgets(**defaults: Any) -> Policy:
    return Policy.from_mapping({"defaults": defaults})


def test_the_call_that_takes_the_run_strictly_past_its_cost_budget_halts() -> None:
    """Summed as integer micro-USD: 0.1 + 0.2 + 0.2 is exactly 0.5, not past it; the next call is."""
    run = Run(budgets(max_cost_usd=0.5))
    run.feed_all([event(outcome="success", result=i, cost_usd=c, ts_ms=i) for i, c in enumerate([0.1, 0.2, 0.2])])
    assert run.halts() == []
    run.feed(event(outcome="success", result=9, cost_usd=0.000001, ts_ms=9))
    assert run.halts() == [(4, "budget_exceeded")]
    evidence = run.decisions[0][1].evidence
    assert (evidence["budget"], evidence["spent"], evidence["limit"]) == ("cost", 0.500001, 0.5)


def test_tokens_budget_counts_tool_and_model_calls() -> None:
    run = Run(budgets(max_tokens=1000))
    run.feed_all([event(outcome="success", result=1, tokens=400, ts_ms=1), model(2, tokens=600)])
    assert run.halts() == []
    run.feed(model(3, tokens=1))
    assert run.halts() == [(3, "budget_exceeded")]
    assert run.decisions[0][1].evidence["budget"] == "tokens"


def test_max_calls_halts_the_call_after_the_limit_of_that_tool_only() -> None:
    policy = Policy.from_mapping({"tools": {"browse": {"max_calls": 3}}})
    run = Run(policy)
    run.feed_all([event("browse", "success", {"u": i}, i, ts_ms=i) for i in range(3)])
    run.feed_all([event("search", "success", {"q": i}, i, ts_ms=10 + i) for i in range(5)])
    assert run.halts() == []
    run.feed(event("browse", "success", {"u": 9}, 9, ts_ms=20))
    assert run.halts() == [(9, "budget_exceeded")]
    assert (run.decisions[0][1].evidence["budget"], run.decisions[0][1].evidence["count"]) == ("calls", 4)


def test_run_budgets_are_refused_under_tools() -> None:
    with pytest.raises(PolicyError, match=r"tools\.browse\.max_cost_usd: a run budget"):
        Policy.from_mapping({"tools": {"browse": {"max_cost_usd": 1}}})
    assert Policy.from_mapping({"agents": {"a*": {"max_cost_usd": 2}}}).resolve("ab", "t").thresholds.max_cost_usd == 2.0


def test_the_25th_model_call_in_a_row_halts_and_a_tool_call_resets_the_count() -> None:
    """A compaction spiral: model calls with no tool call between."""
    run = Run()
    run.feed_all([model(i) for i in range(24)])
    run.feed(event(outcome="success", result="ok", ts_ms=100))
    run.feed_all([model(200 + i) for i in range(24)])
    assert run.halts() == []
    run.feed(model(300))
    assert run.halts() == [(50, "no_progress")]
    evidence = run.decisions[0][1].evidence
    assert (evidence["rule"], evidence["count"], evidence["kind"]) == ("model_calls", 25, "model_call")


def test_model_calls_never_count_toward_the_ceiling_or_loops() -> None:
    """60 identical failing model calls: no recursion, no ceiling (the model-calls rule is off here)."""
    run = Run(budgets(max_model_calls_without_tool=0))
    run.feed_all([model(i, outcome="error") for i in range(60)])
    assert run.actions() == []
    assert run.state.calls == 0
    run.feed(model(59))  # the same event id again: a redelivery, counted once
    assert run.state.model_streak == 60


def test_a_model_call_needs_no_args_or_result_but_a_tool_call_does() -> None:
    model(1)
    with pytest.raises(InvalidEvent, match="one of args or args_hash"):
        decode_event({"run_id": "r", "event_id": "e", "tool": "t", "ts_ms": 1, "outcome": "success"})
    with pytest.raises(InvalidEvent, match="must be tool_call or model_call") as error:
        decode_event({"run_id": "r", "event_id": "e", "tool": "t", "ts_ms": 1, "outcome": "success", "kind": "x",
                      "args": {}, "result": 1})
    assert error.value.field == "kind"
    with pytest.raises(InvalidEvent, match="an operator command"):
        decode_event({"run_id": "r", "event_id": "e", "tool": "t", "ts_ms": 1, "outcome": "success",
                      "kind": "operator", "args": {}, "result": 1})


@pytest.mark.parametrize(("value", "micro", "tokens"), [
    (0.1, 100_000, 0), (0.0000005, 1, 0), (0.0000004999, 0, 0), (3, 3_000_000, 3), (2.9, 2_900_000, 2),
    (10**30, 1 << 62, 1 << 62), (1e300, 1 << 62, 1 << 62),
])
def test_spend_conversions_are_exact_and_saturate(value: float, micro: int, tokens: int) -> None:
    assert (micro_usd(value), token_count(value)) == (micro, tokens)


def test_spending_state_survives_the_stored_record() -> None:
    run = Run(Policy.from_mapping({"tools": {"browse": {"max_calls": 9}}}))
    run.feed_all([event("browse", "success", {"u": 1}, 1, cost_usd=0.25, tokens=7, ts_ms=1), model(2, tokens=5)])
    restored = decode_run(encode_run(StoredRun(run.state)))
    assert restored.state == run.state
    assert (restored.state.cost_micro, restored.state.tokens, restored.state.model_streak) == (250_000, 12, 1)


def test_both_engines_decide_budgets_and_model_calls_alike() -> None:
    lines = []
    for n in range(30):
        lines.append(orjson.dumps({"run_id": "spiral", "event_id": f"s{n}", "tool": "claude-x", "ts_ms": n,
                                   "outcome": "success", "kind": "model_call", "tokens": 10}) + b"\n")
        lines.append(orjson.dumps({"run_id": "spender", "event_id": f"c{n}", "tool": "browse", "ts_ms": n,
                                   "outcome": "success", "args": {"u": n}, "result": n, "cost_usd": 0.07}) + b"\n")
        lines.append(orjson.dumps({"run_id": "browser", "event_id": f"b{n}", "tool": "fetch", "ts_ms": n,
                                   "outcome": "success", "args": {"u": n}, "result": n, "tokens": 3.5}) + b"\n")
    policy = Policy.from_mapping({"defaults": {"max_cost_usd": 1}, "tools": {"fetch": {"max_calls": 5}}})
    output = replay_both(lines, policy)
    decisions = sorted((d["run_id"], d["verdict"], d["trigger_event_id"], d["evidence"].get("budget"))
                       for d in map(orjson.loads, output.splitlines()) if d["action"] != "advise")
    assert decisions == [("browser", "budget_exceeded", "b5", "calls"), ("spender", "budget_exceeded", "c14", "cost"),
                         ("spiral", "no_progress", "s24", None)]


# --- the SDK -----------------------------------------------------------------------------------------

async def test_the_sdk_reports_model_calls_and_costs_and_stops_the_spiral() -> None:
    guard = Guard.in_process(Policy.from_mapping({"defaults": {"max_model_calls_without_tool": 3}}))
    run = guard.run("run-spiral")
    await run.call("search", lambda **_: {"hits": 1}, {"q": "x"}, tokens=100, cost_usd=0.01)
    await run.model_call("claude-x", tokens=2000, cost_usd=0.02)
    await run.model_call("claude-x", tokens=2000)
    with pytest.raises(RunHalted) as halted:
        await run.model_call("claude-x", tokens=2000)
    assert halted.value.verdict == "no_progress"
    assert run.decision is not None and run.decision["evidence"]["rule"] == "model_calls"


def test_huge_costs_and_tokens_saturate_alike_in_both_engines() -> None:
    """A finite but huge cost (1e303 USD overflows to inf once scaled) and sums that would pass 2**63:
    neither engine crashes or wraps; both decide and store the same."""
    lines = [orjson.dumps({"run_id": "r", "event_id": f"e{n}", "tool": "t", "ts_ms": n, "outcome": "success",
                           "args": {"n": n}, "result": n, "cost_usd": 1e303, "tokens": 5e18}) + b"\n"
             for n in range(3)]
    policy = Policy.from_mapping({"defaults": {"max_cost_usd": 1, "max_tokens": 10, "shadow": True}})
    output = replay_both(lines, policy)
    assert [orjson.loads(d)["evidence"]["budget"] for d in output.splitlines()] == ["cost"]
    run = Run(policy)
    run.feed_all([decode_event(orjson.loads(line)) for line in lines])
    assert (run.state.cost_micro, run.state.tokens) == (1 << 62, 1 << 62)
