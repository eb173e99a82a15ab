"""Worker settings, read once from the environment at start-up and validated there.

Nothing else in the worker reads ``os.environ``. ``SETTINGS`` names each field's variable, default and
meaning; the README's table and every harness that starts a worker (``SETTINGS.env(...)``) follow it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..bus.kafka import KafkaClientConfig
from ..bus.logs import FORMATS
from ..bus.settings import SettingsError, SettingsTable
from ..core.stored import FORMAT_VERSION

__all__ = ["SETTINGS", "SettingsError", "WorkerSettings"]

#: The single source of the worker's configuration.
SETTINGS = SettingsTable((
    ("app_id", "LOOPWARDEN_APP_ID", "loopwarden", "consumer group and changelog prefix; workers sharing it split the partitions"),
    ("telemetry_topic", "LOOPWARDEN_TELEMETRY_TOPIC", "agent.telemetry", "input: telemetry v1, keyed by run id"),
    ("control_topic", "LOOPWARDEN_CONTROL_TOPIC", "agent.control", "output: halt/suppress/alert decisions (CloudEvents)"),
    ("alerts_topic", "LOOPWARDEN_ALERTS_TOPIC", "agent.alerts", "output: halts and circuit openings for on-call people"),
    ("dlq_topic", "LOOPWARDEN_DLQ_TOPIC", "agent.telemetry.dlq", "output: rejected input, reason in the `error` header"),
    ("otlp_topic", "LOOPWARDEN_OTLP_TOPIC", "", "input: OTLP traces from the OpenTelemetry Collector's `kafka` exporter, whose tool spans become telemetry; empty: off"),
    ("otlp_encoding", "LOOPWARDEN_OTLP_ENCODING", "otlp_proto", "encoding of that topic, the exporter's `traces::encoding`: `otlp_proto` or `otlp_json`"),
    ("otlp_run_id", "LOOPWARDEN_OTLP_RUN_ID", "conversation", "run id of a tool span: `conversation` (its `gen_ai.conversation.id`, else its trace id) or `trace` (its trace id)"),
    ("fleet_rules", "LOOPWARDEN_FLEET_RULES", "true", "fold the rules across runs (sub-agent trees, self-triggering threads, tool storms: core/fleet) on re-keyed facts; false: per-run rules only, no facts built"),
    ("scopes_topic", "LOOPWARDEN_SCOPES_TOPIC", "loopwarden.scopes", "output: the halts and pauses of scopes wider than a run (sub-agent trees, threads, tools) in force, compacted, keyed by scope key, signed, with their expiry; runtimes read it from the start"),
    ("facts_topic", "LOOPWARDEN_FACTS_TOPIC", "loopwarden.facts", "internal: the facts the folds across runs learn from telemetry, keyed by scope key (`tree/ROOT`, `thread/TENANT/THREAD`, `tool/TENANT/TOOL/UPSTREAM`; LOOPWARDEN_PARTITIONS partitions)"),
    ("partitions", "LOOPWARDEN_PARTITIONS", "8", "partitions of the telemetry topic and the state table (must match)"),
    ("replication_factor", "LOOPWARDEN_REPLICATION_FACTOR", "1", "replication factor of topics the worker creates"),
    ("create_topics", "LOOPWARDEN_CREATE_TOPICS", "true", "create missing topics at start-up"),
    ("policy_path", "LOOPWARDEN_POLICY", "", "policy YAML file; empty means the built-in defaults"),
    ("state_dir", "LOOPWARDEN_STATE_DIR", "var/state", "RocksDB state directory (one per worker instance)"),
    ("metrics_port", "LOOPWARDEN_METRICS_PORT", "9464", "Prometheus metrics port; 0 disables"),
    ("metrics_host", "LOOPWARDEN_METRICS_HOST", "0.0.0.0", "address the metrics endpoint listens on"),
    ("engine", "LOOPWARDEN_ENGINE", "auto", "the batch fold: `native` (the Rust engine, `loopwarden_native`; a start-up error when not installed), `python` (the reference), or `auto` (native when installed)"),
    ("batch_max", "LOOPWARDEN_BATCH_MAX", "1000", "most telemetry events processed (and state writes coalesced) per batch: a batch is what the consumer has fetched, up to this many, with no wait to fill it"),
    ("commit_interval_s", "LOOPWARDEN_COMMIT_INTERVAL_S", "1.0", "consumer offset commit interval, seconds"),
    ("session_timeout_s", "LOOPWARDEN_SESSION_TIMEOUT_S", "10", "group session timeout: how soon a dead worker's partitions move"),
    ("heartbeat_s", "LOOPWARDEN_HEARTBEAT_S", "2", "group heartbeat interval, seconds"),
    ("standby_replicas", "LOOPWARDEN_STANDBY_REPLICAS", "1", "standby copies of each partition's state kept by other workers, so a failover resumes from a local copy instead of replaying the changelog (written a fetch at a time: 0-6 us per event on the peers, BENCHMARKS.md); 0: no copies"),
    ("max_event_bytes", "LOOPWARDEN_MAX_EVENT_BYTES", "1048576", "larger telemetry messages go to the DLQ"),
    ("rocksdb_block_cache_mb", "LOOPWARDEN_ROCKSDB_BLOCK_CACHE_MB", "32", "RocksDB block cache per table partition, MiB"),
    ("rocksdb_write_buffer_mb", "LOOPWARDEN_ROCKSDB_WRITE_BUFFER_MB", "16", "RocksDB write buffer per table partition, MiB"),
    ("rocksdb_max_open_files", "LOOPWARDEN_ROCKSDB_MAX_OPEN_FILES", "256", "RocksDB open files per table partition"),
    ("evict_scan_per_sweep", "LOOPWARDEN_EVICT_SCAN_PER_SWEEP", "256", "stored runs checked for expiry per sweep (a sweep is one partition's turn: every 0.5 s / LOOPWARDEN_PARTITIONS, so each partition every 0.5 s when one worker owns them all; a partition whose pass reached its last run rests 5% of run_ttl_ms, at most 30 s, before the next)"),
    ("state_write_version", "LOOPWARDEN_STATE_WRITE_VERSION", str(FORMAT_VERSION), f"format version of the stored run records this worker writes (0 to {FORMAT_VERSION}; it reads all of them): in a rolling upgrade, keep the old version until every worker runs the new release"),
    ("signing_key", "LOOPWARDEN_SIGNING_KEY", "", "Ed25519 private key (PEM file) that signs every control message; required unless LOOPWARDEN_ALLOW_UNSIGNED=true"),
    ("allow_unsigned", "LOOPWARDEN_ALLOW_UNSIGNED", "false", "publish control messages unsigned (development only: runtimes that verify refuse them)"),
    ("operator_keys", "LOOPWARDEN_OPERATOR_KEYS", "", "operators' Ed25519 public keys (PEM files or directories, comma-separated) whose `loopwarden halt/resume` commands are applied; empty: operator commands go to the DLQ"),
    ("operator_max_age_s", "LOOPWARDEN_OPERATOR_MAX_AGE_S", "900", "operator commands older than this (by their ts_ms) go to the DLQ as replays"),
    ("event_source", "LOOPWARDEN_EVENT_SOURCE", "", "CloudEvents source of decisions; empty means /loopwarden/<app_id>"),
    ("log_level", "LOOPWARDEN_LOG_LEVEL", "warning", "worker log level"),
    ("allow_untested_faust", "LOOPWARDEN_ALLOW_UNTESTED_FAUST", "false", "start on faust-streaming, mode-streaming or aiokafka versions other than the tested pins (0.15.3, 0.7.1, 0.14.0), with a warning; see the upgrade checklist"),
    ("log_format", "LOOPWARDEN_LOG_FORMAT", "json", "log lines on stderr: `json` (one JSON object per line, faust's, aiokafka's and tracebacks included) or `text`"),
))


#: The batch fold's engines (``LOOPWARDEN_ENGINE``).
ENGINES = ("auto", "native", "python")

#: Variables still accepted, for one release, and what to do about them.
DEPRECATED = {
    "LOOPWARDEN_BATCH_WITHIN_S": "LOOPWARDEN_BATCH_WITHIN_S is ignored and will be refused in the next release: "
                                 "a batch is now what the consumer has fetched (up to LOOPWARDEN_BATCH_MAX), with no "
                                 "wait to fill it; remove the variable",
}


@dataclass(frozen=True)
class WorkerSettings:
    kafka: KafkaClientConfig
    app_id: str
    telemetry_topic: str
    control_topic: str
    alerts_topic: str
    dlq_topic: str
    otlp_topic: str
    otlp_encoding: str
    otlp_run_id: str
    fleet_rules: bool
    scopes_topic: str
    facts_topic: str
    partitions: int
    replication_factor: int
    create_topics: bool
    policy_path: Path | None
    state_dir: Path
    metrics_port: int
    metrics_host: str
    engine: str
    batch_max: int
    commit_interval_s: float
    session_timeout_s: float
    heartbeat_s: float
    standby_replicas: int
    max_event_bytes: int
    rocksdb_block_cache_mb: int
    rocksdb_write_buffer_mb: int
    rocksdb_max_open_files: int
    evict_scan_per_sweep: int
    state_write_version: int
    signing_key: Path | None
    allow_unsigned: bool
    operator_keys: str
    operator_max_age_s: float
    event_source: str
    log_level: str
    log_format: str
    allow_untested_faust: bool
    #: Warnings about the environment for the worker to log once logging is set up (deprecated variables).
    notices: tuple[str, ...] = ()

    @property
    def changelog_topic(self) -> str:
        return f"{self.app_id}-runs-changelog"

    @property
    def trees_changelog_topic(self) -> str:
        return f"{self.app_id}-trees-changelog"

    @property
    def threads_changelog_topic(self) -> str:
        return f"{self.app_id}-threads-changelog"

    @property
    def tools_changelog_topic(self) -> str:
        return f"{self.app_id}-tools-changelog"

    @property
    def fleet_changelog_topics(self) -> dict[str, str]:
        """The changelog of each keyed fold's table, by table name (``worker/fleet.py``: ``KINDS``)."""
        return {"trees": self.trees_changelog_topic, "threads": self.threads_changelog_topic,
                "tools": self.tools_changelog_topic}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerSettings:
        """Build and validate the settings; raise SettingsError naming the variable at fault."""
        env = os.environ if environ is None else environ
        values = SETTINGS.read(cls, env)
        for name in ("partitions", "replication_factor", "batch_max", "max_event_bytes"):
            if values[name] < 1:
                raise SettingsError(f"{_var(name)} must be >= 1, got {values[name]}")
        for name in ("commit_interval_s", "session_timeout_s", "heartbeat_s", "operator_max_age_s"):
            if values[name] <= 0:
                raise SettingsError(f"{_var(name)} must be > 0, got {values[name]}")
        if not 0 <= values["state_write_version"] <= FORMAT_VERSION:
            raise SettingsError(f"LOOPWARDEN_STATE_WRITE_VERSION={values['state_write_version']}: this release writes "
                                f"stored run records of format version 0 to {FORMAT_VERSION}")
        if values["heartbeat_s"] * 3 > values["session_timeout_s"]:
            raise SettingsError("LOOPWARDEN_HEARTBEAT_S must be at most a third of LOOPWARDEN_SESSION_TIMEOUT_S")
        if values["signing_key"] is None and not values["allow_unsigned"]:
            raise SettingsError("LOOPWARDEN_SIGNING_KEY: required, the Ed25519 private key that signs control "
                                "messages (`loopwarden keys generate --name worker` makes one); "
                                "LOOPWARDEN_ALLOW_UNSIGNED=true publishes unsigned halts (development only)")
        if values["engine"] not in ENGINES:
            raise SettingsError(f"LOOPWARDEN_ENGINE={values['engine']!r}: expected auto, native or python")
        if values["log_format"] not in FORMATS:
            raise SettingsError(f"LOOPWARDEN_LOG_FORMAT={values['log_format']!r}: expected json or text")
        if values["otlp_encoding"] not in ("otlp_proto", "otlp_json"):
            raise SettingsError(f"LOOPWARDEN_OTLP_ENCODING={values['otlp_encoding']!r}: expected otlp_proto or "
                                "otlp_json, the collector kafka exporter's traces::encoding")
        if values["otlp_run_id"] not in ("conversation", "trace"):
            raise SettingsError(f"LOOPWARDEN_OTLP_RUN_ID={values['otlp_run_id']!r}: expected conversation or trace")
        own = (values["telemetry_topic"], values["control_topic"], values["alerts_topic"], values["dlq_topic"])
        if values["scopes_topic"] in (*own, values["facts_topic"]):
            raise SettingsError(f"LOOPWARDEN_SCOPES_TOPIC={values['scopes_topic']!r} is another of the worker's topics; "
                                "it needs one of its own (compacted)")
        if values["facts_topic"] in own:
            raise SettingsError(f"LOOPWARDEN_FACTS_TOPIC={values['facts_topic']!r} is another of the worker's "
                                "topics; it needs one of its own")
        if values["otlp_topic"] and values["otlp_topic"] in (
                values["telemetry_topic"], values["control_topic"], values["alerts_topic"], values["dlq_topic"]):
            raise SettingsError(f"LOOPWARDEN_OTLP_TOPIC={values['otlp_topic']!r} is one of the worker's own topics; "
                                "name the topic the collector's kafka exporter writes traces to (default otlp_spans)")
        values["event_source"] = values["event_source"] or f"/loopwarden/{values['app_id']}"
        notices = tuple(notice for var, notice in DEPRECATED.items() if var in env)
        return cls(kafka=KafkaClientConfig.from_env(env), notices=notices, **values)


_var = SETTINGS.var
