"""Fault-injection trials: stream a mixed corpus through real workers while something breaks, then
compare what a runtime's halt listener applied with the replay CLI's decisions for the same corpus.

A trial counts, per decision, what matters to a fleet: halts missing, halts replay did not make,
decisions with different content, decisions a runtime applied twice (must be impossible: the SDK
applies a decision id once) and raw redeliveries the SDK deduplicated (allowed: at-least-once).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from stream_app.client import KafkaClientConfig
from stream_app.client.listener import HaltListener
from stream_app.client.publisher import TelemetryPublisher
from stream_app.core import Detector, Policy, RunTable, decode_event
from stream_app.fleet_sim import simulate_fleet

from ..integration.workers import Fleet, WorkerProcess

Fault = Callable[[float], Awaitable[dict[str, Any]]]


@dataclass
class TrialResult:
    scenario: str
    trial: int
    fault: dict[str, Any]
    events: int
    expected_decisions: int
    applied_decisions: int
    missing_halts: int
    extra_halts: int
    missing_other: int
    extra_other: int
    wrong_content: int
    applied_twice: int
    redeliveries_deduplicated: int
    publish_failed: int
    seconds: float
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not (self.missing_halts or self.extra_halts or self.missing_other or self.extra_other
                    or self.wrong_content or self.applied_twice or self.publish_failed)


def replay_decisions(stream: list[dict[str, Any]], policy: Policy | None = None) -> dict[str, dict[str, Any]]:
    table = RunTable(Detector(policy))
    return {d.decision_id: d.to_control() for raw in stream for d in table.observe(decode_event(raw)).decisions}


async def run_trial(scenario: str, trial: int, fleet: Fleet, fault: Fault, seed: int,
                    runs: int = 150, duration_s: float = 6.0, converge_s: float = 120.0) -> TrialResult:
    """Publish a corpus at a steady pace over ``duration_s`` through the SDK publisher, fire ``fault`` at a
    random moment, wait until the listener has applied every expected decision (or ``converge_s``), then
    a little longer to catch extras."""
    rng = random.Random(seed)
    _, stream = simulate_fleet(runs, seed=seed)
    expected = replay_decisions(stream)
    config = KafkaClientConfig(fleet.bootstrap)
    # The corpus's event times are synthetic, so the listener's age check (a replay defence) is off.
    listener = HaltListener(config, fleet.control_topic, trusted_keys=fleet.trusted_keys(), max_age_ms=None,
                            watch_all=True, lookback_ms=3_600_000)
    applied: list[dict[str, Any]] = []
    listener.board.add_callback(applied.append)
    started = time.monotonic()
    await listener.start()
    publisher = TelemetryPublisher(config, fleet.telemetry_topic)
    await publisher.start()
    try:
        fault_task = asyncio.create_task(fault(rng.uniform(0.2, 0.8) * duration_s))
        chunk = 25
        pause = duration_s * chunk / len(stream)
        for at in range(0, len(stream), chunk):
            for event in stream[at:at + chunk]:
                await publisher.publish(event)
            await asyncio.sleep(pause)
        fault_info = await fault_task
        deadline = time.monotonic() + converge_s
        while time.monotonic() < deadline and not expected.keys() <= {d["decision_id"] for d in applied}:
            await asyncio.sleep(0.5)
        await asyncio.sleep(3.0)  # anything extra arrives now
    finally:
        await publisher.stop()
        await listener.stop()
    return compare(scenario, trial, fault_info, stream, expected, applied, listener.counters,
                   publisher.failed, time.monotonic() - started)


def compare(scenario: str, trial: int, fault: dict[str, Any], stream: list[dict[str, Any]],
            expected: dict[str, dict[str, Any]], applied: list[dict[str, Any]], counters: dict[str, int],
            failed: int, seconds: float) -> TrialResult:
    got: dict[str, dict[str, Any]] = {}
    twice = 0
    for decision in applied:
        twice += decision["decision_id"] in got
        got[decision["decision_id"]] = decision
    halts = {i for i, d in expected.items() if d["action"] == "halt"}
    got_halts = {i for i, d in got.items() if d["action"] == "halt"}
    return TrialResult(
        scenario=scenario, trial=trial, fault=fault, events=len(stream),
        expected_decisions=len(expected), applied_decisions=len(got),
        missing_halts=len(halts - got_halts), extra_halts=len(got_halts - halts),
        missing_other=len(expected.keys() - got.keys() - halts),
        extra_other=len(got.keys() - expected.keys() - got_halts),
        wrong_content=sum(1 for i, d in got.items() if i in expected and expected[i] != d),
        applied_twice=twice, redeliveries_deduplicated=counters.get("duplicate", 0),
        publish_failed=failed, seconds=round(seconds, 1),
        notes={"missing": sorted((expected[i]["run_id"], expected[i]["verdict"], expected[i]["trigger_event_id"])
                                 for i in halts - got_halts)[:10],
               "extra": sorted((got[i]["run_id"], got[i]["verdict"], got[i]["trigger_event_id"])
                               for i in got_halts - halts)[:10]},
    )


# --- faults -------------------------------------------------------------------------------------------

def worker_crash(fleet: Fleet, fresh_state: bool) -> Fault:
    """SIGKILL the worker; start a new one (on the same local state, or on none: changelog only)."""
    async def inject(at: float) -> dict[str, Any]:
        await asyncio.sleep(at)
        fleet.workers[-1].kill()
        index = len(fleet.workers) if fresh_state else 0
        await asyncio.to_thread(fleet.start_worker, index)
        return {"fault": "SIGKILL worker", "at_s": round(at, 2), "restart": "fresh state" if fresh_state else "same state"}
    return inject


def rebalance(fleet: Fleet) -> Fault:
    """Two workers share the partitions; one is SIGKILLed (its partitions move), then restarted."""
    async def inject(at: float) -> dict[str, Any]:
        await asyncio.sleep(at)
        fleet.workers[1].kill()
        await asyncio.sleep(2.0)
        await asyncio.to_thread(fleet.start_worker, 1)
        return {"fault": "SIGKILL one of two workers, restart after 2 s", "at_s": round(at, 2)}
    return inject


def broker_restart(broker: Any) -> Fault:
    """SIGTERM the broker and start it again on the same data and port."""
    async def inject(at: float) -> dict[str, Any]:
        await asyncio.sleep(at)
        down = time.monotonic()
        await asyncio.to_thread(broker.stop)
        await asyncio.to_thread(broker.start)
        return {"fault": "broker SIGTERM + restart", "at_s": round(at, 2), "down_s": round(time.monotonic() - down, 1)}
    return inject


def slow_worker(worker: WorkerProcess, cycles: int = 6) -> Fault:
    """Throttle the worker to a tenth of its speed (SIGSTOP 0.9 s / SIGCONT 0.1 s) and watch the lag."""
    async def inject(at: float) -> dict[str, Any]:
        await asyncio.sleep(at)
        lags = []
        for _ in range(cycles):
            os.kill(worker.process.pid, signal.SIGSTOP)
            await asyncio.sleep(0.9)
            os.kill(worker.process.pid, signal.SIGCONT)
            await asyncio.sleep(0.1)
            lags.append(await asyncio.to_thread(_lag, worker))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and await asyncio.to_thread(_lag, worker) > 0:
            await asyncio.sleep(0.5)
        return {"fault": "worker throttled to ~10% for 6 s", "at_s": round(at, 2), "max_lag": max(lags),
                "lag_after": await asyncio.to_thread(_lag, worker)}
    return inject


def _lag(worker: WorkerProcess) -> float:
    try:
        return sum(v for k, v in worker.metrics().items() if k.startswith("loopwarden_consumer_lag{"))
    except OSError:
        return -1.0


def save(result: TrialResult, path: str | None) -> None:
    if path:
        with Path(path).open("ab") as out:
            out.write(orjson.dumps({**asdict(result), "clean": result.clean}) + b"\n")


async def soak(fleet: Fleet, worker: WorkerProcess, minutes: float, runs_total: int, seed: int,
               progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Many short distinct runs at a steady rate for ``minutes``: a quarter are runaways (4 identical
    failures, halted on the 4th), the rest healthy. Samples the worker's resident memory, tracked runs,
    evictions and lag; at the end every runaway must be halted once and nothing else."""
    rng = random.Random(seed)
    config = KafkaClientConfig(fleet.bootstrap)
    listener = HaltListener(config, fleet.control_topic, trusted_keys=fleet.trusted_keys(), max_age_ms=None,
                            watch_all=True, lookback_ms=60_000)
    halted: list[str] = []
    listener.board.add_callback(lambda d: halted.append(d["run_id"]) if d["action"] == "halt" else None)
    await listener.start()
    publisher = TelemetryPublisher(config, fleet.telemetry_topic)
    await publisher.start()
    runaways: set[str] = set()
    samples: list[dict[str, float]] = []
    duration = minutes * 60
    tick = 0.1
    per_tick = runs_total * tick / duration
    started = time.monotonic()
    made = 0
    next_sample = started
    try:
        while made < runs_total:
            due = min(runs_total, int((time.monotonic() - started) / tick * per_tick) + 1)
            while made < due:
                run_id = f"soak-{seed}-{made}"
                now_ms = int(time.time() * 1000)
                runaway = rng.random() < 0.25
                if runaway:
                    runaways.add(run_id)
                for n in range(4):
                    await publisher.publish({
                        "run_id": run_id, "event_id": f"{run_id}-{n}", "tool": "search", "ts_ms": now_ms + n,
                        "outcome": "error" if runaway else "success",
                        "args_hash": "a" * 64 if runaway else f"{rng.getrandbits(256):064x}",
                        "result_hash": "b" * 64 if runaway else f"{rng.getrandbits(256):064x}"})
                made += 1
            if time.monotonic() >= next_sample:
                samples.append(await asyncio.to_thread(_sample, worker, fleet, time.monotonic() - started, made))
                progress(f"soak {samples[-1]['t_s']:6.0f}s  runs {made:>9,}  rss {samples[-1]['rss_mb']:6.1f} MB  "
                         f"tracked {samples[-1]['runs_tracked']:>8,.0f}  evicted {samples[-1]['evicted']:>9,.0f}  "
                         f"lag {samples[-1]['lag']:>7,.0f}")
                next_sample += max(5.0, duration / 40)
            await asyncio.sleep(tick)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not runaways <= set(halted):
            await asyncio.sleep(1.0)
        await asyncio.sleep(3.0)
        samples.append(await asyncio.to_thread(_sample, worker, fleet, time.monotonic() - started, made))
    finally:
        await publisher.stop()
        await listener.stop()
    third = max(1, len(samples) // 3)
    halted_set = set(halted)
    return {
        "minutes": minutes, "runs": made, "events": made * 4, "runaways": len(runaways),
        "missing_halts": len(runaways - halted_set), "false_halts": len(halted_set - runaways),
        "halts_applied_twice": len(halted) - len(halted_set), "publish_failed": publisher.failed,
        "rss_mb_first_third": _median([s["rss_mb"] for s in samples[:third]]),
        "rss_mb_last_third": _median([s["rss_mb"] for s in samples[-third:]]),
        "tracked_first_third": _median([s["runs_tracked"] for s in samples[:third]]),
        "tracked_last_third": _median([s["runs_tracked"] for s in samples[-third:]]),
        "state_mb_last": samples[-1]["state_mb"], "evicted": samples[-1]["evicted"], "samples": samples,
    }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def _sample(worker: WorkerProcess, fleet: Fleet, t_s: float, runs: int) -> dict[str, float]:
    metrics = worker.metrics()
    status = Path(f"/proc/{worker.process.pid}/status").read_text()
    rss_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
    state = sum(f.stat().st_size for f in fleet.workdir.rglob("*") if f.is_file() and "state" in str(f))
    return {
        "t_s": round(t_s, 1), "runs": runs, "rss_mb": rss_kb / 1024,
        "runs_tracked": metrics.get("loopwarden_runs_tracked", 0.0),
        "evicted": metrics.get("loopwarden_evicted_runs_total", 0.0),
        "lag": sum(v for k, v in metrics.items() if k.startswith("loopwarden_consumer_lag{")),
        "state_mb": state / 2**20,
    }
