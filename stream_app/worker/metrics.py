"""Prometheus metrics of the worker (names follow Prometheus conventions; labels are bounded)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class WorkerMetrics:
    """All worker metrics in one registry, so tests and several apps in one process stay apart."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.events = Counter("loopwarden_events_total", "Telemetry events applied, by outcome class.",
                              ["outcome"], registry=r)
        self.duplicates = Counter("loopwarden_duplicate_events_total",
                                  "Redelivered events skipped (same event id or offset already applied).",
                                  registry=r)
        self.decisions = Counter("loopwarden_decisions_total", "Decisions published, by action and verdict.",
                                 ["action", "verdict"], registry=r)
        self.dlq = Counter("loopwarden_dlq_total", "Messages sent to the dead-letter topic, by reason.",
                           ["reason"], registry=r)
        self.policy_mismatch = Counter("loopwarden_policy_mismatch_total",
                                       "Events whose runtime's policy (policy_digest) is not this worker's, by agent.",
                                       ["agent_id"], registry=r)
        self.rekeyed = Counter("loopwarden_rekeyed_total",
                               "Messages that arrived keyed by something else, re-published keyed by run id.",
                               registry=r)
        self.refetched = Counter("loopwarden_refetched_total",
                                 "Input messages left uncommitted to be fetched again: skipped by faust during a "
                                 "rebalance, or held back behind a gap in the offsets delivered.",
                                 ["reason"], registry=r)
        self.evictions = Counter("loopwarden_evicted_runs_total",
                                 "Runs forgotten after run_ttl_ms of event-time silence (counted once their deletion is "
                                 "written).", registry=r)
        self.decision_latency = Histogram(
            "loopwarden_decision_latency_seconds",
            "From the triggering call's ts_ms to its decision being published (wall clock).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.runs_tracked = Gauge("loopwarden_runs_tracked", "Runs with stored state in this worker's active "
                                  "partitions (standbys excluded): counted on recovery, then kept exact.", registry=r)
        self.consumer_lag = Gauge("loopwarden_consumer_lag", "Telemetry messages not yet processed, by partition: the end offset (read every 0.5 s) minus the next offset to process.",
                                  ["partition"], registry=r)
        self.ready = Gauge("loopwarden_worker_ready", "1 once the worker has recovered its state and consumes.",
                           registry=r)
        self.engine = Gauge("loopwarden_engine_info", "The engine folding telemetry batches (1 for the one in use).",
                            ["engine"], registry=r)
        self.fleet_facts = Counter("loopwarden_fleet_facts_total", "Facts folded by the folds across runs, by fold "
                                   "(trees, threads; redelivered: already folded, skipped by their source offset).",
                                   ["fold", "state"], registry=r)
        self.fleet_keys_tracked = Gauge("loopwarden_fleet_keys_tracked", "Keys (sub-agent trees, threads, tools) with stored "
                                        "state in this worker's active partitions, by fold, as counted since the "
                                        "last recovery.", ["fold"], registry=r)
        self.batch_size = Histogram("loopwarden_batch_events", "Telemetry events per processed batch.",
                                    buckets=(1, 10, 50, 100, 250, 500, 1000, 2500), registry=r)
