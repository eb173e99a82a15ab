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
  ``gen_ai.agent.name``;
- ``error_class`` is ``error.type``, except on a failed span whose ``http.response.status_code`` is
  400-599 and whose ``error.type`` is absent or that same status (the HTTP conventions' form): then
  ``http_<status>``, which the storm rules know (429 and 5xx are transient). A bare number in
  ``error.type`` alone stays as it is: on an MCP span it is a JSON-RPC error code, and those may be
  any integer. Exception names (``TimeoutError``, ``java.net.SocketTimeoutException``) stay as given
  too: which of them are timeouts or refused connections differs between languages and libraries, and
  a wrong guess would pause a tool over errors that are the caller's. A status on a span that did not
  fail classes nothing;
- ``upstream`` (what the storm rules count by): our ``dev.loopwarden.upstream``, else ``server.address``,
  with ``server.port`` appended (``host:port``, an IPv6 address in brackets) unless it is 80 or 443:
  nobody writes a host's default port when naming it, and any other port tells servers of one host
  apart (local MCP servers). The MCP conventions name no server, only its address, and a stdio server
  (``network.transport = pipe``) has none: name it with our attribute;
- ``retry_after_ms``: our ``dev.loopwarden.retry_after_ms``, else, on a failed span, the first value of
  ``http.response.header.retry-after`` in seconds (an HTTP date is left to the pause's default wait);
- ``dev.loopwarden.retry_budget``, ``.plan_step``, ``.side_effect`` carry what has no convention, and
  so do the fields of the rules across runs: ``.parent_run_id``, ``.root_run_id`` (required with a
  parent), ``.depth``, ``.thread_key``, ``.trigger`` and ``.caused_by_run_id`` on any span of a run;
  ``.tool_class``, ``.child_run_id``, ``.child_agent_id`` and ``.task_hash`` on a tool span. The
  conventions' attributes read only for those rules (``server.*``, ``http.response.*``) are ignored
  when mistyped rather than costing the call: they were never a reason to refuse a span before.

Sub-agent trees from span parentage. An ``invoke_agent`` span is one agent invocation. Within one
exporter record, an invocation started inside another agent's work (an ``invoke_agent`` or
``execute_tool`` span among its ancestors, by parent span id) is a sub-agent, with a run of its own,
``{trace_id}-{its span id}``: the calls under it (the nearest invocation above a span decides) are
that run's, with ``parent_run_id`` the run that started it, ``root_run_id`` the run they would have
had without a tree (conversation or trace, as above: the root agent's run) and ``depth`` the
sub-agents up the chain. An outermost invocation is the root agent, whose calls keep that run, as do
spans under no invocation at all. A tool span that is the nearest work above a sub-agent's invocation
started it: ``tool_class`` is ``spawn`` and, when it started one sub-agent, ``child_run_id`` and
``child_agent_id`` (that invocation's ``gen_ai.agent.name``) name it. An invocation under a ``CLIENT``
``invoke_agent`` span (with no other work between) is the remote agent serving that call: one
invocation, whose run the client span names.

That is best effort and stateless: a record is all that is known, and a parent span ends after its
children, so a record often holds a sub-agent's calls without the spans above them. Those calls then
count in the root run, as they did before trees (never in a run that does not exist), and a depth
counts only the ancestors in the record: it is at most the true one, so the tree rules can fire late,
never falsely. Declared lineage (any of ``.parent_run_id``, ``.root_run_id``, ``.depth``) wins as a
whole: the span's run is then its conversation or trace, as without a tree; a declared ``.tool_class``
or child wins over the derived ones. The span processor sees one span at a time: declared attributes
only. Trees by span names (``Task``, ``transfer_to_*``) are not guessed.

A tool span that breaks these rules (no tool name, a mistyped attribute of ours) is an ``InvalidEvent``
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
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status, TracesData

from ..core import OUTCOMES, InvalidEvent, NotJSON, Outcome, decode_event
from ..core.contract import MAX_DEPTH, MAX_ID_LENGTH, MAX_RETRY_BUDGET, TOOL_CLASSES, TRIGGERS
from . import Decoded

Encoding = Literal["otlp_proto", "otlp_json"]
RunIdFrom = Literal["conversation", "trace"]
ENCODINGS: Final[tuple[Encoding, ...]] = ("otlp_proto", "otlp_json")
RUN_ID_SOURCES: Final[tuple[RunIdFrom, ...]] = ("conversation", "trace")

# GenAI semantic conventions (execute_tool span) and the general error attribute.
OPERATION: Final = "gen_ai.operation.name"
EXECUTE_TOOL: Final = "execute_tool"
#: One agent invocation (its span is the parent of the invocation's calls).
INVOKE_AGENT: Final = "invoke_agent"
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
SERVER_ADDRESS: Final = "server.address"
SERVER_PORT: Final = "server.port"
HTTP_STATUS: Final = "http.response.status_code"
RETRY_AFTER: Final = "http.response.header.retry-after"

#: Our reverse-DNS prefix for what the conventions do not cover (semantic-conventions naming.md).
PREFIX: Final = "dev.loopwarden."
RETRY_BUDGET: Final = PREFIX + "retry_budget"
PLAN_STEP: Final = PREFIX + "plan_step"
SIDE_EFFECT: Final = PREFIX + "side_effect"
ARGS_HASH: Final = PREFIX + "args_hash"
RESULT_HASH: Final = PREFIX + "result_hash"
RESULT_FP: Final = PREFIX + "result_fp"
OUTCOME: Final = PREFIX + "outcome"
UPSTREAM: Final = PREFIX + "upstream"
RETRY_AFTER_MS: Final = PREFIX + "retry_after_ms"
PARENT_RUN_ID: Final = PREFIX + "parent_run_id"
ROOT_RUN_ID: Final = PREFIX + "root_run_id"
DEPTH: Final = PREFIX + "depth"
THREAD_KEY: Final = PREFIX + "thread_key"
TRIGGER: Final = PREFIX + "trigger"
CAUSED_BY_RUN_ID: Final = PREFIX + "caused_by_run_id"
TOOL_CLASS: Final = PREFIX + "tool_class"
CHILD_RUN_ID: Final = PREFIX + "child_run_id"
CHILD_AGENT_ID: Final = PREFIX + "child_agent_id"
TASK_HASH: Final = PREFIX + "task_hash"

#: Ports left out of an upstream's name: HTTP's and HTTPS's defaults, which nobody writes.
DEFAULT_PORTS: Final = frozenset((80, 443))
#: The longest wait a Retry-After is taken for (the SDK's bound, too): past it, the pause's default.
MAX_RETRY_AFTER_MS: Final = 86_400_000
#: The telemetry fields of the rules across runs, as a ToolCall carries them.
FLEET_FIELDS: Final = ("parent_run_id", "root_run_id", "depth", "child_run_id", "child_agent_id", "task_hash",
                       "upstream", "retry_after_ms", "trigger", "caused_by_run_id", "thread_key")

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
    #: What the call does (declared, or ``spawn`` from parentage); None leaves it to the tool's policy.
    tool_class: str | None = None
    # The rules across runs (``FLEET_FIELDS``): trees, storms, chains.
    parent_run_id: str | None = None
    root_run_id: str | None = None
    depth: int | None = None
    child_run_id: str | None = None
    child_agent_id: str | None = None
    task_hash: str | None = None
    upstream: str | None = None
    retry_after_ms: int | None = None
    trigger: str | None = None
    caused_by_run_id: str | None = None
    thread_key: str | None = None

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
                     "result_fp", "tokens", "tool_class"):
            value = getattr(self, name)
            if value is not None:
                event[name] = value
        event.update(self.fleet())
        return event

    def fleet(self) -> dict[str, Any]:
        """The call's fields for the rules across runs that it has (``FLEET_FIELDS``)."""
        return {name: value for name in FLEET_FIELDS if (value := getattr(self, name)) is not None}


@dataclass(frozen=True, slots=True)
class Lineage:
    """What one record's span parentage says of a span (the module docstring's trees): the sub-agent
    invocation whose run it is in and the one that started that (span ids; None: the root run), that
    run's depth, and for a tool span the sub-agent invocations it started (span id, agent name)."""

    agent: str | None = None
    parent_agent: str | None = None
    depth: int = 0
    children: tuple[tuple[str, str | None], ...] = ()


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
    lineage: Lineage | None = None,
) -> ToolCall:
    """Map one tool span (ids in lowercase hex) to a ToolCall; raise InvalidEvent naming the attribute.
    ``lineage`` is what the span's record says of its place in a sub-agent tree (``tool_calls_of``)."""
    where = f" (span {span_id})"
    if len(trace_id) != 32 or trace_id == "0" * 32:
        raise InvalidEvent("traceId", f"a tool span needs a valid 16-byte trace id{where}")
    if len(span_id) != 16 or span_id == "0" * 16:
        raise InvalidEvent("spanId", f"a tool span needs a valid 8-byte span id, got {span_id!r}")
    if end_ns <= 0:
        raise InvalidEvent("endTimeUnixNano", f"a tool span needs its end time{where}")
    error_type = attributes.get(ERROR_TYPE)
    error_text = None if error_type is None else str(error_type)[:MAX_ID_LENGTH]
    failed = error_status or error_text is not None
    span: dict[str, Any] = {
        "event_id": f"{trace_id}-{span_id}", "ts_ms": end_ns // 1_000_000,
        "latency_ms": round(max(end_ns - start_ns, 0) / 1e6, 3), "trace_id": trace_id, "span_id": span_id,
        "parent_span_id": parent_span_id or None, "agent_id": _string(attributes, AGENT_NAME, where),
        "error_class": _error_class(attributes, error_text, failed),
        **_run(attributes, trace_id, where, run_id_from, lineage),
    }
    if attributes.get(OPERATION) in INFERENCE:
        return _model_call(attributes, where, outcome="error" if failed else "success", **span)
    tool = _string(attributes, TOOL_NAME, where, required=True)
    assert tool is not None

    outcome: Outcome
    if failed:
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
        details = {"error_type": error_text, "message": status_message or None}
        result = {key: value for key, value in details.items() if value is not None} or None

    return ToolCall(
        tool=tool,
        outcome=outcome,
        args=args,
        args_hash=args_hash,
        result=result,
        has_result=has_result,
        result_hash=result_hash,
        retry_budget=_integer(attributes, RETRY_BUDGET, where, 0, MAX_RETRY_BUDGET),
        plan_step=_integer(attributes, PLAN_STEP, where),
        side_effect=_boolean(attributes, SIDE_EFFECT, where),
        result_fp=_string(attributes, RESULT_FP, where),
        upstream=_upstream(attributes, where),
        retry_after_ms=_retry_after_ms(attributes, where, failed),
        **_spawn(attributes, trace_id, where, lineage),
        **span,
    )


def _error_class(attributes: Mapping[str, Any], error_type: str | None, failed: bool) -> str | None:
    """``error.type``, or ``http_<status>`` where the span failed with an HTTP status that ``error.type``
    does not contradict (absent, or the status itself: the HTTP conventions' form)."""
    status = attributes.get(HTTP_STATUS)
    if failed and type(status) is int and 400 <= status <= 599 and error_type in (None, str(status)):
        return f"http_{status}"
    return error_type


def _upstream(attributes: Mapping[str, Any], where: str) -> str | None:
    """Ours, else ``server.address`` (with a port other than 80 and 443); None when neither is a name."""
    declared = _string(attributes, UPSTREAM, where)
    if declared is not None:
        return declared
    host = attributes.get(SERVER_ADDRESS)
    if type(host) is not str or not host:
        return None
    port = attributes.get(SERVER_PORT)
    if type(port) is int and 0 < port < 65_536 and port not in DEFAULT_PORTS:
        host = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    return host if len(host) <= MAX_ID_LENGTH else None


def _retry_after_ms(attributes: Mapping[str, Any], where: str, failed: bool) -> int | None:
    """Ours, else a failed span's ``Retry-After`` response header in seconds (a list of strings, as the
    HTTP conventions record headers); None for an HTTP date or a wait past ``MAX_RETRY_AFTER_MS``."""
    declared = _integer(attributes, RETRY_AFTER_MS, where, 0, MAX_RETRY_AFTER_MS)
    if declared is not None or not failed:
        return declared
    header = attributes.get(RETRY_AFTER)
    if isinstance(header, list | tuple):
        header = header[0] if header else None
    if type(header) is not str:
        return None
    try:
        seconds = float(header)
    except ValueError:
        return None
    return int(seconds * 1000) if 0 <= seconds * 1000 <= MAX_RETRY_AFTER_MS else None


def _run(attributes: Mapping[str, Any], trace_id: str, where: str, run_id_from: RunIdFrom,
         lineage: Lineage | None) -> dict[str, Any]:
    """The span's run and that run's fields: declared, else what the record's parentage says."""
    run_id = trace_id
    if run_id_from == "conversation":
        run_id = _string(attributes, CONVERSATION, where) or trace_id
    parent = _string(attributes, PARENT_RUN_ID, where)
    root = _string(attributes, ROOT_RUN_ID, where)
    depth = _integer(attributes, DEPTH, where, 0, MAX_DEPTH)
    if parent is not None and root is None:
        raise InvalidEvent(ROOT_RUN_ID, f"required when {PARENT_RUN_ID} is set (the id of the tree's root run)"
                           + where)
    fields: dict[str, Any] = {
        "run_id": run_id, "parent_run_id": parent, "root_run_id": root, "depth": depth,
        "trigger": _choice(attributes, TRIGGER, TRIGGERS, where),
        "caused_by_run_id": _string(attributes, CAUSED_BY_RUN_ID, where),
        "thread_key": _string(attributes, THREAD_KEY, where),
    }
    if lineage is not None and lineage.agent is not None and parent is None and root is None and depth is None:
        fields.update(run_id=f"{trace_id}-{lineage.agent}", root_run_id=run_id, depth=lineage.depth,
                      parent_run_id=run_id if lineage.parent_agent is None else f"{trace_id}-{lineage.parent_agent}")
    return fields


def _spawn(attributes: Mapping[str, Any], trace_id: str, where: str, lineage: Lineage | None) -> dict[str, Any]:
    """The tool class and the child a call starts: declared, else what the record's parentage says."""
    tool_class = _choice(attributes, TOOL_CLASS, TOOL_CLASSES, where)
    child_run_id = _string(attributes, CHILD_RUN_ID, where)
    child_agent_id = _string(attributes, CHILD_AGENT_ID, where)
    children = lineage.children if lineage is not None else ()
    if children and tool_class in (None, "spawn"):
        tool_class = "spawn"
        if len(children) == 1 and child_run_id is None and child_agent_id is None:
            child_run_id, child_agent_id = f"{trace_id}-{children[0][0]}", children[0][1]
    return {"tool_class": tool_class, "child_run_id": child_run_id, "child_agent_id": child_agent_id,
            "task_hash": _string(attributes, TASK_HASH, where)}


def tool_calls_of(raw: bytes, encoding: Encoding, run_id_from: RunIdFrom = "conversation",
                  max_event_bytes: int = 1 << 20) -> tuple[list[ToolCall], list[InvalidEvent]]:
    """The tool calls of one exporter record (a TracesData, as ``otlp_proto`` or ``otlp_json``), in
    end-time order, and the errors of its tool spans that broke the mapping or the telemetry contract
    (each event must also encode within ``max_event_bytes``). Raise InvalidEvent when the record is not
    OTLP at all. The record's ``invoke_agent`` spans and parent links give its sub-agent trees."""
    traces, tree, errors = _decode(raw, encoding)
    calls: list[ToolCall] = []
    for resource_spans in traces.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                if not _is_tool_kv(span.attributes):
                    continue  # skipped before its attributes are decoded
                trace_id, span_id = span.trace_id.hex(), span.span_id.hex()
                try:
                    call = tool_call(
                        {kv.key: _any_value(kv.value) for kv in span.attributes},
                        trace_id=trace_id,
                        span_id=span_id,
                        parent_span_id=span.parent_span_id.hex(),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        error_status=span.status.code == Status.STATUS_CODE_ERROR,
                        status_message=span.status.message,
                        run_id_from=run_id_from,
                        lineage=None if tree is None else tree.lineage(trace_id, span_id),
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


def _decode(raw: bytes, encoding: Encoding) -> tuple[TracesData, _AgentTree | None, list[InvalidEvent]]:
    """The record as TracesData (the collector's ``ptrace`` marshalers write exactly that message), its
    agent tree where it has an ``invoke_agent`` span, and the errors of the tool spans left out of it. Of
    OTLP/JSON only the tool spans are parsed, so the tree is read from the document; a tool span whose ids
    are not hex is left out with an error naming the field (the record's other spans still count)."""
    if encoding == "otlp_proto":
        try:
            traces: TracesData = TracesData.FromString(raw)
        except DecodeError as exc:
            raise InvalidEvent("", f"not OTLP protobuf (TracesData): {exc}") from exc
        agents = any(_operation_kv(span.attributes) == INVOKE_AGENT for resource_spans in traces.resource_spans
                     for scope_spans in resource_spans.scope_spans for span in scope_spans.spans)
        return traces, _proto_tree(traces) if agents else None, []
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise NotJSON.at(exc.msg, exc.pos) from exc
    try:
        if type(document) is not dict:
            raise TypeError(f"a TracesData object was expected, got {type(document).__name__}")
        seen: list[tuple[Any, Any]] = []  # (span, its operation), every span of the record
        errors: list[InvalidEvent] = []
        for resource_spans in document.get("resourceSpans") or ():
            for scope_spans in resource_spans.get("scopeSpans") or ():
                spans = [(span, _operation_json(span)) for span in scope_spans.get("spans") or ()]
                seen += spans
                kept = []
                for span, operation in spans:
                    if operation == EXECUTE_TOOL or operation in INFERENCE:
                        try:
                            kept.append(_proto_json_span(span))
                        except InvalidEvent as exc:
                            errors.append(exc)
                scope_spans["spans"] = kept
        tree = _json_tree(seen) if any(operation == INVOKE_AGENT for _, operation in seen) else None
        parsed: TracesData = json_format.ParseDict(document, TracesData(), ignore_unknown_fields=True)
        return parsed, tree, errors
    except (json_format.ParseError, AttributeError, TypeError, ValueError) as exc:
        raise InvalidEvent("", f"not OTLP/JSON traces: {exc}"[:1000]) from exc


def _operation_json(span: dict[str, Any]) -> Any:
    for attribute in span.get("attributes") or ():
        if attribute.get("key") == OPERATION:
            value = attribute.get("value")
            return value.get("stringValue") if type(value) is dict else None
    return None


def _proto_json_span(span: dict[str, Any]) -> dict[str, Any]:
    """The fields the mapping reads, with OTLP/JSON's hex ids turned into proto JSON's base64 (events
    and links are dropped unread)."""
    kept: dict[str, Any] = {name: span[name] for name in _SPAN_FIELDS if name in span}
    for name in _HEX_IDS:
        if kept.get(name):
            try:
                kept[name] = base64.b64encode(bytes.fromhex(kept[name])).decode()
            except (TypeError, ValueError) as exc:
                raise InvalidEvent(name, f"a tool span's {name} must be hex, got {str(kept[name])[:40]!r}") from exc
    return kept


def _is_tool_kv(attributes: Iterable[KeyValue]) -> bool:
    operation = _operation_kv(attributes)
    return operation == EXECUTE_TOOL or operation in INFERENCE


def _operation_kv(attributes: Iterable[KeyValue]) -> str | None:
    for kv in attributes:
        if kv.key == OPERATION:
            value: str = kv.value.string_value
            return value
    return None


#: (trace id, span id), in lowercase hex: a span of the record.
SpanKey = tuple[str, str]
#: The operations that are an agent's work: its invocation, and a tool call.
_WORK: Final = (INVOKE_AGENT, EXECUTE_TOOL)


@dataclass(frozen=True, slots=True)
class _Node:
    """What the agent tree needs of one span of the record."""

    parent: str
    #: ``invoke_agent`` or ``execute_tool``; None for any other span (it passes its parent's run on).
    work: str | None
    #: An ``invoke_agent`` span of kind CLIENT: a call to an agent served elsewhere.
    client: bool = False
    agent_name: str | None = None


@dataclass(frozen=True, slots=True)
class _Context:
    """The run of the work at and under one span (as ``Lineage``), and the nearest agent or tool span at
    or above it."""

    agent: str | None
    parent_agent: str | None
    depth: int
    work: SpanKey | None


_ROOT: Final = _Context(None, None, 0, None)


class _AgentTree:
    """The sub-agent trees of one record (the module docstring's rules), from every span's parent link:
    each span's context follows from its parent's, so a record costs one step per span at most."""

    def __init__(self, nodes: dict[SpanKey, _Node]) -> None:
        self._nodes = nodes
        self._contexts: dict[SpanKey, _Context] = {}
        #: The sub-agent invocations each tool span started (span id, agent name), in record order.
        self._children: dict[SpanKey, list[tuple[str, str | None]]] = {}
        for key, node in nodes.items():
            if node.work == INVOKE_AGENT:
                self._context(key)  # every spawn is known before a tool span asks for its lineage

    def lineage(self, trace_id: str, span_id: str) -> Lineage:
        key = (trace_id, span_id)
        context = self._context(key)
        return Lineage(context.agent, context.parent_agent, context.depth, tuple(self._children.get(key, ())))

    def _context(self, key: SpanKey) -> _Context:
        """The context of ``key``, stepped down from the outermost ancestor the record holds (or the
        nearest one already known). A loop of parent links, which only a malformed record has, is cut
        where it closes."""
        path: list[SpanKey] = []
        on_path: set[SpanKey] = set()
        cursor: SpanKey | None = key
        while cursor is not None and cursor not in self._contexts and cursor in self._nodes and cursor not in on_path:
            path.append(cursor)
            on_path.add(cursor)
            parent = self._nodes[cursor].parent
            cursor = (cursor[0], parent) if parent else None
        context = _ROOT if cursor is None or cursor in on_path else self._contexts.get(cursor, _ROOT)
        for step in reversed(path):
            context = self._step(step, self._nodes[step], context)
            self._contexts[step] = context
        return self._contexts.get(key, _ROOT)

    def _step(self, key: SpanKey, node: _Node, up: _Context) -> _Context:
        """The context of ``key``'s span from its parent's: an invocation under no work is the root agent's,
        and any other span but a sub-agent's invocation passes its parent's run on."""
        work = key if node.work is not None else up.work
        if node.work != INVOKE_AGENT or up.work is None:
            return _Context(up.agent, up.parent_agent, up.depth, work)
        spawner = self._nodes[up.work]
        if spawner.work == INVOKE_AGENT and spawner.client:
            return _Context(up.agent, up.parent_agent, up.depth, work)  # the remote agent serving that call
        if spawner.work == EXECUTE_TOOL:
            self._children.setdefault(up.work, []).append((key[1], node.agent_name))
        return _Context(key[1], up.agent, min(up.depth + 1, MAX_DEPTH), work)


def _proto_tree(traces: TracesData) -> _AgentTree:
    nodes: dict[SpanKey, _Node] = {}
    for resource_spans in traces.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                operation = _operation_kv(span.attributes)
                agent = operation == INVOKE_AGENT
                nodes[(span.trace_id.hex(), span.span_id.hex())] = _Node(
                    span.parent_span_id.hex(), operation if operation in _WORK else None,
                    agent and span.kind == Span.SPAN_KIND_CLIENT, _agent_name_kv(span.attributes) if agent else None)
    return _AgentTree(nodes)


def _json_tree(spans: Iterable[tuple[Any, Any]]) -> _AgentTree:
    """The tree of OTLP/JSON spans (hex ids); a span whose ids are not strings is left out of it (a tool
    span's are checked when it is parsed)."""
    nodes: dict[SpanKey, _Node] = {}
    for span, operation in spans:
        trace_id, span_id, parent = span.get("traceId"), span.get("spanId"), span.get("parentSpanId")
        if type(trace_id) is not str or type(span_id) is not str:
            continue
        agent = operation == INVOKE_AGENT
        client = agent and span.get("kind") in (Span.SPAN_KIND_CLIENT, "SPAN_KIND_CLIENT")
        nodes[(trace_id.lower(), span_id.lower())] = _Node(
            parent.lower() if type(parent) is str else "", operation if operation in _WORK else None, client,
            _agent_name_json(span) if agent else None)
    return _AgentTree(nodes)


def _agent_name_kv(attributes: Iterable[KeyValue]) -> str | None:
    for kv in attributes:
        if kv.key == AGENT_NAME and kv.value.WhichOneof("value") == "string_value":
            name: str = kv.value.string_value
            return name if 0 < len(name) <= MAX_ID_LENGTH else None
    return None


def _agent_name_json(span: dict[str, Any]) -> str | None:
    for attribute in span.get("attributes") or ():
        if attribute.get("key") == AGENT_NAME:
            value = attribute.get("value")
            name = value.get("stringValue") if type(value) is dict else None
            return name if type(name) is str and 0 < len(name) <= MAX_ID_LENGTH else None
    return None


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


def _choice(attributes: Mapping[str, Any], name: str, choices: tuple[str, ...], where: str) -> str | None:
    value = attributes.get(name)
    if value is None or value == "":
        return None
    if value not in choices:
        raise InvalidEvent(name, f"must be one of {', '.join(choices)}, got {value!r}"[:200] + where)
    return str(value)


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
