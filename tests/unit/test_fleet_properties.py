"""Hypothesis properties of the rules that had only example tests: ``tool_storm``, ``handoff_loop`` and the
transient streak, each held to a reference of its row in the rule table over calls of every class (the
trees' and threads' properties are in their own files): a window's first pause at the first fact whose
counts cross the rule, whatever the order and batching (the same id); the half-open cycle fact by fact;
key isolation with every decision compared; and ``handoff_loop`` and the transient streak over
interleaved runs, in both engines (``loopwarden replay``, byte-identical). A redelivered batch counting
each call once is the keyed fold's (tests/unit/test_worker_fleet.py)."""

from __future__ import annotations

import io
import re
from typing import Any

import orjson
from hypothesis import example, given, settings
from hypothesis import strategies as st

from stream_app.commands.replay import replay
from stream_app.core import Policy, decode_event
from stream_app.core.fleet import ToolFact, ToolFold, is_transient, scope_decision_id, tool_fact
from stream_app.core.fleet.tools import merge
from stream_app.core.policy import FleetThresholds

from .conftest import replay_both

T0 = 1_764_000_000_000 - 1_764_000_000_000 % 60_000  # a window's start
KEYS = [("acme", "search", "api.example.com"), ("globex", "search", "api.example.com"),
        ("acme", "weather", "api.example.com"), ("acme", "search", "mcp-search")]
AGENTS = ["triage", "billing", "refunds"]


# --- tool_storm against a reference of its rule ------------------------------------------------------------
# The calls below are of every class: each a success ("ok"), a failure of no class (None) or of a class
# drawn from the transient ones, every HTTP status 400-599 and names that only look transient. Whether a
# class counts is the rule's text (``_counts``), not the code's ``is_transient``.

_TRANSIENT_NAMED = ("http_429", "http_5xx", "timeout", "connection")
_transient_classes = st.one_of(st.sampled_from(_TRANSIENT_NAMED), st.integers(500, 599).map(lambda n: f"http_{n}"))
_other_classes = st.one_of(st.integers(400, 499).filter(lambda n: n != 429).map(lambda n: f"http_{n}"),
                           st.sampled_from(["http_4xx", "http_5", "http_5000", "http_50x", "http_5 3", "HTTP_503",
                                            "Timeout", "tool_error", "auth", "http_600"]),
                           st.none())
#: A call's outcome: "ok", or the class of its failure (None: a failure of no class). Mostly transient
#: failures, so that windows reach and cross the rule's thresholds both ways.
_outcome = st.sampled_from([0, 1, 1, 2]).flatmap(lambda kind: (st.just("ok"), _transient_classes, _other_classes)[kind])


@st.composite
def _minute_of_calls(draw: Any, window_ms: int = 0) -> list[tuple[int, int, str | None]]:
    """One minute of one key's calls, (run, ms, outcome) each, in any order: transient failures of up to 13
    distinct runs (one or two each), and up to twice as many calls of any outcome from 15 runs (the
    rule's two thresholds are met, or missed, by a little or by a lot)."""
    calls = [(run, window_ms + draw(st.integers(0, 59_999)), draw(_transient_classes))
             for run in range(draw(st.integers(0, 13))) for _ in range(draw(st.integers(1, 2)))]
    calls += draw(st.lists(st.tuples(st.integers(0, 14), st.integers(window_ms, window_ms + 59_999), _outcome),
                           max_size=2 * len(calls) + 2))
    return list(draw(st.permutations(calls)))


def _counts(outcome: str | None) -> bool:
    """Whether a call of ``outcome`` is a transient failure, as the rule's text says: http_429, http_5xx,
    http_500..http_599, timeout, connection; no other 4xx, nothing else."""
    return outcome != "ok" and outcome is not None and (
        outcome in _TRANSIENT_NAMED or re.fullmatch("http_5[0-9][0-9]", outcome) is not None)


def _storm_fact(key: tuple[str, str, str], run: int, n: int, ts: int, outcome: str | None,
                retry_after_ms: int | None = None) -> ToolFact:
    tenant, tool, upstream = key
    event: dict[str, Any] = {"run_id": f"r{run}", "event_id": f"{tenant}-{tool}-{upstream}-{n}", "tool": tool,
                             "ts_ms": ts, "outcome": "success" if outcome == "ok" else "error", "args": {"q": n},
                             "result": "x", "upstream": upstream, "tenant": tenant}
    if outcome not in ("ok", None):
        event["error_class"] = outcome
    if retry_after_ms is not None:
        event["retry_after_ms"] = retry_after_ms
    fact = tool_fact(decode_event(event))
    assert fact is not None
    return fact


