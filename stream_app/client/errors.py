"""What the SDK raises into agent code. Each is a ``LoopwardenError`` and keeps the builtin base callers
caught before (``ValueError``, ``TypeError``, ``RuntimeError``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core import LoopwardenError

__all__ = ["DuplicateSuppressed", "InvalidArgumentType", "InvalidCall", "RunHalted", "ThreadHalted", "ToolPaused",
           "TreeHalted", "UsageError"]


class RunHalted(LoopwardenError):
    """loopwarden halted this run: stop calling tools for it. Carries the halt decision."""

    def __init__(self, decision: Mapping[str, Any]) -> None:
        self.decision = dict(decision)
        self.run_id = str(decision.get("run_id", ""))
        self.verdict = str(decision.get("verdict", "unknown"))
        self.reason = str(decision.get("reason", ""))
        self.decision_id = str(decision.get("decision_id", ""))
        super().__init__(
            f"run {self.run_id} was halted by loopwarden ({self.verdict}): {self.reason} "
            f"[decision {self.decision_id}]"
        )


class TreeHalted(RunHalted):
    """loopwarden halted the sub-agent tree this run is in (a control v1 decision of scope ``tree``): every
    run of the tree stops, and no new child starts in it. ``run_id`` is the run refused."""

    def __init__(self, decision: Mapping[str, Any], run_id: str) -> None:
        self.root_run_id = str(decision.get("root_run_id", ""))
        super().__init__({**decision, "run_id": run_id})
        self.decision = dict(decision)
        self.args = (f"run {run_id}: sub-agent tree {self.root_run_id} was halted by loopwarden ({self.verdict}): "
                     f"{self.reason} [decision {self.decision_id}]",)


class ThreadHalted(RunHalted):
    """loopwarden halted the thread a new run was to start on (a control v1 decision of scope ``thread``:
    a self-triggering chain, scheduled runs failing alike): no new run starts on it until an operator
    resumes it. ``run_id`` is the run refused."""

    def __init__(self, decision: Mapping[str, Any], run_id: str) -> None:
        self.tenant = str(decision.get("tenant", ""))
        self.thread_key = str(decision.get("thread_key", ""))
        super().__init__({**decision, "run_id": run_id})
        self.decision = dict(decision)
        self.args = (f"run {run_id}: thread {self.thread_key} was halted by loopwarden ({self.verdict}): "
                     f"{self.reason} [decision {self.decision_id}]",)


class ToolPaused(LoopwardenError):
    """loopwarden paused this tool for the run's tenant (scope ``tool``: a storm, every run failing on the
    same upstream), or for this run (scope ``run``: its own transient streak): the call was not made.
    Wait ``retry_after_s`` seconds and try again (or do something else); the guard lets one call through
    per wait to see whether the upstream recovered. Not a halt: the run goes on."""

    def __init__(self, decision: Mapping[str, Any], run_id: str, tool: str, upstream: str | None,
                 retry_after_s: float) -> None:
        self.decision = dict(decision)
        self.run_id = run_id
        self.tool = tool
        self.upstream = upstream
        self.retry_after_s = retry_after_s
        self.verdict = str(decision.get("verdict", "unknown"))
        self.decision_id = str(decision.get("decision_id", ""))
        where = f" of {upstream}" if upstream else ""
        super().__init__(f"run {run_id}: tool {tool}{where} is paused by loopwarden ({self.verdict}): retry in "
                         f"{retry_after_s:.1f} s [decision {self.decision_id}]")


class DuplicateSuppressed(LoopwardenError):
    """A suppressed duplicate of a side-effecting call, refused because the integration it went through
    cannot hand back the earlier result (``where``; ``instead`` names one that can). Frameworks whose
    hooks let only their own exceptions out subclass it (``integrations.openai_agents``)."""

    def __init__(self, run_id: str, tool: str, where: str = "this integration", instead: str | None = None) -> None:
        self.run_id = run_id
        self.tool = tool
        better = f" ({instead} would answer it)" if instead else ""
        super().__init__(
            f"run {run_id}: loopwarden suppressed a duplicate call of {tool}; {where} cannot hand back the "
            f"earlier result, so the call is refused{better}"
        )


class InvalidCall(LoopwardenError, ValueError):
    """An argument the telemetry contract would refuse (names it), refused before the tool runs."""


class InvalidArgumentType(InvalidCall, TypeError):
    """An argument of the wrong type."""


class UsageError(LoopwardenError, RuntimeError):
    """The SDK used where it cannot work: not started, outside a task or outside its event loop."""
