"""Telemetry contract v1 (what runtimes send) and control contract v1 (what loopwarden answers).

The JSON Schemas in ``schemas/`` are the published form of the same contract; this module is the fast
path that every adapter (worker, replay CLI, SDK) decodes with. A decoding failure names the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import orjson

from .errors import InvalidEvent, NotJSON

Outcome = Literal["success", "error", "empty", "noop"]
Action = Literal["halt", "suppress", "alert", "resume", "advise", "pause"]
Verdict = Literal[
    "recursion",
    "semantic_loop",
    "cycle",
    "iteration_ceiling",
    "duplicate_call",
    "circuit_open",
    "polling",
    "no_progress",
    "oscillation",
    "budget_exceeded",
    "handoff_loop",
    "operator_halt",
    "operator_resume",
]
OperatorAction = Literal["halt", "resume"]

OUTCOMES: Final = frozenset(("success", "error", "empty", "noop"))
#: Tool classes (``tool_class``): what a call does, for the rules that need it; ``other`` by default.
TOOL_CLASSES: Final = ("read", "write", "poll", "spawn", "handoff", "other")
#: Event kinds on the telemetry topic: a tool call (the default), a model call (an inference: its
#: ``tool`` is the model, it needs no args or result), and an operator's signed command.
KINDS: Final = ("tool_call", "model_call", "operator")
#: Spent sums saturate here (both engines agree past any real budget).
SPEND_CAP: Final = 1 << 62


def micro_usd(value: int | float | None) -> int:
    """A cost in USD as integer micro-USD (half rounds up; saturating at ``SPEND_CAP``)."""
    if value is None:
        return 0
    if type(value) is int:
        return min(value * 1_000_000, SPEND_CAP)
    scaled = value * 1_000_000.0 + 0.5  # may be inf for a huge (finite) cost: capped before floor
    return SPEND_CAP if scaled >= SPEND_CAP else max(0, math.floor(scaled))


def token_count(value: int | float | None) -> int:
    """A token count as an integer (a fraction is dropped; saturating at ``SPEND_CAP``)."""
    if value is None:
        return 0
    if type(value) is int:
        return min(value, SPEND_CAP)
    return SPEND_CAP if value >= SPEND_CAP else max(0, math.floor(value))
FAILING_OUTCOMES: Final = frozenset(("error", "empty", "noop"))
SCHEMA_VERSION: Final = "1"

#: Longest accepted identifier (run id, event id, tool name, trace ids...).
MAX_ID_LENGTH: Final = 512
#: Largest accepted encoded event, by default (a runaway payload must not exhaust memory).
MAX_EVENT_BYTES: Final = 1 << 20
#: Largest accepted retry budget; anything above is a mistake, not a policy.
MAX_RETRY_BUDGET: Final = 10_000
_MAX_SAFE_INT: Final = 2**63 - 1
#: The latest event time an event may carry: 9999-12-31T23:59:59.999Z (the last a date can say; a later
#: ``ts_ms`` broke every decision's CloudEvents time, and with it the worker).
MAX_TS_MS: Final = 253_402_300_799_999


@dataclass(slots=True)
class TelemetryEvent:
    """One finished tool call. Exactly one of ``args``/``args_hash`` and of ``result``/``result_hash``
    is meaningful; ``has_result`` tells a JSON ``null`` result from an absent one."""

    run_id: str
    event_id: str
    tool: str
    ts_ms: int
    outcome: Outcome
    args: dict[str, Any] | None = None
    args_hash: str | None = None
    result: Any = None
    has_result: bool = False
    result_hash: str | None = None
    agent_id: str | None = None
    tenant: str | None = None
    seq: int | None = None
    trace_id: str | None = None
    span_id: str | None = None
    parent_span_id: str | None = None
    retry_budget: int | None = None
    plan_step: int | None = None
    side_effect: bool | None = None
    error_class: str | None = None
    #: The start of the error's message (at most ``MAX_ERROR_HEAD_BYTES``, redacted by the SDK), for tools
    #: whose policy opts in (``send_error_head``); halts quote it.
    error_head: str | None = None
    #: SHA-256 of the runtime's policy (``Policy.digest``): workers count events of a policy not theirs.
    policy_digest: str | None = None
    #: The failing result's fingerprint (its hash with volatile tokens masked, ``core/volatile.py``), sent
    #: by runtimes that hash results on the client; a raw ``result`` overrides it.
    result_fp: str | None = None
    #: What the call does (``TOOL_CLASSES``); None leaves it to the tool's policy.
    tool_class: str | None = None
    #: The resource the call reads or writes (a path, a URL, a record id).
    target: str | None = None
    #: The target's content hash after a write-class call.
    state_hash: str | None = None
    #: ``tool_call`` (None) or ``model_call``.
    kind: str | None = None
    #: What the call cost: tokens, and USD (as given; budgets sum ``micro_usd`` of it).
    tokens: int | float | None = None
    cost_usd: int | float | None = None
    # Fleet-wide rules (optional; see ``core/fleet``). Trees: the run's parent and the tree's root run
    # (a root run names itself or nothing), its depth (0 for a root), and on a spawn-class call the child
    # it starts (``task_hash``: a semantic hash of the delegated task, computed like args).
    parent_run_id: str | None = None
    root_run_id: str | None = None
    depth: int | None = None
    child_run_id: str | None = None
    child_agent_id: str | None = None
    task_hash: str | None = None
    #: Storms: the host or MCP server the tool calls, and the wait it asked for.
    upstream: str | None = None
    retry_after_ms: int | None = None
    #: Chains: what started the run (``TRIGGERS``), the run that caused it, and the thread (a PR, an
    #: issue, a channel, a session) that runs on the same subject share.
    trigger: str | None = None
    caused_by_run_id: str | None = None
    thread_key: str | None = None


#: Transient failure classes (``error_class``; besides ``http_500``..``http_599``): what an upstream's
#: degradation causes, not the caller's mistake (every other 4xx).
TRANSIENT_CLASSES: Final = frozenset(("http_429", "http_5xx", "timeout", "connection"))


def is_transient(error_class: str | None) -> bool:
    """Whether a failure of ``error_class`` is one an upstream's degradation causes (429, 5xx, timeout,
    connection), not the caller's mistake (every other 4xx)."""
    if error_class is None:
        return False
    if error_class in TRANSIENT_CLASSES:
        return True
    return (len(error_class) == 8 and error_class.startswith("http_5") and error_class[5:].isascii()
            and error_class[5:].isdigit())


