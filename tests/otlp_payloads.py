"""Real OTLP payloads for the tests: spans recorded by the opentelemetry-sdk and encoded by its own OTLP
encoders (protobuf: ``opentelemetry-exporter-otlp-proto-common``; OTLP/JSON with hex ids:
``opentelemetry-exporter-otlp-json-common``), never hand-written dicts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans as encode_json
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as encode_proto
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span, Status, StatusCode, Tracer, set_span_in_context

ENCODINGS = ("otlp_proto", "otlp_json")


class Recorder:
    """A TracerProvider whose finished spans are kept in memory, in the order they ended."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer: Tracer = self.provider.get_tracer("loopwarden-tests")

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def tool(self, tool: str | None, *, end_ms: int, latency_ms: int = 40, parent: Span | None = None,
             name: str | None = None, args: Any = None, result: Any = None, error: str | None = None,
             status: StatusCode = StatusCode.UNSET, message: str | None = None, **attributes: Any) -> Span:
        """An ended tool span: GenAI execute_tool conventions, arguments and result as JSON strings
        (``args``/``result`` given as str are passed as they are), extra attributes as given."""
        attrs: dict[str, Any] = {"gen_ai.operation.name": "execute_tool"}
        if tool is not None:
            attrs["gen_ai.tool.name"] = tool
        if args is not None:
            attrs["gen_ai.tool.call.arguments"] = args if isinstance(args, str) else json.dumps(args)
        if result is not None:
            attrs["gen_ai.tool.call.result"] = result if isinstance(result, str) else json.dumps(result)
        if error is not None:
            attrs["error.type"] = error
        attrs.update(attributes)
        return self.span(name or f"execute_tool {tool}", end_ms=end_ms, latency_ms=latency_ms, parent=parent,
                         status=status, message=message, **attrs)

    def span(self, name: str, *, end_ms: int, latency_ms: int = 40, parent: Span | None = None,
             status: StatusCode = StatusCode.UNSET, message: str | None = None, **attributes: Any) -> Span:
        """An ended span of any kind."""
        context = set_span_in_context(parent) if parent is not None else None
        span = self.tracer.start_span(name, context=context, attributes=attributes,
                                      start_time=(end_ms - latency_ms) * 1_000_000)
        if status is not StatusCode.UNSET:
            span.set_status(Status(status, message if status is StatusCode.ERROR else None))
        span.end(end_time=end_ms * 1_000_000)
        return span


def encode(spans: Sequence[ReadableSpan], encoding: str) -> bytes:
    """One exporter record holding ``spans``, as the collector's kafka exporter writes it."""
    if encoding == "otlp_proto":
        return encode_proto(spans).SerializeToString()
    return encode_json(spans).to_json().encode()


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    context = span.get_span_context()
    return format(context.trace_id, "032x"), format(context.span_id, "016x")

