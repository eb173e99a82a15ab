"""loopwarden in the OpenAI Agents SDK: run hooks, or tool guardrails, that report every function tool call
and stop a halted run before its next tool runs. The call that triggered the halt has already run and
keeps its result.

- ``LoopwardenRunHooks`` (``Runner.run(agent, input, hooks=...)``) sees every function tool of the run.
  ``on_tool_start`` refuses a halted run's call with ``AgentRunHalted``, a ``RunHalted`` that is also an
  ``AgentsException``: the SDK re-raises those from a hook as they are, and wraps anything else in a
  ``UserError``. Hooks cannot skip a tool, only raise, so a suppressed duplicate of a side-effecting call
  is refused with ``DuplicateSuppressed``, which ends the run (the tool does not run twice).
- ``LoopwardenToolGuardrails`` (``function_tool(..., tool_input_guardrails=[g.input],
  tool_output_guardrails=[g.output])``) guards the tools it is attached to, the SDK's way: a halt trips
  the input guardrail (``ToolInputGuardrailTripwireTriggered``, whose ``output.output_info`` is the halt
  decision), and a suppressed duplicate is answered with the earlier result (``reject_content``): the
  tool does not run and the run goes on.

The SDK turns a tool's exception into a message for the model before any hook or guardrail sees the
call's end, so a failing tool would be reported as a success with that message, and a loop of failures
would never halt. Give each tool ``failure_error_function=tool_failed``: it marks the call failed for
whichever guard reports it, and answers the model with the SDK's default message.

Ids: the run is ``run_id`` (a string, or a function of the run context) if given, else the run's
``group_id`` (``RunConfig(group_id=...)``, the SDK's conversation id), else its trace id (one per
``Runner.run`` while tracing is on). The model's call id goes to ``attrs.tool_call_id``; the trace id
(``trace_<32 hex>``) to the W3C ``trace_id`` without its prefix.

Sub-agents, for the rules across agents:

- A handoff (``on_handoff``, run hooks only: guardrails never see one) is reported once it happened as a
  handoff-class call of the handoff's tool (``transfer_to_<agent>``, or its ``tool_name_override``) naming
  the agent handed to as ``child_agent_id``. The hook gets no ``RunConfig``, so its run is ``run_id``, else
  the trace's group id, else the trace id: a run named only by its group id with tracing off cannot be
  told, and its handoffs go unreported (warned once; pass ``run_id=``). The call's ``agent_id`` is the
  agent handing off, so ``handoff_loop`` sees A->B->A.
- An agent used as a tool (``agent.as_tool(...)``) is a spawn-class call: ``child_agent_id`` is the
  sub-agent's name, the task its input, and ``child_run_id`` is ``<run>/<call id>``: the sub-agent's run,
  a child of the calling run in its tree. The guard wraps the tool's ``on_invoke_tool`` once so that the
  nested ``Runner.run`` carries that lineage (a context variable): the sub-agent's calls, seen by the
  hooks passed to ``as_tool(hooks=...)`` or the guardrails on its tools, go to the child run, and its own
  agent tools nest deeper. So ``tree_depth``, ``tree_fanout`` and ``tree_recursion`` see the tree that
  agents calling agents build, and halt all of it.

A paused tool (``ToolPaused``: a storm on its upstream, or this run's own transient streak) is not a halt:
the guardrails answer the model that the call was not made and when to retry, and the run goes on. Run
hooks cannot skip a tool: they end the run with ``AgentToolPaused``, a ``ToolPaused`` (its
``retry_after_s``) that the SDK lets out of ``Runner.run`` unwrapped.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import re
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Final, NamedTuple

import orjson
from agents import (
    AgentsException,
    Handoff,
    RunContextWrapper,
    RunHooks,
    ToolGuardrailFunctionOutput,
    ToolInputGuardrail,
    ToolInputGuardrailData,
    ToolOutputGuardrail,
    ToolOutputGuardrailData,
    default_tool_error_function,
)
from agents.exceptions import ToolInputGuardrailTripwireTriggered
from agents.tool import FunctionTool, resolve_function_tool_failure_error_function
from agents.tool_context import ToolContext
from agents.tracing import get_current_trace

from .. import client
from ..client import CallIds, Guard, GuardedRun, InvalidCall, PendingCall, RunHalted, Spawn, ToolPaused
from ..core.contract import MAX_ID_LENGTH

__all__ = [
    "AgentRunHalted",
    "AgentToolPaused",
    "DuplicateSuppressed",
    "GuardrailHalted",
    "LoopwardenRunHooks",
    "LoopwardenToolGuardrails",
    "tool_failed",
]

logger = logging.getLogger(__name__)

RunIdOf = Callable[[RunContextWrapper[Any]], str]

_SDK_TRACE_ID: Final = re.compile(r"trace_([0-9a-f]{32})")
#: The exception of each failed call still in flight, by its tool context (gone with the context).
_FAILED: weakref.WeakKeyDictionary[RunContextWrapper[Any], Exception] = weakref.WeakKeyDictionary()


class _Child(NamedTuple):
    """The run of a sub-agent an agent tool runs: its id, the calling run, and their tree's root."""

    run_id: str
    parent_run_id: str
    root_run_id: str


