"""OpenTelemetry tool spans as telemetry: the mapping rules of ``stream_app.sources.otlp`` on real SDK spans,
encoded both ways the collector's kafka exporter writes them."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context

from stream_app.core import InvalidEvent, decode_event
from stream_app.core.contract import is_transient
from stream_app.integrations.otel import LoopwardenSpanProcessor
from stream_app.sources.otlp import ToolCall, tool_calls_of
from stream_app.worker.settings import SettingsError, WorkerSettings
from tests.otlp_payloads import ENCODINGS, Recorder, encode, hex_ids

T0 = 1_764_000_000_000


def calls_of(recorder: Recorder, encoding: str = "otlp_proto", **kwargs: Any) -> list[ToolCall]:
    calls, errors = tool_calls_of(encode(recorder.spans(), encoding), encoding, **kwargs)  # type: ignore[arg-type]
    assert errors == []
    return calls


def only_call(recorder: Recorder, **kwargs: Any) -> ToolCall:
    (call,) = calls_of(recorder, **kwargs)
    return call


def errors_of(recorder: Recorder) -> list[InvalidEvent]:
    return tool_calls_of(encode(recorder.spans(), "otlp_proto"), "otlp_proto")[1]


@pytest.mark.parametrize(
    ("status", "error_type", "declared", "outcome"),
    [
        (StatusCode.UNSET, None, None, "success"),  # the conventions leave a successful span's status unset
        (StatusCode.OK, None, None, "success"),  # some exporters (LangSmith) set OK on success: the same
        (StatusCode.ERROR, None, None, "error"),
        (StatusCode.UNSET, "timeout", None, "error"),  # error.type alone means the call failed
        (StatusCode.OK, "timeout", None, "error"),
        (StatusCode.UNSET, None, "empty", "empty"),  # our attribute for what has no convention
        (StatusCode.UNSET, None, "noop", "noop"),
        (StatusCode.ERROR, None, "empty", "error"),  # an error is an error, whatever else is declared
    ],
)
def test_outcome_follows_status_error_type_and_our_attribute(
        status: StatusCode, error_type: str | None, declared: str | None, outcome: str) -> None:
    recorder = Recorder()
    extra = {"dev.loopwarden.outcome": declared} if declared else {}
    recorder.tool("search_docs", end_ms=T0, status=status, message="index down", error=error_type, **extra)
    assert only_call(recorder).outcome == outcome


def test_a_tool_span_becomes_a_valid_telemetry_event_with_the_span_ids_and_end_time() -> None:
    """Event id = trace id + span id, ts_ms = end time, ids kept, arguments and result from the opt-in
    JSON attributes; the result is a telemetry v1 event."""
    recorder = Recorder()
    root = recorder.tracer.start_span("invoke_agent support")
    span = recorder.tool("search_docs", end_ms=T0 + 1_500, latency_ms=250, parent=root,
                         args={"query": "refund"}, result={"hits": 3}, **{"gen_ai.agent.name": "support"})
    root.end()
    call = calls_of(recorder)[0]
    trace_id, span_id = hex_ids(span)  # type: ignore[arg-type]
    event = call.telemetry()
    assert event == {
        "schema_version": "1", "run_id": trace_id, "event_id": f"{trace_id}-{span_id}", "tool": "search_docs",
        "ts_ms": T0 + 1_500, "outcome": "success", "latency_ms": 250.0, "trace_id": trace_id, "span_id": span_id,
        "parent_span_id": format(root.get_span_context().span_id, "016x"), "args": {"query": "refund"},
        "result": {"hits": 3}, "agent_id": "support",
    }
    assert decode_event(event).event_id == f"{trace_id}-{span_id}"


@pytest.mark.parametrize(
    ("attributes", "run_id_from", "expected"),
    [
        ({"gen_ai.conversation.id": "conv-7"}, "conversation", "conv-7"),  # the conversation, where known
        ({}, "conversation", "trace"),  # else the trace: one agent invocation
        ({"gen_ai.conversation.id": ""}, "conversation", "trace"),  # an empty id is no id
        ({"gen_ai.conversation.id": "conv-7"}, "trace", "trace"),  # configured: always the trace
    ],
)
def test_run_id_is_the_conversation_else_the_trace(attributes: dict[str, str], run_id_from: str,
                                                     expected: str) -> None:
    recorder = Recorder()
    span = recorder.tool("search_docs", end_ms=T0, **attributes)
    call = only_call(recorder, run_id_from=run_id_from)
    assert call.run_id == (hex_ids(span)[0] if expected == "trace" else expected)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("span", "args", "result"),
    [
        # no opt-in content: the call compares by tool name and its error (fail closed)
        ({}, {}, None),
        ({"error": "timeout", "status": StatusCode.ERROR, "message": "index down"}, {},
         {"error_type": "timeout", "message": "index down"}),
        ({"status": StatusCode.ERROR, "message": "index down"}, {}, {"message": "index down"}),
        ({"error": "timeout"}, {}, {"error_type": "timeout"}),
        # arguments that are not a JSON object are kept under one key; a non-JSON result as its string
        ({"args": "plain text input", "result": "plain text output"}, {"arguments": "plain text input"},
         "plain text output"),
        ({"args": [1, 2]}, {"arguments": [1, 2]}, None),
        # an explicit result wins over the error details
        ({"error": "timeout", "result": {"partial": True}}, {}, {"partial": True}),
    ],
)
def test_missing_or_unusual_content_attributes(span: dict[str, Any], args: Any, result: Any) -> None:
    recorder = Recorder()
    recorder.tool("search_docs", end_ms=T0, **span)
    call = only_call(recorder)
    assert (call.args, call.result, call.has_result) == (args, result, True)


def test_our_attributes_carry_what_has_no_convention() -> None:
    recorder = Recorder()
    recorder.tool("send_email", end_ms=T0, **{
        "dev.loopwarden.retry_budget": 5, "dev.loopwarden.plan_step": 2, "dev.loopwarden.side_effect": True,
        "dev.loopwarden.args_hash": "a" * 64, "dev.loopwarden.result_hash": "b" * 64,
        "dev.loopwarden.result_fp": "c" * 64})
    event = only_call(recorder).telemetry()
    assert {k: event.get(k) for k in ("retry_budget", "plan_step", "side_effect", "args_hash", "result_hash",
                                      "result_fp")} == {
        "retry_budget": 5, "plan_step": 2, "side_effect": True, "args_hash": "a" * 64, "result_hash": "b" * 64,
        "result_fp": "c" * 64}
    assert "args" not in event and "result" not in event
    decode_event(event)


@pytest.mark.parametrize(
    ("attributes", "field"),
    [
        ({"gen_ai.tool.name": None}, "gen_ai.tool.name"),  # the one required attribute
        ({"gen_ai.tool.name": "x" * 600}, "gen_ai.tool.name"),
        ({"dev.loopwarden.retry_budget": "3"}, "dev.loopwarden.retry_budget"),
        ({"dev.loopwarden.retry_budget": -1}, "dev.loopwarden.retry_budget"),
        ({"dev.loopwarden.side_effect": "yes"}, "dev.loopwarden.side_effect"),
        ({"dev.loopwarden.plan_step": 1.5}, "dev.loopwarden.plan_step"),
        ({"dev.loopwarden.outcome": "maybe"}, "dev.loopwarden.outcome"),
        ({"dev.loopwarden.args_hash": 7}, "dev.loopwarden.args_hash"),
        ({"dev.loopwarden.result_fp": 7}, "dev.loopwarden.result_fp"),
        ({"gen_ai.conversation.id": 42}, "gen_ai.conversation.id"),
        ({"dev.loopwarden.parent_run_id": "run-parent"}, "dev.loopwarden.root_run_id"),  # a parent needs its root
        ({"dev.loopwarden.root_run_id": 7}, "dev.loopwarden.root_run_id"),
        ({"dev.loopwarden.depth": -1}, "dev.loopwarden.depth"),
        ({"dev.loopwarden.depth": "2"}, "dev.loopwarden.depth"),
        ({"dev.loopwarden.tool_class": "delegate"}, "dev.loopwarden.tool_class"),
        ({"dev.loopwarden.child_run_id": "x" * 600}, "dev.loopwarden.child_run_id"),
        ({"dev.loopwarden.child_agent_id": 7}, "dev.loopwarden.child_agent_id"),
        ({"dev.loopwarden.task_hash": 7}, "dev.loopwarden.task_hash"),
        ({"dev.loopwarden.thread_key": 7}, "dev.loopwarden.thread_key"),
        ({"dev.loopwarden.trigger": "cron"}, "dev.loopwarden.trigger"),
        ({"dev.loopwarden.caused_by_run_id": 7}, "dev.loopwarden.caused_by_run_id"),
        ({"dev.loopwarden.upstream": 443}, "dev.loopwarden.upstream"),
        ({"dev.loopwarden.retry_after_ms": -5}, "dev.loopwarden.retry_after_ms"),
    ],
)
def test_a_bad_tool_span_is_rejected_naming_the_attribute_and_the_others_still_count(
        attributes: dict[str, Any], field: str) -> None:
    recorder = Recorder()
    recorder.tool("search_docs", end_ms=T0)
    tool = attributes.pop("gen_ai.tool.name", "lookup")
    recorder.tool(tool, end_ms=T0 + 1, **attributes)
    calls, errors = tool_calls_of(encode(recorder.spans(), "otlp_proto"), "otlp_proto")
    assert [c.tool for c in calls] == ["search_docs"]
    assert [e.field for e in errors] == [field]
    assert "span " in str(errors[0])


@pytest.mark.parametrize("field", ["traceId", "spanId", "parentSpanId"])
def test_a_tool_span_whose_ids_are_not_hex_is_rejected_naming_the_id_and_the_others_still_count(field: str) -> None:
    """OTLP/JSON writes ids in hex: a tool span with one that is not is an error naming it, and the
    record's other spans count (the whole record was refused, without a field)."""
    recorder = Recorder()
    recorder.tool("search_docs", end_ms=T0)
    recorder.tool("lookup", end_ms=T0 + 1)
    document = orjson.loads(encode(recorder.spans(), "otlp_json"))
    document["resourceSpans"][0]["scopeSpans"][0]["spans"][1][field] = "zz-not-hex"
    calls, errors = tool_calls_of(orjson.dumps(document), "otlp_json")
    assert [c.tool for c in calls] == ["search_docs"]
    assert [e.field for e in errors] == [field] and "must be hex" in str(errors[0])


