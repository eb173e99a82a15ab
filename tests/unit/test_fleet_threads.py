"""Self-triggering chains (core/fleet/threads.py): one test per row of the rules table, and the property
that the set of decisions does not depend on the order the facts came in."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from stream_app.core import decode_event
from stream_app.core.fleet import ScopeDecision, ThreadFact, ThreadFold, ThreadState, thread_fact
from stream_app.core.policy import FleetThresholds

MINUTE = 60_000


def _fact(run: str, n: int, *, trigger: str | None = "webhook", cause: str | None = None,
          failure: str | None = None, ts: int | None = None, thread: str = "pr-7", tenant: str = "acme") -> ThreadFact:
    return ThreadFact(tenant, thread, run, f"{run}-{n}", ts if ts is not None else 1_000 + n, trigger, cause, failure)


def _fold(facts: list[ThreadFact], **fleet: Any) -> list[ScopeDecision]:
    fold = ThreadFold(FleetThresholds(**fleet))
    return [d for f in facts for d in fold.observe(f)]


def _bot_chain(runs: int) -> list[ThreadFact]:
    """A user's run, then a bot whose comment triggers its own next run, each run two events."""
    facts = [_fact("u", 0, trigger="user")]
    cause = "u"
    for i in range(1, runs + 1):
        run = f"b{i}"
        facts += [_fact(run, 10 * i, cause=cause), _fact(run, 10 * i + 1, cause=cause)]
        cause = run
    return facts


def test_the_first_event_of_a_run_of_generation_3_halts_the_thread() -> None:
    decisions = _fold(_bot_chain(4))
    assert [(d.action, d.verdict, d.trigger_event_id) for d in decisions] == [("halt", "self_trigger", "b3-30")]
    control = decisions[0].to_control()
    assert (control["scope"], control["tenant"], control["thread_key"]) == ("thread", "acme", "pr-7")
    assert "run_id" not in control and control["trigger_run_id"] == "b3"
    assert control["evidence"]["chain"] == ["b3", "b2", "b1", "u"]
    assert _fold(_bot_chain(2)) == []  # generation 2 is allowed


def test_a_user_triggered_run_is_generation_0_whatever_caused_it() -> None:
    facts = [_fact("b1", 1), _fact("b2", 2, cause="b1"), _fact("u", 3, trigger="user", cause="b2"),
             _fact("b3", 4, cause="u"), _fact("b4", 5, cause="b3")]
    assert _fold(facts) == []  # b1 0, b2 1, u 0, b3 1, b4 2


def test_a_cause_on_another_thread_starts_a_new_generation() -> None:
    facts = [_fact("a", 1, thread="other"), _fact("b", 2, cause="a"), _fact("c", 3, cause="b"), _fact("d", 4, cause="c")]
    assert _fold(facts) == []  # b is generation 0 here: its cause is not on this thread


def test_a_cause_seen_late_raises_the_generations_it_caused() -> None:
    facts = _bot_chain(3)
    late = [f for f in facts if f.run_id != "b1"] + [f for f in facts if f.run_id == "b1"]
    decisions = _fold(late)
    assert [(d.verdict, d.trigger_event_id) for d in decisions] == [("self_trigger", "b1-10")]
    assert decisions[0].decision_id == _fold(facts)[0].decision_id


def test_a_cycle_of_causes_ends() -> None:
    facts = [_fact("a", 1, cause="b"), _fact("b", 2, cause="a")]
    assert [d.verdict for d in _fold(facts)] == ["self_trigger"]  # a loop of causes never ends either


def test_the_third_scheduled_run_failing_with_the_same_class_halts_at_its_failing_call() -> None:
    day = 86_400_000
    facts = []
    for i in range(3):
        run = f"nightly-{i}"
        facts += [_fact(run, 0, trigger="schedule", ts=i * day), _fact(run, 1, trigger="schedule", ts=i * day + 5,
                                                                        failure="auth")]
    decisions = _fold(facts)
    assert [(d.verdict, d.trigger_event_id) for d in decisions] == [("schedule_failing", "nightly-2-1")]
    assert decisions[0].evidence["runs"] == ["nightly-0", "nightly-1", "nightly-2"]
    assert decisions[0].evidence["error_class"] == "auth"
    assert _fold(facts[:4]) == []


def test_a_scheduled_run_failing_otherwise_or_not_at_all_breaks_the_streak() -> None:
    def run(i: int, failure: str | None) -> list[ThreadFact]:
        return [_fact(f"s{i}", 0, trigger="schedule", ts=i * MINUTE * 90),
                _fact(f"s{i}", 1, trigger="schedule", ts=i * MINUTE * 90 + 1, failure=failure)]

    assert _fold([*run(0, "auth"), *run(1, "timeout"), *run(2, "auth"), *run(3, "auth")]) == []
    assert _fold([*run(0, "auth"), *run(1, None), *run(2, "auth"), *run(3, "auth")]) == []
    user_between = [*run(0, "auth"), _fact("u", 0, trigger="user", ts=MINUTE), *run(1, "auth"), *run(2, "auth")]
    assert [d.verdict for d in _fold(user_between)] == ["schedule_failing"]  # only scheduled runs are a streak


