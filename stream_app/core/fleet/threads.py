"""Self-triggering chains: runs on one thread (a PR, an issue, a channel), folded by (tenant, thread key).

A run says which thread it works on (``thread_key``), what started it (``trigger``) and, when a run
started it, which one (``caused_by_run_id``). Every event of such a run is a fact here, so the fold sees
a run however late its first event comes. Three rules, each at most once per thread (``thread_rate``
once per hour window):

* ``self_trigger``: a run of generation ``self_trigger_generation`` (3). A ``user``-triggered run is
  generation 0; a run caused by a run of the same thread is that run's generation + 1; any other run
  is generation 0. Generations follow the causes seen so far (a cause seen late raises its effects
  then), so the decision does not depend on the order the facts came in. The bot whose comment
  triggers its own next run.
* ``schedule_failing``: ``schedule_failing_runs`` (3) consecutive ``schedule``-triggered runs of the
  thread (by their first event's time) whose first failing call (outcome ``error``) failed with the
  same error class: at the failing call that completes the streak. Scheduled runs firing into the same
  auth error for days.
* ``thread_rate`` (an alert): more than ``max_thread_runs_per_hour`` (6) runs not triggered by a user
  start on the thread in one hour (epoch-aligned windows of event time, a run in the window of its
  first event). Counting only the runs no user started keeps it monotone: every order of the same
  facts raises the same alerts.

``self_trigger`` and ``schedule_failing`` halt the thread: a runtime refuses new runs on it at
``Guard.run`` (the runs already going finish). The tenant is what the telemetry asserts (an empty
string when it names none): one tenant's thread is never another's.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Any, NamedTuple

import orjson

from ..contract import TelemetryEvent
from ..policy import FleetThresholds
from .scope import ScopeDecision, key_text, scope_decision_id

#: Threads tracked at most by one fold (the least recently active are forgotten first).
DEFAULT_MAX_THREADS = 1_000_000
#: Runs one thread keeps (the earliest started are forgotten first); hour windows it keeps.
MAX_THREAD_RUNS = 512
MAX_THREAD_HOURS = 48
HOUR_MS = 3_600_000
#: Run ids an evidence chain lists at most.
CHAIN_LISTED = 10

# A run's record: [first ts_ms, trigger, caused_by_run_id, first failure class, generation]
_START, _TRIGGER, _CAUSE, _FAILURE, _GEN = range(5)


class ThreadFact(NamedTuple):
    """What one new event of a run on a thread tells the thread fold."""

    tenant: str
    thread_key: str
    run_id: str
    event_id: str
    ts_ms: int
    trigger: str | None
    caused_by: str | None
    #: The error class of a failing call (outcome ``error``; ``error`` when it names no class), else None.
    failure: str | None

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.thread_key)

    @property
    def key_text(self) -> str:
        return key_text(self.key)


def thread_fact(event: TelemetryEvent) -> ThreadFact | None:
    """The fact of ``event``, or None when its run names no thread."""
    if event.thread_key is None:
        return None
    failure = (event.error_class or "error") if event.outcome == "error" else None
    return ThreadFact(event.tenant or "", event.thread_key, event.run_id, event.event_id, event.ts_ms,
                      event.trigger, event.caused_by_run_id, failure)


class ThreadState:
    """One thread: its runs (first time, trigger, cause, first failure class, generation), the runs
    started per hour window that no user triggered, and the rules that fired."""

    __slots__ = ("effects", "fired", "hours", "last_ts_ms", "runs", "sources")

    def __init__(self) -> None:
        self.runs: dict[str, list[Any]] = {}
        #: cause -> the runs it caused (derived from ``runs``).
        self.effects: dict[str, list[str]] = {}
        #: hour window start (as text) -> runs started in it that no user triggered.
        self.hours: dict[str, int] = {}
        self.fired: set[str] = set()
        self.last_ts_ms = 0
        #: The adapter's bookkeeping: the highest offset folded per source partition (the worker's).
        self.sources: dict[str, int] = {}

    def encode(self) -> bytes:
        return orjson.dumps({"v": 1, "r": self.runs, "h": self.hours, "f": sorted(self.fired),
                             "ts": self.last_ts_ms, "s": self.sources})

    @classmethod
    def decode(cls, raw: bytes) -> ThreadState:
        obj = orjson.loads(raw)
        if type(obj) is not dict or obj.get("v") != 1:
            raise ValueError(f"not a thread record of format 1: {raw[:60]!r}")
        state = cls()
        state.runs, state.hours, state.fired = obj["r"], obj["h"], set(obj["f"])
        state.last_ts_ms, state.sources = obj["ts"], obj.get("s", {})
        for run_id, run in state.runs.items():
            if run[_CAUSE] is not None:
                state.effects.setdefault(run[_CAUSE], []).append(run_id)
        return state


class ThreadFold:
    """(tenant, thread key) -> ThreadState, least recently active first, forgotten after
    ``thread_ttl_ms`` of event time without a fact (or beyond ``max_threads``)."""

    def __init__(self, fleet: FleetThresholds | None = None, max_threads: int = DEFAULT_MAX_THREADS) -> None:
        self.fleet = fleet or FleetThresholds()
        self.max_threads = max_threads
        self.threads: OrderedDict[tuple[str, str], ThreadState] = OrderedDict()
        self._watermark_ms = 0

    def __len__(self) -> int:
        return len(self.threads)

    def observe(self, fact: ThreadFact) -> tuple[ScopeDecision, ...]:
        threads = self.threads
        key = fact.key
        state = threads.get(key)
        if state is None:
            state = threads[key] = ThreadState()
        else:
            threads.move_to_end(key)
        decisions = fold(self.fleet, state, fact)
        if fact.ts_ms > self._watermark_ms:
            self._watermark_ms = fact.ts_ms
        horizon = self._watermark_ms - self.fleet.thread_ttl_ms
        while threads:
            oldest = next(iter(threads.values()))
            if oldest.last_ts_ms >= horizon and len(threads) <= self.max_threads:
                break
            threads.popitem(last=False)
        return decisions


def fold(fleet: FleetThresholds, state: ThreadState, fact: ThreadFact) -> tuple[ScopeDecision, ...]:
    """Fold one fact into its thread; the decisions it crossed."""
    if fact.ts_ms > state.last_ts_ms:
        state.last_ts_ms = fact.ts_ms
    runs, run_id = state.runs, fact.run_id
    run = runs.get(run_id)
    cap = fleet.self_trigger_generation or 1
    generation_reached: str | None = None
    failed_now = False
    if run is None:
        run = [fact.ts_ms, fact.trigger, fact.caused_by if fact.caused_by != run_id else None, None, 0]
        runs[run_id] = run
        _count_hour(state, run, 1)
        if run[_CAUSE] is not None:
            state.effects.setdefault(run[_CAUSE], []).append(run_id)
        generation_reached = _raise_generation(state, run_id, _generation_of(state, run), cap)
        if len(runs) > MAX_THREAD_RUNS:
            _forget_earliest(state)
    else:
        if fact.ts_ms < run[_START] or (run[_TRIGGER] is None and fact.trigger is not None):
            _count_hour(state, run, -1)
            run[_START] = min(run[_START], fact.ts_ms)
            run[_TRIGGER] = run[_TRIGGER] or fact.trigger
            _count_hour(state, run, 1)
            generation_reached = _raise_generation(state, run_id, _generation_of(state, run), cap)
    if fact.failure is not None and run[_FAILURE] is None:
        run[_FAILURE] = fact.failure
        failed_now = True

    out: list[ScopeDecision] = []
    fired = state.fired
    if fleet.self_trigger_generation and generation_reached is not None and "self_trigger" not in fired:
        fired.add("self_trigger")
        chain = _cause_chain(state, generation_reached)
        out.append(_decision(
            fleet, fact, "halt", "self_trigger", "",
            {"rule": "generation", "generation": fleet.self_trigger_generation,
             "self_trigger_generation": fleet.self_trigger_generation, "chain": chain},
            f"thread {fact.thread_key} triggers itself: run {generation_reached} is generation "
            f"{fleet.self_trigger_generation}, each run caused by the one before on the same thread "
            f"({' <- '.join(chain)})"))
    if fleet.schedule_failing_runs and failed_now and run[_TRIGGER] == "schedule" and "schedule_failing" not in fired:
        streak = _failing_streak(state, run_id, fleet.schedule_failing_runs)
        if streak is not None:
            fired.add("schedule_failing")
            out.append(_decision(
                fleet, fact, "halt", "schedule_failing", "",
                {"rule": "schedule", "error_class": fact.failure, "runs": streak,
                 "schedule_failing_runs": fleet.schedule_failing_runs},
                f"thread {fact.thread_key}: {len(streak)} scheduled runs in a row failed with {fact.failure} "
                f"({', '.join(streak)})"))
    window = _window(run)
    if window is not None:
        count = state.hours.get(window, 0)
        if count > fleet.max_thread_runs_per_hour and ("thread_rate\x1f" + window) not in fired:
            fired.add("thread_rate\x1f" + window)
            out.append(_decision(
                fleet, fact, "alert", "thread_rate", window,
                {"rule": "rate", "runs": count, "window_start_ms": int(window),
                 "max_thread_runs_per_hour": fleet.max_thread_runs_per_hour},
                f"thread {fact.thread_key}: {count} runs no user triggered started within one hour "
                f"(over {fleet.max_thread_runs_per_hour})", shadowable=False))
    return tuple(out)


def _window(run: list[Any]) -> str | None:
    """The hour window a run counts in (as text), or None for a user-triggered run."""
    return None if run[_TRIGGER] == "user" else str(run[_START] - run[_START] % HOUR_MS)


def _count_hour(state: ThreadState, run: list[Any], delta: int) -> None:
    window = _window(run)
    if window is None:
        return
    hours = state.hours
    count = hours.get(window, 0) + delta
    if count > 0:
        hours[window] = count
        if len(hours) > MAX_THREAD_HOURS:
            del hours[min(hours, key=int)]
    else:
        hours.pop(window, None)


def _generation_of(state: ThreadState, run: list[Any]) -> int:
    """What a run's own record says its generation is: 0 for a user's run or one with no known cause."""
    if run[_TRIGGER] == "user":
        return 0
    cause = state.runs.get(run[_CAUSE]) if run[_CAUSE] is not None else None
    return 0 if cause is None else cause[_GEN] + 1


def _raise_generation(state: ThreadState, run_id: str, generation: int, cap: int) -> str | None:
    """Set ``run_id``'s generation to at least ``generation`` and raise the runs it caused from it
    (capped: a cycle of causes ends); the first run put at the cap, if any."""
    reached = None
    runs, effects = state.runs, state.effects
    stack = [(run_id, min(generation, cap))]
    while stack:
        current, gen = stack.pop()
        run = runs.get(current)
        if run is None or gen < run[_GEN] or (gen == run[_GEN] and current != run_id):
            continue
        run[_GEN] = gen
        if reached is None and gen >= cap:
            reached = current
        stack.extend((effect, min(gen + 1, cap)) for effect in effects.get(current, ())
                     if effect in runs and runs[effect][_TRIGGER] != "user")
    return reached


def _cause_chain(state: ThreadState, run_id: str) -> list[str]:
    chain = [run_id]
    cause = state.runs[run_id][_CAUSE]
    while cause is not None and cause in state.runs and cause not in chain and len(chain) < CHAIN_LISTED:
        chain.append(cause)
        cause = state.runs[cause][_CAUSE]
    return chain


def _failing_streak(state: ThreadState, run_id: str, length: int) -> list[str] | None:
    """``length`` consecutive scheduled runs (by first event) including ``run_id`` whose first failure
    has the same class, earliest first; None if there are none."""
    scheduled = sorted((run[_START], rid) for rid, run in state.runs.items() if run[_TRIGGER] == "schedule")
    at = bisect.bisect_left(scheduled, (state.runs[run_id][_START], run_id))
    failure = state.runs[run_id][_FAILURE]
    for first in range(max(0, at - length + 1), at + 1):
        window = scheduled[first:first + length]
        if len(window) == length and all(state.runs[rid][_FAILURE] == failure for _, rid in window):
            return [rid for _, rid in window]
    return None


def _forget_earliest(state: ThreadState) -> None:
    earliest = min(state.runs, key=lambda rid: (state.runs[rid][_START], rid))
    run = state.runs.pop(earliest)
    if run[_CAUSE] is not None:
        effects = state.effects.get(run[_CAUSE])
        if effects is not None and earliest in effects:
            effects.remove(earliest)


def _decision(fleet: FleetThresholds, fact: ThreadFact, action: str, verdict: str, part: str,
              evidence: dict[str, Any], reason: str, shadowable: bool = True) -> ScopeDecision:
    key = fact.key
    if fleet.shadow and shadowable:
        evidence = {**evidence, "shadow": True, "would": action}
        action = "alert"
    return ScopeDecision("thread", key, action, verdict, fact.event_id, fact.run_id,
                         scope_decision_id("thread", key, action, verdict, part), fact.ts_ms, reason, evidence,
                         fact.tenant)
