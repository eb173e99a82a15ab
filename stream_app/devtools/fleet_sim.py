"""A simulated fleet: deterministic telemetry for the kinds of runs a platform team sees.

``loopwarden simulate``, the golden files, the parity and end-to-end tests and the benchmarks all use
this mix of the catalogue's kinds (``scenarios.FLEET_MIX``): healthy runs, legitimate retries against a
flaky tool, runaway loops, argument-mutating loops, 2-call cycles, polling, duplicate e-mails and a run
that never stops. Each kind knows the decision the detector must reach, which makes false halts
countable. Same seed, same bytes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from .scenarios import FLEET_MIX, Scenario, kinds

Event = dict[str, Any]


@dataclass(frozen=True)
class SimRun:
    run_id: str
    agent_id: str
    scenario: Scenario
    events: list[Event]


def simulate_run(run_id: str, scenario: Scenario, rng: random.Random, start_ms: int,
                 calls: int = 12, gap_ms: int = 700) -> SimRun:
    """One run's telemetry: events spaced ``gap_ms`` apart (jittered) from ``start_ms``."""
    agent_id = scenario.agent_id
    events: list[Event] = []
    ts = start_ms
    for seq, (tool, args, outcome, result, extra) in enumerate(scenario.telemetry(rng, calls)):
        ts += gap_ms + rng.randrange(gap_ms)
        event: Event = {
            "schema_version": "1",
            "run_id": run_id,
            "event_id": f"{run_id}-{seq}",
            "agent_id": agent_id,
            "tool": tool,
            "ts_ms": ts,
            "seq": seq,
            "outcome": outcome,
            "args": args,
            "result": result,
            "trace_id": f"{rng.getrandbits(128):032x}",
            "span_id": f"{rng.getrandbits(64):016x}",
            **extra,
        }
        events.append(event)
    return SimRun(run_id, agent_id, scenario, events)


def simulate_fleet(runs: int, seed: int = 7, start_ms: int = 1_764_000_000_000,
                   redeliver_fraction: float = 0.02) -> tuple[list[SimRun], list[Event]]:
    """``runs`` runs of mixed scenarios, and all their events interleaved by time, with a fraction
    redelivered (same event id) the way an at-least-once bus would."""
    rng = random.Random(seed)
    population, weights = kinds(FLEET_MIX)
    fleet = [
        simulate_run(f"run-{i:06d}", rng.choices(population, weights)[0], rng,
                     start_ms + rng.randrange(60_000))
        for i in range(runs)
    ]
    events = sorted((e for run in fleet for e in run.events), key=lambda e: (e["ts_ms"], e["event_id"]))
    return fleet, _redelivered(events, rng, redeliver_fraction)


def _redelivered(events: list[Event], rng: random.Random, fraction: float) -> list[Event]:
    """``events`` with a ``fraction`` of them delivered twice in a row (same event id), as an at-least-once
    bus would."""
    stream: list[Event] = []
    for event in events:
        stream.append(event)
        if rng.random() < fraction:
            stream.append(event)
    return stream


#: Kinds of sub-agent tree and the tree decisions (action/verdict) each must get with the default policy.
TREE_KINDS: dict[str, tuple[str, ...]] = {
    "runaway_depth": ("halt/tree_depth",),  # explore spawns explore spawns explore...
    "duplicate_tasks": ("halt/tree_recursion",),  # the same review delegated again and again
    "map_reduce": (),  # 30 distinct tasks, one level: legitimate fan-out
    "swarm": ("alert/tree_fanout", "halt/tree_fanout"),  # 120 children of distinct tasks
}