#: What starts a run (``trigger``).
TRIGGERS: Final = ("user", "schedule", "webhook", "agent")
#: Deepest declared ``depth`` accepted (a tree is halted long before).
MAX_DEPTH: Final = 10_000
#: Longest accepted ``error_head``, in UTF-8 bytes.
MAX_ERROR_HEAD_BYTES: Final = 256

_OPTIONAL_STRINGS: Final = frozenset(
    ("agent_id", "tenant", "trace_id", "span_id", "parent_span_id", "error_class", "policy_digest", "target",
     "parent_run_id", "root_run_id", "child_run_id", "child_agent_id", "upstream", "caused_by_run_id", "thread_key")
)
_OPTIONAL_NUMBERS: Final = frozenset(("latency_ms", "tokens", "cost_usd"))
_CHECKED_ELSEWHERE: Final = frozenset(
    ("run_id", "event_id", "tool", "ts_ms", "outcome", "args", "args_hash", "result", "result_hash")
)


def _identifier(obj: dict[str, Any], name: str, required: bool) -> str | None:
    value = obj.get(name)
    if value is None:
        if required:
            raise InvalidEvent(name, "required field is missing")
        return None
    if type(value) is not str:
        raise InvalidEvent(name, f"must be a string, got {_json_type(value)}")
    if required and not value:
        raise InvalidEvent(name, "must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidEvent(name, f"longer than {MAX_ID_LENGTH} characters")
    return value


def _integer(obj: dict[str, Any], name: str, minimum: int | None = None) -> int | None:
    value = obj.get(name)
    if value is None:
        return None
    if type(value) is not int:
        if type(value) is float:  # orjson reads an integer past 64 bits as a float
            beyond = " (past the 64-bit range)" if value.is_integer() else ""
            raise InvalidEvent(name, f"must be an integer, got {value!r}{beyond}")
        raise InvalidEvent(name, f"must be an integer, got {_json_type(value)}")
    if minimum is not None and value < minimum:
        raise InvalidEvent(name, f"must be >= {minimum}, got {value}")
    if value > _MAX_SAFE_INT:
        raise InvalidEvent(name, "out of the 64-bit range")
    return value


def _hash_string(obj: dict[str, Any], name: str) -> None:
    value = obj.get(name)
    if value is not None and (type(value) is not str or not value or len(value) > MAX_ID_LENGTH):
        raise InvalidEvent(name, f"must be a non-empty string of at most {MAX_ID_LENGTH} characters")


def _check_required(obj: dict[str, Any]) -> None:
    """Raise the precise error for whichever required field is wrong (the slow, explaining path)."""
    for name in ("run_id", "event_id", "tool"):
        _identifier(obj, name, True)
    ts_ms = _integer(obj, "ts_ms", 0)
    if ts_ms is None:
        raise InvalidEvent("ts_ms", "required field is missing")
    if ts_ms > MAX_TS_MS:
        raise InvalidEvent("ts_ms", f"must be <= {MAX_TS_MS} (9999-12-31T23:59:59.999Z), got {ts_ms}")
    outcome = obj.get("outcome")
    if outcome is None:
        raise InvalidEvent("outcome", "required field is missing")
    raise InvalidEvent("outcome", f"must be one of error, empty, noop, success; got {outcome!r}"[:200])


def _check_optional(obj: dict[str, Any], name: str) -> None:
    """Validate one optional field that is present (unknown fields are ignored: forward compatible)."""
    value = obj[name]
    if value is None:
        return
    if name in _OPTIONAL_STRINGS:
        _identifier(obj, name, False)
    elif name in ("seq", "plan_step"):
        _integer(obj, name)
    elif name == "retry_budget":
        if _integer(obj, name, 0) > MAX_RETRY_BUDGET:  # type: ignore[operator]
            raise InvalidEvent(name, f"must be <= {MAX_RETRY_BUDGET}, got {value}")
    elif name == "error_head":
        if type(value) is not str:
            raise InvalidEvent(name, f"must be a string, got {_json_type(value)}")
        if len(value.encode()) > MAX_ERROR_HEAD_BYTES:
            raise InvalidEvent(name, f"longer than {MAX_ERROR_HEAD_BYTES} bytes")
    elif name == "result_fp" or name == "state_hash" or name == "task_hash":
        _hash_string(obj, name)
    elif name == "depth":
        if _integer(obj, name, 0) > MAX_DEPTH:  # type: ignore[operator]
            raise InvalidEvent(name, f"must be <= {MAX_DEPTH}, got {value}")
    elif name == "retry_after_ms":
        _integer(obj, name, 0)
    elif name == "trigger":
        if value not in TRIGGERS:
            raise InvalidEvent(name, f"must be one of {', '.join(TRIGGERS)}; got {value!r}"[:200])
    elif name == "kind":
        if value == "operator":
            raise InvalidEvent(name, "an operator command, not a telemetry event (send it with loopwarden halt|resume)")
        if value not in KINDS:
            raise InvalidEvent(name, f"must be tool_call or model_call; got {value!r}"[:200])
    elif name == "tool_class":
        if value not in TOOL_CLASSES:
            raise InvalidEvent(name, f"must be one of {', '.join(TOOL_CLASSES)}; got {value!r}"[:200])
    elif name == "side_effect":
        if type(value) is not bool:
            raise InvalidEvent(name, f"must be a boolean, got {_json_type(value)}")
    elif name in _OPTIONAL_NUMBERS:
        if type(value) not in (int, float):
            raise InvalidEvent(name, f"must be a number >= 0, got {_json_type(value)}")
        if value < 0:
            raise InvalidEvent(name, f"must be a number >= 0, got {value!r}")
    elif name == "attrs":
        if type(value) is not dict:
            raise InvalidEvent(name, f"must be an object, got {_json_type(value)}")
    elif name == "schema_version" and value != SCHEMA_VERSION:
        raise InvalidEvent(name, f"unsupported version {value!r}; this reader speaks '1'"[:200])


def parse_event(raw: bytes, max_bytes: int = MAX_EVENT_BYTES) -> TelemetryEvent:
    """Decode one encoded event (a JSONL line, a Kafka message value); raise InvalidEvent with a reason
    a person can act on: too large, not JSON (invalid UTF-8, NaN, nesting past 1024 levels), or a
    contract violation naming the field. orjson reads integers past 64 bits as floats (lossy, but the
    same every time), so a ``ts_ms`` that large is refused as not an integer."""
    if len(raw) > max_bytes:
        raise InvalidEvent("", f"event is {len(raw)} bytes, over the {max_bytes}-byte limit")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise NotJSON.at(exc.msg, exc.pos, raw) from exc
    return decode_event(obj)


def decode_event(obj: Any) -> TelemetryEvent:
    """Validate a decoded JSON value against telemetry v1 and build the event; raise InvalidEvent.

    This runs once per event in every adapter, so the common case is one combined check and the
    field-by-field explanation only runs when something is wrong.
    """
    if type(obj) is not dict:
        raise InvalidEvent("", f"event must be a JSON object, got {_json_type(obj)}")
    get = obj.get
    # Any, not Optional: the combined check below proves their types before they are used.
    run_id: Any = get("run_id")
    event_id: Any = get("event_id")
    tool: Any = get("tool")
    ts_ms: Any = get("ts_ms")
    outcome: Any = get("outcome")
    if not (
        type(run_id) is str and 0 < len(run_id) <= MAX_ID_LENGTH
        and type(event_id) is str and 0 < len(event_id) <= MAX_ID_LENGTH
        and type(tool) is str and 0 < len(tool) <= MAX_ID_LENGTH
        and type(ts_ms) is int and 0 <= ts_ms <= MAX_TS_MS
        and type(outcome) is str and outcome in OUTCOMES
    ):
        _check_required(obj)

    model_call = get("kind") == "model_call"  # an inference: neither args nor a result required
    args, args_hash = get("args"), get("args_hash")
    if args is None:
        if args_hash is None and not model_call:
            raise InvalidEvent("args", "one of args or args_hash is required")
    elif type(args) is not dict:
        raise InvalidEvent("args", f"must be an object, got {_json_type(args)}")
    if args_hash is not None:
        _hash_string(obj, "args_hash")
    has_result = "result" in obj
    result_hash = get("result_hash")
    if result_hash is not None:
        _hash_string(obj, "result_hash")
    elif not has_result and not model_call:
        raise InvalidEvent("result", "one of result or result_hash is required")
    for name in obj.keys() - _CHECKED_ELSEWHERE:
        _check_optional(obj, name)
    if get("parent_run_id") is not None and get("root_run_id") is None:
        raise InvalidEvent("root_run_id", "required when parent_run_id is set (the id of the tree's root run)")

    return TelemetryEvent(
        run_id, event_id, tool, ts_ms, outcome, args, args_hash, get("result"), has_result, result_hash,
        get("agent_id"), get("tenant"), get("seq"), get("trace_id"), get("span_id"), get("parent_span_id"),
        get("retry_budget"), get("plan_step"), get("side_effect"), get("error_class"), get("error_head"),
        get("policy_digest"), get("result_fp"), get("tool_class"), get("target"), get("state_hash"), get("kind"),
        get("tokens"), get("cost_usd"), get("parent_run_id"), get("root_run_id"), get("depth"), get("child_run_id"),
        get("child_agent_id"), get("task_hash"), get("upstream"), get("retry_after_ms"), get("trigger"),
        get("caused_by_run_id"), get("thread_key"),
    )


@dataclass(frozen=True, slots=True)
class OperatorCommand:
    """An operator's halt or resume of one run (``loopwarden halt|resume``). It travels on the telemetry
    topic, keyed by run id, so it is applied in order with the run's calls; the adapter has verified
    its signature (``key_id``) before the core sees it."""

    run_id: str
    action: OperatorAction
    command_id: str
    operator: str
    reason: str
    ts_ms: int
    key_id: str = ""

    def to_json(self) -> dict[str, Any]:
        """The command's wire object (``key_id`` travels in a header, with the signature)."""
        return {"schema_version": SCHEMA_VERSION, "kind": "operator", "run_id": self.run_id,
                "action": self.action, "command_id": self.command_id, "operator": self.operator,
                "reason": self.reason, "ts_ms": self.ts_ms}


def decode_operator_command(raw: bytes, key_id: str = "") -> OperatorCommand:
    """Decode an operator command's value; raise InvalidEvent naming the field."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise NotJSON.at(exc.msg, exc.pos, raw) from exc
    if type(obj) is not dict or obj.get("kind") != "operator":
        raise InvalidEvent("kind", "not an operator command")
    for name in ("run_id", "command_id", "operator", "reason"):
        value = obj.get(name)
        if type(value) is not str or not 0 < len(value) <= MAX_ID_LENGTH * (4 if name == "reason" else 1):
            raise InvalidEvent(name, "required: a non-empty string")
    if obj.get("action") not in ("halt", "resume"):
        raise InvalidEvent("action", f"must be halt or resume, got {str(obj.get('action'))[:40]!r}")
    ts_ms = obj.get("ts_ms")
    if type(ts_ms) is not int or not 0 <= ts_ms <= MAX_TS_MS:
        raise InvalidEvent("ts_ms", f"required: an integer from 0 to {MAX_TS_MS} (epoch milliseconds)")
    return OperatorCommand(obj["run_id"], obj["action"], obj["command_id"], obj["operator"], obj["reason"],
                           ts_ms, key_id)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


@dataclass(slots=True, frozen=True)
class Decision:
    """One control decision. ``decision_id`` is derived from the input, so a replayed or redelivered
    trigger yields the same id and consumers can apply it idempotently."""

    run_id: str
    action: Action
    verdict: Verdict
    trigger_event_id: str
    decision_id: str
    ts_ms: int
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)
    agent_id: str | None = None
    tenant: str | None = None
    trace_id: str | None = None
    span_id: str | None = None

    def to_control(self) -> dict[str, Any]:
        """The control v1 JSON object (schemas/control.v1.json)."""
        message: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "decision_id": self.decision_id,
            "run_id": self.run_id,
            "action": self.action,
            "verdict": self.verdict,
            "trigger_event_id": self.trigger_event_id,
            "ts_ms": self.ts_ms,
            "reason": self.reason,
            "evidence": self.evidence,
        }
        for name in ("agent_id", "tenant", "trace_id", "span_id"):
            value = getattr(self, name)
            if value is not None:
                message[name] = value
        return message
