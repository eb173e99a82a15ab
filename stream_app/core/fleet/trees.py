"""Sub-agent trees: runs spawning runs, folded by the tree's root run id.

Each run of a tree says so in its events (``root_run_id``; ``parent_run_id`` and ``depth`` for a child),
and a spawn-class call may name the child it starts (``child_run_id``, ``child_agent_id``, ``task_hash``).
A run without a ``root_run_id`` whose spawn-class call starts a child is the root of its tree. Every
rule fires at most once per tree (``tree_recursion`` once per task), whatever else fired before, so the
set of decisions depends on the facts and not on the order they came in:

* ``tree_depth``: a run deeper than ``max_tree_depth``: at the spawn call that would create it, or at
  the first event of such a run if its spawn was not seen. A run's depth is the larger of what it
  declares and what the parent chain seen so far gives (its parent's + 1, a non-root at least 1); a
  parent seen late deepens its descendants then.
* ``tree_recursion``: the ``tree_task_repeats``-th spawn of the same task (child agent, ``task_hash``)
  in one tree: a self-delegation chain and duplicate siblings alike. Distinct tasks never count.
* ``tree_fanout``: the event that makes the tree's known runs (the root, every run that sent an event,
  every child a spawn named) exceed ``max_tree_runs``; an ``alert`` when they pass half of it.
* ``tree_budget``: the call whose ``cost_usd`` takes the tree's sum (integer micro-USD) strictly past
  ``max_tree_cost_usd``. The sum is what the root spent (its every call, from its first: a root's first
  spawn's fact carries what its run spent so far, each later fact what its call added, ``root_cost``)
  and what its sub-agents' calls cost. A root's call is a fact once the root has made a spawn-class
  call (``RunState.spawned``, set by a halted run's spawn too, whose runtime went on in fleet mode: what
  it spent until its halt then reaches the tree): a run spawning nothing sends no tree fact. A root
  whose run state was forgotten (``run_ttl_ms`` of silence, waiting for its sub-agents) starts again
  from its next spawn, whose fact brings what it spent since: it adds to what the tree counted. What a
  forgotten root spends without spawning again does not reach its tree. Facts of the release before
  carried a root's total (``TreeFact.root_total``): the largest of those counts.

Every decision halts (or alerts on) the whole tree: a runtime refuses the calls of every run of it and
new children at ``Guard.run``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, NamedTuple

import orjson

from ..contract import SPEND_CAP, TelemetryEvent, micro_usd
from ..detector import RunState
from ..policy import MAX_TREE_RUNS_TRACKED, FleetThresholds
from .scope import ScopeDecision, scope_decision_id

#: Trees tracked at most by one fold (the least recently active are forgotten first).
DEFAULT_MAX_TREES = 1_000_000
#: Run ids an evidence chain lists at most (the deepest run and its ancestors).
CHAIN_LISTED = 10


class TreeFact(NamedTuple):
    """What one new event tells the tree fold. A named tuple, as the other facts: a batch builds each
    fact twice (from the fold's output, from the facts topic), and a frozen dataclass's ``__init__``
    took 2-3 us of it."""

    root: str
    run_id: str
    event_id: str
    ts_ms: int
    parent: str | None
    depth: int | None
    cost_micro: int
    spawn: bool
    child_run_id: str | None
    child_agent_id: str | None
    task_hash: str | None
    tenant: str | None
    #: A root's ``cost_micro`` is its run's total so far, not what to add: the facts of the release before
    #: 2026-12-06 (their items one field shorter), folded as then, keeping the largest.
    root_total: bool = False

    @property
    def key_text(self) -> str:
        return self.root


def tree_fact(event: TelemetryEvent, tool_class: str, spent: int | None = None) -> TreeFact | None:
    """The fact of ``event`` (its resolved ``tool_class``), or None when it tells the tree nothing: a
    run outside any tree, or a root's call that starts no child and costs nothing, or comes before its
    first spawn (its spending until then comes with that spawn). ``spent`` is, for the root, what its
    fact adds to the tree's spend (``root_cost``; None: nothing, until a spawn-class tool call makes it a
    spawner): a sub-agent's fact carries its call's cost."""
    spawn = tool_class == "spawn"
    root = event.root_run_id or event.run_id
    cost = micro_usd(event.cost_usd)
    if root == event.run_id:
        if not spawn and (spent is None or not cost):
            return None
        # None: a root that has not spawned (a model call said to be a spawn): its first spawn brings it
        cost = 0 if spent is None else spent
    return TreeFact(root, event.run_id, event.event_id, event.ts_ms, event.parent_run_id, event.depth,
                    cost, spawn, event.child_run_id if spawn else None,
                    event.child_agent_id if spawn else None, event.task_hash if spawn else None, event.tenant)


class TreeState:
    """One tree: its known runs with their depths (capped one past ``max_tree_depth``: all a rule needs,
    and a cycle in bad parent links ends), parent links, summed cost, spawn counts per task and the
    rules that fired."""

    __slots__ = ("anonymous", "children", "cost_micro", "depth", "fired", "last_ts_ms", "parent", "root_cost",
                 "sources", "tasks")

    def __init__(self) -> None:
        self.depth: dict[str, int] = {}
        self.parent: dict[str, str] = {}
        self.children: dict[str, list[str]] = {}
        #: Runs that spawned a child without naming it: a child one level below them, wherever they end up.
        self.anonymous: set[str] = set()
        #: What the tree's calls cost (summed), and the largest total a root's fact of the release before
        #: reported (``TreeFact.root_total``).
        self.cost_micro = 0
        self.root_cost = 0
        #: ``task_key`` -> the runs that spawned it (up to ``tree_task_repeats``).
        self.tasks: dict[str, list[str]] = {}
        self.fired: set[str] = set()
        self.last_ts_ms = 0
        #: The adapter's bookkeeping: the highest offset folded per source ("partition" -> offset), so a
        #: redelivered fact counts once (the worker's; replay and the SDK leave it empty).
        self.sources: dict[str, int] = {}

    def encode(self) -> bytes:
        """The stored form (the worker's trees table)."""
        record = {"v": 1, "d": self.depth, "p": self.parent, "c": self.cost_micro, "t": self.tasks,
                  "f": sorted(self.fired), "ts": self.last_ts_ms, "s": self.sources, "a": sorted(self.anonymous)}
        if self.root_cost:  # a key of its own: a reader of the release before ignores it
            record["rc"] = self.root_cost
        return orjson.dumps(record)

    @classmethod
    def decode(cls, raw: bytes) -> TreeState:
        obj = orjson.loads(raw)
        if type(obj) is not dict or obj.get("v") != 1:
            raise ValueError(f"not a tree record of format 1: {raw[:60]!r}")
        state = cls()
        state.depth, state.parent, state.cost_micro = obj["d"], obj["p"], obj["c"]
        state.last_ts_ms = obj["ts"]
        # Releases before task_key keyed a task by its whole hash: keyed as task_key keys it (a record this
        # release writes holds task keys only; one an earlier release reads counts them apart from its own
        # while workers of both releases share the tree: at worst a tree_recursion fires later, once).
        state.tasks = {_keyed(task): runs for task, runs in obj["t"].items()}
        state.fired = {_RECURSION + _keyed(mark[len(_RECURSION):]) if mark.startswith(_RECURSION) else mark
                       for mark in obj["f"]}
        state.sources = obj.get("s", {})
        state.anonymous = set(obj.get("a", ()))
        state.root_cost = obj.get("rc", 0)
        for child, parent in state.parent.items():
            state.children.setdefault(parent, []).append(child)
        return state


def task_key(child_agent_id: str | None, task_hash: str) -> str:
    """How a tree's state keys a task: the child agent and the task hash, a hash longer than 16
    characters as 16 hex digits of its BLAKE2b (64 bits: two tasks of one tree of up to
    ``MAX_TREE_RUNS_TRACKED`` runs collide with a chance below 1e-11; the SDK's 64-hex hashes were most
    of a tree's stored bytes)."""
    if len(task_hash) > 16:
        task_hash = hashlib.blake2b(task_hash.encode(), digest_size=8).hexdigest()
    return f"{child_agent_id or ''}\x1f{task_hash}"


_RECURSION = "tree_recursion\x1f"


def _keyed(task: str) -> str:
    agent, _, task_hash = task.rpartition("\x1f")
    return task_key(agent, task_hash)


class TreeFold:
    """Root run id -> TreeState, least recently active first, forgotten after ``tree_ttl_ms`` of event
    time without a fact (or beyond ``max_trees``)."""

    def __init__(self, fleet: FleetThresholds | None = None, max_trees: int = DEFAULT_MAX_TREES) -> None:
        self.fleet = fleet or FleetThresholds()
        self.max_trees = max_trees
        self.trees: OrderedDict[str, TreeState] = OrderedDict()
        self._watermark_ms = 0

    def __len__(self) -> int:
        return len(self.trees)

    def observe(self, fact: TreeFact) -> tuple[ScopeDecision, ...]:
        trees = self.trees
        state = trees.get(fact.root)
        if state is None:
            state = trees[fact.root] = TreeState()
        else:
            trees.move_to_end(fact.root)
        decisions = fold(self.fleet, state, fact)
        if fact.ts_ms > self._watermark_ms:
            self._watermark_ms = fact.ts_ms
        horizon = self._watermark_ms - self.fleet.tree_ttl_ms
        while trees:
            oldest = next(iter(trees.values()))
            if oldest.last_ts_ms >= horizon and len(trees) <= self.max_trees:
                break
            trees.popitem(last=False)
        return decisions


def root_spent(state: RunState) -> int | None:
    """What a run spent, once it has spawned (else None): ``root_cost``'s reading of its state."""
    return state.cost_micro if state.spawned else None


def root_cost(before: int | None, after: int | None) -> int | None:
    """What a root's tree fact adds to its tree's spend, from its run's ``root_spent`` before and after the
    call: nothing before its first spawn (None); at that spawn, all the run spent so far; after it, what
    the call added. Summed by the fold, so a root whose run state was forgotten (``run_ttl_ms`` of
    silence while its sub-agents work) and spawns again adds what it spends from then on to what its
    tree already counted, instead of starting again from 0 (the release before sent the run's total and
    the fold kept the largest)."""
    if after is None:
        return None
    return after if before is None else after - before


def fold(fleet: FleetThresholds, state: TreeState, fact: TreeFact) -> tuple[ScopeDecision, ...]:
    """Fold one fact into its tree; the decisions it crossed."""
    if fact.ts_ms > state.last_ts_ms:
        state.last_ts_ms = fact.ts_ms
    cap = fleet.max_tree_depth + 1
    root, run_id = fact.root, fact.run_id
    depths, parent = state.depth, fact.parent
    if not fact.spawn and run_id != root and root in depths \
            and depths.get(run_id, -1) >= min(max(1, fact.depth or 0), cap) \
            and (parent is None or parent == run_id or run_id in state.parent):
        # most facts: another call of a run the tree knows as deep, its parent linked: nothing to place
        deeper = None
    else:
        # (run, depth) of the first run (or unnamed child, one below its spawner) this fact puts at the cap
        deeper = _place(state, fact, cap)
    if fact.cost_micro:
        if fact.root_total and run_id == root:
            state.root_cost = max(state.root_cost, fact.cost_micro)
        else:
            state.cost_micro = min(state.cost_micro + fact.cost_micro, SPEND_CAP)
    if deeper is None and not fact.spawn and _runs_settled(fleet, state) \
            and (not fleet.max_tree_cost_usd or "tree_budget" in state.fired):
        return ()  # most facts: none of _crossed's rules can fire (checked here, without building a thing)
    return _crossed(fleet, state, fact, deeper, cap)


def _runs_settled(fleet: FleetThresholds, state: TreeState) -> bool:
    """Neither ``tree_fanout`` rule can fire on the tree's run count as it is (the half alert fires at the
    latest with the halt, so a fired halt means both did)."""
    runs = len(state.depth)
    return runs <= fleet.max_tree_runs // 2 or "tree_fanout" in state.fired \
        or (runs <= fleet.max_tree_runs and "tree_fanout_half" in state.fired)


def _place(state: TreeState, fact: TreeFact, cap: int) -> tuple[str, int] | None:
    """Put the fact's runs (its own, its parent, the child it spawns) in the tree; the first (run, depth)
    put at the cap, if any."""
    root, run_id = fact.root, fact.run_id
    deeper = _know(state, root, max(0, fact.depth or 0) if run_id == root else 0, cap)
    if run_id != root:
        deeper = _know(state, run_id, max(1, fact.depth or 0), cap) or deeper
        if fact.parent is not None and fact.parent != run_id:
            deeper = _link(state, root, fact.parent, run_id, cap) or deeper
    if fact.spawn:
        child = fact.child_run_id
        if child is not None and child not in (run_id, root):
            deeper = _know(state, child, state.depth.get(run_id, 0) + 1, cap) or deeper
            deeper = _link(state, root, run_id, child, cap) or deeper
        elif run_id in state.depth:
            state.anonymous.add(run_id)
            if state.depth[run_id] + 1 >= cap:
                deeper = deeper or (run_id, cap)
    return deeper


def _crossed(fleet: FleetThresholds, state: TreeState, fact: TreeFact, deeper: tuple[str, int] | None,
             cap: int) -> tuple[ScopeDecision, ...]:
    """The decisions of the rules the fact's tree crossed with it (each fires once per tree)."""
    root, run_id = fact.root, fact.run_id
    out: list[ScopeDecision] = []
    fired = state.fired
    if "tree_depth" not in fired and deeper is not None:
        fired.add("tree_depth")
        deepest, depth = deeper
        if state.depth.get(deepest, cap) < cap:  # a run one above the cap that spawned an unnamed child
            how = f"run {deepest} at depth {depth - 1} spawned a child at depth {depth}"
        elif deepest == fact.child_run_id:
            how = f"run {run_id} at depth {depth - 1} spawned {deepest} at depth {depth}"
        else:
            how = f"run {deepest} is at depth {depth} or more"
        evidence: dict[str, Any] = {"rule": "depth", "depth": depth, "max_tree_depth": fleet.max_tree_depth,
                                    "chain": _chain(state, deepest)}
        if fact.depth is not None:
            evidence["declared_depth"] = fact.depth
        levels = f"{fleet.max_tree_depth} level{'s' if fleet.max_tree_depth != 1 else ''}"
        out.append(_decision(fleet, fact, "halt", "tree_depth", "", evidence,
                             f"sub-agent tree {root} is more than {levels} deep: {how}"))
    if fact.spawn and fact.task_hash is not None and fleet.tree_task_repeats:
        task = task_key(fact.child_agent_id, fact.task_hash)
        spawners = state.tasks.get(task)
        if spawners is None:
            if len(state.tasks) < MAX_TREE_RUNS_TRACKED:
                state.tasks[task] = [run_id]
        elif len(spawners) < fleet.tree_task_repeats:
            spawners.append(run_id)
            if len(spawners) == fleet.tree_task_repeats and (_RECURSION + task) not in fired:
                fired.add(_RECURSION + task)
                agent = fact.child_agent_id or "(unnamed)"
                out.append(_decision(  # the id's part: the whole task, as before tasks were keyed short
                    fleet, fact, "halt", "tree_recursion", f"{fact.child_agent_id or ''}\x1f{fact.task_hash}",
                    {"rule": "task", "child_agent_id": fact.child_agent_id, "task_hash": fact.task_hash,
                     "spawns": len(spawners), "spawned_by": list(spawners)},
                    f"sub-agent tree {root} spawned the same task {len(spawners)} times (agent {agent}, task "
                    f"{fact.task_hash[:16]}): a self-delegation chain or duplicate siblings"))
    runs = len(state.depth)
    if runs > fleet.max_tree_runs // 2 and "tree_fanout_half" not in fired:
        fired.add("tree_fanout_half")
        out.append(_decision(fleet, fact, "alert", "tree_fanout", "half",
                             {"rule": "runs", "runs": runs, "max_tree_runs": fleet.max_tree_runs},
                             f"sub-agent tree {root} has {runs} runs, more than half of max_tree_runs "
                             f"{fleet.max_tree_runs}", shadowable=False))
    if runs > fleet.max_tree_runs and "tree_fanout" not in fired:
        fired.add("tree_fanout")
        out.append(_decision(fleet, fact, "halt", "tree_fanout", "",
                             {"rule": "runs", "runs": runs, "max_tree_runs": fleet.max_tree_runs},
                             f"sub-agent tree {root} has {runs} runs, over max_tree_runs {fleet.max_tree_runs}"))
    limit = micro_usd(fleet.max_tree_cost_usd)
    total = min(state.cost_micro + state.root_cost, SPEND_CAP)
    if limit and total > limit and "tree_budget" not in fired:
        fired.add("tree_budget")
        spent = total / 1_000_000
        out.append(_decision(fleet, fact, "halt", "tree_budget", "",
                             {"rule": "cost", "cost_usd": spent, "max_tree_cost_usd": fleet.max_tree_cost_usd},
                             f"sub-agent tree {root} spent ${spent:.6f}, over max_tree_cost_usd "
                             f"${fleet.max_tree_cost_usd:g}: run {run_id}'s call took it past"))
    return tuple(out)


def _know(state: TreeState, run_id: str, depth: int, cap: int) -> tuple[str, int] | None:
    """Record ``run_id`` at least at ``depth``, deepening its known descendants; the first (run, depth)
    it put at the cap (a run that spawned an unnamed child is there one level earlier), if any."""
    depths = state.depth
    if run_id not in depths:
        if len(depths) >= MAX_TREE_RUNS_TRACKED:
            return None
        depths[run_id] = -1
    reached = None
    anonymous = state.anonymous
    stack = [(run_id, min(depth, cap))]
    while stack:
        run, d = stack.pop()
        if d <= depths.get(run, -1):
            continue
        depths[run] = d
        if reached is None and (d >= cap or (d + 1 >= cap and run in anonymous)):
            reached = (run, cap)
        stack.extend((child, min(d + 1, cap)) for child in state.children.get(run, ()))
    return reached


def _link(state: TreeState, root: str, parent: str, child: str, cap: int) -> tuple[str, int] | None:
    """``parent`` started ``child`` (the first parent named wins); what reached the cap, if any."""
    if child == root or child in state.parent or child not in state.depth:
        return None
    reached = None
    if parent not in state.depth:
        reached = _know(state, parent, 0 if parent == root else 1, cap)
        if parent not in state.depth:  # not tracked: the tree is past MAX_TREE_RUNS_TRACKED
            return reached
    state.parent[child] = parent
    state.children.setdefault(parent, []).append(child)
    return _know(state, child, state.depth[parent] + 1, cap) or reached


def _chain(state: TreeState, run_id: str) -> list[str]:
    """``run_id`` and its ancestors, deepest first (at most ``CHAIN_LISTED``)."""
    chain = [run_id]
    parent = state.parent.get(run_id)
    while parent is not None and len(chain) < CHAIN_LISTED and parent not in chain:
        chain.append(parent)
        parent = state.parent.get(parent)
    return chain


def _decision(fleet: FleetThresholds, fact: TreeFact, action: str, verdict: str, part: str,
              evidence: dict[str, Any], reason: str, shadowable: bool = True) -> ScopeDecision:
    key = (fact.root,)
    if fleet.shadow and shadowable:
        evidence = {**evidence, "shadow": True, "would": action}
        action = "alert"
    return ScopeDecision("tree", key, action, verdict, fact.event_id, fact.run_id,
                         scope_decision_id("tree", key, action, verdict, part), fact.ts_ms, reason, evidence,
                         fact.tenant)
