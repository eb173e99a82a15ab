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
    stream: list[Event] = []
    for event in events:
        stream.append(event)
        if rng.random() < redeliver_fraction:
            stream.append(event)
    return fleet, stream
