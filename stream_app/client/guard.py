"""The guard: what agent code calls its tools through.

``GuardedRun.call`` refuses a halted run's call before it runs (``RunHalted``), hands back the earlier
result for a suppressed duplicate of a side-effecting call instead of acting again, and otherwise runs
the tool, classifies its outcome and reports it as telemetry.

Local first, fleet-wide authority. The per-run rules (recursion, semantic loops, cycles, the ceiling,
duplicate side effects) are folded *here*, through the same core the workers run, on exactly the
telemetry this process publishes (``_LocalRules``): a halt decided on one call is in force before the
next, and a duplicate side effect is answered before it runs, at any call rate. The fleet
(``Guard.fleet``) gets the same telemetry, folds the same sequence into the same decisions with the same
ids (each applied once here: ``confirmed``), and decides what only it can see: operators' halts and
resumes, runs this process saw only part of (``fleet_only``). A fleet halt halts the local state too; a
fleet resume lifts the local halt and resets the local streaks, as the worker does.

- ``Guard.in_process()``: local rules only, no Kafka. For one process, tests and notebooks.
- ``Guard.fleet(config)``: local rules (``local_rules=True``, the default, or per run with
  ``guard.run(..., local_rules=False)`` for a run whose calls are published by several processes, which
  each see only part of it) plus telemetry to Kafka and the workers' decisions from the control topic.

A duplicate side effect is the one repetition that must be stopped *before* it happens: the guard asks
the local fold first, on a scratch copy of the run's state, whether repeating a remembered
side-effecting call would be suppressed or halted; only then is the repetition recorded and the earlier
result handed back. Without local rules the fleet's ``suppress`` arrives after the repetition ran.

A halt that arrives while a bound task (``bind_task``, ``bound()``) awaits a tool cancels the tool's
await, and the call raises ``RunHalted`` in its place, so ``except RunHalted`` sees every halt.

Sub-agent trees: ``guard.run(child_id, parent_run_id=...)`` (or ``run.child(child_id)``) starts a run in
its parent's tree; every event of a run carries its tree's ``root_run_id`` (a root names itself), a
child's also its parent and depth, and a spawn-class call (``spawn=Spawn(...)``) the child it starts and
the hash of its task. The tree rules (``core/fleet/trees.py``) fold here too, for the runs this process
sees; a tree halt (this fold's or the fleet's) refuses every call of the tree's runs and every new
child, with ``TreeHalted`` (a ``RunHalted``).

Threads: ``guard.run(run_id, thread_key=..., trigger=..., caused_by_run_id=...)`` says which thread (a
PR, an issue, a channel) the run works on and what started it; every event carries it. The thread rules
(``core/fleet/threads.py``) fold here too; a thread halt refuses new runs on the thread at
``Guard.run`` with ``ThreadHalted`` (a ``RunHalted``), and lets the runs going on finish.

Storms: ``run.call(tool, fn, args, upstream="api.example.com")`` names the host or MCP server the tool
calls; a failure is classed from the exception (``error_class``: ``http_<status>`` from a
``status_code``, ``timeout``, ``connection``, else the exception's type) with the wait it asked for
(``retry_after_ms`` from a ``Retry-After``). When the tool of that upstream is paused for the run's
tenant (a storm: the fleet's ``tool_storm``, or this process's fold), the call is not made and raises
``ToolPaused`` with ``retry_after_s``; once the pause's wait is over the guard lets one call per wait
through (0-20% jitter), and the ``resume`` that follows a success lifts the pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import random
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, Final

from ..bus.clock import wall_clock_ms
from ..bus.kafka import KafkaClientConfig
from ..bus.signing import WORKER_KEYS_VAR, KeyRing
from ..core import (
    OUTCOMES,
    Detector,
    Outcome,
    Policy,
    RunTable,
    decode_event,
)
from ..core.contract import MAX_ID_LENGTH, MAX_RETRY_BUDGET, TOOL_CLASSES, TRIGGERS
from ..core.fleet import (
    ThreadFold,
    ToolFold,
    TreeFact,
    TreeFold,
    root_cost,
    root_spent,
    thread_fact,
    tool_fact,
    tree_fact,
)
from .errors import InvalidCall, RunHalted, ThreadHalted, ToolPaused, TreeHalted, UsageError
from .lifecycle import StartStop
from .listener import ControlBoard, DecisionCallback, HaltListener, read_scopes
from .publisher import (
    DEFAULT_REDACTED_FIELDS,
    UNHASHABLE,
    FinishedCall,
    TelemetryBuilder,
    TelemetryPublisher,
)

logger = logging.getLogger(__name__)

#: Run handles kept, most recently used last: ``guard.run(id).call(...)`` needs no reference held.
_MAX_RUNS: Final = 10_000
#: Outcomes of side-effecting calls remembered per run (to hand back); the least recently used go first.
_REMEMBERED_PER_RUN: Final = 64
_EMPTY_TYPES: Final = (str, bytes, list, tuple, dict, set, frozenset)


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """Returned by a tool to state its outcome explicitly, e.g. ``ToolOutcome("noop", result)`` for a
    call that changed nothing, or a write's after-state (``state_hash``: the target's content hash after
    it, so that edits undone and redone, and writes that change nothing, are seen). The caller of
    ``GuardedRun.call`` receives ``result``."""

    outcome: Outcome
    result: Any = None
    state_hash: str | None = None

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise InvalidCall(f"outcome must be one of {', '.join(sorted(OUTCOMES))}; got {self.outcome!r}")


@dataclass(frozen=True, slots=True)
class CallIds:
    """A framework's ids of one tool call, carried into its telemetry so a halt can be traced back to the
    framework's own records: W3C ``trace_id``/``span_id``/``parent_span_id`` (hex), and the framework's
    id of the call (``attrs.tool_call_id``: an OpenAI/Anthropic tool-call id, a JSON-RPC request id)."""

    tool_call_id: str | None = None
    trace_id: str | None = None
    span_id: str | None = None
    parent_span_id: str | None = None


_NO_IDS: Final = CallIds()


@dataclass(frozen=True, slots=True)
class Spawn:
    """What a spawn-class call starts: the child's run id and agent, and the task delegated to it
    (``task``: the raw task, hashed here like arguments; or its ``task_hash``). Passing it makes the call
    spawn-class. Start the child with ``run.child(child_run_id)`` to put it in this run's tree."""

    child_run_id: str | None = None
    child_agent_id: str | None = None
    task: Any = None
    task_hash: str | None = None

    def __post_init__(self) -> None:
        for name in ("child_run_id", "child_agent_id", "task_hash"):
            _check_id(f"spawn.{name}", getattr(self, name))