#: The child run each guarded agent-tool call starts, and the guard that began the call, by its tool
#: context, until the tool is invoked.
_SPAWNED: weakref.WeakKeyDictionary[RunContextWrapper[Any], tuple[_Child, _ToolCalls]] = weakref.WeakKeyDictionary()
#: The child run whose nested ``Runner.run`` this is (set by the agent tool's wrapped invoke), else None.
_CHILD: contextvars.ContextVar[_Child | None] = contextvars.ContextVar("loopwarden_child_run", default=None)


def tool_failed(context: RunContextWrapper[Any], error: Exception) -> str:
    """A ``failure_error_function`` for ``function_tool`` and ``as_tool``: marks the call failed, so the
    guard reports its error, and answers the model as the SDK's default does. A halt raised in a
    sub-agent's nested run (``RunHalted``: its tree was halted) is raised on: the calling run is in the
    same tree, so the whole ``Runner.run`` ends, not just the sub-agent."""
    if isinstance(error, RunHalted):
        raise error
    _FAILED[context] = error
    return default_tool_error_function(context, error)


class AgentRunHalted(RunHalted, AgentsException):
    """``RunHalted`` as an ``AgentsException``, which the SDK lets out of a hook unwrapped."""


def _halted(halted: RunHalted) -> AgentRunHalted:
    """The run's ``AgentRunHalted``; a tree's or thread's decision names no run, so the refused one is added."""
    return AgentRunHalted({**halted.decision, "run_id": halted.run_id})


class AgentToolPaused(ToolPaused, AgentsException):
    """``ToolPaused`` as an ``AgentsException``, which the SDK lets out of a hook unwrapped (a run hook
    cannot skip the call: the run ends; ``LoopwardenToolGuardrails`` lets it go on)."""


def _paused(paused: ToolPaused) -> AgentToolPaused:
    return AgentToolPaused(paused.decision, paused.run_id, paused.tool, paused.upstream, paused.retry_after_s)


class GuardrailHalted(RunHalted, ToolInputGuardrailTripwireTriggered):
    """A halted run's call stopped at ``LoopwardenToolGuardrails.input``: the SDK's tripwire
    (``guardrail``; ``output.output_info`` is the halt decision) whose message says which halt, rather
    than the SDK's "Tool input guardrail ToolInputGuardrail triggered tripwire"; and a ``RunHalted``."""

    def __init__(self, guardrail: ToolInputGuardrail[Any], decision: dict[str, Any]) -> None:
        # Not through super(): the two bases take different arguments; both sets of attributes are set.
        halted = RunHalted(decision)
        self.decision, self.run_id, self.verdict = halted.decision, halted.run_id, halted.verdict
        self.reason, self.decision_id = halted.reason, halted.decision_id
        self.guardrail = guardrail
        self.output = ToolGuardrailFunctionOutput.raise_exception(output_info=halted.decision)
        self.run_data = None
        Exception.__init__(self, f"tool input guardrail {guardrail.get_name()} tripped: {halted}")


class DuplicateSuppressed(client.DuplicateSuppressed, AgentsException):
    """The SDK's ``DuplicateSuppressed`` as an ``AgentsException``, which the SDK lets out of a hook
    unwrapped: a run hook cannot hand back the earlier result (``LoopwardenToolGuardrails`` can)."""