def _window_id(key: tuple[str, ...], window_ms: int) -> str:
    """The first pause's id as the rule derives it: from (scope, key, action, verdict, window)."""
    return scope_decision_id("tool", key, "pause", "tool_storm", str(window_ms))


def _chunks(facts: list[ToolFact], cuts: list[bool]) -> list[ToolFact]:
    """``facts`` cut after each fact whose ``cuts`` is true, each piece summed per key and window (a
    worker's batch: ``merge``)."""
    out: list[ToolFact] = []
    piece: list[ToolFact] = []
    for fact, cut in zip(facts, cuts, strict=True):
        piece.append(fact)
        if cut:
            out += merge(piece)
            piece = []
    return out + merge(piece)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), calls=_minute_of_calls(), min_runs=st.sampled_from([10, 10, 10, 1, 4]))
@example(data=None, calls=[(run, 0, "http_503") for run in range(10)], min_runs=10)  # the 10th run's failure
@example(data=None, calls=[(0, 0, "ok")] * 11 + [(run, 0, "http_429") for run in range(10)], min_runs=10)  # 10 of 21
@example(data=None, calls=[(0, 0, "ok")] * 10 + [(run, 0, "timeout") for run in range(10)], min_runs=10)  # 10 of 20
@example(data=None, calls=[(run, 0, "http_404") for run in range(12)], min_runs=10)  # not transient
def test_a_window_pauses_at_the_first_fact_whose_counts_cross_the_rule(data: Any, calls: list[Any],
                                                                       min_runs: int) -> None:
    """One key's calls in one window, in any order, summed in batches cut anywhere: the key is paused
    once, at the first (summed) fact after which the window's transient failures come from at least
    ``storm_min_runs`` distinct runs and are at least half of its calls, with the window's id; never if
    no fact gets there (fewer distinct failing runs, fewer than half the calls, classes that never
    count)."""
    cuts = data.draw(st.lists(st.booleans(), min_size=len(calls), max_size=len(calls))) if data else [True] * len(calls)
    key = KEYS[0]
    facts = [_storm_fact(key, run, n, T0 + at, outcome) for n, (run, at, outcome) in enumerate(calls)]
    expected = []
    runs: set[int] = set()
    transient = 0
    for n, (run, _, outcome) in enumerate(calls):
        if _counts(outcome):
            transient += 1
            runs.add(run)
        if (cuts[n] or n == len(calls) - 1) and len(runs) >= min_runs and 2 * transient >= n + 1:
            expected = [("pause", "tool_storm", facts[n].event_id, _window_id(key, T0), n + 1, transient, min_runs)]
            break
    fold = ToolFold(FleetThresholds(storm_min_runs=min_runs))
    decided = [(d.action, d.verdict, d.trigger_event_id, d.decision_id, d.evidence["calls"], d.evidence["transient"],
                d.evidence["runs"]) for f in _chunks(facts, cuts) for d in fold.observe(f)]
    assert decided == expected


@settings(max_examples=100, deadline=None)
@given(data=st.data(),
       calls=st.lists(_minute_of_calls(), min_size=len(KEYS), max_size=len(KEYS)),
       windows=st.lists(st.sampled_from([T0, T0 + 60_000, T0 + 3_600_000]), min_size=len(KEYS), max_size=len(KEYS)))
def test_a_windows_first_pause_is_the_same_whatever_the_order_and_batching_of_its_facts(
        data: Any, calls: list[list[Any]], windows: list[int]) -> None:
    """Facts of several keys, each key's in one window: every order and every batching of them pauses each
    key whose window's counts (in the end) cross the rule, once, with the window's id; a key paused in
    some order only is paused with that same id (the decision set (scope, key, action, verdict, id) of
    the crossing keys is order-independent)."""
    facts = [_storm_fact(key, run, n, window + at, outcome)
             for key, window, key_calls in zip(KEYS, windows, calls, strict=True)
             for n, (run, at, outcome) in enumerate(key_calls)]
    crossing = set()
    for key, window, key_calls in zip(KEYS, windows, calls, strict=True):
        runs = {run for run, _, outcome in key_calls if _counts(outcome)}
        if len(runs) >= 10 and 2 * sum(_counts(outcome) for _, _, outcome in key_calls) >= len(key_calls):
            crossing.add((key, _window_id(key, window)))
    sets = []
    for _ in range(2):
        order = data.draw(st.permutations(facts))
        cuts = data.draw(st.lists(st.booleans(), min_size=len(facts), max_size=len(facts)))
        fold = ToolFold()
        decided = [(d.scope, d.key, d.action, d.verdict, d.decision_id) for f in _chunks(order, cuts)
                   for d in fold.observe(f)]
        assert len(decided) == len(set(decided))  # once per key
        assert {(paused, decision_id) for _, paused, _, _, decision_id in decided} >= crossing
        for scope, paused, action, verdict, decision_id in decided:
            assert (scope, action, verdict) == ("tool", "pause", "tool_storm")
            assert decision_id == _window_id(paused, windows[KEYS.index(paused)])  # type: ignore[arg-type]
        sets.append({d for d in decided if (d[1], d[4]) in crossing})
    assert sets[0] == sets[1]


