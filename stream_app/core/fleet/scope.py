"""Decisions about a scope wider than one run (control v1 ``scope``)."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import orjson

from ..contract import MAX_ID_LENGTH, MAX_TS_MS, SCHEMA_VERSION
from ..errors import InvalidEvent, NotJSON

Scope = Literal["run", "tree", "tool", "thread"]
#: Control v1 scopes, and the key fields each names its key with (``run``: the run id, the default).
SCOPES: Final[dict[str, tuple[str, ...]]] = {
    "run": ("run_id",),
    "tree": ("root_run_id",),
    "tool": ("tenant", "tool", "upstream"),
    "thread": ("tenant", "thread_key"),
}


def scope_decision_id(scope: str, key: tuple[str, ...], action: str, verdict: str, part: str = "") -> str:
    """The id of the decision ``action``/``verdict`` about ``scope`` ``key``: ``part`` says what in the
    key fired when a rule can fire more than once (a task of a tree, a window of a tool)."""
    raw = "\x1f".join((scope, *key, action, verdict, part)).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


@dataclass(slots=True, frozen=True)
class ScopeDecision:
    """One decision about a tree, a tool or a thread. ``trigger_run_id`` is the run whose event crossed
    the threshold (for people: a runtime acts on the scope's key, not on it; empty for an operator's)."""

    scope: Scope
    key: tuple[str, ...]
    action: str
    verdict: str
    trigger_event_id: str
    trigger_run_id: str
    decision_id: str
    ts_ms: int
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)
    tenant: str | None = None

    def to_control(self) -> dict[str, Any]:
        """The control v1 object: ``scope`` and its key fields instead of ``run_id``."""
        message: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "decision_id": self.decision_id,
            "scope": self.scope,
            **dict(zip(SCOPES[self.scope], self.key, strict=True)),
            "action": self.action,
            "verdict": self.verdict,
            "trigger_event_id": self.trigger_event_id,
            **({"trigger_run_id": self.trigger_run_id} if self.trigger_run_id else {}),
            "ts_ms": self.ts_ms,
            "reason": self.reason,
            "evidence": self.evidence,
        }
        if self.tenant is not None and "tenant" not in message:
            message["tenant"] = self.tenant
        return message

    @property
    def key_text(self) -> str:
        """The key as one string (the partition key of the re-keyed topics and of the scopes topic)."""
        return key_text(self.key)


@functools.lru_cache(maxsize=1 << 16)
def key_text(key: tuple[str, ...]) -> str:
    """A scope key as one unambiguous string: its parts joined by ``/``, each but the last with ``%`` and
    ``/`` escaped (``acme/pr-7``; a tenant ``a/b`` gives ``a%2Fb/...``). Cached: a key's facts ask for it
    on both sides of the facts topic, batch after batch."""
    *head, last = key
    return "/".join([*(part.replace("%", "%25").replace("/", "%2F") for part in head), last])


def key_part(text: str) -> str:
    """A key part but the last as ``key_text`` writes it, read back (``%2F`` a ``/``, ``%25`` a ``%``)."""
    return text.replace("%2F", "/").replace("%2f", "/").replace("%25", "%")


#: Scopes an operator halts (a tool: pauses) and resumes through their keyed fold (``loopwarden halt
#: --tree|--thread|--tool``).
OPERATED_SCOPES: Final = ("tree", "thread", "tool")


@dataclass(slots=True, frozen=True)
class ScopeCommand:
    """An operator's halt or resume of a tree or a thread, or pause or resume of a tool (``loopwarden
    halt|resume --tree|--thread|--tool``). It travels on the facts topic, keyed by the scope key, so its
    keyed fold applies it in order with the key's facts; the adapter has verified its signature
    (``key_id``) before the core sees it. An operator's pause of a tool lets no call through until an
    operator resumes it (no half-open)."""

    scope: str
    key: tuple[str, ...]
    action: str
    command_id: str
    operator: str
    reason: str
    ts_ms: int
    key_id: str = ""

    def to_json(self) -> dict[str, Any]:
        """The command's wire object (``key_id`` travels in a header, with the signature)."""
        return {"schema_version": SCHEMA_VERSION, "kind": "operator", "scope": self.scope,
                **dict(zip(SCOPES[self.scope], self.key, strict=True)), "action": self.action,
                "command_id": self.command_id, "operator": self.operator, "reason": self.reason, "ts_ms": self.ts_ms}

    @property
    def key_text(self) -> str:
        return key_text(self.key)

    def decision(self) -> ScopeDecision:
        """The signed answer: ``operator_halt`` or ``operator_resume`` of the scope, its id from the
        command (a command applied twice is one decision)."""
        verdict = "operator_resume" if self.action == "resume" else "operator_halt"
        return ScopeDecision(
            self.scope, self.key, self.action, verdict, self.command_id, "",  # type: ignore[arg-type]
            scope_decision_id(self.scope, self.key, self.action, verdict, self.command_id), self.ts_ms,
            f"{self.action} by operator {self.operator}: {self.reason}",
            {"operator": self.operator, "reason": self.reason, "command_id": self.command_id, "key_id": self.key_id},
            self.key[0] if self.scope in ("thread", "tool") else None)


def decode_scope_command(raw: bytes, key_id: str = "") -> ScopeCommand:
    """Decode an operator's scope command; raise InvalidEvent naming the field."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise NotJSON.at(exc.msg, exc.pos) from exc
    if type(obj) is not dict or obj.get("kind") != "operator":
        raise InvalidEvent("kind", "not an operator command")
    scope = obj.get("scope")
    if scope not in OPERATED_SCOPES:
        raise InvalidEvent("scope", f"must be one of {', '.join(OPERATED_SCOPES)}, got {str(scope)[:40]!r}")
    for name in (*SCOPES[scope], "command_id", "operator", "reason"):
        value = obj.get(name)
        empty_ok = name == "tenant"  # a thread of telemetry that names no tenant
        if type(value) is not str or not (0 if empty_ok else 1) <= len(value) <= MAX_ID_LENGTH * (
                4 if name == "reason" else 1):
            raise InvalidEvent(name, "required: a non-empty string" if not empty_ok else "required: a string")
    actions = ("pause", "resume") if scope == "tool" else ("halt", "resume")
    if obj.get("action") not in actions:
        raise InvalidEvent("action", f"must be {' or '.join(actions)}, got {str(obj.get('action'))[:40]!r}")
    ts_ms = obj.get("ts_ms")
    if type(ts_ms) is not int or not 0 <= ts_ms <= MAX_TS_MS:
        raise InvalidEvent("ts_ms", f"required: an integer from 0 to {MAX_TS_MS} (epoch milliseconds)")
    return ScopeCommand(scope, tuple(obj[name] for name in SCOPES[scope]), obj["action"], obj["command_id"],
                        obj["operator"], obj["reason"], ts_ms, key_id)