def test_a_call_whose_telemetry_is_too_large_is_rejected() -> None:
    recorder = Recorder()
    recorder.tool("read_file", end_ms=T0, result={"text": "x" * 5000})
    calls, errors = tool_calls_of(encode(recorder.spans(), "otlp_proto"), "otlp_proto", max_event_bytes=4096)
    assert calls == [] and "over the 4096-byte limit" in str(errors[0])


def test_spans_are_matched_by_attribute_never_by_name() -> None:
    """A span named like a tool call but without the attribute is not one; a tool span with a name of its
    own (OpenLLMetry's ``{tool}.tool``) is; agent spans are skipped; inference spans are model calls."""
    recorder = Recorder()
    recorder.span("invoke_agent support", end_ms=T0, **{"gen_ai.operation.name": "invoke_agent"})
    recorder.span("chat gpt-5", end_ms=T0 + 1, **{"gen_ai.operation.name": "chat"})
    recorder.span("execute_tool search_docs", end_ms=T0 + 2, **{"gen_ai.tool.name": "search_docs"})
    recorder.span("GET /index", end_ms=T0 + 3)
    recorder.tool("search_docs", end_ms=T0 + 4, name="search_docs.tool")
    assert [(c.tool, c.ts_ms, c.kind) for c in calls_of(recorder)] == [
        ("chat", T0 + 1, "model_call"), ("search_docs", T0 + 4, None)]


