"""Fault-injection trials: stream a mixed corpus through real workers while something breaks, then
compare what a runtime's halt listener applied with the replay CLI's decisions for the same corpus.

A trial counts, per decision, what matters to a fleet: halts missing, halts replay did not make,
decisions with different content, decisions a runtime applied twice (must be impossible: the SDK
applies a decision id once) and raw redeliveries the SDK deduplicated (allowed: at-least-once).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from stream_app.bus.wire import encode_telemetry, header
from stream_app.client import KafkaClientConfig
from stream_app.client.listener import HaltListener
from stream_app.client.publisher import TelemetryPublisher
from stream_app.commands.replay import replay
from stream_app.core import Policy
from stream_app.core.fleet import SCOPES
from stream_app.devtools.fleet_sim import simulate_fleet, simulate_storm, simulate_threads, simulate_trees
from stream_app.devtools.harness import metric_total
from stream_app.worker.main import ensure_topics
from stream_app.worker.settings import WorkerSettings

from ..integration.workers import Fleet, WorkerProcess, consume, produce

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
    """What ``loopwarden replay`` decides on ``stream`` (every rule: per run and across runs), by id."""
    out = io.BytesIO()
    replay([orjson.dumps(e) + b"\n" for e in stream], policy or Policy(), out, io.StringIO(), engine="python")
    return {d["decision_id"]: d for d in map(orjson.loads, out.getvalue().splitlines())}


def corpus(kind: str, runs: int, seed: int) -> list[dict[str, Any]]:
    """The trial's telemetry: the simulated fleet (``fleet``), or half of it interleaved with 8 sub-agent
    trees and 8 threads of every kind (``trees``: the keyed folds work across partitions while the fault
    hits)."""
    if kind == "fleet":
        return simulate_fleet(runs, seed=seed)[1]
    _, stream = simulate_fleet(runs // 2, seed=seed)
    if kind == "storm":
        storm = simulate_storm(seed=seed)
        return sorted([*stream, *storm], key=lambda e: (e["ts_ms"], e["event_id"]))
    _, trees = simulate_trees(8, seed=seed)
    _, threads = simulate_threads(8, seed=seed)
    return sorted([*stream, *trees, *threads], key=lambda e: (e["ts_ms"], e["event_id"]))


def _content(decision: dict[str, Any]) -> dict[str, Any]:
    """What must be equal between replay's decision and the fleet's: all of a run's decision; of a
    decision across runs, what does not depend on the order its facts arrived in (the fleet folds facts
    from several partitions in another order than replay's input order, so the fact that crossed the
    threshold, its time, the reason naming it and which failing streak of scheduled runs completed first
    may differ: control v1 says so)."""
    if decision.get("scope", "run") == "run":
        return decision
    evidence = decision.get("evidence", {})
    scope = decision["scope"]
    counted = {k: evidence.get(k) for k in ("runs", "spawns", "task_hash", "max_tree_depth", "error_class",
                                             "window_start_ms")}
    if isinstance(counted["runs"], list):  # schedule_failing's streak: which one is found first is the order's
        counted["runs"] = len(counted["runs"])
    return {"decision_id": decision["decision_id"], "scope": scope, "key": [decision.get(name) for name in SCOPES[scope]],
            "action": decision["action"], "verdict": decision["verdict"], "rule": evidence.get("rule"),
            "counted": counted}


def _follows_time(decision: dict[str, Any]) -> bool:
    """A storm's pause again or resume: made at the fact whose event time crosses the wait, which depends
    on how the partitions' facts interleave (not one set replay and the fleet must share; the storm's
    first pause, its incident, is)."""
    return decision.get("scope") == "tool" and decision["evidence"].get("rule") in ("still_failing", "recovered")


def _subject(decision: dict[str, Any]) -> str:
    scope = decision.get("scope", "run")
    if scope == "run":
        return str(decision.get("run_id"))
    return f"{scope}/" + "/".join(str(decision.get(name)) for name in SCOPES[scope])


def _listener(fleet: Fleet) -> tuple[HaltListener, list[dict[str, Any]]]:
    """A runtime's halt listener on the fleet's control topic, and the decisions it applies, in order.
    The corpus's event times are synthetic, so the listener's age check (a replay defence) is off."""
    listener = HaltListener(KafkaClientConfig(fleet.bootstrap), fleet.control_topic, trusted_keys=fleet.trusted_keys(),
                            max_age_ms=None, watch_all=True, lookback_ms=3_600_000)
    applied: list[dict[str, Any]] = []
    listener.board.add_callback(applied.append)
    return listener, applied


async def _converge(expected: dict[str, dict[str, Any]], applied: list[dict[str, Any]], within_s: float) -> None:
    """Wait until every expected decision was applied (or ``within_s``), then 3 s more for extras."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not expected.keys() <= {d["decision_id"] for d in applied}:
        await asyncio.sleep(0.5)
    await asyncio.sleep(3.0)  # anything extra arrives now


