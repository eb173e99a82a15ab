"""The runtime SDK: what an agent runtime imports to be watched and stopped by loopwarden.

    async with Guard.fleet(KafkaClientConfig("kafka:9092")) as guard:   # or Guard.in_process()
        run = guard.run("run-42", agent_id="support-agent")
        hits = await run.call("search_docs", search_docs, {"query": "refund policy"})

Needs the core, orjson and, for fleet mode only, aiokafka (``pip install 'loopwarden[kafka]'``); never
faust or rocksdict.

Errors (``LoopwardenError`` is the core's root; the whole tree is drawn in ``stream_app.core.errors``)::

    LoopwardenError
    ├── RunHalted             the run was halted: stop calling tools for it (carries the decision)
    │   ├── TreeHalted        its sub-agent tree was halted: every run of it stops, no child starts
    │   └── ThreadHalted      its thread was halted (a self-triggering chain): no new run starts on it
    ├── ToolPaused            a paused tool (a storm over the fleet, or the run's transient streak): retry later
    ├── DuplicateSuppressed   a duplicate side effect refused where the earlier result cannot be handed back
    ├── InvalidCall           an argument the contract would refuse (also a ValueError)
    │   └── InvalidArgumentType                                     (also a TypeError)
    ├── UsageError            not started, outside a task or its event loop (also a RuntimeError)
    └── KafkaConfigError      Kafka settings or topics that cannot work (also a ValueError)
"""

from __future__ import annotations

from ..bus.kafka import KafkaClientConfig, KafkaConfigError
from .errors import (
    DuplicateSuppressed,
    InvalidArgumentType,
    InvalidCall,
    RunHalted,
    ThreadHalted,
    ToolPaused,
    TreeHalted,
    UsageError,
)
from .guard import CallIds, Guard, GuardedRun, PendingCall, Spawn, ToolOutcome
from .listener import ControlBoard, DecisionCallback, HaltListener
from .publisher import DEFAULT_REDACTED_FIELDS, FinishedCall, TelemetryBuilder, TelemetryPublisher

__all__ = [
    "DEFAULT_REDACTED_FIELDS",
    "CallIds",
    "ControlBoard",
    "DecisionCallback",
    "DuplicateSuppressed",
    "FinishedCall",
    "Guard",
    "GuardedRun",
    "HaltListener",
    "InvalidArgumentType",
    "InvalidCall",
    "KafkaClientConfig",
    "KafkaConfigError",
    "PendingCall",
    "RunHalted",
    "Spawn",
    "TelemetryBuilder",
    "TelemetryPublisher",
    "ThreadHalted",
    "ToolOutcome",
    "ToolPaused",
    "TreeHalted",
    "UsageError",
]
