"""loopwarden in an MCP server: a middleware of the MCP Python SDK (v2 ``ServerMiddleware``) around every
``tools/call`` the server answers.

An MCP server sees only its own tools, so the agent runtime is the first place to guard a run; this is
the enforcement point for servers that agents you do not control call. Each call is reported as
telemetry; once the run is halted a call is refused without running the tool, as a tool error
(``isError: true``, the text naming the verdict and reason) rather than a JSON-RPC error: MCP hands tool
errors to the model, which can tell its user why, while a protocol error reads as a broken server. A
suppressed duplicate of a side-effecting tool (``side_effect: true`` in the guard's policy) is answered
with the earlier result and the tool does not run again.

Ids: the run is what the ``run_id`` function of the request context returns; by default the request's
``_meta["dev.loopwarden/run_id"]``, which the agent runtime sets (``call_tool(..., meta={...})``). Without
one, the run is the server process: right for a stdio server, which a client starts per session; an HTTP
server shared by many clients needs one of the two, or its clients share one run. A server that must
not let clients choose their run (a client could rotate ids to escape) passes its own ``run_id``. The
tool call id is the JSON-RPC request id; the trace and span ids come from the W3C ``traceparent`` the
client puts in ``_meta`` (the MCP SDK's client does when OpenTelemetry is on): the client's span of
this call.

Upstream: every call names this server as its ``upstream``, so that the storm rule sees many runs
failing on the same server and pauses its tool for their tenant; a paused tool's call is answered as a
tool error saying when to retry (``ToolPaused``), without running it. The name is ``upstream`` if given
(the name or URL agents know the server by), else the ``serverInfo`` name the server answers with: in
the ``initialize`` result of a handshake-era session, in the ``_meta`` of every 2026-era result. A
2026-era client's first call, before any answer, names no upstream as it begins (a storm's pause cannot
refuse it), and is reported with the name its answer gives; pass ``upstream`` to have it from the start.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Final

from mcp.server.context import CallNext, HandlerResult, ServerMiddleware, ServerRequestContext
from mcp_types import SERVER_INFO_META_KEY, CallToolResult, TextContent
from opentelemetry.trace import get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import BaseModel

from ..client import CallIds, Guard, InvalidCall, RunHalted, ToolOutcome, ToolPaused
from ..core import Outcome
from ..core.contract import MAX_ID_LENGTH

#: ``_meta`` key under which a client names its run (reverse-DNS prefixed, as MCP asks of ``_meta`` keys).
RUN_ID_META_KEY: Final = "dev.loopwarden/run_id"

logger = logging.getLogger(__name__)

RunIdFunction = Callable[[ServerRequestContext[Any, Any]], str | None]

_W3C: Final = TraceContextTextMapPropagator()


class LoopGuardMiddleware(ServerMiddleware[Any]):
    """Guards the server's tool calls with ``guard``: ``MCPServer(..., middleware=[LoopGuardMiddleware(guard)])``.

    ``run_id``: a function of the request context naming its run (default ``run_id_from_meta``); when it
    returns None the run is this server process. ``agent_id``: the agent the guard's policy resolves
    these calls under. ``upstream``: the name of this server in the calls' telemetry (default: its
    ``serverInfo`` name, see the module docstring). A fleet guard must be started first (e.g. in the
    server's lifespan).
    """

    def __init__(self, guard: Guard, *, run_id: RunIdFunction | None = None, agent_id: str | None = None,
                 upstream: str | None = None) -> None:
        self.guard = guard
        self.agent_id = agent_id
        self.process_run_id = f"mcp-{uuid.uuid4().hex}"
        #: What the calls name as their upstream: given, or learned from the server's answers (None: not yet).
        self.upstream = upstream
        self._run_id = run_id or run_id_from_meta

    async def __call__(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        params = ctx.params or {}
        tool, arguments = params.get("name"), params.get("arguments")
        # The middleware runs before the SDK validates params: malformed calls get the SDK's own error.
        if ctx.method != "tools/call" or not isinstance(tool, str) or not isinstance(arguments, Mapping | None):
            return self._learn(await call_next(ctx))
        try:
            run = self.guard.run(self._run_id(ctx) or self.process_run_id, agent_id=self.agent_id)
            pending = await run.begin(tool, arguments, ids=call_ids(ctx), upstream=self.upstream)
        except (RunHalted, ToolPaused) as refused:
            return CallToolResult(content=[TextContent(type="text", text=str(refused))], is_error=True)
        except InvalidCall as invalid:
            # A call the telemetry contract cannot describe (an empty tool name, one of 600 characters): the
            # server answers it as it would unguarded (an unknown tool is its own tool error), unrecorded.
            logger.debug("MCP call not guarded: %s", invalid)
            return self._learn(await call_next(ctx))
        if pending.earlier is not None:
            earlier: HandlerResult = pending.earlier.replay()
            return earlier
        started = time.perf_counter()
        try:
            result = self._learn(await call_next(ctx))
        except Exception as exc:
            await run.finish(pending, error=exc, latency_ms=(time.perf_counter() - started) * 1000,
                             upstream=self.upstream)
            raise
        # A call that named no upstream as it began (the first, before any answer) reports the name its
        # answer gave: it counts in the same streak (run, tool, upstream) as the calls after it.
        answered: HandlerResult = await run.finish(pending, ToolOutcome(outcome(result), result),
                                                   latency_ms=(time.perf_counter() - started) * 1000,
                                                   upstream=self.upstream)
        return advised(answered, run.take_advice())

    def _learn(self, result: HandlerResult) -> HandlerResult:
        """``result``, once the server's name is read from it if not known yet (see the module docstring)."""
        if self.upstream is None:
            self.upstream = server_name(result)
        return result


def advised(result: HandlerResult, advice: str | None) -> HandlerResult:
    """The tool's result with loopwarden's warning appended as one more text content, so the model reads
    it with the result it is about."""
    if advice is None:
        return result
    note = {"type": "text", "text": f"[loopwarden] {advice}"}
    if isinstance(result, BaseModel):
        result = result.model_dump(mode="json", by_alias=True, exclude_none=True)
    if not isinstance(result, dict):
        return result
    return {**result, "content": [*(result.get("content") or []), note]}


def server_name(result: HandlerResult) -> str | None:
    """The ``serverInfo`` name in a server's answer: an ``initialize`` result's, or the 2026-era stamp in
    any result's ``_meta``; None if it has none (or one that cannot be an id)."""
    if isinstance(result, BaseModel):
        result = result.model_dump(mode="json", by_alias=True, exclude_none=True)
    if not isinstance(result, dict):
        return None
    meta = result.get("_meta")
    info = result.get("serverInfo") or (meta.get(SERVER_INFO_META_KEY) if isinstance(meta, dict) else None)
    name = info.get("name") if isinstance(info, dict) else None
    return name if isinstance(name, str) and 0 < len(name) <= MAX_ID_LENGTH else None


def run_id_from_meta(ctx: ServerRequestContext[Any, Any]) -> str | None:
    """The run the client named in ``_meta["dev.loopwarden/run_id"]``, if any."""
    named = (ctx.meta or {}).get(RUN_ID_META_KEY)
    return named if isinstance(named, str) and 0 < len(named) <= MAX_ID_LENGTH else None  # else the process's run


def call_ids(ctx: ServerRequestContext[Any, Any]) -> CallIds:
    """The JSON-RPC request id, and the trace and span of the client's ``_meta.traceparent`` if valid."""
    span = get_current_span(_W3C.extract(ctx.meta or {})).get_span_context()
    if not span.is_valid:
        return CallIds(tool_call_id=str(ctx.request_id))
    return CallIds(tool_call_id=str(ctx.request_id), trace_id=format(span.trace_id, "032x"),
                   span_id=format(span.span_id, "016x"))


def outcome(result: HandlerResult) -> Outcome:
    """A ``tools/call`` result's outcome: ``isError`` is an error; no content and no structured content
    is empty (a failing outcome too: repeating a call that finds nothing is a loop)."""
    if isinstance(result, BaseModel):  # middleware answering a call itself may return the model
        result = result.model_dump(mode="json", by_alias=True, exclude_none=True)
    result = result or {}
    if result.get("isError") is True:
        return "error"
    if not result.get("content") and result.get("structuredContent") is None:
        return "empty"
    return "success"
