"""The shipped collector configuration (deploy/otel-collector/config.yaml) parses, wires its pipeline, and
sets the kafka exporter and filter processor keys the way their documentation names them and the worker
reads the records. (Loading it into a real otelcol-contrib build is left to deployment: the Go build of
the exporter and processor modules is too heavy for the test machine.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from stream_app.sources.otlp import ENCODINGS

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "otel-collector" / "config.yaml"

#: Settings of the contrib kafka exporter (exporter/kafkaexporter/README.md) this configuration may use.
KAFKA_EXPORTER_KEYS = {"brokers", "protocol_version", "client_id", "traces", "partition_traces_by_id", "producer",
                       "tls", "auth", "timeout", "retry_on_failure", "sending_queue", "record_headers"}
KAFKA_TRACES_KEYS = {"topic", "encoding", "topic_from_metadata_key", "message_key_from_metadata_key"}
KAFKA_PRODUCER_KEYS = {"max_message_bytes", "required_acks", "compression", "compression_params", "linger",
                       "flush_max_messages", "allow_auto_topic_creation", "max_broker_write_bytes"}


def load() -> dict[str, Any]:
    config = yaml.safe_load(CONFIG.read_text())
    assert isinstance(config, dict)
    return config


def test_pipeline_wires_otlp_in_tool_spans_filtered_kafka_out() -> None:
    config = load()
    (pipeline,) = config["service"]["pipelines"].items()
    name, stages = pipeline
    assert name.split("/")[0] == "traces"
    assert stages["receivers"] == ["otlp"] and set(config["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    assert stages["processors"][0].startswith("filter/")  # filtered before batching: less to batch
    (exporter,) = stages["exporters"]
    assert exporter.split("/")[0] == "kafka"
    for kind in ("receivers", "processors", "exporters"):
        assert set(stages[kind]) <= set(config[kind]), f"{kind} used but not defined"


def test_filter_keeps_only_tool_and_inference_spans_by_attribute() -> None:
    """One condition (conditions are ORed: a span matching any is dropped) that keeps exactly the
    operations the worker maps: execute_tool and the inference operations."""
    from stream_app.sources.otlp import EXECUTE_TOOL, INFERENCE

    config = load()
    (filter_name,) = [p for p in config["processors"] if p.startswith("filter/")]
    filter_ = config["processors"][filter_name]
    assert filter_["error_mode"] == "ignore"
    (condition,) = filter_["traces"]["span"]
    kept = {part.split("!=")[1].strip().strip('"') for part in condition.split(" and ")}
    assert all(part.startswith('attributes["gen_ai.operation.name"] != ') for part in condition.split(" and "))
    assert kept == {EXECUTE_TOOL, *INFERENCE}


def test_kafka_exporter_writes_one_trace_per_record_in_an_encoding_the_worker_reads() -> None:
    config = load()
    (exporter,) = [e for e in config["exporters"] if e.startswith("kafka/")]
    kafka = config["exporters"][exporter]
    assert set(kafka) <= KAFKA_EXPORTER_KEYS
    assert set(kafka["traces"]) <= KAFKA_TRACES_KEYS and set(kafka["producer"]) <= KAFKA_PRODUCER_KEYS
    assert kafka["traces"]["topic"] == "otlp_spans"  # the exporter's default, named for LOOPWARDEN_OTLP_TOPIC
    assert kafka["traces"]["encoding"] in ENCODINGS
    assert kafka["partition_traces_by_id"] is True
    assert kafka["producer"]["required_acks"] == -1
