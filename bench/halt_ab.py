"""Halt latency of two commits' workers at one fixed rate, interleaved: an A/B of a change to the fleet path.

    python -m bench.halt_ab [--rate 20000] [--rounds 3] [--runs 3] REF_A REF_B

Not part of ``make bench``. Each REF is a commit (checked out as a worktree under ``var/bench/ab``) or ``.``
for this working tree; its worker runs that tree's ``stream_app`` (``PYTHONPATH``, from a directory outside
the repository so the installed package does not win), with this tree's native engine (the one installed:
a change to ``native/`` is not compared, and a warning says so). Per round, each ref in turn (alternating
order, after one uncounted session that warms the broker up) gets a fresh worker, the bench's warm-up, and
``--runs`` runs of ``bench.halt.halt_latency`` (the fleet path: local rules off, linger 0; runaways at 10/s
over the rest of ``--rate``), 8 s each. Printed: each
run, then per ref the percentiles of every halt pooled (``--rounds`` x ``--runs`` x 80) and of its inbound
half. Why pooled and interleaved: this machine's speed moves by a third within an hour and one run's p99 is
nearly its largest sample of 80, so two bench runs an hour apart cannot tell a 20% change from the weather
(2026-12-06: per-run p99s of one commit spread 26-71 ms at one rate).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import time
from pathlib import Path

from . import fleet, halt
from .kafka import broker
from .stats import percentiles, progress
from .workers import REPO, BenchDeployment

WORKDIR = REPO / "var" / "bench"
WORKTREES = WORKDIR / "ab"
SECONDS = 8.0
INJECT_PER_S = 10.0


def tree_of(ref: str, root: Path = REPO, worktrees: Path = WORKTREES) -> Path:
    """The source tree whose worker stands for ``ref``: this one for ``.``, else a worktree at that commit
    (made once, reused while it is at that commit)."""
    if ref == ".":
        return root
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", f"{ref}^{{commit}}"], check=True,
                            capture_output=True, text=True).stdout.strip()
    tree = worktrees / commit[:12]
    if not (tree / "stream_app").is_dir():
        worktrees.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", "-f", str(tree), commit], check=True,
                       capture_output=True)
    return tree


def native_differs(ref: str, root: Path = REPO) -> bool:
    """Whether ``native/`` at ``ref`` differs from this working tree's (then the A/B does not compare it)."""
    if ref == ".":
        return False
    return subprocess.run(["git", "-C", str(root), "diff", "--quiet", ref, "--", "native"]).returncode != 0


def worker_env(tree: Path) -> dict[str, str]:
    """The environment that makes a bench worker run ``tree``'s ``stream_app``."""
    return {"PYTHONPATH": str(tree)}


async def _session(bootstrap: str, template: Path, tree: Path, rate: float, runs: int, tag: str
                   ) -> tuple[list[float], list[float]]:
    deployment = BenchDeployment(bootstrap, WORKDIR, env=worker_env(tree))
    await deployment.start_worker_async()
    latencies: list[float] = []
    inbound: list[float] = []
    try:
        await fleet.warm_up(deployment, template, f"{tag}w")
        await fleet.run_load(deployment, template, 0.1 * rate, 6.0, f"{tag}x", drain_timeout_s=30.0)
        guard = await halt.guard_for(deployment, local_rules=False, linger_ms=0)
        try:
            async with halt.clocked(deployment, guard) as clock:
                for run in range(runs):
                    prefix = f"{tag}r{run}"
                    result = await halt.halt_latency(deployment, guard, clock, template, rate - 4 * INJECT_PER_S,
                                                     INJECT_PER_S, SECONDS, prefix)
                    ids = [run_id for run_id in clock.latency_ms if run_id.startswith(prefix)]
                    latencies += [clock.latency_ms[run_id] for run_id in ids]
                    inbound += clock.inbound_ms(ids)
                    cuts = result.get("latency_ms", {})
                    worker = result["host_cpu"].get("by_role", {}).get("worker", 0.0)
                    loop = result["host_cpu"].get("worker_loop")
                    progress(f"halt_ab: {tag} run {run + 1}/{runs}: p50 {cuts.get('p50', 0):.1f} ms, p99 "
                             f"{cuts.get('p99', 0):.1f} ms, {result['halted']}/{result['injected']} halted, worker "
                             f"{worker:.2f} cores" + (f", its loop running {loop['running']:.2f} and waiting for a "
                                                      f"core {loop['waiting']:.2f}" if loop else ""))
        finally:
            await guard.stop()
    finally:
        deployment.stop()
    return latencies, inbound


def report(pooled: dict[str, tuple[list[float], list[float]]]) -> list[str]:
    """One line per ref: pooled halt latency and inbound percentiles (ms)."""
    lines = []
    for ref, (latencies, inbound) in pooled.items():
        cuts, into = percentiles(latencies), percentiles(inbound)
        lines.append(f"{ref}: {len(latencies)} halts, latency p50 {cuts['p50']:.1f} ms, p95 {cuts['p95']:.1f}, "
                     f"p99 {cuts['p99']:.1f}, max {cuts['max']:.1f}; inbound p50 {into['p50']:.1f}, "
                     f"p99 {into['p99']:.1f}")
    return lines


async def run(refs: list[str], rate: float, rounds: int, runs: int) -> None:
    template = WORKDIR / "corpus.tsv"
    if not template.exists():
        from . import corpus

        corpus.write_template(template, 10_000)
    trees = {ref: tree_of(ref) for ref in refs}
    for ref in refs:
        if native_differs(ref):
            progress(f"halt_ab: native/ at {ref} differs from this tree's; both run the installed engine")
    os.chdir("/")  # python -m stream_app must not find this repository's package first
    pooled: dict[str, tuple[list[float], list[float]]] = {ref: ([], []) for ref in refs}
    with broker() as (bootstrap, _):
        # a broker started a minute ago makes the first session's halts the slowest of all (a JVM warming
        # up): one session first, not counted
        progress("halt_ab: warming the broker up (one session, not counted)")
        await _session(bootstrap, template, trees[refs[0]], rate, 1, f"abw{int(time.time()) % 10_000}")
        for number in range(rounds):
            order = refs if number % 2 == 0 else list(reversed(refs))
            for ref in order:
                latencies, inbound = await _session(bootstrap, template, trees[ref], rate, runs,
                                                    f"ab{number}{refs.index(ref)}{int(time.time()) % 10_000}")
                pooled[ref][0].extend(latencies)
                pooled[ref][1].extend(inbound)
    print("\n".join(report(pooled)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.halt_ab", description=__doc__.splitlines()[0])
    parser.add_argument("refs", nargs=2, help="two commits (or . for this working tree)")
    parser.add_argument("--rate", type=float, default=20_000.0, help="events/s through the worker, runaways included")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3, help="runs of 8 s per ref and round")
    args = parser.parse_args(argv)
    if args.refs[0] == args.refs[1]:
        parser.error("two different refs")
    asyncio.run(run(list(args.refs), args.rate, args.rounds, args.runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
