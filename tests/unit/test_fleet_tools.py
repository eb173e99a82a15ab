"""Tool storms (core/fleet/tools.py): one test per row of the rule and of the half-open cycle, tenant
isolation, what counts as transient, and a batch's summed facts deciding as its events one by one."""

from __future__ import annotations

from typing import Any

from stream_app.core import decode_event
from stream_app.core.fleet import ScopeDecision, ToolFact, ToolFold, ToolState, is_transient, tool_fact
from stream_app.core.fleet.tools import merge
from stream_app.core.policy import FleetThresholds

T0 = 1_764_000_000_000 - 1_764_000_000_000 % 60_000  # a window's start


def _call(run: str, n: int, ts: int, *, error: str | None = "http_429", tenant: str = "acme",
          retry_after_ms: int | None = None, upstream: str = "api.example.com") -> ToolFact:
    event: dict[str, Any] = {"run_id": run, "event_id": f"{run}-{n}", "tool": "search", "ts_ms": ts,
                             "outcome": "error" if error else "success", "args": {"q": n}, "result": "x",
                             "upstream": upstream, "tenant": tenant}
    if error:
        event["error_class"] = error
    if retry_after_ms is not None:
        event["retry_after_ms"] = retry_after_ms
    fact = tool_fact(decode_event(event))
    assert fact is not None
    return fact


def _fold(facts: list[ToolFact], fold: ToolFold | None = None, **fleet: Any) -> list[ScopeDecision]:
    fold = ToolFold(FleetThresholds(**fleet)) if fold is None else fold
    return [d for f in facts for d in fold.observe(f)]


def _storm(runs: int, *, start: int = T0, **kw: Any) -> list[ToolFact]:
    return [_call(f"r{i}", 0, start + 1_000 * i, **kw) for i in range(runs)]


def test_transient_failures_from_10_runs_pause_the_tool_at_the_10th_runs_call() -> None:
    decisions = _fold(_storm(12))
    assert [(d.action, d.verdict, d.trigger_event_id) for d in decisions] == [("pause", "tool_storm", "r9-0")]
    control = decisions[0].to_control()
    assert (control["scope"], control["tenant"], control["tool"], control["upstream"]) == \
        ("tool", "acme", "search", "api.example.com")
    assert "run_id" not in control and control["evidence"]["wait_ms"] == 60_000
    assert control["evidence"]["runs"] == 10 and control["evidence"]["window_start_ms"] == T0
    assert _fold(_storm(9)) == []


def test_a_storm_needs_half_of_the_keys_calls_to_fail_transiently() -> None:
    healthy = [_call(f"ok{i}", 0, T0 + i, error=None) for i in range(11)]
    assert _fold([*healthy, *_storm(10)]) == []  # 10 of 21 calls
    assert [d.action for d in _fold([*healthy[:10], *_storm(10)])] == ["pause"]  # 10 of 20


def test_other_4xx_never_count_and_timeouts_and_5xx_do() -> None:
    assert _fold(_storm(12, error="http_404")) == []
    assert _fold(_storm(12, error="auth")) == []
    assert [d.action for d in _fold(_storm(12, error="http_503"))] == ["pause"]
    assert [d.action for d in _fold(_storm(12, error="timeout"))] == ["pause"]
    assert [is_transient(c) for c in ("http_429", "http_5xx", "http_500", "http_599", "connection", "http_400",
                                      "http_5", "http_5000", None)] == [True] * 5 + [False] * 4


def test_one_tenants_failures_never_pause_another_tenants_tool() -> None:
    mixed = [_call(f"a{i}", 0, T0 + i, tenant="a") for i in range(6)] + \
            [_call(f"b{i}", 0, T0 + 100 + i, tenant="b") for i in range(6)]
    assert _fold(mixed) == []


def test_runs_of_another_minute_do_not_add_up() -> None:
    assert _fold(_storm(6) + _storm(6, start=T0 + 60_000)) == []


def test_the_pause_waits_the_largest_retry_after_asked_capped_at_10_minutes() -> None:
    facts = [*_storm(9), _call("r9", 0, T0 + 9_500, retry_after_ms=30_000)]
    assert _fold(facts)[0].evidence["wait_ms"] == 30_000
    facts = [*_storm(9), _call("r9", 0, T0 + 9_500, retry_after_ms=3_600_000)]
    assert _fold(facts)[0].evidence["wait_ms"] == 600_000


