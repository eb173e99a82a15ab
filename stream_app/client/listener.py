"""Control in: the runtime's side of loopwarden's decisions.

``ControlBoard`` is what a runtime knows about its runs: which are halted (and by which decision),
which calls are suppressed until when, which tasks to cancel on a halt. It applies control v1 messages
idempotently (a decision id is applied once; redelivery, replays and the local and fleet detectors
agreeing on an id change nothing) and never raises on bad input: a malformed message is counted.
The in-process guard feeds it the local detector's decisions; ``HaltListener`` feeds it the control
topic.

``HaltListener`` reads every partition of the control topic without a consumer group: each runtime
process must see every decision for its runs, and a group would split them between processes. It acts
only on messages signed by a trusted worker key (``signing.KeyRing``) and no older than ``max_age_ms``;
the rest are counted by reason (``unsigned``, ``unknown_key``, ``bad_signature``, ``expired``) and
dropped, and a decision id already applied counts as ``duplicate``. On
start it rewinds ``lookback_ms`` (by record timestamp) and waits until it has caught up, so a halt
issued while the process was starting or restarting is applied before its first tool call. Decisions
for runs not watched yet are parked (bounded) and applied when the run is first watched; their
signatures are checked then, not on arrival: most are other processes' runs, and checking every
signature of the fleet's decisions cost a runtime more than its own runs (an Ed25519
verification is ~116 us here, ~190 us under load: up to a quarter of a core at 1,300 decisions/s).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, TypeGuard

import orjson

from ..bus.clock import wall_clock_ms
from ..bus.kafka import KafkaClientConfig, KafkaConfigError
from ..bus.signing import WORKER_KEYS_VAR
from .lifecycle import StartStop

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import ConsumerRecord, TopicPartition

    from ..bus.signing import KeyRing

logger = logging.getLogger(__name__)

Applied = Literal["applied", "duplicate", "malformed", "ignored"]
#: Who made a decision: this process's own fold of its runs, or the fleet's workers.
Source = Literal["local", "fleet"]
#: Called with the control v1 object of every decision applied to a watched run; may be async.
DecisionCallback = Callable[[dict[str, Any]], object]

_ACTIONS: Final = frozenset(("halt", "suppress", "alert", "resume", "advise", "pause"))
#: Suppressed calls remembered per run; the oldest go first (they expire within a minute anyway).
_SUPPRESSIONS_PER_RUN: Final = 256
#: Decisions parked per unwatched run (a run has at most a few: halt, resume, halt...).
_PARKED_PER_RUN: Final = 8


@dataclass(slots=True)
class _RunView:
    halt: dict[str, Any] | None = None
    #: The latest warning before a halt (an ``advise`` decision): for the model's next input.
    advice: dict[str, Any] | None = None
    #: (tool, args_hash) -> epoch ms until which the call is suppressed.
    suppressed: dict[tuple[str, str], int] = field(default_factory=dict)
    #: tool -> (epoch ms until which the run's calls to it pause, the pause decision): a transient streak.
    paused: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)
    tasks: weakref.WeakSet[asyncio.Task[Any]] = field(default_factory=weakref.WeakSet)


class ControlBoard:
    """The decisions that concern this runtime's runs, applied once each. Memory is bounded: the most
    recent ``max_runs`` runs, ``max_decision_ids`` decision ids and ``max_parked_runs`` unwatched runs
    (and as many sub-agent trees).

    Decisions of scope ``tree`` (control v1 ``scope``, keyed by ``root_run_id``) halt every run of the
    tree: the runs watched with that root (``watch(run_id, root_run_id=)``) and any started in it later.
    A tree halt is kept whether or not a run of the tree is watched yet. Decisions of scope ``thread``
    (keyed by ``tenant`` and ``thread_key``) halt a thread: no new run starts on it (``thread_halt``),
    the runs going on finish. Decisions of scope ``tool`` (``tenant``, ``tool``, ``upstream``) pause a
    tool for a tenant (``tool_pause``) until a ``resume``: the guard then lets one call through per wait.
    Scopes this board does not know are counted as ``ignored``."""

    def __init__(
        self,
        *,
        watch_all: bool = False,
        max_runs: int = 100_000,
        max_decision_ids: int = 100_000,
        max_parked_runs: int = 10_000,
        default_window_ms: int = 60_000,
    ) -> None:
        self.watch_all = watch_all
        self.max_runs = max_runs
        self.max_decision_ids = max_decision_ids
        self.max_parked_runs = max_parked_runs
        #: Suppression window when a suppress decision carries none in its evidence.
        self.default_window_ms = default_window_ms
        #: applied/duplicate/malformed/ignored, the listener's refusals by reason, and where decisions came
        #: from: ``local`` (this process's own fold), ``confirmed`` (the fleet's copy of a local one
        #: arrived), ``fleet_only`` (made by the fleet alone: an operator, runs seen only there).
        self.counters: dict[str, int] = {"applied": 0, "duplicate": 0, "malformed": 0, "ignored": 0,
                                         "unsigned": 0, "unknown_key": 0, "bad_signature": 0, "expired": 0,
                                         "local": 0, "confirmed": 0, "fleet_only": 0}
        self._runs: OrderedDict[str, _RunView] = OrderedDict()
        #: Root run id -> the tree halt in force; run id -> its tree's root (watched runs of a tree).
        self._tree_halts: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._roots: OrderedDict[str, str] = OrderedDict()
        #: (tenant, thread key) -> the thread halt in force; (tenant, tool, upstream) -> the tool's pause.
        self._thread_halts: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()
        self._tool_pauses: OrderedDict[tuple[str, str, str], dict[str, Any]] = OrderedDict()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._local_ids: OrderedDict[str, None] = OrderedDict()
        #: Unwatched run id -> its decisions, each with None (applied when watched) or the check to pass first.
        self._parked: OrderedDict[str, list[tuple[Any, Callable[[], bool] | None]]] = OrderedDict()
        self._callbacks: list[DecisionCallback] = []
        self._confirmations: list[DecisionCallback] = []
        self._follow: Callable[[dict[str, Any]], None] | None = None
        self._callback_tasks: set[asyncio.Future[Any]] = set()

    def add_callback(self, callback: DecisionCallback) -> None:
        """``callback(message)`` for every decision acted upon, whichever side made it."""
        self._callbacks.append(callback)

    def add_confirmation_callback(self, callback: DecisionCallback) -> None:
        """``callback(message)`` when the fleet's copy of a decision this process made arrives."""
        self._confirmations.append(callback)

    def follow_fleet(self, follow: Callable[[dict[str, Any]], None]) -> None:
        """``follow(message)`` for every fleet decision acted upon that this process did not make (the
        local fold mirrors an operator's halt or resume on the run's state)."""
        self._follow = follow

    def watch(self, run_id: str, root_run_id: str | None = None) -> None:
        """Apply decisions for ``run_id`` from now on, starting with any parked for it; ``root_run_id``:
        the sub-agent tree it is in (its tree's halts halt it)."""
        if root_run_id is not None:
            self._roots[run_id] = root_run_id
            self._roots.move_to_end(run_id)
            if len(self._roots) > self.max_runs:
                self._roots.popitem(last=False)
        view = self._view(run_id)
        for message, check in self._parked.pop(run_id, ()):
            if check is None:
                self._act(run_id, view, message)
            elif check():  # parked unchecked (``park``): its signature is checked now, counted if refused
                self.apply(message)

    def watches(self, run_id: str) -> bool:
        """Whether decisions for ``run_id`` concern this process."""
        return self.watch_all or run_id in self._runs

    def advice(self, run_id: str) -> dict[str, Any] | None:
        """The latest advise decision for ``run_id`` (control v1 object), or None."""
        view = self._runs.get(run_id)
        return view.advice if view is not None else None

    def halt_decision(self, run_id: str) -> dict[str, Any] | None:
        """The halt in force for the run (its control v1 object, or its tree's), or None."""
        view = self._runs.get(run_id)
        if view is not None and view.halt is not None:
            return view.halt
        root = self._roots.get(run_id)
        return None if root is None else self._tree_halts.get(root)

    def tree_halt(self, root_run_id: str) -> dict[str, Any] | None:
        """The halt in force for the sub-agent tree of ``root_run_id``, or None."""
        return self._tree_halts.get(root_run_id)

    def thread_halt(self, tenant: str | None, thread_key: str) -> dict[str, Any] | None:
        """The halt in force for ``tenant``'s thread ``thread_key`` (None: the telemetry names no
        tenant), or None."""
        return self._thread_halts.get((tenant or "", thread_key))

    def tool_pause(self, tenant: str | None, tool: str, upstream: str) -> dict[str, Any] | None:
        """The pause in force for ``tenant``'s ``tool`` of ``upstream`` (control v1 object), or None."""
        return self._tool_pauses.get((tenant or "", tool, upstream))

    def run_pause(self, run_id: str, tool: str, now_ms: int) -> tuple[int, dict[str, Any]] | None:
        """(until when, the decision) if the run's calls to ``tool`` are paused at ``now_ms``, else None."""
        view = self._runs.get(run_id)
        if view is None or tool not in view.paused:
            return None
        until, decision = view.paused[tool]
        if now_ms >= until:
            del view.paused[tool]
            return None
        return until, decision

    def is_suppressed(self, run_id: str, tool: str, args_hash: str, now_ms: int) -> bool:
        """Whether this call must be handed the earlier result instead of being executed."""
        view = self._runs.get(run_id)
        if view is None:
            return False
        until = view.suppressed.get((tool, args_hash))
        if until is None:
            return False
        if now_ms > until:
            del view.suppressed[(tool, args_hash)]
            return False
        return True

    def bind_task(self, run_id: str, task: asyncio.Task[Any]) -> None:
        """Cancel ``task`` when the run is halted (at once if it already is)."""
        view = self._view(run_id)
        view.tasks.add(task)
        if self.halt_decision(run_id) is not None:
            _cancel(run_id, [task])

    def unbind_task(self, run_id: str, task: asyncio.Task[Any]) -> None:
        view = self._runs.get(run_id)
        if view is not None:
            view.tasks.discard(task)

    def apply_json(self, raw: bytes | None) -> Applied:
        """Apply one control message as it came off the wire."""
        return self.apply(_decoded(raw))

    def apply(self, message: object, *, source: Source = "fleet") -> Applied:
        """Apply one control v1 object made by ``source`` (this process's fold, or the fleet); never
        raises."""
        if not _well_formed(message):
            self.counters["malformed"] += 1
            logger.debug("malformed control message ignored: %.200r", message)
            return "malformed"
        decision_id = message["decision_id"]
        if decision_id in self._seen:
            self.counters["duplicate"] += 1
            if source == "fleet" and decision_id in self._local_ids:
                del self._local_ids[decision_id]  # counted once, however often the fleet re-sends it
                self.counters["confirmed"] += 1
                for callback in self._confirmations:
                    self._notify(callback, message)
            return "duplicate"
        self._seen[decision_id] = None
        if len(self._seen) > self.max_decision_ids:
            self._seen.popitem(last=False)
        if source == "local":
            self._local_ids[decision_id] = None
            if len(self._local_ids) > self.max_decision_ids:
                self._local_ids.popitem(last=False)
        if message["action"] not in _ACTIONS:  # a newer writer's action: forward compatible
            self.counters["ignored"] += 1
            return "ignored"
        scope = message.get("scope", "run")
        if scope == "tree":
            self._act_on_tree(message["root_run_id"], message, source)
            return "applied"
        if scope == "thread":
            self._act_on_thread((message["tenant"], message["thread_key"]), message, source)
            return "applied"
        if scope == "tool":
            self._act_on_tool((message["tenant"], message["tool"], message["upstream"]), message, source)
            return "applied"
        if scope != "run":  # a scope this board does not know yet: forward compatible
            self.counters["ignored"] += 1
            return "ignored"
        run_id = message["run_id"]
        view = self._runs.get(run_id)
        if view is None and not self.watch_all:
            return self.park(run_id, message)
        self._act(run_id, view if view is not None else self._view(run_id), message, source)
        return "applied"

    def _act(self, run_id: str, view: _RunView, message: dict[str, Any], source: Source = "fleet") -> None:
        self._runs.move_to_end(run_id)
        action = message["action"]
        log_extra = {
            "run_id": run_id,
            "decision_id": message["decision_id"],
            "verdict": message.get("verdict"),
        }
        if action == "halt":
            if view.halt is None:
                view.halt = message
                logger.info("run halted: %s", message.get("reason"), extra=log_extra)
                _cancel(run_id, list(view.tasks))
        elif action == "resume":
            view.halt = None
            view.suppressed.clear()
            view.paused.clear()
            logger.info("run resumed", extra=log_extra)
        elif action == "pause":  # the run's transient streak: its calls to the tool wait
            evidence = message.get("evidence") or {}
            wait_ms = evidence.get("wait_ms")
            tool = evidence.get("tool")
            if type(tool) is str and type(wait_ms) is int and wait_ms > 0 and type(message.get("ts_ms")) is int:
                view.paused[tool] = (message["ts_ms"] + wait_ms, message)
                logger.info("run's calls to %s paused: %s", tool, message.get("reason"), extra=log_extra)
        elif action == "advise":
            view.advice = message
            logger.info("run advised: %s", message.get("reason"), extra=log_extra)
        elif action == "suppress":
            evidence = message["evidence"]
            window_ms = evidence.get("window_ms")
            if type(window_ms) is not int or window_ms <= 0:
                window_ms = self.default_window_ms
            key = (evidence["tool"], evidence["args_hash"])
            view.suppressed[key] = max(view.suppressed.pop(key, 0), message["ts_ms"] + window_ms)
            if len(view.suppressed) > _SUPPRESSIONS_PER_RUN:
                del view.suppressed[next(iter(view.suppressed))]
            logger.debug("call suppressed", extra=log_extra)
        self.counters["applied"] += 1
        if source == "local":
            self.counters["local"] += 1
        else:
            self.counters["fleet_only"] += 1
            if self._follow is not None:
                self._follow(message)
        for callback in self._callbacks:
            self._notify(callback, message)

    def _act_on_tree(self, root: str, message: dict[str, Any], source: Source) -> None:
        action = message["action"]
        log_extra = {"root_run_id": root, "decision_id": message["decision_id"], "verdict": message.get("verdict")}
        if action == "halt":
            if root not in self._tree_halts:
                self._tree_halts[root] = message
                if len(self._tree_halts) > self.max_parked_runs:
                    self._tree_halts.popitem(last=False)
                logger.info("sub-agent tree halted: %s", message.get("reason"), extra=log_extra)
                for run_id, run_root in list(self._roots.items()):
                    view = self._runs.get(run_id)
                    if run_root == root and view is not None:
                        _cancel(run_id, list(view.tasks))
        elif action == "resume":
            self._tree_halts.pop(root, None)
            logger.info("sub-agent tree resumed", extra=log_extra)
        else:
            logger.info("sub-agent tree %s: %s", action, message.get("reason"), extra=log_extra)
        self.counters["applied"] += 1
        self.counters["local" if source == "local" else "fleet_only"] += 1
        for callback in self._callbacks:
            self._notify(callback, message)

    def _act_on_thread(self, thread: tuple[str, str], message: dict[str, Any], source: Source) -> None:
        action = message["action"]
        log_extra = {"tenant": thread[0], "thread_key": thread[1], "decision_id": message["decision_id"],
                     "verdict": message.get("verdict")}
        if action == "halt":
            if thread not in self._thread_halts:
                self._thread_halts[thread] = message
                if len(self._thread_halts) > self.max_parked_runs:
                    self._thread_halts.popitem(last=False)
                logger.info("thread halted: %s", message.get("reason"), extra=log_extra)
        elif action == "resume":
            self._thread_halts.pop(thread, None)
            logger.info("thread resumed", extra=log_extra)
        else:
            logger.info("thread %s: %s", action, message.get("reason"), extra=log_extra)
        self.counters["applied"] += 1
        self.counters["local" if source == "local" else "fleet_only"] += 1
        for callback in self._callbacks:
            self._notify(callback, message)

    def _act_on_tool(self, key: tuple[str, str, str], message: dict[str, Any], source: Source) -> None:
        action = message["action"]
        log_extra = {"tenant": key[0], "tool": key[1], "upstream": key[2], "decision_id": message["decision_id"],
                     "verdict": message.get("verdict")}
        if action == "pause":
            self._tool_pauses.pop(key, None)
            self._tool_pauses[key] = message  # a pause again (its wait doubled) replaces the one before
            if len(self._tool_pauses) > self.max_parked_runs:
                self._tool_pauses.popitem(last=False)
            logger.info("tool paused: %s", message.get("reason"), extra=log_extra)
        elif action == "resume":
            self._tool_pauses.pop(key, None)
            logger.info("tool resumed", extra=log_extra)
        else:
            logger.info("tool %s: %s", action, message.get("reason"), extra=log_extra)
        self.counters["applied"] += 1
        self.counters["local" if source == "local" else "fleet_only"] += 1
        for callback in self._callbacks:
            self._notify(callback, message)

    def _notify(self, callback: DecisionCallback, message: dict[str, Any]) -> None:
        """A callback's failure is logged, never propagated: it must not stop the next decision."""
        try:
            outcome = callback(message)
            if inspect.isawaitable(outcome):
                future = asyncio.ensure_future(outcome)
                self._callback_tasks.add(future)
                future.add_done_callback(self._callback_done)
        except Exception:
            logger.exception("decision callback %r failed", callback)

    def _callback_done(self, future: asyncio.Future[Any]) -> None:
        self._callback_tasks.discard(future)
        if not future.cancelled() and future.exception() is not None:
            logger.error("decision callback failed", exc_info=future.exception())

    def _view(self, run_id: str) -> _RunView:
        view = self._runs.get(run_id)
        if view is None:
            view = self._runs[run_id] = _RunView()
            if len(self._runs) > self.max_runs:
                self._runs.popitem(last=False)
        else:
            self._runs.move_to_end(run_id)
        return view

    def park(self, run_id: str, message: Any, check: Callable[[], bool] | None = None) -> Applied:
        """Keep a message about ``run_id``, a run this process does not watch (yet), until it is watched.
        ``apply`` parks messages it has checked and marked seen (``check`` None: acted on when the run is
        watched). The listener parks fleet messages unchecked, with their ``check()`` (the signature and
        the rest): most are another process's runs, and checking each signature of the whole fleet's
        decisions would cost a runtime more than its own runs do; ``check()`` runs if the run is watched
        while the message is still parked, and then it is applied like any other. Nothing about an
        unchecked message is acted upon or remembered (its decision id is not marked seen)."""
        parked = self._parked.pop(run_id, [])
        self._parked[run_id] = [*parked, (message, check)][-_PARKED_PER_RUN:]
        if len(self._parked) > self.max_parked_runs:
            self._parked.popitem(last=False)
        self.counters["ignored"] += 1
        return "ignored"


