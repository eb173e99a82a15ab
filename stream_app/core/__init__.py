"""The pure detector core: contract, normalisation, policy and the detector fold.

No I/O, no clocks, no Kafka: the worker, the replay CLI and the SDK all import this unchanged.
"""

from __future__ import annotations

from .contract import (
    FAILING_OUTCOMES,
    OUTCOMES,
    Action,
    Decision,
    OperatorCommand,
    Outcome,
    TelemetryEvent,
    Verdict,
    decode_event,
    decode_operator_command,
    parse_event,
)
from .detector import DUPLICATE, Detector, Evaluation, Finding, RunState, decision_id, event_hashes, explain
from .errors import InvalidEvent, LoopwardenError, NormalisationError, NotJSON, PolicyError
from .normalize import DEFAULT_IGNORED_FIELDS, FieldFilter, canonical_json, normalise, semantic_hash
from .policy import CallPolicy, Policy, Thresholds
from .runs import RunTable

__all__ = [
    "DEFAULT_IGNORED_FIELDS",
    "DUPLICATE",
    "FAILING_OUTCOMES",
    "OUTCOMES",
    "Action",
    "CallPolicy",
    "Decision",
    "Detector",
    "Evaluation",
    "FieldFilter",
    "Finding",
    "InvalidEvent",
    "LoopwardenError",
    "NormalisationError",
    "NotJSON",
    "OperatorCommand",
    "Outcome",
    "Policy",
    "PolicyError",
    "RunState",
    "RunTable",
    "TelemetryEvent",
    "Thresholds",
    "Verdict",
    "canonical_json",
    "decision_id",
    "decode_event",
    "decode_operator_command",
    "event_hashes",
    "explain",
    "normalise",
    "parse_event",
    "semantic_hash",
]
