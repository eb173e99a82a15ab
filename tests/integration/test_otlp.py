"""OpenTelemetry into the fleet, on the real broker: the collector's kafka exporter records (both
encodings) through a worker, and the SDK's span processor, give the decisions of the equivalent native
telemetry; non-tool spans are ignored and what is not OTLP goes to the DLQ with its reason."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Status, StatusCode

from scripts.kafka_local import TopicSpec, create_topics
from stream_app.bus.wire import header
from stream_app.client import KafkaClientConfig, TelemetryBuilder, TelemetryPublisher
from stream_app.core import Detector, RunTable, decode_event, semantic_hash
from stream_app.devtools.fleet_sim import simulate_fleet
from stream_app.integrations.otel import LoopwardenSpanProcessor
from tests.otlp_payloads import ENCODINGS, Recorder, encode, hex_ids
from tests.readme_examples import example

from .workers import Fleet, consume, decisions_of, produce_raw, run

pytestmark = pytest.mark.integration

EXPORT_BATCH = 30  # spans per SDK export batch, which the collector splits into one record per trace


def replay_decisions(stream: list[dict[str, Any]]) -> list[dict[str, Any]]:
    table = RunTable(Detector())
    return [d.to_control() for raw in stream for d in table.observe(decode_event(raw)).decisions]


def _error_details(result: dict[str, Any]) -> tuple[str, str]:
    """(error.type, status description) a tool instrumentation would record for a simulated failure."""
    return str(result.get("code", result.get("status", "tool_error"))), str(result["error"])


def otlp_corpus(encoding: str, runs: int = 40, seed: int = 5) -> tuple[list[tuple[bytes, bytes]], list[dict[str, Any]]]:
    """The simulated fleet as an instrumented app would trace it: one trace per run (an invoke_agent root,
    a chat span now and then), one execute_tool span per call, half the runs naming their conversation.
    Returns the exporter's records (``partition_traces_by_id``: SDK export batches split per trace, one
    record redelivered) and, record by record, the native telemetry their tool spans stand for (written
    from the simulation, not by the mapping under test). Times are recent, like the span processor's."""
    fleet, _ = simulate_fleet(runs, seed=seed, start_ms=time.time_ns() // 1_000_000 - 300_000, redeliver_fraction=0)
    recorder = Recorder()
    roots = {r.run_id: recorder.tracer.start_span(f"invoke_agent {r.agent_id}", start_time=(r.events[0]["ts_ms"] - 50)
                                                  * 1_000_000, attributes={"gen_ai.operation.name": "invoke_agent"})
             for r in fleet}
    named = {r.run_id for i, r in enumerate(fleet) if i % 2 == 0}
    native: dict[str, dict[str, Any]] = {}  # by span id
    for n, e in enumerate(sorted((e for r in fleet for e in r.events), key=lambda e: (e["ts_ms"], e["event_id"]))):
        root = roots[e["run_id"]]
        attrs: dict[str, Any] = {"gen_ai.agent.name": e["agent_id"]}
        if e["run_id"] in named:
            attrs["gen_ai.conversation.id"] = e["run_id"]
        for name in ("retry_budget", "plan_step", "side_effect"):
            if name in e:
                attrs[f"dev.loopwarden.{name}"] = e[name]
        if e["outcome"] == "error":
            error_type, message = _error_details(e["result"])
            span = recorder.tool(e["tool"], end_ms=e["ts_ms"], parent=root, args=e["args"], error=error_type,
                                 status=StatusCode.ERROR, message=message, **attrs)
            result: Any = {"error_type": error_type, "message": message}
        else:
            span = recorder.tool(e["tool"], end_ms=e["ts_ms"], parent=root, args=e["args"], result=e["result"], **attrs)
            result = e["result"]
        if n % 7 == 0:  # the model's turn: an inference span, which is not a tool call
            recorder.span("chat gpt-5", end_ms=e["ts_ms"] + 1, parent=root, **{"gen_ai.operation.name": "chat"})
        trace_id, span_id = hex_ids(span)  # type: ignore[arg-type]
        native[span_id] = {
            "run_id": e["run_id"] if e["run_id"] in named else trace_id, "event_id": f"{trace_id}-{span_id}",
            "tool": e["tool"], "ts_ms": e["ts_ms"], "outcome": e["outcome"], "args": e["args"], "result": result,
            "agent_id": e["agent_id"], "trace_id": trace_id, "span_id": span_id,
            "parent_span_id": format(root.get_span_context().span_id, "016x"),
            **{k: e[k] for k in ("retry_budget", "plan_step", "side_effect") if k in e},
            **({"error_class": result["error_type"]} if e["outcome"] == "error" else {}),
        }
    for root in roots.values():
        root.end()
    spans = recorder.spans()  # in the order they ended, as the SDK exports them
    records: list[tuple[bytes, bytes, list[dict[str, Any]]]] = []
    for start in range(0, len(spans), EXPORT_BATCH):
        by_trace: dict[str, list[Any]] = {}
        for span in spans[start:start + EXPORT_BATCH]:
            by_trace.setdefault(hex_ids(span)[0], []).append(span)
        for trace_id, members in by_trace.items():
            tool_events = [native[hex_ids(s)[1]] for s in members if hex_ids(s)[1] in native]
            records.append((trace_id.encode(), encode(members, encoding), tool_events))
    retried = next(i for i, (_, _, events) in enumerate(records) if i >= 6 and events)
    records.insert(retried + 1, records[retried])  # the collector retried a record the broker had written
    return [(key, value) for key, value, _ in records], [e for _, _, events in records for e in events]


def partly_bad_record(encoding: str) -> tuple[tuple[bytes, bytes], str]:
    """A record with a valid tool span (run ``run-partial``) and one without ``gen_ai.tool.name``."""
    recorder = Recorder()
    root = recorder.tracer.start_span("invoke_agent partial")
    good = recorder.tool("lookup_customer", end_ms=1_764_000_100_000, parent=root, args={"id": 7},
                         result={"name": "Ada"}, **{"gen_ai.conversation.id": "run-partial"})
    recorder.tool(None, end_ms=1_764_000_100_010, parent=root, name="execute_tool ???")
    root.end()
    trace_id, span_id = hex_ids(good)  # type: ignore[arg-type]
    return (trace_id.encode(), encode(recorder.spans(), encoding)), f"{trace_id}-{span_id}"


async def runaway_through_the_span_processor(fleet: Fleet) -> list[str]:
    """An OTel-instrumented agent, guarded by one line, calling a failing tool 6 times; its event ids."""
    provider = TracerProvider()
    publisher = TelemetryPublisher(KafkaClientConfig(fleet.bootstrap), fleet.telemetry_topic)
    async with LoopwardenSpanProcessor(publisher) as processor:  # delivers what was reported on exit
        provider.add_span_processor(processor)
        tracer = provider.get_tracer("runaway-agent")
        ids = []
        for _ in range(6):
            with tracer.start_as_current_span("execute_tool search_docs", attributes={
                    "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search_docs",
                    "gen_ai.conversation.id": "conv-otel-runaway",
                    "gen_ai.tool.call.arguments": '{"query": "q3 report"}', "error.type": "TimeoutError"}) as span:
                span.set_status(Status(StatusCode.ERROR, "index unavailable"))
                ids.append(f"{span.get_span_context().trace_id:032x}-{span.get_span_context().span_id:016x}")
    return ids


@pytest.fixture(scope="module", params=ENCODINGS)
def otlp_run(request: pytest.FixtureRequest, kafka_bootstrap: str,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One worker reading a collector topic in one encoding: the simulated fleet as exporter records
    (with a redelivered record), a record that is not OTLP, a record with a bad tool span; and, on its
    telemetry topic, a runaway reported by the span processor. Everything it wrote, collected."""
    encoding = request.param
    fleet = Fleet(kafka_bootstrap, tmp_path_factory.mktemp(encoding))
    otlp_topic = f"{fleet.name}.otlp_spans"
    fleet.settings.update(otlp_topic=otlp_topic, otlp_encoding=encoding)
    worker = fleet.start_worker()
    try:
        records, expected_stream = otlp_corpus(encoding)
        garbage = (b"garbage", b"\x0a\xff\xff\xff\xff\x0f" if encoding == "otlp_proto" else b"{not json")
        partial, partial_event_id = partly_bad_record(encoding)
        run(produce_raw(kafka_bootstrap, otlp_topic, [*records[:20], garbage, partial, *records[20:]]))
        expected = replay_decisions(expected_stream)
        otel_ids = run(runaway_through_the_span_processor(fleet))
        control = run(consume(kafka_bootstrap, fleet.control_topic, len(expected) + 1, settle=3.0))
        dlq = run(consume(kafka_bootstrap, fleet.dlq_topic, 2, settle=0.5))
        telemetry = run(consume(kafka_bootstrap, fleet.telemetry_topic, len(expected_stream) + 1 + 6, settle=0.5))
        time.sleep(1.0)  # let the metrics of the last batch land
        return {"encoding": encoding, "otlp_topic": otlp_topic, "expected_stream": expected_stream,
                "expected": expected, "control": control, "dlq": dlq, "telemetry": telemetry,
                "partial_event_id": partial_event_id, "otel_ids": otel_ids, "metrics": worker.metrics(),
                "log": worker.log_tail()}
    finally:
        fleet.stop()


def test_collector_records_get_the_decisions_of_the_equivalent_native_telemetry(otlp_run: dict[str, Any]) -> None:
    """Every control message for the traced fleet equals what replaying the native telemetry those tool
    spans stand for gives: none missing, none extra, each run's in order (a redelivered record counted
    once, by event id)."""
    got = [d for d in decisions_of(otlp_run["control"]) if d["run_id"] != "conv-otel-runaway"]
    expected = otlp_run["expected"]
    assert {d["verdict"] for d in expected} >= {"recursion", "semantic_loop", "cycle", "circuit_open"}
    key = lambda d: (d["run_id"], d["ts_ms"], d["decision_id"])  # noqa: E731
    assert sorted(got, key=key) == sorted(expected, key=key), otlp_run["log"]
    for run_id in {d["run_id"] for d in expected}:
        assert [d["decision_id"] for d in got if d["run_id"] == run_id] == [
            d["decision_id"] for d in expected if d["run_id"] == run_id]


def test_tool_spans_are_relayed_as_telemetry_keyed_by_run_id(otlp_run: dict[str, Any]) -> None:
    """Tool spans reach the telemetry topic as the native events they stand for, inference spans as model
    calls of the same run (agent spans are skipped), keyed by run id; the valid span of a partly bad record
    is relayed too."""
    relayed = [r for r in otlp_run["telemetry"] if orjson.loads(r.value)["run_id"] != "conv-otel-runaway"]
    assert all(r.key == orjson.loads(r.value)["run_id"].encode() for r in relayed)
    models = [e for e in (orjson.loads(r.value) for r in relayed) if e.get("kind") == "model_call"]
    tools = [r for r in relayed if orjson.loads(r.value).get("kind") != "model_call"]
    assert models and all("args" not in e and "result" not in e for e in models)
    assert all(decode_event(e).kind == "model_call" for e in models)
    relayed = tools
    by_id = {event["event_id"]: event for event in (orjson.loads(r.value) for r in relayed)}
    assert len(relayed) == len(otlp_run["expected_stream"]) + 1
    assert otlp_run["partial_event_id"] in by_id
    redelivered = len(otlp_run["expected_stream"]) - len({e["event_id"] for e in otlp_run["expected_stream"]})
    redelivered_models = len(models) - len({e["event_id"] for e in models})  # inference spans sent twice
    assert redelivered > 0
    assert otlp_run["metrics"]["loopwarden_duplicate_events_total"] == redelivered + redelivered_models
    for native in otlp_run["expected_stream"]:
        event = by_id[native["event_id"]]
        assert {k: event.get(k) for k in native} == native


def test_what_is_not_otlp_and_bad_tool_spans_land_in_the_dlq(otlp_run: dict[str, Any]) -> None:
    dlq = sorted(otlp_run["dlq"], key=lambda r: r.key)
    assert [r.key for r in dlq] == sorted([b"garbage", otlp_run["partial_event_id"].split("-")[0].encode()])
    by_key = {r.key: r for r in dlq}
    garbage = by_key[b"garbage"]
    expected = "not OTLP protobuf" if otlp_run["encoding"] == "otlp_proto" else "not JSON"
    assert header(garbage.headers, "error").decode().startswith(expected)
    partial = next(r for r in dlq if r.key != b"garbage")
    assert header(partial.headers, "error_field") == b"gen_ai.tool.name"
    assert header(partial.headers, "error").decode().startswith("gen_ai.tool.name: tool span rejected")
    assert all(header(r.headers, "source_topic") == otlp_run["otlp_topic"].encode() for r in dlq)
    metrics = otlp_run["metrics"]
    assert metrics['loopwarden_dlq_total{reason="gen_ai.tool.name"}'] == 1


def test_the_span_processor_gets_a_runaway_halted(otlp_run: dict[str, Any]) -> None:
    """Telemetry from LoopwardenSpanProcessor is native telemetry: the worker warns on the runaway's 3rd
    identical failing call and halts it on its 4th, each decision naming its span."""
    decisions = [d for d in decisions_of(otlp_run["control"]) if d["run_id"] == "conv-otel-runaway"]
    assert [(d["action"], d["verdict"], d["trigger_event_id"]) for d in decisions] == [
        ("advise", "recursion", otlp_run["otel_ids"][2]), ("halt", "recursion", otlp_run["otel_ids"][3])]
    halts = decisions[1:]
    trace_id, span_id = otlp_run["otel_ids"][3].split("-")
    assert (halts[0]["trace_id"], halts[0]["span_id"]) == (trace_id, span_id)


async def _events_published_by_the_processor(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    provider = TracerProvider()
    builder = TelemetryBuilder(raw_tools=["lookup_customer"])
    async with TelemetryPublisher(KafkaClientConfig(bootstrap), topic) as publisher:
        processor = LoopwardenSpanProcessor(publisher, builder, run_id_from="trace")
        provider.add_span_processor(processor)
        tracer = provider.get_tracer("agent")

        def tool_call_in_a_thread(name: str, arguments: dict[str, Any], **extra: Any) -> None:
            with tracer.start_as_current_span(f"execute_tool {name}", attributes={
                    "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name,
                    "gen_ai.tool.call.arguments": orjson.dumps(arguments).decode(), **extra}):
                pass

        with tracer.start_as_current_span("invoke_agent support"):
            with tracer.start_as_current_span("chat"):
                pass
            await asyncio.to_thread(tool_call_in_a_thread, "search_docs", {"query": "refund", "api_key": "sk-1"},
                                    **{"gen_ai.tool.call.result": '{"hits": 2}'})
            await asyncio.to_thread(tool_call_in_a_thread, "lookup_customer", {"id": 7, "password": "hunter2"},
                                    **{"dev.loopwarden.result_hash": "c" * 64, "dev.loopwarden.side_effect": True})
            await asyncio.to_thread(tool_call_in_a_thread, "broken", {}, **{"dev.loopwarden.retry_budget": "3"})
        assert await asyncio.to_thread(processor.force_flush, 10_000)
        assert (processor.reported, processor.rejected, processor.dropped) == (2, 1, 0)
    return [orjson.loads(r.value) for r in await consume(bootstrap, topic, 2, settle=0.5)]


def test_span_processor_publishes_tool_spans_hashed_and_redacted(kafka_bootstrap: str, topic_factory: Any) -> None:
    """With the real SDK TracerProvider: one event per ended tool span (spans ended on other threads,
    flushed with the SDK's force_flush), built by the TelemetryBuilder: arguments hashed after secrets are
    removed, a raw tool's arguments sent without them, the span's own result hash kept, ids from the span;
    a tool span with a mistyped attribute is counted as rejected, not raised into the app."""
    topic = topic_factory(partitions=1)
    search, lookup = run(_events_published_by_the_processor(kafka_bootstrap, topic))
    assert search["tool"] == "search_docs" and "args" not in search
    assert search["args_hash"] == semantic_hash({"query": "refund"})
    assert search["result_hash"] == semantic_hash({"hits": 2})
    assert search["run_id"] == search["trace_id"] and search["event_id"] == f"{search['trace_id']}-{search['span_id']}"
    assert len(search["parent_span_id"]) == 16
    assert lookup["args"] == {"id": 7} and lookup["result_hash"] == "c" * 64 and "result" not in lookup
    assert lookup["side_effect"] is True
    assert b"sk-1" not in orjson.dumps(search) and b"hunter2" not in orjson.dumps(lookup)


async def _ensure_topic(bootstrap: str, name: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        exists = name in await admin.list_topics()
    finally:
        await admin.close()
    if not exists:
        create_topics(bootstrap, [TopicSpec(name, 1)])


def test_readme_opentelemetry_example_runs(kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's example, run as written against the local broker (KAFKA_BOOTSTRAP_SERVERS), publishes
    its tool span to agent.telemetry as one hashed telemetry event."""
    run(_ensure_topic(kafka_bootstrap, "agent.telemetry"))
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    code = example("### OpenTelemetry")
    assert len(code.strip().splitlines()) <= 10
    namespace: dict[str, Any] = {}
    exec(compile("async def _example():\n" + "".join(f"    {line}\n" for line in code.splitlines()),
                 "README.md", "exec"), namespace)
    started_ms = time.time_ns() // 1_000_000
    run(namespace["_example"]())
    events = [orjson.loads(r.value) for r in run(consume(kafka_bootstrap, "agent.telemetry", 1 << 30, timeout=5))]
    mine = [e for e in events if e["tool"] == "search_docs" and e["ts_ms"] >= started_ms
            and e["event_id"] == f"{e['run_id']}-{e.get('span_id')}"]
    assert len(mine) == 1, events[-5:]
    assert "args_hash" in mine[0] and mine[0]["run_id"] == mine[0]["trace_id"]
