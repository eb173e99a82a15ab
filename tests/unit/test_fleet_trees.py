"""Sub-agent trees (core/fleet/trees.py): one test per row of the rules table, and the property that the
set of decisions does not depend on the order the facts came in."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from stream_app.core import Policy, decode_event
from stream_app.core.fleet import ScopeDecision, TreeFact, TreeFold, TreeState, tree_fact, trees
from stream_app.core.policy import FleetThresholds


def _fact(run: str, n: int, *, root: str = "root", parent: str | None = None, spawn: bool = False,
          child: str | None = None, agent: str | None = None, task: str | None = None, cost: int = 0,
          depth: int | None = None, ts: int = 1_000) -> TreeFact:
    return TreeFact(root, run, f"{run}-{n}", ts + n, parent, depth, cost, spawn, child, agent, task, "acme")


def _fold(facts: list[TreeFact], **fleet: Any) -> list[ScopeDecision]:
    fold = TreeFold(FleetThresholds(**fleet))
    return [d for f in facts for d in fold.observe(f)]


def _chain(levels: int) -> list[TreeFact]:
    """root spawns c1, c1 spawns c2, ...; each child's first event names its parent."""
    facts, parent = [], "root"
    for level in range(1, levels + 1):
        child = f"c{level}"
        facts.append(_fact(parent, level, spawn=True, child=child, parent=None if parent == "root" else f"c{level - 2}"
                           if level > 2 else "root"))
        parent = child
    return facts


def test_a_spawn_that_would_create_a_run_deeper_than_max_tree_depth_halts_the_tree() -> None:
    decisions = _fold(_chain(7))
    assert [(d.action, d.verdict, d.trigger_event_id) for d in decisions] == [("halt", "tree_depth", "c5-6")]
    control = decisions[0].to_control()
    assert control["scope"] == "tree" and control["root_run_id"] == "root" and "run_id" not in control
    assert control["evidence"]["depth"] == 6 and control["evidence"]["chain"][:3] == ["c6", "c5", "c4"]
    assert _fold(_chain(5)) == []  # depth 5 is allowed


def test_a_run_deeper_than_allowed_whose_spawn_was_not_seen_halts_at_its_first_event() -> None:
    decisions = _fold([_fact("deep", 1, parent="p", depth=6)])
    assert [(d.verdict, d.trigger_event_id) for d in decisions] == [("tree_depth", "deep-1")]
    assert decisions[0].evidence["declared_depth"] == 6


def test_depth_is_derived_from_the_parent_chain_when_a_run_declares_less() -> None:
    """Each run says depth 1; the chain seen says 6."""
    facts = [_fact(f"c{i}", i, parent="root" if i == 1 else f"c{i - 1}", depth=1) for i in range(1, 7)]
    assert [d.verdict for d in _fold(facts)] == ["tree_depth"]
    assert [d.verdict for d in _fold(facts[:5])] == []


def test_the_third_spawn_of_the_same_task_halts_the_tree() -> None:
    spawns = [_fact("root", i, spawn=True, child=f"c{i}", agent="explorer", task="t" * 16) for i in range(1, 4)]
    decisions = _fold(spawns)
    assert [(d.verdict, d.trigger_event_id) for d in decisions] == [("tree_recursion", "root-3")]
    assert decisions[0].evidence["spawns"] == 3 and decisions[0].evidence["spawned_by"] == ["root"] * 3
    assert _fold(spawns[:2]) == []


def test_a_self_delegation_chain_counts_across_levels() -> None:
    """explore spawns explore spawns explore: the same task at three levels."""
    facts = [_fact("root", 1, spawn=True, child="a", agent="explore", task="x" * 16),
             _fact("a", 2, parent="root", spawn=True, child="b", agent="explore", task="x" * 16),
             _fact("b", 3, parent="a", spawn=True, child="c", agent="explore", task="x" * 16)]
    assert [d.verdict for d in _fold(facts)] == ["tree_recursion"]