class _ToolCalls:
    """What the hooks and the guardrails share: which run a call belongs to, and the calls in flight."""

    def __init__(self, guard: Guard, run_id: str | RunIdOf | None = None, *, agent_id: str | None = None,
                 tenant: str | None = None) -> None:
        self.guard = guard
        self.agent_id = agent_id
        self.tenant = tenant
        self._run_id = run_id
        self._pending: dict[tuple[str, str], tuple[GuardedRun, PendingCall, float]] = {}
        self._warned: set[str] = set()
        self._warned_handoff = False

    async def _begin(self, context: ToolContext[Any], tool: Any = None) -> tuple[GuardedRun, PendingCall]:
        """``GuardedRun.begin`` for this call (``RunHalted``, ``ToolPaused`` propagate); remembered until it
        ends unless it is a suppressed duplicate, which is already reported. ``tool``: the called tool, if
        known; an agent's ``as_tool`` makes the call a spawn."""
        run = self._guarded(context)
        w3c = _SDK_TRACE_ID.fullmatch(_sdk_trace_id() or "")
        ids = CallIds(tool_call_id=context.tool_call_id, trace_id=w3c.group(1) if w3c else None)
        args = _arguments(context.tool_arguments)
        sub_agent = _sub_agent(tool)
        child = None if sub_agent is None else _child_id(run.run_id, context.tool_call_id)
        spawn = None if sub_agent is None else Spawn(child_run_id=child, child_agent_id=sub_agent, task=_task(args))
        pending = await run.begin(context.tool_name, args, ids=ids, spawn=spawn)
        if pending.earlier is None:
            self._pending[run.run_id, context.tool_call_id] = (run, pending, time.perf_counter())
            if child is not None:
                _SPAWNED[context] = (_Child(child, run.run_id, run.root_run_id), self)
                _carry_lineage(tool)
        return run, pending

    def _guarded(self, context: RunContextWrapper[Any]) -> GuardedRun:
        """The guarded run of a call: the child run of the agent tool running this nested run, if any,
        else ``_run_of``'s. Raises ``TreeHalted`` for a new child of a halted tree."""
        child = _CHILD.get()
        if child is None:
            return self.guard.run(self._run_of(context), self.agent_id, self.tenant)
        return self.guard.run(child.run_id, self.agent_id, self.tenant, parent_run_id=child.parent_run_id,
                              root_run_id=child.root_run_id)

    async def _finish(self, context: ToolContext[Any], result: Any) -> GuardedRun | None:
        """Reports the call's end: its error if ``tool_failed`` saw one, else its result; its run (None: not begun here)."""
        error = _FAILED.pop(context, None)
        begun = self._pending.pop((self._run_of(context), context.tool_call_id), None)
        if begun is None:
            return None
        run, pending, started = begun
        await run.finish(pending, result, error=error, latency_ms=(time.perf_counter() - started) * 1000)
        return run

    def _run_of(self, context: RunContextWrapper[Any], required: bool = True) -> str:
        """The call's run id: ``run_id`` (or what it returns), else the group id (the tool's run config, or
        the trace's for a context without one), else the trace id; in a sub-agent's nested run, that
        child run. ``required=False``: "" if none."""
        child = _CHILD.get()
        if child is not None:
            return child.run_id
        if callable(self._run_id):
            return self._run_id(context)
        if isinstance(context, ToolContext):
            group_id = context.run_config.group_id if context.run_config else None
        else:
            trace = get_current_trace()
            group_id = getattr(trace, "group_id", None) if trace is not None else None
        run_id = self._run_id or group_id or _sdk_trace_id()
        if not run_id and not required:
            return ""
        if not run_id:
            raise InvalidCall(
                "loopwarden cannot tell which run this tool call belongs to: pass run_id=, or run with "
                "RunConfig(group_id=...), or leave tracing on"
            )
        return run_id