def test_more_than_6_runs_in_an_hour_that_no_user_triggered_alert_once_per_window() -> None:
    facts = [_fact(f"w{i}", 0, ts=i * MINUTE) for i in range(8)]
    decisions = _fold(facts)
    assert [(d.action, d.verdict, d.trigger_event_id) for d in decisions] == [("alert", "thread_rate", "w6-0")]
    assert decisions[0].evidence["runs"] == 7 and decisions[0].evidence["window_start_ms"] == 0
    users = [_fact(f"u{i}", 0, trigger="user", ts=i * MINUTE) for i in range(10)]
    assert _fold(users) == []
    next_hour = [_fact(f"x{i}", 0, ts=60 * MINUTE + i) for i in range(7)]
    assert [d.evidence["window_start_ms"] for d in _fold(facts + next_hour)] == [0, 3_600_000]


def test_one_tenants_thread_is_not_anothers() -> None:
    facts = [_fact("u", 0, trigger="user"), _fact("b1", 1, cause="u", tenant="other"),
             _fact("b2", 2, cause="b1"), _fact("b3", 3, cause="b2")]
    assert _fold(facts) == []  # on acme's pr-7, b2 is generation 0 (b1 was other's)


def test_shadow_mode_alerts_and_rules_can_be_disabled() -> None:
    assert [(d.action, d.evidence["would"]) for d in _fold(_bot_chain(3), shadow=True)] == [("alert", "halt")]
    assert _fold(_bot_chain(5), self_trigger_generation=0) == []


def test_the_thread_state_round_trips_through_its_stored_form() -> None:
    fold = ThreadFold()
    for fact in _bot_chain(2):
        fold.observe(fact)
    state = fold.threads[("acme", "pr-7")]
    again = ThreadState.decode(state.encode())
    assert (again.runs, again.effects, again.hours, again.fired) == (state.runs, state.effects, state.hours,
                                                                     state.fired)
    # and folding on from the decoded copy decides what the original would
    assert [d.decision_id for d in _fold_from(again, _fact("b3", 99, cause="b2"))] == \
        [d.decision_id for d in _fold_from(state, _fact("b3", 99, cause="b2"))]


def _fold_from(state: ThreadState, fact: ThreadFact) -> tuple[ScopeDecision, ...]:
    from stream_app.core.fleet.threads import fold

    return fold(FleetThresholds(), state, fact)


def test_events_say_which_thread_they_are_on() -> None:
    def event(**fields: Any) -> Any:
        return decode_event({"run_id": "r", "event_id": "e", "tool": "gh", "ts_ms": 1, "outcome": "success",
                             "args": {}, "result": None, **fields})

    assert thread_fact(event()) is None
    fact = thread_fact(event(thread_key="pr-7", trigger="webhook", caused_by_run_id="r0"))
    assert fact is not None and (fact.tenant, fact.thread_key, fact.trigger, fact.caused_by, fact.failure) == \
        ("", "pr-7", "webhook", "r0", None)
    failing = thread_fact(event(thread_key="pr-7", outcome="error", error_class="auth", tenant="acme"))
    assert failing is not None and (failing.tenant, failing.failure) == ("acme", "auth")
    assert thread_fact(event(thread_key="pr-7", outcome="empty")).failure is None  # type: ignore[union-attr]


# --- order: the same facts in any order make the same set of decisions ------------------------------------

@st.composite
def _threads(draw: st.DrawFn) -> list[ThreadFact]:
    """Runs on two threads, each caused by an earlier run (or none), some by users, each with a few events."""
    facts: list[ThreadFact] = []
    runs: list[str] = []
    for n in range(draw(st.integers(1, 30))):
        run = f"r{n}"
        thread = draw(st.sampled_from(["t1", "t2"]))
        trigger = draw(st.sampled_from(["user", "webhook", "agent", None]))
        cause = draw(st.sampled_from(runs)) if runs and draw(st.booleans()) else None
        start = draw(st.integers(0, 3)) * 20 * MINUTE + n
        facts.extend(_fact(run, i, trigger=trigger, cause=cause, thread=thread, ts=start + i)
                     for i in range(draw(st.integers(1, 3))))
        runs.append(run)
    return facts


@given(_threads(), st.randoms(use_true_random=False))
@settings(max_examples=150, deadline=None)
def test_the_set_of_decisions_does_not_depend_on_the_order_of_the_facts(facts: list[ThreadFact], rnd: Any) -> None:
    shuffled = list(facts)
    rnd.shuffle(shuffled)
    fleet = {"max_thread_runs_per_hour": 3}

    def keys(decisions: list[ScopeDecision]) -> set[tuple[Any, ...]]:
        return {(d.scope, d.key, d.action, d.verdict, d.decision_id) for d in decisions}

    assert keys(_fold(facts, **fleet)) == keys(_fold(shuffled, **fleet))