async def run_trial(scenario: str, trial: int, fleet: Fleet, fault: Fault, seed: int,
                    runs: int = 150, duration_s: float = 6.0, converge_s: float = 120.0,
                    kind: str = "fleet") -> TrialResult:
    """Publish a corpus (``corpus(kind)``) at a steady pace over ``duration_s`` through the SDK publisher,
    fire ``fault`` at a random moment, wait until the listener has applied every expected decision (or
    ``converge_s``), then a little longer to catch extras."""
    rng = random.Random(seed)
    stream = corpus(kind, runs, seed)
    expected = {i: d for i, d in replay_decisions(stream).items() if not _follows_time(d)}
    config = KafkaClientConfig(fleet.bootstrap)
    listener, applied = _listener(fleet)
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
        await _converge(expected, applied, converge_s)
    finally:
        await publisher.stop()
        await listener.stop()
    storm = [d for d in applied if d.get("scope") == "tool"]
    applied = [d for d in applied if not _follows_time(d)]
    result = compare(scenario, trial, fault_info, stream, expected, applied, listener.counters,
                     publisher.failed, time.monotonic() - started)
    if storm:  # the storm's pauses again and its resume follow event time: its last word must be a resume
        result.notes["storm"] = [(d["action"], d["evidence"].get("rule")) for d in storm]
    if result.missing_halts or result.missing_other:
        await _diagnose_missing(fleet, expected, applied, dict(listener.counters), result)
    return result


async def _diagnose_missing(fleet: Fleet, expected: dict[str, dict[str, Any]], applied: list[dict[str, Any]],
                            counters: dict[str, int], result: TrialResult) -> None:
    """Where the missing decisions went: published by the workers (the runtime's listener missed them) or
    never published (a worker did not decide them), by control partition; and the workers' metrics."""
    records = await consume(fleet.bootstrap, fleet.control_topic, len(expected), timeout=20, settle=1.0)
    published = {orjson.loads(r.value)["decision_id"]: r.partition for r in records}
    missing = expected.keys() - {d["decision_id"] for d in applied}
    result.notes["missing_published"] = dict(Counter(published[i] for i in missing if i in published))
    result.notes["missing_unpublished"] = sum(1 for i in missing if i not in published)
    result.notes["listener_counters"] = counters
    result.notes["worker_metrics"] = []
    for worker in fleet.workers:
        with contextlib.suppress(Exception):
            metrics = worker.metrics()
            result.notes["worker_metrics"].append({k: v for k, v in metrics.items()
                                                   if k.startswith("loopwarden_") and "_created" not in k
                                                   and "_bucket" not in k})


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
        wrong_content=sum(1 for i, d in got.items() if i in expected and _content(expected[i]) != _content(d)),
        applied_twice=twice, redeliveries_deduplicated=counters.get("duplicate", 0),
        publish_failed=failed, seconds=round(seconds, 1),
        notes={"missing": sorted((_subject(expected[i]), expected[i]["verdict"], expected[i]["trigger_event_id"])
                                 for i in halts - got_halts)[:10],
               "extra": sorted((_subject(got[i]), got[i]["verdict"], got[i]["trigger_event_id"])
                               for i in got_halts - halts)[:10],
               "wrong": [(_subject(d), d["verdict"], _content(expected[i]), _content(d)) for i, d in got.items()
                         if i in expected and _content(expected[i]) != _content(d)][:5]},
    )


