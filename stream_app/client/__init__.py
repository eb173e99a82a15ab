"""The runtime SDK: what an agent runtime imports to be watched and stopped by loopwarden.

    async with Guard.fleet(KafkaClientConfig("kafka:9092")) as guard:   # or Guard.in_process()
        run = guard.run("run-42", agent_id="support-agent")
        hits = await run.call("search_docs", search_docs, {"query": "refund policy"})

Needs the core, orjson and, for fleet mode only, aiokafka (``pip install 'loopwarden[kafka]'``); never
faust or rocksdict.

Errors (``LoopwardenError`` is the core's root)::

    LoopwardenError
    ├── RunHalted           the run was halted: stop calling tools for it (carries the decision)
    └── KafkaConfigError    Kafka settings or topics that cannot work (also a ValueError)
"""

from __future__ import annotations

from ..bus.kafka import KafkaClientConfig, KafkaConfigError
from .guard import CallIds, Guard, GuardedRun, PendingCall, RunHalted, ToolOutcome
from .listener import ControlBoard, DecisionCallback, HaltListener
from .publisher import DEFAULT_REDACTED_FIELDS, FinishedCall, TelemetryBuilder, TelemetryPublisher

__all__ = [
    "DEFAULT_REDACTED_FIELDS",
    "CallIds",
    "ControlBoard",
    "DecisionCallback",
    "FinishedCall",
    "Guard",
    "GuardedRun",
    "HaltListener",
    "KafkaClientConfig",
    "KafkaConfigError",
    "PendingCall",
    "RunHalted",
    "TelemetryBuilder",
    "TelemetryPublisher",
    "ToolOutcome",
]
