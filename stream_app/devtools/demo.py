"""``loopwarden demo``: a simulated fleet of agents, guarded through the SDK, watched by a real worker.

This is what ``make run`` shows. It starts a worker process on the Kafka at KAFKA_BOOTSTRAP_SERVERS
(topics and state of its own, so demos never mix), then runs agent runs concurrently through
``Guard.fleet``: healthy runs, legitimate retries against a flaky tool, runaway loops, argument-mutating
loops, edit/patch cycles, polling and duplicate e-mails, a sub-agent tree whose explorer agents
keep delegating deeper, and a storm: the weather API every forecaster calls answers 503 for a while.
Runaways keep calling (and spawning) until the guard refuses; forecasters wait when the tool is paused.
It ends with a table: calls, halts by verdict, false halts, how many calls each runaway made after the
call that triggered its halt (the overshoot: 0, since the guard folds its runs' per-run rules itself)
and the side effects performed (a duplicate e-mail is one too many), then where the decisions were made
and how long the fleet's confirmations took. Exit status 1 if anything was halted that should not have
been, a runaway was never stopped, a side effect was repeated, the runaway tree was not halted once, or
the storm was not one incident (one pause, then a resume, no forecaster halted).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..client import Guard, GuardedRun, KafkaClientConfig, RunHalted, Spawn, ToolPaused, TreeHalted
from .harness import Deployment, WorkerStartError
from .scenarios import DEMO_MIX, Scenario, kinds


@dataclass
class RunRecord:
    """One simulated run of the demo: its kind, the halt it must get, and what happened."""

    scenario: str
    expected: str | None
    run: GuardedRun | None = None
    verdict: str | None = None
    overshoot: int | None = None
    #: Side effects the run's tools performed (e-mails sent).
    side_effects: int = 0

    @property
    def calls(self) -> int:
        return self.run.calls if self.run is not None else 0


class ThinkingRun:
    """A guarded run whose agent takes a model turn (50-150 ms, a fast model) before every tool call."""

    def __init__(self, run: GuardedRun, rng: random.Random, record: RunRecord) -> None:
        self.run = run
        self.rng = rng
        self.record = record

    async def call(self, tool: str, fn: Callable[..., Any], /, args: dict[str, Any], **options: Any) -> Any:
        await asyncio.sleep(self.rng.uniform(0.05, 0.15))
        return await self.run.call(tool, fn, args, **options)

    def effect(self) -> None:
        self.record.side_effects += 1


async def _agent(guard: Guard, scenario: Scenario, run_id: str, seed: int, record: RunRecord) -> None:
    rng = random.Random(seed)
    run = record.run = guard.run(run_id, agent_id=scenario.agent_id)
    await asyncio.sleep(rng.uniform(0, 1.0))  # agents start staggered, like a real fleet
    try:
        await scenario.agent(ThinkingRun(run, rng, record), rng)
    except RunHalted as halted:
        record.verdict = halted.verdict
        trigger_seq = halted.decision.get("evidence", {}).get("seq")
        if trigger_seq is not None:
            record.overshoot = run.calls - (trigger_seq + 1)


@dataclass
class TreeRecord:
    """The demo's runaway sub-agent tree: explorers that each delegate one level deeper."""

    root_run_id: str
    runs: int = 0
    depth: int = 0
    verdict: str | None = None
    #: Calls and children the guard refused once the tree was halted.
    refused: int = 0


