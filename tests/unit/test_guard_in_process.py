"""The runtime SDK without Kafka: the in-process guard, the telemetry it builds, the control board it obeys,
and the Kafka settings object."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest

import stream_app.client as client
from stream_app.bus.wire import encode_telemetry
from stream_app.client import (
    CallIds,
    ControlBoard,
    FinishedCall,
    Guard,
    GuardedRun,
    InvalidCall,
    KafkaClientConfig,
    KafkaConfigError,
    RunHalted,
    TelemetryBuilder,
    ToolOutcome,
)
from stream_app.core import Policy, decode_event, semantic_hash

REPO = Path(__file__).resolve().parents[2]
TELEMETRY_SCHEMA = json.loads((REPO / "schemas" / "telemetry.v1.json").read_text())


class Counted:
    """A tool that counts its executions and answers from a script (an exception is raised)."""

    def __init__(self, *answers: Any) -> None:
        self.answers = answers
        self.calls = 0

    def __call__(self, **kwargs: Any) -> Any:
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if isinstance(answer, BaseException):
            raise answer
        return answer


async def attempt(
    run: GuardedRun, tool: str, fn: Callable[..., Any], args: dict[str, Any], **options: Any
) -> Any:
    """One call the way an agent's retry loop makes it: a tool's own exception is an answer, not the end."""
    try:
        return await run.call(tool, fn, args, **options)
    except RunHalted:
        raise
    except Exception as exc:  # noqa: BLE001 - any tool error is an answer to retry on
        return exc


class FakeClock:
    """Epoch milliseconds that only move when told to."""

    def __init__(self, now_ms: int = 1_764_000_000_000) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


# --------------------------------------------------------------------------------------------------
# Halting runaways, letting retries through


async def test_runaway_tool_is_refused_after_its_fourth_identical_failure() -> None:
    """A tool that always fails the same way runs 4 times; the 5th call raises RunHalted without running it."""
    run = Guard.in_process().run("run-runaway")
    tool = Counted(RuntimeError("index unavailable"))
    for _ in range(4):
        with pytest.raises(RuntimeError):
            await run.call("search_docs", tool, {"query": "quarterly report"})
    with pytest.raises(RunHalted) as halted:
        await run.call("search_docs", tool, {"query": "quarterly report"})
    assert tool.calls == 4
    assert halted.value.verdict == "recursion"
    assert halted.value.run_id == "run-runaway"
    assert run.halted and run.decision is not None and run.decision["evidence"]["count"] == 4


async def test_halted_run_refuses_every_tool_not_only_the_looping_one() -> None:
    """After a halt, a different tool with different arguments is refused too."""
    run = Guard.in_process().run("run-1")
    for _ in range(4):
        await attempt(run, "search_docs", Counted(RuntimeError("down")), {"q": "x"})
    other = Counted({"ok": True})
    with pytest.raises(RunHalted):
        await run.call("read_file", other, {"path": "/a"})
    assert other.calls == 0


async def test_flaky_tool_that_recovers_within_its_retry_budget_completes() -> None:
    """4 identical errors then a success, with retry_budget=5, is a legitimate retry: no halt."""
    run = Guard.in_process().run("run-flaky")
    tool = Counted(*[RuntimeError("HTTP 503")] * 4, {"total": 120})
    answers = [
        await attempt(run, "fetch_invoice", tool, {"invoice": "INV-1"}, retry_budget=5) for _ in range(5)
    ]
    assert answers[-1] == {"total": 120}
    assert tool.calls == 5
    assert not run.halted


async def test_same_flaky_tool_without_a_declared_budget_is_halted() -> None:
    """The budget is what lets the previous test through: with the default of 3 the 4th error halts."""
    run = Guard.in_process().run("run-flaky")
    tool = Counted(*[RuntimeError("HTTP 503")] * 4, {"total": 120})
    for _ in range(4):
        await attempt(run, "fetch_invoice", tool, {"invoice": "INV-1"})
    with pytest.raises(RunHalted):
        await run.call("fetch_invoice", tool, {"invoice": "INV-1"})


async def test_arguments_differing_only_in_noise_fields_are_the_same_call() -> None:
    """nonce, attempt, requestId and a timestamp change every time, yet the calls are identical: the halt
    is `recursion` (identical arguments), not `semantic_loop`, and the arguments were verified."""
    run = Guard.in_process().run("run-noise")
    tool = Counted(RuntimeError("index unavailable"))
    for attempt_no in range(4):
        args = {
            "query": "refund policy",
            "nonce": uuid.uuid4().hex,
            "attempt": attempt_no,
            "requestId": f"req-{attempt_no}",
            "created_at": f"2025-01-0{attempt_no + 1}",
        }
        await attempt(run, "search_docs", tool, args)
    assert run.decision is not None
    assert run.decision["verdict"] == "recursion"
    assert run.decision["evidence"]["args_verified"] is True
    assert run.decision["evidence"]["args_hash"] == semantic_hash({"query": "refund policy"})


async def test_a_halt_decided_on_a_call_is_in_force_before_the_next_call() -> None:
    """The halting call itself still returns the tool's outcome; the refusal starts with the next call."""
    run = Guard.in_process().run("run-1")
    tool = Counted(RuntimeError("down"))
    for _ in range(3):
        await attempt(run, "search_docs", tool, {"q": "x"})
    assert not run.halted
    with pytest.raises(RuntimeError):
        await run.call("search_docs", tool, {"q": "x"})
    assert run.halted


