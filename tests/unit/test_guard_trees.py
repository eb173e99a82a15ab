"""Sub-agent trees through the SDK: runs started in a parent's tree, spawn calls, the tree rules folded in
process, and a tree halt refusing every run of the tree and every new child (``TreeHalted``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from stream_app.client import ControlBoard, Guard, InvalidCall, RunHalted, Spawn, TreeHalted
from stream_app.core import Policy

REPO = Path(__file__).resolve().parents[2]
TELEMETRY_SCHEMA = json.loads((REPO / "schemas" / "telemetry.v1.json").read_text())


def _guard(**fleet: Any) -> tuple[Guard, list[dict[str, Any]]]:
    policy = Policy.from_mapping({"fleet": fleet} if fleet else None)
    guard = Guard.in_process(policy, clock=lambda: 1_700_000_000_000)
    events: list[dict[str, Any]] = []
    local = guard._local
    assert local is not None
    fold = local.fold

    def recording(event: dict[str, Any]) -> None:
        events.append(event)
        fold(event)

    local.fold = recording  # type: ignore[method-assign]
    return guard, events


def ok(**_: Any) -> str:
    return "ok"


async def test_a_runaway_chain_of_sub_agents_halts_the_whole_tree_before_the_next_level() -> None:
    """explore spawns explore spawns explore...: the spawn that would start level 6 halts the tree; every
    run of it is refused from then on, and so is a new child."""
    guard, _ = _guard()
    runs = [guard.run("root", agent_id="explore")]
    for level in range(1, 6):
        parent = runs[-1]
        await parent.call("Task", ok, {"prompt": f"explore level {level}"},
                          spawn=Spawn(child_run_id=f"kid{level}", child_agent_id="explore", task=f"level {level}"))
        runs.append(parent.child(f"kid{level}", agent_id="explore"))
    assert [r.depth for r in runs] == [0, 1, 2, 3, 4, 5] and {r.root_run_id for r in runs} == {"root"}
    assert not any(r.halted for r in runs)
    await runs[-1].call("Task", ok, {"prompt": "deeper"}, spawn=Spawn(child_run_id="kid6", task="deeper"))
    for run in runs:
        with pytest.raises(TreeHalted) as info:
            await run.call("search", ok, {})
        assert info.value.root_run_id == "root" and info.value.verdict == "tree_depth"
        assert info.value.run_id == run.run_id and isinstance(info.value, RunHalted)
    with pytest.raises(TreeHalted):
        runs[-1].child("kid6")
    with pytest.raises(TreeHalted):
        guard.run("late", parent_run_id="kid2")  # the parent's tree, found from the parent guarded here
    assert guard.counters["applied"] == 1 and guard.counters["local"] == 1


async def test_the_third_spawn_of_the_same_task_halts_the_tree_and_distinct_tasks_do_not() -> None:
    guard, _ = _guard()
    root = guard.run("root", agent_id="lead")
    for n in range(20):  # a fan-out of distinct tasks, as map-reduce does
        await root.call("Task", ok, {"n": n}, spawn=Spawn(f"rev{n}", "reviewer", task={"issue": n}))
    assert not root.halted
    for n in range(3):  # the same review three times: duplicate siblings; the third spawn ran, then halted
        await root.call("Task", ok, {"n": 99 + n}, spawn=Spawn(f"dup{n}", "reviewer", task={"issue": 99}))
    with pytest.raises(TreeHalted):
        await root.call("search", ok, {})
    assert root.decision is not None and root.decision["verdict"] == "tree_recursion"
    assert root.decision["evidence"]["spawns"] == 3


async def test_a_spawn_is_folded_as_it_begins_so_a_nested_sub_agent_is_stopped_inside_it() -> None:
    """Frameworks whose spawn call returns when its sub-agent is done (agents as tools, Claude's Agent
    tool): each level's spawn is still running when the next begins. The tree learns of a spawn as it
    begins, so the spawn that would start level 6 halts the tree and the level-6 child is refused at
    ``Guard.run`` before it runs a call; the spawns' ends (reported after) count neither a spawn nor a
    run again, only their cost: six of $0.30 pass $1.70 at the sixth end, not before."""
    guard, events = _guard(max_tree_cost_usd=1.7)
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    refused: list[str] = []

    async def level(run: Any, depth: int) -> None:
        pending = await run.begin("Task", {"prompt": f"level {depth + 1}"},
                                  spawn=Spawn(child_run_id=f"kid{depth + 1}", task=f"level {depth + 1}"))
        try:
            child = run.child(f"kid{depth + 1}")
        except TreeHalted as halted:
            refused.append(halted.run_id)
        else:
            await level(child, depth + 1)
        await run.finish(pending, "done", cost_usd=0.3)

    await level(guard.run("root"), 0)

    spawns = [e for e in events if e["tool"] == "Task"]
    assert [e["run_id"] for e in spawns] == ["kid5", "kid4", "kid3", "kid2", "kid1", "root"]  # as they end
    assert refused == ["kid6"]
    assert [(d["verdict"], d["trigger_event_id"]) for d in decisions] == [
        ("tree_depth", spawns[0]["event_id"]),  # kid5's spawn, decided as it began
        ("tree_budget", spawns[5]["event_id"]),  # $1.80 > $1.70 at the sixth end
    ]
    assert decisions[0]["evidence"]["depth"] == 6 and decisions[1]["evidence"]["cost_usd"] == 1.8


async def test_a_trees_budget_counts_what_the_root_spent_before_and_after_its_spawn() -> None:
    """A $1 tree budget: a lead that spent $0.50 thinking, then a sub-agent spending $0.60 inside the spawn
    (folded as it begins, with what the lead spent so far), halts the tree at the sub-agent's call; a lead
    spending $0.10 then $0.70 after its sub-agent's $0.30, at the lead's own second call."""
    guard, events = _guard(max_tree_cost_usd=1.0)
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    lead = guard.run("lead")
    await lead.model_call("claude", tokens=1, cost_usd=0.5)
    await lead.begin("Task", {"p": 1}, spawn=Spawn(child_run_id="kid", task="review"))  # the spawn runs on
    kid = lead.child("kid")
    with pytest.raises(TreeHalted):  # reported, and it took the tree past: the sub-agent stops here
        await kid.model_call("claude", tokens=1, cost_usd=0.6)
    with pytest.raises(TreeHalted):
        await lead.call("search", ok, {})
    other = guard.run("other")
    await other.call("Task", ok, {"p": 2}, spawn=Spawn(child_run_id="kid2", task="review"))
    await other.child("kid2").model_call("claude", tokens=1, cost_usd=0.3)
    await other.model_call("claude", tokens=0, cost_usd=0.1)
    with pytest.raises(TreeHalted):
        await other.model_call("claude", tokens=1, cost_usd=0.7)
    with pytest.raises(TreeHalted):
        await other.call("search", ok, {})
    budget = [(d["root_run_id"], d["trigger_event_id"], d["evidence"]["cost_usd"]) for d in decisions
              if d["verdict"] == "tree_budget"]
    model_calls = {e["run_id"]: e["event_id"] for e in events if e["tool"] == "claude"}  # each run's last
    assert budget == [("lead", model_calls["kid"], 1.1), ("other", model_calls["other"], 1.1)]


def _tree_spend(guard: Guard, root: str) -> float:
    local = guard._local
    assert local is not None
    state = local.trees.trees[root]
    return (state.cost_micro + state.root_cost) / 1_000_000


async def test_a_roots_calls_while_its_first_spawn_runs_reach_its_tree_once() -> None:
    """A root's spend reaches its tree once whatever runs while its spawns do: its $0.30 call made while
    its first spawn runs (parallel tool use) counts, as replay and the worker count it, and two spawns run
    side by side (``gather``) bring the $0.50 spent before them once, not twice; a root whose first call is
    a spawn counts what it spends while that spawn runs too."""
    guard, _ = _guard(max_tree_cost_usd=0.75)
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    lead = guard.run("lead")
    await lead.model_call("claude", tokens=1, cost_usd=0.5)
    pending = await lead.begin("Task", {"p": 1}, spawn=Spawn(child_run_id="kid", task="review"))
    with pytest.raises(TreeHalted):  # $0.80: reported, past the budget
        await lead.model_call("claude", tokens=1, cost_usd=0.3)
    await lead.finish(pending, "done")
    assert _tree_spend(guard, "lead") == 0.8 and [d["verdict"] for d in decisions] == ["tree_budget"]

    guard, _ = _guard(max_tree_cost_usd=0.9)
    lead = guard.run("lead")
    await lead.model_call("claude", tokens=1, cost_usd=0.5)

    async def sub_agent(**_: Any) -> str:
        await asyncio.sleep(0)
        return "done"

    await asyncio.gather(lead.call("Task", sub_agent, {"p": 1}, spawn=Spawn(child_run_id="k1", task="a")),
                         lead.call("Task", sub_agent, {"p": 2}, spawn=Spawn(child_run_id="k2", task="b")))
    assert _tree_spend(guard, "lead") == 0.5

    guard, _ = _guard()
    lead = guard.run("lead")
    pending = await lead.begin("Task", {"p": 1}, spawn=Spawn(child_run_id="kid", task="review"))
    await lead.model_call("claude", tokens=1, cost_usd=0.25)
    await lead.finish(pending, "done", cost_usd=0.125)
    await lead.model_call("claude", tokens=1, cost_usd=0.5)
    assert _tree_spend(guard, "lead") == 0.875


async def test_every_event_says_which_tree_it_is_in() -> None:
    guard, events = _guard()
    root = guard.run("root", agent_id="lead", tenant="acme", thread_key="pr-7", trigger="user")
    await root.call("Task", ok, {"p": 1}, spawn=Spawn(child_run_id="kid", child_agent_id="coder", task="write tests"))
    kid = root.child("kid", agent_id="coder")
    await kid.call("search", ok, {"q": 1})
    await kid.model_call("claude", tokens=5)
    for event in events:
        jsonschema.validate(event, TELEMETRY_SCHEMA)
    spawn, call, model = events
    assert spawn["root_run_id"] == "root" and spawn["tool_class"] == "spawn" and spawn["child_run_id"] == "kid"
    assert spawn["child_agent_id"] == "coder" and len(spawn["task_hash"]) == 64
    assert (spawn["thread_key"], spawn["trigger"]) == ("pr-7", "user") and "parent_run_id" not in spawn
    assert (call["root_run_id"], call["parent_run_id"], call["depth"], call["tenant"]) == ("root", "root", 1, "acme")
    assert model["root_run_id"] == "root" and "child_run_id" not in call
    # the same task, said differently (key order, whitespace), hashes alike
    await root.call("Task", ok, {"p": 2}, spawn=Spawn(task={"b": 1, "a": "x  y"}))
    await root.call("Task", ok, {"p": 3}, spawn=Spawn(task={"a": "x y", "b": 1}))
    assert events[-1]["task_hash"] == events[-2]["task_hash"]


async def test_a_run_is_guarded_in_one_tree_only() -> None:
    guard, _ = _guard()
    guard.run("kid", parent_run_id="p", root_run_id="r")
    assert guard.run("kid").root_run_id == "r"  # asking again without the lineage is fine
    with pytest.raises(InvalidCall, match="already guarded with parent"):
        guard.run("kid", parent_run_id="other")
    with pytest.raises(InvalidCall, match="trigger"):
        guard.run("x", trigger="cron")
    with pytest.raises(InvalidCall, match=r"spawn\.child_run_id"):
        Spawn(child_run_id="")


async def test_a_fleet_tree_halt_stops_the_trees_runs_here_and_cancels_their_bound_tasks() -> None:
    """A tree halt from the control topic (no run_id: the scope's key) halts every watched run of the tree,
    cancels a bound task awaiting a tool, is kept for runs of the tree started later, and leaves other
    trees alone."""
    guard, _ = _guard()
    kid = guard.run("kid", parent_run_id="root", root_run_id="root")
    other = guard.run("solo")
    started = asyncio.Event()

    async def slow(**_: Any) -> str:
        started.set()
        await asyncio.sleep(30)
        return "late"

    async def agent() -> None:
        async with kid.bound():
            await kid.call("slow", slow, {})

    task = asyncio.create_task(agent())
    await started.wait()
    halt = {"schema_version": "1", "decision_id": "d" * 32, "scope": "tree", "root_run_id": "root", "action": "halt",
            "verdict": "tree_fanout", "trigger_event_id": "e", "trigger_run_id": "kid9", "ts_ms": 1,
            "reason": "sub-agent tree root has 101 runs", "evidence": {"rule": "runs", "runs": 101}}
    assert guard.board.apply(halt) == "applied"
    with pytest.raises(TreeHalted):
        await asyncio.wait_for(task, 2)
    with pytest.raises(TreeHalted):
        guard.run("kid2", parent_run_id="kid")
    assert guard.board.apply(halt) == "duplicate"
    assert await other.call("search", ok, {}) == "ok"
    assert guard.board.apply({**halt, "decision_id": "e" * 32, "action": "resume"}) == "applied"
    assert await kid.call("search", ok, {}) == "ok"


def test_scopes_the_board_does_not_know_yet_are_ignored_and_bad_tree_messages_are_malformed() -> None:
    board = ControlBoard(watch_all=True)
    base = {"decision_id": "a" * 32, "action": "halt", "verdict": "tool_storm", "ts_ms": 1, "reason": "r",
            "evidence": {}}
    assert board.apply({**base, "scope": "galaxy", "tenant": "t"}) == "ignored"  # a scope of a later release
    assert board.apply({**base, "decision_id": "b" * 32, "scope": "tree"}) == "malformed"  # no root_run_id
    assert board.apply({**base, "decision_id": "c" * 32, "scope": 7, "run_id": "r"}) == "malformed"
