"""``make bench``: every benchmark in one run, then BENCHMARKS.md and its plots.

    python -m bench [--quick] [--skip-core] [--only limit,fleet,halt,overshoot,settings,trees,treehalt,stormpause]

1. The core benchmark (``python -m bench.core --json bench/results/core.json``).
2. On one broker (``KAFKA_BOOTSTRAP_SERVERS``, else a local one started here): the limit (raw
   consume, round trip), fleet throughput (one and two workers), halt latency at three loads,
   overshoot at three call rates, worker settings tried through their environment variables, the
   worker's CPU per event with the rules across runs (trees, threads, tool storms) on and off, and how
   soon a tree halt and a storm's pause reach a runtime.
   Workers are real ``python -m stream_app worker`` processes with RocksDB state and changelogs.
3. Results go to ``bench/results/*.json``; ``bench.report`` renders BENCHMARKS.md and the PNG plots
   from them (``python -m bench.report`` re-renders without measuring).

Progress lines go to stderr. ``--quick`` shortens every phase (for trying the harness, not for figures).
Not part of it: ``python -m bench.cycle`` (a worker's CPU per batch against batch size below saturation:
the fixed cost of a cycle, where the halt latency at partial load goes; ``--trace``: which of the event
loop's steps that cost is made of, and its long steps) and ``python -m bench.halt_ab REF_A REF_B`` (two
commits' halt latency at one rate, interleaved and pooled: an A/B the machine's drift cannot decide).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stream_app.client import Guard, KafkaClientConfig, Spawn
from stream_app.worker.settings import SETTINGS

from . import corpus, fleet, halt, limit, report
from .kafka import broker, create_topics
from .loadgen import LoadGen
from .stats import progress
from .workers import REPO, BenchDeployment, commit_overruns

RESULTS = REPO / "bench" / "results"
WORKDIR = REPO / "var" / "bench"
SECTIONS = ("limit", "fleet", "halt", "overshoot", "settings", "trees", "treehalt", "stormpause")

#: Settings tried against the default, one worker, saturation probe: (label, worker settings by field,
#: other environment). PRODUCER_LINGER_MS is faust's own variable (faust reads it over the app's
#: ``producer_linger_ms=1``).
SETTINGS_TRIED: tuple[tuple[str, dict[str, object], dict[str, str]], ...] = (
    ("producer linger 10 ms: PRODUCER_LINGER_MS=10", {}, {"PRODUCER_LINGER_MS": "10"}),
    ("producer batches of 16 KiB (faust's default): PRODUCER_MAX_BATCH_SIZE=16384", {},
     {"PRODUCER_MAX_BATCH_SIZE": "16384"}),
    ("the Python reference folds: LOOPWARDEN_ENGINE=python", {"engine": "python"}, {}),
)


@dataclass(frozen=True)
class Plan:
    """How long and how often each phase runs."""

    template_runs: int = 10_000
    raw_messages: int = 100_000
    repeats: int = 3
    round_trips: int = 200
    #: First saturation backlog; later probes size theirs from the first probe (``backlog_for``). A worker
    #: applies 15,000-45,000 events/s here: 8,000 ran out before the window four times in a row (~1 min).
    backlog: int = 300_000
    warm_s: float = 3.0
    measure_s: float = 8.0
    step_fractions: tuple[float, ...] = (0.6, 0.8, 1.0)
    step_s: float = 15.0
    load_levels: tuple[float, ...] = (0.1, 0.5, 0.9)
    halt_s: float = 8.0
    overshoot_rates: tuple[float, ...] = (10, 100, 1000)
    overshoot_runs: int = 5
    settings_rounds: int = 2
    #: Rounds of the trees section's two probes: its rounds' ratios spread 0.99-1.73 over 5 rounds on
    #: 2026-12-04, so their median moved by a tenth from one run to the next.
    trees_rounds: int = 9

    def backlog_for(self, capacity: float | None, measure_s: float, margin: float = 1.5) -> int:
        """A saturation backlog that outlasts warm-up and measuring ``margin`` times at ``capacity``."""
        return int(margin * (self.warm_s + measure_s) * capacity) if capacity else self.backlog


QUICK = Plan(template_runs=4_000, raw_messages=40_000, repeats=2, round_trips=100, backlog=250_000,
             measure_s=4, step_fractions=(0.5, 0.9), step_s=6, halt_s=5, overshoot_runs=3, settings_rounds=1,
             trees_rounds=3)


def run_core(results: Path) -> None:
    """The core benchmark in its own process; its progress goes straight to our stderr."""
    progress("core: python -m bench.core --json bench/results/core.json")
    status = subprocess.call([sys.executable, "-m", "bench.core", "--json", str(results / "core.json")], cwd=REPO)
    if status != 0:
        progress(f"core: bench.core exited with {status}; core section left as it was")


async def kafka_benches(bootstrap: str, plan: Plan, sections: set[str], results: Path,
                        template: Path) -> None:
    """Every Kafka benchmark in ``sections``, each writing its JSON as soon as it is done."""
    name = f"bench-{uuid.uuid4().hex[:6]}"

    def save(section: str, data: dict[str, Any]) -> None:
        machine = json.loads((results / "machine.json").read_text())
        measured = {"commit": machine["commit"], "date_utc": machine["date_utc"]}
        (results / f"{section}.json").write_text(json.dumps(data | {"measured": measured}, indent=1) + "\n")

    if "limit" in sections:
        progress("limit: raw aiokafka consume and one-message round trip")
        started = os.getloadavg()[0]
        data = await limit.measure(bootstrap, name, template, plan.raw_messages, plan.repeats, plan.round_trips)
        save("limit", data | {"load_before": started, "load_after": os.getloadavg()[0]})

    capacity_one: float | None = None
    sustained_one: float | None = None
    if "fleet" in sections:
        fleet_data = await fleet_section(bootstrap, template, plan, results)
        save("fleet", fleet_data)
        capacity_one = fleet_data["1w"]["probe"]["applied_per_s"]
        sustained_one = fleet_data["1w"]["sustained_per_s"] or 0.5 * capacity_one
    elif (results / "fleet.json").exists():
        previous = json.loads((results / "fleet.json").read_text())["1w"]
        capacity_one, sustained_one = previous["probe"]["applied_per_s"], previous["sustained_per_s"]

    if sections & {"halt", "overshoot"}:
        base = sustained_one or 1000.0
        deployment = BenchDeployment(bootstrap, WORKDIR)
        try:
            await deployment.start_worker_async()
            await fleet.warm_up(deployment, template, "hw")
            # The broker is a JVM started a minute ago and the worker has folded a few hundred events: the
            # first seconds of load measure their warming up (the first 10% load run was 8 ms at p50, the
            # third 5 ms, on one day), not the halt path. Ten seconds of the lowest load first.
            await fleet.run_load(deployment, template, plan.load_levels[0] * base, 10.0, "hw10",
                                 drain_timeout_s=30.0)
            # Halt latency is the fleet path's (what decisions only the fleet makes cost: local rules off,
            # telemetry sent at once); overshoot is what a runtime gets as shipped (local rules on). One
            # guard at a time: each reads the whole control topic, on this process's event loop.
            if "halt" in sections:
                fleet_path = await halt.guard_for(deployment, local_rules=False, linger_ms=0)
                try:
                    save("halt", await halt_section(deployment, fleet_path, template, plan, base)
                         | {"commit_overruns": commit_overruns(deployment.workers[0]), "path": "fleet",
                            "guard": {"local_rules": False, "linger_ms": 0}})
                finally:
                    await fleet_path.stop()
            if "overshoot" in sections:
                shipped = await halt.guard_for(deployment)
                try:
                    save("overshoot", await overshoot_section(deployment, shipped, template, plan, base)
                         | {"guard": {"local_rules": True}})
                finally:
                    await shipped.stop()
        finally:
            deployment.stop()

    if "settings" in sections:
        save("settings", await settings_section(bootstrap, template, plan, capacity_one))

    if "trees" in sections:
        save("trees", await trees_section(bootstrap, plan, capacity_one, results))

    if "treehalt" in sections:
        save("treehalt", await tree_halt_section(bootstrap, plan))

    if "stormpause" in sections:
        save("stormpause", await storm_pause_section(bootstrap, plan, sustained_one))


async def fleet_section(bootstrap: str, template: Path, plan: Plan, results: Path) -> dict[str, Any]:
    """Saturation probe, then open-loop steps, for one worker and for two in one group."""
    data: dict[str, Any] = {"step_s": plan.step_s, "step_fractions": plan.step_fractions,
                            "definition": {"max_backlog_slope": fleet.MAX_BACKLOG_SLOPE,
                                           "max_end_backlog_s": fleet.MAX_END_BACKLOG_S,
                                           "min_producer_share": fleet.MIN_PRODUCER_SHARE}}
    capacity_one: float | None = None
    for workers in (1, 2):
        load_before = os.getloadavg()[0]
        deployment = BenchDeployment(bootstrap, WORKDIR)
        try:
            progress(f"fleet: starting {workers} worker(s)")
            for _ in range(workers):
                await deployment.start_worker_async()
            await fleet.warm_up(deployment, template, f"f{workers}w")
            backlog = plan.backlog_for(capacity_one, plan.measure_s, margin=1.5 * workers)
            progress(f"fleet: {workers} worker(s), saturation probe ({backlog:,} events backlog)")
            probe = await fleet.capacity(deployment, template, backlog, f"f{workers}p",
                                         results / "profile-1w.txt" if workers == 1 else None, plan.warm_s,
                                         plan.measure_s)
            progress(f"fleet: {workers} worker(s) apply {probe['applied_per_s']:,.0f} ev/s saturated "
                     f"({probe['worker_cpu_us_per_event']:,.0f} us worker CPU per event)")
            capacity_one = capacity_one or probe["applied_per_s"]
            steps = await fleet.sustained(deployment, template, probe["applied_per_s"], plan.step_fractions,
                                          plan.step_s, f"f{workers}s")
            overruns = commit_overruns(deployment.workers[0])
        finally:
            deployment.stop()
        data[f"{workers}w"] = {"probe": probe, **steps, "commit_overruns": overruns, "load_before": load_before,
                               "load_after": os.getloadavg()[0]}
        progress(f"fleet: {workers} worker(s) sustain {steps['sustained_per_s']:,.0f} ev/s")
    # The standby choice: the same two-worker probe without standby replicas (each worker then keeps no
    # copy of the other's partitions; a failover recovers them from the changelog).
    deployment = BenchDeployment(bootstrap, WORKDIR, settings={"standby_replicas": 0})
    try:
        for _ in range(2):
            await deployment.start_worker_async()
        await fleet.warm_up(deployment, template, "f2n")
        probe = await fleet.capacity(deployment, template, plan.backlog_for(capacity_one, plan.measure_s, margin=3.0),
                                     "f2np", None, plan.warm_s, plan.measure_s)
    finally:
        deployment.stop()
    data["2w_no_standby"] = {"probe": probe}
    progress(f"fleet: 2 workers without standbys apply {probe['applied_per_s']:,.0f} ev/s saturated "
             f"({probe['worker_cpu_us_per_event']:,.0f} us worker CPU per event)")
    return data


async def halt_section(deployment: BenchDeployment, guard: Guard, template: Path, plan: Plan,
                       sustained: float) -> dict[str, Any]:
    """Halt latency at each load level, ``plan.repeats`` times."""
    async with halt.clocked(deployment, guard) as clock:
        levels = await _halt_levels(deployment, guard, clock, template, plan, sustained)
    return {"sustained_per_s": sustained, "duration_s": plan.halt_s, "levels": levels,
            "wrong_trigger": clock.wrong_trigger}


async def _halt_levels(deployment: BenchDeployment, guard: Guard, clock: halt.HaltClock, template: Path, plan: Plan,
                       sustained: float) -> list[dict[str, Any]]:
    rtt_topic = f"{deployment.name}.rtt"
    await asyncio.to_thread(create_topics, deployment.bootstrap, [(rtt_topic, 1)])
    levels = []
    for level in plan.load_levels:
        load = level * sustained
        inject = min(10.0, max(2.0, 0.1 * load / 4))  # runaways bring at most ~10% of the load
        background = max(0.0, load - 4 * inject)
        runs, raws = [], []
        for repeat in range(plan.repeats):
            result = await halt.halt_latency(deployment, guard, clock, template, background, inject, plan.halt_s,
                                             f"h{int(level * 100)}r{repeat}")
            runs.append(result)
            cuts = result.get("latency_ms")
            progress(f"halt: {level:.0%} load ({load:,.0f} ev/s), run {repeat + 1}/{plan.repeats}: "
                     + (f"p50 {cuts['p50']:.0f} ms, p99 {cuts['p99']:.0f} ms, "
                        f"{result['halted']}/{result['injected']} halted" if cuts else "no halts received"))
            # the raw trip alone at the same load, after each run (not during it: its polls would share the host)
            raws.append(await halt.raw_trips_under_load(deployment, template, background, plan.halt_s,
                                                        f"h{int(level * 100)}r{repeat}raw", rtt_topic))
            progress(f"halt: {level:.0%} load, a raw round trip alone: p50 {raws[-1]['p50']:.1f} ms, "
                     f"p99 {raws[-1]['p99']:.1f} ms")
        ok = [r["latency_ms"] for r in runs if "latency_ms" in r]
        splits = [r["split_ms"] for r in runs if r.get("split_ms")]
        levels.append({"level": level, "load_per_s": load, "runs": runs,
                       "raw_round_trips_ms": raws,
                       "raw_round_trip_ms": {k: statistics.median(c[k] for c in raws) for k in ("p50", "p95", "p99", "max")},
                       "median": {k: statistics.median(c[k] for c in ok) for k in ("p50", "p95", "p99", "max")}
                       if ok else None,
                       "split_median": {k: statistics.median(c[k] for c in splits) for k in splits[0]}
                       if splits else None})
    return levels


async def overshoot_section(deployment: BenchDeployment, guard: Guard, template: Path, plan: Plan,
                            sustained: float) -> dict[str, Any]:
    """Overshoot per call rate on an idle fleet, and at 50% load for the paces with a target."""
    loads = []
    for level, rates in ((0.0, plan.overshoot_rates), (0.5, tuple(r for r in plan.overshoot_rates if r <= 100))):
        progress(f"overshoot: runaways at {', '.join(f'{r:g}' for r in rates)} calls/s, "
                 f"{level:.0%} background load")
        loads.append({"level": level} | await halt.overshoot(
            deployment, guard, template, rates, plan.overshoot_runs, level * sustained, f"o{int(level * 100)}"))
    return {"loads": loads}


async def _interleaved(bootstrap: str, template: Path, plan: Plan, backlog: int, section: str, prefix: str,
                       configs: tuple[tuple[str, dict[str, object], dict[str, str]], ...],
                       rounds: int, profiles: dict[str, Path] | None = None,
                       measure_s: float | None = None, alternate: bool = False) -> list[dict[str, Any]]:
    """One worker's saturation probe for each of ``configs`` (label, worker settings by field, other
    environment), each on a fresh deployment, in ``rounds`` interleaved rounds (so drift in the
    machine's load hits all of them); per config its probes and their medians. ``profiles``: the
    configs (by label) whose first-round probe is sampled by py-spy, and where to; ``measure_s``: each
    probe's measured window (default: the plan's, less 2 s); ``alternate``: every other round runs the
    configs in reverse order (a machine slowing down or speeding up over the run then favours none)."""
    probes: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in configs}
    for round_ in range(rounds):
        for label, settings, env in (configs[::-1] if alternate and round_ % 2 else configs):
            deployment = BenchDeployment(bootstrap, WORKDIR, settings=dict(settings), env=env)
            try:
                await deployment.start_worker_async()
                profile_to = (profiles or {}).get(label) if round_ == 0 else None
                probe = await fleet.capacity(deployment, template, backlog, f"{prefix}{round_}{len(probes[label])}",
                                             profile_to, plan.warm_s,
                                             plan.measure_s - 2 if measure_s is None else measure_s, drain=False)
                probe["rss_peak_mb"] = deployment.workers[0].rss_mb(peak=True)
            finally:
                deployment.stop()
            probes[label].append(probe)
            progress(f"{section}: round {round_ + 1}/{rounds}, {label}: "
                     f"{probe['applied_per_s']:,.0f} ev/s, {probe['worker_cpu_us_per_event']:,.0f} us CPU per event")
    return [{"label": label, "env": {**SETTINGS.env(**settings), **env}, "probes": probes[label],
             "applied_per_s": statistics.median(p["applied_per_s"] for p in probes[label]),
             "worker_cpu_us_per_event": statistics.median(p["worker_cpu_us_per_event"] for p in probes[label]),
             "rss_peak_mb": max(p["rss_peak_mb"] for p in probes[label])}
            for label, settings, env in configs]


async def settings_section(bootstrap: str, template: Path, plan: Plan, capacity_one: float | None) -> dict[str, Any]:
    """Saturation throughput of one worker with the default and each setting in SETTINGS_TRIED, in
    ``plan.settings_rounds`` interleaved rounds."""
    # Settings may be much faster than the default, and these deployments are not reused: a generous
    # backlog costs only its production, a backlog that runs out costs a second probe.
    backlog = plan.backlog_for(capacity_one, plan.measure_s - 2, margin=3.0)
    configs = (("default", {}, {}), *SETTINGS_TRIED)
    return {"tried": await _interleaved(bootstrap, template, plan, backlog, "settings", "v", configs,
                                        plan.settings_rounds)}


async def trees_section(bootstrap: str, plan: Plan, capacity_one: float | None, results: Path) -> dict[str, Any]:
    """One worker's saturation throughput and CPU per event on the fleet as the SDK sends it plus
    sub-agent trees of every kind, with the rules across runs on (every fold) and off
    (``LOOPWARDEN_FLEET_RULES=false``), in interleaved rounds."""
    template = WORKDIR / "corpus-trees.tsv"
    trees = max(8, plan.template_runs // 100)
    events, facts = corpus.write_tree_template(template, plan.template_runs, trees)
    corpus.check_renamed(corpus.read_template(template)[:1])
    progress(f"trees: {events:,} events ({facts:,} tree facts, {trees} trees) -> {template}")
    # A ratio of two noisy medians, on a corpus whose parts differ (threads first, trees in bursts): windows
    # of two passes over it, and ``plan.trees_rounds`` rounds (the same configuration's probes spread 31-46 us
    # in the settings' 6-s windows).
    measure_s = 2 * plan.measure_s - 2
    backlog = plan.backlog_for(capacity_one or 40_000, measure_s, margin=1.5)
    configs: tuple[tuple[str, dict[str, object], dict[str, str]], ...] = (
        ("every fold", {"fleet_rules": True}, {}), ("per-run rules only", {"fleet_rules": False}, {}))
    # The verdict is the median of the rounds' ratios: each round's two probes ran back to back (in
    # alternating order), so the machine's drift between rounds, which moved either configuration's probes
    # by a third on 2026-12-03, cancels in each ratio; the ratio of the two medians is reported beside it.
    tried = await _interleaved(bootstrap, template, plan, backlog, "trees", "t", configs, plan.trees_rounds,
                               {"every fold": results / "profile-trees.txt", "per-run rules only":
                                results / "profile-trees-off.txt"}, measure_s, alternate=True)
    pairs = [on["worker_cpu_us_per_event"] / off["worker_cpu_us_per_event"]
             for on, off in zip(tried[0]["probes"], tried[1]["probes"], strict=True)]
    return {"corpus": {"events": events, "tree_facts": facts, "trees": trees}, "tried": tried,
            "round_ratios": pairs, "cpu_ratio": statistics.median(pairs),
            "ratio_of_medians": tried[0]["worker_cpu_us_per_event"] / tried[1]["worker_cpu_us_per_event"]}


async def tree_halt_section(bootstrap: str, plan: Plan, trees: int = 40, threads: int = 40) -> dict[str, Any]:
    """How soon a scope halt made by the fleet reaches a guarded run in another process: one runtime
    (fleet path only: no local rules) spawns a chain of sub-agents until the tree is 6 deep; a second
    runtime guards another run of the same tree. Then, per thread, the first runtime starts runs on one
    thread each caused by the one before until the 3rd generation (``self_trigger``); the second guards a
    run of that thread. Latency: from the crossing event's end (the decision's ts_ms) to the second
    runtime's board applying the halt, per tree and per thread."""
    deployment = BenchDeployment(bootstrap, WORKDIR)
    latencies: list[float] = []
    thread_latencies: list[float] = []
    try:
        await deployment.start_worker_async()
        config = KafkaClientConfig(bootstrap)
        common: dict[str, Any] = {"trusted_keys": deployment.trusted_keys(), "scopes_topic": deployment.scopes_topic}
        spawner = Guard.fleet(config, deployment.telemetry_topic, deployment.control_topic, local_rules=False,
                              linger_ms=0, **common)
        watcher = Guard.fleet(config, deployment.telemetry_topic, deployment.control_topic, **common)
        arrived: dict[str, float] = {}
        waiting: dict[str, asyncio.Event] = {}

        def applied(decision: dict[str, Any]) -> None:
            key = decision.get("root_run_id") if decision.get("scope") == "tree" else decision.get("thread_key")
            if decision.get("scope") in ("tree", "thread") and decision["action"] == "halt" and key in waiting:
                arrived[key] = time.time() * 1000 - decision["ts_ms"]
                waiting[key].set()

        watcher.on_decision(applied)
        async with spawner, watcher:
            for n in range(trees):
                root = f"{deployment.name}-tree-{n}"
                waiting[root] = asyncio.Event()
                watcher.run(f"{root}-far", parent_run_id=root, root_run_id=root)  # the tree's run elsewhere
                run = spawner.run(root, local_rules=False)
                for level in range(6):
                    child = f"{root}-l{level + 1}"
                    await run.call("Task", lambda **_: "started", {"level": level},
                                   spawn=Spawn(child_run_id=child, child_agent_id="explorer", task=f"level {level}"))
                    run = run.child(child, local_rules=False)
                await asyncio.wait_for(waiting[root].wait(), 30)
                latencies.append(arrived[root])
                await asyncio.sleep(0.2)
            for n in range(threads):
                thread = f"{deployment.name}-thread-{n}"
                waiting[thread] = asyncio.Event()
                watcher.run(f"{thread}-far", tenant="acme", thread_key=thread, trigger="user")
                cause = None
                for generation in range(4):  # generation 3's first event is the self_trigger
                    run_id = f"{thread}-g{generation}"
                    run = spawner.run(run_id, tenant="acme", thread_key=thread, local_rules=False,
                                      trigger="user" if cause is None else "webhook", caused_by_run_id=cause)
                    await run.call("post_comment", lambda **_: "posted", {"generation": generation})
                    cause = run_id
                await asyncio.wait_for(waiting[thread].wait(), 30)
                thread_latencies.append(arrived[thread])
                await asyncio.sleep(0.2)
    finally:
        deployment.stop()
    out: dict[str, Any] = {}
    for label, values in (("trees", latencies), ("threads", thread_latencies)):
        cuts = statistics.quantiles(values, n=100)
        progress(f"treehalt: {len(values)} {label}, p50 {cuts[49]:.0f} ms, p95 {cuts[94]:.0f} ms, "
                 f"max {max(values):.0f} ms")
        out[label] = {"count": len(values), "latencies_ms": values, "p50_ms": cuts[49], "p95_ms": cuts[94],
                      "max_ms": max(values)}
    # the tree figures at the top level, as before
    return {"trees": len(latencies), "latencies_ms": latencies, "p50_ms": out["trees"]["p50_ms"],
            "p95_ms": out["trees"]["p95_ms"], "max_ms": out["trees"]["max_ms"], "threads": out["threads"]}


