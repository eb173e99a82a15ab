"""The catalogue of simulated runs: every kind of run a platform team sees, and the halt it must get.

Each kind has two faces, kept side by side so that adding or changing a kind is one place:

- ``telemetry(rng, n)``: the calls of one run as synthetic telemetry (tool, args, outcome, result,
  extra fields), what ``fleet_sim`` writes for replay, the golden files, the parity tests and the
  benchmarks (deterministic per seed);
- ``agent(run, rng)``: the same kind of agent acting live through a guarded run (``loopwarden demo``):
  real tool functions that succeed or raise, an agent that keeps calling until the guard refuses.

The two faces of a kind make the same halt at the same call, though not the same bytes (a live tool's
result is its own). ``expected_halt`` is what makes false halts and misses countable. Which kinds a
simulation uses, and in what proportion, is its mix (``FLEET_MIX``, ``DEMO_MIX``).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

#: One simulated call: tool, arguments, outcome, result, extra telemetry fields.
Step = tuple[str, dict[str, Any], str, Any, dict[str, Any]]
#: A runaway agent that is never stopped gives up after this many calls (and is reported as missed).
MAX_CALLS = 200


class ToolFailed(Exception):
    """What the simulated tools raise: a tool's own failure (not a loopwarden error), which the guard
    reports as the call's error outcome and re-raises to the agent."""


class AgentRun(Protocol):
    """What a live agent calls its tools through (``GuardedRun``, with a model turn before each call)."""

    async def call(self, tool: str, fn: Callable[..., Any], /, args: dict[str, Any], **options: Any) -> Any: ...

    def effect(self) -> None:
        """A tool acted on the outside world (an e-mail went out): counted, to show duplicates."""


@dataclass(frozen=True)
class Scenario:
    """A kind of run: its calls, its live agent, and the halt verdict it must get (None: must not halt)."""

    name: str
    expected_halt: str | None
    telemetry: Callable[[random.Random, int], Iterator[Step]]
    agent: Callable[[AgentRun, random.Random], Awaitable[None]]

    @property
    def agent_id(self) -> str:
        return f"{self.name.replace('_', '-')}-agent"


async def _latency(rng: random.Random) -> None:
    await asyncio.sleep(rng.uniform(0.02, 0.08))


# -- healthy: distinct successful calls with an advancing plan ------------------------------------

def _healthy(rng: random.Random, n: int) -> Iterator[Step]:
    for step in range(n):
        tool = rng.choice(("search_docs", "read_file", "summarise", "lookup_customer"))
        yield tool, {"query": f"topic {step} {rng.randrange(10**6)}"}, "success", {"hits": rng.randrange(50)}, {
            "plan_step": step
        }


async def _healthy_agent(run: AgentRun, rng: random.Random) -> None:
    async def search(query: str) -> dict[str, Any]:
        await _latency(rng)
        return {"hits": rng.randrange(1, 40), "query": query}

    for step in range(12):
        await run.call("search_docs", search, {"query": f"topic {step} {rng.randrange(10**6)}"}, plan_step=step)


# -- flaky_retry: 4 identical 503s then a success, under a declared budget of 5: a retry, never a loop

def _flaky_retry(rng: random.Random, n: int) -> Iterator[Step]:
    args = {"invoice": f"INV-{rng.randrange(10**5)}"}
    for attempt in range(4):
        yield "fetch_invoice", {**args, "attempt": attempt}, "error", {"status": 503, "error": "unavailable"}, {
            "retry_budget": 5
        }
    yield "fetch_invoice", {**args, "attempt": 4}, "success", {"total": 120}, {"retry_budget": 5}


async def _flaky_retry_agent(run: AgentRun, rng: random.Random) -> None:
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


# -- runaway: the identical call failing identically, again and again: recursion --------------------

def _runaway(rng: random.Random, n: int) -> Iterator[Step]:
    query = f"quarterly report {rng.randrange(10**4)}"
    for _ in range(n):
        yield "search_docs", {"query": query}, "error", {"error": "index unavailable", "code": "E_INDEX"}, {}


async def _runaway_agent(run: AgentRun, rng: random.Random) -> None:
    async def search(query: str) -> dict[str, Any]:
        await _latency(rng)
        raise ToolFailed("index unavailable")

    query = f"quarterly report {rng.randrange(10**4)}"
    for _ in range(MAX_CALLS):
        try:
            await run.call("search_docs", search, {"query": query})
        except ToolFailed:
            continue


# -- mutating_loop: arguments change (a counter the normaliser knows, a token it does not), the
#    failure does not: a semantic loop

def _mutating(rng: random.Random, n: int) -> Iterator[Step]:
    query = f"refund policy {rng.randrange(10**4)}"
    for attempt in range(n):
        args = {"query": query, "attempt": attempt, "session_token": f"{rng.getrandbits(64):016x}"}
        yield "search_docs", args, "error", {"error": "rate limited", "code": 429}, {}


async def _mutating_agent(run: AgentRun, rng: random.Random) -> None:
    async def search(query: str, attempt: int, client_state: str) -> dict[str, Any]:
        await _latency(rng)
        raise ToolFailed("429 rate limited")

    for attempt in range(MAX_CALLS):
        args = {"query": "refund policy", "attempt": attempt, "client_state": f"{rng.getrandbits(64):016x}"}
        try:
            await run.call("search_docs", search, args)
        except ToolFailed:
            continue