def test_inference_spans_are_model_calls_of_the_same_run_with_their_tokens() -> None:
    recorder = Recorder()
    recorder.span("chat claude", end_ms=T0, **{"gen_ai.operation.name": "chat", "gen_ai.request.model": "claude-x",
                                                "gen_ai.usage.input_tokens": 1200, "gen_ai.usage.output_tokens": 300,
                                                "gen_ai.conversation.id": "conv-9"})
    recorder.tool("search_docs", end_ms=T0 + 1, **{"gen_ai.conversation.id": "conv-9"})
    model, tool = calls_of(recorder)
    event = model.telemetry()
    assert (event["kind"], event["tool"], event["tokens"], event["run_id"]) == ("model_call", "claude-x", 1500, "conv-9")
    assert "args" not in event and "result" not in event and "args_hash" not in event
    assert tool.run_id == "conv-9"
    decode_event(event)


def test_calls_come_out_in_end_time_order() -> None:
    recorder = Recorder()
    for end_ms, tool in ((T0 + 30, "c"), (T0 + 10, "a"), (T0 + 20, "b")):
        recorder.tool(tool, end_ms=end_ms)
    assert [c.tool for c in calls_of(recorder)] == ["a", "b", "c"]


def test_both_encodings_give_the_same_calls() -> None:
    """OTLP/JSON (hex ids, camelCase, 64-bit integers as strings) and protobuf decode alike."""
    recorder = Recorder()
    root = recorder.tracer.start_span("invoke_agent support")
    recorder.tool("search_docs", end_ms=T0, parent=root, args={"q": "x", "n": 2}, status=StatusCode.ERROR,
                  message="down", error="timeout", **{"dev.loopwarden.retry_budget": 2,
                                                      "gen_ai.conversation.id": "conv-1"})
    recorder.tool("send_email", end_ms=T0 + 5, parent=root, args={"to": "a@b.c"}, result=[1, {"ok": True}],
                  **{"dev.loopwarden.side_effect": True, "dev.loopwarden.outcome": "noop"})
    recorder.span("chat", end_ms=T0 + 6, parent=root, **{"gen_ai.operation.name": "chat", "list": [1, 2]})
    root.end()
    proto, json_ = (calls_of(recorder, encoding) for encoding in ENCODINGS)
    assert len(proto) == 3 and proto == json_  # two tool calls and the inference (a model call)