class _Unavailable(Exception):
    """The bench's degraded upstream: an HTTP 503."""

    status_code = 503


async def storm_pause_section(bootstrap: str, plan: Plan, sustained: float | None, storms: int = 30,
                              level: float = 0.1) -> dict[str, Any]:
    """How soon a storm's pause reaches a runtime, at ``level`` (10%) of one worker's sustained rate of
    background telemetry (the fleet as the SDK sends it, every call naming its upstream): per storm, ten
    runs (one runtime, fleet path only: no local rules, telemetry sent at once) fail once each on a fresh
    tool key; a second runtime watches. Latency: from the end of the 10th run's failing call (the pause's
    ``ts_ms``: the fact that crossed) to the watcher's board applying the pause."""
    template = WORKDIR / "corpus-trees.tsv"
    if not template.exists():
        corpus.write_tree_template(template, plan.template_runs, max(8, plan.template_runs // 100))
    load = level * (sustained or 1000.0)
    deployment = BenchDeployment(bootstrap, WORKDIR)
    latencies: list[float] = []
    gen = None
    try:
        await deployment.start_worker_async()
        await fleet.warm_up(deployment, template, "sw")
        config = KafkaClientConfig(bootstrap)
        common: dict[str, Any] = {"trusted_keys": deployment.trusted_keys(), "scopes_topic": deployment.scopes_topic}
        failing = Guard.fleet(config, deployment.telemetry_topic, deployment.control_topic, local_rules=False,
                              linger_ms=0, **common)
        watcher = Guard.fleet(config, deployment.telemetry_topic, deployment.control_topic, **common)
        arrived: dict[str, float] = {}
        waiting: dict[str, asyncio.Event] = {}

        def applied(decision: dict[str, Any]) -> None:
            tenant = decision.get("tenant")
            if decision.get("scope") == "tool" and decision["action"] == "pause" and tenant in waiting:
                arrived[tenant] = time.time() * 1000 - decision["ts_ms"]
                waiting[tenant].set()

        def broken(**_: Any) -> None:
            raise _Unavailable("503 Service Unavailable")

        watcher.board.add_callback(applied)
        gen = LoadGen(bootstrap, deployment.telemetry_topic, template, load, storms * 2.0 + 30, "sb")
        await gen.prepare()
        await gen.go()
        async with failing, watcher:
            for n in range(storms):
                tenant = f"{deployment.name}-storm-{n}"
                waiting[tenant] = asyncio.Event()
                for r in range(10):
                    with contextlib.suppress(_Unavailable):
                        await failing.run(f"{tenant}-run-{r}", tenant=tenant, local_rules=False).call(
                            "weather.lookup", broken, {"city": f"c{r}"}, upstream="api.weather.example")
                await asyncio.wait_for(waiting[tenant].wait(), 30)
                latencies.append(arrived[tenant])
                await asyncio.sleep(0.5)
    finally:
        if gen is not None:
            await gen.kill()
        deployment.stop()
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    progress(f"stormpause: {len(latencies)} storms at {load:,.0f} ev/s of background: p50 {cuts[49]:.0f} ms, "
             f"p95 {cuts[94]:.0f} ms, max {max(latencies):.0f} ms")
    return {"storms": len(latencies), "level": level, "background_per_s": load, "latencies_ms": latencies,
            "p50_ms": cuts[49], "p95_ms": cuts[94], "max_ms": max(latencies)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short phases, to try the harness")
    parser.add_argument("--skip-core", action="store_true", help="do not run bench.core")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"Kafka sections (default: {','.join(SECTIONS)})")
    args = parser.parse_args(argv)
    sections = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = sections - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    plan = QUICK if args.quick else Plan()
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # a fresh broker's first group join is noisy
    began = time.monotonic()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "machine.json").write_text(json.dumps(report.machine(), indent=1) + "\n")
    if not args.skip_core:
        run_core(RESULTS)
    if sections:
        template = WORKDIR / "corpus.tsv"
        progress(f"corpus: {plan.template_runs:,} simulated runs (stream_app.devtools.fleet_sim) -> {template}")
        events = corpus.write_template(template, plan.template_runs)
        corpus.check_renamed(corpus.read_template(template)[:1])
        with broker() as (bootstrap, version):
            progress(f"broker: Apache Kafka {version} at {bootstrap}")
            machine = json.loads((RESULTS / "machine.json").read_text())
            machine |= {"kafka": version, "sections": sorted(sections), "corpus_events": events,
                        "corpus_mean_bytes": corpus.mean_size(corpus.read_template(template)),
                        "plan": "quick" if args.quick else "full"}
            (RESULTS / "machine.json").write_text(json.dumps(machine, indent=1) + "\n")
            asyncio.run(kafka_benches(bootstrap, plan, sections, RESULTS, template))
    elapsed = time.monotonic() - began
    machine = json.loads((RESULTS / "machine.json").read_text()) | {"elapsed_s": elapsed,
                                                                     "load_at_end": os.getloadavg()[0]}
    (RESULTS / "machine.json").write_text(json.dumps(machine, indent=1) + "\n")
    report.write(RESULTS, REPO / "BENCHMARKS.md")
    progress(f"done in {elapsed / 60:.1f} min: BENCHMARKS.md and bench/results/*.png written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