@st.composite
def _key_facts(draw: Any) -> list[ToolFact]:
    """One key's facts: up to 3 minutes of calls in any order, then probes over 10 minutes, some succeeding;
    now and then a call asks for a wait (1 s, 30 s)."""
    calls = draw(st.permutations([call for minute in draw(st.lists(
        st.sampled_from([0, 60_000, 180_000, 240_000]).flatmap(_minute_of_calls), max_size=3)) for call in minute]))
    probes = draw(st.lists(st.tuples(st.integers(0, 599_999), st.booleans()), max_size=8))
    calls += [(99, at, "ok" if ok else "http_503") for at, ok in sorted(probes)]
    waits = draw(st.lists(st.sampled_from([None, None, 1_000, 30_000]), min_size=len(calls), max_size=len(calls)))
    return [_storm_fact(KEYS[0], run, n, T0 + at, outcome, wait)
            for n, ((run, at, outcome), wait) in enumerate(zip(calls, waits, strict=True))]


def _storm_then(*probes: tuple[int, str] | tuple[int, str, int], retry_after_ms: int | None = None) -> list[ToolFact]:
    """10 runs failing at T0 + 0..9 s (the 10th pauses at T0 + 9 s), then probes ``(ms after the pause,
    outcome[, run])``."""
    return [*(_storm_fact(KEYS[0], run, run, T0 + 1_000 * run, "http_503", retry_after_ms) for run in range(10)),
            *(_storm_fact(KEYS[0], (*probe, 99)[2], 100 + n, T0 + 9_000 + probe[0], probe[1])
              for n, probe in enumerate(probes))]


@settings(max_examples=150, deadline=None)
@given(facts=_key_facts(), shadow=st.sampled_from([False, False, False, True]))
@example(facts=_storm_then((59_999, "ok"), (60_000, "ok")), shadow=False)  # resumed at pause + wait exactly
@example(facts=_storm_then((119_999, "timeout"), (120_000, "timeout"), (359_999, "ok"), (360_000, "ok")),
         shadow=False)  # paused again at twice the wait exactly, for 120 s; resumed 120 s later
@example(facts=_storm_then((799_999, "http_503"), (800_000, "http_503"), (2_000_000, "http_503"),
                           retry_after_ms=400_000), shadow=False)  # 400 s asked for: paused again for 600 s (the cap), then again
@example(facts=_storm_then(*((52_000 + run, "http_503", 10 + run) for run in range(10)), (60_000, "ok"),
                           (60_001, "http_503", 20)), shadow=False)  # the next minute's storm came while paused
def test_a_keys_pauses_and_resumes_follow_the_half_open_cycle(facts: list[ToolFact], shadow: bool) -> None:
    """Fact by fact: a storm pauses (shadow: alerts) at most once per window, ever, never while the key is
    paused, with the window's id, for the largest wait asked in its window (capped), else 60 s; while
    paused, the first success at or after the pause + its wait resumes, else the first fact at or after
    twice the wait pauses again, the wait doubled (capped), each with its own id; nothing else. After a
    resume, only a window after those seen so far starts another storm."""
    key = KEYS[0]
    fold = ToolFold(FleetThresholds(shadow=shadow))
    pause: tuple[int, int, int, int] | None = None
    fired: set[int] = set()
    asked: dict[int, set[int]] = {}
    seen: set[int] = set()  # the windows seen before the last resume
    for fact in facts:
        asked.setdefault(fact.window_ms, {60_000}).add(min(fact.retry_after_ms, 600_000) or 60_000)
        decided = [(d.action, d.evidence["rule"], d.decision_id, d.evidence["wait_ms"] if d.action != "resume" else
                    None, d.trigger_event_id) for d in fold.observe(fact)]
        if pause is None:
            if decided:
                [(action, rule, decision_id, wait, trigger)] = decided
                assert (action, rule, trigger) == ("alert" if shadow else "pause", "storm", fact.event_id)
                assert fact.window_ms not in fired | seen
                assert decision_id == scope_decision_id("tool", key, action, "tool_storm", str(fact.window_ms))
                assert wait in asked[fact.window_ms]
                fired.add(fact.window_ms)
                if not shadow:
                    pause = (fact.ts_ms, wait, 1, fact.window_ms)
            continue
        since, wait, ordinal, window = pause
        if fact.success_ts_ms >= since + wait:
            assert decided == [("resume", "recovered", scope_decision_id("tool", key, "resume", "tool_storm",
                                                                         f"{window}:{ordinal}"), None, fact.event_id)]
            pause = None
            seen |= set(asked)
        elif fact.ts_ms >= since + 2 * wait:
            again = min(2 * wait, 600_000)
            assert decided == [("pause", "still_failing", scope_decision_id("tool", key, "pause", "tool_storm",
                                                                            f"{window}:{ordinal + 1}"),
                                again, fact.event_id)]
            pause = (fact.ts_ms, again, ordinal + 1, window)
        else:
            assert decided == []