# --------------------------------------------------------------------------------------------------
# Side effects: duplicates are handed the earlier result


@pytest.mark.parametrize(
    ("policy", "side_effect"),
    [
        # the call site says the tool acts on the world
        (Policy(), True),
        # the policy says so and the call site leaves it to the policy
        (Policy(tools={"send_email": {"side_effect": True}}), None),
    ],
)
async def test_repeated_side_effect_is_handed_the_earlier_result_then_the_circuit_opens(
    policy: Policy, side_effect: bool | None
) -> None:
    """send_email with the same arguments: the 1st call sends; the 2nd and 3rd get the 1st result back
    without sending; the 4th opens the circuit (RunHalted, circuit_open). One e-mail in all."""
    run = Guard.in_process(policy).run("run-mail")
    receipt = {"message_id": "m-1"}
    send = Counted(receipt)
    args = {"to": "customer@example.com", "subject": "Your refund", "body": "Approved."}
    answers = [await run.call("send_email", send, args, side_effect=side_effect) for _ in range(3)]
    assert answers == [receipt] * 3 and all(a is receipt for a in answers)
    with pytest.raises(RunHalted) as halted:
        await run.call("send_email", send, args, side_effect=side_effect)
    assert halted.value.verdict == "circuit_open"
    assert send.calls == 1


async def test_failed_side_effect_repeated_gets_the_earlier_exception_again() -> None:
    """A timed-out send may have gone out: repeating it hands back the same exception, without sending."""
    run = Guard.in_process().run("run-mail")
    timeout = TimeoutError("ETIMEDOUT")
    send = Counted(timeout, {"message_id": "m-2"})
    for _ in range(3):
        with pytest.raises(TimeoutError) as raised:
            await run.call("send_email", send, {"to": "a@example.com"}, side_effect=True)
        assert raised.value is timeout
    assert send.calls == 1


async def test_side_effect_with_other_arguments_is_not_a_duplicate() -> None:
    """Two different e-mails are two sends."""
    run = Guard.in_process().run("run-mail")
    send = Counted({"ok": True})
    for to in ("a@example.com", "b@example.com"):
        await run.call("send_email", send, {"to": to}, side_effect=True)
    assert send.calls == 2


async def test_duplicate_after_the_side_effect_window_is_executed_again() -> None:
    """The same send 60 s + 1 ms later is outside the window: it is sent again."""
    clock = FakeClock()
    run = Guard.in_process(clock=clock).run("run-mail")
    send = Counted({"ok": True})
    await run.call("send_email", send, {"to": "a@example.com"}, side_effect=True)
    clock.now_ms += 60_001
    await run.call("send_email", send, {"to": "a@example.com"}, side_effect=True)
    assert send.calls == 2