def simulate_trees(trees: int, seed: int = 11, start_ms: int = 1_764_000_000_000,
                   redeliver_fraction: float = 0.02, prefix: str = "tree-") -> tuple[dict[str, str], list[Event]]:
    """``trees`` sub-agent trees of the ``TREE_KINDS`` in turn (root run id -> kind), and all their runs'
    events interleaved by time, with a fraction redelivered. Every event of a run carries its tree's
    ``root_run_id`` (a child's also its parent and depth), as the SDK sends them; a spawn call names its
    child and the task's hash. Run ids start with ``prefix``."""
    rng = random.Random(seed)
    kinds_of: dict[str, str] = {}
    events: list[Event] = []
    names = list(TREE_KINDS)
    for t in range(trees):
        kind = names[t % len(names)]
        root = f"{prefix}{t:04d}"
        kinds_of[root] = kind
        start = start_ms + rng.randrange(30_000)
        if kind == "runaway_depth":
            chain = [root] + [f"{root}-d{level}" for level in range(1, 8)]
            spawns = [(chain[i], chain[i + 1], "explore", f"explore the repository, level {i}") for i in range(7)]
        elif kind == "duplicate_tasks":
            spawns = [(root, f"{root}-r{n}", "reviewer", "review issues 1-10") for n in range(4)]
        elif kind == "map_reduce":
            spawns = [(root, f"{root}-m{n}", "mapper", f"summarise chapter {n}") for n in range(30)]
        else:
            spawns = [(root, f"{root}-s{n}", "swarm", f"probe shard {n}") for n in range(120)]
        depth = {root: 0}
        parent_of: dict[str, str] = {}
        ts = start
        for parent, child, agent, task in spawns:
            ts += 200 + rng.randrange(200)
            depth[child] = depth[parent] + 1
            parent_of[child] = parent
            events.append(_tree_event(parent, f"{parent}-spawn-{child}", ts, root, parent_of.get(parent),
                                      depth[parent], tool="Task", args={"prompt": task}, result="started",
                                      extra={"tool_class": "spawn", "child_run_id": child, "child_agent_id": agent,
                                             "task_hash": _task_hash(task)}))
            events.extend(  # the child works a little
                _tree_event(child, f"{child}-{n}", ts + 50 + 100 * n, root, parent, depth[child], tool="search",
                            args={"q": f"{task} {n}"}, result=f"hits {n}", extra={"agent_id": agent, "cost_usd": 0.01})
                for n in range(3))
    events.sort(key=lambda e: (e["ts_ms"], e["event_id"]))
    return kinds_of, _redelivered(events, rng, redeliver_fraction)


def _tree_event(run_id: str, event_id: str, ts_ms: int, root: str, parent: str | None, depth: int, *, tool: str,
                args: dict[str, Any], result: Any, extra: dict[str, Any]) -> Event:
    event: Event = {"schema_version": "1", "run_id": run_id, "event_id": event_id, "tool": tool, "ts_ms": ts_ms,
                    "outcome": "success", "args": args, "result": result, "root_run_id": root, **extra}
    if parent is not None:
        event["parent_run_id"] = parent
        event["depth"] = depth
    return event


def _task_hash(task: str) -> str:
    from ..core import semantic_hash
    from ..core.normalize import FieldFilter

    return semantic_hash({"task": task}, FieldFilter(()), True)


#: Kinds of thread (runs on one PR, issue or schedule) and the thread decisions each must get with the
#: default policy.
THREAD_KINDS: dict[str, tuple[str, ...]] = {
    "comment_bot": ("halt/self_trigger",),  # a bot whose comment triggers its own next run
    "nightly_auth": ("halt/schedule_failing",),  # a nightly job failing into the same auth error
    "chatops": (),  # people asking a bot, again and again: every run a user's
    "busy_webhook": ("alert/thread_rate",),  # 13 independent webhook runs in 40 minutes: 7 or more in one hour
}
DAY_MS = 86_400_000


