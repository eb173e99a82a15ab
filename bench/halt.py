"""Halt latency under load, and overshoot: what a runaway agent costs before the guard refuses.

Both use the runtime SDK as an agent runtime does (``Guard.fleet``, its publisher and halt listener) in
this process, against real workers, while ``bench.loadgen`` adds background telemetry from its own
process.

- Halt latency, on the fleet path (a guard with local rules off and the producer's linger at 0: what a
  decision only the fleet can make costs): runaway runs (4 identical failing calls; the 4th triggers
  ``recursion``) are injected at a steady pace. Latency is from the moment the SDK has produced the
  triggering event (the 4th ``call`` returned, its telemetry queued to the producer) to the moment
  ``Guard.on_decision`` receives the halt. After each run, the raw round trip alone
  (``raw_trips_under_load``) over the same background load: how much of the halt's tail the broker and
  the host's shared cores give any trip at that load.
- Overshoot, as shipped (local rules on): one agent at a time calls a failing tool at a fixed pace
  through the guard until ``RunHalted``; overshoot is the calls it made after the triggering one
  (``evidence.seq``).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from stream_app.client import Guard, GuardedRun, KafkaClientConfig, RunHalted

from .host import HostCpu
from .limit import round_trips
from .loadgen import LoadGen
from .stats import percentiles, progress
from .workers import BenchDeployment

#: A runaway that is not halted by then gives up (and is reported as never halted).
MAX_CALLS = 5_000


class ToolFailed(Exception):
    """What the runaway's tool raises, every time, with the same message."""


def _failing_tool(query: str) -> None:
    raise ToolFailed("index unavailable")


async def _call(run: GuardedRun, query: str) -> None:
    with contextlib.suppress(ToolFailed):
        await run.call("search_docs", _failing_tool, {"query": query})


