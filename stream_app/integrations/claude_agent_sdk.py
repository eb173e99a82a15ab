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
success. Ids: the main agent's run is the ``session_id``, a sub-agent's its own child run (below); the tool
call id is the ``tool_use_id``; hook inputs carry no trace ids.

Sub-agents: a call of the ``Agent`` tool (``Task`` before Claude Code 2.1) starts one, so it is reported as
a spawn-class call: ``child_agent_id`` is its ``subagent_type``, the task its ``prompt`` (else its
``description``), hashed like arguments, so the same task delegated again and again is seen, and
``child_run_id`` is ``<session_id>/<tool_use_id>``: the sub-agent's run, a child of the run that called the
tool, in the session's tree (the session is its root). The tool hooks of a sub-agent's calls carry its
``agent_id`` (``SubagentStart`` says which one started); the guard pairs an ``agent_id`` with the oldest
spawn of its ``agent_type`` (else the oldest) not yet paired, in the order sub-agents start, so register
``subagent_start`` too: without it, a sub-agent is paired at its first tool call, and one that makes none
leaves its spawn to the next. A sub-agent the guard saw no spawn for is a child of the session. So a tree
that runs away is seen as it grows: a spawn creating a run deeper than the policy's ``max_tree_depth``,
or taking the tree past ``max_tree_runs``, halts the tree, and every run of it is denied its next call.

A paused tool (``ToolPaused``: a storm on its upstream, or this run's own transient streak) is denied with
the wait in the reason, and the agent goes on: Claude can retry later or do something else.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Final, NamedTuple, cast

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
    SubagentStartHookInput,
    SyncHookJSONOutput,
)

from ..client import CallIds, Guard, GuardedRun, PendingCall, RunHalted, Spawn, ToolOutcome, ToolPaused
from ..core.contract import MAX_ID_LENGTH

#: Calls begun but not finished, kept per guard: a call another hook or the user denied never gets its
#: post hook, so the oldest are forgotten past this many.
_MAX_PENDING: Final = 1024
#: The tool that starts a sub-agent: ``Agent`` since Claude Code 2.1, ``Task`` (still its alias) before.
SUBAGENT_TOOLS: Final = frozenset(("Agent", "Task"))
#: The sub-agent type an ``Agent`` call without ``subagent_type`` starts.
DEFAULT_SUBAGENT_TYPE: Final = "general-purpose"
#: Spawns not yet paired with a sub-agent, and sub-agents paired with their runs, kept per guard.
_MAX_SUBAGENTS: Final = 4096


class _Child(NamedTuple):
    """A sub-agent's run: its id, and the run that spawned it."""

    run_id: str
    parent_run_id: str


class _Spawned(NamedTuple):
    """A spawn not yet paired with the sub-agent it started."""

    session_id: str
    subagent_type: str
    child: _Child