async def test_repeated_call_without_side_effect_is_executed_every_time() -> None:
    """Only side-effecting calls are handed back; a read is simply repeated."""
    run = Guard.in_process().run("run-read")
    read = Counted({"text": "hello"})
    for _ in range(3):
        await run.call("read_file", read, {"path": "/a"})
    assert read.calls == 3


# --------------------------------------------------------------------------------------------------
# Tools of every shape, outcomes of every kind


def _sync_tool(q: str) -> Any:
    raise LookupError(f"no index for {q}")


async def _async_tool(q: str) -> Any:
    await asyncio.sleep(0)
    raise LookupError(f"no index for {q}")


def _threaded_tool(q: str) -> Awaitable[Any]:
    return asyncio.to_thread(_sync_tool, q)


@pytest.mark.parametrize("fn", [_sync_tool, _async_tool, _threaded_tool], ids=["sync", "async", "to_thread"])
async def test_sync_async_and_awaitable_returning_tools_are_all_guarded(fn: Callable[..., Any]) -> None:
    """Each kind of tool raises its own error to the caller and is halted after 4 identical failures."""
    run = Guard.in_process().run("run-kinds")
    for _ in range(4):
        with pytest.raises(LookupError, match="no index for x"):
            await run.call("search_docs", fn, {"q": "x"})
    with pytest.raises(RunHalted):
        await run.call("search_docs", fn, {"q": "x"})


@pytest.mark.parametrize("fn", [lambda: 42, lambda: asyncio.sleep(0, result=42)], ids=["sync", "async"])
async def test_a_successful_tool_returns_its_value(fn: Callable[..., Any]) -> None:
    """The guard is transparent to a tool that works."""
    assert await Guard.in_process().run("run-ok").call("answer", fn) == 42


@pytest.mark.parametrize(
    ("returned", "outcome", "caller_gets"),
    [
        (None, "empty", None),  # nothing at all
        ("", "empty", ""),  # an empty string
        ([], "empty", []),  # an empty list
        ({}, "empty", {}),  # an empty object
        (ToolOutcome("noop", {"changed": 0}), "noop", {"changed": 0}),  # the tool says it did nothing
        (ToolOutcome("error", {"status": 500}), "error", {"status": 500}),  # an error returned, not raised
    ],
)
async def test_failing_outcomes_are_classified_and_four_identical_ones_halt(
    returned: Any, outcome: str, caller_gets: Any
) -> None:
    """Empty results and explicit failing outcomes count as failures; the caller gets the plain result."""
    run = Guard.in_process().run("run-outcomes")
    answers = [await run.call("lookup", lambda **_: returned, {"id": 7}) for _ in range(4)]
    assert answers == [caller_gets] * 4
    assert run.decision is not None
    assert (run.decision["verdict"], run.decision["evidence"]["outcome"]) == ("recursion", outcome)


async def test_identical_successes_do_not_halt() -> None:
    """Polling a job that keeps answering 'running' is not a loop (20 calls: an advisory alert only)."""
    guard = Guard.in_process()
    seen: list[dict[str, Any]] = []
    guard.on_decision(seen.append)
    run = guard.run("run-poll")
    for _ in range(20):
        assert await run.call("check_job", lambda **_: {"state": "running"}, {"job_id": "j-1"}) == {
            "state": "running"
        }
    assert not run.halted
    assert [(d["action"], d["verdict"]) for d in seen] == [("alert", "polling")]


def test_tool_outcome_refuses_an_unknown_outcome() -> None:
    """A typo in an explicit outcome is caught where it is made."""
    with pytest.raises(ValueError, match="outcome must be one of"):
        ToolOutcome("failed")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"retry_budget": -1}, "retry_budget"),  # the contract's minimum is 0
        ({"retry_budget": 10_001}, "retry_budget"),  # and its maximum 10 000
        ({"plan_step": "2"}, "plan_step"),  # an integer, not a string
        ({"ids": CallIds(tool_call_id="")}, "ids.tool_call_id"),  # ids are non-empty strings
        ({"ids": CallIds(trace_id="f" * 513)}, "ids.trace_id"),  # of at most 512 characters
    ],
)
async def test_invalid_call_options_are_refused_before_the_tool_runs(
    options: dict[str, Any], field: str
) -> None:
    """What the telemetry contract would reject is rejected up front, so the tool never runs unreported."""
    tool = Counted(1)
    with pytest.raises(ValueError, match=field):
        await Guard.in_process().run("run-1").call("t", tool, {}, **options)
    assert tool.calls == 0


