"""Bytes on the bus: how telemetry and control messages are encoded, shared by the worker and the SDK.

Control and alert messages are CloudEvents in Kafka binary mode: the value is the control v1 JSON, and
the event attributes travel as ``ce_*`` headers, so any CloudEvents consumer can route them (by
``ce_type``) without knowing our schema. The record key is the run id, the key runtimes consume by.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from ..core import Decision, OperatorCommand
from ..core.contract import MAX_TS_MS
from ..core.fleet import ScopeDecision
from ..core.fleet.scope import ScopeCommand

CE_TYPE_PREFIX = "dev.loopwarden."
CONTENT_TYPE = b"application/json"

Headers = list[tuple[str, bytes]]

#: Marks an operator command on the telemetry topic (``loopwarden halt|resume``), so the worker tells
#: it from a tool call without parsing it as one.
KIND_HEADER = "lw_kind"
OPERATOR_KIND = b"operator"


def encode_telemetry(event: dict[str, Any]) -> tuple[bytes, bytes]:
    """(key, value) of one telemetry event: keyed by run id so a run stays in one partition."""
    return event["run_id"].encode(), orjson.dumps(event)


def traceparent(trace_id: str | None, span_id: str | None) -> str | None:
    """W3C traceparent of the triggering call, when its ids are well-formed hex."""
    if not trace_id or not span_id or len(trace_id) != 32 or len(span_id) != 16:
        return None
    try:
        int(trace_id, 16), int(span_id, 16)
    except ValueError:
        return None
    return f"00-{trace_id.lower()}-{span_id.lower()}-01"


def encode_control(decision: Decision, source: str) -> tuple[bytes, bytes, Headers]:
    """(key, value, headers) of a decision as a binary-mode CloudEvent. ``ce_time`` is the trigger's
    event time, so re-sending the same decision yields byte-identical headers and value."""
    value = orjson.dumps(decision.to_control())
    headers: Headers = [
        ("ce_specversion", b"1.0"),
        ("ce_id", decision.decision_id.encode()),
        ("ce_source", source.encode()),
        ("ce_type", f"{CE_TYPE_PREFIX}{decision.action}".encode()),
        ("ce_time", rfc3339(decision.ts_ms).encode()),
        ("ce_subject", decision.run_id.encode()),
        ("ce_partitionkey", decision.run_id.encode()),
        ("content-type", CONTENT_TYPE),
    ]
    parent = traceparent(decision.trace_id, decision.span_id)
    if parent:
        headers.append(("ce_traceparent", parent.encode()))
    return decision.run_id.encode(), value, headers


def encode_scope_control(decision: ScopeDecision, source: str) -> tuple[bytes, bytes, Headers]:
    """(key, value, headers) of a decision about a tree, a tool or a thread: keyed by the scope's key (the
    root run id of a tree), ``ce_subject`` ``scope/key``; no run id anywhere a runtime would act on."""
    key = decision.key_text.encode()
    value = orjson.dumps(decision.to_control())
    headers: Headers = [
        ("ce_specversion", b"1.0"),
        ("ce_id", decision.decision_id.encode()),
        ("ce_source", source.encode()),
        ("ce_type", f"{CE_TYPE_PREFIX}{decision.scope}.{decision.action}".encode()),
        ("ce_time", rfc3339(decision.ts_ms).encode()),
        ("ce_subject", f"{decision.scope}/{decision.key_text}".encode()),
        ("ce_partitionkey", key),
        ("content-type", CONTENT_TYPE),
    ]
    return key, value, headers


def encode_operator(command: OperatorCommand) -> tuple[bytes, bytes, Headers]:
    """(key, value, headers) of an operator command, keyed by run id like the run's telemetry (so it
    is applied in order with the run's calls). The signature headers are added by the sender."""
    return command.run_id.encode(), orjson.dumps(command.to_json()), [(KIND_HEADER, OPERATOR_KIND)]


def encode_scope_operator(command: ScopeCommand) -> tuple[bytes, bytes, Headers]:
    """(key, value, headers) of an operator's tree or thread command, keyed ``scope/key`` like the facts
    of its keyed fold. The signature headers are added by the sender."""
    return f"{command.scope}/{command.key_text}".encode(), orjson.dumps(command.to_json()), [(KIND_HEADER, OPERATOR_KIND)]


def header(headers: Any, name: str) -> bytes | None:
    """The value of header ``name`` from a list of (name, value) pairs (aiokafka/faust shapes)."""
    if not headers:
        return None
    items = headers.items() if isinstance(headers, dict) else headers
    for key, value in items:
        if key == name:
            return value if isinstance(value, bytes) else str(value).encode()
    return None


def rfc3339(ts_ms: int) -> str:
    """``ts_ms`` as an RFC 3339 UTC time with milliseconds (CloudEvents ``time``); a time no date can say
    (a forged fact's, say) is said as the nearest one that can, never an error. In integer arithmetic: every
    published decision is dated here (datetime's float seconds took 2.8 us a decision, and said a quarter to
    half of the times after 2242, 2^33 s, a millisecond early)."""
    ts_ms = min(max(ts_ms, 0), MAX_TS_MS)  # the event times telemetry may carry
    seconds, ms = divmod(ts_ms, 1000)
    t = time.gmtime(seconds)
    return _RFC3339 % (t[0], t[1], t[2], t[3], t[4], t[5], ms)


_RFC3339 = "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ"