def test_a_distinct_task_fan_out_up_to_max_tree_runs_never_halts() -> None:
    spawns = [_fact("root", i, spawn=True, child=f"c{i}", agent="reviewer", task=f"{i:016d}") for i in range(99)]
    decisions = _fold(spawns)
    assert [(d.action, d.verdict) for d in decisions] == [("alert", "tree_fanout")]  # past half only


def test_the_run_that_takes_the_tree_past_max_tree_runs_halts_it_and_half_alerts_first() -> None:
    spawns = [_fact("root", i, spawn=True, child=f"c{i}") for i in range(1, 101)]
    decisions = _fold(spawns)
    assert [(d.action, d.verdict, d.trigger_event_id) for d in decisions] == [
        ("alert", "tree_fanout", "root-50"), ("halt", "tree_fanout", "root-100")]
    assert decisions[1].evidence == {"rule": "runs", "runs": 101, "max_tree_runs": 100}


def test_the_call_that_takes_the_tree_past_its_cost_budget_halts_it() -> None:
    facts = [_fact(f"c{i}", i, parent="root", cost=400_000) for i in range(1, 4)]
    decisions = _fold(facts, max_tree_cost_usd=1.0)
    assert [(d.verdict, d.trigger_event_id) for d in decisions] == [("tree_budget", "c3-3")]
    assert _fold(facts) == []  # 0: no budget
    assert _fold([*facts[:2], _fact("c3", 3, parent="root", cost=200_000)], max_tree_cost_usd=1.0) == []  # not past


def test_the_roots_spending_is_summed_as_the_subagents_in_whatever_order_it_is_reported() -> None:
    """A root's first fact (its first spawn) carries what the root spent so far (its calls before the
    spawn too), each later one what its call added, a sub-agent's its call's own cost: the tree's spend is
    their sum, and the decision the same in any order (its trigger the fact that crossed it)."""
    root = [_fact("root", 1, spawn=True, child="c1", cost=300_000), _fact("root", 5, cost=300_000)]
    kid = [_fact("c1", 2, parent="root", cost=300_000), _fact("c1", 6, parent="root", cost=200_000)]
    assert _fold([root[0], kid[0], root[1]], max_tree_cost_usd=1.0) == []  # 0.6 + 0.3
    decisions = _fold([root[0], kid[0], root[1], kid[1]], max_tree_cost_usd=1.0)  # 0.6 + 0.5
    assert [(d.verdict, d.trigger_event_id, d.evidence["cost_usd"]) for d in decisions] == \
        [("tree_budget", "c1-6", 1.1)]
    again = _fold([root[1], kid[1], root[0], kid[0]], max_tree_cost_usd=1.0)
    assert [(d.decision_id, d.trigger_event_id) for d in again] == [(decisions[0].decision_id, "c1-2")]
    root_past = _fold([*kid, root[0], _fact("root", 7, cost=300_001)], max_tree_cost_usd=1.1)
    assert [(d.verdict, d.trigger_event_id) for d in root_past] == [("tree_budget", "root-7")]


def test_a_roots_fact_of_the_release_before_carries_its_runs_total_and_the_largest_counts() -> None:
    """Facts written before ``root_total`` (a root's fact then carried its run's total so far): folded as
    then, the largest of the root's plus the sub-agents' sum, however often and in whatever order; a
    root's newer facts add to that."""
    root = [_fact("root", 1, spawn=True, child="c1", cost=300_000)._replace(root_total=True),
            _fact("root", 5, cost=600_000)._replace(root_total=True)]
    kid = [_fact("c1", 2, parent="root", cost=300_000), _fact("c1", 6, parent="root", cost=200_000)]
    assert _fold([root[0], kid[0], root[1]], max_tree_cost_usd=1.0) == []  # 0.6 + 0.3
    decisions = _fold([root[1], kid[1], root[0], root[1], kid[0]], max_tree_cost_usd=1.0)
    assert [(d.verdict, d.trigger_event_id, d.evidence["cost_usd"]) for d in decisions] == \
        [("tree_budget", "c1-2", 1.1)]
    newer = _fold([root[1], kid[0], _fact("root", 7, cost=100_001)], max_tree_cost_usd=1.0)  # 0.6 + 0.3 + 0.1+
    assert [(d.verdict, d.trigger_event_id) for d in newer] == [("tree_budget", "root-7")]