@dataclass(slots=True)
class _Earlier:
    """A call's last outcome: what its caller got (value or exception) and what was reported."""

    outcome: Outcome
    value: Any
    error: Exception | None
    body: Any
    error_class: str | None
    expires_ms: int
    state_hash: str | None = None
    tokens: int | float | None = None
    cost_usd: int | float | None = None
    #: The wait the upstream asked for (``Retry-After``), in ms.
    retry_after_ms: int | None = None

    def replay(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _LocalRules:
    """The per-run rules, folded in this process over the telemetry it publishes."""

    def __init__(self, policy: Policy, board: ControlBoard) -> None:
        #: One guard may serve runs on several threads (a framework's tool threads, a server's workers):
        #: its folds are shared, so each step takes this lock (re-entered by ``follow``, which the board
        #: calls back from a decision a fold applies).
        self.lock = threading.RLock()
        self.table = RunTable(Detector(policy))
        self.trees = TreeFold(policy.fleet)
        self.threads = ThreadFold(policy.fleet)
        self.tools = ToolFold(policy.fleet)
        self.policy = policy
        self.board = board
        #: Spawn events whose tree fact was folded as they began, by event id (the most recent).
        self._begun_spawns: OrderedDict[str, bool] = OrderedDict()
        #: Roots whose first spawn began before their run had a state: spawned from their first event on.
        self._spawning: OrderedDict[str, None] = OrderedDict()
        board.follow_fleet(self.follow)

    def fold(self, event: dict[str, Any]) -> None:
        with self.lock:
            self._fold(event)

    def _fold(self, event: dict[str, Any]) -> None:
        decoded = decode_event(event)
        state = self.table.get(decoded.run_id)
        spent = None if state is None else root_spent(state)
        evaluation = self.table.observe(decoded)
        for decision in evaluation.decisions:
            self.board.apply(decision.to_control(), source="local")
        state = self.table.get(decoded.run_id)
        if self._spawning and state is not None and decoded.run_id in self._spawning:
            # its first spawn began before its first event (bringing nothing): a spawner from that event on
            del self._spawning[decoded.run_id]
            state.spawned = True
            spent = 0 if spent is None else spent
        if not evaluation.duplicate:
            tool_class = decoded.tool_class or self.policy.resolve(decoded.agent_id, decoded.tool).thresholds.tool_class
            fact = tree_fact(decoded, tool_class, root_cost(spent, None if state is None else root_spent(state)))
            if fact is not None and self._begun_spawns.pop(decoded.event_id, False):
                # Folded as the spawn began (a root's spend until then with it); what the call cost is
                # known only now.
                fact = fact._replace(spawn=False, child_run_id=None, child_agent_id=None,
                                     task_hash=None) if fact.cost_micro else None
            if fact is not None:
                self._observe_tree(fact)
            thread = thread_fact(decoded)
            if thread is not None:
                for thread_decision in self.threads.observe(thread):
                    self.board.apply(thread_decision.to_control(), source="local")
            tool = tool_fact(decoded)
            if tool is not None:
                for tool_decision in self.tools.observe(tool):
                    self.board.apply(tool_decision.to_control(), source="local")

    def spawn_begins(self, run_id: str, tenant: str | None, spec: _CallSpec, ts_ms: int) -> None:
        """Fold the tree fact of a spawn-class call as it begins, as ``tree_fact`` gives it for the event
        the call will report (at no cost yet); that event (same id) then adds only its cost."""
        with self.lock:
            self._spawn_begins(run_id, tenant, spec, ts_ms)

    def _spawn_begins(self, run_id: str, tenant: str | None, spec: _CallSpec, ts_ms: int) -> None:
        tool_class = spec.tool_class or self.policy.resolve(spec.agent_id, spec.tool).thresholds.tool_class
        if tool_class != "spawn" or spec.event_id is None:
            return
        fields = spec.fleet or {}
        self._begun_spawns[spec.event_id] = True
        if len(self._begun_spawns) > _MAX_RUNS:
            self._begun_spawns.popitem(last=False)
        root = fields.get("root_run_id") or run_id
        cost = 0
        if root == run_id:
            # A root's first spawn brings what its run spent before it (``root_cost``), and from then on the
            # run is a spawner: its calls while the spawn runs add their own cost, and a spawn begun
            # meanwhile (another in parallel, this one again after a cancel) brings nothing more.
            state = self.table.get(run_id)
            if state is None:
                self._spawning[run_id] = None
                if len(self._spawning) > _MAX_RUNS:
                    self._spawning.popitem(last=False)
            elif not state.spawned:
                cost, state.spawned = state.cost_micro, True
        self._observe_tree(TreeFact(
            root, run_id, spec.event_id, ts_ms, fields.get("parent_run_id"), fields.get("depth"),
            cost, True, fields.get("child_run_id"),
            fields.get("child_agent_id"), fields.get("task_hash"), tenant))

    def _observe_tree(self, fact: TreeFact) -> None:
        for tree_decision in self.trees.observe(fact):
            self.board.apply(tree_decision.to_control(), source="local")

    def would_stop(self, event: dict[str, Any]) -> bool:
        """Whether recording ``event`` would suppress or halt, judged on a scratch copy of the run."""
        with self.lock:
            state = self.table.get(event["run_id"])
            if state is None:
                return False
            decisions = self.table.detector.evaluate(state.copy(), decode_event(event)).decisions
        return any(d.action in ("suppress", "halt") for d in decisions)

    def follow(self, message: dict[str, Any]) -> None:
        """A fleet decision this fold did not make: the run's state follows it as the worker's does."""
        if message.get("scope", "run") != "run":
            return  # a tree's halt lives on the board, not in the runs' states
        with self.lock:
            if message["action"] == "halt":
                self.table.halt(message["run_id"], message["decision_id"])
            elif message["action"] == "resume":
                self.table.resume(message["run_id"])


class _FleetLink:
    """Fleet mode: telemetry to Kafka, the workers' decisions from the control topic."""

    def __init__(self, publisher: TelemetryPublisher, listener: HaltListener, scopes_topic: str = "",
                 allow_unsigned: bool = False) -> None:
        self.publisher = publisher
        self.listener = listener
        #: The workers' scopes topic, read once at start (the scope halts and pauses in force); empty: not read.
        self.scopes_topic = scopes_topic
        self.allow_unsigned = allow_unsigned

    @property
    def counters(self) -> dict[str, int]:
        return {"published": self.publisher.published, "publish_failed": self.publisher.failed}

    def ready(self) -> bool:
        return self.publisher.started

    async def start(self) -> None:
        await self.publisher.start()
        try:
            await self.listener.start()
            if self.scopes_topic:
                await read_scopes(self.listener.config, self.scopes_topic, self.listener.board,
                                  trusted_keys=self.listener.trusted_keys, allow_unsigned=self.allow_unsigned)
        except BaseException:
            await self.listener.stop()
            await self.publisher.stop()
            raise

    async def stop(self) -> None:
        try:
            await self.listener.stop()
        finally:
            await self.publisher.stop()

    async def record(self, event: dict[str, Any]) -> None:
        try:
            await self.publisher.publish(event)
        except Exception:
            # Telemetry trouble must not fail the agent's tool call; it is counted and logged instead.
            self.publisher.failed += 1
            logger.warning(
                "telemetry for run %s not queued",
                event["run_id"],
                exc_info=True,
                extra={"run_id": event["run_id"]},
            )



class Guard(StartStop):
    """One per runtime process: hands out ``GuardedRun``s and holds what they share. Build it with
    ``Guard.in_process()`` or ``Guard.fleet(config)``."""

    def __init__(
        self,
        builder: TelemetryBuilder,
        board: ControlBoard,
        local: _LocalRules | None,
        fleet: _FleetLink | None,
        clock: Callable[[], int] = wall_clock_ms,
    ) -> None:
        if local is None and fleet is None:
            raise InvalidCall("a guard needs local rules, the fleet, or both")
        self.builder = builder
        self.board = board
        self.clock = clock
        self._local = local
        self._fleet = fleet
        self._runs: OrderedDict[str, GuardedRun] = OrderedDict()
        self._runs_lock = threading.RLock()
        #: (tenant, tool, upstream, pause decision id) -> when the next call may go through (half-open).
        self._probes: OrderedDict[tuple[str, str, str, str], int] = OrderedDict()
        self._jitter = random.Random()

    def admit(self, tenant: str | None, tool: str, upstream: str, run_id: str) -> None:
        """Raise ``ToolPaused`` unless a call of ``tool`` to ``upstream`` may go through: none is paused
        for ``tenant``, or the pause's wait is over and no other call went through in this wait (one per
        wait, 0-20% jitter, the first probe's too, so runtimes do not probe in step)."""
        pause = self.board.tool_pause(tenant, tool, upstream)
        if pause is None:
            return
        if pause.get("verdict") == "operator_halt":  # an operator's pause: nothing goes through until resumed
            raise ToolPaused(pause, run_id, tool, upstream, 60.0)
        wait = pause.get("evidence", {}).get("wait_ms")
        wait_ms = wait if type(wait) is int and wait > 0 else 60_000
        key = (tenant or "", tool, upstream, str(pause.get("decision_id")))
        now = self.clock()
        next_ms = self._probes.get(key)
        if next_ms is None:  # this runtime's first probe of the pause, drawn once
            next_ms = self._probes[key] = int(pause.get("ts_ms", now)) + self._jittered(wait_ms)
            if len(self._probes) > _MAX_RUNS:
                self._probes.popitem(last=False)
        if now >= next_ms:
            self._probes[key] = now + self._jittered(wait_ms)
            self._probes.move_to_end(key)
            if len(self._probes) > _MAX_RUNS:
                self._probes.popitem(last=False)
            return  # the one call of this wait: does the upstream answer again?
        raise ToolPaused(pause, run_id, tool, upstream, (next_ms - now) / 1000)

    def _jittered(self, wait_ms: int) -> int:
        """A half-open wait, 0-20% longer."""
        return int(wait_ms * (1 + self._jitter.uniform(0.0, 0.2)))

    @classmethod
    def in_process(
        cls,
        policy: Policy | None = None,
        *,
        raw_tools: Iterable[str] = (),
        redact: Iterable[str] = DEFAULT_REDACTED_FIELDS,
        clock: Callable[[], int] = wall_clock_ms,
    ) -> Guard:
        """A guard with the detector in this process; no Kafka, nothing to start. ``policy=None`` means
        the built-in defaults."""
        policy = policy or Policy()
        board = ControlBoard(watch_all=True)
        return cls(TelemetryBuilder(policy, raw_tools, redact=redact), board, _LocalRules(policy, board), None, clock)

    @classmethod
    def fleet(
        cls,
        config: KafkaClientConfig | None = None,
        telemetry_topic: str | None = None,
        control_topic: str | None = None,
        policy: Policy | None = None,
        *,
        trusted_keys: KeyRing | None = None,
        allow_unsigned: bool = False,
        raw_tools: Iterable[str] = (),
        redact: Iterable[str] = DEFAULT_REDACTED_FIELDS,
        lookback_ms: int = 60_000,
        local_rules: bool = True,
        linger_ms: int = 5,
        clock: Callable[[], int] = wall_clock_ms,
        scopes_topic: str | None = None,
    ) -> Guard:
        """A guard that folds its runs' per-run rules here (``local_rules``), publishes their telemetry
        and obeys the fleet's decisions signed by ``trusted_keys``: the workers' public keys, by default
        the ``LOOPWARDEN_WORKER_KEYS`` files or directories (``allow_unsigned`` only for development).

        What is not given is read from the environment the workers are configured by: ``config`` from
        ``KAFKA_*`` (``KafkaClientConfig.from_env``), the topics from ``LOOPWARDEN_TELEMETRY_TOPIC``,
        ``LOOPWARDEN_CONTROL_TOPIC`` and ``LOOPWARDEN_SCOPES_TOPIC`` (defaults ``agent.telemetry``,
        ``agent.control``, ``loopwarden.scopes``). The scopes topic is read from its beginning at start,
        so a sub-agent tree halted before this process started is refused here too (``""``: not read).

        ``policy`` is what the local rules enforce (``None``: the built-in defaults); give it the
        workers' policy, so both sides decide alike (telemetry carries its digest; workers count
        mismatches). The stricter applies either way: this process enforces its policy and obeys every
        fleet decision. ``linger_ms`` is the telemetry producer's batching delay. Start the guard before
        use (``async with``)."""
        if trusted_keys is None and not allow_unsigned:
            setting = os.environ.get(WORKER_KEYS_VAR, "").strip()
            if setting:
                trusted_keys = KeyRing.from_setting(setting)
        env = os.environ
        config = config or KafkaClientConfig.from_env(env)
        telemetry_topic = telemetry_topic or env.get("LOOPWARDEN_TELEMETRY_TOPIC", "").strip() or "agent.telemetry"
        control_topic = control_topic or env.get("LOOPWARDEN_CONTROL_TOPIC", "").strip() or "agent.control"
        if scopes_topic is None:
            scopes_topic = env.get("LOOPWARDEN_SCOPES_TOPIC", "").strip() or "loopwarden.scopes"
        policy = policy or Policy()
        board = ControlBoard()
        fleet = _FleetLink(
            TelemetryPublisher(config, telemetry_topic, linger_ms=linger_ms),
            HaltListener(config, control_topic, trusted_keys=trusted_keys, allow_unsigned=allow_unsigned,
                         board=board, lookback_ms=lookback_ms),
            scopes_topic, allow_unsigned,
        )
        local = _LocalRules(policy, board) if local_rules else None
        return cls(TelemetryBuilder(policy, raw_tools, redact=redact), board, local, fleet, clock)

    async def start(self) -> None:
        if self._fleet is not None:
            await self._fleet.start()

    async def stop(self) -> None:
        if self._fleet is not None:
            await self._fleet.stop()

    async def flush(self) -> None:
        """Wait until the telemetry of every call made so far is acknowledged by the broker (or has failed:
        ``counters``), the producer's linger included. In process there is nothing to wait for. ``stop``
        does it too (for at most the publisher's close timeout); this is for a runtime that goes on, or
        that is frozen between requests without stopping (a serverless function)."""
        if self._fleet is not None:
            await self._fleet.publisher.flush()

    def ready(self) -> bool:
        return self._fleet is None or self._fleet.ready()

    @property
    def counters(self) -> dict[str, int]:
        """Decisions applied/duplicate/malformed/ignored, refused by reason, made ``local``ly,
        ``confirmed`` by the fleet and ``fleet_only``; (fleet) telemetry published/failed."""
        return {**self.board.counters, **(self._fleet.counters if self._fleet is not None else {})}

    def on_decision(self, callback: DecisionCallback) -> None:
        """Call ``callback(control_v1_dict)`` for every decision applied to this process's runs."""
        self.board.add_callback(callback)

    def run(self, run_id: str, agent_id: str | None = None, tenant: str | None = None, *,
            local_rules: bool = True, parent_run_id: str | None = None, root_run_id: str | None = None,
            thread_key: str | None = None, trigger: str | None = None,
            caused_by_run_id: str | None = None) -> GuardedRun:
        """The guarded handle of a run: the same object for the same run id (the 10 000 most recent).

        ``local_rules=False``: this run's rules are left to the fleet, for a run whose calls several
        processes publish (each would see only part of it locally); its halts then arrive from the
        control topic, some milliseconds after the call that triggered them.

        ``parent_run_id``: the run that started this one (a sub-agent); ``root_run_id`` its tree's root
        (default: the parent's root when the parent is guarded here, else the parent). Raises
        ``TreeHalted`` when that tree is halted: no new child starts in it. ``thread_key``, ``trigger``
        (user, schedule, webhook, agent) and ``caused_by_run_id`` say what started the run, for the
        rules on chains of runs; raises ``ThreadHalted`` when the tenant's thread is halted: no new run
        starts on it."""
        for name, value in (("run_id", run_id), ("agent_id", agent_id), ("tenant", tenant),
                            ("parent_run_id", parent_run_id), ("root_run_id", root_run_id),
                            ("thread_key", thread_key), ("caused_by_run_id", caused_by_run_id)):
            _check_id(name, value)
        if trigger is not None and trigger not in TRIGGERS:
            raise InvalidCall(f"trigger: must be one of {', '.join(TRIGGERS)}; got {trigger!r}")
        if not local_rules and self._fleet is None:
            raise InvalidCall("local_rules=False needs the fleet: an in-process guard has only local rules")
        with self._runs_lock:  # runs may be started from several threads
            guarded = self._runs.get(run_id)
            if guarded is None:
                parent = self._runs.get(parent_run_id) if parent_run_id is not None else None
                if root_run_id is None:
                    root_run_id = (parent.root_run_id if parent is not None else parent_run_id) or run_id
                depth = 0 if parent_run_id is None else parent.depth + 1 if parent is not None else 1
                halt = self.board.tree_halt(root_run_id)
                if halt is not None:
                    raise TreeHalted(halt, run_id)
                thread_halt = self.board.thread_halt(tenant, thread_key) if thread_key is not None else None
                if thread_halt is not None:
                    raise ThreadHalted(thread_halt, run_id)
                guarded = self._runs[run_id] = GuardedRun(self, run_id, agent_id, tenant,
                                                          local_rules and self._local is not None,
                                                          _Lineage(root_run_id, parent_run_id, depth, thread_key, trigger,
                                                                   caused_by_run_id))
                if len(self._runs) > _MAX_RUNS:
                    self._runs.popitem(last=False)
                self.board.watch(run_id, root_run_id)
            else:
                self._runs.move_to_end(run_id)
                asked = (parent_run_id, root_run_id, thread_key, trigger, caused_by_run_id)
                lineage = guarded._lineage
                known = (lineage.parent_run_id, lineage.root_run_id, lineage.thread_key, lineage.trigger,
                         lineage.caused_by_run_id)
                if any(a is not None and a != k for a, k in zip(asked, known, strict=True)):
                    raise InvalidCall(f"run {run_id} is already guarded with parent {lineage.parent_run_id!r}, root "
                                      f"{lineage.root_run_id!r}, thread {lineage.thread_key!r}")
            if (guarded.agent_id, guarded.tenant) != (agent_id, tenant):
                raise InvalidCall(
                    f"run {run_id} is already guarded as agent {guarded.agent_id!r}, tenant {guarded.tenant!r}"
                )
            if guarded.local_rules != (local_rules and self._local is not None):
                raise InvalidCall(f"run {run_id} is already guarded with local_rules={guarded.local_rules}")
            return guarded


@dataclass(frozen=True, slots=True)
class _Lineage:
    """Where a run comes from: its tree, and what started it."""

    root_run_id: str
    parent_run_id: str | None
    depth: int
    thread_key: str | None
    trigger: str | None
    caused_by_run_id: str | None

    def fields(self) -> dict[str, Any]:
        """The telemetry fields every event of the run carries."""
        out: dict[str, Any] = {"root_run_id": self.root_run_id}
        if self.parent_run_id is not None:
            out["parent_run_id"] = self.parent_run_id
            out["depth"] = self.depth
        for name in ("thread_key", "trigger", "caused_by_run_id"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


class GuardedRun:
    """One agent run's tool calls, through the guard. Not thread-safe; use it from one event loop."""

    def __init__(self, guard: Guard, run_id: str, agent_id: str | None, tenant: str | None,
                 local_rules: bool, lineage: _Lineage | None = None) -> None:
        self.run_id = run_id
        self.agent_id = agent_id
        self.tenant = tenant
        #: Whether this process folds the run's per-run rules (see ``Guard.run``).
        self.local_rules = local_rules
        self._guard = guard
        self._builder = guard.builder
        self._board = guard.board
        self._clock = guard.clock
        self._local = guard._local if local_rules else None
        self._fleet = guard._fleet
        self._lineage = lineage or _Lineage(run_id, None, 0, None, None, None)
        self._fleet_fields = self._lineage.fields()
        self._seq = 0
        self._advice_taken: str | None = None
        self._earlier: OrderedDict[tuple[str, str], _Earlier] = OrderedDict()
        #: Side-effecting calls running now, by key: an identical one begun meanwhile waits for the first
        #: and is its duplicate (the outcome, or None when the first never finished).
        self._flying: dict[tuple[str, str], asyncio.Future[_Earlier | None]] = {}

    @property
    def decision(self) -> dict[str, Any] | None:
        """The halt decision in force (control v1 object: the run's, or its tree's), or None."""
        return self._board.halt_decision(self.run_id)

    @property
    def root_run_id(self) -> str:
        """The root of the sub-agent tree this run is in (its own id for a root)."""
        return self._lineage.root_run_id

    @property
    def depth(self) -> int:
        """The run's depth in its tree (0 for a root)."""
        return self._lineage.depth

    @property
    def parent_run_id(self) -> str | None:
        """The run that started this one (None for a root)."""
        return self._lineage.parent_run_id

    def child(self, run_id: str, agent_id: str | None = None, *, local_rules: bool = True) -> GuardedRun:
        """Start (or get) a sub-agent run of this one, in this run's tree and tenant; ``TreeHalted`` if
        the tree is halted."""
        return self._guard.run(run_id, agent_id, self.tenant, local_rules=local_rules, parent_run_id=self.run_id,
                               root_run_id=self.root_run_id)

    @property
    def halted(self) -> bool:
        return self.decision is not None

    @property
    def advice(self) -> str | None:
        """The latest warning before a halt for this run (an ``advise`` decision's reason, written for the
        model: hand it to the model with the tool result), or None."""
        message = self._board.advice(self.run_id)
        return None if message is None else str(message.get("reason", ""))

    def take_advice(self) -> str | None:
        """The latest advice if not taken before, else None: what a framework integration appends to the
        tool result the model reads next (each warning once)."""
        message = self._board.advice(self.run_id)
        if message is None or message["decision_id"] == self._advice_taken:
            return None
        self._advice_taken = message["decision_id"]
        return str(message.get("reason", ""))

    @property
    def calls(self) -> int:
        """Calls reported so far; the next call's telemetry carries this as its ``seq``."""
        return self._seq

    def bind_task(self, task: asyncio.Task[Any] | None = None) -> asyncio.Task[Any]:
        """Have ``task`` (default: the current one) cancelled when the run is halted. A halt landing
        while the task awaits a tool raises ``RunHalted`` from that ``call``; elsewhere (a model turn)
        the task sees a ``CancelledError``, which ``bound()`` turns into ``RunHalted``."""
        task = task or asyncio.current_task()
        if task is None:
            raise UsageError("bind_task() outside a task: pass the task to cancel on halt")
        self._board.bind_task(self.run_id, task)
        return task

    @asynccontextmanager
    async def bound(self) -> AsyncIterator[GuardedRun]:
        """``async with run.bound():`` binds the current task for the block; a halt that cancels it
        anywhere inside leaves the block as ``RunHalted``, not as a cancellation."""
        task = self.bind_task()
        try:
            yield self
        except asyncio.CancelledError:
            if self._halt_cancelled(task):
                raise self._halted_error(self.decision or {}) from None
            raise
        finally:
            self._board.unbind_task(self.run_id, task)

    def _halt_cancelled(self, task: asyncio.Task[Any] | None) -> bool:
        """Whether the cancellation ``task`` is in was the board's, for this run's halt; if so, it is
        taken back (a cancellation of anyone else's still stands)."""
        if task is None or not self.halted or not task.cancelling():
            return False
        task.uncancel()
        return task.cancelling() == 0

    async def call(
        self,
        tool: str,
        fn: Callable[..., Any],
        /,
        args: Mapping[str, Any] | None = None,
        *,
        side_effect: bool | None = None,
        retry_budget: int | None = None,
        plan_step: int | None = None,
        ids: CallIds | None = None,
        tool_class: str | None = None,
        target: str | None = None,
        tokens: int | float | None = None,
        cost_usd: int | float | None = None,
        spawn: Spawn | None = None,
        upstream: str | None = None,
        agent_id: str | None = None,
    ) -> Any:
        """Run ``fn(**args)`` (sync or async) as tool ``tool`` and return its result, unless the run is
        halted (``RunHalted``), the tool is paused (``ToolPaused``) or the call is a suppressed duplicate
        (the earlier result, or the earlier exception, again). A tool's exception is reported, then
        re-raised.

        ``side_effect``: the tool acts on the outside world; None leaves it to the policy.
        ``retry_budget``: identical failures this call may repeat; None leaves it to the policy.
        ``plan_step``: progress marker; an advance resets repetition evidence.
        ``ids``: the framework's ids of this call, for its telemetry.
        ``tool_class``: what the call does (read, write, poll, spawn, handoff, other); None leaves it to
        the policy. ``target``: the resource it reads or writes; a write's tool may return
        ``ToolOutcome(..., state_hash=)`` with the target's content hash after it.
        ``tokens``, ``cost_usd``: what the call cost, for the run's budgets (``max_tokens``,
        ``max_cost_usd``).
        ``spawn``: the call starts a sub-agent (``Spawn``: its run id, agent and task); spawn-class.
        ``upstream``: the host or MCP server the tool calls, for the storm rule (a paused tool of it
        raises ``ToolPaused``). ``agent_id``: the agent making this call when it is not the run's (a
        handoff moved the run to another agent); its policy applies, and ``handoff_loop`` compares it
        with the ``child_agent_id`` of the handoff before.
        Sync tools run on the event loop's thread; wrap a blocking one in ``asyncio.to_thread``.
        """
        _check_spend(tokens, cost_usd)  # before the tool runs: refused after, a retry would run it again
        pending = await self.begin(tool, args, side_effect=side_effect, retry_budget=retry_budget,
                                   plan_step=plan_step, ids=ids, tool_class=tool_class, target=target, spawn=spawn,
                                   upstream=upstream, agent_id=agent_id)
        if pending.earlier is not None:
            return pending.earlier.replay()
        started = time.perf_counter()
        try:
            value = fn(**pending.args)
            if inspect.isawaitable(value):
                value = await value
        except asyncio.CancelledError:
            self.abandon(pending)
            if self._halt_cancelled(asyncio.current_task()):
                raise self._halted_error(self.decision or {}) from None  # the tool was cut off: nothing to report
            raise
        except Exception as exc:
            await self.finish(pending, error=exc, latency_ms=(time.perf_counter() - started) * 1000,
                              tokens=tokens, cost_usd=cost_usd)
            raise
        except BaseException:
            self.abandon(pending)
            raise
        return await self.finish(pending, value, latency_ms=(time.perf_counter() - started) * 1000,
                                 tokens=tokens, cost_usd=cost_usd)

    async def model_call(self, model: str, *, tokens: int | float | None = None, cost_usd: int | float | None = None,
                         outcome: Outcome = "success", ids: CallIds | None = None) -> None:
        """Report one model call (an inference) of this run: it counts toward the run's budgets and
        toward the model calls in a row with no tool call between (``max_model_calls_without_tool``),
        never toward the ceiling or the loop rules. Raises ``RunHalted`` if the run is halted, by this
        call or before it."""
        ids = ids or _NO_IDS
        _check_call(model, None, None, ids)
        _check_spend(tokens, cost_usd)
        if outcome not in OUTCOMES:
            raise InvalidCall(f"outcome must be one of {', '.join(sorted(OUTCOMES))}; got {outcome!r}")
        if not self._guard.ready():
            raise UsageError("the fleet guard is not started: use 'async with guard' or await guard.start()")
        self._raise_if_halted()
        await self._record(self._builder.build(FinishedCall(
            self.run_id, model, {}, outcome, None, self._clock(), 0.0, seq=self._seq, agent_id=self.agent_id,
            tenant=self.tenant, trace_id=ids.trace_id, span_id=ids.span_id, parent_span_id=ids.parent_span_id,
            kind="model_call", tokens=tokens, cost_usd=cost_usd, fleet=self._fleet_fields)))
        self._raise_if_halted()

    async def begin(
        self,
        tool: str,
        args: Mapping[str, Any] | None = None,
        *,
        side_effect: bool | None = None,
        retry_budget: int | None = None,
        plan_step: int | None = None,
        ids: CallIds | None = None,
        tool_class: str | None = None,
        target: str | None = None,
        spawn: Spawn | None = None,
        upstream: str | None = None,
        agent_id: str | None = None,
    ) -> PendingCall:
        """The first half of ``call``, for frameworks that report a tool call in two hooks (before it
        runs, after it ran): raises ``RunHalted`` if the run is halted; returns a ``PendingCall`` whose
        ``earlier`` is set when the call is a suppressed duplicate (hand ``earlier.replay()`` back
        instead of running the tool; it is already reported). Otherwise run the tool and ``finish``."""
        ids = ids or _NO_IDS
        _check_call(tool, retry_budget, plan_step, ids, tool_class, target)
        if not self._guard.ready():
            raise UsageError(
                "the fleet guard is not started: use 'async with guard' or await guard.start()"
            )
        self._raise_if_halted()
        now_ms = self._clock()
        paused = self._board.run_pause(self.run_id, tool, now_ms)
        if paused is not None:  # this run's own transient streak: wait what the upstream asked for
            raise ToolPaused(paused[1], self.run_id, tool, upstream, (paused[0] - now_ms) / 1000)
        _check_id("upstream", upstream)
        if upstream is not None:
            self._guard.admit(self.tenant, tool, upstream, self.run_id)
        _check_id("agent_id", agent_id)
        agent = agent_id if agent_id is not None else self.agent_id
        arguments = dict(args or {})
        fleet_fields = self._fleet_fields
        if upstream is not None:
            fleet_fields = {**fleet_fields, "upstream": upstream}
        if spawn is not None:
            tool_class = tool_class or "spawn"
            fleet_fields = {**fleet_fields, **self._spawn_fields(tool, spawn, agent)}
        spec = _CallSpec(
            tool,
            arguments,
            self._builder.args_hash(agent, tool, arguments),
            side_effect,
            retry_budget,
            plan_step,
            ids,
            tool_class,
            target,
            fleet_fields,
            agent,
            uuid.uuid4().hex if spawn is not None else None,
        )
        thresholds = self._builder.policy.resolve(agent, tool).thresholds
        side_effecting = side_effect if side_effect is not None else thresholds.side_effect
        # Arguments without a JSON form all hash alike: such a call is no one's duplicate (handing it
        # another call's result would drop its side effect).
        keyed = side_effecting and spec.args_hash != UNHASHABLE
        earlier = self._recall(spec.key, now_ms) if keyed else None
        flight = self._flying.get(spec.key) if keyed and earlier is None else None
        if flight is not None and flight.get_loop() is not asyncio.get_running_loop():
            flight = None  # begun on another loop (a sync framework's bridge runs each step on its own): not awaitable here
        if flight is not None:
            # an identical call is running: it is this one's first occurrence (its outcome, when it ends)
            earlier = await asyncio.shield(flight)
            self._raise_if_halted()
            now_ms = self._clock()
        if earlier is not None:
            repeat = self._event(spec, earlier, now_ms, 0.0, repeat=True)
            suppressed = self._board.is_suppressed(self.run_id, tool, spec.args_hash, now_ms)
            if suppressed or (self._local is not None and self._local.would_stop(repeat)):
                await self._record(repeat)
                self._raise_if_halted()
                # No tool ran, so nothing awaited: yield, or an agent retrying in a tight loop would
                # starve the listener that is about to deliver its halt.
                await asyncio.sleep(0)
                logger.debug(
                    "duplicate call of %s handed the earlier result",
                    tool,
                    extra={"run_id": self.run_id, "tool": tool},
                )
                return PendingCall(spec, side_effecting, thresholds.side_effect_window_ms, earlier)
        if spawn is not None and self._local is not None:
            # The child starts while this call runs (an agent tool returns when its sub-agent is done):
            # its tree learns of it now, so a spawn too deep, or one too many, halts the tree before the
            # child's first call. The event reported as the call ends has the same id and is not folded again.
            self._local.spawn_begins(self.run_id, self.tenant, spec, now_ms)
        flight = None
        if keyed and spec.key not in self._flying:
            flight = self._flying[spec.key] = asyncio.get_running_loop().create_future()
        return PendingCall(spec, side_effecting, thresholds.side_effect_window_ms, None, flight)

    def abandon(self, pending: PendingCall) -> None:
        """The call begun as ``pending`` will not be finished (its tool was cancelled): identical calls
        waiting for it go ahead and run."""
        self._land(pending, None)

    def _land(self, pending: PendingCall, done: _Earlier | None) -> None:
        flight = pending.flight
        if flight is not None and not flight.done():
            flight.set_result(done)
        if flight is not None and self._flying.get(pending.spec.key) is flight:
            del self._flying[pending.spec.key]

    async def finish(self, pending: PendingCall, result: Any = None, *, error: Exception | None = None,
                     latency_ms: float = 0.0, state_hash: str | None = None, tokens: int | float | None = None,
                     cost_usd: int | float | None = None, upstream: str | None = None) -> Any:
        """The second half of ``call``: report the tool's ``result`` (or its ``error``) and return what
        the caller gets (a ``ToolOutcome``'s result, or ``result`` itself). ``state_hash``: a write's
        after-state, when the tool did not return it in a ``ToolOutcome``. ``upstream``: the upstream
        learned while the call ran, for a call that named none at ``begin`` (an MCP server's name comes
        with its first answer): the call is reported with it, so it counts in the same streak as the
        calls after it."""
        try:
            return await self._finish(pending, result, error, latency_ms, state_hash, tokens, cost_usd, upstream)
        finally:
            self._land(pending, None)  # the call was refused (a bad argument): a call waiting for it runs

    async def _finish(self, pending: PendingCall, result: Any, error: Exception | None, latency_ms: float,
                      state_hash: str | None, tokens: int | float | None, cost_usd: int | float | None,
                      upstream: str | None) -> Any:
        retry_after_ms = None
        if upstream is not None and "upstream" not in (pending.spec.fleet or {}):
            _check_id("upstream", upstream)
            pending = replace(pending, spec=replace(pending.spec, fleet={**(pending.spec.fleet or {}),
                                                                           "upstream": upstream}))
        if error is not None:
            outcome: Outcome = "error"
            value: Any = None
            error_class, retry_after_ms = classify_error(error)
            body: Any = {"error_class": type(error).__name__[:MAX_ID_LENGTH], "message": _text(error)}
        else:
            outcome, value, body = _classify(result)
            if isinstance(result, ToolOutcome) and result.state_hash is not None:
                state_hash = result.state_hash
        _check_id("state_hash", state_hash)
        _check_spend(tokens, cost_usd)
        end_ms = self._clock()
        done = _Earlier(outcome, value, error, body, error_class if error is not None else None,
                        end_ms + pending.window_ms, state_hash, tokens, cost_usd, retry_after_ms)
        if pending.side_effecting and pending.spec.args_hash != UNHASHABLE:
            self._remember(pending.spec.key, done)
        self._land(pending, done)
        await self._record(self._event(pending.spec, done, end_ms, latency_ms))
        return value

    def spawned(self, pending: PendingCall, spawn: Spawn) -> PendingCall:
        """The call in progress ``pending`` as a spawn-class call that started ``spawn``'s child, for a
        framework that learns only while a call runs that it runs a sub-agent (a tool invoking an
        agent). Its tree learns of the spawn now, as ``begin`` tells it of one; ``finish`` the returned
        call. A call begun as a spawn (or marked before) is returned as it is."""
        spec = pending.spec
        if spec.event_id is not None:
            return pending
        spec = replace(spec, tool_class="spawn", fleet={**(spec.fleet or {}), **self._spawn_fields(spec.tool, spawn, spec.agent_id)},
                       event_id=uuid.uuid4().hex)
        if self._local is not None:
            self._local.spawn_begins(self.run_id, self.tenant, spec, self._clock())
        return replace(pending, spec=spec)

    def _spawn_fields(self, tool: str, spawn: Spawn, agent: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if spawn.child_run_id is not None:
            out["child_run_id"] = spawn.child_run_id
        if spawn.child_agent_id is not None:
            out["child_agent_id"] = spawn.child_agent_id
        task_hash = spawn.task_hash
        if task_hash is None and spawn.task is not None:
            task_hash = self._builder.args_hash(agent, tool, {"task": spawn.task})
        if task_hash is not None:
            out["task_hash"] = task_hash
        return out

    def _event(
        self, spec: _CallSpec, done: _Earlier, ts_ms: int, latency_ms: float, repeat: bool = False
    ) -> dict[str, Any]:
        """The telemetry of one call; a repeat handed the earlier outcome is marked in ``attrs``."""
        attrs: dict[str, Any] = {}
        if spec.ids.tool_call_id is not None:
            attrs["tool_call_id"] = spec.ids.tool_call_id
        if repeat:
            attrs["suppressed"] = True
        return self._builder.build(
            FinishedCall(
                self.run_id,
                spec.tool,
                spec.args,
                done.outcome,
                done.body,
                ts_ms,
                latency_ms,
                seq=self._seq,
                agent_id=spec.agent_id,
                tenant=self.tenant,
                side_effect=spec.side_effect,
                retry_budget=spec.retry_budget,
                plan_step=spec.plan_step,
                error_class=done.error_class,
                error_message=_text(done.error) if done.error is not None else None,
                trace_id=spec.ids.trace_id,
                span_id=spec.ids.span_id,
                parent_span_id=spec.ids.parent_span_id,
                attrs=attrs,
                tool_class=spec.tool_class,
                target=spec.target,
                state_hash=done.state_hash,
                tokens=None if repeat else done.tokens,  # a suppressed repeat cost nothing
                cost_usd=None if repeat else done.cost_usd,
                fleet=spec.fleet if done.retry_after_ms is None or repeat
                else {**(spec.fleet or {}), "retry_after_ms": done.retry_after_ms},
                event_id=None if repeat else spec.event_id,
            ),
            args_hash=spec.args_hash,
        )

    async def _record(self, event: dict[str, Any]) -> None:
        self._seq += 1
        if self._local is not None:
            self._local.fold(event)
        if self._fleet is not None:
            await self._fleet.record(event)

    def _recall(self, key: tuple[str, str], now_ms: int) -> _Earlier | None:
        earlier = self._earlier.get(key)
        if earlier is not None and now_ms > earlier.expires_ms:
            del self._earlier[key]
            return None
        return earlier

    def _remember(self, key: tuple[str, str], earlier: _Earlier) -> None:
        self._earlier[key] = earlier
        self._earlier.move_to_end(key)
        if len(self._earlier) > _REMEMBERED_PER_RUN:
            self._earlier.popitem(last=False)

    def _raise_if_halted(self) -> None:
        decision = self.decision
        if decision is not None:
            raise self._halted_error(decision)

    def _halted_error(self, decision: Mapping[str, Any]) -> RunHalted:
        if decision.get("scope") == "tree":
            return TreeHalted(decision, self.run_id)
        return RunHalted(decision)


@dataclass(frozen=True, slots=True)
class PendingCall:
    """A call between ``GuardedRun.begin`` and ``GuardedRun.finish``."""

    spec: _CallSpec
    side_effecting: bool
    window_ms: int
    #: Set when the call is a suppressed duplicate: ``earlier.replay()`` is its answer; do not run it.
    earlier: _Earlier | None
    #: A side-effecting call's flight: identical calls begun while it runs wait for its outcome.
    flight: asyncio.Future[_Earlier | None] | None = None

    @property
    def args(self) -> dict[str, Any]:
        return self.spec.args


@dataclass(frozen=True, slots=True)
class _CallSpec:
    """What the agent asked for in one ``call``."""

    tool: str
    args: dict[str, Any]
    args_hash: str
    side_effect: bool | None
    retry_budget: int | None
    plan_step: int | None
    ids: CallIds
    tool_class: str | None = None
    target: str | None = None
    #: The run's (and a spawn's) fields for the rules across runs.
    fleet: Mapping[str, Any] | None = None
    #: The agent making the call (None: the run's).
    agent_id: str | None = None
    #: The event's id, chosen as a spawn begins (its tree fact is folded then); None: chosen as it ends.
    event_id: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.tool, self.args_hash)


def _classify(value: Any) -> tuple[Outcome, Any, Any]:
    """(outcome, what the caller gets, what is reported) of a tool's return value."""
    if isinstance(value, ToolOutcome):
        return value.outcome, value.result, value.result
    if value is None or (isinstance(value, _EMPTY_TYPES) and not value):
        return "empty", value, value
    return "success", value, value


def _check_id(name: str, value: Any) -> None:
    """``InvalidCall`` naming ``name`` unless ``value`` is None or an identifier-sized string."""
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_ID_LENGTH):
        raise InvalidCall(f"{name}: must be a non-empty string of at most {MAX_ID_LENGTH} characters")


def _check_spend(tokens: Any, cost_usd: Any) -> None:
    for name, value in (("tokens", tokens), ("cost_usd", cost_usd)):
        if value is not None and (type(value) not in (int, float) or not 0 <= value < float("inf")):
            raise InvalidCall(f"{name}: must be a number >= 0, got {value!r}")


def _check_call(tool: str, retry_budget: int | None, plan_step: int | None, ids: CallIds,
                tool_class: str | None = None, target: str | None = None) -> None:
    """Refuse, before the tool runs, what the telemetry contract would refuse after it."""
    if tool_class is not None and tool_class not in TOOL_CLASSES:
        raise InvalidCall(f"tool_class: must be one of {', '.join(TOOL_CLASSES)}; got {tool_class!r}")
    if target is not None and (not isinstance(target, str) or len(target) > MAX_ID_LENGTH):
        raise InvalidCall(f"target: must be a string of at most {MAX_ID_LENGTH} characters")
    if not isinstance(tool, str) or not 0 < len(tool) <= MAX_ID_LENGTH:
        raise InvalidCall(f"tool: must be a non-empty string of at most {MAX_ID_LENGTH} characters")
    if retry_budget is not None and (
        type(retry_budget) is not int or not 0 <= retry_budget <= MAX_RETRY_BUDGET
    ):
        raise InvalidCall(
            f"retry_budget: must be an integer from 0 to {MAX_RETRY_BUDGET}, got {retry_budget!r}"
        )
    if plan_step is not None and type(plan_step) is not int:
        raise InvalidCall(f"plan_step: must be an integer, got {plan_step!r}")
    for name in ("tool_call_id", "trace_id", "span_id", "parent_span_id"):
        _check_id(f"ids.{name}", getattr(ids, name))


def classify_error(error: BaseException) -> tuple[str, int | None]:
    """The telemetry ``error_class`` of a tool's exception, and the wait it asked for (ms, or None): an
    HTTP status (``status_code`` or ``status`` on it or on its ``response``, as httpx, requests, aiohttp
    and the model SDKs raise) gives ``http_<status>``, a timeout ``timeout``, a refused or dropped
    connection ``connection``; anything else its type's name. The wait is a ``retry_after`` attribute
    (seconds) or the response's ``Retry-After`` header (seconds)."""
    response = _attribute(error, "response")
    status = None
    for holder in (error, response):
        for name in ("status_code", "status"):
            value = _attribute(holder, name) if holder is not None else None
            if type(value) is int and 100 <= value <= 599:
                status = value
                break
        if status is not None:
            break
    if status is not None and status >= 400:
        error_class = f"http_{status}"
    elif isinstance(error, TimeoutError):
        error_class = "timeout"
    elif isinstance(error, ConnectionError):
        error_class = "connection"
    else:
        error_class = type(error).__name__[:MAX_ID_LENGTH]
    wait: Any = _attribute(error, "retry_after")
    if wait is None and response is not None:
        headers = _attribute(response, "headers")
        with contextlib.suppress(Exception):
            wait = headers.get("retry-after") if headers is not None else None
    try:
        seconds = float(wait) if wait is not None else None
    except Exception:  # noqa: BLE001 - an HTTP date (the pause's default wait), or a value whose float() fails
        seconds = None
    retry_after_ms = int(seconds * 1000) if seconds is not None and 0 <= seconds < 86_400 else None
    return error_class, retry_after_ms


def _attribute(holder: object, name: str) -> Any:
    """``holder.name``, or None when it has none or reading it raises (a property of a tool's exception
    that fails must not replace the exception the tool raised)."""
    try:
        return getattr(holder, name, None)
    except Exception:  # noqa: BLE001 - a tool's exception's property: whatever it raises, it has none
        return None


def _text(error: BaseException) -> str:
    """``str(error)``, or its type's name when that raises."""
    try:
        return str(error)
    except Exception:  # noqa: BLE001 - a tool's exception's __str__: whatever it raises, it has no text
        return f"<{type(error).__name__}: its message could not be read>"