async def backlog_trial(scenario: str, trial: int, fleet: Fleet, fault: Callable[[list[dict[str, Any]]], Awaitable[dict[str, Any]]],
                        seed: int, runs: int, converge_s: float = 240.0) -> TrialResult:
    """``fault`` publishes the corpus (raw, as fast as one producer can, so workers meet backlogs) and
    starts, kills and restarts workers; then, as ``run_trial``, every expected decision must arrive. The
    control topic is read back too: ``notes['published_twice']`` counts decisions published more than
    once (allowed, at-least-once, the runtime applies one; a revoked batch must not be one of them)."""
    _, stream = simulate_fleet(runs, seed=seed)
    expected = replay_decisions(stream)
    listener, applied = _listener(fleet)
    started = time.monotonic()
    # the workers start later: make their topics now, as they would (the listener needs the control topic)
    await ensure_topics(WorkerSettings.from_env(fleet.worker_env(0, 0)))
    await listener.start()
    try:
        fault_info = await fault(stream)
        await _converge(expected, applied, converge_s)
    finally:
        await listener.stop()
    result = compare(scenario, trial, fault_info, stream, expected, applied, listener.counters, 0,
                     time.monotonic() - started)
    published = Counter(orjson.loads(record.value)["decision_id"]
                        for record in await consume(fleet.bootstrap, fleet.control_topic, len(expected), timeout=60))
    result.notes["published"] = sum(published.values())
    result.notes["published_twice"] = sum(n - 1 for n in published.values() if n > 1)
    return result


def _processed(worker: WorkerProcess) -> tuple[float, float, float]:
    """(telemetry events applied or skipped, batches, events in those batches) by ``worker`` so far."""
    samples = worker.metrics()
    return (metric_total(samples, "loopwarden_events_total") + metric_total(samples, "loopwarden_duplicate_events_total"),
            metric_total(samples, "loopwarden_batch_events_count"), metric_total(samples, "loopwarden_batch_events_sum"))


def join_during_batch(fleet: Fleet) -> Callable[[list[dict[str, Any]]], Awaitable[dict[str, Any]]]:
    """The whole corpus waits as a backlog; worker 0 starts on it (batches of up to 1,000 records) and a
    second worker joins the group while worker 0 is still deep in it: the rebalance revokes partitions
    from under a batch in flight."""
    async def inject(stream: list[dict[str, Any]]) -> dict[str, Any]:
        await produce(fleet.bootstrap, fleet.telemetry_topic, stream)
        first = await asyncio.to_thread(fleet.start_worker, 0)
        joiner = fleet.start_worker(1, wait=False)
        at_start = await asyncio.to_thread(_processed, first)
        await joiner.wait_ready_async()
        at_join = await asyncio.to_thread(_processed, first)
        stale = metric_total(await asyncio.to_thread(first.metrics), 'loopwarden_refetched_total{reason="stale"}')
        return {"fault": "a second worker joins while the first is deep in a backlog",
                "events": len(stream), "applied_when_join_began": int(at_start[0]),
                "backlog_when_joined": int(len(stream) - at_join[0]),
                "mean_batch_before_join": round(at_join[2] / max(at_join[1], 1), 1),
                "stale_records_dropped": int(stale)}
    return inject


