"""A simulated fleet: deterministic telemetry for the kinds of runs a platform team sees.

Used by ``make run`` (the demo), the parity and end-to-end tests and the benchmarks, so every one of
them exercises the same mix: healthy runs, legitimate retries against a flaky tool, runaway loops,
argument-mutating loops, 2-call cycles, polling, duplicate e-mails and a run that never stops.
Each scenario knows the decision the detector must reach, which is what makes false halts countable.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

Event = dict[str, Any]


@dataclass(frozen=True)
class Scenario:
    """A kind of run: how its calls look, and the halt verdict it must get (None: must not halt)."""

    name: str
    expected_halt: str | None
    calls: Callable[[random.Random, int], Iterator[tuple[str, dict[str, Any], str, Any, dict[str, Any]]]]


def _healthy(rng: random.Random, n: int) -> Iterator[tuple[str, dict[str, Any], str, Any, dict[str, Any]]]:
    for step in range(n):
        tool = rng.choice(("search_docs", "read_file", "summarise", "lookup_customer"))
        yield tool, {"query": f"topic {step} {rng.randrange(10**6)}"}, "success", {"hits": rng.randrange(50)}, {
            "plan_step": step
        }


def _flaky_retry(rng: random.Random, n: int) -> Iterator[tuple[str, dict[str, Any], str, Any, dict[str, Any]]]:
    # 4 identical 503s then a success, under a declared budget of 5: a retry, never a loop.
    args = {"invoice": f"INV-{rng.randrange(10**5)}"}
    for attempt in range(4):
        yield "fetch_invoice", {**args, "attempt": attempt}, "error", {"status": 503, "error": "unavailable"}, {
            "retry_budget": 5
        }
    yield "fetch_invoice", {**args, "attempt": 4}, "success", {"total": 120}, {"retry_budget": 5}


def _runaway(rng: random.Random, n: int) -> Iterator[tuple[str, dict[str, Any], str, Any, dict[str, Any]]]:
    query = f"quarterly report {rng.randrange(10**4)}"
    for _ in range(n):
        yield "search_docs", {"query": query}, "error", {"error": "index unavailable", "code": "E_INDEX"}, {}


def _mutating(rng: random.Random, n: int) -> Iterator[tuple[str, dict[str, Any], str, Any, dict[str, Any]]]:
    # An incrementing counter the normaliser knows and a random token it does not: only the outcome repeats.
    query = f"refund policy {rng.randrange(10**4)}"
    for attempt in range(n):
        args = {"query": query, "attempt": attempt, "session_token": f"{rng.getrandbits(64):016x}"}
        yield "search_docs", args, "error", {"error": "rate limited", "code": 429}, {}


def _cycle(rng: random.Random, n: int) -> Iterator[tuple[str, dict[str, Any], str, Any, dict[str, Any]]]:
    path = f"/src/module_{rng.randrange(100)}.py"
    for _ in range(n):
        yield "read_file", {"path": path}, "success", {"text": "def f(): ..."}, {}
        yield "apply_patch", {"path": path, "patch": "--- a\n+++ b"}, "error", {"error": "hunk failed"}, {}


def _polling(rng: random.Random, n: int) -> Iterator[tuple[str, dict[str, Any], str, Any, dict[str, Any]]]:
    job = f"job-{rng.randrange(10**6)}"
    for _ in range(24):
        yield "check_job", {"job_id": job}, "success", {"state": "running"}, {}
    yield "check_job", {"job_id": job}, "success", {"state": "done"}, {}


def _duplicate_email(rng: random.Random, n: int) -> Iterator[tuple[str, dict[str, Any], str, Any, dict[str, Any]]]:
    args = {"to": f"customer{rng.randrange(1000)}@example.com", "subject": "Your refund", "body": "Approved."}
    for _ in range(6):
        yield "send_email", {**args, "request_id": f"{rng.getrandbits(32):08x}"}, "error", {
            "error": "ETIMEDOUT"
        }, {"side_effect": True}


def _endless(rng: random.Random, n: int) -> Iterator[tuple[str, dict[str, Any], str, Any, dict[str, Any]]]:
    for step in range(60):
        yield "browse", {"url": f"https://example.com/page/{step}"}, "success", {"links": step}, {}


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("healthy", None, _healthy),
    Scenario("flaky_retry", None, _flaky_retry),
    Scenario("runaway", "recursion", _runaway),
    Scenario("mutating_loop", "semantic_loop", _mutating),
    Scenario("cycle", "cycle", _cycle),
    Scenario("polling", None, _polling),
    Scenario("duplicate_email", "circuit_open", _duplicate_email),
    Scenario("endless", "iteration_ceiling", _endless),
)
_WEIGHTS = (40, 15, 10, 10, 5, 10, 5, 5)


@dataclass(frozen=True)
class SimRun:
    run_id: str
    agent_id: str
    scenario: Scenario
    events: list[Event]


def simulate_run(run_id: str, scenario: Scenario, rng: random.Random, start_ms: int,
                 calls: int = 12, gap_ms: int = 700) -> SimRun:
    """One run's telemetry: events spaced ``gap_ms`` apart (jittered) from ``start_ms``."""
    agent_id = f"{scenario.name.replace('_', '-')}-agent"
    events: list[Event] = []
    ts = start_ms
    for seq, (tool, args, outcome, result, extra) in enumerate(scenario.calls(rng, calls)):
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
    fleet = [
        simulate_run(f"run-{i:06d}", rng.choices(SCENARIOS, _WEIGHTS)[0], rng,
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