@pytest.mark.parametrize(
    ("encoding", "payload", "reason"),
    [
        ("otlp_proto", b"\x0a\xff\xff\xff\xff\x0f", "not OTLP protobuf"),  # a truncated field
        ("otlp_json", b"{not json", "not JSON"),
        ("otlp_json", b"[1, 2]", "not OTLP/JSON traces"),
        ("otlp_json", b'{"resourceSpans": 3}', "not OTLP/JSON traces"),
    ],
)
def test_a_payload_that_is_not_otlp_is_refused_as_a_whole(encoding: str, payload: bytes, reason: str) -> None:
    with pytest.raises(InvalidEvent, match=reason):
        tool_calls_of(payload, encoding)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LOOPWARDEN_OTLP_ENCODING": "jaeger_proto"}, "expected otlp_proto or otlp_json"),
        ({"LOOPWARDEN_OTLP_RUN_ID": "session"}, "expected conversation or trace"),
        ({"LOOPWARDEN_OTLP_TOPIC": "agent.telemetry"}, "one of the worker's own topics"),
    ],
)
def test_bad_otlp_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        WorkerSettings.from_env({"LOOPWARDEN_ALLOW_UNSIGNED": "true", **env})


def test_otlp_input_is_off_by_default() -> None:
    settings = WorkerSettings.from_env({"LOOPWARDEN_ALLOW_UNSIGNED": "true"})
    assert (settings.otlp_topic, settings.otlp_encoding, settings.otlp_run_id) == ("", "otlp_proto", "conversation")