async def _runaway_tree(guard: Guard, record: TreeRecord, rng: random.Random) -> None:
    """An explorer searches, then delegates "explore deeper" to a new explorer, which does the same
    (Claude Code's sub-agents nesting 50+ levels). The guard halts the tree at the spawn that would start
    a run deeper than max_tree_depth; every run of it is refused from then on, and so is a new child."""

    def search(q: str) -> str:
        return f"3 files match {q!r}"

    def delegate(prompt: str) -> str:
        return "sub-agent started"

    runs = [guard.run(record.root_run_id, agent_id="explorer")]
    record.runs = 1
    try:
        for level in range(50):
            run = runs[-1]
            await asyncio.sleep(rng.uniform(0.05, 0.15))  # the explorer's model turn
            await run.call("search_code", search, {"q": f"handlers, level {level}"})
            child_id = f"{record.root_run_id}-l{level + 1}"
            task = f"explore the handlers one level deeper than level {level}"
            await run.call("Task", delegate, {"prompt": task},
                           spawn=Spawn(child_run_id=child_id, child_agent_id="explorer", task=task))
            runs.append(run.child(child_id, agent_id="explorer"))
            record.runs += 1
            record.depth = runs[-1].depth
    except TreeHalted as halted:
        record.verdict = halted.verdict
    for run in runs:  # every run of the halted tree is refused, the deepest one's next child too
        try:
            await run.call("search_code", search, {"q": "one more look"})
        except TreeHalted:
            record.refused += 1
    try:
        runs[-1].child(f"{record.root_run_id}-late", agent_id="explorer")
    except TreeHalted:
        record.refused += 1


class Upstream503(Exception):
    """What the demo's weather API raises while it is degraded: an HTTP 503 asking for a wait."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__("503 Service Unavailable")
        self.status_code = 503
        self.retry_after = retry_after_s


@dataclass
class StormRecord:
    """The demo's storm: forecasters calling one weather API that degrades, then recovers."""

    tool: str
    upstream: str
    #: Seconds after the start the API degrades and recovers (monotonic clock, set by the storm).
    degraded_from: float = 0.0
    degraded_to: float = 0.0
    #: Calls that reached the API: answered, failed; calls the guard refused while paused.
    answered: int = 0
    failed: int = 0
    refused: int = 0
    #: Forecasters the per-run rules halted (none should be: a storm is not a loop).
    halted: int = 0
    #: (seconds after the degradation, action, rule) of each tool decision the guard applied.
    decisions: list[tuple[float, str, str]] | None = None


async def _storm(guard: Guard, record: StormRecord, runs: int, tenant: str, rng: random.Random) -> None:
    """``runs`` forecasters look up the weather for their cities every few hundred ms; two seconds in, the
    API answers 503 (Retry-After 1 s) for six seconds. Ten runs failing in the same minute make it a
    storm: the guard pauses the tool for the tenant (one incident, not a halt per run), each forecaster
    waits what ``ToolPaused`` says, one call per wait goes through, and the first success resumes it."""
    start = time.monotonic()
    record.degraded_from, record.degraded_to = start + 2.0, start + 8.0

    def lookup(city: str) -> str:
        now = time.monotonic()
        if record.degraded_from <= now < record.degraded_to:
            record.failed += 1
            raise Upstream503(1.0)
        record.answered += 1
        return f"{city}: sunny"

    async def forecaster(n: int) -> None:
        run = guard.run(f"{record.tool}-forecaster-{n:02d}", agent_id="forecaster", tenant=tenant)
        cities = [f"city-{n}-{i}" for i in range(40)]
        try:
            for city in cities:
                await asyncio.sleep(rng.uniform(0.2, 0.4))  # the forecaster's model turn
                while time.monotonic() < start + 20.0:
                    try:
                        await run.call(record.tool, lookup, {"city": city}, upstream=record.upstream)
                        break
                    except ToolPaused as paused:
                        record.refused += 1
                        await asyncio.sleep(paused.retry_after_s)
                    except Upstream503:
                        await asyncio.sleep(rng.uniform(0.1, 0.3))  # the agent retries
                if time.monotonic() > start + 12.0:
                    return
        except RunHalted:
            record.halted += 1

    await asyncio.gather(*(forecaster(n) for n in range(runs)))


def _progress(records: list[RunRecord], started: float, done: int) -> str:
    halted = Counter(o.verdict for o in records if o.verdict)
    verdicts = ", ".join(f"{v} {n}" for v, n in sorted(halted.items())) or "none yet"
    return (f"[{time.monotonic() - started:5.1f}s] runs {len(records)} ({len(records) - done} active) | "
            f"calls {sum(o.calls for o in records)} | halted {sum(halted.values())}: {verdicts}")