class HaltClock:
    """Matches halts received by the guard to the moment their trigger was produced, and splits the
    latency at the control record's timestamp (set by the worker's producer when it sends the halt, in
    whole milliseconds: the split's halves are each up to 1 ms off, their sum is not): inbound (trigger
    produced -> halt sent) and outbound (halt sent -> runtime holds it)."""

    def __init__(self) -> None:
        self.produced: dict[str, float] = {}
        self.produced_epoch_ms: dict[str, float] = {}
        self.latency_ms: dict[str, float] = {}
        self.received_epoch_ms: dict[str, float] = {}
        self.sent_epoch_ms: dict[str, int] = {}
        self.wrong_trigger = 0
        self._reader: AIOKafkaConsumer | None = None
        self._tps: list[TopicPartition] = []

    def on_decision(self, decision: dict[str, Any]) -> None:
        now = time.perf_counter()
        run_id = decision["run_id"]
        if decision["action"] != "halt" or run_id not in self.produced or run_id in self.latency_ms:
            return
        if decision.get("evidence", {}).get("seq") != 3:
            self.wrong_trigger += 1
        self.latency_ms[run_id] = (now - self.produced[run_id]) * 1000
        self.received_epoch_ms[run_id] = time.time() * 1000

    async def runaway(self, guard: Guard, run_id: str) -> None:
        """Four identical failing calls, back to back; the time the 4th was produced is kept."""
        run = guard.run(run_id, agent_id="bench-runaway")
        for _ in range(4):
            await _call(run, "quarterly report")
        self.produced[run_id] = time.perf_counter()
        self.produced_epoch_ms[run_id] = time.time() * 1000

    async def start_reading(self, bootstrap: str, topic: str, partitions: int) -> None:
        """Remember where the control topic ends now: ``read_sent`` reads it from there."""
        self._reader = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
        await self._reader.start()
        self._tps = [TopicPartition(topic, p) for p in range(partitions)]
        self._reader.assign(self._tps)
        await self._reader.seek_to_end(*self._tps)
        for tp in self._tps:
            await self._reader.position(tp)  # resolved now, not at the first read

    async def read_sent(self) -> None:
        """Read the control topic up to its end now and keep the timestamp of each injected run's halt
        record. After the halts, not while they run: a tap consuming beside the runtime's listener took the
        process's loop turns from it (the listener got a halt 0.3 ms after the tap at p50, 2026-12-06)."""
        reader = self._reader
        if reader is None:
            return
        ends = await reader.end_offsets(self._tps)
        while [tp for tp, end in ends.items() if await reader.position(tp) < end]:
            for records in (await reader.getmany(timeout_ms=200)).values():
                for record in records:
                    run_id = record.key.decode() if record.key else ""
                    # the halt's record: the 3rd call's advice comes first, in a batch of its own when
                    # the worker folded the 3rd and 4th calls apart (until 2026-12-04 its timestamp was
                    # taken, and the inbound half read as short as 0.5 ms)
                    if run_id in self.produced_epoch_ms and orjson.loads(record.value or b"{}").get("action") == "halt":
                        self.sent_epoch_ms.setdefault(run_id, record.timestamp)

    async def stop_reading(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            await reader.stop()

    def inbound_ms(self, run_ids: list[str]) -> list[float]:
        """Milliseconds from each of these runs' trigger produced to its halt sent (``read_sent`` found it)."""
        return [self.sent_epoch_ms[r] - self.produced_epoch_ms[r] for r in run_ids if r in self.sent_epoch_ms]

    def split(self, run_ids: list[str]) -> dict[str, float]:
        """Median inbound and outbound milliseconds of these runs' halts."""
        both = [r for r in run_ids if r in self.sent_epoch_ms and r in self.received_epoch_ms]
        if not both:
            return {}
        return {"inbound_p50": statistics.median(self.inbound_ms(both)),
                "outbound_p50": statistics.median(self.received_epoch_ms[r] - self.sent_epoch_ms[r] for r in both)}


@contextlib.asynccontextmanager
async def clocked(deployment: BenchDeployment, guard: Guard) -> AsyncIterator[HaltClock]:
    """A ``HaltClock`` on ``guard``'s decisions, reading the control topic's halt records from where it ends
    when the block starts (``HaltClock.read_sent``)."""
    clock = HaltClock()
    guard.on_decision(clock.on_decision)
    await clock.start_reading(deployment.bootstrap, deployment.control_topic, deployment.partitions)
    try:
        yield clock
    finally:
        await clock.stop_reading()


async def background(deployment: BenchDeployment, template: Path, per_s: float, duration_s: float,
                     prefix: str) -> LoadGen | None:
    """Once the workers are idle, background telemetry at ``per_s`` for ``duration_s`` from the load
    generator's process, under way (None at 0); the caller kills it when done."""
    await deployment.wait_idle()
    if per_s <= 0:
        return None
    gen = LoadGen(deployment.bootstrap, deployment.telemetry_topic, template, per_s, duration_s, prefix)
    await gen.prepare()
    await gen.go()
    return gen


async def halt_latency(deployment: BenchDeployment, guard: Guard, clock: HaltClock, template: Path,
                       background_per_s: float, inject_per_s: float, duration_s: float,
                       prefix: str) -> dict[str, Any]:
    """Inject runaways at ``inject_per_s`` for ``duration_s`` over ``background_per_s`` of telemetry."""
    gen = await background(deployment, template, background_per_s, duration_s, prefix)
    injected: list[str] = []
    tasks = []
    host = HostCpu()
    start = time.monotonic()
    try:
        while (due := start + len(injected) / inject_per_s) < start + duration_s:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            run_id = f"{prefix}-runaway-{len(injected)}"
            injected.append(run_id)
            tasks.append(asyncio.create_task(clock.runaway(guard, run_id)))
        host_cpu = host.finish()
        await asyncio.gather(*tasks)
        deadline = time.monotonic() + 15
        while any(r not in clock.latency_ms for r in injected) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        final = await gen.wait() if gen is not None else None
    finally:
        if gen is not None:
            await gen.kill()
    samples = [clock.latency_ms[r] for r in injected if r in clock.latency_ms]
    await clock.read_sent()
    result: dict[str, Any] = {
        "background_per_s": background_per_s,
        "inject_per_s": inject_per_s,
        "injected": len(injected),
        "halted": len(samples),
        "background_produced_per_s": (final["acked"] / duration_s) if final else 0.0,
        "host_cpu": host_cpu,
    }
    if len(samples) >= 2:
        result["latency_ms"] = percentiles(samples)
        result["split_ms"] = clock.split(injected)
    return result


async def raw_trips_under_load(deployment: BenchDeployment, template: Path, background_per_s: float,
                               duration_s: float, prefix: str, topic: str) -> dict[str, float]:
    """The raw round trip (``limit.round_trips``: one message produced, acks all, linger 0, to a consumer
    holding it) on ``topic`` of one partition, while ``background_per_s`` of telemetry goes through the
    workers as in ``halt_latency``: what the broker and the host's shared cores alone give one trip at that
    load (a halt makes two trips, plus the worker's fetch and fold). A trip every ~30 ms over the window."""
    gen = await background(deployment, template, background_per_s, duration_s, prefix)
    try:
        await asyncio.sleep(0.5)  # the load under way, as the halts' first injection is
        samples = await round_trips(deployment.bootstrap, topic, max(20, int((duration_s - 1.5) / 0.035)),
                                    pause_s=0.03)
        if gen is not None:
            await gen.wait()
    finally:
        if gen is not None:
            await gen.kill()
    return percentiles(samples)


async def overshoot_run(guard: Guard, run_id: str, calls_per_s: float) -> dict[str, Any]:
    """A runaway calling at ``calls_per_s`` (absolute schedule) until the guard refuses."""
    run = guard.run(run_id, agent_id="bench-overshoot")
    interval = 1.0 / calls_per_s
    next_at = time.monotonic()
    try:
        while run.calls < MAX_CALLS:
            await _call(run, "q3 report")
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    except RunHalted as halted:
        trigger = halted.decision.get("evidence", {}).get("seq")
        return {"calls": run.calls, "trigger_seq": trigger,
                "overshoot": None if trigger is None else run.calls - (trigger + 1)}
    return {"calls": run.calls, "trigger_seq": None, "overshoot": None}


async def overshoot(deployment: BenchDeployment, guard: Guard, template: Path, rates: tuple[float, ...], runs: int,
                    background_per_s: float, prefix: str) -> dict[str, Any]:
    """``runs`` sequential runaways per pace in ``rates``, over ``background_per_s`` of telemetry; the
    worker is let drain before, and between paces when there is no background (a fast runaway can
    leave a backlog behind)."""
    expected_s = sum(runs * (4 / rate + 0.5) for rate in rates) + 30
    gen = await background(deployment, template, background_per_s, expected_s, prefix)
    try:
        by_rate: dict[str, list[dict[str, Any]]] = {}
        for rate in rates:
            if background_per_s == 0:
                await deployment.wait_idle()
            results = [await overshoot_run(guard, f"{prefix}-{rate:g}-{i}-{uuid.uuid4().hex[:4]}", rate)
                       for i in range(runs)]
            by_rate[f"{rate:g}"] = results
            counts = [r["overshoot"] for r in results if r["overshoot"] is not None]
            progress(f"  {rate:g} calls/s: overshoot {sorted(counts)} (background {background_per_s:,.0f} ev/s)")
        return {"background_per_s": background_per_s, "runs": by_rate}
    finally:
        if gen is not None:
            await gen.kill()


async def guard_for(deployment: BenchDeployment, local_rules: bool = True, linger_ms: int = 5) -> Guard:
    """A started fleet guard on the deployment's topics (``local_rules=False``: the fleet path alone)."""
    guard = Guard.fleet(KafkaClientConfig(deployment.bootstrap), deployment.telemetry_topic,
                        deployment.control_topic, trusted_keys=deployment.trusted_keys(), lookback_ms=0,
                        local_rules=local_rules, linger_ms=linger_ms)
    await guard.start()
    return guard