def _state_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def crash_during_recovery(fleet: Fleet) -> Callable[[list[dict[str, Any]]], Awaitable[dict[str, Any]]]:
    """Worker 0 folds the first half of the corpus, then is SIGKILLed; the second half waits as a backlog
    while a new worker on empty state recovers the whole changelog, and is SIGKILLed in the middle of that
    recovery; it is started again on what it had recovered and must catch up with everything."""
    async def inject(stream: list[dict[str, Any]]) -> dict[str, Any]:
        half = len(stream) // 2
        first = await asyncio.to_thread(fleet.start_worker, 0)
        await produce(fleet.bootstrap, fleet.telemetry_topic, stream[:half])
        deadline = time.monotonic() + 120
        while (await asyncio.to_thread(_processed, first))[0] < half and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        first.kill()
        await produce(fleet.bootstrap, fleet.telemetry_topic, stream[half:])
        state = fleet.root / "state-1"
        recovering = fleet.start_worker(1, wait=False)
        started = time.monotonic()
        # the table's RocksDB files fill as the changelog is applied; ready turns 1 once it is recovered
        while time.monotonic() - started < 120:
            if _state_bytes(state) > 256 * 1024 or await asyncio.to_thread(recovering.is_ready):
                break
            await asyncio.sleep(0.05)
        ready = await asyncio.to_thread(recovering.is_ready)
        recovered_bytes = _state_bytes(state)
        recovering.kill()
        killed_after = time.monotonic() - started
        again = await asyncio.to_thread(fleet.start_worker, 1)
        recovery_s = None
        with contextlib.suppress(OSError):
            recovery_s = round(time.monotonic() - started - killed_after, 1)
        return {"fault": "SIGKILL during the recovery of a fresh worker, a backlog waiting", "events": len(stream),
                "killed_during_recovery": not ready, "killed_after_s": round(killed_after, 1),
                "state_bytes_when_killed": recovered_bytes, "restarted_ready_after_s": recovery_s,
                "restarted_pid": again.process.pid}
    return inject


async def no_fault(at: float) -> dict[str, Any]:
    """Nothing breaks: the fleet must decide exactly as replay does."""
    return {"fault": "none"}


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
    """Throttle the worker to 3% of its speed (SIGSTOP 0.97 s / SIGCONT 0.03 s) and watch the lag. The batch
    path clears ~25,000 events/s, so a tenth (0.1 s a second) would clear the chaos load's second of backlog
    each time and show no lag."""
    async def inject(at: float) -> dict[str, Any]:
        await asyncio.sleep(at)
        lags = []
        for _ in range(cycles):
            os.kill(worker.process.pid, signal.SIGSTOP)
            await asyncio.sleep(0.97)
            os.kill(worker.process.pid, signal.SIGCONT)
            await asyncio.sleep(0.03)
            lags.append(await asyncio.to_thread(_lag, worker))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and await asyncio.to_thread(_lag, worker) > 0:
            await asyncio.sleep(0.5)
        return {"fault": "worker throttled to ~3% for 6 s", "at_s": round(at, 2), "max_lag": max(lags),
                "lag_after": await asyncio.to_thread(_lag, worker)}
    return inject


def _lag(worker: WorkerProcess) -> float:
    try:
        return metric_total(worker.metrics(), "loopwarden_consumer_lag")
    except OSError:
        return -1.0


def save(result: TrialResult, path: str | None) -> None:
    if path:
        with Path(path).open("ab") as out:
            out.write(orjson.dumps({**asdict(result), "clean": result.clean}) + b"\n")


#: Share of the soak's runs that are runaways (the rest make one healthy call each).
RUNAWAY_SHARE = 0.02


