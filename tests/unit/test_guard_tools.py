"""Tool storms through the SDK: failures classed from the exception, the storm paused fleet-wide
(``ToolPaused`` with ``retry_after_s``), half-open (one call per wait, jittered), and the resume after a
success lifting the pause; another tenant's calls, and calls naming no upstream, go on."""

from __future__ import annotations

from typing import Any

import pytest

from stream_app.client import Guard, ToolPaused
from stream_app.client.guard import classify_error
from stream_app.core import Policy
from tests.integration.tools import telemetry_of

T0 = 1_764_000_000_000 - 1_764_000_000_000 % 60_000
UPSTREAM = "api.weather.example"


class Unavailable(Exception):
    """What an HTTP client raises for a 503 (httpx and requests carry the response)."""

    def __init__(self, status: int = 503, retry_after: str | None = None) -> None:
        super().__init__(f"{status} Service Unavailable")
        headers = {"retry-after": retry_after} if retry_after is not None else {}
        self.response = type("Response", (), {"status_code": status, "headers": headers})()


def test_a_tools_exception_is_classed_for_the_storm_rule() -> None:
    assert classify_error(Unavailable(429, "30")) == ("http_429", 30_000)
    assert classify_error(Unavailable(404)) == ("http_404", None)
    assert classify_error(TimeoutError("read timed out")) == ("timeout", None)
    assert classify_error(ConnectionRefusedError("refused")) == ("connection", None)
    assert classify_error(ValueError("bad")) == ("ValueError", None)
    assert classify_error(Unavailable(503, "Wed, 21 Oct 2026 07:28:00 GMT")) == ("http_503", None)


class _Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def _unavailable(**_: Any) -> None:
    raise Unavailable(503)


def _ok(**_: Any) -> str:
    return "sunny"


async def _storm(guard: Guard, clock: _Clock, runs: int = 10, tenant: str = "acme") -> None:
    for n in range(runs):
        clock.now += 1_000
        run = guard.run(f"{tenant}-run-{n}", tenant=tenant)
        with pytest.raises(Unavailable):
            await run.call("weather", _unavailable, {"city": "Oslo"}, upstream=UPSTREAM)


async def test_ten_runs_failing_on_one_upstream_pause_the_tool_for_their_tenant_only() -> None:
    clock = _Clock()
    guard = Guard.in_process(Policy(), clock=clock)
    await _storm(guard, clock)
    eleventh = guard.run("acme-run-10", tenant="acme")
    with pytest.raises(ToolPaused) as info:
        await eleventh.call("weather", _ok, {"city": "Oslo"}, upstream=UPSTREAM)
    assert info.value.verdict == "tool_storm" and 59 <= info.value.retry_after_s <= 72  # the wait, + up to 20%
    assert (info.value.tool, info.value.upstream, info.value.run_id) == ("weather", UPSTREAM, "acme-run-10")
    assert not eleventh.halted  # a pause is not a halt: the run goes on
    assert await guard.run("globex-run", tenant="globex").call("weather", _ok, {}, upstream=UPSTREAM) == "sunny"
    assert await eleventh.call("weather", _ok, {"city": "Oslo"}) == "sunny"  # no upstream named: not counted
    assert await eleventh.call("news", _ok, {}, upstream=UPSTREAM) == "sunny"  # another tool of it


async def test_half_open_one_call_per_wait_then_a_success_resumes_the_tool() -> None:
    clock = _Clock()
    guard = Guard.in_process(Policy(), clock=clock)
    await _storm(guard, clock)
    pause = guard.board.tool_pause("acme", "weather", UPSTREAM)
    assert pause is not None
    run = guard.run("acme-prober", tenant="acme")
    clock.now = pause["ts_ms"]
    with pytest.raises(ToolPaused) as first:
        await run.call("weather", _ok, {"city": "Bergen"}, upstream=UPSTREAM)
    clock.now += round(first.value.retry_after_s * 1000)  # the wait is over (round: int() fell 1 ms short)
    with pytest.raises(Unavailable):
        await run.call("weather", _unavailable, {"city": "Bergen"}, upstream=UPSTREAM)
    with pytest.raises(ToolPaused) as info:  # the next waits for the next probe: the wait, + up to 20%
        await run.call("weather", _ok, {"city": "Bergen"}, upstream=UPSTREAM)
    assert 60 <= info.value.retry_after_s <= 72
    clock.now += int(info.value.retry_after_s * 1000) + 1
    assert await run.call("weather", _ok, {"city": "Bergen"}, upstream=UPSTREAM) == "sunny"  # recovered
    assert guard.board.tool_pause("acme", "weather", UPSTREAM) is None  # the fold's resume lifted it
    assert await guard.run("acme-after", tenant="acme").call("weather", _ok, {}, upstream=UPSTREAM) == "sunny"


