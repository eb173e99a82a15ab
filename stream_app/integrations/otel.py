"""loopwarden for an app already instrumented with OpenTelemetry: a ``SpanProcessor`` that reports each
ended GenAI tool span (``gen_ai.operation.name = execute_tool``) as one telemetry event.

    async with LoopwardenSpanProcessor(TelemetryPublisher(config)) as processor:
        provider.add_span_processor(processor)

The span is mapped exactly as the worker maps the collector's OTLP records (``stream_app.sources.otlp``: tool,
outcome, run id, event id ``{trace_id}-{span_id}``, end time, error class, upstream, our ``dev.loopwarden.*``
attributes), so a call reported both ways counts once. The processor sees one span at a time, so a
sub-agent tree is only what the spans declare (``dev.loopwarden.parent_run_id`` and the rest), never
what a record's span parentage gives the collector route. Unlike the collector route, the event is
built by the SDK's ``TelemetryBuilder``: secrets are redacted and arguments and results are hashed
here, in the app, so they do not travel unless a tool is opted in (``raw_tools``).

Spans end on whichever thread ran the tool, and ``on_end`` must neither block nor raise: the event is
handed to the publisher's event loop (the loop running when the processor is made, or ``loop=``) in
the order the spans ended. A tool span that breaks the mapping (no ``gen_ai.tool.name``, a mistyped
attribute) is logged and counted in ``rejected``, never raised into the app.

The processor reports; halts reach the app the usual way: a ``Guard.fleet`` or ``HaltListener`` in the
same process applies the workers' decisions (``guard.run(run_id).halted``, bound tasks cancelled).
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import StatusCode

from ..client import FinishedCall, InvalidCall, TelemetryBuilder, TelemetryPublisher, UsageError
from ..core import InvalidEvent
from ..sources.otlp import RUN_ID_SOURCES, RunIdFrom, ToolCall, is_tool_span, tool_call

logger = logging.getLogger(__name__)


class LoopwardenSpanProcessor(SpanProcessor):
    """Publishes the telemetry of every tool span that ends, through ``publisher``. As an async context
    manager it starts the publisher, and on exit delivers what the spans ended so far reported, then
    stops it; otherwise keep the publisher running while spans end and ``await flush()`` before
    stopping it. ``builder`` sets hashing, raw tools and redaction (default: the SDK's defaults);
    ``run_id_from``: ``"conversation"`` (``gen_ai.conversation.id``, else the trace id) or ``"trace"``.
    Counters: ``reported``, ``rejected`` (bad tool spans), ``dropped`` (not queued)."""

    def __init__(
        self,
        publisher: TelemetryPublisher,
        builder: TelemetryBuilder | None = None,
        *,
        run_id_from: RunIdFrom = "conversation",
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if run_id_from not in RUN_ID_SOURCES:
            raise InvalidCall(f"run_id_from: expected conversation or trace, got {run_id_from!r}")
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise UsageError("LoopwardenSpanProcessor: make it inside the event loop that runs the "
                                   "publisher, or pass loop=") from None
        self.publisher = publisher
        self.builder = builder or TelemetryBuilder()
        self.run_id_from = run_id_from
        self.loop = loop
        self.reported = 0
        self.rejected = 0
        self.dropped = 0
        self._pending: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> LoopwardenSpanProcessor:
        await self.publisher.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            await self.flush()
        finally:
            await self.publisher.stop()

    def on_end(self, span: ReadableSpan) -> None:
        attributes = span.attributes or {}
        if not is_tool_span(attributes):
            return
        context = span.get_span_context()
        try:
            call = tool_call(
                attributes,
                trace_id=format(context.trace_id, "032x") if context else "",
                span_id=format(context.span_id, "016x") if context else "",
                parent_span_id=format(span.parent.span_id, "016x") if span.parent else None,
                start_ns=span.start_time or 0,
                end_ns=span.end_time or 0,
                error_status=span.status.status_code is StatusCode.ERROR,
                status_message=span.status.description or "",
                run_id_from=self.run_id_from,
            )
        except InvalidEvent as exc:
            self.rejected += 1
            logger.warning("tool span %r not reported to loopwarden: %s", span.name, exc)
            return
        try:
            self.loop.call_soon_threadsafe(self._hand_over, call)
        except RuntimeError:  # the loop is closed: the app is shutting down
            self.dropped += 1
            logger.warning("tool span %r not reported to loopwarden: its event loop is closed", span.name)

    async def flush(self) -> None:
        """Wait until the tool spans ended so far are acknowledged by the broker (or have failed)."""
        await asyncio.sleep(0)  # hand-overs scheduled from other threads run first
        while self._pending:
            await asyncio.gather(*self._pending)
        await self.publisher.flush()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """``flush`` for threads other than the publisher's loop (which must not block on itself)."""
        try:
            if asyncio.get_running_loop() is self.loop:
                return False
        except RuntimeError:
            pass
        future = asyncio.run_coroutine_threadsafe(self.flush(), self.loop)
        try:
            future.result(timeout_millis / 1000)
        except TimeoutError:
            return False
        return True

    def _hand_over(self, call: ToolCall) -> None:
        """On the loop: publish in the order spans ended (each task queues its event on its first step)."""
        task = self.loop.create_task(self._publish(self._event(call)))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _publish(self, event: dict[str, Any]) -> None:
        try:
            await self.publisher.publish(event)
        except Exception:
            self.dropped += 1
            logger.warning("tool call of run %s not reported to loopwarden", event["run_id"], exc_info=True)
        else:
            self.reported += 1

    def _event(self, call: ToolCall) -> dict[str, Any]:
        """The call's telemetry, built (redacted, hashed) by the SDK's builder, with the span's ids."""
        event = self.builder.build(
            FinishedCall(call.run_id, call.tool, call.args or {}, call.outcome, call.result, call.ts_ms,
                         call.latency_ms, agent_id=call.agent_id, side_effect=call.side_effect,
                         retry_budget=call.retry_budget, plan_step=call.plan_step, error_class=call.error_class,
                         kind=call.kind, tokens=call.tokens, tool_class=call.tool_class, fleet=call.fleet()),
            args_hash=call.args_hash if call.args is None else None,  # arguments, when present, win
        )
        event.update(event_id=call.event_id, trace_id=call.trace_id, span_id=call.span_id)
        if call.parent_span_id:
            event["parent_span_id"] = call.parent_span_id
        if call.kind is not None:  # a model call: no arguments, no result
            return event
        if call.args is None:  # only the span's hash is known (a raw tool would otherwise send {})
            event.pop("args", None)
            event["args_hash"] = call.args_hash
        if not call.has_result:
            event.pop("result", None)
            event["result_hash"] = call.result_hash
            event.pop("result_fp", None)  # the builder's would be of the missing result
            if call.result_fp is not None:
                event["result_fp"] = call.result_fp
        return event