async def test_a_frameworks_trace_ids_reach_the_decision_its_call_triggers() -> None:
    """The trace and span ids a framework gives a call travel in its telemetry to the halt it triggers."""
    guard = Guard.in_process()
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    run = guard.run("run-1")
    for n in range(4):
        ids = CallIds(tool_call_id=f"call-{n}", trace_id="0af7651916cd43dd8448eb211c80319c", span_id=f"{n:016x}")
        await attempt(run, "search", Counted(RuntimeError("down")), {"q": "x"}, ids=ids)
    assert [(d["action"], d["trace_id"], d["span_id"]) for d in decisions] == [
        ("advise", "0af7651916cd43dd8448eb211c80319c", f"{2:016x}"),  # the warning comes with the 3rd
        ("halt", "0af7651916cd43dd8448eb211c80319c", f"{3:016x}")]


# --------------------------------------------------------------------------------------------------
# Halts reach callbacks and bound tasks


async def test_halt_cancels_bound_tasks_and_notifies_callbacks() -> None:
    """A halt cancels the run's other bound tasks (not the task making the call, which gets RunHalted)
    and reaches sync and async callbacks with the control v1 object."""
    guard = Guard.in_process()
    synced: list[dict[str, Any]] = []
    awaited: list[dict[str, Any]] = []

    async def async_callback(decision: dict[str, Any]) -> None:
        awaited.append(decision)

    guard.on_decision(synced.append)
    guard.on_decision(async_callback)
    run = guard.run("run-1")
    background = asyncio.create_task(asyncio.sleep(3600))
    run.bind_task(background)
    run.bind_task()  # the current task: must survive its own halt
    for _ in range(4):
        await attempt(run, "search_docs", Counted(RuntimeError("down")), {"q": "x"})
    await asyncio.sleep(0)  # let the cancellation and the async callback run
    assert background.cancelled()
    assert [d["action"] for d in synced] == ["advise", "halt"] and awaited == synced
    assert synced[1]["run_id"] == "run-1" and len(synced[1]["decision_id"]) == 32


async def test_task_bound_after_the_halt_is_cancelled_at_once() -> None:
    """Binding a task to an already halted run cancels it."""
    run = Guard.in_process().run("run-1")
    for _ in range(4):
        await attempt(run, "search_docs", Counted(RuntimeError("down")), {"q": "x"})
    late = asyncio.create_task(asyncio.sleep(3600))
    run.bind_task(late)
    await asyncio.sleep(0)
    assert late.cancelled()


def test_run_halted_says_which_run_why_and_which_decision() -> None:
    """The exception's message is enough to find the decision in the control topic."""
    error = RunHalted(
        {
            "run_id": "run-9",
            "verdict": "cycle",
            "reason": "a 2-call cycle repeated 4 times",
            "decision_id": "ab" * 16,
        }
    )
    assert str(error) == (
        f"run run-9 was halted by loopwarden (cycle): a 2-call cycle repeated 4 times [decision {'ab' * 16}]"
    )
    assert (error.run_id, error.verdict, error.decision_id) == ("run-9", "cycle", "ab" * 16)


def test_guard_hands_out_one_run_object_per_run_id() -> None:
    """The same run id gives the same handle (one sequence, one memory); a conflicting identity is refused."""
    guard = Guard.in_process()
    run = guard.run("run-1", agent_id="a")
    assert guard.run("run-1", agent_id="a") is run
    with pytest.raises(ValueError, match="already guarded"):
        guard.run("run-1", agent_id="b")
    with pytest.raises(ValueError, match="run_id"):
        guard.run("")


