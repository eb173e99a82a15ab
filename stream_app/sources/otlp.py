"""OpenTelemetry tool spans as telemetry: the GenAI ``execute_tool`` span mapped to one telemetry v1 event.

Agents already instrumented with OpenTelemetry describe every tool call as a span with
``gen_ai.operation.name = execute_tool`` (GenAI semantic conventions). Two adapters turn those spans
into the native contract, so they go through exactly the detector fold native telemetry goes through:

- the worker reads the OpenTelemetry Collector's ``kafka`` exporter topic (``otlp_proto`` or
  ``otlp_json`` records; ``tool_calls_of``) and re-publishes each tool span as telemetry keyed by run id;
- ``stream_app.integrations.otel.LoopwardenSpanProcessor`` does it inside the instrumented process.

The mapping (``tool_call``), shared by both:

- a tool span is recognised by its ``gen_ai.operation.name`` attribute, never by its name (span names
  differ between instrumentations); other spans are skipped before their attributes are decoded;
- ``tool`` is ``gen_ai.tool.name`` (required);
- ``outcome``: status ERROR or an ``error.type`` attribute is ``error``; otherwise our
  ``dev.loopwarden.outcome`` (for ``empty`` and ``noop``, which have no convention), else ``success``:
  status OK and UNSET both mean success (some exporters set OK on every span);
- ``args`` is the opt-in ``gen_ai.tool.call.arguments`` (a JSON string, or an object), else our
  ``dev.loopwarden.args_hash``, else ``{}``: without either, a tool's calls compare by tool name and
  result alone, which can only halt sooner (fail closed). Arguments that are not a JSON object are
  kept as ``{"arguments": value}``;
- ``result`` is the opt-in ``gen_ai.tool.call.result`` (JSON, or kept as the string), else our
  ``dev.loopwarden.result_hash``, else, for an error, ``{"error_type": error.type, "message": the
  status description}`` (so a retry whose error changes is a retry), else null; ``result_fp`` is our
  ``dev.loopwarden.result_fp`` (a failing result's fingerprint, computed where the result was: a raw
  result overrides it);
- ``run_id``: ``gen_ai.conversation.id`` where the span has it, else the trace id (``run_id_from=
  "conversation"``, the default), or always the trace id (``"trace"``). A conversation spans many
  traces (one per turn), so a loop across turns is only seen by conversation; but the conventions put
  the conversation id on agent and inference spans and only *allow* it on tool spans, hence the
  fallback: a trace is then one agent invocation;
- ``event_id`` is ``{trace_id}-{span_id}``: a span delivered twice (collector retries, a redelivered
  record, the processor and the collector both reporting it) counts once;
- ``ts_ms`` is the span's end time; trace, span and parent span ids are kept; ``agent_id`` is
  ``gen_ai.agent.name``; ``error_class`` is ``error.type``;
- ``dev.loopwarden.retry_budget``, ``.plan_step``, ``.side_effect`` carry what has no convention.

A tool span that breaks these rules (no tool name, a mistyped attribute) is an ``InvalidEvent``
naming the attribute; the worker dead-letters the record it came in and still relays its other spans.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Status, TracesData

from ..core import OUTCOMES, InvalidEvent, NotJSON, Outcome, decode_event
from ..core.contract import MAX_ID_LENGTH, MAX_RETRY_BUDGET
from . import Decoded

Encoding = Literal["otlp_proto", "otlp_json"]
RunIdFrom = Literal["conversation", "trace"]
ENCODINGS: Final[tuple[Encoding, ...]] = ("otlp_proto", "otlp_json")
RUN_ID_SOURCES: Final[tuple[RunIdFrom, ...]] = ("conversation", "trace")

# GenAI semantic conventions (execute_tool span) and the general error attribute.
OPERATION: Final = "gen_ai.operation.name"
EXECUTE_TOOL: Final = "execute_tool"
#: Inference operations: a span of one of these is a model call (``kind: model_call``).
INFERENCE: Final = frozenset(("chat", "text_completion", "generate_content"))
REQUEST_MODEL: Final = "gen_ai.request.model"
RESPONSE_MODEL: Final = "gen_ai.response.model"
INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
TOOL_NAME: Final = "gen_ai.tool.name"
ARGUMENTS: Final = "gen_ai.tool.call.arguments"
RESULT: Final = "gen_ai.tool.call.result"
CONVERSATION: Final = "gen_ai.conversation.id"
AGENT_NAME: Final = "gen_ai.agent.name"
ERROR_TYPE: Final = "error.type"

#: Our reverse-DNS prefix for what the conventions do not cover (semantic-conventions naming.md).
PREFIX: Final = "dev.loopwarden."
RETRY_BUDGET: Final = PREFIX + "retry_budget"
PLAN_STEP: Final = PREFIX + "plan_step"
SIDE_EFFECT: Final = PREFIX + "side_effect"
ARGS_HASH: Final = PREFIX + "args_hash"
RESULT_HASH: Final = PREFIX + "result_hash"
RESULT_FP: Final = PREFIX + "result_fp"
OUTCOME: Final = PREFIX + "outcome"

_SPAN_FIELDS: Final = ("traceId", "spanId", "parentSpanId", "startTimeUnixNano", "endTimeUnixNano",
                       "attributes", "status")
_HEX_IDS: Final = ("traceId", "spanId", "parentSpanId")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """What one tool span says, in the telemetry contract's terms. ``args`` is None when only
    ``args_hash`` is known; ``has_result`` is False when only ``result_hash`` is."""

    run_id: str
    event_id: str
    tool: str
    ts_ms: int
    outcome: Outcome
    latency_ms: float
    trace_id: str
    span_id: str
    parent_span_id: str | None
    args: dict[str, Any] | None
    args_hash: str | None
    result: Any
    has_result: bool
    result_hash: str | None
    agent_id: str | None
    retry_budget: int | None
    plan_step: int | None
    side_effect: bool | None
    error_class: str | None
    result_fp: str | None = None
    #: ``model_call`` for an inference span (``tool`` is the model), else None.
    kind: str | None = None
    tokens: int | None = None

    def telemetry(self) -> dict[str, Any]:
        """The telemetry v1 object of this call, arguments and result as the span carried them."""
        event: dict[str, Any] = {
            "schema_version": "1",
            "run_id": self.run_id,
            "event_id": self.event_id,
            "tool": self.tool,
            "ts_ms": self.ts_ms,
            "outcome": self.outcome,
            "latency_ms": self.latency_ms,
            "trace_id": self.trace_id,
            "span_id": self.span_id,
        }
        if self.kind is not None:
            event["kind"] = self.kind  # a model call: no args, no result
        elif self.args is not None:
            event["args"] = self.args
        else:
            event["args_hash"] = self.args_hash
        if self.kind is None and self.has_result:
            event["result"] = self.result
        elif self.kind is None:
            event["result_hash"] = self.result_hash
        for name in ("parent_span_id", "agent_id", "retry_budget", "plan_step", "side_effect", "error_class",
                     "result_fp", "tokens"):
            value = getattr(self, name)
            if value is not None:
                event[name] = value
        return event


def is_tool_span(attributes: Mapping[str, Any]) -> bool:
    """Whether a span's attributes describe a tool execution or a model call (by attribute, never by
    span name)."""
    operation = attributes.get(OPERATION)
    return operation == EXECUTE_TOOL or operation in INFERENCE


def _model_call(attributes: Mapping[str, Any], where: str, **ids: Any) -> ToolCall:
    """An inference span as a model call: its model is the ``tool``, its tokens are input + output."""
    model = (_string(attributes, RESPONSE_MODEL, where) or _string(attributes, REQUEST_MODEL, where)
             or str(attributes.get(OPERATION)))
    counts = [_integer(attributes, name, where, 0) for name in (INPUT_TOKENS, OUTPUT_TOKENS)]
    tokens = sum(c for c in counts if c is not None) if any(c is not None for c in counts) else None
    return ToolCall(tool=model[:MAX_ID_LENGTH], args=None, args_hash=None, result=None, has_result=False,
                    result_hash=None, retry_budget=None, plan_step=None, side_effect=None, kind="model_call",
                    tokens=tokens, **ids)


def tool_call(
    attributes: Mapping[str, Any],
    *,
    trace_id: str,
    span_id: str,
    parent_span_id: str | None,
    start_ns: int,
    end_ns: int,
    error_status: bool,
    status_message: str,
    run_id_from: RunIdFrom = "conversation",
) -> ToolCall:
    """Map one tool span (ids in lowercase hex) to a ToolCall; raise InvalidEvent naming the attribute."""
    where = f" (span {span_id})"
    if len(trace_id) != 32 or trace_id == "0" * 32:
        raise InvalidEvent("traceId", f"a tool span needs a valid 16-byte trace id{where}")
    if len(span_id) != 16 or span_id == "0" * 16:
        raise InvalidEvent("spanId", f"a tool span needs a valid 8-byte span id, got {span_id!r}")
    if end_ns <= 0:
        raise InvalidEvent("endTimeUnixNano", f"a tool span needs its end time{where}")
    if attributes.get(OPERATION) in INFERENCE:
        error_type = attributes.get(ERROR_TYPE)
        run_id = trace_id
        if run_id_from == "conversation":
            run_id = _string(attributes, CONVERSATION, where) or trace_id
        return _model_call(
            attributes, where, run_id=run_id, event_id=f"{trace_id}-{span_id}", ts_ms=end_ns // 1_000_000,
            outcome="error" if error_status or error_type is not None else "success",
            latency_ms=round(max(end_ns - start_ns, 0) / 1e6, 3), trace_id=trace_id, span_id=span_id,
            parent_span_id=parent_span_id or None, agent_id=_string(attributes, AGENT_NAME, where),
            error_class=None if error_type is None else str(error_type)[:MAX_ID_LENGTH])
    tool = _string(attributes, TOOL_NAME, where, required=True)
    assert tool is not None

    error_type = attributes.get(ERROR_TYPE)
    error_class = None if error_type is None else str(error_type)[:MAX_ID_LENGTH]
    outcome: Outcome
    if error_status or error_class is not None:
        outcome = "error"
    else:
        declared = attributes.get(OUTCOME, "success")
        if declared not in OUTCOMES:
            raise InvalidEvent(OUTCOME, f"must be one of {', '.join(sorted(OUTCOMES))}, got {declared!r}"[:200]
                               + where)
        outcome = declared

    args_hash = _string(attributes, ARGS_HASH, where)
    raw_args = attributes.get(ARGUMENTS)
    args: dict[str, Any] | None
    if raw_args is not None:
        parsed = _json_value(raw_args)
        args = parsed if isinstance(parsed, dict) else {"arguments": parsed}
    else:
        args = None if args_hash is not None else {}

    result_hash = _string(attributes, RESULT_HASH, where)
    has_result = True
    result: Any = None
    if RESULT in attributes:
        result = _json_value(attributes[RESULT])
    elif result_hash is not None:
        has_result = False
    elif outcome == "error":
        details = {"error_type": error_class, "message": status_message or None}
        result = {key: value for key, value in details.items() if value is not None} or None

    run_id = trace_id
    if run_id_from == "conversation":
        run_id = _string(attributes, CONVERSATION, where) or trace_id

    return ToolCall(
        run_id=run_id,
        event_id=f"{trace_id}-{span_id}",
        tool=tool,
        ts_ms=end_ns // 1_000_000,
        outcome=outcome,
        latency_ms=round(max(end_ns - start_ns, 0) / 1e6, 3),
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent_span_id or None,
        args=args,
        args_hash=args_hash,
        result=result,
        has_result=has_result,
        result_hash=result_hash,
        agent_id=_string(attributes, AGENT_NAME, where),
        retry_budget=_integer(attributes, RETRY_BUDGET, where, 0, MAX_RETRY_BUDGET),
        plan_step=_integer(attributes, PLAN_STEP, where),
        side_effect=_boolean(attributes, SIDE_EFFECT, where),
        error_class=error_class,
        result_fp=_string(attributes, RESULT_FP, where),
    )


def tool_calls_of(raw: bytes, encoding: Encoding, run_id_from: RunIdFrom = "conversation",
                  max_event_bytes: int = 1 << 20) -> tuple[list[ToolCall], list[InvalidEvent]]:
    """The tool calls of one exporter record (a TracesData, as ``otlp_proto`` or ``otlp_json``), in
    end-time order, and the errors of its tool spans that broke the mapping or the telemetry contract
    (each event must also encode within ``max_event_bytes``). Raise InvalidEvent when the record is not
    OTLP at all."""
    traces = _decode(raw, encoding)
    calls: list[ToolCall] = []
    errors: list[InvalidEvent] = []
    for resource_spans in traces.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                if not _is_tool_kv(span.attributes):
                    continue  # skipped before its attributes are decoded
                try:
                    call = tool_call(
                        {kv.key: _any_value(kv.value) for kv in span.attributes},
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        error_status=span.status.code == Status.STATUS_CODE_ERROR,
                        status_message=span.status.message,
                        run_id_from=run_id_from,
                    )
                    event = call.telemetry()
                    decode_event(event)  # the contract's own check, naming the field
                    size = len(orjson.dumps(event))
                    if size > max_event_bytes:
                        raise InvalidEvent("", f"the telemetry of tool span {call.span_id} is {size} bytes, "
                                               f"over the {max_event_bytes}-byte limit")
                except InvalidEvent as exc:
                    errors.append(exc)
                    continue
                calls.append(call)
    calls.sort(key=lambda c: c.ts_ms)  # stable: spans that ended in the same millisecond keep their order
    return calls, errors


def decoder(encoding: Encoding, run_id_from: RunIdFrom = "conversation",
            max_event_bytes: int = 1 << 20) -> Callable[[bytes], Decoded]:
    """This source's decoder for the worker's relay: one exporter record in, its tool calls as telemetry
    v1 objects and the errors of its bad tool spans out (``tool_calls_of``)."""

    def decode(raw: bytes) -> Decoded:
        calls, errors = tool_calls_of(raw, encoding, run_id_from, max_event_bytes)
        return Decoded([call.telemetry() for call in calls], errors, "tool span")

    return decode


def _decode(raw: bytes, encoding: Encoding) -> TracesData:
    """The record as TracesData (the collector's ``ptrace`` marshalers write exactly that message)."""
    if encoding == "otlp_proto":
        try:
            traces: TracesData = TracesData.FromString(raw)
        except DecodeError as exc:
            raise InvalidEvent("", f"not OTLP protobuf (TracesData): {exc}") from exc
        return traces
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise NotJSON.at(exc.msg, exc.pos) from exc
    try:
        if type(document) is not dict:
            raise TypeError(f"a TracesData object was expected, got {type(document).__name__}")
        for resource_spans in document.get("resourceSpans") or ():
            for scope_spans in resource_spans.get("scopeSpans") or ():
                scope_spans["spans"] = [_proto_json_span(span) for span in scope_spans.get("spans") or ()
                                        if _is_tool_json(span)]
        parsed: TracesData = json_format.ParseDict(document, TracesData(), ignore_unknown_fields=True)
        return parsed
    except (json_format.ParseError, AttributeError, TypeError, ValueError) as exc:
        raise InvalidEvent("", f"not OTLP/JSON traces: {exc}"[:1000]) from exc


def _is_tool_json(span: dict[str, Any]) -> bool:
    for attribute in span.get("attributes") or ():
        if attribute.get("key") == OPERATION:
            value = attribute.get("value")
            return type(value) is dict and (value.get("stringValue") == EXECUTE_TOOL
                                             or value.get("stringValue") in INFERENCE)
    return False


def _proto_json_span(span: dict[str, Any]) -> dict[str, Any]:
    """The fields the mapping reads, with OTLP/JSON's hex ids turned into proto JSON's base64 (events
    and links are dropped unread)."""
    kept: dict[str, Any] = {name: span[name] for name in _SPAN_FIELDS if name in span}
    for name in _HEX_IDS:
        if kept.get(name):
            kept[name] = base64.b64encode(bytes.fromhex(kept[name])).decode()
    return kept


def _is_tool_kv(attributes: Iterable[KeyValue]) -> bool:
    for kv in attributes:
        if kv.key == OPERATION:
            return kv.value.string_value == EXECUTE_TOOL or kv.value.string_value in INFERENCE
    return False


def _any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()
    return getattr(value, kind)


def _json_value(value: Any) -> Any:
    """An attribute that carries JSON (a string), or a structured value as it is; a string that is
    not JSON is kept as the string."""
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return list(value) if isinstance(value, tuple) else value


def _string(attributes: Mapping[str, Any], name: str, where: str, required: bool = False) -> str | None:
    value = attributes.get(name)
    if value is None or value == "":
        if required:
            raise InvalidEvent(name, f"required on a tool span{where}")
        return None
    if type(value) is not str or len(value) > MAX_ID_LENGTH:
        raise InvalidEvent(name, f"must be a string of at most {MAX_ID_LENGTH} characters{where}")
    return value


def _integer(attributes: Mapping[str, Any], name: str, where: str, minimum: int | None = None,
             maximum: int | None = None) -> int | None:
    value = attributes.get(name)
    if value is None:
        return None
    if type(value) is not int or (minimum is not None and value < minimum) or (
            maximum is not None and value > maximum):
        bounds = f" from {minimum} to {maximum}" if minimum is not None else ""
        raise InvalidEvent(name, f"must be an integer{bounds}, got {value!r}"[:200] + where)
    return value


def _boolean(attributes: Mapping[str, Any], name: str, where: str) -> bool | None:
    value = attributes.get(name)
    if value is not None and type(value) is not bool:
        raise InvalidEvent(name, f"must be a boolean, got {value!r}"[:200] + where)
    return value