def _run_scoped(message: object) -> str | None:
    """The run id of a decision about one run (scope ``run``, the default), else None."""
    if type(message) is dict and message.get("scope", "run") == "run":
        run_id = message.get("run_id")
        if type(run_id) is str:
            return run_id
    return None


def _decoded(raw: bytes | None) -> object:
    """The JSON value of a control message, or None (``apply`` counts that as malformed)."""
    try:
        return orjson.loads(raw) if raw is not None else None
    except orjson.JSONDecodeError:
        return None


#: The field naming the key of each scope this board acts on (``tenant`` too for a thread).
_SCOPE_KEYS = {"run": "run_id", "tree": "root_run_id", "thread": "thread_key", "tool": "tool"}


def _well_formed(message: object) -> TypeGuard[dict[str, Any]]:
    """The fields the board acts on are present and typed (the rest is the writer's business)."""
    if type(message) is not dict:
        return False
    scope = message.get("scope", "run")
    key = _SCOPE_KEYS.get(scope, "decision_id") if type(scope) is str else "decision_id"
    if type(scope) is not str or not all(
        type(message.get(name)) is str and message[name] for name in ("decision_id", key, "action")
    ):
        return False
    if scope == "thread" and type(message.get("tenant")) is not str:
        return False
    if scope == "tool" and not (type(message.get("tenant")) is str and type(message.get("upstream")) is str):
        return False
    if message["action"] != "suppress":
        return True
    evidence = message.get("evidence")
    return (
        type(evidence) is dict
        and type(evidence.get("tool")) is str
        and type(evidence.get("args_hash")) is str
        and type(message.get("ts_ms")) is int
    )