async def test_a_fleet_pause_is_obeyed_and_its_resume_lifts_it() -> None:
    clock = _Clock()
    guard = Guard.in_process(Policy(), clock=clock)
    pause = {"schema_version": "1", "decision_id": "p" * 32, "scope": "tool", "tenant": "acme", "tool": "weather",
             "upstream": UPSTREAM, "action": "pause", "verdict": "tool_storm", "trigger_event_id": "e",
             "trigger_run_id": "r", "ts_ms": T0, "reason": "storm", "evidence": {"wait_ms": 30_000}}
    assert guard.board.apply(pause) == "applied"
    run = guard.run("acme-1", tenant="acme")
    with pytest.raises(ToolPaused) as info:
        await run.call("weather", _ok, {}, upstream=UPSTREAM)
    assert 30 <= info.value.retry_after_s <= 36
    assert guard.board.apply({**pause, "decision_id": "q" * 32, "action": "resume"}) == "applied"
    assert await run.call("weather", _ok, {}, upstream=UPSTREAM) == "sunny"


async def test_the_telemetry_names_the_upstream_the_class_and_the_wait() -> None:
    guard = Guard.in_process(Policy(), clock=_Clock())
    events = telemetry_of(guard)

    def limited(**_: Any) -> None:
        raise Unavailable(429, "12")

    with pytest.raises(Unavailable):
        await guard.run("r", tenant="acme").call("weather", limited, {}, upstream=UPSTREAM)
    assert (events[0]["upstream"], events[0]["error_class"], events[0]["retry_after_ms"]) == (UPSTREAM, "http_429",
                                                                                              12_000)


async def test_an_upstream_learned_while_the_first_call_ran_is_reported_and_counts_in_its_streak() -> None:
    """A streak counts per (run, tool, upstream): a call that named no upstream as it began (an MCP
    server's name comes with its first answer) reports the one ``finish`` is given, so the 4th identical
    failure halts as it would had all four named it; an upstream the call named at ``begin`` stands."""
    from stream_app.client import RunHalted

    guard = Guard.in_process(Policy(), clock=_Clock())
    events = telemetry_of(guard)
    run = guard.run("mcp-client")
    first = await run.begin("reindex", {"collection": "docs"})
    await run.finish(first, error=LookupError("index store unavailable"), upstream="indexer")
    for _ in range(2):
        pending = await run.begin("reindex", {"collection": "docs"}, upstream="indexer")
        await run.finish(pending, error=LookupError("index store unavailable"), upstream="other")
    pending = await run.begin("reindex", {"collection": "docs"}, upstream="indexer")
    await run.finish(pending, error=LookupError("index store unavailable"))
    with pytest.raises(RunHalted):  # the 5th is refused before it runs
        await run.begin("reindex", {"collection": "docs"}, upstream="indexer")
    assert [e["upstream"] for e in events] == ["indexer"] * 4
    assert run.decision is not None and run.decision["verdict"] == "recursion"