async def soak(fleet: Fleet, worker: WorkerProcess, minutes: float, runs_total: int, seed: int,
               progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Many distinct runs at a steady rate for ``minutes``: most are one healthy call (an agent run that
    looked something up and finished), ``RUNAWAY_SHARE`` are runaways (4 identical failures, halted on
    the 4th). Samples the worker's resident memory, tracked runs, evictions and lag; at the end every
    runaway must be halted once and nothing else."""
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
    made = events = 0
    next_sample = started
    try:
        while made < runs_total:
            due = min(runs_total, int((time.monotonic() - started) / tick * per_tick) + 1)
            while made < due:
                run_id = f"soak-{seed}-{made}"
                now_ms = int(time.time() * 1000)
                runaway = rng.random() < RUNAWAY_SHARE
                if runaway:
                    runaways.add(run_id)
                for n in range(4 if runaway else 1):
                    events += 1
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
    thirds = {"first": samples[:third], "middle": samples[third:-third] or samples, "last": samples[-third:]}
    halted_set = set(halted)
    return {
        "minutes": minutes, "runs": made, "events": events, "runaways": len(runaways),
        "missing_halts": len(runaways - halted_set), "false_halts": len(halted_set - runaways),
        "halts_applied_twice": len(halted) - len(halted_set), "publish_failed": publisher.failed,
        **{f"rss_mb_{name}_third": _median([s["rss_mb"] for s in part]) for name, part in thirds.items()},
        **{f"tracked_{name}_third": _median([s["runs_tracked"] for s in part]) for name, part in thirds.items()},
        "state_mb_last": samples[-1]["state_mb"], "evicted": samples[-1]["evicted"], "samples": samples,
    }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def _sample(worker: WorkerProcess, fleet: Fleet, t_s: float, runs: int) -> dict[str, float]:
    metrics = worker.metrics()
    state = sum(f.stat().st_size for f in fleet.root.rglob("*") if f.is_file() and "state" in str(f))
    return {
        "t_s": round(t_s, 1), "runs": runs, "rss_mb": worker.rss_mb(),
        "runs_tracked": metrics.get("loopwarden_runs_tracked", 0.0),
        "evicted": metrics.get("loopwarden_evicted_runs_total", 0.0),
        "lag": sum(v for k, v in metrics.items() if k.startswith("loopwarden_consumer_lag{")),
        "state_mb": state / 2**20,
    }


# --- bad input through Kafka ------------------------------------------------------------------------

def _base(i: int) -> dict[str, Any]:
    return {"run_id": f"bad-{i}", "event_id": f"bad-{i}", "tool": "search", "ts_ms": 1_764_000_000_000 + i,
            "outcome": "error", "args": {"q": "x"}, "result": {"error": "503"}}


def _with(i: int, **fields: Any) -> bytes:
    return orjson.dumps({**_base(i), **fields})


_WRONG_TYPES = [("run_id", 5), ("event_id", []), ("tool", None), ("ts_ms", "soon"), ("outcome", "kaput"),
                ("args", [1, 2]), ("retry_budget", -1), ("side_effect", "yes"), ("plan_step", 1.5),
                ("schema_version", "9"), ("attrs", "x"), ("latency_ms", -3)]

#: Each class of bad input the issue names, as a function of a counter (no two messages are equal).
BAD_INPUT_CLASSES: dict[str, Callable[[int], bytes]] = {
    "not JSON": lambda i: b"{not json %d" % i,
    "invalid UTF-8": lambda i: b'{"run_id": "r\xff\xfe%d", "event_id": "e"}' % i,
    "NaN / Infinity": lambda i: _with(i).replace(b'"result":', b'"latency_ms":NaN,"result":' if i % 2 else
                                                   b'"latency_ms":Infinity,"result":'),
    "deep nesting (5,000 levels)": lambda i: b'{"run_id":"r%d","args":' % i + b"[" * 5000 + b"]" * 5000 + b"}",
    "duplicate keys, the last one wrong": lambda i: _with(i)[:-1] + b',"ts_ms":"later"}',
    "integer beyond 64 bits": lambda i: _with(i).replace(b'"ts_ms":1764', b'"ts_ms":999999999999999999999999', 1),
    "wrong type in a field": lambda i: _with(i, **dict([_WRONG_TYPES[i % len(_WRONG_TYPES)]])),
    "huge string (600 KB run id)": lambda i: _with(i, run_id="r" * 600_000 + str(i)),
    "huge array (100,000 items) as args": lambda i: _with(i, args=list(range(100_000 + i))),
    "multi-megabyte payload (3 MB)": lambda i: _with(i, result={"blob": "x" * 3_000_000}),
}


async def bad_input_flood(fleet: Fleet, worker: WorkerProcess, seed: int, runs: int = 200,
                          per_class: int = 20) -> dict[str, Any]:
    """The worker's rate on clean telemetry, then on telemetry interleaved with every class of bad input
    (one bad message per good one at the start); bad messages must land in the DLQ with their reason,
    good ones must decide as replay does, and the worker's memory must not grow with the garbage."""
    clean, mixed = (_renamed(simulate_fleet(runs, seed=seed + n)[1], f"p{n}-") for n in (0, 1))
    bad = [(name, make(i)) for i in range(per_class) for name, make in BAD_INPUT_CLASSES.items()]
    admin = AIOKafkaAdminClient(bootstrap_servers=fleet.bootstrap)
    await admin.start()
    try:  # an operator may allow big messages on the input; the worker must still cope
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, fleet.telemetry_topic,
                                                  configs={"max.message.bytes": str(8 << 20)})])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=fleet.bootstrap, acks="all", max_request_size=8 << 20,
                                linger_ms=5)
    await producer.start()

    async def timed(messages: list[tuple[bytes | None, bytes]], done: float) -> float:
        started = time.monotonic()
        for key, value in messages:
            await producer.send(fleet.telemetry_topic, key=key, value=value)
        await producer.flush()
        while await asyncio.to_thread(_taken, worker) < done:
            if time.monotonic() - started > 300:
                raise AssertionError(f"worker stuck at {await asyncio.to_thread(_taken, worker)} of {done} messages")
            await asyncio.sleep(0.05)
        return time.monotonic() - started

    try:
        clean_s = await timed([encode_telemetry(e) for e in clean], len(clean))
        rss_before = await asyncio.to_thread(worker.rss_mb)
        interleaved: list[tuple[bytes | None, bytes]] = []
        good = [encode_telemetry(e) for e in mixed]
        for i, message in enumerate(good):
            interleaved.append(message)
            if i < len(bad):
                interleaved.append((f"bad-{i}".encode(), bad[i][1]))
        interleaved.extend((b"bad", value) for _, value in bad[len(good):])
        mixed_s = await timed(interleaved, len(clean) + len(interleaved))
        rss_after = await asyncio.to_thread(worker.rss_mb)
    finally:
        await producer.stop()

    expected = replay_decisions(clean) | replay_decisions(mixed)
    control = await consume(fleet.bootstrap, fleet.control_topic, len(expected), timeout=60, settle=1.0)
    got = {orjson.loads(r.value)["decision_id"] for r in control}
    dlq = await consume(fleet.bootstrap, fleet.dlq_topic, len(bad), timeout=60, settle=1.0)
    with_reason = [r for r in dlq if header(r.headers, "error")]
    return {
        "classes": list(BAD_INPUT_CLASSES), "bad_messages": len(bad), "good_events": len(clean) + len(mixed),
        "bad_megabytes": sum(len(value) for _, value in bad) / 2**20,
        "clean_events_per_s": len(clean) / clean_s,
        "mixed_good_events_per_s": len(mixed) / mixed_s, "mixed_messages_per_s": len(interleaved) / mixed_s,
        "dlq_messages": len(dlq), "dlq_with_reason": len(with_reason),
        "dlq_truncated": sum(1 for r in dlq if header(r.headers, "value_bytes")),
        "dlq_reasons": sorted({header(r.headers, "error").decode()[:80] for r in with_reason})[:40],
        "decisions_expected": len(expected), "decisions_missing": len(expected.keys() - got),
        "decisions_extra": len(got - expected.keys()), "rss_mb_before": rss_before, "rss_mb_after": rss_after,
    }


def _renamed(stream: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    return [{**e, "run_id": prefix + e["run_id"], "event_id": prefix + e["event_id"]} for e in stream]


def _taken(worker: WorkerProcess) -> float:
    """Input messages the worker has finished with: applied, skipped as redeliveries, or dead-lettered."""
    metrics = worker.metrics()
    return sum(v for k, v in metrics.items() if k.startswith(("loopwarden_events_total{", "loopwarden_dlq_total{"))) \
        + metrics.get("loopwarden_duplicate_events_total", 0.0)