def test_each_rule_fires_once_per_tree_and_shadow_mode_alerts() -> None:
    facts = [*_chain(8), _fact("c8", 99, parent="c7")]
    assert [d.verdict for d in _fold(facts)] == ["tree_depth"]
    shadow = _fold(_chain(7), shadow=True)
    assert [(d.action, d.evidence["would"]) for d in shadow] == [("alert", "halt")]


def test_a_cycle_of_parent_links_ends() -> None:
    facts = [_fact("a", 1, parent="b"), _fact("b", 2, parent="a"), _fact("a", 3, parent="b", spawn=True, child="b")]
    assert [d.verdict for d in _fold(facts)] == ["tree_depth"]  # a loop of parents is infinitely deep


def test_the_decision_id_names_the_tree_and_the_rule_not_the_trigger() -> None:
    one = _fold(_chain(7))[0]
    other = _fold([_fact("deep", 1, parent="p", depth=9)])[0]
    assert one.trigger_event_id != other.trigger_event_id and one.decision_id == other.decision_id


def test_the_tree_state_round_trips_through_its_stored_form() -> None:
    fold = TreeFold()
    for fact in _chain(4):
        fold.observe(fact)
    from stream_app.core.fleet import TreeState

    state = fold.trees["root"]
    again = TreeState.decode(state.encode())
    assert (again.depth, again.parent, again.children, again.fired) == (state.depth, state.parent, state.children,
                                                                       state.fired)


def test_a_task_is_kept_by_64_bits_of_its_hash_and_its_third_spawn_still_halts_the_tree() -> None:
    """The SDK's task hashes are 64 hex digits: most of a stored tree when kept whole. Two tasks whose
    hashes share their first 16 digits are still two tasks (the key hashes the whole hash)."""
    whole, twin = "ab" * 32, "ab" * 8 + "cd" * 24
    fold = TreeFold()
    decisions = [d for i in range(1, 4) for d in fold.observe(
        _fact("root", i, spawn=True, child=f"c{i}", agent="explorer", task=whole))]
    decisions += [d for i in range(4, 6) for d in fold.observe(
        _fact("root", i, spawn=True, child=f"c{i}", agent="explorer", task=twin))]
    assert [(d.verdict, d.trigger_event_id) for d in decisions] == [("tree_recursion", "root-3")]
    # the decision's id is the whole task's, as before tasks were keyed short
    assert decisions[0].decision_id == trees.scope_decision_id("tree", ("root",), "halt", "tree_recursion",
                                                               f"explorer\x1f{whole}")
    stored = fold.trees["root"].encode()
    assert whole.encode() not in stored and twin[:16].encode() not in stored
    assert sorted(TreeState.decode(stored).tasks) == sorted([trees.task_key("explorer", whole),
                                                             trees.task_key("explorer", twin)])
    assert trees.task_key("explorer", "t" * 16) == "explorer\x1f" + "t" * 16  # a short hash is kept as it is


def test_a_tree_stored_with_whole_task_hashes_is_read_as_task_keys() -> None:
    """A record of a release that keyed tasks by the whole hash: its counts and fired rules carry on."""
    import orjson

    counted, fired = "12" * 32, "34" * 32
    old = orjson.dumps({"v": 1, "d": {"root": 0, "c1": 1, "c2": 1}, "p": {"c1": "root", "c2": "root"}, "c": 0,
                        "t": {f"explorer\x1f{counted}": ["root", "root"], f"explorer\x1f{fired}": ["root"] * 3},
                        "f": [f"tree_recursion\x1fexplorer\x1f{fired}"], "ts": 1_000, "s": {}, "a": []})
    state = TreeState.decode(old)
    fleet = FleetThresholds()
    assert trees.fold(fleet, state, _fact("root", 9, spawn=True, child="c9", agent="explorer", task=fired)) == ()
    decisions = trees.fold(fleet, state, _fact("root", 10, spawn=True, child="c10", agent="explorer", task=counted))
    assert [d.verdict for d in decisions] == ["tree_recursion"]
    assert TreeState.decode(state.encode()).tasks == state.tasks  # read back as written