@settings(max_examples=100, deadline=None)
@given(data=st.data(), own=_key_facts(),
       others=st.lists(st.tuples(st.integers(1, len(KEYS) - 1), st.integers(0, 14), st.integers(0, 299_999),
                                 _outcome), max_size=80),
       shadow=st.booleans())
def test_facts_of_other_keys_never_change_a_keys_decisions(data: Any, own: list[ToolFact], others: list[Any],
                                                           shadow: bool) -> None:
    """A key's facts (``_key_facts``: storms, waits asked for, pauses again, resumes) and facts of other
    keys (another tenant, tool or upstream; the same runs) put anywhere among them: the key's decisions,
    every field of each, are those it makes alone, and the others' those they make without it. One
    tenant's failures never pause another tenant's tool. (Within the fold's memory: ``tool_ttl_ms`` of
    event time, ``max_tools`` keys.)"""
    key = KEYS[0]
    stream = list(own)
    alone = _scope_decisions(stream, shadow)
    noise = [_storm_fact(KEYS[k], run, 1000 + n, T0 + at, outcome) for n, (k, run, at, outcome) in enumerate(others)]
    for fact in noise:
        stream.insert(data.draw(st.integers(0, len(stream))), fact)
    mixed = _scope_decisions(stream, shadow)
    assert [d for d in mixed if d.key == key] == alone
    assert [d for d in mixed if d.key != key] == _scope_decisions([f for f in stream if f.key != key], shadow)


def _scope_decisions(facts: list[ToolFact], shadow: bool = False) -> list[Any]:
    fold = ToolFold(FleetThresholds(shadow=shadow))
    return [d for f in facts for d in fold.observe(f)]


@settings(max_examples=100, deadline=None)
@given(calls=st.lists(st.tuples(st.integers(0, len(KEYS) - 1), st.integers(0, 8), st.integers(0, 600_000), _outcome,
                                st.sampled_from([None, 1_000])), max_size=120))
def test_failures_from_fewer_than_10_runs_never_pause(calls: list[Any]) -> None:
    """However many calls of any class from 9 runs, in any order and window, for any key: nothing."""
    facts = [_storm_fact(KEYS[k], run, n, T0 + at, outcome, wait) for n, (k, run, at, outcome, wait) in enumerate(calls)]
    assert _scope_decisions(facts) == []


# --- handoff_loop and the transient streak in both engines, runs interleaved ------------------------------

def _replay(lines: list[bytes], policy: Policy) -> list[dict[str, Any]]:
    """The run decisions (not the warnings) ``loopwarden replay`` writes for ``lines``: the native engine's
    and the reference's, held byte-identical (the reference's alone without the native engine)."""
    try:
        import loopwarden_native  # noqa: F401
    except ImportError:
        out = io.BytesIO()
        replay(lines, policy, out, io.StringIO(), engine="python")
        output = out.getvalue()
    else:
        output = replay_both(lines, policy)
    return [d for d in map(orjson.loads, output.splitlines()) if "run_id" in d and d["action"] != "advise"]


def _interleaved(data: Any, runs: dict[str, list[dict[str, Any]]]) -> list[bytes]:
    """The runs' events, each run's in order, the runs interleaved as ``data`` draws (one after the other
    without it); times ascending."""
    queues = {run: list(events) for run, events in runs.items() if events}
    lines: list[bytes] = []
    while queues:
        run = data.draw(st.sampled_from(sorted(queues))) if data else min(queues)
        event = queues[run].pop(0)
        if not queues[run]:
            del queues[run]
        lines.append(orjson.dumps({**event, "ts_ms": 1_000 + len(lines)}) + b"\n")
    return lines