class LoopwardenRunHooks(_ToolCalls, RunHooks[Any]):
    """Guards every function tool call of the runs it hooks: ``Runner.run(agent, input, hooks=hooks)``.

    ``run_id``: the run's id, or a function of its context that returns it (default: its ``group_id``,
    else its trace id). ``agent_id``/``tenant``: what the guard's policy resolves these calls under.
    """

    async def on_tool_start(self, context: RunContextWrapper[Any], agent: Any, tool: Any) -> None:
        if not isinstance(context, ToolContext):  # computer and shell actions: no call id, no arguments
            return
        self._check_failures_reach_the_hooks(tool)
        try:
            run, pending = await self._begin(context, tool)
        except RunHalted as halted:
            raise _halted(halted) from None
        except ToolPaused as paused:
            raise _paused(paused) from None
        if pending.earlier is not None:
            raise DuplicateSuppressed(run.run_id, context.tool_name, "a run hook", "LoopwardenToolGuardrails")

    async def on_tool_end(self, context: RunContextWrapper[Any], agent: Any, tool: Any, result: Any) -> None:
        if isinstance(context, ToolContext):
            await self._finish(context, result)

    async def on_handoff(self, context: RunContextWrapper[Any], from_agent: Any, to_agent: Any) -> None:
        """Report the handoff that just happened as a handoff-class call to ``to_agent``; a halted run is
        stopped here (the handoff itself is done: the SDK calls this hook after it)."""
        run_id = self._run_of(context, required=False)
        if not run_id:
            if not self._warned_handoff:
                self._warned_handoff = True
                logger.warning(
                    "loopwarden: a handoff from %r to %r went unreported: its hook sees no RunConfig, so a run "
                    "named only by its group_id cannot be told while tracing is off. Fix: LoopwardenRunHooks("
                    "guard, run_id=...) (a string, or a function of the run context)",
                    from_agent.name, to_agent.name)
            return
        w3c = _SDK_TRACE_ID.fullmatch(_sdk_trace_id() or "")
        try:
            run = self._guarded(context)
            pending = await run.begin(_handoff_tool(from_agent, to_agent), tool_class="handoff", agent_id=from_agent.name,
                                      spawn=Spawn(child_agent_id=to_agent.name),
                                      ids=CallIds(trace_id=w3c.group(1) if w3c else None))
        except RunHalted as halted:
            raise _halted(halted) from None
        if pending.earlier is None:
            await run.finish(pending, {"assistant": to_agent.name})

    def _check_failures_reach_the_hooks(self, tool: Any) -> None:
        """Warn once per tool whose failures the SDK turns into messages the hooks cannot tell from a
        success: a loop of its failures would never halt."""
        if not isinstance(tool, FunctionTool) or tool.name in self._warned:
            return
        failure = resolve_function_tool_failure_error_function(tool)
        if failure is not None and failure is not tool_failed:
            self._warned.add(tool.name)
            logger.warning(
                "loopwarden: function tool %r has no failure_error_function=tool_failed: the SDK turns its "
                "exceptions into messages before LoopwardenRunHooks sees the call end, so its failures count as "
                "successes and a loop of them is never halted. Fix: @function_tool(failure_error_function="
                "tool_failed) (stream_app.integrations.openai_agents.tool_failed)", tool.name)


class LoopwardenToolGuardrails(_ToolCalls):
    """Guards the function tools it is attached to:
    ``function_tool(fn, tool_input_guardrails=[g.input], tool_output_guardrails=[g.output],
    failure_error_function=tool_failed)``. Arguments as for ``LoopwardenRunHooks``.
    """

    def __init__(self, guard: Guard, run_id: str | RunIdOf | None = None, *, agent_id: str | None = None,
                 tenant: str | None = None) -> None:
        super().__init__(guard, run_id, agent_id=agent_id, tenant=tenant)
        self.input: ToolInputGuardrail[Any] = ToolInputGuardrail(self._before, name="loopwarden")
        self.output: ToolOutputGuardrail[Any] = ToolOutputGuardrail(self._after, name="loopwarden")

    async def _before(self, data: ToolInputGuardrailData) -> ToolGuardrailFunctionOutput:
        try:
            _, pending = await self._begin(data.context, _tool_of(data.agent, data.context.tool_name))
        except RunHalted as halted:
            # The SDK's tripwire, raised here so that its message names the halt.
            raise GuardrailHalted(self.input, {**halted.decision, "run_id": halted.run_id}) from None
        except ToolPaused as paused:
            # Not a halt: the model is told the call was not made and when to retry, and the run goes on.
            return ToolGuardrailFunctionOutput.reject_content(
                f"{paused}. The call was not made.",
                output_info={"paused": paused.decision, "retry_after_s": paused.retry_after_s})
        if pending.earlier is None:
            return ToolGuardrailFunctionOutput.allow()
        try:
            earlier = str(pending.earlier.replay())
        except Exception as exc:  # noqa: BLE001 - the earlier call failed (any tool error): the model gets the same answer as then
            earlier = default_tool_error_function(data.context, exc)
        return ToolGuardrailFunctionOutput.reject_content(earlier, output_info={"suppressed": True})

    async def _after(self, data: ToolOutputGuardrailData) -> ToolGuardrailFunctionOutput:
        run = await self._finish(data.context, data.output)
        advice = run.take_advice() if run is not None else None
        if advice is None:
            return ToolGuardrailFunctionOutput.allow()
        # The model reads the warning with this call's output: the output, then loopwarden's note.
        return ToolGuardrailFunctionOutput.reject_content(f"{data.output}\n\n[loopwarden] {advice}",
                                                          output_info={"advice": advice})


