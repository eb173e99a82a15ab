"""Local first, fleet-wide authority, against a real worker on the real broker.

``Guard.fleet`` folds each run's per-run rules itself (local rules, the default): the call that
triggers a halt runs, the next one is refused before its tool runs, at 10, 100 and 1,000 calls/s, and
a duplicate side effect is answered with the earlier result before the socket is touched. The worker
folds the same telemetry into the same decisions (same ids), which the runtime applies once; it also
makes what only it can: a halt on events the runtime's fold did not see the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from stream_app.client import Guard, GuardedRun, KafkaClientConfig, RunHalted
from stream_app.core import Policy

from .tools import Counted
from .workers import Fleet, consume

pytestmark = pytest.mark.integration

RATES = (10, 100, 1000)


@pytest.fixture(scope="module")
def fleet(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    deployment = Fleet(kafka_bootstrap, tmp_path_factory.mktemp("local-rules"), partitions=2)
    deployment.start_worker()
    try:
        yield deployment
    finally:
        deployment.stop()


def _guard(fleet: Fleet, **options: Any) -> Guard:
    return Guard.fleet(KafkaClientConfig(fleet.bootstrap), fleet.telemetry_topic, fleet.control_topic,
                       trusted_keys=fleet.trusted_keys(), **options)


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _paced(rate: float, calls: Callable[[int], Awaitable[Any]], limit: int = 200) -> int:
    """Make calls at ``rate`` per second until one raises RunHalted; return that call's number."""
    interval, next_at = 1.0 / rate, time.monotonic()
    for n in range(1, limit + 1):
        try:
            await calls(n)
        except RunHalted:
            return n
        next_at += interval
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    raise AssertionError(f"never halted in {limit} calls")


async def _confirmed(guard: Guard, run: GuardedRun) -> None:
    """The fleet's copy of every decision the runtime made arrives: same decision ids, none of its own."""
    await _until(lambda: 0 < guard.counters["local"] == guard.counters["confirmed"], "the fleet's copies")
    assert guard.counters["fleet_only"] == 0
    assert run.decision is not None


@pytest.mark.parametrize("rate", RATES)
async def test_the_4th_identical_failure_runs_and_the_5th_call_is_refused(fleet: Fleet, rate: int) -> None:
    async with _guard(fleet) as guard:
        run = guard.run(f"recursion-{rate}-{time.monotonic_ns()}")
        tool = Counted(OSError("index unavailable"))

        async def call(n: int) -> None:
            with contextlib.suppress(OSError):
                await run.call("search_docs", tool, {"query": "q3"})

        assert await _paced(rate, call) == 5
        assert tool.calls == 4
        assert run.decision is not None and (run.decision["verdict"], run.decision["evidence"]["seq"]) == ("recursion", 3)
        await _confirmed(guard, run)


@pytest.mark.parametrize("rate", RATES)
async def test_the_call_completing_the_4th_cycle_runs_and_the_next_is_refused(fleet: Fleet, rate: int) -> None:
    async with _guard(fleet) as guard:
        run = guard.run(f"cycle-{rate}-{time.monotonic_ns()}")
        read, patch = Counted("def f(): ..."), Counted(ValueError("hunk 1 failed"))

        async def call(n: int) -> None:
            if n % 2:
                await run.call("read_file", read, {"path": "/a.py"})
            else:
                with contextlib.suppress(ValueError):
                    await run.call("apply_patch", patch, {"path": "/a.py", "patch": "p"})

        assert await _paced(rate, call) == 9
        assert (read.calls, patch.calls) == (4, 4)
        assert run.decision is not None and run.decision["verdict"] == "cycle"
        await _confirmed(guard, run)