def test_half_open_a_success_after_the_wait_resumes_and_none_within_twice_the_wait_pauses_again() -> None:
    fold = ToolFold()
    paused = _fold(_storm(10), fold)[0]
    since = paused.ts_ms
    assert _fold([_call("probe", 1, since + 30_000, error=None)], fold) == []  # before the wait: still paused
    assert _fold([_call("probe", 2, since + 90_000)], fold) == []  # a probe failed; not yet twice the wait
    again = _fold([_call("probe", 3, since + 120_000)], fold)
    assert [(d.action, d.evidence["wait_ms"], d.evidence["pauses"]) for d in again] == [("pause", 120_000, 2)]
    assert again[0].decision_id != paused.decision_id
    resumed = _fold([_call("probe", 4, since + 120_000 + 120_000, error=None)], fold)
    assert [(d.action, d.verdict, d.trigger_event_id) for d in resumed] == [("resume", "tool_storm", "probe-4")]
    assert _fold(_storm(12, start=T0 + 1_000), fold) == []  # the storm's window fired once


def test_shadow_mode_alerts_and_pauses_nothing() -> None:
    fold = ToolFold(FleetThresholds(shadow=True))
    decisions = _fold(_storm(10), fold)
    assert [(d.action, d.evidence["would"]) for d in decisions] == [("alert", "pause")]
    assert _fold([_call("ok", 0, T0 + 500_000, error=None)], fold) == []  # no resume of a pause never made


def test_a_batch_summed_decides_as_its_events_one_by_one() -> None:
    facts = _storm(14) + [_call(f"ok{i}", 0, T0 + 20_000 + i, error=None) for i in range(3)]
    one_by_one = _fold(facts)
    summed = _fold(merge(facts[:7]) + merge(facts[7:]))
    assert [d.decision_id for d in summed] == [d.decision_id for d in one_by_one]
    assert merge(facts[:7])[0].calls == 7 and merge(facts[:7])[0].failing_runs == tuple(f"r{i}" for i in range(7))


def test_the_tool_state_round_trips_through_its_stored_form() -> None:
    fold = ToolFold()
    _fold(_storm(10), fold)
    state = fold.tools[("acme", "search", "api.example.com")]
    again = ToolState.decode(state.encode())
    assert (again.windows, again.pause, again.fired) == (state.windows, state.pause, state.fired)


def test_calls_naming_no_upstream_and_model_calls_are_no_facts() -> None:
    event = {"run_id": "r", "event_id": "e", "tool": "t", "ts_ms": 1, "outcome": "error", "args": {}, "result": 1}
    assert tool_fact(decode_event(event)) is None
    assert tool_fact(decode_event({**event, "upstream": "u", "kind": "model_call"})) is None
    fact = tool_fact(decode_event({**event, "upstream": "u", "error_class": "http_502"}))
    assert fact is not None and (fact.tenant, fact.transient, fact.failing_runs) == ("", 1, ("r",))


def test_a_fact_of_a_window_older_than_every_window_kept_is_late_and_never_fires_again() -> None:
    fold = ToolFold()
    assert [d.action for d in _fold(_storm(10), fold)] == ["pause"]
    for minute in (1, 3, 5, 7, 9):  # four more storms, each resumed a minute later: the first's marks are gone
        if minute > 1:
            assert [d.action for d in _fold(_storm(10, start=T0 + 60_000 * minute), fold)] == ["pause"]
        ok = _call(f"ok{minute}", 0, T0 + 60_000 * (minute + 1) + 30_000, error=None)
        assert [d.action for d in _fold([ok], fold)] == ["resume"]
    state = fold.tools[("acme", "search", "api.example.com")]
    assert str(T0) not in state.windows and f"tool_storm\x1f{T0}" not in state.fired
    # a worker's batch of the first storm's minute delivered this late (one fact of 12 runs) is no incident:
    # it would repeat the first pause's id, and its resume's, and runtimes would take neither as news
    assert _fold(merge(_storm(12)), fold) == []
    assert str(T0) not in state.windows and len(state.windows) == 4
    # a window still kept counts its late facts (it fired, as every window a resume saw: no new pause)
    kept = state.windows[str(T0 + 60_000 * 8)]
    calls = kept[0]
    assert _fold(merge(_storm(12, start=T0 + 60_000 * 8)), fold) == [] and kept[0] == calls + 12
