"""Fleet throughput: the highest telemetry rate a group of workers keeps up with, open loop.

Two phases per group size (one worker; two workers in one consumer group):

1. Saturation probe: a backlog is produced as fast as possible, and the rate at which the workers
   apply it once warm, with the producer idle, is their capacity (the backlog is sized to last a
   measurable window, then drained). A single worker is profiled with py-spy meanwhile.
2. Open-loop steps on the same deployment at fractions of that capacity: upwards while they keep up,
   then bisecting; each step drains before the next starts. The highest step that keeps up
   (``Step.judge``) is the sustained rate.

Progress (events applied) and lag come from the workers' Prometheus endpoints, sampled every
``SAMPLE_S``; the backlog is the events the producer had acknowledged minus the events applied.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import profile
from .loadgen import LoadGen
from .stats import progress
from .workers import BenchDeployment

SAMPLE_S = 0.5
#: A step keeps up when, over its second half, the backlog grows by less than this share of the rate...
MAX_BACKLOG_SLOPE = 0.02
#: ...and the backlog when production ends is at most this many seconds of input.
MAX_END_BACKLOG_S = 1.0
#: The producer must have sent this share of the schedule on time, or the step says nothing.
MIN_PRODUCER_SHARE = 0.97
#: Largest backlog a saturation probe builds (memory of the load generator: ~400 B per event).
MAX_BACKLOG = 1_500_000
#: A saturation probe whose backlog lasts a shorter window than this is repeated with a bigger one.
MIN_WINDOW_S = 4.0
#: The workers are stopped (SIGSTOP) while a probe's backlog is produced, this long at a time: well inside
#: the group's session timeout (10 s), so no rebalance follows...
HOLD_MAX_S = 6.0
#: ...then let run this long (their heartbeats reach the group coordinator), and stopped again...
BREATHE_S = 0.3
#: ...until the backlog is produced or this long has passed.
PRODUCE_MAX_S = 180.0


@dataclass
class Sample:
    t: float
    acked: int
    processed: int
    lag: int

    @property
    def backlog(self) -> int:
        return max(0, self.acked - self.processed)


@dataclass
class Step:
    """One open-loop step and its verdict."""

    rate: float
    duration_s: float
    produced_per_s: float = 0.0
    applied_per_s: float = 0.0
    end_backlog: int = 0
    backlog_slope_per_s: float = 0.0
    max_lag: int = 0
    drain_s: float | None = None
    producer_ok: bool = True
    keeps_up: bool = False
    worker_cpu_us_per_event: float | None = None
    #: The load generator's own CPU share over the step (1.0 = one core): near 1.0 it was the limit.
    loadgen_cpu_share: float = 0.0
    samples: list[Sample] = field(default_factory=list)

    def judge(self) -> None:
        """Apply the keeps-up definition (see BENCHMARKS.md)."""
        half = [s for s in self.samples if s.t >= self.duration_s / 2]
        self.backlog_slope_per_s = _slope([(s.t, s.backlog) for s in half]) if len(half) >= 3 else 0.0
        self.keeps_up = (self.producer_ok
                         and self.backlog_slope_per_s <= MAX_BACKLOG_SLOPE * self.rate
                         and self.end_backlog <= MAX_END_BACKLOG_S * self.rate)


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0


async def run_load(deployment: BenchDeployment, template: Path, rate: float, duration_s: float, prefix: str,
                   drain_timeout_s: float = 15.0) -> Step:
    """One open-loop step at ``rate`` for ``duration_s``, then wait (at most ``drain_timeout_s``) for the
    workers to apply everything."""
    step = Step(rate, duration_s)
    gen = LoadGen(deployment.bootstrap, deployment.telemetry_topic, template, rate, duration_s, prefix)
    await gen.prepare()
    base, _ = await deployment.progress()
    cpu0 = sum(w.cpu_s() for w in deployment.workers)
    await gen.go()
    start = time.monotonic()
    while not gen.done:
        await asyncio.sleep(SAMPLE_S)
        processed, lag = await deployment.progress()
        step.samples.append(Sample(time.monotonic() - start, gen.acked, processed - base, lag))
    final = await gen.wait()
    produced_s = time.monotonic() - start
    processed, lag = await deployment.progress()
    step.end_backlog = max(0, final["acked"] - (processed - base))
    step.max_lag = max([s.lag for s in step.samples] + [lag])
    step.produced_per_s = final["acked"] / produced_s
    step.loadgen_cpu_share = final.get("cpu_s", 0.0) / max(final["send_s"], 1e-9)
    step.applied_per_s = (processed - base) / produced_s
    step.producer_ok = (final["failed"] == 0 and final["send_s"] <= duration_s / MIN_PRODUCER_SHARE)
    step.judge()
    deadline = time.monotonic() + drain_timeout_s
    while processed - base < final["acked"] and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        processed, _ = await deployment.progress()
    if processed - base >= final["acked"]:
        step.drain_s = time.monotonic() - start - produced_s
        cpu = sum(w.cpu_s() for w in deployment.workers) - cpu0
        step.worker_cpu_us_per_event = cpu / max(final["acked"], 1) * 1e6
    return step


async def saturate(deployment: BenchDeployment, template: Path, backlog: int, warm_s: float, measure_s: float,
                   prefix: str, profile_to: Path | None = None) -> dict[str, Any]:
    """Produce ``backlog`` events as fast as possible, then measure the apply rate over ``measure_s``
    after ``warm_s`` (or until the backlog runs out), with the producer idle; with ``profile_to``, a
    py-spy summary of worker 0 over the same window.

    The workers are held (SIGSTOP) while the backlog is produced: workers that apply faster than one load
    generator produces would otherwise eat the backlog as it is made (two workers did, 1,500,000 events,
    2026-12-03) and no window would ever have the producer idle. A hold lasts ``HOLD_MAX_S``, then the
    workers run for ``BREATHE_S`` (a heartbeat: the group keeps them) and are held again, until the backlog
    is produced: a single 6 s hold let a slow generator (23,600 events/s, 64 s for 1,500,000) hand the
    two-worker probes a backlog they ate as it was made (one probe measured 0 events/s).
    ``applied_while_produced`` says how much of the backlog the breaths took."""
    gen = LoadGen(deployment.bootstrap, deployment.telemetry_topic, template, backlog * 10.0, 0.1, prefix)
    await gen.prepare()
    base, _ = await deployment.progress()
    pids = [w.process.pid for w in deployment.workers]
    _signal(pids, signal.SIGSTOP)
    breaths = 0
    try:
        await gen.go()
        done = asyncio.ensure_future(gen.wait())
        producing = time.monotonic()
        while True:
            await asyncio.wait([done], timeout=HOLD_MAX_S)
            if done.done() or time.monotonic() - producing > PRODUCE_MAX_S:
                break
            _signal(pids, signal.SIGCONT)
            await asyncio.sleep(BREATHE_S)
            breaths += 1
            _signal(pids, signal.SIGSTOP)
    finally:
        _signal(pids, signal.SIGCONT)
    resumed = time.monotonic()
    final = await done
    applied_while_produced = (await deployment.progress())[0] - base
    await asyncio.sleep(max(0.0, warm_s - (time.monotonic() - resumed)))
    before, _ = await deployment.progress()
    batches0 = _batches(await deployment.scrape_async())
    cpu0 = sum(w.cpu_s() for w in deployment.workers)
    window_start = time.monotonic()
    profiling = None
    if profile_to is not None and profile.available():
        profiling = asyncio.create_task(profile.record(deployment.workers[0].process.pid, measure_s, profile_to))
    after, lag = before, 0
    while time.monotonic() - window_start < measure_s and after - base < final["acked"]:
        await asyncio.sleep(SAMPLE_S / 2)
        after, lag = await deployment.progress()
    elapsed = time.monotonic() - window_start
    cpu = sum(w.cpu_s() for w in deployment.workers) - cpu0
    batches1 = _batches(await deployment.scrape_async())
    result: dict[str, Any] = {
        "mean_batch_events": (batches1[0] - batches0[0]) / max(batches1[1] - batches0[1], 1),
        "backlog": final["acked"],
        "produce_s": final["send_s"],
        "breaths": breaths,
        "applied_while_produced": applied_while_produced,
        "window_s": elapsed,
        "backlog_ran_out": after - base >= final["acked"],
        "applied_per_s": (after - before) / elapsed,
        "worker_cpu_share": cpu / elapsed,
        "worker_cpu_us_per_event": cpu / max(after - before, 1) * 1e6,
        "consumer_lag_metric_at_end": lag,
        "backlog_at_end": final["acked"] - (after - base),
    }
    if profiling is not None:
        try:
            result["profile"] = profile.summarise(await profiling, after - before)
        except RuntimeError as exc:  # e.g. no ptrace permission in a container
            progress(f"  no profile: {exc}")
    return result


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        os.kill(pid, sig)


def _batches(samples: list[dict[str, float]]) -> tuple[float, float]:
    """(events, batches) processed so far, from the ``loopwarden_batch_events`` histogram."""
    return (sum(s.get("loopwarden_batch_events_sum", 0.0) for s in samples),
            sum(s.get("loopwarden_batch_events_count", 0.0) for s in samples))


async def capacity(deployment: BenchDeployment, template: Path, backlog: int, prefix: str,
                   profile_to: Path | None = None, warm_s: float = 3.0, measure_s: float = 8.0,
                   drain: bool = True) -> dict[str, Any]:
    """Saturation probe: ``saturate``, again with a bigger backlog if it ran out before a measurable
    window; with ``drain``, the deployment is let apply the rest, so it can be used again."""
    attempt = 0
    while True:
        result = await saturate(deployment, template, backlog, warm_s, measure_s, f"{prefix}{attempt}", profile_to)
        if drain:
            await deployment.wait_idle(timeout_s=120)
        if result["window_s"] >= min(MIN_WINDOW_S, measure_s) or backlog >= MAX_BACKLOG:
            return result
        if not drain:
            await deployment.wait_idle(timeout_s=120)
        # What ran out is a lower bound of the rate: size the next backlog for twice that.
        backlog = min(MAX_BACKLOG, max(backlog * 2, int(2 * (warm_s + measure_s) * result["applied_per_s"])))
        attempt += 1
        progress(f"  backlog gone after {result['window_s']:.1f} s of measuring; again with {backlog:,} events")


async def warm_up(deployment: BenchDeployment, template: Path, prefix: str) -> None:
    """A few seconds of light load, so that a rebalance after start-up and cold caches are behind us."""
    await run_load(deployment, template, 50.0, 3.0, prefix, drain_timeout_s=30.0)


async def sustained(deployment: BenchDeployment, template: Path, cap: float, fractions: tuple[float, ...],
                    step_s: float, prefix: str, max_steps: int = 3) -> dict[str, Any]:
    """Open-loop steps, ``max_steps`` at most: up through ``fractions`` of ``cap`` while they keep up,
    then bisecting between the highest step that kept up (or zero) and the lowest that did not."""
    steps: list[Step] = []
    upward = iter(fractions)
    passed, failed = 0.0, None
    while len(steps) < max_steps:
        fraction = next(upward, None) if failed is None else (passed + failed) / 2
        if fraction is None:
            break
        rate = max(10.0, round(cap * fraction, -1))
        step = await run_load(deployment, template, rate, step_s, f"{prefix}{len(steps)}")
        steps.append(step)
        verdict = "keeps up" if step.keeps_up else ("producer fell behind" if not step.producer_ok else "falls behind")
        progress(f"  step {rate:,.0f} ev/s for {step_s:.0f} s: applied {step.applied_per_s:,.0f}/s, "
                 f"backlog at end {step.end_backlog:,}, slope {step.backlog_slope_per_s:+,.0f}/s -> {verdict}")
        if step.keeps_up:
            passed = fraction
        else:
            failed = fraction
        if step.drain_s is None:
            await deployment.wait_idle(timeout_s=60)
    kept = [s.rate for s in steps if s.keeps_up]
    return {"sustained_per_s": max(kept) if kept else 0.0,
            "steps": [{k: v for k, v in asdict(s).items() if k != "samples"} | {
                "samples": [asdict(x) for x in s.samples]} for s in steps]}
