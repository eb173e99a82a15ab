"""loopwarden in LangChain and LangGraph: an agent middleware for LangChain v1's ``create_agent``, and a
callback handler for any LangChain runnable (a LangGraph graph, a legacy agent, a bare tool).

Both report every tool call and refuse a halted run's next call before its tool runs, with ``RunHalted``;
the call that triggered the halt has already run and keeps its result. That is the same in-process,
where the halt is in force at once, and in fleet mode, where it arrives a few milliseconds after the
triggering call. ``RunHalted`` leaves ``invoke``: LangGraph's ``ToolNode`` re-raises every exception
but bad tool arguments, unless it was built with ``handle_tool_errors=True`` (or, for the callback
handler, which raises inside the tool call, a ``ToolErrorMiddleware`` answers every exception); then the
model is told of the halt, each further call is refused the same way, and the agent loops on until
LangGraph's recursion limit.

Prefer the middleware: it runs around each tool call, so a suppressed duplicate of a side-effecting
call is answered with the earlier result without running the tool, and the run goes on. A callback
cannot skip a tool, only raise: the handler refuses a suppressed duplicate with ``DuplicateSuppressed``,
which ends the run (the tool does not run twice).

Ids: the run is the LangGraph thread (``config["configurable"]["thread_id"]``), so an operator halts or
resumes a conversation by the id the application knows; a thread's calls share the run's iteration
ceiling. Without a thread, the run is the invocation: the callback handler uses the root run id (what
LangSmith calls the trace; ``config["run_id"]`` when the caller set it), the middleware that
``config["run_id"]``, else an id of its own. The model's tool call id goes to ``attrs.tool_call_id``. The
handler also maps the run tree onto W3C ids: the trace id is the root run's UUID in hex (as LangSmith's
OpenTelemetry export has it), span ids the last 8 bytes of the tool's and its parent's run UUIDs.
LangChain's run ids are UUIDv7, whose first 8 bytes (LangSmith's choice) repeat within a millisecond.

Sub-agents: an agent or graph that a tool call runs (agents as tools, a supervisor's workers, a ``task``
tool) is a sub-agent, so its tool calls go to a child run of the calling run, in its tree
(``parent_run_id``; ``root_run_id`` the outermost run, also when the nesting goes deeper): the tree rules
see it, and its calls do not count toward its caller's loops and ceiling. The child run is the tool
call's: the handler names it by the tool's LangChain run UUID, the middleware by an id of its own; a
thread id the sub-agent inherited from its caller's config does not name it. The tool call becomes a
spawn-class call as the sub-agent starts (``GuardedRun.spawned``: the child run, the call's arguments as
the task), so its tree learns of it before the sub-agent's first call: a spawn nesting too deep, one too
many, or the 3rd delegation of the same task halts the tree. A subgraph that is a node of its parent
graph (a supervisor's or a team's agents, ``graph.add_node("researcher", create_agent(...))``) is a
sub-agent too: each time the node runs, its calls go to a child run of the run outside it, named
``<run>/<the node's checkpoint namespace>`` (``t1/researcher:<task id>``; a subgraph in a subgraph one
level deeper, its parent the enclosing node's run), so ``tree_depth`` and ``tree_fanout`` see the graph's
nesting and how often its agents ran, and each agent's loops are its own. No call spawns such a node, so
there is no task to count toward ``tree_recursion``. A graph's own nodes and chains stay steps of its run:
flat use is one run, as before. The middleware sees a subgraph only under a thread (LangChain drops a
config's ``run_id`` inside a subgraph): without, each agent's invocation is a run of its own, as before.
A functional-API ``@task`` runs in its caller's graph: the handler, which sees each task start with its
``langgraph_path``, keeps a task's calls in the run of the node calling it (a workflow's tasks are steps
of the thread's run; a graph a task runs is a child run named by the task); the middleware sees no task,
so each node and task above an agent counts as a level (an agent a workflow's task runs is at depth 2,
under the handler at depth 1). The handler sees the
nesting through LangChain's parent run ids and LangGraph's checkpoint namespaces; the middleware through
the tool call it is running and the namespace, so both the calling agent and the sub-agent need a
``LoopwardenMiddleware``. A conversation's thread is the tree's root: a tree is forgotten after
``tree_ttl_ms`` (1 h) without a call, so a thread whose sub-agents ran more than ``max_tree_runs``
times within that is halted (``tree_fanout``); raise it for long supervisor conversations.

Handoffs: a call of a handoff tool (its metadata names ``__handoff_destination``: langgraph-swarm's and
langgraph-supervisor's ``create_handoff_tool``, ``transfer_to_<agent>`` returning ``Command(goto=agent,
graph=Command.PARENT)``) is a handoff-class call from the node handing over (``agent_id``: the node's name)
to the agent named (``child_agent_id``), and the node handed the conversation joins the run of the agent
that handed it over the next time it runs under the same run (``_Handoffs``, one per guard: each agent's
middleware and the handler see the same): peers hand one run back and forth instead of each activation
being a sub-agent, so ``handoff_loop`` sees A->B->A, and a successful call of another kind between resets
it, as in an OpenAI Agents run. A supervisor's workers it hands work to join its run too (their way back
is no handoff call: no round trip is counted).

A paused tool (``ToolPaused``: a storm on its upstream, or the run's own transient streak) is not a
halt: the middleware answers the call with an error ``ToolMessage`` saying when to retry, without
running the tool, and the run goes on; the handler cannot skip a tool, so its ``ToolPaused`` ends the
invocation, like a ``DuplicateSuppressed``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import hashlib
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from contextlib import contextmanager
from typing import Annotated, Any, NotRequired, TypeVar
from uuid import UUID

from langchain.agents.middleware import AgentMiddleware, AgentState, ToolCallRequest
from langchain.agents.middleware.types import PrivateStateAttr
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import ToolMessage
from langgraph.channels.untracked_value import UntrackedValue
from langgraph.errors import GraphBubbleUp
from langgraph.runtime import Runtime
from langgraph.types import Command

from ..client import (
    CallIds,
    DuplicateSuppressed,
    Guard,
    GuardedRun,
    PendingCall,
    RunHalted,
    Spawn,
    ToolOutcome,
    ToolPaused,
    UsageError,
)
from ..core.contract import MAX_ID_LENGTH

__all__ = ["DuplicateSuppressed", "LoopwardenCallbackHandler", "LoopwardenMiddleware"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
ToolResult = ToolMessage | Command[Any]


#: Invocations and halts remembered to notice repeats (bounded memory).
_REMEMBERED = 1_000
#: LangChain logs every exception a callback raises, at WARNING, however often the same halt is refused.
_CALLBACK_LOGGER = "langchain_core.callbacks.manager"


class _ToolCall:
    """The middleware's tool call in progress: its run, the call (a spawn once a sub-agent starts in
    it), and the id of the child run a sub-agent it runs gets."""

    __slots__ = ("child_run_id", "pending", "run")

    def __init__(self, run: GuardedRun, pending: PendingCall) -> None:
        self.run, self.pending, self.child_run_id = run, pending, str(uuid.uuid4())


#: The middleware's tool call in progress; a context variable, so that an agent the tool invokes (on this
#: thread or a task) sees it.
_TOOL_CALL: contextvars.ContextVar[_ToolCall | None] = contextvars.ContextVar("loopwarden_tool_call", default=None)


#: The tool metadata key naming the agent a handoff tool hands the conversation to (``create_handoff_tool`` of
#: langgraph-swarm and langgraph-supervisor: a ``transfer_to_<agent>`` tool returning
#: ``Command(goto=agent, graph=Command.PARENT)``).
_HANDOFF_DESTINATION = "__handoff_destination"


class _Handoffs:
    """Agent nodes handed the conversation: (the run outside the node, the node's name) -> the run of the
    agent that handed it over, which the node's next activation joins (a peer in one run, not a sub-agent).
    One per guard: each agent's middleware and the handler see the same."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: OrderedDict[tuple[str, str], str] = OrderedDict()

    def hand(self, parent_run_id: str, node: str, run_id: str) -> None:
        with self._lock:
            self._runs[parent_run_id, node] = run_id
            self._runs.move_to_end((parent_run_id, node))
            if len(self._runs) > _REMEMBERED:
                self._runs.popitem(last=False)

    def handed(self, parent_run_id: str, node: str) -> str | None:
        with self._lock:
            return self._runs.get((parent_run_id, node))


_HANDOFFS: weakref.WeakKeyDictionary[Guard, _Handoffs] = weakref.WeakKeyDictionary()
_HANDOFFS_LOCK = threading.Lock()


def _handoffs(guard: Guard) -> _Handoffs:
    with _HANDOFFS_LOCK:
        handoffs = _HANDOFFS.get(guard)
        if handoffs is None:
            handoffs = _HANDOFFS[guard] = _Handoffs()
        return handoffs


def _handoff(guard: Guard, run: GuardedRun, destination: Any, agent: str | None) -> dict[str, Any]:
    """``begin``'s arguments for a call of a handoff tool (``destination``: its metadata's, None for any other
    tool): a handoff-class call from ``agent`` (the node handing over) to the destination, which joins
    ``run`` when it next runs in the same graph (``_Handoffs``)."""
    if not isinstance(destination, str) or not destination:
        return {}
    if run.parent_run_id is not None:
        _handoffs(guard).hand(run.parent_run_id, destination, run.run_id)
    return {"tool_class": "handoff", "agent_id": agent, "spawn": Spawn(child_agent_id=destination)}


def _node(namespace: str) -> str:
    """The name of the node a checkpoint namespace ends in (``team:<task id>|alice:<task id>``: alice)."""
    return namespace.rsplit(_NS_SEP, 1)[-1].split(":", 1)[0]


class _OnceFilter(logging.Filter):
    """Lets LangChain's warning about a handler's ``RunHalted`` through once per decision: an agent loop
    under a catch-all error handler would repeat it every superstep until the recursion limit."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        halted = next((a for a in record.args or () if isinstance(a, str) and a.startswith("RunHalted(")), None) \
            if isinstance(record.args, tuple) else None
        if halted is None or not record.getMessage().startswith("Error in LoopwardenCallbackHandler."):
            return True
        if halted in self._seen:
            return False
        if len(self._seen) >= _REMEMBERED:
            self._seen.clear()
        self._seen.add(halted)
        return True


_ONCE = _OnceFilter()


def _warn_swallowed(where: str, fix: str, run_id: str) -> None:
    logger.warning("loopwarden: run %s was halted, and its RunHalted went back to the model instead of ending "
                   "the run: %s. The tool does not run again, but the agent loops on until LangGraph's recursion "
                   "limit. Fix: %s", run_id, where, fix)


class _Bridge:
    """Runs the guard's coroutines from LangChain's sync code, which LangGraph calls on worker threads.

    A guard belongs to one event loop. With ``loop`` (the loop a fleet guard was started on, which must
    keep running meanwhile) each coroutine runs there. Without, each runs on a private loop, one at a
    time: right for an in-process guard, whose calls never wait on anything.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` (sync guard work) where the guard's coroutines run: under the lock, or on ``loop``."""
        if self.loop is None:
            with self._lock:
                return fn()
        if _running_loop() is self.loop:
            return fn()

        async def on_loop() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(on_loop(), self.loop).result()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self.loop is None:
            with self._lock:
                if _running_loop() is None:
                    return asyncio.run(coroutine)
                # a sync call made where a loop runs (a notebook, a sync tool invoked in ``async def``):
                # asyncio.run cannot nest, so the guard's step runs on a thread of its own meanwhile
                with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="loopwarden") as step:
                    return step.submit(asyncio.run, coroutine).result()
        if _running_loop() is self.loop:
            coroutine.close()
            raise UsageError(
                "loopwarden: a sync LangChain call on the guard's own event loop would block it; call the "
                "agent with ainvoke/astream there, or invoke it from another thread"
            )
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()


class LoopwardenCallbackHandler(BaseCallbackHandler):
    """Guards the tool calls of any runnable it is a callback of:
    ``agent.invoke(inputs, {"callbacks": [LoopwardenCallbackHandler(guard)]})``.

    ``agent_id``/``tenant``: what the guard's policy resolves these calls under. ``loop``: the event
    loop a fleet guard runs on (needed for a fleet guard, under ``invoke`` and ``ainvoke`` alike:
    LangChain runs a sync handler off the loop); leave it None for an in-process guard.
    """

    # LangChain logs and swallows a handler's exception unless this is set: a halt must stop the run.
    raise_error = True

    def __init__(
        self,
        guard: Guard,
        *,
        agent_id: str | None = None,
        tenant: str | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.guard = guard
        self.agent_id = agent_id
        self.tenant = tenant
        self._bridge = _Bridge(loop)
        self._roots: dict[UUID, UUID] = {}  # run id of each chain and tool in flight -> its root run id
        #: Chains in flight inside a tool call (a sub-agent) -> (their child run's id, its parent run's id).
        self._children: dict[UUID, tuple[str, str]] = {}
        self._pending: dict[UUID, tuple[GuardedRun, PendingCall, float]] = {}
        self._refused: set[UUID] = set()  # invocations (root runs) in which a call was refused
        #: Chains in flight that are (or run inside) a functional-API ``@task`` call -> the task's checkpoint
        #: namespace: a task runs in its caller's graph, so the node calling it holds no subgraph.
        self._tasks: dict[UUID, str] = {}
        self._warned = False
        if _ONCE not in logging.getLogger(_CALLBACK_LOGGER).filters:
            logging.getLogger(_CALLBACK_LOGGER).addFilter(_ONCE)

    def on_chain_start(
        self, serialized: dict[str, Any] | None, inputs: Any, *, run_id: UUID,
        parent_run_id: UUID | None = None, **kwargs: Any,
    ) -> None:
        self._roots[run_id] = self._roots.get(parent_run_id, parent_run_id) if parent_run_id else run_id
        metadata = kwargs.get("metadata")
        if metadata and _is_task_call(metadata.get("langgraph_path")):
            self._tasks[run_id] = metadata.get("langgraph_checkpoint_ns")
        if parent_run_id is None:
            return
        calling = self._pending.get(parent_run_id)
        if calling is not None:  # run by a tool call: a sub-agent, in a child run of the calling run
            self._children[run_id] = (str(parent_run_id), calling[0].run_id)
            run, pending, started = calling
            spawn = Spawn(child_run_id=str(parent_run_id), task=pending.args)
            self._pending[parent_run_id] = (run, self._bridge.call(lambda: run.spawned(pending, spawn)), started)
        elif parent_run_id in self._children:
            self._children[run_id] = self._children[parent_run_id]

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._ended(run_id)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._ended(run_id)

    def _ended(self, run_id: UUID) -> None:
        self._roots.pop(run_id, None)
        self._children.pop(run_id, None)
        self._tasks.pop(run_id, None)
        self._refused.discard(run_id)

    def on_tool_start(
        self,
        serialized: dict[str, Any],
        input_str: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        inputs: dict[str, Any] | None = None,
        tool_call_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        root = self._roots.get(parent_run_id, parent_run_id) if parent_run_id else run_id
        child = self._children.get(parent_run_id) if parent_run_id else None
        thread_id = (metadata or {}).get("thread_id")
        ids = CallIds(
            tool_call_id=tool_call_id,
            trace_id=root.hex,
            span_id=_span_id(run_id),
            parent_span_id=_span_id(parent_run_id) if parent_run_id else None,
        )
        tool = serialized["name"]
        run_name = child[0] if child is not None else str(thread_id or root)
        namespace = (metadata or {}).get("langgraph_checkpoint_ns")
        holders = self._holders(namespace, (metadata or {}).get("langgraph_path")) \
            if isinstance(namespace, str) and child is None else []
        try:
            if child is not None:
                run = self.guard.run(child[0], self.agent_id, self.tenant, parent_run_id=child[1])
            elif holders:  # in a subgraph: a sub-agent
                subgraph = _subgraph_run(self.guard, run_name, holders, self.agent_id, self.tenant, self.agent_id)
                assert subgraph is not None
                run, run_name = subgraph, subgraph.run_id
            else:
                run = self.guard.run(run_name, self.agent_id, self.tenant)
            agent = _node(holders[-1]) if holders else (metadata or {}).get("lc_agent_name") or self.agent_id
            handoff = _handoff(self.guard, run, (metadata or {}).get(_HANDOFF_DESTINATION), agent)
            pending = self._bridge.run(run.begin(tool, _args(inputs, input_str), ids=ids, **handoff))
        except RunHalted:
            if root in self._refused and not self._warned:
                self._warned = True
                _warn_swallowed("a tool error handler catches every exception (ToolNode(handle_tool_errors=True), "
                                "ToolErrorMiddleware answering all) and hands it to the model",
                                "let RunHalted through (handle_tool_errors=(ToolException,)), or guard with "
                                "LoopwardenMiddleware listed first", run_name)
            self._refused.add(root)
            raise
        if pending.earlier is not None:
            raise DuplicateSuppressed(run.run_id, tool, "a callback handler", "LoopwardenMiddleware")
        self._pending[run_id] = (run, pending, time.perf_counter())
        self._roots[run_id] = root  # for the chains the tool runs

    def _holders(self, namespace: str, path: Any) -> list[str]:
        """The namespaces of the nodes holding the subgraphs a tool call with checkpoint ``namespace``
        runs in, outermost first: each node but the last (the call's own task), unless the task below it
        is a functional-API ``@task`` call (the call's own from its ``langgraph_path``; an enclosing one's
        from the chains in flight), which runs in its caller's graph."""
        prefixes = _prefixes(namespace)
        if len(prefixes) < 2:
            return []
        tasks = set(self._tasks.copy().values())  # copy: atomic while other threads start and end chains
        if _is_task_call(path):
            tasks.add(namespace)
        return [prefix for prefix, below in itertools.pairwise(prefixes) if below not in tasks]

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._roots.pop(run_id, None)
        begun = self._pending.pop(run_id, None)
        if begun is not None:
            run, pending, started = begun
            self._bridge.run(run.finish(pending, _reported(output), latency_ms=_ms_since(started)))

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._roots.pop(run_id, None)
        begun = self._pending.pop(run_id, None)
        # An interrupt (GraphBubbleUp) pauses the call, which runs again on resume; it did not fail.
        if begun is not None and isinstance(error, Exception) and not isinstance(error, GraphBubbleUp):
            run, pending, started = begun
            self._bridge.run(run.finish(pending, error=error, latency_ms=_ms_since(started)))


class _GuardedState(AgentState[Any]):
    """The agent state plus the run id, chosen once per invocation (not checkpointed, not in the output)."""

    loopwarden_run_id: NotRequired[Annotated[str, UntrackedValue, PrivateStateAttr]]
    #: The run of the tool call that runs this agent, when it is a sub-agent (its run is a child of that one).
    loopwarden_parent_run_id: NotRequired[Annotated[str, UntrackedValue, PrivateStateAttr]]
    #: This invocation's id: a second refusal within one invocation means a RunHalted was swallowed.
    loopwarden_invocation: NotRequired[Annotated[str, UntrackedValue, PrivateStateAttr]]
    #: The graph node this agent is (a node of a parent graph): the agent its handoffs come from.
    loopwarden_agent: NotRequired[Annotated[str, UntrackedValue, PrivateStateAttr]]


class LoopwardenMiddleware(AgentMiddleware[_GuardedState, Any]):
    """Guards an agent's tool calls: ``create_agent(model, tools, middleware=[LoopwardenMiddleware(guard)])``.

    List it first, outermost, so it sees each call's final outcome (after ``ToolErrorMiddleware``,
    ``ToolRetryMiddleware``...) and its ``RunHalted`` reaches the caller untouched. ``agent_id``/``tenant``:
    what the guard's policy resolves these calls under. ``loop``: the event loop a fleet guard runs on,
    needed only when the agent is called with sync ``invoke``.
    """

    state_schema = _GuardedState

    def __init__(
        self,
        guard: Guard,
        *,
        agent_id: str | None = None,
        tenant: str | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__()
        self.guard = guard
        self.agent_id = agent_id
        self.tenant = tenant
        self._bridge = _Bridge(loop)
        self._refused: OrderedDict[str, None] = OrderedDict()  # recent invocations with a refused call
        self._warned = False

    def before_agent(self, state: _GuardedState, runtime: Runtime[Any]) -> dict[str, Any]:
        invocation = uuid.uuid4().hex
        calling = _TOOL_CALL.get()
        if calling is not None:  # run by a guarded agent's tool call: a sub-agent, in a child run of that run
            run, pending = calling.run, calling.pending
            spawn = Spawn(child_run_id=calling.child_run_id, task=pending.args)
            calling.pending = self._bridge.call(lambda: run.spawned(pending, spawn))
            return {"loopwarden_run_id": calling.child_run_id, "loopwarden_parent_run_id": run.run_id,
                    "loopwarden_invocation": invocation}
        info = runtime.execution_info
        run_id = (info.thread_id or info.run_id) if info is not None else None
        if info is not None and run_id and _NS_SEP in info.checkpoint_ns:  # a node of a parent graph: a sub-agent
            holders = _prefixes(info.checkpoint_ns)[:-1]  # every node above the agent's own
            subgraph = _subgraph_run(self.guard, str(run_id), holders, self.agent_id, self.tenant)
            assert subgraph is not None and subgraph.parent_run_id is not None
            return {"loopwarden_run_id": subgraph.run_id, "loopwarden_parent_run_id": subgraph.parent_run_id,
                    "loopwarden_invocation": invocation, "loopwarden_agent": _node(holders[-1])}
        return {"loopwarden_run_id": str(run_id or uuid.uuid4()), "loopwarden_invocation": invocation}

    def wrap_tool_call(
        self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], ToolResult]
    ) -> ToolResult:
        tool, args, ids = _call(request)
        with self._noticing_swallowed_halts(request):
            run = self._run(request)
            try:
                pending = self._bridge.run(run.begin(tool, args, ids=ids, **self._handoff(request, run)))
            except ToolPaused as paused:
                return _paused(request, paused)
        if pending.earlier is not None:
            return _replayed(request, pending)
        started = time.perf_counter()
        calling = _ToolCall(run, pending)
        token = _TOOL_CALL.set(calling)
        try:
            result = handler(request)
        except GraphBubbleUp:
            raise  # an interrupt pauses the call, which runs again on resume; it did not fail
        except Exception as exc:
            self._bridge.run(run.finish(calling.pending, error=exc, latency_ms=_ms_since(started)))
            raise
        finally:
            _TOOL_CALL.reset(token)
        self._bridge.run(run.finish(calling.pending, _reported(result), latency_ms=_ms_since(started)))
        return _advised(result, run.take_advice())

    async def awrap_tool_call(
        self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], Awaitable[ToolResult]]
    ) -> ToolResult:
        tool, args, ids = _call(request)
        with self._noticing_swallowed_halts(request):
            run = self._run(request)
            try:
                pending = await run.begin(tool, args, ids=ids, **self._handoff(request, run))
            except ToolPaused as paused:
                return _paused(request, paused)
        if pending.earlier is not None:
            return _replayed(request, pending)
        started = time.perf_counter()
        calling = _ToolCall(run, pending)
        token = _TOOL_CALL.set(calling)
        try:
            result = await handler(request)
        except GraphBubbleUp:
            raise
        except Exception as exc:
            await run.finish(calling.pending, error=exc, latency_ms=_ms_since(started))
            raise
        finally:
            _TOOL_CALL.reset(token)
        await run.finish(calling.pending, _reported(result), latency_ms=_ms_since(started))
        return _advised(result, run.take_advice())

    @contextmanager
    def _noticing_swallowed_halts(self, request: ToolCallRequest) -> Iterator[None]:
        """A second refusal in one invocation: the first RunHalted did not end it, so a middleware listed
        before this one (outside it) turned it into a message; warn once, with the fix."""
        try:
            yield
        except RunHalted as halted:
            invocation = str(request.state.get("loopwarden_invocation", ""))
            if invocation in self._refused and not self._warned:
                self._warned = True
                _warn_swallowed("a middleware listed before LoopwardenMiddleware (outside it) catches tool errors "
                                "(ToolErrorMiddleware, ToolRetryMiddleware...)",
                                "list LoopwardenMiddleware first: create_agent(..., middleware=[LoopwardenMiddleware("
                                "guard), ...])", halted.run_id)
            self._refused[invocation] = None
            if len(self._refused) > _REMEMBERED:
                self._refused.popitem(last=False)
            raise

    def _handoff(self, request: ToolCallRequest, run: GuardedRun) -> dict[str, Any]:
        """``begin``'s arguments for a handoff tool's call (none for another tool's)."""
        destination = (getattr(request.tool, "metadata", None) or {}).get(_HANDOFF_DESTINATION)
        return _handoff(self.guard, run, destination, request.state.get("loopwarden_agent") or self.agent_id)

    def _run(self, request: ToolCallRequest) -> GuardedRun:
        """The call's run; a sub-agent's is started as a child of its caller's (``TreeHalted`` if that
        tree is halted)."""
        state = request.state
        return self.guard.run(state["loopwarden_run_id"], self.agent_id, self.tenant,
                              parent_run_id=state.get("loopwarden_parent_run_id"))


#: LangGraph's checkpoint namespace separator: a task's namespace lists the nodes it runs in, outermost
#: first (``team:<task id>|worker:<task id>|tools:<task id>``).
_NS_SEP = "|"


def _subgraph_run(guard: Guard, base: str, holders: list[str], agent_id: str | None, tenant: str | None,
                  enclosing_agent_id: str | None = None) -> GuardedRun | None:
    """The run of the subgraph a task runs in, from the checkpoint namespaces of the nodes holding its
    enclosing subgraphs (outermost first; for a task of a graph's node: each node of its namespace but
    its own): each is a child run of the run outside it (the outermost's parent: ``base``, the graph's
    run), named ``<base>/<that node's namespace>``; None at the top level. ``TreeHalted`` if that tree is
    halted. The enclosing graphs' runs are guarded as ``enclosing_agent_id``'s (the handler's one agent: a
    run that is one task's enclosing graph and another's own is then the same agent's; the middleware's
    agents are no graph's enclosing one). A node another agent of its graph handed the conversation to (a
    handoff tool: ``_Handoffs``) joins that agent's run instead: peers hand one run back and forth, so
    ``handoff_loop`` sees A->B->A (LangGraph swarms), and their calls are one run's, as an OpenAI Agents
    run's handoffs are."""
    run, parent = None, base
    handoffs = _handoffs(guard)
    for depth, holder in enumerate(holders, 1):
        run_id = handoffs.handed(parent, _node(holder)) or _subgraph_id(base, holder)
        run = guard.run(run_id, agent_id if depth == len(holders) else enclosing_agent_id, tenant,
                        parent_run_id=parent)
        parent = run.run_id
    return run


def _prefixes(namespace: str) -> list[str]:
    """A checkpoint namespace down to each of its nodes, outermost first (the last is itself)."""
    return list(itertools.accumulate(namespace.split(_NS_SEP), lambda a, b: a + _NS_SEP + b))


def _is_task_call(path: Any) -> bool:
    """Whether a ``langgraph_path`` is a functional-API ``@task`` call's: ``("__pregel_push", the
    caller's path, index, True)``; a ``Send``'s ends in False (LangGraph's own ``graph_namespace`` in
    ``pregel/_messages.py`` reads it so)."""
    return type(path) is tuple and len(path) == 4 and path[0] == "__pregel_push" and path[3] is True


def _subgraph_id(base: str, namespace: str) -> str:
    """``<base>/<namespace>``, or a digest of it when that is longer than a run id may be."""
    run_id = f"{base}/{namespace}"
    if len(run_id) <= MAX_ID_LENGTH:
        return run_id
    return f"subgraph-{hashlib.blake2b(run_id.encode(), digest_size=16).hexdigest()}"


def _call(request: ToolCallRequest) -> tuple[str, dict[str, Any], CallIds]:
    call = request.tool_call
    return call["name"], dict(call["args"]), CallIds(tool_call_id=call["id"])


def _args(inputs: Mapping[str, Any] | None, input_str: str) -> dict[str, Any]:
    """A tool's arguments as the callback sees them: a dict, or the bare string a tool was given."""
    return dict(inputs) if inputs is not None else {"input": input_str}


def _reported(output: Any) -> Any:
    """What a tool's output reports: a ``ToolMessage``'s content, failing if its status is ``error``
    (a ``ToolException`` a tool handles, an error ``ToolErrorMiddleware`` turned into a message)."""
    if isinstance(output, ToolMessage):
        return ToolOutcome("error", output.content) if output.status == "error" else output.content
    return output


def _advised(result: ToolResult, advice: str | None) -> ToolResult:
    """The tool's message with loopwarden's warning appended, so the model reads it with the result it
    is about (a ``Command`` result is returned as it is)."""
    if advice is None or not isinstance(result, ToolMessage) or not isinstance(result.content, str):
        return result
    return result.model_copy(update={"content": f"{result.content}\n\n[loopwarden] {advice}"})


def _paused(request: ToolCallRequest, paused: ToolPaused) -> ToolMessage:
    """The answer to a paused tool's call, which did not run: the model reads when to retry."""
    return ToolMessage(content=f"{paused}. The call was not made.", name=request.tool_call["name"],
                       tool_call_id=request.tool_call["id"], status="error")


def _replayed(request: ToolCallRequest, pending: PendingCall) -> ToolMessage:
    """The earlier answer to a suppressed duplicate, as the answer to this tool call."""
    assert pending.earlier is not None
    return ToolMessage(
        content=pending.earlier.replay(),
        name=request.tool_call["name"],
        tool_call_id=request.tool_call["id"],
        status="error" if pending.earlier.outcome == "error" else "success",
    )


def _span_id(run_id: UUID) -> str:
    return run_id.bytes[8:].hex()  # a UUIDv7's counter and random bits; its first 8 are mostly time


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