def summary_table(records: list[RunRecord]) -> tuple[str, int, int]:
    """The closing table, the number of false halts and the number of missed runaways."""
    header = ("scenario", "runs", "calls", "halted", "verdicts", "false halts", "missed", "overshoot p50/max",
              "side effects (extra)")
    rows = []
    false_total = missed_total = 0
    for scenario, _ in DEMO_MIX:
        mine = [o for o in records if o.scenario == scenario]
        if not mine:
            continue
        verdicts = Counter(o.verdict for o in mine if o.verdict)
        false_halts = sum(1 for o in mine if o.verdict and o.verdict != o.expected)
        missed = sum(1 for o in mine if o.expected and not o.verdict)
        over = [o.overshoot for o in mine if o.overshoot is not None]
        false_total += false_halts
        missed_total += missed
        effects = sum(o.side_effects for o in mine)
        extra = sum(o.side_effects - 1 for o in mine if o.side_effects > 1)  # each run means to act once
        rows.append((scenario, str(len(mine)), str(sum(o.calls for o in mine)), str(sum(verdicts.values())),
                     ", ".join(f"{v} {n}" for v, n in sorted(verdicts.items())) or "-", str(false_halts),
                     str(missed), f"{statistics.median(over):g} / {max(over)}" if over else "-",
                     f"{effects} ({extra})" if effects else "-"))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines), false_total, missed_total