RUNS = ["r1", "r2", "r3"]
#: A step of a run: a handoff (from, to: None is no agent named; it succeeds or fails), another call (it
#: succeeds or fails), or a model call.
_run_step = st.one_of(st.tuples(st.just("handoff"), st.sampled_from([*AGENTS, None]), st.sampled_from([*AGENTS, None]),
                                st.booleans()),
                      st.tuples(st.just("handoff"), st.sampled_from(AGENTS[:2]), st.sampled_from(AGENTS[:2]),
                                st.booleans()),
                      st.tuples(st.just("call"), st.booleans(), st.just(None), st.just(None)),
                      st.tuples(st.just("model"), st.just(None), st.just(None), st.just(None)))
#: Handoffs back and forth between two agents (A->B, B->A, ...), each succeeding or failing.
_ping_pong = st.tuples(st.sampled_from([*AGENTS, None]), st.sampled_from([*AGENTS, None]),
                       st.lists(st.booleans(), min_size=1, max_size=7)).map(
    lambda t: [("handoff", *((t[0], t[1]) if i % 2 == 0 else (t[1], t[0])), ok) for i, ok in enumerate(t[2])])
#: A run: ping-pongs and single steps, at most 24 (the iteration ceiling and the model calls in a row
#: that halt a run are out of reach).
_handoff_run = st.lists(st.one_of(_ping_pong, _run_step.map(lambda step: [step])), max_size=12).map(
    lambda blocks: [step for block in blocks for step in block][:24])


def _handoff_reference_of(steps: list[tuple[Any, ...]], round_trips: int) -> tuple[int, str | None, str | None] | None:
    """The rule's text: the handoff-class call (whatever its outcome) that makes ``2 * round_trips``
    handoffs in a row going back and forth between the same two agents (A->B, B->A, ...), with no
    successful call of another kind between (a failing one, a model call, change nothing); its index
    and agents, or None."""
    count, last = 0, None
    for i, (kind, a, b, _) in enumerate(steps):
        if kind == "handoff":
            count = count + 1 if count and last == (b or "", a or "") else 1
            last = (a or "", b or "")
            if count >= 2 * round_trips:
                return i, a, b
        elif kind == "call" and a:
            count = 0
    return None


def _handoff_event(run: str, i: int, step: tuple[Any, ...]) -> dict[str, Any]:
    kind, a, b, ok = step
    event: dict[str, Any] = {"run_id": run, "event_id": f"{run}-{i}"}
    if kind == "handoff":  # a failing handoff's result is its own: no other rule sees a repetition
        event.update(tool=f"transfer_to_{b}", outcome="success" if ok else "error", args={}, tool_class="handoff",
                     result="handed off" if ok else f"refused {run} {i}")
        event.update({name: agent for name, agent in (("agent_id", a), ("child_agent_id", b)) if agent is not None})
    elif kind == "call":  # distinct arguments and results: no other rule has a streak or cycle to count
        event.update(tool="lookup_order", outcome="success" if a else "error", args={"order": i},
                     result=f"order {run} {i}")
    else:
        event.update(tool="gpt", kind="model_call", outcome="success", args={}, result="thinking")
    return event


@settings(max_examples=150, deadline=None)
@given(data=st.data(), steps=st.lists(_handoff_run, min_size=len(RUNS), max_size=len(RUNS)),
       round_trips=st.sampled_from([3, 3, 3, 1, 2]))
def test_handoff_loops_halt_where_the_reference_says_in_both_engines(data: Any, steps: list[Any],
                                                                     round_trips: int) -> None:
    """Runs interleaved, each a random sequence of handoffs (between two or three agents, some unnamed;
    succeeding or failing), other calls (succeeding or failing) and model calls: each run halts by
    ``handoff_loop`` exactly where the reference says, and nothing else halts it."""
    policy = Policy() if round_trips == 3 else Policy.from_mapping({"defaults": {"handoff_round_trips": round_trips}})
    lines = _interleaved(data, {run: [_handoff_event(run, i, s) for i, s in enumerate(run_steps)]
                                for run, run_steps in zip(RUNS, steps, strict=True)})
    decided = _replay(lines, policy)
    for run, run_steps in zip(RUNS, steps, strict=True):
        expected = _handoff_reference_of(run_steps, round_trips)
        got = [(d["action"], d["verdict"], d["trigger_event_id"], d["evidence"]["count"], d["evidence"]["agents"])
               for d in decided if d["run_id"] == run]
        assert got == ([] if expected is None else
                       [("halt", "handoff_loop", f"{run}-{expected[0]}", 2 * round_trips, [expected[1], expected[2]])])


