"""Local first, fleet-wide authority, in-process: the guard's own fold of its runs, and how decisions the
fleet makes (fed here to the board as the halt listener would) act on it. The same behaviour against a
real worker and broker is in tests/integration/test_local_rules.py."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from stream_app.client import ControlBoard, Guard, GuardedRun, InvalidCall, RunHalted
from stream_app.client.publisher import error_head
from stream_app.core import Policy
from tests.integration.tools import Counted, telemetry_of


def _fleet(action: str, run_id: str = "run-1", verdict: str = "operator_halt") -> dict[str, Any]:
    """A decision as the workers publish it (an operator's, say)."""
    return {"schema_version": "1", "decision_id": uuid.uuid4().hex, "run_id": run_id, "action": action,
            "verdict": verdict, "trigger_event_id": f"op-{uuid.uuid4().hex}", "ts_ms": 1_000,
            "reason": "by operator", "evidence": {}}


async def _fail(run: GuardedRun, tool: Counted, n: int) -> None:
    for _ in range(n):
        with pytest.raises(OSError, match="down"):
            await run.call("search", tool, {"q": "x"})


async def test_a_local_decision_and_the_fleets_copy_are_one_decision() -> None:
    """The fold here halts at the 4th identical failure; the fleet's copy (same id) is confirmed once,
    however often it is re-sent; a decision only the fleet made is counted as such."""
    guard = Guard.in_process()
    applied: list[dict[str, Any]] = []
    confirmed: list[dict[str, Any]] = []
    guard.on_decision(applied.append)
    guard.board.add_confirmation_callback(confirmed.append)
    run = guard.run("run-1")
    await _fail(run, Counted(OSError("down")), 4)
    advice, local = applied
    assert advice["action"] == "advise" and local["action"] == "halt"
    assert guard.board.apply(dict(local)) == "duplicate"  # the fleet's copy
    assert guard.board.apply(dict(local)) == "duplicate"  # re-sent after a worker crash
    assert guard.board.apply(_fleet("alert", verdict="polling")) == "applied"
    counters = guard.counters
    assert (counters["local"], counters["confirmed"], counters["fleet_only"], counters["applied"]) == (2, 1, 1, 3)
    assert confirmed == [local]
    assert run.advice == advice["reason"]


async def test_a_fleet_halt_halts_the_local_fold_too() -> None:
    """An operator's halt (made by the fleet alone) refuses the next call and stops the local fold, as
    the worker's state stops: the fold makes no decision of its own for the halted run."""
    guard = Guard.in_process()
    run = guard.run("run-1")
    tool = Counted(OSError("down"))
    await _fail(run, tool, 2)
    halt = _fleet("halt")
    guard.board.apply(halt)
    with pytest.raises(RunHalted) as refused:
        await run.call("search", tool, {"q": "x"})
    assert (refused.value.decision_id, tool.calls) == (halt["decision_id"], 2)
    assert guard._local is not None
    assert guard._local.table.get("run-1").halted_by == halt["decision_id"]  # type: ignore[union-attr]


async def test_a_fleet_resume_lifts_a_local_halt_and_resets_the_streaks() -> None:
    """After an operator's resume the run starts afresh, as the worker's does: the 4th identical failure
    after the resume halts again, not the 1st."""
    guard = Guard.in_process()
    run = guard.run("run-1")
    tool = Counted(OSError("down"))
    await _fail(run, tool, 4)
    assert run.halted
    guard.board.apply(_fleet("resume", verdict="operator_resume"))
    assert not run.halted
    await _fail(run, tool, 3)
    assert not run.halted
    await _fail(run, tool, 1)
    assert run.halted and tool.calls == 8


async def test_a_halt_landing_while_a_bound_task_awaits_a_tool_raises_run_halted_there() -> None:
    """The fleet's halt cancels the bound task's await of the tool; the call raises RunHalted in its
    place (not CancelledError), and the task is not left cancelled."""
    guard = Guard.in_process()
    run = guard.run("run-1")
    started = asyncio.Event()

    async def slow_search(q: str) -> str:
        started.set()
        await asyncio.sleep(30)
        return "never"

    async def agent() -> str:
        run.bind_task()
        try:
            await run.call("search", slow_search, {"q": "x"})
        except RunHalted as halted:
            await asyncio.sleep(0)  # the task can still await: it is not cancelled any more
            return halted.verdict
        return "not halted"

    task = asyncio.create_task(agent())
    await started.wait()
    guard.board.apply(_fleet("halt"))
    assert await asyncio.wait_for(task, 5) == "operator_halt"


async def test_bound_turns_a_halt_during_a_model_turn_into_run_halted() -> None:
    guard = Guard.in_process()
    run = guard.run("run-1")
    turn = asyncio.Event()

    async def agent() -> str:
        try:
            async with run.bound():
                turn.set()
                await asyncio.sleep(30)  # the model thinks
        except RunHalted as halted:
            return halted.verdict
        return "not halted"

    task = asyncio.create_task(agent())
    await turn.wait()
    guard.board.apply(_fleet("halt"))
    assert await asyncio.wait_for(task, 5) == "operator_halt"


async def test_someone_elses_cancellation_is_not_turned_into_run_halted() -> None:
    guard = Guard.in_process()
    run = guard.run("run-1")
    turn = asyncio.Event()

    async def agent() -> None:
        async with run.bound():
            turn.set()
            await asyncio.sleep(30)

    task = asyncio.create_task(agent())
    await turn.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_an_in_process_guard_has_no_run_without_local_rules() -> None:
    with pytest.raises(InvalidCall, match="local_rules=False needs the fleet"):
        Guard.in_process().run("run-1", local_rules=False)


async def test_every_event_carries_the_policy_digest() -> None:
    policy = Policy.from_mapping({"tools": {"search": {"retry_budget": 1}}})
    guard = Guard.in_process(policy)
    events = telemetry_of(guard)
    await guard.run("run-1").call("search", Counted("ok"), {"q": "x"})
    assert [e["policy_digest"] for e in events] == [policy.digest]
    assert policy.digest != Policy().digest and len(policy.digest) == 64


@pytest.mark.parametrize("opted_in", [True, False])
async def test_error_head_is_sent_only_for_tools_the_policy_opts_in(opted_in: bool) -> None:
    policy = Policy.from_mapping({"tools": {"login": {"send_error_head": opted_in}}})
    guard = Guard.in_process(policy)
    events = telemetry_of(guard)
    run = guard.run("run-1")
    with pytest.raises(PermissionError):
        await run.call("login", Counted(PermissionError("denied for token=abc123 " + "x" * 400)), {"u": "bob"})
    assert events[0]["error_class"] == "PermissionError"
    if opted_in:
        assert events[0]["error_head"].startswith("denied for token=*** xxx")
        assert len(events[0]["error_head"].encode()) == 256
    else:
        assert "error_head" not in events[0]


async def test_a_halt_names_the_failure_as_the_telemetry_did() -> None:
    policy = Policy.from_mapping({"tools": {"search": {"send_error_head": True}}})
    guard = Guard.in_process(policy)
    run = guard.run("run-1")
    for _ in range(4):
        with pytest.raises(OSError, match="upstream"):
            await run.call("search", Counted(OSError("upstream timeout after 30 s")), {"q": "x"})
    decision = run.decision
    assert decision is not None
    assert decision["evidence"]["error_class"] == "OSError"
    assert decision["evidence"]["error_head"] == "upstream timeout after 30 s"
    assert decision["reason"].endswith("it failed with OSError: upstream timeout after 30 s")


@pytest.mark.parametrize(
    ("message", "head"),
    [
        ("401 for token=abc123", "401 for token=***"),  # a secret's name, then its value
        ("password: 'hunter2' refused", "password: *** refused"),
        ("Authorization: Bearer eyJhbGciOi.x.y failed", "Authorization: *** *** failed"),
        ("GET https://bob:hunter2@api.example/x: 500", "GET https://***@api.example/x: 500"),
        ("session_token=ab12; retry", "session_token=***; retry"),
        ("HTTP 503 from upstream after 3 tries", "HTTP 503 from upstream after 3 tries"),  # nothing secret
    ],
)
def test_error_heads_mask_secrets_in_the_text(message: str, head: str) -> None:
    assert error_head(message) == head


def test_the_board_counts_a_fleet_copy_only_for_local_decisions() -> None:
    board = ControlBoard(watch_all=True)
    decision = _fleet("halt")
    assert board.apply(decision) == "applied"
    assert board.apply(dict(decision)) == "duplicate"  # a redelivered fleet decision is no confirmation
    assert (board.counters["fleet_only"], board.counters["confirmed"], board.counters["local"]) == (1, 0, 0)