async def test_run_handles_need_not_be_kept_by_the_caller() -> None:
    """`guard.run(id).call(...)` each time, holding no reference, still remembers the run's side effects."""
    guard = Guard.in_process()
    send = Counted({"ok": True})
    for _ in range(3):
        await guard.run("run-1").call("send_email", send, {"to": "a@example.com"}, side_effect=True)
    assert send.calls == 1


async def test_fleet_guard_refuses_calls_before_it_is_started() -> None:
    """Calling through an unstarted fleet guard is a programming error, reported before the tool runs."""
    run = Guard.fleet(KafkaClientConfig("127.0.0.1:1"), allow_unsigned=True).run("run-1")
    tool = Counted(1)
    with pytest.raises(RuntimeError, match="not started"):
        await run.call("t", tool, {})
    assert tool.calls == 0


# --------------------------------------------------------------------------------------------------
# Telemetry: hashed by default, raw when opted in, equal to what the worker would compute

SECRET = "s3cr3t-4111-1111-1111-1111"


def _call(tool: str, args: dict[str, Any], result: Any, **extra: Any) -> FinishedCall:
    return FinishedCall("run-7", tool, args, "error", result, 1_764_000_000_123, 12.3456, seq=3, **extra)


def test_default_telemetry_carries_no_raw_argument_or_result() -> None:
    """The encoded message contains hashes only: the secret in the arguments and result is not in its bytes,
    and the event is valid telemetry v1."""
    builder = TelemetryBuilder()
    event = builder.build(
        _call(
            "charge_card",
            {"card": SECRET, "amount": 10},
            {"echo": SECRET},
            agent_id="billing",
            side_effect=True,
            error_class="CardDeclined",
        )
    )
    key, value = encode_telemetry(event)
    assert key == b"run-7"
    assert SECRET.encode() not in value
    assert "args" not in event and "result" not in event
    assert event["args_hash"] == semantic_hash({"card": SECRET, "amount": 10})
    assert event["result_hash"] == semantic_hash({"echo": SECRET})
    jsonschema.validate(orjson.loads(value), TELEMETRY_SCHEMA)
    decoded = decode_event(orjson.loads(value))
    assert (decoded.seq, decoded.side_effect, decoded.error_class) == (3, True, "CardDeclined")


def test_opted_in_tool_sends_raw_arguments_and_result() -> None:
    """A tool in raw_tools travels with its arguments and result (e.g. for the worker's strict_args)."""
    builder = TelemetryBuilder(raw_tools={"sql"})
    event = builder.build(_call("sql", {"query": "select 1", "params": (1, 2)}, None))
    _, value = encode_telemetry(event)
    decoded = decode_event(orjson.loads(value))
    assert decoded.args == {"query": "select 1", "params": [1, 2]}
    assert decoded.has_result and decoded.result is None
    assert "args_hash" not in event and "result_hash" not in event
    jsonschema.validate(orjson.loads(value), TELEMETRY_SCHEMA)


def test_hashes_follow_the_tool_policy() -> None:
    """Per-tool settings shape the hash: run_python keeps whitespace, search_docs ignores cache_hint."""
    policy = Policy.from_mapping(
        {
            "tools": {
                "run_python": {"collapse_whitespace": False},
                "search_docs": {"ignore_fields": ["cache_hint"]},
            }
        }
    )
    builder = TelemetryBuilder(policy)
    assert builder.args_hash(None, "run_python", {"code": "if x:\n    y"}) != builder.args_hash(
        None, "run_python", {"code": "if x: y"}
    )
    assert builder.args_hash(None, "other", {"code": "if x:\n    y"}) == builder.args_hash(
        None, "other", {"code": "if x: y"}
    )
    assert builder.args_hash(None, "search_docs", {"q": "a", "cache_hint": "t1"}) == builder.args_hash(
        None, "search_docs", {"q": "a", "cache_hint": "t2"}
    )


