"""``loopwarden demo``: a simulated fleet of agents, guarded through the SDK, watched by a real worker.

This is what ``make run`` shows. It starts a worker process on the Kafka at KAFKA_BOOTSTRAP_SERVERS
(topics and state of its own, so demos never mix), then runs agent runs concurrently through
``Guard.fleet``: healthy runs, legitimate retries against a flaky tool, runaway loops, argument-mutating
loops, edit/patch cycles, polling and duplicate e-mails. Runaways keep calling until the guard refuses.
It ends with a table: calls, halts by verdict, false halts, and how many calls each runaway made after
the call that triggered its halt (the overshoot). Exit status 1 if anything was halted that should not
have been, or a runaway was never stopped.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .client import Guard, GuardedRun, KafkaClientConfig, RunHalted
from .signing import KeyRing, ensure_pairs

MAX_CALLS = 200  # a runaway the fleet never stops gives up here, and is reported as missed


class ToolFailed(Exception):
    """What the simulated tools raise."""


@dataclass
class Outcome:
    scenario: str
    expected: str | None
    run: GuardedRun | None = None
    verdict: str | None = None
    overshoot: int | None = None

    @property
    def calls(self) -> int:
        return self.run.calls if self.run is not None else 0


@dataclass
class Scene:
    """A scenario: how an agent of this kind behaves, and the halt it must (or must not) get."""

    name: str
    expected: str | None
    behave: Callable[[ThinkingRun, random.Random], Awaitable[None]]
    share: int


async def _latency(rng: random.Random) -> None:
    await asyncio.sleep(rng.uniform(0.02, 0.08))


class ThinkingRun:
    """A guarded run whose agent takes a model turn (50-150 ms, a fast model) before every tool call."""

    def __init__(self, run: GuardedRun, rng: random.Random) -> None:
        self.run = run
        self.rng = rng

    async def call(self, tool: str, fn: Callable[..., Any], /, args: dict[str, Any], **options: Any) -> Any:
        await asyncio.sleep(self.rng.uniform(0.05, 0.15))
        return await self.run.call(tool, fn, args, **options)


async def healthy(run: ThinkingRun, rng: random.Random) -> None:
    async def search(query: str) -> dict[str, Any]:
        await _latency(rng)
        return {"hits": rng.randrange(1, 40), "query": query}

    for step in range(12):
        await run.call("search_docs", search, {"query": f"topic {step} {rng.randrange(10**6)}"}, plan_step=step)


async def flaky_retry(run: ThinkingRun, rng: random.Random) -> None:
    failures = iter(range(4))

    async def fetch_invoice(invoice: str, attempt: int) -> dict[str, Any]:
        await _latency(rng)
        if next(failures, None) is not None:
            raise ToolFailed("503 Service Unavailable")
        return {"invoice": invoice, "total": 120}

    invoice = f"INV-{rng.randrange(10**5)}"
    for attempt in range(6):
        try:
            await run.call("fetch_invoice", fetch_invoice, {"invoice": invoice, "attempt": attempt}, retry_budget=5)
            break
        except ToolFailed:
            continue


async def runaway(run: ThinkingRun, rng: random.Random) -> None:
    async def search(query: str) -> dict[str, Any]:
        await _latency(rng)
        raise ToolFailed("index unavailable")

    query = f"quarterly report {rng.randrange(10**4)}"
    for _ in range(MAX_CALLS):
        try:
            await run.call("search_docs", search, {"query": query})
        except ToolFailed:
            continue


async def mutating_loop(run: ThinkingRun, rng: random.Random) -> None:
    async def search(query: str, attempt: int, client_state: str) -> dict[str, Any]:
        await _latency(rng)
        raise ToolFailed("429 rate limited")

    for attempt in range(MAX_CALLS):
        args = {"query": "refund policy", "attempt": attempt, "client_state": f"{rng.getrandbits(64):016x}"}
        try:
            await run.call("search_docs", search, args)
        except ToolFailed:
            continue


async def edit_cycle(run: ThinkingRun, rng: random.Random) -> None:
    async def read_file(path: str) -> str:
        await _latency(rng)
        return "def f(): ..."

    async def apply_patch(path: str, patch: str) -> None:
        await _latency(rng)
        raise ToolFailed("hunk 1 failed")

    path = f"/src/module_{rng.randrange(100)}.py"
    for _ in range(MAX_CALLS // 2):
        await run.call("read_file", read_file, {"path": path})
        try:
            await run.call("apply_patch", apply_patch, {"path": path, "patch": "--- a\n+++ b"})
        except ToolFailed:
            continue


async def polling(run: ThinkingRun, rng: random.Random) -> None:
    remaining = iter(range(23))

    async def check_job(job_id: str) -> dict[str, str]:
        await _latency(rng)
        return {"state": "running" if next(remaining, None) is not None else "done"}

    job = f"job-{rng.randrange(10**6)}"
    while (await run.call("check_job", check_job, {"job_id": job}))["state"] != "done":
        pass


async def duplicate_email(run: ThinkingRun, rng: random.Random) -> None:
    sent: list[str] = []

    async def send_email(to: str, subject: str, body: str, request_id: str) -> None:
        await _latency(rng)
        sent.append(to)  # the mail goes out, but the relay times out before it says so
        raise ToolFailed("ETIMEDOUT talking to the mail relay")

    args = {"to": f"customer{rng.randrange(1000)}@example.com", "subject": "Your refund", "body": "Approved."}
    for _ in range(MAX_CALLS):
        try:
            await run.call("send_email", send_email, {**args, "request_id": uuid.uuid4().hex}, side_effect=True)
        except ToolFailed:
            continue


SCENES = (
    Scene("healthy", None, healthy, 30),
    Scene("flaky_retry", None, flaky_retry, 15),
    Scene("polling", None, polling, 8),
    Scene("runaway", "recursion", runaway, 15),
    Scene("mutating_loop", "semantic_loop", mutating_loop, 12),
    Scene("edit_cycle", "cycle", edit_cycle, 8),
    Scene("duplicate_email", "circuit_open", duplicate_email, 12),
)


@dataclass
class Worker:
    """The worker process the demo starts, and where its files go."""

    name: str
    workdir: Path
    process: subprocess.Popen[bytes] | None = None
    metrics_port: int = 0
    env: dict[str, str] = field(default_factory=dict)

    @property
    def topics(self) -> tuple[str, str]:
        return f"{self.name}.telemetry", f"{self.name}.control"

    @property
    def keys(self) -> Path:
        """A development key pair: the worker signs its decisions with it, the agents' guard trusts it."""
        return ensure_pairs(self.workdir / "keys", "worker")

    def start(self, bootstrap: str, partitions: int) -> None:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.metrics_port = sock.getsockname()[1]
        telemetry, control = self.topics
        self.env = {
            **os.environ,
            "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "LOOPWARDEN_APP_ID": self.name,
            "LOOPWARDEN_TELEMETRY_TOPIC": telemetry,
            "LOOPWARDEN_CONTROL_TOPIC": control,
            "LOOPWARDEN_ALERTS_TOPIC": f"{self.name}.alerts",
            "LOOPWARDEN_DLQ_TOPIC": f"{self.name}.dlq",
            "LOOPWARDEN_PARTITIONS": str(partitions),
            "LOOPWARDEN_STATE_DIR": str(self.workdir / "state"),
            "LOOPWARDEN_METRICS_PORT": str(self.metrics_port),
            "LOOPWARDEN_METRICS_HOST": "127.0.0.1",
            "LOOPWARDEN_SIGNING_KEY": str(self.keys / "worker.key"),
        }
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = (self.workdir / "worker.log").open("wb")
        self.process = subprocess.Popen([sys.executable, "-m", "stream_app", "worker"], env=self.env,
                                        stdout=log, stderr=subprocess.STDOUT)

    async def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise SystemExit(f"loopwarden demo: the worker exited; see {self.workdir / 'worker.log'}")
            try:
                text = await asyncio.to_thread(self._scrape)
                if "loopwarden_worker_ready 1.0" in text:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.25)
        raise SystemExit(f"loopwarden demo: worker not ready after {timeout:.0f} s; see {self.workdir}")

    def _scrape(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as response:
            return str(response.read().decode())

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


async def _agent(guard: Guard, scene: Scene, run_id: str, seed: int, outcome: Outcome) -> None:
    rng = random.Random(seed)
    run = outcome.run = guard.run(run_id, agent_id=f"{scene.name.replace('_', '-')}-agent")
    await asyncio.sleep(rng.uniform(0, 1.0))  # agents start staggered, like a real fleet
    try:
        await scene.behave(ThinkingRun(run, rng), rng)
    except RunHalted as halted:
        outcome.verdict = halted.verdict
        trigger_seq = halted.decision.get("evidence", {}).get("seq")
        if trigger_seq is not None:
            outcome.overshoot = run.calls - (trigger_seq + 1)


def _progress(outcomes: list[Outcome], started: float, done: int) -> str:
    halted = Counter(o.verdict for o in outcomes if o.verdict)
    verdicts = ", ".join(f"{v} {n}" for v, n in sorted(halted.items())) or "none yet"
    return (f"[{time.monotonic() - started:5.1f}s] runs {len(outcomes)} ({len(outcomes) - done} active) | "
            f"calls {sum(o.calls for o in outcomes)} | halted {sum(halted.values())}: {verdicts}")


def summary_table(outcomes: list[Outcome]) -> tuple[str, int, int]:
    """The closing table, the number of false halts and the number of missed runaways."""
    header = ("scenario", "runs", "calls", "halted", "verdicts", "false halts", "missed", "overshoot p50/max")
    rows = []
    false_total = missed_total = 0
    for scene in SCENES:
        mine = [o for o in outcomes if o.scenario == scene.name]
        if not mine:
            continue
        verdicts = Counter(o.verdict for o in mine if o.verdict)
        false_halts = sum(1 for o in mine if o.verdict and o.verdict != o.expected)
        missed = sum(1 for o in mine if o.expected and not o.verdict)
        over = [o.overshoot for o in mine if o.overshoot is not None]
        false_total += false_halts
        missed_total += missed
        rows.append((scene.name, str(len(mine)), str(sum(o.calls for o in mine)), str(sum(verdicts.values())),
                     ", ".join(f"{v} {n}" for v, n in sorted(verdicts.items())) or "-", str(false_halts),
                     str(missed), f"{statistics.median(over):g} / {max(over)}" if over else "-"))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines), false_total, missed_total