@pytest.mark.parametrize(
    ("attributes", "upstream"),
    [
        ({"server.address": "api.example.com"}, "api.example.com"),
        ({"server.address": "api.example.com", "server.port": 443}, "api.example.com"),  # a default port: unwritten
        ({"server.address": "localhost", "server.port": 8931}, "localhost:8931"),  # tells local MCP servers apart
        ({"server.address": "::1", "server.port": 3000}, "[::1]:3000"),
        ({"server.address": "api.example.com", "dev.loopwarden.upstream": "mcp:github"}, "mcp:github"),  # ours wins
        ({"network.transport": "pipe", "dev.loopwarden.upstream": "mcp:filesystem"}, "mcp:filesystem"),  # stdio MCP
        ({"network.transport": "pipe"}, None),  # no address, no name: no upstream
        ({"server.address": 7}, None),  # a mistyped convention is ignored, not a reason to refuse the call
        ({"server.address": "api.example.com", "server.port": "8080"}, "api.example.com"),
    ],
)
def test_upstream_is_ours_else_the_server_address(attributes: dict[str, Any], upstream: str | None) -> None:
    recorder = Recorder()
    recorder.tool("search_docs", end_ms=T0, **attributes)
    event = only_call(recorder).telemetry()
    assert event.get("upstream") == upstream
    assert decode_event(event).upstream == upstream


@pytest.mark.parametrize(
    ("status", "attributes", "outcome", "error_class", "transient"),
    [
        (StatusCode.ERROR, {"http.response.status_code": 503}, "error", "http_503", True),
        (StatusCode.ERROR, {"http.response.status_code": 429, "error.type": "429"}, "error", "http_429", True),
        (StatusCode.UNSET, {"http.response.status_code": 502, "error.type": "502"}, "error", "http_502", True),
        (StatusCode.ERROR, {"http.response.status_code": 404}, "error", "http_404", False),  # the caller's mistake
        # error.type contradicts the status, or stands alone (a JSON-RPC code, on an MCP span): as given
        (StatusCode.ERROR, {"http.response.status_code": 503, "error.type": "tool_error"}, "error", "tool_error",
         False),
        (StatusCode.ERROR, {"error.type": "503"}, "error", "503", False),
        (StatusCode.ERROR, {"error.type": "java.net.SocketTimeoutException"}, "error",
         "java.net.SocketTimeoutException", False),  # exception names are not guessed at
        (StatusCode.ERROR, {"error.type": "timeout"}, "error", "timeout", True),
        (StatusCode.UNSET, {"http.response.status_code": 503}, "success", None, False),  # did not fail: no class
        (StatusCode.ERROR, {"http.response.status_code": "503"}, "error", None, False),  # mistyped: ignored
    ],
)
def test_error_class_is_the_error_type_or_a_failed_span_s_http_status(
        status: StatusCode, attributes: dict[str, Any], outcome: str, error_class: str | None,
        transient: bool) -> None:
    recorder = Recorder()
    recorder.tool("fetch_page", end_ms=T0, status=status, message="upstream said no", **attributes)
    call = only_call(recorder)
    assert (call.outcome, call.error_class, is_transient(call.error_class)) == (outcome, error_class, transient)


def test_a_failed_span_keeps_its_error_type_in_the_result_details() -> None:
    """The result stands for what the span said (a retry whose error changes is a retry); the class is
    what the rules read."""
    recorder = Recorder()
    recorder.tool("fetch_page", end_ms=T0, status=StatusCode.ERROR, message="busy", error="503",
                  **{"http.response.status_code": 503})
    call = only_call(recorder)
    assert (call.error_class, call.result) == ("http_503", {"error_type": "503", "message": "busy"})