@pytest.mark.parametrize(
    "args",
    [
        {"query": "  refund\n policy ", "limit": 10.0},  # whitespace and an integral float
        {"when": dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC), "ids": (1, 2)},  # datetime and tuple
        {1: "one", "nested": {"requestId": "r-1", "deep": [{"nonce": "n"}]}},  # int key, noise fields
        {"blob": b"\x00\xffbinary", "ratio": float("nan")},  # bytes, and NaN (JSON null on the wire)
    ],
)
def test_client_hash_equals_the_hash_of_the_raw_event_the_worker_would_get(args: dict[str, Any]) -> None:
    """For any argument values, hashing on the client gives what the detector computes from the same
    arguments sent raw and decoded off the wire: hashed and raw tools are compared alike."""
    hashed = TelemetryBuilder().build(_call("t", args, "x"))
    raw = TelemetryBuilder(raw_tools={"t"}).build(_call("t", args, "x"))
    decoded = decode_event(orjson.loads(encode_telemetry(raw)[1]))
    assert decoded.args is not None
    assert hashed["args_hash"] == semantic_hash(decoded.args)


def test_value_without_a_json_form_is_hashed_as_unhashable() -> None:
    """An object orjson cannot encode does not break telemetry: it is compared as 'unhashable' (fail
    closed), and a raw tool falls back to the hash for it."""
    opaque = object()
    hashed = TelemetryBuilder().build(_call("t", {"obj": opaque}, opaque))
    raw = TelemetryBuilder(raw_tools={"t"}).build(_call("t", {"obj": opaque}, opaque))
    assert (hashed["args_hash"], hashed["result_hash"]) == ("unhashable", "unhashable")
    assert (raw["args_hash"], raw["result_hash"]) == ("unhashable", "unhashable")
    decode_event(orjson.loads(encode_telemetry(raw)[1]))


def test_event_ids_are_unique_and_sequence_numbers_count_per_run() -> None:
    """Every call gets a fresh event id (a restarted run is never mistaken for a redelivery)."""
    builder = TelemetryBuilder()
    ids = {builder.build(_call("t", {}, "x"))["event_id"] for _ in range(1000)}
    assert len(ids) == 1000


def test_strict_args_tool_sent_as_a_hash_is_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    """A strict_args tool that is not in raw_tools would be compared by name alone: say so, once."""
    builder = TelemetryBuilder(Policy(tools={"sql": {"strict_args": True}}))
    for _ in range(3):
        builder.build(_call("sql", {"q": "select 1"}, "x"))
    assert [r.getMessage() for r in caplog.records].count(
        "tool sql has strict_args in the policy but its arguments travel only as a hash, so loopwarden "
        "compares its calls by tool name alone; add it to raw_tools"
    ) == 1


# --------------------------------------------------------------------------------------------------
# The control board: decisions applied once, bad input counted


def _decision(action: str = "halt", run_id: str = "run-1", **extra: Any) -> dict[str, Any]:
    return {
        "schema_version": "1",
        "decision_id": uuid.uuid4().hex,
        "run_id": run_id,
        "action": action,
        "verdict": "recursion",
        "trigger_event_id": "ev-1",
        "ts_ms": 1_000,
        "reason": "looping",
        "evidence": {"tool": "send_email", "args_hash": "h1", "window_ms": 60_000},
        **extra,
    }


def test_board_applies_a_decision_once() -> None:
    """The same decision id applied twice changes nothing the second time; a resume lifts the halt."""
    board = ControlBoard()
    board.watch("run-1")
    halt = _decision()
    assert [board.apply(halt), board.apply(dict(halt))] == ["applied", "duplicate"]
    assert board.halt_decision("run-1") == halt
    assert board.apply(_decision("resume")) == "applied"
    assert board.halt_decision("run-1") is None
    assert board.apply(halt) == "duplicate"  # a late redelivery of the lifted halt does not re-halt
    assert board.halt_decision("run-1") is None
    assert board.counters == {"applied": 2, "duplicate": 2, "malformed": 0, "ignored": 0,
                              "unsigned": 0, "unknown_key": 0, "bad_signature": 0, "expired": 0,
                              "local": 0, "confirmed": 0, "fleet_only": 2}


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",  # not JSON at all
        b"[1, 2]",  # JSON, not an object
        b'{"run_id": "run-1", "action": "halt"}',  # no decision id
        b'{"decision_id": 7, "run_id": "run-1", "action": "halt"}',  # a mistyped decision id
        b'{"decision_id": "d", "run_id": "run-1", "action": "suppress", "ts_ms": 1}',  # suppress, no evidence
        None,  # a tombstone
    ],
)
def test_board_counts_malformed_messages_and_carries_on(raw: bytes | None) -> None:
    """A bad message is counted, never raised; the next good one is applied."""
    board = ControlBoard(watch_all=True)
    assert board.apply_json(raw) == "malformed"
    assert board.apply(_decision()) == "applied"
    assert board.counters["malformed"] == 1