@pytest.mark.parametrize("rate", RATES)
async def test_the_51st_call_runs_and_the_52nd_is_refused(fleet: Fleet, rate: int) -> None:
    async with _guard(fleet) as guard:
        run = guard.run(f"ceiling-{rate}-{time.monotonic_ns()}")
        browse = Counted({"links": 3})

        async def call(n: int) -> None:
            await run.call("browse", browse, {"url": f"https://example.com/{n}"})

        assert await _paced(rate, call) == 52
        assert browse.calls == 51
        assert run.decision is not None and run.decision["verdict"] == "iteration_ceiling"
        await _confirmed(guard, run)


@pytest.mark.parametrize("rate", RATES)
async def test_duplicate_side_effects_are_answered_before_they_run(fleet: Fleet, rate: int) -> None:
    """Duplicates 2 and 3 get the earlier result (here, the earlier error) without running; the 4th
    raises RunHalted without running: one e-mail leaves, however fast the agent retries."""
    async with _guard(fleet) as guard:
        run = guard.run(f"email-{rate}-{time.monotonic_ns()}")
        timeout = TimeoutError("ETIMEDOUT talking to the mail relay")
        send_email = Counted(timeout)
        answers: list[BaseException] = []

        async def call(n: int) -> None:
            try:
                await run.call("send_email", send_email, {"to": "a@example.com", "subject": "refund"},
                               side_effect=True)
            except TimeoutError as exc:
                answers.append(exc)

        assert await _paced(rate, call) == 4
        assert send_email.calls == 1
        assert answers == [timeout, timeout, timeout]
        assert run.decision is not None and run.decision["verdict"] == "circuit_open"
        await _confirmed(guard, run)


async def test_six_emails_10_ms_apart_send_one(fleet: Fleet) -> None:
    """The report that started it: a runtime calling a side-effecting send_email 6 times 10 ms apart
    sent all 6 before any decision arrived. With local rules: 1."""
    async with _guard(fleet) as guard:
        run = guard.run(f"six-emails-{time.monotonic_ns()}")
        send_email = Counted(TimeoutError("ETIMEDOUT"))
        refused = 0
        for _ in range(6):
            try:
                await run.call("send_email", send_email, {"to": "a@example.com", "body": "ok"}, side_effect=True)
            except TimeoutError:
                pass
            except RunHalted:
                refused += 1
            await asyncio.sleep(0.01)
        assert (send_email.calls, refused) == (1, 3)
        # The runtime published every call, the answered ones marked; it wrote no control message.
        records = await consume(fleet.bootstrap, fleet.telemetry_topic, 0, timeout=5, settle=0.5)
        mine = [orjson.loads(r.value) for r in records if r.key == run.run_id.encode()]
        assert [e.get("attrs", {}).get("suppressed", False) for e in mine] == [False, True, True, True]
        await _confirmed(guard, run)


async def test_the_fleet_still_halts_what_the_runtime_saw_differently(fleet: Fleet) -> None:
    """One telemetry event lost on the way (the runtime's fold saw it, the worker did not): the runtime's
    fold sees a broken streak and does not halt; the worker sees 4 identical failures and does. Its
    halt reaches the runtime, is applied once, and halts the run's local state too."""
    async with _guard(fleet) as guard:
        assert guard._fleet is not None
        publish = guard._fleet.record

        async def lossy(event: dict[str, Any]) -> None:
            if event["tool"] != "ping":  # the one event that is dropped
                await publish(event)

        guard._fleet.record = lossy  # type: ignore[method-assign]
        run = guard.run(f"dropped-{time.monotonic_ns()}")
        search, ping = Counted(OSError("down")), Counted("pong")
        for tool in ("search", "search", "ping", "search", "search"):
            with contextlib.suppress(OSError):
                await run.call(tool, search if tool == "search" else ping, {"q": "x"})
        assert not run.halted and guard.counters["local"] == 0
        await _until(lambda: run.halted, "the fleet's halt")
        assert (guard.counters["fleet_only"], guard.counters["applied"]) == (2, 2)  # the fleet's warning and halt
        assert run.advice is not None and "failed the same way 3 times" in run.advice
        assert run.decision is not None and run.decision["trigger_event_id"]  # the worker's 4th failure
        with pytest.raises(RunHalted):
            await run.call("search", search, {"q": "x"})
        assert guard._local is not None
        assert guard._local.table.get(run.run_id).halted_by == run.decision["decision_id"]  # type: ignore[union-attr]