def simulate_threads(threads: int, seed: int = 13, start_ms: int = 1_764_000_000_000,
                     redeliver_fraction: float = 0.02, prefix: str = "thread-",
                     tenant: str = "acme") -> tuple[dict[str, str], list[Event]]:
    """``threads`` threads of the ``THREAD_KINDS`` in turn (thread key -> kind), and all their runs' events
    interleaved by time, with a fraction redelivered. Every event of a run carries its ``thread_key``,
    ``trigger`` and, for a run another run caused, ``caused_by_run_id``, as the SDK sends them."""
    rng = random.Random(seed)
    kinds_of: dict[str, str] = {}
    events: list[Event] = []
    names = list(THREAD_KINDS)
    for t in range(threads):
        kind = names[t % len(names)]
        thread = f"{prefix}{t:04d}"
        kinds_of[thread] = kind
        start = start_ms + rng.randrange(30_000)
        # (run id, trigger, caused by, start, failing error class or None)
        runs: list[tuple[str, str, str | None, int, str | None]]
        if kind == "comment_bot":
            runs = [(f"{thread}-u", "user", None, start, None)]
            runs += [(f"{thread}-b{n}", "webhook", runs[-1][0] if n == 1 else f"{thread}-b{n - 1}",
                      start + 90_000 * n, None) for n in range(1, 6)]
        elif kind == "nightly_auth":
            runs = [(f"{thread}-n{n}", "schedule", None, start + DAY_MS * n, "auth") for n in range(4)]
        elif kind == "chatops":
            runs = [(f"{thread}-c{n}", "user", None, start + 300_000 * n, None) for n in range(10)]
        else:
            runs = [(f"{thread}-w{n}", "webhook", None, start + 200_000 * n, None) for n in range(13)]
        for run_id, trigger, cause, ts, failure in runs:
            for n in range(3):
                event: Event = {"schema_version": "1", "run_id": run_id, "event_id": f"{run_id}-{n}", "tool": "gh",
                                "ts_ms": ts + 100 * n + rng.randrange(50), "outcome": "success",
                                "args": {"op": f"step {n}"}, "result": f"done {n}", "tenant": tenant,
                                "thread_key": thread, "trigger": trigger}
                if cause is not None:
                    event["caused_by_run_id"] = cause
                if failure is not None and n == 2:
                    event.update(outcome="error", error_class=failure, result="401 unauthorized")
                events.append(event)
    events.sort(key=lambda e: (e["ts_ms"], e["event_id"]))
    return kinds_of, _redelivered(events, rng, redeliver_fraction)


def simulate_storm(runs: int = 24, seed: int = 17, start_ms: int = 1_764_000_000_000, *, tenant: str = "acme",
                   tool: str = "weather.lookup", upstream: str = "api.weather.example", degraded_s: int = 150,
                   recovers: bool = True, redeliver_fraction: float = 0.02, prefix: str = "storm-") -> list[Event]:
    """``runs`` concurrent runs of ``tenant`` calling ``tool`` of ``upstream`` every few seconds: healthy
    for a minute, then the upstream answers 503 (asking for a 30 s Retry-After) for ``degraded_s``
    seconds, then recovers (``recovers``; else the stream ends while it fails). Each run retries with small jittered waits and varying arguments, as agents
    do; another tenant (``globex``) calls the same upstream at the same time, always with success: its
    calls never pause ``tenant``'s tool, nor its own."""
    rng = random.Random(seed)
    events: list[Event] = []
    degraded_from = start_ms + 60_000
    degraded_to = degraded_from + degraded_s * 1000
    end = degraded_to + 90_000 if recovers else degraded_to
    for owner, count in ((tenant, runs), ("globex", 3)):
        for r in range(count):
            run_id = f"{prefix}{owner}-{r:03d}"
            ts = start_ms + rng.randrange(5_000)
            n = 0
            while ts < end:
                failing = owner == tenant and degraded_from <= ts < degraded_to
                event: Event = {"schema_version": "1", "run_id": run_id, "event_id": f"{run_id}-{n}", "tool": tool,
                                "ts_ms": ts, "tenant": owner, "upstream": upstream, "agent_id": "forecaster",
                                "args": {"city": f"city-{(r + n) % 40}"},
                                "outcome": "error" if failing else "success",
                                "result": "503 Service Unavailable" if failing else f"forecast {n}"}
                if failing:
                    event.update(error_class="http_503", retry_after_ms=30_000)
                events.append(event)
                n += 1
                ts += 5_000 + rng.randrange(4_000)
    events.sort(key=lambda e: (e["ts_ms"], e["event_id"]))
    return _redelivered(events, rng, redeliver_fraction)