async def run_demo(bootstrap: str, runs: int, partitions: int, seed: int, workdir: Path) -> int:
    name = f"demo-{uuid.uuid4().hex[:8]}"
    worker = Worker(name, workdir / name)
    print(f"loopwarden demo: starting a worker on {bootstrap} (topics {name}.*) ...", file=sys.stderr, flush=True)
    worker.start(bootstrap, partitions)
    try:
        await worker.wait_ready()
        telemetry, control = worker.topics
        rng = random.Random(seed)
        weights = [scene.share for scene in SCENES]
        plan = [SCENES[i % len(SCENES)] for i in range(len(SCENES))]  # every scenario at least once
        plan += rng.choices(SCENES, weights, k=max(0, runs - len(plan)))
        outcomes = [Outcome(scene.name, scene.expected) for scene in plan]
        config = KafkaClientConfig.from_env({**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap})
        halt_latency_ms: list[float] = []
        trusted = KeyRing.from_paths([worker.keys / "worker.pub"])
        async with Guard.fleet(config, telemetry, control, trusted_keys=trusted) as guard:
            guard.on_decision(lambda d: halt_latency_ms.append(time.time() * 1000 - d["ts_ms"])
                              if d["action"] == "halt" else None)
            print(f"loopwarden demo: {len(plan)} agent runs calling tools ...", file=sys.stderr, flush=True)
            started = time.monotonic()
            tasks = [
                asyncio.create_task(_agent(guard, scene, f"{name}-run-{i:03d}", seed * 1000 + i, outcomes[i]))
                for i, scene in enumerate(plan)
            ]
            try:
                while True:
                    done = sum(task.done() for task in tasks)
                    print(_progress(outcomes, started, done), file=sys.stderr, flush=True)
                    if done == len(tasks):
                        break
                    await asyncio.wait(tasks, timeout=1.0)
            finally:
                # On Ctrl-C the agents stop before the guard they call through does.
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            for task in tasks:
                task.result()  # surface a crashed agent instead of a wrong table
        table, false_halts, missed = summary_table(outcomes)
        print()
        print(table)
        print()
        print(f"{sum(o.calls for o in outcomes)} calls in {len(outcomes)} runs; false halts: {false_halts}; "
              f"runaways not stopped: {missed}. Overshoot = calls a runaway made after the call that "
              "triggered its halt, before the guard refused.")
        if halt_latency_ms:
            cuts = statistics.quantiles(halt_latency_ms, n=100) if len(halt_latency_ms) > 1 else halt_latency_ms * 99
            print(f"halt latency, end of the triggering call to the runtime holding the halt: "
                  f"p50 {cuts[49]:.0f} ms, p95 {cuts[94]:.0f} ms, max {max(halt_latency_ms):.0f} ms")
        return 1 if false_halts or missed else 0
    finally:
        worker.stop()
        shutil.rmtree(worker.workdir, ignore_errors=True)


def main(bootstrap: str | None, runs: int, partitions: int, seed: int) -> int:
    if not bootstrap:
        print("loopwarden demo: set KAFKA_BOOTSTRAP_SERVERS (make run starts a local broker for you)",
              file=sys.stderr)
        return 2
    try:
        return asyncio.run(run_demo(bootstrap, runs, partitions, seed, Path("var/demo")))
    except KeyboardInterrupt:
        print("\nloopwarden demo: interrupted; worker stopped.", file=sys.stderr)
        return 130
