"""Hypothesis properties of the rules that had only example tests: ``tool_storm`` (order, key isolation,
what never counts), ``handoff_loop`` and the transient streak (each against a small reference model of
its row in the rule table). The trees' and threads' properties are in their own files."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from stream_app.core import Detector, RunState, decode_event
from stream_app.core.fleet import ToolFact, ToolFold, tool_fact
from stream_app.core.policy import FleetThresholds

T0 = 1_764_000_000_000 - 1_764_000_000_000 % 60_000  # a window's start
TRANSIENT = ["http_429", "http_500", "http_503", "http_5xx", "timeout", "connection"]
NOT_TRANSIENT = ["http_400", "http_401", "http_403", "http_404", "http_409", "http_422", "tool_error", None]
KEYS = [("acme", "search", "api.example.com"), ("globex", "search", "api.example.com"),
        ("acme", "weather", "api.example.com"), ("acme", "search", "mcp-search")]


def _fact(key: tuple[str, str, str], run: str, n: int, ts: int, error: str | None, failing: bool = True) -> ToolFact:
    tenant, tool, upstream = key
    event: dict[str, Any] = {"run_id": run, "event_id": f"{run}-{tool}-{upstream}-{n}", "tool": tool, "ts_ms": ts,
                             "outcome": "error" if failing else "success", "args": {"q": n}, "result": "x",
                             "upstream": upstream, "tenant": tenant}
    if failing and error is not None:
        event["error_class"] = error
    fact = tool_fact(decode_event(event))
    assert fact is not None
    return fact


def _decided(facts: list[ToolFact]) -> list[tuple[Any, ...]]:
    fold = ToolFold(FleetThresholds())
    return [(d.key, d.action, d.decision_id) for f in facts for d in fold.observe(f)]


#: One minute of calls to one key: (run number, ms into the window, transient class) per failing call.
_window_calls = st.lists(st.tuples(st.integers(0, 14), st.integers(0, 59_999), st.sampled_from(TRANSIENT)),
                         min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(calls=st.lists(_window_calls, min_size=len(KEYS), max_size=len(KEYS)), order=st.randoms(use_true_random=False))
def test_a_window_of_transient_failures_pauses_each_key_once_whatever_the_order(calls: list[Any], order: Any) -> None:
    """Every key's calls in one window fail transiently: a key is paused (once, with its window's id) iff
    its failures come from at least ``storm_min_runs`` (10) distinct runs, whatever order the facts of
    all keys come in."""
    facts = [_fact(key, f"{key[0]}-r{run}", n, T0 + at, error)
             for key, key_calls in zip(KEYS, calls, strict=True) for n, (run, at, error) in enumerate(key_calls)]
    in_time = sorted(facts, key=lambda f: f.ts_ms)
    shuffled = list(facts)
    order.shuffle(shuffled)
    expected = {(key, "pause") for key, key_calls in zip(KEYS, calls, strict=True)
                if len({run for run, _, _ in key_calls}) >= 10}
    for stream in (in_time, shuffled):
        decided = _decided(stream)
        assert {(key, action) for key, action, _ in decided} == expected
        assert len(decided) == len(expected)  # once per key
    assert sorted(_decided(in_time)) == sorted(_decided(shuffled))  # the same ids


@settings(max_examples=60, deadline=None)
@given(storm=st.lists(st.tuples(st.integers(0, 14), st.integers(0, 119_999), st.booleans()), min_size=1, max_size=60),
       noise=st.lists(st.tuples(st.sampled_from(KEYS[1:]), st.integers(0, 14), st.integers(0, 119_999),
                                st.booleans()), max_size=60))
def test_other_keys_facts_never_change_a_keys_decisions(storm: list[Any], noise: list[Any]) -> None:
    """Interleaving any facts of other keys (another tenant, tool or upstream) changes nothing about one
    key's decisions: one tenant's failures never pause another's tool."""
    key = KEYS[0]
    own = [_fact(key, f"r{run}", n, T0 + at, "http_503", failing) for n, (run, at, failing) in enumerate(storm)]
    others = [_fact(other, f"o{run}", 1000 + n, T0 + at, "http_429", failing)
              for n, (other, run, at, failing) in enumerate(noise)]
    alone = [d for d in _decided(sorted(own, key=lambda f: f.ts_ms)) if d[0] == key]
    mixed = [d for d in _decided(sorted(own + others, key=lambda f: f.ts_ms)) if d[0] == key]
    assert mixed == alone


@settings(max_examples=60, deadline=None)
@given(calls=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 179_999), st.sampled_from(NOT_TRANSIENT)),
                      max_size=80))
def test_failures_that_are_not_transient_never_pause(calls: list[Any]) -> None:
    """4xx other than 429, a tool's own error, a failure of no class: however many runs fail so, nothing."""
    facts = sorted((_fact(KEYS[0], f"r{run}", n, T0 + at, error) for n, (run, at, error) in enumerate(calls)),
                   key=lambda f: f.ts_ms)
    assert all(f.transient == 0 for f in facts)
    assert _decided(facts) == []