def _cancel(run_id: str, tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel the run's bound tasks, except the one applying the halt: the guard raises RunHalted in it."""
    try:
        current = asyncio.current_task()
    except RuntimeError:  # no running loop
        current = None
    for task in tasks:
        if task is not current and not task.done():
            task.cancel(f"loopwarden halted run {run_id}")


async def read_scopes(config: KafkaClientConfig, topic: str, board: ControlBoard, *,
                      trusted_keys: KeyRing | None, allow_unsigned: bool = False,
                      timeout_s: float = 10.0) -> int:
    """Apply the scope halts in force on ``topic`` (the workers' compacted scopes topic: the latest record
    of each scope key, read from the beginning) to ``board``, so a runtime started after a tree was halted
    still refuses its children. Only signed records (unless ``allow_unsigned``) not past their
    ``expires_ms``; a tombstone (no value) lifts its scope. Returns how many were applied; a missing
    topic (workers of an older release) is logged and applies none."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import TopicPartition

    if trusted_keys is None and not allow_unsigned:
        raise KafkaConfigError("trusted_keys: required to read the scopes topic (or allow_unsigned=True)")
    # A short fetch wait: offset requests queue behind a fetch on the same connection.
    consumer = AIOKafkaConsumer(**config.aiokafka_kwargs(), client_id="loopwarden-sdk-scopes", group_id=None,
                                enable_auto_commit=False, auto_offset_reset="earliest", fetch_max_wait_ms=20)
    await consumer.start()
    latest: dict[bytes, Any] = {}
    try:
        if topic not in await consumer.topics():
            logger.warning("scopes topic %s does not exist (workers of an older release, or no ACL to describe it): "
                           "tree halts made before this process started are not known here", topic,
                           extra={"topic": topic})
            return 0
        await consumer.end_offsets([TopicPartition(topic, 0)])
        partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        # Offsets before assigning (nothing is fetched yet): an empty topic costs no fetch at all.
        ends: dict[TopicPartition, int] = await consumer.end_offsets(partitions)
        starts: dict[TopicPartition, int] = await consumer.beginning_offsets(partitions)
        behind = {tp for tp, end in ends.items() if end > starts[tp]}
        if behind:
            consumer.assign(sorted(behind))
            for tp in behind:
                consumer.seek(tp, starts[tp])
        deadline = asyncio.get_running_loop().time() + timeout_s
        while behind and asyncio.get_running_loop().time() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for record in records:
                    if record.key is not None:
                        latest[record.key] = record
            behind = {tp for tp in behind if await consumer.position(tp) < ends[tp]}
        if behind:
            logger.warning("scopes topic %s: not read to its end within %.0f s", topic, timeout_s, extra={"topic": topic})
    finally:
        await consumer.stop()
    applied = 0
    now = wall_clock_ms()
    for record in latest.values():
        if record.value is None:
            continue  # a tombstone: the scope was lifted
        if trusted_keys is not None:
            from ..bus.signing import SignatureRejected

            try:
                trusted_keys.verify(record.value, record.headers)
            except SignatureRejected as exc:
                board.counters[exc.reason] += 1
                logger.warning("scope record refused (%s): %s", exc.reason, exc, extra={"topic": topic})
                continue
        message = _decoded(record.value)
        if type(message) is not dict or type(message.get("expires_ms")) is not int or message["expires_ms"] < now:
            continue
        applied += board.apply(message) == "applied"
    return applied


#: Default age beyond which a signed decision is refused as a replay (its ``ts_ms`` is the trigger's
#: event time); comfortably above the default lookback and any halt latency.
MAX_DECISION_AGE_MS: Final = 300_000


class HaltListener(StartStop):
    """Feeds a ``ControlBoard`` from the control topic: every partition, no consumer group, signed
    messages only. ``trusted_keys`` is required unless ``allow_unsigned`` (development only) is set."""

    def __init__(
        self,
        config: KafkaClientConfig,
        topic: str = "agent.control",
        *,
        trusted_keys: KeyRing | None = None,
        allow_unsigned: bool = False,
        max_age_ms: int | None = MAX_DECISION_AGE_MS,
        board: ControlBoard | None = None,
        watch_all: bool = False,
        lookback_ms: int = 60_000,
        catch_up_timeout_s: float = 10.0,
        fetch_max_wait_ms: int = 100,
        metadata_max_age_ms: int = 30_000,
        client_id: str = "loopwarden-sdk",
    ) -> None:
        if trusted_keys is None and not allow_unsigned:
            raise KafkaConfigError(
                f"trusted_keys: required, the public key(s) of the workers that sign control messages: set "
                f"{WORKER_KEYS_VAR} to their PEM files or directories (comma-separated), or pass "
                "trusted_keys=KeyRing.from_setting(...); allow_unsigned=True accepts unsigned halts from anyone "
                "who can write the topic (development only)"
            )
        self.config = config
        self.topic = topic
        self.trusted_keys = trusted_keys
        self.max_age_ms = max_age_ms
        self.board = board if board is not None else ControlBoard(watch_all=watch_all)
        self.lookback_ms = lookback_ms
        self.catch_up_timeout_s = catch_up_timeout_s
        # The broker answers a fetch as soon as one byte arrives (fetch_min_bytes=1), so this wait bounds
        # only empty polls: shortening it adds requests, not speed.
        self.fetch_max_wait_ms = fetch_max_wait_ms
        # How soon partitions added to the control topic are noticed.
        self.metadata_max_age_ms = metadata_max_age_ms
        self.client_id = client_id
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._caught_up = asyncio.Event()

    @property
    def counters(self) -> dict[str, int]:
        return self.board.counters

    async def start(self) -> None:
        """Assign every partition, rewind ``lookback_ms`` and return once caught up (or after
        ``catch_up_timeout_s``, with a warning)."""
        from aiokafka import AIOKafkaConsumer

        if self._consumer is not None:
            return
        consumer = AIOKafkaConsumer(
            **self.config.aiokafka_kwargs(),
            client_id=self.client_id,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="latest",
            fetch_max_wait_ms=self.fetch_max_wait_ms,
            metadata_max_age_ms=self.metadata_max_age_ms,
        )
        try:
            await consumer.start()  # inside the try: a refused login or certificate still closes the client
            ends = await self._assign_and_rewind(consumer)
        except BaseException:
            await consumer.stop()
            raise
        self._consumer = consumer
        self._caught_up.clear()
        self._task = asyncio.create_task(
            self._consume(consumer, ends), name=f"loopwarden-listener:{self.topic}"
        )
        try:
            await asyncio.wait_for(self._caught_up.wait(), self.catch_up_timeout_s)
        except TimeoutError:
            logger.warning(
                "control topic %s: not caught up after %.1f s; continuing while it catches up",
                self.topic,
                self.catch_up_timeout_s,
                extra={"topic": self.topic},
            )

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await consumer.stop()

    async def _assign_and_rewind(self, consumer: AIOKafkaConsumer) -> dict[TopicPartition, int]:
        """Assign all partitions at ``now - lookback_ms``; return the end offsets to catch up to."""
        from aiokafka.structs import TopicPartition

        if self.topic not in await consumer.topics():
            raise KafkaConfigError(
                f"control topic {self.topic!r} does not exist, or this principal may not see it (Kafka hides "
                "topics a principal cannot describe). Operator action: check the name and the ACLs "
                "(docs/security.md), or start the worker with LOOPWARDEN_CREATE_TOPICS=true"
            )
        # Asking for an offset of partition 0 (every topic has one) makes the client track the topic's
        # metadata, after which its partitions are known.
        await consumer.end_offsets([TopicPartition(self.topic, 0)])
        partitions = [
            TopicPartition(self.topic, p) for p in sorted(consumer.partitions_for_topic(self.topic))
        ]
        consumer.assign(partitions)
        found: dict[TopicPartition, Any] = {}
        if self.lookback_ms > 0:
            since = max(wall_clock_ms() - self.lookback_ms, 0)
            found = await consumer.offsets_for_times(dict.fromkeys(partitions, since))
        ends: dict[TopicPartition, int] = await consumer.end_offsets(partitions)
        for tp in partitions:
            hit = found.get(tp)
            consumer.seek(tp, hit.offset if hit is not None else ends[tp])
        return {tp: end for tp, end in ends.items() if found.get(tp) is not None}

    async def _consume(self, consumer: AIOKafkaConsumer, behind: dict[TopicPartition, int]) -> None:
        """Apply every control message; survive broker trouble and bad messages."""
        while True:
            try:
                if not behind:
                    self._caught_up.set()
                batches = await consumer.getmany(timeout_ms=1_000)
                for records in batches.values():
                    for record in records:
                        self.receive(record)
                for tp in list(behind):
                    if await consumer.position(tp) >= behind[tp]:
                        del behind[tp]
                await self._follow_new_partitions(consumer)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("control topic %s: consuming failed; retrying in 1 s", self.topic)
                await asyncio.sleep(1.0)

    def receive(self, record: ConsumerRecord[bytes, bytes]) -> Applied | str:
        """Check one record's signature and age, then apply it; returns what happened to it. A decision
        about a run this process does not watch (another process's, most likely) is parked unchecked
        (``ControlBoard.park``) and checked only if the run is watched while it is parked."""
        value = record.value if record.value is not None else b""
        message = _decoded(value)
        stale = self._stale(message)
        run_id = _run_scoped(message)
        if run_id is not None and not self.board.watches(run_id):
            if stale is not None:  # no concern of this process: a replay aimed at it, or old traffic
                return self._reject("expired", stale, record, warn=False)
            return self.board.park(run_id, message, lambda: self._refusal(record) is None)
        refused = self._refusal(record)
        if refused is not None:
            return refused
        if stale is not None:  # warned about when it concerns a run of this process
            return self._reject("expired", stale, record, warn=run_id is not None)
        return self.board.apply(message)

    def _refusal(self, record: ConsumerRecord[bytes, bytes]) -> str | None:
        """Why the record's signature is refused (counted and logged), or None if it is good."""
        if self.trusted_keys is None:
            return None
        from ..bus.signing import SignatureRejected

        try:
            self.trusted_keys.verify(record.value if record.value is not None else b"", record.headers)
        except SignatureRejected as exc:
            return self._reject(exc.reason, str(exc), record)
        return None

    def _stale(self, message: object) -> str | None:
        """Why the message is too old to act on, or None."""
        if self.max_age_ms is not None and type(message) is dict and type(message.get("ts_ms")) is int:
            age_ms = wall_clock_ms() - message["ts_ms"]
            if age_ms > self.max_age_ms:
                return f"decision is {age_ms // 1000} s old"
        return None

    def _reject(self, reason: str, detail: str, record: ConsumerRecord[bytes, bytes], warn: bool = True) -> str:
        self.board.counters[reason] += 1
        logger.log(logging.WARNING if warn else logging.DEBUG, "control message refused (%s): %s", reason, detail,
                   extra={"topic": record.topic, "partition": record.partition, "offset": record.offset,
                          "reason": reason})
        return reason

    async def _follow_new_partitions(self, consumer: AIOKafkaConsumer) -> None:
        """Assign partitions added to the topic since start, from their beginning, keeping positions.
        (Re-assigning resets every position, so they are read first and restored.)"""
        from aiokafka.structs import TopicPartition

        assigned = consumer.assignment()
        known = consumer.partitions_for_topic(self.topic) or set()
        if len(known) <= len(assigned):
            return
        positions = {tp: await consumer.position(tp) for tp in assigned}
        partitions = [TopicPartition(self.topic, p) for p in sorted(known)]
        consumer.assign(partitions)
        for tp in partitions:
            if tp in positions:
                consumer.seek(tp, positions[tp])
            else:
                await consumer.seek_to_beginning(tp)
        logger.info(
            "control topic %s grew to %d partitions", self.topic, len(partitions), extra={"topic": self.topic}
        )
