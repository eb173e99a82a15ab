"""Threads through the SDK: runs that say which thread they work on and what started them, the thread
rules folded in process, and a thread halt refusing new runs on the thread (``ThreadHalted``) while the
runs going on finish."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from stream_app.client import ControlBoard, Guard, RunHalted, ThreadHalted
from stream_app.core import Policy

REPO = Path(__file__).resolve().parents[2]
TELEMETRY_SCHEMA = json.loads((REPO / "schemas" / "telemetry.v1.json").read_text())


def _guard() -> tuple[Guard, list[dict[str, Any]]]:
    guard = Guard.in_process(Policy(), clock=lambda: 1_700_000_000_000)
    events: list[dict[str, Any]] = []
    local = guard._local
    assert local is not None
    fold = local.fold

    def recording(event: dict[str, Any]) -> None:
        events.append(event)
        fold(event)

    local.fold = recording  # type: ignore[method-assign]
    return guard, events


def ok(**_: Any) -> str:
    return "ok"


async def test_a_bot_whose_comment_triggers_its_own_next_run_is_refused_a_fourth_run() -> None:
    """A user's run, then bot runs each caused by the one before on the same PR: the first event of the
    generation-3 run halts the thread; that run finishes, the next one is refused at Guard.run, and the
    same thread of another tenant, or another thread, still starts."""
    guard, events = _guard()
    first = guard.run("u", tenant="acme", thread_key="pr-7", trigger="user")
    await first.call("gh.comment", ok, {"body": "please fix"})
    cause = "u"
    for n in range(1, 4):
        run = guard.run(f"bot-{n}", tenant="acme", thread_key="pr-7", trigger="webhook", caused_by_run_id=cause)
        await run.call("gh.comment", ok, {"body": f"fixed, attempt {n}"})
        cause = run.run_id
    assert await run.call("gh.comment", ok, {"body": "one more"}) == "ok"  # the run going on finishes
    with pytest.raises(ThreadHalted) as info:
        guard.run("bot-4", tenant="acme", thread_key="pr-7", trigger="webhook", caused_by_run_id="bot-3")
    assert info.value.verdict == "self_trigger" and (info.value.tenant, info.value.thread_key) == ("acme", "pr-7")
    assert info.value.run_id == "bot-4" and isinstance(info.value, RunHalted)
    assert "thread pr-7 was halted" in str(info.value)
    assert guard.run("bot-4", tenant="other", thread_key="pr-7", trigger="webhook").call is not None
    assert guard.run("bot-5", tenant="acme", thread_key="pr-8", trigger="webhook").call is not None
    for event in events:
        jsonschema.validate(event, TELEMETRY_SCHEMA)
    assert {(e["thread_key"], e["trigger"]) for e in events if e["run_id"] == "bot-2"} == {("pr-7", "webhook")}
    assert {e.get("caused_by_run_id") for e in events if e["run_id"] == "bot-2"} == {"bot-1"}


async def test_scheduled_runs_failing_into_the_same_error_halt_the_schedules_thread() -> None:
    guard, _ = _guard()

    def unauthorized(**_: Any) -> None:
        raise PermissionError("401 unauthorized")

    for night in range(3):
        run = guard.run(f"nightly-{night}", tenant="acme", thread_key="nightly-report", trigger="schedule")
        with pytest.raises(PermissionError):
            await run.call("crm.export", unauthorized, {"day": night})
    with pytest.raises(ThreadHalted) as info:
        guard.run("nightly-3", tenant="acme", thread_key="nightly-report", trigger="schedule")
    assert info.value.verdict == "schedule_failing"
    assert info.value.decision["evidence"]["runs"] == ["nightly-0", "nightly-1", "nightly-2"]


async def test_a_fleet_thread_halt_refuses_new_runs_until_resumed() -> None:
    guard, _ = _guard()
    halt = {"schema_version": "1", "decision_id": "d" * 32, "scope": "thread", "tenant": "acme",
            "thread_key": "issue-9", "action": "halt", "verdict": "self_trigger", "trigger_event_id": "e",
            "trigger_run_id": "r", "ts_ms": 1, "reason": "a chain", "evidence": {"rule": "generation"}}
    going = guard.run("going", tenant="acme", thread_key="issue-9")
    assert guard.board.apply(halt) == "applied"
    assert await going.call("gh.read", ok, {}) == "ok"  # a thread halt stops no run already going
    with pytest.raises(ThreadHalted):
        guard.run("new", tenant="acme", thread_key="issue-9")
    assert guard.board.apply({**halt, "decision_id": "e" * 32, "action": "resume"}) == "applied"
    assert guard.run("new", tenant="acme", thread_key="issue-9").call is not None


def test_a_thread_message_without_its_tenant_or_key_is_malformed() -> None:
    board = ControlBoard(watch_all=True)
    base = {"decision_id": "a" * 32, "action": "halt", "verdict": "self_trigger", "ts_ms": 1, "reason": "r",
            "evidence": {}, "scope": "thread"}
    assert board.apply({**base, "tenant": "t"}) == "malformed"  # no thread_key
    assert board.apply({**base, "decision_id": "b" * 32, "thread_key": "k"}) == "malformed"  # no tenant
    assert board.apply({**base, "decision_id": "c" * 32, "thread_key": "k", "tenant": ""}) == "applied"
    assert board.thread_halt(None, "k") is not None and board.thread_halt("t", "k") is None