#: A step of a run with a transient streak: the tool ``t`` failing again with the streak's result
#: ("same": its class, the wait it asks for), ``t`` failing with a result of its own ("odd"), another
#: tool succeeding or failing ("other"), or a model call.
_same = st.sampled_from([True] * 8 + [False]).flatmap(
    lambda transient: st.tuples(st.just("same"), _transient_classes, st.sampled_from([None, 2_000])) if transient
    else st.tuples(st.just("same"), _other_classes, st.just(None)))
_streak_run_step = st.one_of(
    _same, st.tuples(st.just("odd"), st.one_of(_transient_classes, _other_classes), st.just(None)),
    st.tuples(st.just("other"), _outcome, st.just(None)), st.tuples(st.just("model"), st.just(None), st.just(None)))
#: A run: stretches of the same failure and single steps, at most 30.
_streak_run = st.lists(st.one_of(st.lists(_same, min_size=1, max_size=6), _streak_run_step.map(lambda s: [s])),
                       max_size=10).map(lambda blocks: [step for block in blocks for step in block][:30])


def _streak_reference_of(steps: list[tuple[Any, ...]], mutating: bool, budget: int = 3,
                         pauses: int = 2) -> list[tuple[int, str, str, int]]:
    """The rule's text: a streak is the calls in a row of one tool failing with one result (a model call
    is none of its business; any other call ends it, and a failure of another result starts another).
    Where the streak's count passes the retry budget, ``recursion`` (``semantic_loop`` when its arguments
    mutate) halts; if every failure of the streak was transient it pauses instead and fills its budget
    again, twice; the third time it halts with ``recursion``. (index, action, verdict, pause) of each."""
    out: list[tuple[int, str, str, int]] = []
    label: object = None
    count, all_transient, paused = 0, True, 0
    for i, (kind, outcome, _) in enumerate(steps):
        if kind == "model":
            continue
        if kind in ("same", "odd"):
            this = "same" if kind == "same" else i
            if this == label:
                count += 1
                all_transient = all_transient and _counts(outcome)
            else:
                label, count, all_transient, paused = this, 1, _counts(outcome), 0
        else:
            label, count, all_transient, paused = None, 0, True, 0
        if count > budget:
            verdict = "semantic_loop" if mutating else "recursion"
            if all_transient and paused < pauses:
                paused, count = paused + 1, 0
                out.append((i, "pause", verdict, paused))
            else:
                out.append((i, "halt", verdict if not all_transient else "recursion", 0))
                break
    return out


def _streak_event(run: str, i: int, step: tuple[Any, ...], mutating: bool) -> dict[str, Any]:
    kind, outcome, wait = step
    event: dict[str, Any] = {"run_id": run, "event_id": f"{run}-{i}", "upstream": "api.example.com"}
    if kind == "same":
        event.update(tool="t", outcome="error", args={"page": i} if mutating else {}, result="503 Service Unavailable")
    elif kind == "odd":
        event.update(tool="t", outcome="error", args={}, result=f"failed: {run} {i}")
    elif kind == "other":
        event.update(tool="notes", outcome="success" if outcome == "ok" else "error", args={"i": i},
                     result=f"note {run} {i}")
    else:
        event.update(tool="gpt", kind="model_call", outcome="success", args={}, result="thinking")
    if outcome not in ("ok", None):
        event["error_class"] = outcome
    if wait is not None:
        event["retry_after_ms"] = wait
    return event


@settings(max_examples=150, deadline=None)
@given(data=st.data(), steps=st.lists(_streak_run, min_size=len(RUNS), max_size=len(RUNS)),
       mutating=st.lists(st.booleans(), min_size=len(RUNS), max_size=len(RUNS)))
@example(data=None, steps=[[("same", "http_503", None)] * 12, [("same", "timeout", 2_000)] * 6 + [("model", None, None)]
                           + [("same", "http_429", None)] * 6, [("same", "http_404", None)] * 5],
         mutating=[False, True, False])