# --- handoff_loop -----------------------------------------------------------------------------------------

AGENTS = ["triage", "billing", "refunds"]
#: A step of a run: a handoff (from, to), or another call that succeeds or fails.
_step = st.one_of(st.tuples(st.just("handoff"), st.sampled_from(AGENTS), st.sampled_from(AGENTS)),
                  st.tuples(st.just("call"), st.booleans(), st.just("")))


def _handoff_reference(steps: list[tuple[Any, ...]], round_trips: int = 3) -> int | None:
    """The index of the call that the rule halts at: the handoff that makes ``2 * round_trips`` handoffs in
    a row back and forth between the same two agents (A->B then B->A...), counting restarted by a handoff
    of another pair or direction and cleared by a successful call of another class; None if none does."""
    count, last = 0, None
    for i, (kind, a, b) in enumerate(steps):
        if kind == "handoff":
            count = count + 1 if count and last == (b, a) else 1
            last = (a, b)
            if count >= 2 * round_trips:
                return i
        elif a:  # a successful call of another class
            count = 0
    return None


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(_step, max_size=40))
def test_handoff_loop_halts_where_the_reference_says(steps: list[tuple[Any, ...]]) -> None:
    detector, state = Detector(), RunState()
    fired = None
    for i, (kind, a, b) in enumerate(steps):
        if kind == "handoff":
            event = {"run_id": "r", "event_id": f"e{i}", "tool": f"transfer_to_{b}", "ts_ms": 1_000 + i,
                     "outcome": "success", "args": {}, "result": "handed off", "agent_id": a, "child_agent_id": b,
                     "tool_class": "handoff"}
        else:  # distinct arguments and results: no other rule has a streak to count
            event = {"run_id": "r", "event_id": f"e{i}", "tool": "lookup_order", "ts_ms": 1_000 + i,
                     "outcome": "success" if a else "error", "args": {"order": i}, "result": f"order {i}"}
        verdicts = [d.verdict for d in detector.evaluate(state, decode_event(event)).decisions if d.action == "halt"]
        if "handoff_loop" in verdicts:
            fired = i
            break
    assert fired == _handoff_reference(steps)


# --- the transient streak ---------------------------------------------------------------------------------

def _streak_reference(steps: list[tuple[bool, str | None]], budget: int = 3, pauses: int = 2) -> list[tuple[int, str]]:
    """The same failing call again and again (``(False, class)``), a successful call of another tool now
    and then (``(True, None)``), which ends the streak. Where recursion would halt (the call past the retry
    budget in the current stretch), a stretch whose failures were all transient pauses instead and a new
    stretch of the same streak begins; after ``pauses`` pauses of one streak, or on a stretch with a
    failure that is not transient, it halts."""
    out: list[tuple[int, str]] = []
    count, all_transient, paused = 0, True, 0
    for i, (other, error) in enumerate(steps):
        if other:
            count, all_transient, paused = 0, True, 0
            continue
        count += 1
        all_transient = all_transient and error in TRANSIENT
        if count > budget:
            if all_transient and paused < pauses:
                out.append((i, "pause"))
                paused, count, all_transient = paused + 1, 0, True
            else:
                out.append((i, "halt"))
                break
    return out


#: Mostly transient failures, so that streaks reach their pauses; now and then another failure or call.
_streak_step = st.sampled_from([(False, error) for error in TRANSIENT * 8] + [(False, error) for error in NOT_TRANSIENT]
                               + [(True, None)] * 2)


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(_streak_step, min_size=1, max_size=24))
@example(steps=[(False, "http_503")] * 12)  # pause, pause, halt
def test_a_transient_streak_pauses_twice_then_halts_where_the_reference_says(
        steps: list[tuple[bool, str | None]]) -> None:
    """The same failing call again and again, each failure of a random class, now and then a successful
    call of another tool, which ends the streak (its pauses counted anew)."""
    detector, state = Detector(), RunState()
    got: list[tuple[int, str]] = []
    for i, (other, error) in enumerate(steps):
        if other:
            event: dict[str, Any] = {"run_id": "r", "event_id": f"e{i}", "tool": "notes", "ts_ms": i,
                                     "outcome": "success", "args": {"i": i}, "result": f"note {i}"}
        else:
            event = {"run_id": "r", "event_id": f"e{i}", "tool": "t", "ts_ms": i, "outcome": "error", "args": {},
                     "result": "503", "upstream": "u"}
            if error is not None:
                event["error_class"] = error
        got += [(i, d.action) for d in detector.evaluate(state, decode_event(event)).decisions
                if d.action in ("pause", "halt")]
        if got and got[-1][1] == "halt":
            break
    assert got == _streak_reference(steps)
