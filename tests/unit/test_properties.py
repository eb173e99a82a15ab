"""Hypothesis properties of classification: the invariants the product promises."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from .conftest import Run, event

failing = st.sampled_from(["error", "empty", "noop"])


@given(st.integers(0, 30), failing, st.integers(0, 10**6), st.text(min_size=1, max_size=20))
def test_halt_index_is_budget_plus_one(budget, outcome, gap_ms, body) -> None:
    """Invariant: identical failing calls within the window halt exactly at call budget + 1."""
    run = Run()
    gap = gap_ms % (600_000 // (budget + 1))  # keep the whole streak within the 600 s window
    run.feed_all([event(outcome=outcome, result=body, retry_budget=budget, ts_ms=i * gap)
                  for i in range(budget + 3)])
    assert run.halts()[:1] == [(budget + 1, "recursion")]


@given(st.lists(st.sampled_from(["success", "error", "empty", "noop"]), min_size=1, max_size=49))
def test_strictly_changing_outcomes_never_halt(outcomes) -> None:
    """Invariant: when no two consecutive calls share an outcome, the same call never halts (below the
    ceiling), whatever the result bodies."""
    changing = [o for i, o in enumerate(outcomes) if i == 0 or o != outcomes[i - 1]]
    run = Run()
    run.feed_all([event(outcome=o, result="same body", ts_ms=i) for i, o in enumerate(changing)])
    assert [v for _, v in run.halts() if v != "cycle"] == []


@given(st.lists(st.text(max_size=6), min_size=1, max_size=49, unique=True))
def test_distinct_results_never_halt_below_the_ceiling(bodies) -> None:
    """Invariant: a failure that changes its body every time is never a recursion or semantic loop."""
    run = Run()
    run.feed_all([event(result=b, ts_ms=i) for i, b in enumerate(bodies)])
    assert run.halts() == []


@given(st.integers(1, 12), st.integers(1, 5))
def test_duplicates_never_change_decisions(n_calls, copies) -> None:
    """Invariant: redelivering every event up to ``copies`` times yields the same decisions."""
    calls = [event(event_id=f"e{i}", ts_ms=i) for i in range(n_calls)]
    once = Run().feed_all(calls)
    many = Run().feed_all([c for c in calls for _ in range(copies)])
    assert [d.decision_id for _, d in many.decisions] == [d.decision_id for _, d in once.decisions]
