"""The guard: what agent code calls its tools through.

``GuardedRun.call`` refuses a halted run's call before it runs (``RunHalted``), hands back the earlier
result for a suppressed duplicate of a side-effecting call instead of acting again, and otherwise runs
the tool, classifies its outcome and reports it as telemetry.

Two modes share that path and differ only in where telemetry goes and decisions come from:

- ``Guard.in_process()`` folds each call through the core detector in this process, so a halt decided
  on one call is in force before the next. For one process, tests and notebooks.
- ``Guard.fleet(config)`` publishes telemetry to Kafka and applies the decisions the workers publish on
  the control topic. A decision arrives some milliseconds after the call that triggered it; a bound
  task (``bind_task``) is cancelled on arrival.

A duplicate side effect is the one repetition that must be stopped *before* it happens. In-process,
the guard therefore asks the detector first, on a scratch copy of the run's state, whether repeating a
remembered side-effecting call would be suppressed or halted; only then is the repetition recorded and
the earlier result handed back. In fleet mode the same happens once the fleet's ``suppress`` decision
has arrived: the repetition that triggered it has already run.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ..bus.clock import wall_clock_ms
from ..bus.kafka import KafkaClientConfig
from ..core import (
    OUTCOMES,
    Detector,
    Outcome,
    Policy,
    RunTable,
    decode_event,
)
from ..core.contract import MAX_ID_LENGTH, MAX_RETRY_BUDGET
from .errors import InvalidCall, RunHalted, UsageError
from .lifecycle import StartStop
from .listener import ControlBoard, DecisionCallback, HaltListener
from .publisher import (
    DEFAULT_REDACTED_FIELDS,
    FinishedCall,
    TelemetryBuilder,
    TelemetryPublisher,
)

if TYPE_CHECKING:
    from ..bus.signing import KeyRing

logger = logging.getLogger(__name__)

#: Run handles kept, most recently used last: ``guard.run(id).call(...)`` needs no reference held.
_MAX_RUNS: Final = 10_000
#: Outcomes of side-effecting calls remembered per run (to hand back); the least recently used go first.
_REMEMBERED_PER_RUN: Final = 64
_EMPTY_TYPES: Final = (str, bytes, list, tuple, dict, set, frozenset)


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """Returned by a tool to state its outcome explicitly, e.g. ``ToolOutcome("noop", result)`` for a
    call that changed nothing. The caller of ``GuardedRun.call`` receives ``result``."""

    outcome: Outcome
    result: Any = None

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


@dataclass(slots=True)
class _Earlier:
    """A call's last outcome: what its caller got (value or exception) and what was reported."""

    outcome: Outcome
    value: Any
    error: Exception | None
    body: Any
    error_class: str | None
    expires_ms: int

    def replay(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _LocalDetector:
    """In-process mode: telemetry is folded through the core detector right here."""

    def __init__(self, policy: Policy, board: ControlBoard) -> None:
        self.table = RunTable(Detector(policy))
        self.board = board
        self.counters: dict[str, int] = {}

    def ready(self) -> bool:
        return True

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def record(self, event: dict[str, Any]) -> None:
        for decision in self.table.observe(decode_event(event)).decisions:
            self.board.apply(decision.to_control())

    def would_stop(self, event: dict[str, Any]) -> bool:
        """Whether recording ``event`` would suppress or halt, judged on a scratch copy of the run."""
        state = self.table.get(event["run_id"])
        if state is None:
            return False
        scratch = state.copy()
        decisions = self.table.detector.evaluate(scratch, decode_event(event)).decisions
        return any(d.action in ("suppress", "halt") for d in decisions)


class _FleetLink:
    """Fleet mode: telemetry to Kafka, decisions from the control topic."""

    def __init__(self, publisher: TelemetryPublisher, listener: HaltListener) -> None:
        self.publisher = publisher
        self.listener = listener

    @property
    def counters(self) -> dict[str, int]:
        return {"published": self.publisher.published, "publish_failed": self.publisher.failed}

    def ready(self) -> bool:
        return self.publisher.started

    async def start(self) -> None:
        await self.publisher.start()
        try:
            await self.listener.start()
        except BaseException:
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

    def would_stop(self, event: dict[str, Any]) -> bool:
        return False  # the fleet's verdict arrives later, as a decision


class Guard(StartStop):
    """One per runtime process: hands out ``GuardedRun``s and holds what they share. Build it with
    ``Guard.in_process()`` or ``Guard.fleet(config)``."""

    def __init__(
        self,
        builder: TelemetryBuilder,
        board: ControlBoard,
        link: _LocalDetector | _FleetLink,
        clock: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self.builder = builder
        self.board = board
        self.clock = clock
        self._link = link
        self._runs: OrderedDict[str, GuardedRun] = OrderedDict()

    @classmethod
    def in_process(
        cls,
        policy: Policy | None = None,
        *,
        raw_tools: Iterable[str] = (),
        redact: Iterable[str] = DEFAULT_REDACTED_FIELDS,
        clock: Callable[[], int] = wall_clock_ms,
    ) -> Guard:
        """A guard with the detector in this process; no Kafka, nothing to start."""
        policy = policy or Policy()
        board = ControlBoard(watch_all=True)
        return cls(TelemetryBuilder(policy, raw_tools, redact=redact), board, _LocalDetector(policy, board), clock)

    @classmethod
    def fleet(
        cls,
        config: KafkaClientConfig,
        telemetry_topic: str = "agent.telemetry",
        control_topic: str = "agent.control",
        policy: Policy | None = None,
        *,
        trusted_keys: KeyRing | None = None,
        allow_unsigned: bool = False,
        raw_tools: Iterable[str] = (),
        redact: Iterable[str] = DEFAULT_REDACTED_FIELDS,
        lookback_ms: int = 60_000,
        clock: Callable[[], int] = wall_clock_ms,
    ) -> Guard:
        """A guard that publishes telemetry and obeys the fleet's decisions signed by ``trusted_keys``
        (the workers' public keys; ``allow_unsigned`` only for development). Give it the workers'
        policy, so field filters and side-effect windows agree. Start it before use (``async with``)."""
        board = ControlBoard()
        link = _FleetLink(
            TelemetryPublisher(config, telemetry_topic),
            HaltListener(config, control_topic, trusted_keys=trusted_keys, allow_unsigned=allow_unsigned,
                         board=board, lookback_ms=lookback_ms),
        )
        return cls(TelemetryBuilder(policy, raw_tools, redact=redact), board, link, clock)

    async def start(self) -> None:
        await self._link.start()

    async def stop(self) -> None:
        await self._link.stop()

    @property
    def counters(self) -> dict[str, int]:
        """Decisions applied/duplicate/malformed/ignored, and (fleet) telemetry published/failed."""
        return {**self.board.counters, **self._link.counters}

    def on_decision(self, callback: DecisionCallback) -> None:
        """Call ``callback(control_v1_dict)`` for every decision applied to this process's runs."""
        self.board.add_callback(callback)

    def run(self, run_id: str, agent_id: str | None = None, tenant: str | None = None) -> GuardedRun:
        """The guarded handle of a run: the same object for the same run id (the 10 000 most recent)."""
        for name, value in (("run_id", run_id), ("agent_id", agent_id), ("tenant", tenant)):
            if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_ID_LENGTH):
                raise InvalidCall(f"{name}: must be a non-empty string of at most {MAX_ID_LENGTH} characters")
        guarded = self._runs.get(run_id)
        if guarded is None:
            guarded = self._runs[run_id] = GuardedRun(self, run_id, agent_id, tenant)
            if len(self._runs) > _MAX_RUNS:
                self._runs.popitem(last=False)
            self.board.watch(run_id)
        else:
            self._runs.move_to_end(run_id)
        if (guarded.agent_id, guarded.tenant) != (agent_id, tenant):
            raise InvalidCall(
                f"run {run_id} is already guarded as agent {guarded.agent_id!r}, tenant {guarded.tenant!r}"
            )
        return guarded


class GuardedRun:
    """One agent run's tool calls, through the guard. Not thread-safe; use it from one event loop."""

    def __init__(self, guard: Guard, run_id: str, agent_id: str | None, tenant: str | None) -> None:
        self.run_id = run_id
        self.agent_id = agent_id
        self.tenant = tenant
        self._builder = guard.builder
        self._board = guard.board
        self._clock = guard.clock
        self._link = guard._link
        self._seq = 0
        self._earlier: OrderedDict[tuple[str, str], _Earlier] = OrderedDict()

    @property
    def decision(self) -> dict[str, Any] | None:
        """The halt decision in force (control v1 object), or None."""
        return self._board.halt_decision(self.run_id)

    @property
    def halted(self) -> bool:
        return self.decision is not None

    @property
    def calls(self) -> int:
        """Calls reported so far; the next call's telemetry carries this as its ``seq``."""
        return self._seq

    def bind_task(self, task: asyncio.Task[Any] | None = None) -> asyncio.Task[Any]:
        """Have ``task`` (default: the current one) cancelled when the run is halted."""
        task = task or asyncio.current_task()
        if task is None:
            raise UsageError("bind_task() outside a task: pass the task to cancel on halt")
        self._board.bind_task(self.run_id, task)
        return task

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
    ) -> Any:
        """Run ``fn(**args)`` (sync or async) as tool ``tool`` and return its result, unless the run is
        halted (``RunHalted``) or the call is a suppressed duplicate (the earlier result, or the earlier
        exception, again). A tool's exception is reported, then re-raised.

        ``side_effect``: the tool acts on the outside world; None leaves it to the policy.
        ``retry_budget``: identical failures this call may repeat; None leaves it to the policy.
        ``plan_step``: progress marker; an advance resets repetition evidence.
        ``ids``: the framework's ids of this call, for its telemetry.
        Sync tools run on the event loop's thread; wrap a blocking one in ``asyncio.to_thread``.
        """
        pending = await self.begin(tool, args, side_effect=side_effect, retry_budget=retry_budget,
                                   plan_step=plan_step, ids=ids)
        if pending.earlier is not None:
            return pending.earlier.replay()
        started = time.perf_counter()
        try:
            value = fn(**pending.args)
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:
            await self.finish(pending, error=exc, latency_ms=(time.perf_counter() - started) * 1000)
            raise
        return await self.finish(pending, value, latency_ms=(time.perf_counter() - started) * 1000)

    async def begin(
        self,
        tool: str,
        args: Mapping[str, Any] | None = None,
        *,
        side_effect: bool | None = None,
        retry_budget: int | None = None,
        plan_step: int | None = None,
        ids: CallIds | None = None,
    ) -> PendingCall:
        """The first half of ``call``, for frameworks that report a tool call in two hooks (before it
        runs, after it ran): raises ``RunHalted`` if the run is halted; returns a ``PendingCall`` whose
        ``earlier`` is set when the call is a suppressed duplicate (hand ``earlier.replay()`` back
        instead of running the tool; it is already reported). Otherwise run the tool and ``finish``."""
        ids = ids or _NO_IDS
        _check_call(tool, retry_budget, plan_step, ids)
        if not self._link.ready():
            raise UsageError(
                "the fleet guard is not started: use 'async with guard' or await guard.start()"
            )
        self._raise_if_halted()
        arguments = dict(args or {})
        spec = _CallSpec(
            tool,
            arguments,
            self._builder.args_hash(self.agent_id, tool, arguments),
            side_effect,
            retry_budget,
            plan_step,
            ids,
        )
        thresholds = self._builder.policy.resolve(self.agent_id, tool).thresholds
        side_effecting = side_effect if side_effect is not None else thresholds.side_effect
        now_ms = self._clock()
        earlier = self._recall(spec.key, now_ms) if side_effecting else None
        if earlier is not None:
            repeat = self._event(spec, earlier, now_ms, 0.0, repeat=True)
            suppressed = self._board.is_suppressed(self.run_id, tool, spec.args_hash, now_ms)
            if suppressed or self._link.would_stop(repeat):
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
        return PendingCall(spec, side_effecting, thresholds.side_effect_window_ms, None)

    async def finish(self, pending: PendingCall, result: Any = None, *, error: Exception | None = None,
                     latency_ms: float = 0.0) -> Any:
        """The second half of ``call``: report the tool's ``result`` (or its ``error``) and return what
        the caller gets (a ``ToolOutcome``'s result, or ``result`` itself)."""
        if error is not None:
            outcome: Outcome = "error"
            value: Any = None
            body: Any = {"error_class": type(error).__name__, "message": str(error)}
        else:
            outcome, value, body = _classify(result)
        end_ms = self._clock()
        done = _Earlier(outcome, value, error, body, type(error).__name__ if error else None,
                        end_ms + pending.window_ms)
        if pending.side_effecting:
            self._remember(pending.spec.key, done)
        await self._record(self._event(pending.spec, done, end_ms, latency_ms))
        return value

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
                agent_id=self.agent_id,
                tenant=self.tenant,
                side_effect=spec.side_effect,
                retry_budget=spec.retry_budget,
                plan_step=spec.plan_step,
                error_class=done.error_class,
                trace_id=spec.ids.trace_id,
                span_id=spec.ids.span_id,
                parent_span_id=spec.ids.parent_span_id,
                attrs=attrs,
            ),
            args_hash=spec.args_hash,
        )

    async def _record(self, event: dict[str, Any]) -> None:
        self._seq += 1
        await self._link.record(event)

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
            raise RunHalted(decision)


@dataclass(frozen=True, slots=True)
class PendingCall:
    """A call between ``GuardedRun.begin`` and ``GuardedRun.finish``."""

    spec: _CallSpec
    side_effecting: bool
    window_ms: int
    #: Set when the call is a suppressed duplicate: ``earlier.replay()`` is its answer; do not run it.
    earlier: _Earlier | None

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


def _check_call(tool: str, retry_budget: int | None, plan_step: int | None, ids: CallIds) -> None:
    """Refuse, before the tool runs, what the telemetry contract would refuse after it."""
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
        value = getattr(ids, name)
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_ID_LENGTH):
            raise InvalidCall(f"ids.{name}: must be a non-empty string of at most {MAX_ID_LENGTH} characters")
