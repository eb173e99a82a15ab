"""Decisions about a scope wider than one run (control v1 ``scope``)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from ..contract import SCHEMA_VERSION

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
    the threshold (for people: a runtime acts on the scope's key, not on it)."""

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
            "trigger_run_id": self.trigger_run_id,
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


def key_text(key: tuple[str, ...]) -> str:
    """A scope key as one unambiguous string: its parts joined by ``/``, each but the last with ``%`` and
    ``/`` escaped (``acme/pr-7``; a tenant ``a/b`` gives ``a%2Fb/...``)."""
    *head, last = key
    return "/".join([*(part.replace("%", "%25").replace("/", "%2F") for part in head), last])