def test_events_say_which_tree_they_are_in() -> None:
    policy = Policy.from_mapping({"tools": {"Task": {"tool_class": "spawn"}}})

    def event(**fields: Any) -> Any:
        return decode_event({"run_id": "r", "event_id": "e", "tool": "Task", "ts_ms": 1, "outcome": "success",
                             "args": {}, "result": None, **fields})

    spawn = tree_fact(event(child_run_id="kid", task_hash="a" * 16),
                      policy.resolve(None, "Task").thresholds.tool_class)
    assert spawn is not None and spawn.root == "r" and spawn.spawn and spawn.child_run_id == "kid"
    assert tree_fact(event(), "other") is None  # not in a tree
    assert tree_fact(event(root_run_id="r"), "other") is None  # a root's call before it spawned: no fact yet
    assert tree_fact(event(root_run_id="r", cost_usd=0.5), "other") is None
    spent = tree_fact(event(root_run_id="r", cost_usd=0.5), "other", 700_000)  # after: what it spent so far
    assert spent is not None and (spent.root, spent.cost_micro, spent.spawn) == ("r", 700_000, False)
    assert tree_fact(event(root_run_id="r"), "other", 700_000) is None  # a call costing nothing: nothing new
    first = tree_fact(event(cost_usd=0.5), "spawn", 900_000)  # its first spawn brings what it spent before
    assert first is not None and (first.cost_micro, first.spawn) == (900_000, True)
    child = tree_fact(event(root_run_id="r0", parent_run_id="p", depth=2), "other")
    assert child is not None and (child.root, child.parent, child.depth, child.spawn) == ("r0", "p", 2, False)


# --- order: the same facts in any order make the same set of decisions ------------------------------------

@st.composite
def _trees(draw: st.DrawFn) -> list[TreeFact]:
    """A random tree: each run's facts in its own order, runs spawning children of a few tasks."""
    runs = ["root"]
    facts: list[TreeFact] = []
    for n in range(draw(st.integers(1, 40))):
        parent = draw(st.sampled_from(runs))
        child = f"r{n}"
        task = draw(st.sampled_from(["a" * 16, "b" * 16, "c" * 64, "d" * 64, "e" * 40]))  # short hashes kept, long keyed
        facts.append(_fact(parent, n, spawn=True, child=child if draw(st.booleans()) else None, agent="w",
                           task=task, cost=draw(st.integers(0, 300_000)),
                           parent=None if parent == "root" else "?")._replace(
                               root_total=parent == "root" and draw(st.booleans())))  # a root's: either release
        runs.append(child)
        if draw(st.booleans()):
            facts.append(_fact(child, 1000 + n, parent=parent, depth=draw(st.none() | st.integers(0, 8)),
                               cost=draw(st.sampled_from([0, 0, 250_000]))))
    return facts


@given(_trees(), st.randoms(use_true_random=False))
@settings(max_examples=150, deadline=None)
def test_the_set_of_decisions_does_not_depend_on_the_order_of_the_facts(facts: list[TreeFact], rnd: Any) -> None:
    # the "?" parents stand for the spawner, known from its spawn: fix them up per run
    spawner = {f.child_run_id: f.run_id for f in facts if f.child_run_id}
    facts = [f if f.parent != "?" else TreeFact(f.root, f.run_id, f.event_id, f.ts_ms, spawner.get(f.run_id),
                                                f.depth, f.cost_micro, f.spawn, f.child_run_id, f.child_agent_id,
                                                f.task_hash, f.tenant) for f in facts]
    shuffled = list(facts)
    rnd.shuffle(shuffled)
    fleet = {"max_tree_depth": 3, "max_tree_runs": 12, "max_tree_cost_usd": 2.0}

    def keys(decisions: list[ScopeDecision]) -> set[tuple[Any, ...]]:
        return {(d.scope, d.key, d.action, d.verdict, d.decision_id) for d in decisions}

    assert keys(_fold(facts, **fleet)) == keys(_fold(shuffled, **fleet))


