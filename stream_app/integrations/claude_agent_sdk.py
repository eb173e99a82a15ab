"""loopwarden in the Claude Agent SDK: hook callbacks for ``PreToolUse``, ``PostToolUse`` and
``PostToolUseFailure``, registered through ``ClaudeAgentOptions(hooks=...)``.

The SDK reports a tool call in two hooks, so the call is split the same way: ``PreToolUse`` begins it
(``GuardedRun.begin``), the hook after it finishes it. Once the run is halted, ``PreToolUse`` denies the
call (``permissionDecision: "deny"``, the reason for Claude) and stops the agent (``continue: false``
with a ``stopReason``): a denial alone would let Claude try something else. The post hook of the call
that triggered the halt already stops the agent, so Claude does not spend another turn. A suppressed
duplicate of a side-effecting tool is denied with its earlier result in the reason, and the agent goes
on.

Outcome: ``PostToolUseFailure`` (the CLI's failed tool calls, ``error`` text) is an error; in
``PostToolUse`` a ``tool_response`` with ``is_error``/``isError`` true (MCP and SDK ``@tool`` results) or
``success`` false is an error; an empty response (None, "", [], {}) is empty; anything else is a
success. Ids: the run is the ``session_id`` (sub-agents' calls belong to their session's run), the tool
call id is the ``tool_use_id``; hook inputs carry no trace ids.

Sub-agents: a call of the ``Agent`` tool (``Task`` before Claude Code 2.1) starts one, so it is reported as
a spawn-class call: ``child_agent_id`` is its ``subagent_type``, the task its ``prompt`` (else its
``description``), hashed like arguments, so the same task delegated again and again is seen.

A paused tool (``ToolPaused``: a storm on its upstream, or this run's own transient streak) is denied with
the wait in the reason, and the agent goes on: Claude can retry later or do something else.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Final, cast

import orjson
from claude_agent_sdk.types import (
    HookContext,
    HookInput,
    PostToolUseFailureHookInput,
    PostToolUseFailureHookSpecificOutput,
    PostToolUseHookInput,
    PostToolUseHookSpecificOutput,
    PreToolUseHookInput,
    PreToolUseHookSpecificOutput,
    SyncHookJSONOutput,
)

from ..client import CallIds, Guard, PendingCall, RunHalted, Spawn, ToolOutcome, ToolPaused
from ..core.contract import MAX_ID_LENGTH

#: Calls begun but not finished, kept per guard: a call another hook or the user denied never gets its
#: post hook, so the oldest are forgotten past this many.
_MAX_PENDING: Final = 1024
#: The tool that starts a sub-agent: ``Agent`` since Claude Code 2.1, ``Task`` (still its alias) before.
SUBAGENT_TOOLS: Final = frozenset(("Agent", "Task"))


class ClaudeAgentGuard:
    """The hook callbacks of one guard; register ``pre_tool_use``, ``post_tool_use`` and
    ``post_tool_use_failure`` for all tools (``HookMatcher(hooks=[...])``, no matcher).

    ``agent_id``: the agent the guard's policy resolves these calls under.
    """

    def __init__(self, guard: Guard, *, agent_id: str | None = None) -> None:
        self.guard = guard
        self.agent_id = agent_id
        self._pending: OrderedDict[str, PendingCall] = OrderedDict()

    async def pre_tool_use(
        self, input_data: HookInput, tool_use_id: str | None, context: HookContext
    ) -> SyncHookJSONOutput:
        """Begin the call; deny it and stop the agent if the run is halted."""
        call = cast(PreToolUseHookInput, input_data)
        try:
            run = self.guard.run(call["session_id"], agent_id=self.agent_id)
            pending = await run.begin(call["tool_name"], call["tool_input"], spawn=spawn_of(call),
                                      ids=CallIds(tool_call_id=call["tool_use_id"]))
        except RunHalted as halted:
            return {"continue_": False, "stopReason": str(halted), "hookSpecificOutput": _deny(str(halted))}
        except ToolPaused as paused:
            return {"hookSpecificOutput": _deny(f"{paused}. The call was not made; retry it later or do something "
                                                f"else.")}
        if pending.earlier is not None:
            earlier = orjson.dumps(pending.earlier.replay(), default=str).decode()
            return {"hookSpecificOutput": _deny(
                f"loopwarden: this repeats an earlier call of {call['tool_name']} with the same input; the tool "
                f"acts on the outside world, so it was not run again. Its result was: {earlier}")}
        self._pending[call["tool_use_id"]] = pending
        if len(self._pending) > _MAX_PENDING:
            self._pending.popitem(last=False)
        return {}

    async def post_tool_use(
        self, input_data: HookInput, tool_use_id: str | None, context: HookContext
    ) -> SyncHookJSONOutput:
        """Finish the call with its ``tool_response``; stop the agent if that halted the run."""
        call = cast(PostToolUseHookInput, input_data)
        response = call["tool_response"]
        return await self._finish(call, ToolOutcome("error", response) if is_error(response) else response)

    async def post_tool_use_failure(
        self, input_data: HookInput, tool_use_id: str | None, context: HookContext
    ) -> SyncHookJSONOutput:
        """Finish the call as failed with the CLI's ``error``; stop the agent if that halted the run."""
        call = cast(PostToolUseFailureHookInput, input_data)
        return await self._finish(call, ToolOutcome("error", {"error": call["error"]}))

    async def _finish(self, call: PostToolUseHookInput | PostToolUseFailureHookInput,
                      result: Any) -> SyncHookJSONOutput:
        pending = self._pending.pop(call["tool_use_id"], None)
        if pending is None:  # begun by no PreToolUse of this guard (or forgotten): nothing to finish
            return {}
        run = self.guard.run(call["session_id"], agent_id=self.agent_id)
        await run.finish(pending, result, latency_ms=call.get("duration_ms", 0))
        decision = run.decision
        if decision is None:
            advice = run.take_advice()
            if advice is None:
                return {}
            # Claude reads it with this call's result: the warning before the halt.
            context_for_claude: PostToolUseHookSpecificOutput | PostToolUseFailureHookSpecificOutput
            if call["hook_event_name"] == "PostToolUse":
                context_for_claude = {"hookEventName": "PostToolUse", "additionalContext": f"loopwarden: {advice}"}
            else:
                context_for_claude = {"hookEventName": "PostToolUseFailure",
                                      "additionalContext": f"loopwarden: {advice}"}
            return {"hookSpecificOutput": context_for_claude}
        return {"continue_": False, "stopReason": str(RunHalted(decision))}


def spawn_of(call: PreToolUseHookInput) -> Spawn | None:
    """The sub-agent an ``Agent``/``Task`` call starts (see the module docstring), else None."""
    if call["tool_name"] not in SUBAGENT_TOOLS:
        return None
    tool_input = call["tool_input"] if isinstance(call["tool_input"], Mapping) else {}
    agent = tool_input.get("subagent_type")
    task = tool_input.get("prompt") or tool_input.get("description")
    named = isinstance(agent, str) and 0 < len(agent) <= MAX_ID_LENGTH  # the model wrote it: never trusted to fit
    return Spawn(child_agent_id=agent if named else None, task=task or None)


def is_error(response: Any) -> bool:
    """Whether a ``PostToolUse`` ``tool_response`` reports a failure (see the module docstring)."""
    return isinstance(response, Mapping) and (
        response.get("is_error") is True or response.get("isError") is True or response.get("success") is False
    )


def _deny(reason: str) -> PreToolUseHookSpecificOutput:
    return {"hookEventName": "PreToolUse", "permissionDecision": "deny", "permissionDecisionReason": reason}