def test_transient_streaks_pause_twice_then_halt_where_the_reference_says_in_both_engines(
        data: Any, steps: list[Any], mutating: list[bool]) -> None:
    """Runs interleaved, each failing again and again at one tool, the failures of every class, now and
    then another call: each run's pauses and halt come where the reference says, with the verdict it
    says, each pause for the wait its trigger asked for (else 60 s)."""
    runs = {run: [_streak_event(run, i, s, m) for i, s in enumerate(run_steps)]
            for run, run_steps, m in zip(RUNS, steps, mutating, strict=True)}
    decided = _replay(_interleaved(data, runs), Policy())
    for (run, events), run_steps, m in zip(runs.items(), steps, mutating, strict=True):
        got = [(d["trigger_event_id"], d["action"], d["verdict"], d["evidence"].get("pause", 0),
                d["evidence"].get("wait_ms")) for d in decided if d["run_id"] == run]
        assert got == [(f"{run}-{i}", action, verdict, pause,
                        (events[i].get("retry_after_ms") or 60_000) if action == "pause" else None)
                       for i, action, verdict, pause in _streak_reference_of(run_steps, m)]


@settings(max_examples=50, deadline=None)
@given(digits=st.text(st.characters(categories=["Nd", "No"]), min_size=2, max_size=2))
@example(digits="\u00b23")  # "http_5²3": 8 characters, 9 UTF-8 bytes
def test_only_http_500_to_599_of_the_http_5_classes_are_transient_in_both_engines(digits: str) -> None:
    """A streak of 12 identical failures of class ``http_5`` + two digit characters pauses twice and halts
    (transient) iff the class is http_500..http_599, in both engines."""
    error_class = f"http_5{digits}"
    lines = [orjson.dumps({"run_id": "r", "event_id": f"e{n}", "tool": "t", "ts_ms": n, "outcome": "error",
                           "args": {}, "result": "503", "error_class": error_class, "upstream": "u"}) + b"\n"
             for n in range(12)]
    actions = [d["action"] for d in _replay(lines, Policy())]
    assert actions == (["pause", "pause", "halt"] if _counts(error_class) else ["halt"])
    assert is_transient(error_class) == _counts(error_class)


def test_a_transient_streak_counts_per_upstream_in_both_engines() -> None:
    """The streak's key is (run, tool, upstream): the same failure of the same call at another host is
    another streak (a failover is no loop), so 3 failures at the primary then 4 at the mirror pause at
    the mirror's 4th, not at the 4th call; a call naming no upstream keeps the tool's own streak."""
    def line(n: int, upstream: str | None) -> bytes:
        event = {"run_id": "r", "event_id": f"e{n}", "tool": "t", "ts_ms": n, "outcome": "error", "args": {},
                 "result": "503", "error_class": "http_503"}
        return orjson.dumps({**event, "upstream": upstream} if upstream else event) + b"\n"
    failover = [line(n, "primary.example.com") for n in range(3)] + \
               [line(n, "mirror.example.com") for n in range(3, 9)]
    assert [(d["trigger_event_id"], d["action"]) for d in _replay(failover, Policy())] == [("e6", "pause")]
    unnamed = [line(n, None) for n in range(9)]
    assert [(d["trigger_event_id"], d["action"]) for d in _replay(unnamed, Policy())] == \
        [("e3", "pause"), ("e7", "pause")]


def _model_call(run: str, n: int, ts_ms: int | None = None, **fields: Any) -> bytes:
    """A JSONL line: run ``run``'s model call ``n`` (at ``ts_ms``, else ``n``), ``fields`` over it."""
    event = {"run_id": run, "event_id": f"{run}-{n}", "tool": "claude", "kind": "model_call",
             "ts_ms": n if ts_ms is None else ts_ms, "outcome": "success", "args": {}, "result": n, **fields}
    return orjson.dumps(event) + b"\n"


#: A spawn-class tool call's fields (with ``"tools": {"Task": {"tool_class": "spawn"}}`` in the policy),
#: and a sub-agent's of root ``root``.
_SPAWN = {"tool": "Task", "kind": "tool_call", "child_run_id": "kid", "task_hash": "a" * 16}
_KID = {"root_run_id": "root", "parent_run_id": "root", "depth": 1}


def _tree_decided(lines: list[bytes], policy: Policy) -> list[dict[str, Any]]:
    """The tree decisions of replaying ``lines`` (the same in both engines)."""
    return [d for d in map(orjson.loads, replay_both(lines, policy).splitlines()) if d.get("scope") == "tree"]


