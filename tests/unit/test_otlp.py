"""OpenTelemetry tool spans as telemetry: the mapping rules of ``stream_app.sources.otlp`` on real SDK spans,
encoded both ways the collector's kafka exporter writes them."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.trace import StatusCode

from stream_app.core import InvalidEvent, decode_event
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
        ("otlp_json", b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz", "attributes": '
                      b'[{"key": "gen_ai.operation.name", "value": {"stringValue": "execute_tool"}}]}]}]}]}',
         "not OTLP/JSON traces"),  # ids are hex in OTLP/JSON
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
