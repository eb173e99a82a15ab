"""What one batch costs a worker whatever its size: worker CPU and batches per second at a few open-loop
rates, with the rules across runs on (as shipped) and off. Not part of ``make bench`` (~4 min):

    python -m bench.cycle [--rates 1000,8000,26000] [--rounds 2]
    python -m bench.cycle --trace [--rates 1000,22000]

Where a worker's time goes at partial load (issue 15's halt latency at 50% load): a worker runs a cycle
per fetch (fetch, fold, publish, commit bookkeeping) as soon as records arrive, so below saturation the
number of cycles per second barely moves with the rate and each costs a fixed part (aiokafka's fetch
and produce requests in Python, the event loop, the per-batch work of the batch path) plus a part per
event. Printed per rate: worker cores (user + system, all threads, from /proc), batches per second,
events per batch, and CPU per batch; the fixed part is the intercept of CPU per batch against events per
batch (the least-squares line over the rates, per configuration). Needs a broker
(``KAFKA_BOOTSTRAP_SERVERS``, else a local one is started).

``--trace``: one worker as shipped, its event loop traced (``bench.looptrace``), and at each rate the kinds of
loop steps that took the most time: calls per second, milliseconds per second and microseconds per call
(a step of the agent is a batch; aiokafka's fetch and produce requests, its fetcher waking up, faust's drain
loop, the timers are the cycle's fixed part).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from stream_app.devtools.harness import metric_total

from . import corpus, fleet, looptrace
from .kafka import broker
from .stats import progress
from .workers import REPO, BenchDeployment

WORKDIR = REPO / "var" / "bench"  # as make bench's

#: Seconds of load before measuring (the load generator's ramp, the worker's first batches), and measured.
SETTLE_S = 2.0
MEASURE_S = 6.0
CONFIGS: tuple[tuple[str, dict[str, object]], ...] = (("every fold", {}), ("per-run rules only",
                                                                          {"fleet_rules": False}))


async def probe(bootstrap: str, template: Path, settings: dict[str, object], rates: list[float],
                tag: str) -> list[tuple[float, float, float]]:
    """(rate, worker cores, batches per second) at each rate, on one fresh worker."""
    deployment = BenchDeployment(bootstrap, WORKDIR, settings=dict(settings))
    await deployment.start_worker_async()
    out = []
    try:
        await fleet.warm_up(deployment, template, f"{tag}w")
        worker = deployment.workers[0]
        for rate in rates:
            load = asyncio.create_task(fleet.run_load(deployment, template, rate, SETTLE_S + MEASURE_S + 2.0,
                                                      f"{tag}{int(rate)}", drain_timeout_s=30.0))
            await asyncio.sleep(SETTLE_S)
            before, cpu0, t0 = (await deployment.scrape_async())[0], worker.cpu_s(), time.monotonic()
            await asyncio.sleep(MEASURE_S)
            after, cpu1, t1 = (await deployment.scrape_async())[0], worker.cpu_s(), time.monotonic()
            await load
            batches = metric_total(after, "loopwarden_batch_events_count") - metric_total(
                before, "loopwarden_batch_events_count")
            out.append((rate, (cpu1 - cpu0) / (t1 - t0), batches / (t1 - t0)))
    finally:
        deployment.stop()
    return out


async def trace(bootstrap: str, template: Path, rates: list[float], top: int) -> None:
    """Print, per rate, the kinds of event loop steps a worker as shipped spent the most time in."""
    path = WORKDIR / "looptrace.json"
    path.unlink(missing_ok=True)
    deployment = BenchDeployment(bootstrap, WORKDIR, env=looptrace.worker_env(path))
    await deployment.start_worker_async()
    try:
        await fleet.warm_up(deployment, template, "tw")
        worker = deployment.workers[0]
        for rate in rates:
            progress(f"cycle: traced worker at {rate:,.0f} events/s")
            load = asyncio.create_task(fleet.run_load(deployment, template, rate, SETTLE_S + MEASURE_S + 2.0,
                                                      f"t{int(rate)}", drain_timeout_s=30.0))
            await asyncio.sleep(SETTLE_S)
            before, cpu0, t0 = looptrace.read(path), worker.cpu_s(), time.monotonic()
            batches0 = metric_total((await deployment.scrape_async())[0], "loopwarden_batch_events_count")
            await asyncio.sleep(MEASURE_S)
            after, cpu1, t1 = looptrace.read(path), worker.cpu_s(), time.monotonic()
            batches1 = metric_total((await deployment.scrape_async())[0], "loopwarden_batch_events_count")
            await load
            steps = looptrace.rates(before, after)
            busy = sum(seconds for _, seconds in steps.values())
            print(f"\n{rate:,.0f} events/s: worker {(cpu1 - cpu0) / (t1 - t0):.3f} cores, "
                  f"{(batches1 - batches0) / (t1 - t0):,.0f} batches/s; event loop steps "
                  f"{sum(calls for calls, _ in steps.values()):,.0f}/s taking {busy * 1000:,.0f} ms/s\n")
            print("| loop step (where it began) | calls/s | ms/s | us/call |")
            print("|---|---|---|---|")
            for key, (calls, seconds) in sorted(steps.items(), key=lambda item: -item[1][1])[:top]:
                print(f"| `{key}` | {calls:,.0f} | {seconds * 1000:.1f} | {seconds / calls * 1e6:,.0f} |")
            long = looptrace.stalls(path, before[0], after[0])
            print(f"\nlong steps (>= {looptrace.STALL_S * 1000:g} ms) and collections (>= "
                  f"{looptrace.GC_STALL_S * 1000:g} ms) over {after[0] - before[0]:.1f} s\n")
            print("| kind | count | longest ms | their ms |")
            print("|---|---|---|---|")
            for key, values in sorted(long.items(), key=lambda item: -sum(item[1]))[:top]:
                print(f"| `{key}` | {len(values)} | {', '.join(f'{v * 1000:.1f}' for v in values[:5])} | "
                      f"{sum(values) * 1000:.0f} |")
    finally:
        deployment.stop()


def _intercept(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through ``points``."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    return my - slope * mx, slope


async def run(rates: list[float], rounds: int) -> None:
    template = WORKDIR / "corpus.tsv"
    if not template.exists():
        corpus.write_template(template, 10_000)
    with broker() as (bootstrap, _):
        results: dict[str, list[tuple[float, float, float]]] = {label: [] for label, _ in CONFIGS}
        for number in range(rounds):
            order = CONFIGS if number % 2 == 0 else tuple(reversed(CONFIGS))
            for label, settings in order:
                progress(f"cycle: round {number + 1}/{rounds}, {label}")
                results[label] += await probe(bootstrap, template, settings, rates, f"c{number}{len(label)}")
    print("| configuration | events/s | worker cores | batches/s | events per batch | CPU per batch |")
    print("|---|---|---|---|---|---|")
    for label, rows in results.items():
        points = []
        for rate, cores, batches in rows:
            per_batch_ms = cores / batches * 1000 if batches else float("nan")
            points.append((rate / batches if batches else 0.0, per_batch_ms))
            print(f"| {label} | {rate:,.0f} | {cores:.3f} | {batches:,.0f} | {rate / max(batches, 1e-9):,.1f} | "
                  f"{per_batch_ms:.2f} ms |")
        fixed, per_event = _intercept(points)
        print(f"\n{label}: CPU per batch = {fixed:.2f} ms + {per_event * 1000:.1f} us x events per batch "
              f"(least squares over {len(points)} probes)\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cycle", description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1000,8000,26000", help="open-loop rates, events/s (comma-separated)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of both configurations")
    parser.add_argument("--trace", action="store_true", help="trace one worker's event loop at each rate instead")
    parser.add_argument("--top", type=int, default=15, help="with --trace: the kinds of loop steps printed")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    if args.trace:
        asyncio.run(_traced(rates, args.top))
    else:
        asyncio.run(run(rates, args.rounds))
    return 0


async def _traced(rates: list[float], top: int) -> None:
    template = WORKDIR / "corpus.tsv"
    if not template.exists():
        corpus.write_template(template, 10_000)
    with broker() as (bootstrap, _):
        await trace(bootstrap, template, rates, top)


if __name__ == "__main__":
    raise SystemExit(main())