async def test_a_runs_transient_streak_pauses_its_calls_to_the_tool_twice_then_halts() -> None:
    """One run alone retrying a failing upstream (no storm: one run): where recursion would halt, every
    failure being transient, its calls to the tool pause for the Retry-After instead; the third time, it
    halts (recursion)."""
    from stream_app.client import RunHalted

    clock = _Clock()
    guard = Guard.in_process(Policy(), clock=clock)
    run = guard.run("lonely", tenant="acme")

    def limited(**_: Any) -> None:
        raise Unavailable(503, "5")

    pauses = []
    for _ in range(40):
        clock.now += 1_000
        try:
            await run.call("weather", limited, {"city": "Oslo"}, upstream=UPSTREAM)
        except Unavailable:
            continue
        except ToolPaused as paused:
            pauses.append(paused)
            if len(pauses) == 1:
                with pytest.raises(ToolPaused):  # still paused a moment later
                    await run.call("weather", limited, {"city": "Oslo"}, upstream=UPSTREAM)
            clock.now += round(paused.retry_after_s * 1000)
        except RunHalted as halted:
            verdict = halted.verdict
            break
    else:
        pytest.fail("never halted")
    assert verdict == "recursion"
    assert len(pauses) == 2 and [p.decision["evidence"]["pause"] for p in pauses] == [1, 2]
    assert all(p.decision["action"] == "pause" and p.decision["evidence"]["wait_ms"] == 5_000 for p in pauses)
    assert 0 < pauses[0].retry_after_s <= 5


async def test_a_streak_with_a_failure_that_is_not_transient_halts_as_before() -> None:
    from stream_app.client import RunHalted

    guard = Guard.in_process(Policy(), clock=_Clock())
    run = guard.run("buggy", tenant="acme")

    def not_found(**_: Any) -> None:
        raise Unavailable(404)

    for _ in range(4):
        with pytest.raises(Unavailable):
            await run.call("weather", not_found, {"city": "Atlantis"}, upstream=UPSTREAM)
    with pytest.raises(RunHalted) as info:
        await run.call("weather", not_found, {"city": "Atlantis"}, upstream=UPSTREAM)
    assert info.value.verdict == "recursion"


async def test_a_runs_pause_holds_only_its_calls_to_that_tool() -> None:
    guard = Guard.in_process(Policy(), clock=_Clock())
    pause = {"schema_version": "1", "decision_id": "r" * 32, "run_id": "r1", "action": "pause",
             "verdict": "recursion", "trigger_event_id": "e", "ts_ms": T0, "reason": "transient",
             "evidence": {"tool": "weather", "wait_ms": 5_000}}
    run, other = guard.run("r1", tenant="acme"), guard.run("r2", tenant="acme")
    assert guard.board.apply(pause) == "applied"
    with pytest.raises(ToolPaused) as info:
        await run.call("weather", _ok, {})
    assert info.value.retry_after_s == 5 and not run.halted
    assert await run.call("news", _ok, {}) == "sunny"
    assert await other.call("weather", _ok, {}) == "sunny"


async def test_the_first_probe_is_jittered_too_so_runtimes_do_not_probe_in_step() -> None:
    """Each runtime draws its first probe of a pause once, 0-20% past the wait: not before, reported as
    the wait left, and runtimes with other draws probe at other instants."""
    pause = {"schema_version": "1", "decision_id": "p" * 32, "scope": "tool", "tenant": "acme", "tool": "weather",
             "upstream": UPSTREAM, "action": "pause", "verdict": "tool_storm", "trigger_event_id": "e",
             "trigger_run_id": "r", "ts_ms": T0, "reason": "storm", "evidence": {"wait_ms": 60_000}}
    firsts = []
    for seed in range(8):
        clock = _Clock()
        guard = Guard.in_process(Policy(), clock=clock)
        guard._jitter.seed(seed)
        guard.board.apply(pause)
        run = guard.run(f"acme-{seed}", tenant="acme")
        clock.now = T0 + 60_000  # the wait is over, but not this runtime's first probe (drawn just now)
        with pytest.raises(ToolPaused) as info:
            await run.call("weather", _ok, {}, upstream=UPSTREAM)
        first = T0 + 60_000 + int(info.value.retry_after_s * 1000)
        assert T0 + 60_000 <= first <= T0 + 72_000
        clock.now = first - 1
        with pytest.raises(ToolPaused) as again:
            await run.call("weather", _ok, {}, upstream=UPSTREAM)
        assert again.value.retry_after_s == 0.001  # the same draw: one millisecond left
        clock.now = first
        assert await run.call("weather", _ok, {}, upstream=UPSTREAM) == "sunny"
        firsts.append(first)
    assert len(set(firsts)) == len(firsts)  # not in step