class ClaudeAgentGuard:
    """The hook callbacks of one guard; register ``pre_tool_use``, ``post_tool_use`` and
    ``post_tool_use_failure`` for all tools (``HookMatcher(hooks=[...])``, no matcher).

    ``agent_id``: the agent the guard's policy resolves these calls under.
    """

    def __init__(self, guard: Guard, *, agent_id: str | None = None) -> None:
        self.guard = guard
        self.agent_id = agent_id
        self._pending: OrderedDict[str, PendingCall] = OrderedDict()
        self._spawned: OrderedDict[str, _Spawned] = OrderedDict()  # by the spawn's tool_use_id
        self._children: OrderedDict[tuple[str, str], _Child] = OrderedDict()  # by (session_id, agent_id)

    async def subagent_start(
        self, input_data: HookInput, tool_use_id: str | None, context: HookContext
    ) -> SyncHookJSONOutput:
        """Pair the sub-agent that starts with the spawn that started it (see the module docstring)."""
        start = cast(SubagentStartHookInput, input_data)
        self._child_of(start["session_id"], start["agent_id"], start.get("agent_type"))
        return {}

    async def pre_tool_use(
        self, input_data: HookInput, tool_use_id: str | None, context: HookContext
    ) -> SyncHookJSONOutput:
        """Begin the call; deny it and stop the agent if the run is halted."""
        call = cast(PreToolUseHookInput, input_data)
        try:
            run = self._run_of(call)
            spawn = spawn_of(call, child_run_id(call["session_id"], call["tool_use_id"]))
            pending = await run.begin(call["tool_name"], call["tool_input"], spawn=spawn,
                                      ids=CallIds(tool_call_id=call["tool_use_id"]))
        except RunHalted as halted:
            return {"continue_": False, "stopReason": str(halted), "hookSpecificOutput": _deny(str(halted))}
        except ToolPaused as paused:
            return {"hookSpecificOutput": _deny(f"{paused}. The call was not made; retry it later or do something "
                                                f"else.")}
        if pending.earlier is not None:
            earlier = _shown(pending.earlier)
            return {"hookSpecificOutput": _deny(
                f"loopwarden: this repeats an earlier call of {call['tool_name']} with the same input; the tool "
                f"acts on the outside world, so it was not run again. Its result was: {earlier}")}
        self._pending[call["tool_use_id"]] = pending
        if len(self._pending) > _MAX_PENDING:
            self._pending.popitem(last=False)
        if spawn is not None and spawn.child_run_id is not None:
            self._spawned[call["tool_use_id"]] = _Spawned(
                call["session_id"], spawn.child_agent_id or DEFAULT_SUBAGENT_TYPE, _Child(spawn.child_run_id, run.run_id))
            if len(self._spawned) > _MAX_SUBAGENTS:
                self._spawned.popitem(last=False)
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
        run = self._run_of(call)
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

    def _run_of(self, call: PreToolUseHookInput | PostToolUseHookInput | PostToolUseFailureHookInput) -> GuardedRun:
        """The run of a tool hook's call: the session's, or the sub-agent's whose ``agent_id`` it carries.
        Raises ``TreeHalted`` (a ``RunHalted``) for a new sub-agent of a halted tree."""
        session = call["session_id"]
        agent = call.get("agent_id")
        if not agent:
            return self.guard.run(session, agent_id=self.agent_id)
        child = self._child_of(session, agent, call.get("agent_type"))
        return self.guard.run(child.run_id, agent_id=self.agent_id, parent_run_id=child.parent_run_id,
                              root_run_id=session)

    def _child_of(self, session: str, agent: str, agent_type: str | None) -> _Child:
        """The run of sub-agent ``agent``: paired with the oldest unpaired spawn of the session of its
        type (else the oldest) the first time it is seen; a child of the session if there is none."""
        child = self._children.get((session, agent))
        if child is not None:
            return child
        spawned = [(use, s) for use, s in self._spawned.items() if s.session_id == session]
        use = next((use for use, s in spawned if s.subagent_type == agent_type), spawned[0][0] if spawned else None)
        child = self._spawned.pop(use).child if use is not None else _Child(child_run_id(session, agent), session)
        self._children[session, agent] = child
        if len(self._children) > _MAX_SUBAGENTS:
            self._children.popitem(last=False)
        return child


def child_run_id(session_id: str, suffix: str) -> str:
    """A sub-agent's run id: ``<session_id>/<suffix>``, or a hash of it past the id length limit."""
    run_id = f"{session_id}/{suffix}"
    return run_id if len(run_id) <= MAX_ID_LENGTH else hashlib.sha256(run_id.encode()).hexdigest()


def spawn_of(call: PreToolUseHookInput, child: str | None = None) -> Spawn | None:
    """The sub-agent an ``Agent``/``Task`` call starts (see the module docstring), its run ``child``, else None."""
    if call["tool_name"] not in SUBAGENT_TOOLS:
        return None
    tool_input = call["tool_input"] if isinstance(call["tool_input"], Mapping) else {}
    agent = tool_input.get("subagent_type")
    task = tool_input.get("prompt") or tool_input.get("description")
    named = isinstance(agent, str) and 0 < len(agent) <= MAX_ID_LENGTH  # the model wrote it: never trusted to fit
    return Spawn(child_run_id=child, child_agent_id=agent if named else None, task=task or None)


def is_error(response: Any) -> bool:
    """Whether a ``PostToolUse`` ``tool_response`` reports a failure (see the module docstring)."""
    return isinstance(response, Mapping) and (
        response.get("is_error") is True or response.get("isError") is True or response.get("success") is False
    )


def _shown(earlier: Any) -> str:
    """The earlier call's answer as the model reads it: its result as JSON (anything JSON cannot say as
    its text: an integer past 64 bits, say), or the error it failed with."""
    try:
        result = earlier.replay()
    except Exception as exc:  # noqa: BLE001 - the earlier call failed: that is its answer
        return f"it failed: {type(exc).__name__}: {exc}"
    try:
        return orjson.dumps(result, default=str).decode()
    except TypeError:
        return repr(result)


def _deny(reason: str) -> PreToolUseHookSpecificOutput:
    return {"hookEventName": "PreToolUse", "permissionDecision": "deny", "permissionDecisionReason": reason}
