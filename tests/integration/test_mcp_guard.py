"""The MCP guard in a real MCP Python SDK server, driven by the SDK's own client in-process: over the
handshake-era JSON-RPC streams (``legacy``) and over the 2026 per-request path, no network."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from mcp import Client
from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp_types import INTERNAL_ERROR, CallToolResult, TextContent

from stream_app.client import Guard, KafkaClientConfig
from stream_app.integrations.mcp import RUN_ID_META_KEY, LoopGuardMiddleware, outcome
from tests.integration.workers import Fleet, consume
from tests.readme_examples import example

MODES = ["legacy", "2026-07-28"]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
SPAN_ID = "b7ad6b7169203331"


class Counted:
    """Counts a tool's executions."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        return self.calls


def guarded_server(guard: Guard, **options: Any) -> tuple[MCPServer, LoopGuardMiddleware, Counted]:
    """A server whose ``reindex`` tool always fails the same way, behind the guard."""
    middleware = LoopGuardMiddleware(guard, **options)
    server = MCPServer("indexer", middleware=[middleware])
    runs = Counted()

    @server.tool()
    def reindex(collection: str) -> str:
        runs()
        raise ToolError("index store unavailable")

    return server, middleware, runs


def meta(run_id: str) -> dict[str, Any]:
    return {RUN_ID_META_KEY: run_id, "traceparent": f"00-{TRACE_ID}-{SPAN_ID}-01"}


def text(result: CallToolResult) -> str:
    return " ".join(block.text for block in result.content if isinstance(block, TextContent))


@pytest.mark.parametrize("mode", MODES)
async def test_fourth_identical_failure_halts_and_the_next_call_is_refused_without_running(mode: str) -> None:
    """A client retrying a failing tool: the 4th identical failure halts the run (defaults), and the 5th
    call is answered isError with the halt's reason while the tool does not run again. The halt carries
    the client's run id and the trace and span of its traceparent."""
    guard = Guard.in_process()
    decisions: list[dict[str, Any]] = []
    guard.on_decision(decisions.append)
    server, _, runs = guarded_server(guard)
    async with Client(server, mode=mode) as client:
        answers = [await client.call_tool("reindex", {"collection": "docs"}, meta=meta("run-7"))
                   for _ in range(5)]

    assert runs.calls == 4
    assert all(a.is_error for a in answers)
    assert all("index store unavailable" in text(a) for a in answers[:4])
    advice, halt = decisions
    assert (halt["action"], halt["verdict"], halt["run_id"]) == ("halt", "recursion", "run-7")
    # The warning rides on the 3rd call's result, which is what the model reads before its 4th call.
    assert advice["action"] == "advise" and f"[loopwarden] {advice['reason']}" in text(answers[2])
    assert not any(advice["reason"] in text(a) for a in answers[:2])
    assert (halt["trace_id"], halt["span_id"]) == (TRACE_ID, SPAN_ID)
    assert text(answers[4]).startswith("run run-7 was halted by loopwarden (recursion): ")
    assert halt["reason"] in text(answers[4])
    assert guard.run("run-7").calls == 4  # the refused call ran nothing and reported nothing


@pytest.mark.parametrize("mode", MODES)
async def test_a_client_naming_a_run_or_tool_the_contract_cannot_describe_is_answered_as_unguarded(mode: str) -> None:
    """A run id of 513 characters in ``_meta`` is no run's name: the call goes to the process's own run
    (it was an ``InvalidCall``, an internal error to the client, for a call that works unguarded). A tool
    name the telemetry cannot carry (600 characters) is answered by the server as it answers any unknown
    tool, a tool error, not the protocol error the guard made of it."""
    server, _, runs = guarded_server(Guard.in_process())
    async with Client(server, mode=mode) as client:
        named = await client.call_tool("reindex", {"collection": "docs"}, meta={RUN_ID_META_KEY: "r" * 513})
        unknown = await client.call_tool("x" * 600, {})
    assert named.is_error and "index store unavailable" in text(named) and runs.calls == 1
    assert unknown.is_error and "x" * 600 in text(unknown)


async def test_each_run_is_judged_on_its_own() -> None:
    """Runs named by their clients are independent: one run's halt does not refuse another's calls, and
    calls without a run id belong to the server process's run."""
    guard = Guard.in_process()
    server, middleware, runs = guarded_server(guard)
    async with Client(server) as client:
        for _ in range(4):
            await client.call_tool("reindex", {"collection": "docs"}, meta=meta("run-a"))
        other = await client.call_tool("reindex", {"collection": "docs"}, meta=meta("run-b"))
        anonymous = await client.call_tool("reindex", {"collection": "docs"})

    assert guard.run("run-a").halted and not guard.run("run-b").halted
    assert "index store unavailable" in text(other) and "index store unavailable" in text(anonymous)
    assert runs.calls == 6
    assert guard.run(middleware.process_run_id).calls == 1


async def test_a_run_id_function_decides_the_run_over_what_the_client_claims() -> None:
    """A server that names runs itself ignores the client's run id: a client rotating ids is still halted."""
    guard = Guard.in_process()
    server, _, runs = guarded_server(guard, run_id=lambda ctx: "tenant-acme")
    async with Client(server) as client:
        answers = [await client.call_tool("reindex", {"collection": "docs"}, meta=meta(f"run-{n}"))
                   for n in range(5)]

    assert runs.calls == 4
    assert text(answers[4]).startswith("run tenant-acme was halted by loopwarden (recursion)")