@given(_trees(), st.randoms(use_true_random=False), st.sampled_from([0.0, 2.0]))
@settings(max_examples=200, deadline=None)
def test_a_call_of_a_known_run_skips_placing_it_with_the_same_state_and_decisions(facts: list[TreeFact],
                                                                                  rnd: Any, budget: float) -> None:
    """The fold's shortcuts (no placing for a known run's call; no rule checks when none can fire: with no
    cost budget, most facts) decide as placing every fact and checking every rule."""
    # each run's later calls again (the facts the fold's shortcut takes), in a random order
    facts = facts + [f._replace(event_id=f"{f.event_id}-again", spawn=False, child_run_id=None, ts_ms=f.ts_ms + 5)
                     for f in facts if f.run_id != "root"]
    facts = [f._replace(parent=None) if f.parent == "?" else f for f in facts]
    rnd.shuffle(facts)
    fleet = FleetThresholds(max_tree_depth=3, max_tree_runs=12, max_tree_cost_usd=budget)
    cap = fleet.max_tree_depth + 1

    def placing_every_fact(state: TreeState, fact: TreeFact) -> tuple[ScopeDecision, ...]:
        state.last_ts_ms = max(state.last_ts_ms, fact.ts_ms)
        deeper = trees._place(state, fact, cap)
        if fact.root_total and fact.run_id == fact.root:  # a root's fact of the release before: its total
            state.root_cost = max(state.root_cost, fact.cost_micro)
        else:
            state.cost_micro += fact.cost_micro
        return trees._crossed(fleet, state, fact, deeper, cap)

    shortcut, reference = TreeState(), TreeState()
    for fact in facts:
        assert trees.fold(fleet, shortcut, fact) == placing_every_fact(reference, fact)
        assert shortcut.encode() == reference.encode()


def test_a_call_that_only_crosses_the_budget_is_in_the_next_stored_form() -> None:
    """A known run's call that takes the tree past its budget changes the fired rules without placing a
    run: the record encoded after it says so (an encoding that keeps parts of the tree between facts must
    see that change too: b72a92e's cache did only once ``_crossed`` cleared it)."""
    fleet = FleetThresholds(max_tree_cost_usd=1.0)
    state = TreeState()
    trees.fold(fleet, state, _fact("root", 1, spawn=True, child="c1"))
    trees.fold(fleet, state, _fact("c1", 2, parent="root"))
    before = state.encode()
    assert [d.verdict for d in trees.fold(fleet, state, _fact("c1", 3, parent="root", cost=1_500_000))] == [
        "tree_budget"]
    after = state.encode()
    assert after != before and after == TreeState.decode(after).encode()
    assert "tree_budget" in TreeState.decode(after).fired


@given(_trees())
@settings(max_examples=150, deadline=None)
def test_a_tree_read_back_from_its_stored_form_before_every_fact_decides_as_one_kept_in_memory(
        facts: list[TreeFact]) -> None:
    """The worker decodes a tree's record when what is stored is not what it wrote last; replay and the
    SDK keep the tree in memory: the same decisions, the same record."""
    facts = [f._replace(parent=None) if f.parent == "?" else f for f in facts]
    fleet = FleetThresholds(max_tree_depth=3, max_tree_runs=12, max_tree_cost_usd=2.0, tree_task_repeats=2)
    memory, stored = TreeState(), TreeState().encode()
    for fact in facts:
        state = TreeState.decode(stored)
        assert trees.fold(fleet, state, fact) == trees.fold(fleet, memory, fact)
        stored = state.encode()
        assert stored == memory.encode()