@pytest.mark.parametrize("local_rules", [True, False])
async def test_local_rules_off_leaves_the_run_to_the_fleet(fleet: Fleet, local_rules: bool) -> None:
    """A run whose calls several processes publish: ``guard.run(..., local_rules=False)`` makes no
    decision here; the fleet's halt arrives and refuses a later call. With local rules the same run is
    refused at its 5th call."""
    async with _guard(fleet) as guard:
        run = guard.run(f"shared-{local_rules}-{time.monotonic_ns()}", local_rules=local_rules)
        tool = Counted(OSError("down"))

        async def call(n: int) -> None:
            with contextlib.suppress(OSError):
                await run.call("search_docs", tool, {"query": "q"})

        refused_at = await _paced(20, call)
        assert run.decision is not None and run.decision["evidence"]["seq"] == 3  # both: the 4th call
        if local_rules:
            assert (refused_at, guard.counters["local"]) == (5, 2)  # the warning at the 3rd, the halt at the 4th
        else:
            assert refused_at >= 5 and guard.counters["local"] == 0 and guard.counters["fleet_only"] == 2


@pytest.mark.parametrize("local_rules", [True, False])
async def test_failures_differing_in_volatile_tokens_are_halted_on_their_fingerprint(fleet: Fleet,
                                                                                  local_rules: bool) -> None:
    """Each failure carries a fresh duration, request id and time, so no two result hashes are equal. The
    runtime sends the fingerprint it computed (never the text): its own fold and the fleet's halt the
    4th call alike (evidence.match fingerprint); without local rules the fleet does it alone."""
    async with _guard(fleet) as guard:
        run = guard.run(f"volatile-{local_rules}-{time.monotonic_ns()}", local_rules=local_rules)
        errors = iter(RuntimeError(f"upstream timeout after {30412 + 7 * n}ms (request req_{n:08x}) at "
                                   f"2026-12-01T15:25:{n:02d}Z") for n in range(100))

        def search_docs(**_: Any) -> None:
            raise next(errors)

        async def call(n: int) -> None:
            with contextlib.suppress(RuntimeError):  # not a TimeoutError: that would be transient, paused
                await run.call("search_docs", search_docs, {"query": "refund policy"})

        refused_at = await _paced(20, call)
        assert run.decision is not None
        assert (run.decision["verdict"], run.decision["evidence"]["seq"], run.decision["evidence"]["match"]) == (
            "recursion", 3, "fingerprint")
        if local_rules:
            assert refused_at == 5
            await _confirmed(guard, run)
        else:
            assert refused_at >= 5 and guard.counters["local"] == 0 and guard.counters["fleet_only"] == 2


async def test_workers_count_telemetry_of_another_policy(fleet: Fleet) -> None:
    """Telemetry carries the runtime's policy digest; a worker with another policy counts the events by
    agent and warns once per digest."""
    policy = Policy.from_mapping({"tools": {"search_docs": {"retry_budget": 5}}})
    async with _guard(fleet, policy=policy) as guard:
        for n in range(3):
            run = guard.run(f"policy-{n}-{time.monotonic_ns()}", agent_id="mismatched-agent")
            await run.call("search_docs", Counted({"hits": 1}), {"query": "q"})
    worker = fleet.workers[0]
    sample = 'loopwarden_policy_mismatch_total{agent_id="mismatched-agent"}'
    deadline = time.monotonic() + 30
    while worker.metrics().get(sample, 0) < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert worker.metrics()[sample] == 3
    warnings = [line for line in Path(worker.log_path).read_text().splitlines() if policy.digest[:16] in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0]