# -- cycle: read a file, fail to patch it, read it again...: a 2-call cycle -------------------------

def _cycle(rng: random.Random, n: int) -> Iterator[Step]:
    path = f"/src/module_{rng.randrange(100)}.py"
    for _ in range(n):
        yield "read_file", {"path": path}, "success", {"text": "def f(): ..."}, {}
        yield "apply_patch", {"path": path, "patch": "--- a\n+++ b"}, "error", {"error": "hunk failed"}, {}


async def _cycle_agent(run: AgentRun, rng: random.Random) -> None:
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


# -- polling: the same successful answer many times, then done: advisory only, never a halt ---------

def _polling(rng: random.Random, n: int) -> Iterator[Step]:
    job = f"job-{rng.randrange(10**6)}"
    for _ in range(24):
        yield "check_job", {"job_id": job}, "success", {"state": "running"}, {}
    yield "check_job", {"job_id": job}, "success", {"state": "done"}, {}


async def _polling_agent(run: AgentRun, rng: random.Random) -> None:
    remaining = iter(range(23))

    async def check_job(job_id: str) -> dict[str, str]:
        await _latency(rng)
        return {"state": "running" if next(remaining, None) is not None else "done"}

    job = f"job-{rng.randrange(10**6)}"
    while (await run.call("check_job", check_job, {"job_id": job}))["state"] != "done":
        pass


# -- duplicate_email: a side effect that went out but timed out, repeated: suppressed, then the
#    circuit opens

def _duplicate_email(rng: random.Random, n: int) -> Iterator[Step]:
    args = {"to": f"customer{rng.randrange(1000)}@example.com", "subject": "Your refund", "body": "Approved."}
    for _ in range(6):
        yield "send_email", {**args, "request_id": f"{rng.getrandbits(32):08x}"}, "error", {
            "error": "ETIMEDOUT"
        }, {"side_effect": True}


async def _duplicate_email_agent(run: AgentRun, rng: random.Random) -> None:
    async def send_email(to: str, subject: str, body: str, request_id: str) -> None:
        await _latency(rng)
        run.effect()  # the mail goes out, but the relay times out before it says so
        raise ToolFailed("ETIMEDOUT talking to the mail relay")

    args = {"to": f"customer{rng.randrange(1000)}@example.com", "subject": "Your refund", "body": "Approved."}
    for _ in range(MAX_CALLS):
        try:
            await run.call("send_email", send_email, {**args, "request_id": uuid.uuid4().hex}, side_effect=True)
        except ToolFailed:
            continue


# -- endless: distinct successful calls that never finish: the iteration ceiling ---------------------

def _endless(rng: random.Random, n: int) -> Iterator[Step]:
    for step in range(60):
        yield "browse", {"url": f"https://example.com/page/{step}"}, "success", {"links": step}, {}


async def _endless_agent(run: AgentRun, rng: random.Random) -> None:
    async def browse(url: str) -> dict[str, Any]:
        await _latency(rng)
        return {"links": len(url)}

    for step in range(MAX_CALLS):
        await run.call("browse", browse, {"url": f"https://example.com/page/{step}"})


CATALOGUE: tuple[Scenario, ...] = (
    Scenario("healthy", None, _healthy, _healthy_agent),
    Scenario("flaky_retry", None, _flaky_retry, _flaky_retry_agent),
    Scenario("runaway", "recursion", _runaway, _runaway_agent),
    Scenario("mutating_loop", "semantic_loop", _mutating, _mutating_agent),
    Scenario("cycle", "cycle", _cycle, _cycle_agent),
    Scenario("polling", None, _polling, _polling_agent),
    Scenario("duplicate_email", "circuit_open", _duplicate_email, _duplicate_email_agent),
    Scenario("endless", "iteration_ceiling", _endless, _endless_agent),
)
BY_NAME: Mapping[str, Scenario] = {scenario.name: scenario for scenario in CATALOGUE}

#: A mix: (kind, weight) in draw order. The order is part of a mix (a seeded draw depends on it).
Mix = tuple[tuple[str, int], ...]
#: The replay corpus: mostly healthy runs, every loop kind, redeliveries added by ``fleet_sim``.
FLEET_MIX: Mix = (("healthy", 40), ("flaky_retry", 15), ("runaway", 10), ("mutating_loop", 10), ("cycle", 5),
                  ("polling", 10), ("duplicate_email", 5), ("endless", 5))
#: ``loopwarden demo``: more runaways than a real fleet has, so a minute shows every verdict.
DEMO_MIX: Mix = (("healthy", 30), ("flaky_retry", 15), ("polling", 8), ("runaway", 15), ("mutating_loop", 12),
                 ("cycle", 8), ("duplicate_email", 12))


def kinds(mix: Mix) -> tuple[list[Scenario], list[int]]:
    """The scenarios of ``mix`` and their weights, in its draw order."""
    return [BY_NAME[name] for name, _ in mix], [weight for _, weight in mix]