async def run_demo(bootstrap: str, runs: int, partitions: int, seed: int, workdir: Path) -> int:
    deployment = Deployment(bootstrap, workdir, partitions, name=f"demo-{uuid.uuid4().hex[:8]}")
    name = deployment.name
    print(f"loopwarden demo: starting a worker on {bootstrap} (topics {name}.*) ...", file=sys.stderr, flush=True)
    try:
        try:
            await deployment.start_worker_async()
        except WorkerStartError as exc:
            raise SystemExit(f"loopwarden demo: {exc}") from exc
        rng = random.Random(seed)
        population, weights = kinds(DEMO_MIX)
        plan = list(population)  # every scenario at least once
        plan += rng.choices(population, weights, k=max(0, runs - len(plan)))
        records = [RunRecord(scenario.name, scenario.expected_halt) for scenario in plan]
        config = KafkaClientConfig.from_env({**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap})
        confirmed_ms: list[float] = []
        tree = TreeRecord(f"{name}-tree")
        tree_confirmed: list[str] = []
        storm = StormRecord("weather.lookup", "api.weather.demo", decisions=[])
        storm_confirmed: list[str] = []
        async with Guard.fleet(config, deployment.telemetry_topic, deployment.control_topic,
                               trusted_keys=deployment.trusted_keys(), scopes_topic=deployment.scopes_topic) as guard:
            guard.board.add_confirmation_callback(
                lambda d: confirmed_ms.append(time.time() * 1000 - d["ts_ms"]) if d["action"] == "halt" else None)
            guard.board.add_confirmation_callback(
                lambda d: tree_confirmed.append(d["verdict"]) if d.get("scope") == "tree" else None)
            guard.board.add_confirmation_callback(
                lambda d: storm_confirmed.append(d["action"]) if d.get("scope") == "tool" else None)

            def on_tool(d: dict[str, Any]) -> None:
                if d.get("scope") == "tool" and storm.decisions is not None:
                    storm.decisions.append((time.monotonic() - storm.degraded_from, d["action"],
                                            d["evidence"].get("rule", "")))

            guard.on_decision(on_tool)
            print(f"loopwarden demo: {len(plan)} agent runs calling tools ...", file=sys.stderr, flush=True)
            started = time.monotonic()
            tasks = [
                asyncio.create_task(_agent(guard, scenario, f"{name}-run-{i:03d}", seed * 1000 + i, records[i]))
                for i, scenario in enumerate(plan)
            ]
            tasks.append(asyncio.create_task(_runaway_tree(guard, tree, random.Random(seed))))
            tasks.append(asyncio.create_task(_storm(guard, storm, 12, name, random.Random(seed + 1))))
            try:
                while True:
                    done = sum(task.done() for task in tasks[:len(records)])  # the runs' agents (then the tree)
                    print(_progress(records, started, done), file=sys.stderr, flush=True)
                    if all(task.done() for task in tasks):
                        break
                    await asyncio.wait(tasks, timeout=1.0)
            finally:
                # On Ctrl-C the agents stop before the guard they call through does.
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            for task in tasks:
                task.result()  # surface a crashed agent instead of a wrong table
            for _ in range(50):  # the fleet's copies of the tree halt and the storm's pause (a second at most)
                if (tree_confirmed or tree.verdict is None) and (storm_confirmed or not storm.decisions):
                    break
                await asyncio.sleep(0.1)
        table, false_halts, missed = summary_table(records)
        print()
        print(table)
        print()
        extra = sum(o.side_effects - 1 for o in records if o.side_effects > 1)
        print(f"{sum(o.calls for o in records)} calls in {len(records)} runs; false halts: {false_halts}; "
              f"runaways not stopped: {missed}; duplicate side effects: {extra}. Overshoot = calls a runaway made "
              "after the call that triggered its halt, before the guard refused.")
        counters = guard.counters
        print(f"decisions made in the runtime by its local rules (in force before the next call): "
              f"{counters['local']}; the fleet's copies confirmed {counters['confirmed']} of them (same decision "
              f"ids, applied once); decisions only the fleet made: {counters['fleet_only']}.")
        tree_halted = tree.verdict is not None
        print(f"sub-agent tree {tree.root_run_id}: {tree.runs} explorer runs, {tree.depth} levels deep, then halted "
              f"({tree.verdict}); {tree.refused} calls and children refused after it; the fleet's tree fold "
              f"{'confirmed it' if tree_confirmed else 'did not confirm it (yet)'}." if tree_halted else
              f"sub-agent tree {tree.root_run_id}: NOT halted after {tree.runs} runs, {tree.depth} levels deep")
        assert storm.decisions is not None
        incidents = [t for t, action, rule in storm.decisions if action == "pause" and rule == "storm"]
        resumed = [t for t, action, _ in storm.decisions if action == "resume"]
        storm_ok = len(incidents) == 1 and bool(resumed) and storm.halted == 0
        print(f"tool storm on {storm.tool} of {storm.upstream}: {storm.failed} calls failed (503) from the "
              f"forecasters; {len(incidents)} incident{'s' if len(incidents) != 1 else ''}: "
              + (f"paused {incidents[0]:.1f} s after the API degraded, {storm.refused} calls refused while paused "
                 f"(they never reached the API), "
                 + (f"resumed {resumed[-1] - (storm.degraded_to - storm.degraded_from):.1f} s after it recovered"
                    if resumed else "NOT resumed") if incidents else "never paused")
              + f"; forecasters halted: {storm.halted}; the fleet's tool fold "
              + ("confirmed it." if storm_confirmed else "did not confirm it (yet)."))
        if confirmed_ms:
            cuts = statistics.quantiles(confirmed_ms, n=100, method="inclusive") if len(confirmed_ms) > 1 \
                else confirmed_ms * 99
            print(f"fleet path latency, end of the triggering call to the fleet's copy of the halt at the runtime: "
                  f"p50 {cuts[49]:.0f} ms, p95 {cuts[94]:.0f} ms, max {max(confirmed_ms):.0f} ms")
        return 1 if false_halts or missed or extra or not tree_halted or not storm_ok else 0
    finally:
        deployment.stop()
        shutil.rmtree(deployment.root, ignore_errors=True)


def main(bootstrap: str | None, runs: int, partitions: int, seed: int) -> int:
    if not bootstrap:
        print("loopwarden demo: set KAFKA_BOOTSTRAP_SERVERS (make run starts a local broker for you)",
              file=sys.stderr)
        return 2
    config = KafkaClientConfig.from_env({**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap})
    asyncio.run(config.check_connection())  # KafkaUnreachable: one line, from the CLI
    try:
        return asyncio.run(run_demo(bootstrap, runs, partitions, seed, Path("var/demo")))
    except KeyboardInterrupt:
        print("\nloopwarden demo: interrupted; worker stopped.", file=sys.stderr)
        return 130