@pytest.mark.parametrize(
    ("status", "attributes", "retry_after_ms"),
    [
        (StatusCode.ERROR, {"http.response.header.retry-after": ["30"]}, 30_000),
        (StatusCode.ERROR, {"http.response.header.retry-after": ["1.5", "9"]}, 1_500),  # the first value
        (StatusCode.ERROR, {"http.response.header.retry-after": ["Wed, 21 Oct 2026 07:28:00 GMT"]}, None),
        (StatusCode.ERROR, {"http.response.header.retry-after": ["-1"]}, None),
        (StatusCode.ERROR, {"http.response.header.retry-after": ["999999"]}, None),  # past a day: the default
        (StatusCode.UNSET, {"http.response.header.retry-after": ["30"]}, None),  # a success asks for no wait
        (StatusCode.UNSET, {"dev.loopwarden.retry_after_ms": 2_000}, 2_000),  # ours, as given
        (StatusCode.ERROR, {"dev.loopwarden.retry_after_ms": 2_000, "http.response.header.retry-after": ["30"]},
         2_000),
    ],
)
def test_retry_after_is_ours_else_a_failed_span_s_retry_after_header(
        status: StatusCode, attributes: dict[str, Any], retry_after_ms: int | None) -> None:
    recorder = Recorder()
    recorder.tool("fetch_page", end_ms=T0, status=status, **attributes)
    event = only_call(recorder).telemetry()
    assert event.get("retry_after_ms") == retry_after_ms
    decode_event(event)


DECLARED = {
    "dev.loopwarden.parent_run_id": "run-parent", "dev.loopwarden.root_run_id": "run-root",
    "dev.loopwarden.depth": 2, "dev.loopwarden.thread_key": "github:acme/api#42", "dev.loopwarden.trigger": "webhook",
    "dev.loopwarden.caused_by_run_id": "run-earlier",
}
SPAWN = {"dev.loopwarden.tool_class": "spawn", "dev.loopwarden.child_run_id": "run-child",
         "dev.loopwarden.child_agent_id": "researcher", "dev.loopwarden.task_hash": "d" * 64}


def test_our_attributes_carry_the_fields_of_the_rules_across_runs() -> None:
    """A run's lineage and thread on any of its spans (a model call's too), a spawn's child on its tool span."""
    recorder = Recorder()
    recorder.tool("Task", end_ms=T0, **DECLARED, **SPAWN, **{"gen_ai.conversation.id": "run-self"})
    recorder.span("chat claude", end_ms=T0 + 1, **DECLARED, **{"gen_ai.operation.name": "chat"})
    tool, model = (call.telemetry() for call in calls_of(recorder))
    fields = {k.removeprefix("dev.loopwarden."): v for k, v in DECLARED.items()}
    assert {k: tool.get(k) for k in (*fields, "run_id", "tool_class", "child_run_id", "child_agent_id", "task_hash")} == {
        **fields, "run_id": "run-self", "tool_class": "spawn", "child_run_id": "run-child",
        "child_agent_id": "researcher", "task_hash": "d" * 64}
    assert {k: model.get(k) for k in fields} == fields
    decoded = decode_event(tool)
    assert (decoded.parent_run_id, decoded.depth, decoded.trigger, decoded.task_hash) == (
        "run-parent", 2, "webhook", "d" * 64)
    decode_event(model)


def open_span(recorder: Recorder, name: str, *, parent: Span | None = None, kind: SpanKind = SpanKind.INTERNAL,
              **attributes: Any) -> Span:
    """A span left open for others to nest under."""
    context = set_span_in_context(parent) if parent is not None else None
    return recorder.tracer.start_span(name, context=context, kind=kind, attributes=attributes,
                                      start_time=(T0 - 1_000) * 1_000_000)