def test_board_ignores_other_runs_and_unknown_actions() -> None:
    """A halt for a run this process does not watch, or an action from a newer writer, is ignored."""
    board = ControlBoard()
    board.watch("run-1")
    assert board.apply(_decision(run_id="run-2")) == "ignored"
    assert board.apply(_decision("throttle")) == "ignored"
    assert board.halt_decision("run-1") is None and board.halt_decision("run-2") is None


def test_decision_for_a_run_watched_later_is_applied_when_watching_starts() -> None:
    """A halt read during start-up, before the runtime created the run, is in force once it does."""
    board = ControlBoard()
    board.apply(_decision(run_id="run-late"))
    board.watch("run-late")
    assert board.halt_decision("run-late") is not None
    assert board.counters["applied"] == 1


def test_suppression_lasts_its_window_from_the_trigger() -> None:
    """A suppress decision at ts 1 000 with a 60 s window covers the call until ts 61 000, then lapses."""
    board = ControlBoard(watch_all=True)
    board.apply(_decision("suppress", verdict="duplicate_call"))
    assert board.is_suppressed("run-1", "send_email", "h1", 61_000)
    assert not board.is_suppressed("run-1", "send_email", "other-hash", 2_000)
    assert not board.is_suppressed("run-1", "send_email", "h1", 61_001)


def test_board_memory_is_bounded() -> None:
    """Decision ids and runs beyond the limits are forgotten oldest first."""
    board = ControlBoard(watch_all=True, max_runs=10, max_decision_ids=10)
    decisions = [_decision(run_id=f"run-{i}") for i in range(25)]
    for decision in decisions:
        board.apply(decision)
    assert board.apply(decisions[0]) == "applied"  # its id was forgotten
    assert board.halt_decision("run-1") is None and board.halt_decision("run-24") is not None


# --------------------------------------------------------------------------------------------------
# Kafka settings


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"bootstrap_servers": " "}, "bootstrap_servers"),  # nowhere to connect
        ({"security_protocol": "TLS"}, "security_protocol"),  # not a Kafka protocol name
        (
            {
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "GSSAPI",
                "sasl_username": "u",
                "sasl_password": "p",
            },
            "sasl_mechanism",
        ),  # unsupported mechanism
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN"}, "sasl_username"),  # no user
        ({"sasl_username": "u", "sasl_password": "p"}, "sasl_"),  # SASL user with PLAINTEXT: ignored
        ({"ssl_cafile": "/ca.pem"}, "ssl_"),  # a CA with PLAINTEXT: ignored
        ({"security_protocol": "SSL", "ssl_keyfile": "/k.pem"}, "ssl_keyfile"),  # key without cert
    ],
)
def test_kafka_settings_that_cannot_work_are_refused(settings: dict[str, Any], message: str) -> None:
    """Each refusal names the setting to fix."""
    with pytest.raises(KafkaConfigError, match=message):
        KafkaClientConfig(**{"bootstrap_servers": "kafka:9092", **settings})


def test_kafka_settings_give_aiokafka_arguments_and_hide_the_password() -> None:
    """SASL_SSL yields the SASL credentials and a TLS context honouring ssl_check_hostname; repr never
    shows the password."""
    config = KafkaClientConfig(
        "kafka:9093",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="runtime",
        sasl_password="hunter2",
        ssl_check_hostname=False,
    )
    kwargs = config.aiokafka_kwargs()
    assert kwargs["sasl_mechanism"] == "SCRAM-SHA-512" and kwargs["sasl_plain_password"] == "hunter2"
    assert kwargs["ssl_context"].check_hostname is False
    assert "hunter2" not in repr(config)
    assert KafkaClientConfig("kafka:9092").aiokafka_kwargs() == {
        "bootstrap_servers": "kafka:9092",
        "security_protocol": "PLAINTEXT",
    }