def _arguments(raw: str) -> dict[str, Any]:
    """A function call's arguments: the JSON object the model sent, or what it sent under ``input``."""
    try:
        value = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        return {"input": raw}
    return value if isinstance(value, dict) else {"input": value}


def _sub_agent(tool: Any) -> str | None:
    """The name of the agent an ``agent.as_tool(...)`` tool runs, else None. The SDK marks such tools only
    with these two fields (what its run state reads, too)."""
    if not isinstance(tool, FunctionTool) or not getattr(tool, "_is_agent_tool", False):
        return None
    name = getattr(getattr(tool, "_agent_instance", None), "name", None)
    return name if isinstance(name, str) and name else None


def _child_id(run_id: str, call_id: str) -> str:
    """A sub-agent's run id: ``<run>/<call id>``, or a hash of it past the id length limit."""
    child = f"{run_id}/{call_id}"
    return child if len(child) <= MAX_ID_LENGTH else hashlib.sha256(child.encode()).hexdigest()


def _carry_lineage(tool: Any) -> None:
    """Wrap an agent tool's ``on_invoke_tool`` (once) so that the nested run it starts runs as the child
    run its guarded call named (``_CHILD``); a call no guard began leaves the lineage as it is. A halt
    that ends the nested run ends the agent-tool call too: it is reported failed with it (no hook sees
    its end), then raised on."""
    invoke: Callable[[ToolContext[Any], str], Awaitable[Any]] = tool.on_invoke_tool
    if getattr(invoke, "_loopwarden_lineage", False):
        return

    async def on_invoke_tool(context: ToolContext[Any], arguments: str) -> Any:
        spawned = _SPAWNED.pop(context, None)
        if spawned is None:
            return await invoke(context, arguments)
        child, calls = spawned
        token = _CHILD.set(child)
        try:
            return await invoke(context, arguments)
        except RunHalted as halted:
            error = halted
        finally:
            _CHILD.reset(token)
        _FAILED[context] = error
        await calls._finish(context, None)
        raise error

    on_invoke_tool._loopwarden_lineage = True  # type: ignore[attr-defined]
    tool.on_invoke_tool = on_invoke_tool


def _tool_of(agent: Any, name: str) -> Any:
    """The function tool ``name`` of ``agent``, or None (a guardrail is told the tool's name only)."""
    return next((t for t in getattr(agent, "tools", None) or () if isinstance(t, FunctionTool) and t.name == name),
                None)


def _task(args: dict[str, Any]) -> Any:
    """What an agent tool delegates: the ``input`` it was given (its default schema), else its arguments."""
    return args["input"] if set(args) == {"input"} else args


def _handoff_tool(from_agent: Any, to_agent: Any) -> str:
    """The name of the tool the model called to hand ``from_agent``'s run to ``to_agent``: its handoff's
    ``tool_name`` when ``from_agent`` lists one for it, else the SDK's default ``transfer_to_<agent>``."""
    for entry in getattr(from_agent, "handoffs", None) or ():
        if isinstance(entry, Handoff) and entry.agent_name == to_agent.name:
            return entry.tool_name
    return Handoff.default_tool_name(to_agent)


def _sdk_trace_id() -> str | None:
    """The SDK's id of the current trace; None while tracing is off (a no-op trace)."""
    trace = get_current_trace()
    trace_id = trace.trace_id if trace is not None else None
    return trace_id if trace_id and trace_id.startswith("trace_") else None