def open_agent(recorder: Recorder, agent: str, parent: Span | None = None,
               kind: SpanKind = SpanKind.INTERNAL) -> Span:
    return open_span(recorder, f"invoke_agent {agent}", parent=parent, kind=kind,
                     **{"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent})


def close(*spans: Span) -> None:
    """End open spans, innermost first, after the calls in them."""
    for n, span in enumerate(spans):
        span.end(end_time=(T0 + 100 + n) * 1_000_000)


def span_id(span: Span) -> str:
    return hex_ids(span)[1]  # type: ignore[arg-type]


def delegation(recorder: Recorder, **tool_attributes: Any) -> dict[str, Span]:
    """A planner that calls a tool itself and delegates through one (``research``) to a researcher, which
    calls a tool, asks the model and nests a summarizer directly (no tool between)."""
    spans: dict[str, Span] = {"planner": open_agent(recorder, "planner")}
    spans["read_plan"] = recorder.tool("read_plan", end_ms=T0 + 1, parent=spans["planner"], **tool_attributes)
    spans["research"] = open_span(recorder, "execute_tool research", parent=spans["planner"], **tool_attributes,
                                  **{"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "research"})
    spans["researcher"] = open_agent(recorder, "researcher", spans["research"])
    spans["search"] = recorder.tool("search", end_ms=T0 + 2, parent=spans["researcher"], **tool_attributes)
    spans["chat"] = recorder.span("chat claude", end_ms=T0 + 3, parent=spans["researcher"],
                                  **tool_attributes, **{"gen_ai.operation.name": "chat"})
    spans["summarizer"] = open_agent(recorder, "summarizer", spans["researcher"])
    spans["summarize"] = recorder.tool("summarize", end_ms=T0 + 4, parent=spans["summarizer"], **tool_attributes)
    close(spans["summarizer"], spans["researcher"], spans["research"], spans["planner"])
    return spans


def lineage(calls: list[ToolCall]) -> list[tuple[Any, ...]]:
    return [(c.tool, c.run_id, c.parent_run_id, c.root_run_id, c.depth, c.tool_class, c.child_run_id,
             c.child_agent_id) for c in calls]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_invoke_agent_parentage_in_a_record_gives_the_sub_agent_tree(encoding: str) -> None:
    """The root agent's calls keep the trace's run; a sub-agent's are a run of its own, under the run
    that started it; the tool span that started it is a spawn naming it."""
    recorder = Recorder()
    spans = delegation(recorder)
    trace = hex_ids(spans["planner"])[0]  # type: ignore[arg-type]
    researcher, summarizer = (f"{trace}-{span_id(spans[name])}" for name in ("researcher", "summarizer"))
    calls = calls_of(recorder, encoding)
    assert lineage(calls) == [
        ("read_plan", trace, None, None, None, None, None, None),
        ("search", researcher, trace, trace, 1, None, None, None),
        ("chat", researcher, trace, trace, 1, None, None, None),  # the sub-agent's model call is its too
        ("summarize", summarizer, researcher, trace, 2, None, None, None),
        ("research", trace, None, None, None, "spawn", researcher, "researcher"),
    ]
    for call in calls:
        decode_event(call.telemetry())


def test_the_root_of_a_tree_is_the_run_the_calls_would_have_had() -> None:
    recorder = Recorder()
    spans = delegation(recorder, **{"gen_ai.conversation.id": "conv-4"})
    researcher = "-".join(hex_ids(spans["researcher"]))  # type: ignore[arg-type]
    calls = {c.tool: c for c in calls_of(recorder)}
    assert calls["read_plan"].run_id == calls["research"].run_id == "conv-4"
    assert (calls["search"].run_id, calls["search"].parent_run_id, calls["search"].root_run_id) == (
        researcher, "conv-4", "conv-4")


def test_a_record_without_the_spans_above_a_sub_agent_gives_what_it_holds() -> None:
    """Spans of one trace come in several records: a sub-agent whose starting work is in another record
    is not known to be one (its calls stay in the root run, as before trees), and a depth counts the
    ancestors in the record only, so it is never more than the true one."""
    recorder = Recorder()
    spans = delegation(recorder)
    trace = hex_ids(spans["planner"])[0]  # type: ignore[arg-type]
    researcher, summarizer = (f"{trace}-{span_id(spans[name])}" for name in ("researcher", "summarizer"))

    def record(*names: str) -> list[tuple[Any, ...]]:
        ids = {span_id(spans[name]) for name in names}
        kept = [s for s in recorder.spans() if format(s.get_span_context().span_id, "016x") in ids]
        calls, errors = tool_calls_of(encode(kept, "otlp_proto"), "otlp_proto")
        assert errors == []
        return lineage(calls)

    assert record("search", "researcher") == [("search", trace, None, None, None, None, None, None)]
    assert record("search", "researcher", "research") == [  # a tool started it: a sub-agent, whoever called it
        ("search", researcher, trace, trace, 1, None, None, None),
        ("research", trace, None, None, None, "spawn", researcher, "researcher")]
    assert record("summarize", "summarizer", "researcher") == [  # truly depth 2
        ("summarize", summarizer, trace, trace, 1, None, None, None)]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_remote_agent_serving_a_client_invocation_is_that_invocation(encoding: str) -> None:
    """A CLIENT invoke_agent span and the invocation that serves it (a transport span between) are one
    sub-agent, one level down, not two."""
    recorder = Recorder()
    planner = open_agent(recorder, "planner")
    remote = open_agent(recorder, "billing", planner, SpanKind.CLIENT)
    post = open_span(recorder, "POST /agents/billing", parent=remote, kind=SpanKind.CLIENT)
    served = open_agent(recorder, "billing", post, SpanKind.SERVER)
    recorder.tool("refund", end_ms=T0, parent=served)
    close(served, post, remote, planner)
    trace = hex_ids(planner)[0]  # type: ignore[arg-type]
    assert lineage(calls_of(recorder, encoding)) == [
        ("refund", f"{trace}-{span_id(remote)}", trace, trace, 1, None, None, None)]


def test_declared_lineage_and_tool_class_win_over_parentage() -> None:
    recorder = Recorder()
    planner = open_agent(recorder, "planner")
    handoff = open_span(recorder, "execute_tool transfer", parent=planner, **{
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "transfer", "dev.loopwarden.tool_class": "handoff"})
    worker = open_agent(recorder, "worker", handoff)
    recorder.tool("lookup", end_ms=T0, parent=worker, **{"dev.loopwarden.root_run_id": "run-root"})
    close(worker, handoff, planner)
    trace = hex_ids(planner)[0]  # type: ignore[arg-type]
    assert lineage(calls_of(recorder)) == [
        ("lookup", trace, None, "run-root", None, None, None, None),  # its run: the trace, as declared alone
        ("transfer", trace, None, None, None, "handoff", None, None),
    ]


class _Publisher:
    """What the span processor needs of a TelemetryPublisher, keeping the events."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def flush(self) -> None:
        pass

    async def publish(self, event: dict[str, Any]) -> None:
        self.events.append(event)


def test_the_span_processor_reports_the_fields_of_the_rules_across_runs() -> None:
    async def report() -> list[dict[str, Any]]:
        publisher = _Publisher()
        async with LoopwardenSpanProcessor(publisher) as processor:  # type: ignore[arg-type]
            provider = TracerProvider()
            provider.add_span_processor(processor)
            with provider.get_tracer("t").start_as_current_span("execute_tool Task", attributes={
                    "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "Task", "server.address": "localhost",
                    "server.port": 8931, "http.response.status_code": 503,
                    "http.response.header.retry-after": ["7"], **DECLARED, **SPAWN}) as span:
                span.set_status(Status(StatusCode.ERROR, "busy"))
        return publisher.events

    (event,) = asyncio.run(report())
    fields = {k.removeprefix("dev.loopwarden."): v for k, v in {**DECLARED, **SPAWN}.items()}
    assert {k: event.get(k) for k in (*fields, "upstream", "error_class", "retry_after_ms")} == {
        **fields, "upstream": "localhost:8931", "error_class": "http_503", "retry_after_ms": 7_000}
    decode_event(event)