def test_a_trees_budget_counts_the_roots_calls_before_and_after_its_spawn_in_both_engines() -> None:
    """The root spends $0.50 thinking, spawns a sub-agent, which spends $0.30, then spends $0.30 more:
    $1.10 is past a $1 tree budget at the root's last call, not at $0.30 (its sub-agent alone), in both
    engines; a root that spawns nothing sends no tree fact, whatever it spends."""
    policy = Policy.from_mapping({"fleet": {"max_tree_cost_usd": 1}, "tools": {"Task": {"tool_class": "spawn"}}})
    lines = [_model_call("root", 1, cost_usd=0.25), _model_call("root", 2, cost_usd=0.25),
             _model_call("root", 3, **_SPAWN), _model_call("kid", 4, cost_usd=0.3, **_KID),
             _model_call("root", 5, cost_usd=0.2), _model_call("root", 6, cost_usd=0.1)]
    decided = _tree_decided(lines, policy)
    assert [(d["verdict"], d["trigger_event_id"], d["evidence"]["cost_usd"]) for d in decided] == \
        [("tree_budget", "root-6", 1.1)]
    assert _tree_decided([_model_call("solo", n, cost_usd=0.5) for n in range(5)], policy) == []


def test_a_root_forgotten_while_its_subagent_works_adds_what_it_spends_after_to_its_tree_in_both_engines() -> None:
    """The root spends $0.25, spawns a sub-agent and waits past ``run_ttl_ms`` (its run's state is
    forgotten) while the sub-agent spends $0.20 over minutes; back, it spends $0.30, spawns again and
    spends $0.30 more: $1.05 is past a $1 tree budget at its last call, in both engines. (The root's
    facts once carried its run's total and the fold kept the largest: $0.60 + $0.20, never past.)"""
    policy = Policy.from_mapping({"defaults": {"run_ttl_ms": 60_000}, "fleet": {"max_tree_cost_usd": 1},
                                  "tools": {"Task": {"tool_class": "spawn"}}})
    lines = [_model_call("root", 1, 1_000, cost_usd=0.25), _model_call("root", 2, 2_000, **_SPAWN),
             *(_model_call("kid", n, n * 30_000, cost_usd=0.05, **_KID) for n in range(1, 5)),
             _model_call("root", 3, 150_000, cost_usd=0.3), _model_call("root", 4, 151_000, **_SPAWN),
             _model_call("root", 5, 152_000, cost_usd=0.3)]
    decided = _tree_decided(lines, policy)
    assert [(d["verdict"], d["trigger_event_id"], d["evidence"]["cost_usd"]) for d in decided] == \
        [("tree_budget", "root-5", 1.05)]


def test_a_roots_model_call_said_to_be_a_spawn_adds_nothing_its_first_spawn_brings_it_in_both_engines() -> None:
    """A root's model call with ``tool_class: spawn`` (the contract accepts it; it makes no spawner) is a
    spawn fact adding nothing: the root's first spawn-class tool call brings all it spent, that call's
    $0.50 included, once ($0.50 is not past a $0.90 tree budget; counted twice it would be)."""
    policy = Policy.from_mapping({"fleet": {"max_tree_cost_usd": 0.9}, "tools": {"Task": {"tool_class": "spawn"}}})
    lines = [_model_call("root", 1, tool_class="spawn", cost_usd=0.5),
             _model_call("root", 2, tool="Task", kind="tool_call", child_run_id="kid"),
             _model_call("root", 3, cost_usd=0.25)]
    assert _tree_decided(lines, policy) == []
    decided = _tree_decided([*lines, _model_call("root", 4, cost_usd=0.25)], policy)
    assert [(d["verdict"], d["trigger_event_id"], d["evidence"]["cost_usd"]) for d in decided] == \
        [("tree_budget", "root-4", 1.0)]


def test_a_halted_root_that_spawns_anyway_brings_what_it_spent_to_its_tree_in_both_engines() -> None:
    """A root halted by its own $0.60 budget at $0.70 whose runtime spawns anyway (fleet mode: the halt
    arrives after the call) makes a tree of $0.70 + its sub-agent's $0.40: past a $1 tree budget at the
    sub-agent's call, in both engines (the spawn's fact once carried only that call's own cost)."""
    policy = Policy.from_mapping({"defaults": {"max_cost_usd": 0.6}, "fleet": {"max_tree_cost_usd": 1},
                                  "tools": {"Task": {"tool_class": "spawn"}}})
    lines = [_model_call("root", 1, cost_usd=0.35), _model_call("root", 2, cost_usd=0.35),
             _model_call("root", 3, **_SPAWN), _model_call("kid", 4, cost_usd=0.4, **_KID)]
    decided = list(map(orjson.loads, replay_both(lines, policy).splitlines()))
    assert [(d.get("scope", "run"), d["verdict"], d["trigger_event_id"]) for d in decided
            if d["action"] == "halt"] == [("run", "budget_exceeded", "root-2"), ("tree", "tree_budget", "kid-4")]