async def test_readme_example_hands_back_the_earlier_result_of_a_duplicate_side_effect() -> None:
    """The README's server: sending the same e-mail again within 60 s returns the first receipt, and the
    tool ran once."""
    namespace: dict[str, Any] = {}
    exec(example("### MCP servers"), namespace)
    decisions: list[dict[str, Any]] = []
    namespace["guard"].on_decision(decisions.append)
    async with Client(namespace["server"]) as client:
        args = {"to": "ops@example.com", "subject": "disk full"}
        first, again = [await client.call_tool("send_email", args, meta=meta("run-mail")) for _ in range(2)]

    assert namespace["outbox"] == ["ops@example.com"]
    assert (first.is_error, text(first)) == (False, "queued as #1")
    assert (again.is_error, text(again), again.structured_content) == (False, "queued as #1", first.structured_content)
    assert [(d["action"], d["verdict"]) for d in decisions] == [("suppress", "duplicate_call")]


async def test_protocol_errors_count_as_failures() -> None:
    """A tool answering with a JSON-RPC error (MCPError) fails identically each time: halted at the 4th."""
    guard = Guard.in_process()
    server = MCPServer("gateway", middleware=[LoopGuardMiddleware(guard)])
    runs = Counted()

    @server.tool()
    def fetch(url: str) -> str:
        runs()
        raise MCPError(code=INTERNAL_ERROR, message="upstream refused")

    async with Client(server) as client:
        for _ in range(4):
            with pytest.raises(MCPError, match="upstream refused"):
                await client.call_tool("fetch", {"url": "https://example.com"}, meta=meta("run-x"))
        refused = await client.call_tool("fetch", {"url": "https://example.com"}, meta=meta("run-x"))

    assert runs.calls == 4
    assert refused.is_error and "recursion" in text(refused)


async def test_answers_from_inner_middleware_are_classified_like_the_sdks() -> None:
    """A middleware listed after the guard may answer calls itself with a result model (here: a server
    in maintenance); an agent retrying into it is halted like one retrying a failing tool."""

    async def maintenance(ctx: ServerRequestContext[Any, Any], call_next: Callable[..., Awaitable[Any]]) -> Any:
        if ctx.method == "tools/call":
            return CallToolResult(content=[TextContent(type="text", text="down for maintenance")], is_error=True)
        return await call_next(ctx)

    guard = Guard.in_process()
    server, _, runs = guarded_server(guard)
    server.middleware.append(maintenance)
    async with Client(server) as client:
        answers = [await client.call_tool("reindex", {"collection": "docs"}, meta=meta("run-m"))
                   for _ in range(5)]

    assert runs.calls == 0
    assert [text(a).split(" [loopwarden] ")[0] for a in answers[:4]] == ["down for maintenance"] * 4
    assert "[loopwarden] reindex failed the same way 3 times" in text(answers[2])  # the warning, once
    assert "recursion" in text(answers[4])


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        ({"content": [{"type": "text", "text": "42"}], "isError": False}, "success"),
        ({"content": [], "structuredContent": {"rows": []}}, "success"),  # structured data is an answer
        ({"content": [{"type": "text", "text": "boom"}], "isError": True}, "error"),
        ({"content": [], "isError": False}, "empty"),  # a tool that returned nothing
        (None, "empty"),
    ],
)
def test_outcome_of_a_tool_result(result: Any, expected: str) -> None:
    assert outcome(result) == expected


async def test_malformed_calls_are_left_to_the_sdk() -> None:
    """Before the SDK validates params, a call without a tool name passes through unreported."""
    guard = Guard.in_process()
    middleware = LoopGuardMiddleware(guard)
    ctx: ServerRequestContext[Any, Any] = ServerRequestContext(
        session=None,  # type: ignore[arg-type]  # not used on this path
        lifespan_context={}, protocol_version="2025-11-25", method="tools/call", params={"arguments": []},
        request_id=1)

    async def sdk(ctx: ServerRequestContext[Any, Any]) -> dict[str, Any]:
        return {"passed": True}

    assert await middleware(ctx, sdk) == {"passed": True}
    assert guard.run(middleware.process_run_id).calls == 0


@pytest.mark.integration
async def test_fleet_halt_reaches_the_mcp_server(kafka_bootstrap: str, tmp_path: Path) -> None:
    """With a real worker on the real broker: the server's telemetry carries the client's run id, the
    JSON-RPC request ids and the traceparent; the worker's halt comes back signed and the next call is
    refused without running the tool."""
    fleet = Fleet(kafka_bootstrap, tmp_path, partitions=2)
    await asyncio.to_thread(fleet.start_worker)
    try:
        async with Guard.fleet(KafkaClientConfig(kafka_bootstrap), fleet.telemetry_topic, fleet.control_topic,
                               trusted_keys=fleet.trusted_keys()) as guard:
            server, _, runs = guarded_server(guard)
            async with Client(server) as client:
                for _ in range(4):
                    await client.call_tool("reindex", {"collection": "docs"}, meta=meta("run-fleet"))
                async with asyncio.timeout(30):
                    while not guard.run("run-fleet").halted:
                        await asyncio.sleep(0.05)
                refused = await client.call_tool("reindex", {"collection": "docs"}, meta=meta("run-fleet"))
        telemetry = [orjson.loads(r.value) for r in await consume(kafka_bootstrap, fleet.telemetry_topic, 4,
                                                                   settle=0.5)]
    finally:
        await asyncio.to_thread(fleet.stop)

    assert runs.calls == 4
    assert refused.is_error and "recursion" in text(refused)
    assert [(e["run_id"], e["tool"], e["outcome"], e["trace_id"], e["span_id"]) for e in telemetry] == [
        ("run-fleet", "reindex", "error", TRACE_ID, SPAN_ID)] * 4
    call_ids = [e["attrs"]["tool_call_id"] for e in telemetry]
    assert len(set(call_ids)) == 4 and all(i.isdigit() for i in call_ids)