def test_kafka_settings_from_the_environment() -> None:
    """The worker builds the same object from its environment."""
    config = KafkaClientConfig.from_env(
        {
            "KAFKA_BOOTSTRAP_SERVERS": "k1:9092,k2:9092",
            "KAFKA_SECURITY_PROTOCOL": "ssl",
            "KAFKA_SSL_CHECK_HOSTNAME": "false",
        }
    )
    assert (config.bootstrap_servers, config.security_protocol, config.ssl_check_hostname) == (
        "k1:9092,k2:9092",
        "SSL",
        False,
    )


# --------------------------------------------------------------------------------------------------
# Packaging


def test_public_names_are_exactly_all() -> None:
    """__all__ lists exactly the public names the package exports (its submodules aside)."""
    exported = {name for name in vars(client) if not name.startswith("_")} - {
        "annotations",
        "guard",
        "errors",
        "lifecycle",
        "listener",
        "publisher",
    }
    assert sorted(client.__all__) == sorted(exported)


# --------------------------------------------------------------------------------------------------
# Tool classes, targets and after-states through the SDK


async def test_a_fresh_error_text_each_time_is_still_the_same_failure() -> None:
    """The detection-round-2 example: fresh request ids and durations in every error; the 5th call is
    refused before it runs. (A ``TimeoutError`` would be classed transient: paused twice before the halt,
    ``test_guard_tools.py``.)"""
    run = Guard.in_process().run("run-volatile")
    attempts = iter(range(100))

    def search_docs(**_: Any) -> None:
        n = next(attempts)
        raise RuntimeError(f"upstream timeout after {30412 + n}ms (request req_{n:08x})")

    for _ in range(4):
        with pytest.raises(RuntimeError):
            await run.call("search_docs", search_docs, {"query": "refund"})
    with pytest.raises(RunHalted) as halted:
        await run.call("search_docs", search_docs, {"query": "refund"})
    assert next(attempts) == 4  # the 5th never ran
    assert halted.value.verdict == "recursion" and run.decision is not None
    assert run.decision["evidence"]["match"] == "fingerprint"


async def test_rereading_an_unchanged_file_is_refused_at_the_5th_read() -> None:
    run = Guard.in_process().run("run-reads")
    read_file = Counted("def f(): ...")
    for _ in range(4):
        await run.call("read_file", read_file, {"path": "/a.py"}, tool_class="read", target="/a.py")
    with pytest.raises(RunHalted) as halted:
        await run.call("read_file", read_file, {"path": "/a.py"}, tool_class="read", target="/a.py")
    assert (read_file.calls, halted.value.verdict) == (4, "no_progress")


async def test_edits_undone_and_redone_are_refused_after_the_5th_write() -> None:
    """The tool returns its after-state in a ToolOutcome: S1, S0, S1, S0, S1 halts at the 5th write."""
    run = Guard.in_process().run("run-edits")
    writes = iter("10101010")

    def apply_patch(**_: Any) -> ToolOutcome:
        return ToolOutcome("success", {"ok": True}, state_hash=next(writes) * 64)

    for _ in range(5):
        await run.call("apply_patch", apply_patch, {"path": "/a.py"}, tool_class="write", target="/a.py")
    with pytest.raises(RunHalted) as halted:
        await run.call("apply_patch", apply_patch, {"path": "/a.py"}, tool_class="write", target="/a.py")
    assert halted.value.verdict == "oscillation"


async def test_a_bad_tool_class_is_refused_before_the_tool_runs() -> None:
    run = Guard.in_process().run("run-bad-class")
    tool = Counted("x")
    with pytest.raises(InvalidCall, match="tool_class"):
        await run.call("read_file", tool, {}, tool_class="reader")
    assert tool.calls == 0
