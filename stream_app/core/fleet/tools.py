"""Tool storms: one upstream degrading under every run that calls it, folded by (tenant, tool, upstream).

When an API or an MCP server degrades, every concurrent run hits the same 429/5xx wall; per-run rules
would make N separate halts while the agents' retries keep the upstream above its rate limit. The right
answer is one incident and one fleet-wide pause of that tool. A call names its upstream (``upstream``:
the host or MCP server; calls naming none are not counted here) and a failing call its class
(``error_class``); the transient classes are ``TRANSIENT_CLASSES`` and ``http_500``..``http_599``, and
no other 4xx than 429 is ever transient.

Counts are kept per epoch-aligned window of event time (``STORM_WINDOW_MS``, 60 s). ``tool_storm``
(action ``pause``, scope ``tool``) fires at the fact that makes a window's transient failures come from
at least ``storm_min_runs`` (10) distinct runs and make up at least half of the key's calls in it; once
per window, and not while the tool is paused. The pause's wait is the largest ``retry_after_ms`` seen in
the window, capped at ``storm_max_wait_ms`` (10 min), else ``storm_wait_ms`` (60 s).
A key keeps its latest ``MAX_TOOL_WINDOWS`` (4) windows; a fact of a window older than all of them is
late and counts in none (the half-open cycle still hears it), so a window fires at most once however late
its facts come.

Half-open: after the wait each runtime admits at most one call per paused key per wait (with 0-20%
jitter); the fold publishes ``resume`` at the first success of the key at or after the pause's time +
its wait, and pauses again with the wait doubled (capped) when a fact comes twice the wait after the
pause with no such success. Those two follow the facts as they arrive: when facts of several partitions
interleave, the fleet may pause again more or fewer times than replay and resume at another fact (or,
by the end of a stream, where replay has not yet). The incident itself, the first pause (its id the
window's), is the same in replay and the fleet whenever the window's counts cross the rule in both
orders (tests/integration/test_fleet_folds.py); a fact order that crosses "half the calls" only for a
while could make one pause and not the other.

A fact here is what a batch of one source partition says about one key and window (the worker sums its
events' calls, and lists the source offsets they came from: ``offsets``, and ``transient_offsets`` of the
transient failures among them); replay and the SDK fold one event at a time (``tool_fact``, no offsets),
the same sums. ``past`` recounts a fact for the offsets above a high-water mark: a batch folded again
after a crash, its edges cut elsewhere, counts each call once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Final, NamedTuple

import orjson

from ..contract import TRANSIENT_CLASSES, TelemetryEvent, is_transient

__all__ = ["TRANSIENT_CLASSES", "ToolFact", "ToolFold", "ToolState", "fold", "is_transient", "merge", "tool_fact"]
from ..policy import FleetThresholds
from .scope import ScopeDecision, key_text, scope_decision_id

#: The storm's counting window (event time, epoch-aligned).
STORM_WINDOW_MS: Final = 60_000
#: Windows one key keeps; distinct failing runs one window lists at most (the rule needs ``storm_min_runs``).
MAX_TOOL_WINDOWS: Final = 4
MAX_LISTED_RUNS: Final = 64
#: Keys tracked at most by one fold (the least recently active are forgotten first).
DEFAULT_MAX_TOOLS: Final = 1_000_000


class ToolFact(NamedTuple):
    """What some calls (one event, or a batch's events of one source partition) tell the tool fold
    about one key and window."""

    tenant: str
    tool: str
    upstream: str
    window_ms: int
    #: The last event counted (the trigger of a decision this fact crosses), and its run and time.
    event_id: str
    run_id: str
    ts_ms: int
    calls: int
    transient: int
    #: The time of the latest success counted (-1: none), and the largest ``retry_after_ms`` asked for.
    success_ts_ms: int
    retry_after_ms: int
    #: The runs whose calls failed transiently (distinct, at most ``MAX_LISTED_RUNS``).
    failing_runs: tuple[str, ...]
    #: The source offsets of the calls counted, ascending (a worker's fact; none from replay or the SDK),
    #: and of the transient failures among them.
    offsets: tuple[int, ...] = ()
    transient_offsets: tuple[int, ...] = ()

    @classmethod
    def of(cls, *fields: Any) -> ToolFact:
        """The fact of its fields as a facts message lists them (the failing runs and the offsets lists)."""
        return cls(*fields[:11], *map(tuple, fields[11:]))

    def past(self, high_water: int) -> ToolFact:
        """This fact counting only its calls at source offsets above ``high_water`` (all of them, if it
        lists no offsets). Its distinct failing runs, latest success and largest wait stand: counting
        them again changes nothing."""
        if not self.offsets or self.offsets[0] > high_water:
            return self
        offsets = tuple(o for o in self.offsets if o > high_water)
        transient = tuple(o for o in self.transient_offsets if o > high_water)
        return self._replace(calls=len(offsets), transient=len(transient), offsets=offsets, transient_offsets=transient)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.tenant, self.tool, self.upstream)

    @property
    def key_text(self) -> str:
        return key_text(self.key)


def tool_fact(event: TelemetryEvent) -> ToolFact | None:
    """The fact of one tool call that names its upstream, or None."""
    if event.upstream is None or event.kind == "model_call":
        return None
    transient = event.outcome == "error" and is_transient(event.error_class)
    ts = event.ts_ms
    return ToolFact(event.tenant or "", event.tool, event.upstream, ts - ts % STORM_WINDOW_MS, event.event_id,
                    event.run_id, ts, 1, int(transient), ts if event.outcome == "success" else -1,
                    event.retry_after_ms or 0, (event.run_id,) if transient else ())


def merge(facts: Iterable[ToolFact]) -> list[ToolFact]:
    """Facts of the same key and window summed (in the order their keys first came; the last event of
    each is its trigger)."""
    out: dict[tuple[str, str, str, int], ToolFact] = {}
    for fact in facts:
        mark = (fact.tenant, fact.tool, fact.upstream, fact.window_ms)
        known = out.get(mark)
        if known is None:
            out[mark] = fact
            continue
        runs = known.failing_runs
        if fact.failing_runs and len(runs) < MAX_LISTED_RUNS:
            runs = tuple(dict.fromkeys(runs + fact.failing_runs))[:MAX_LISTED_RUNS]
        out[mark] = ToolFact(fact.tenant, fact.tool, fact.upstream, fact.window_ms, fact.event_id, fact.run_id,
                             max(known.ts_ms, fact.ts_ms), known.calls + fact.calls, known.transient + fact.transient,
                             max(known.success_ts_ms, fact.success_ts_ms),
                             max(known.retry_after_ms, fact.retry_after_ms), runs,
                             tuple(sorted(known.offsets + fact.offsets)),
                             tuple(sorted(known.transient_offsets + fact.transient_offsets)))
    return list(out.values())


class ToolState:
    """One (tenant, tool, upstream): its recent windows' counts and the pause in force."""

    __slots__ = ("fired", "last_ts_ms", "pause", "sources", "windows")

    def __init__(self) -> None:
        #: window start (as text) -> [calls, transient, failing runs (up to storm_min_runs), max retry_after_ms]
        self.windows: dict[str, list[Any]] = {}
        #: The pause in force: [since ts_ms, wait_ms, ordinal, window], or None.
        self.pause: list[Any] | None = None
        self.fired: set[str] = set()
        self.last_ts_ms = 0
        #: The adapter's bookkeeping: the highest offset folded per source partition (the worker's).
        self.sources: dict[str, int] = {}

    def encode(self) -> bytes:
        return orjson.dumps({"v": 1, "w": self.windows, "p": self.pause, "f": sorted(self.fired),
                             "ts": self.last_ts_ms, "s": self.sources})

    @classmethod
    def decode(cls, raw: bytes) -> ToolState:
        obj = orjson.loads(raw)
        if type(obj) is not dict or obj.get("v") != 1:
            raise ValueError(f"not a tool record of format 1: {raw[:60]!r}")
        state = cls()
        state.windows, state.pause, state.fired = obj["w"], obj["p"], set(obj["f"])
        state.last_ts_ms, state.sources = obj["ts"], obj.get("s", {})
        return state


class ToolFold:
    """(tenant, tool, upstream) -> ToolState, least recently active first, forgotten after
    ``tool_ttl_ms`` of event time without a fact (or beyond ``max_tools``)."""

    def __init__(self, fleet: FleetThresholds | None = None, max_tools: int = DEFAULT_MAX_TOOLS) -> None:
        self.fleet = fleet or FleetThresholds()
        self.max_tools = max_tools
        self.tools: OrderedDict[tuple[str, str, str], ToolState] = OrderedDict()
        self._watermark_ms = 0

    def __len__(self) -> int:
        return len(self.tools)

    def observe(self, fact: ToolFact) -> tuple[ScopeDecision, ...]:
        tools = self.tools
        key = fact.key
        state = tools.get(key)
        if state is None:
            state = tools[key] = ToolState()
        else:
            tools.move_to_end(key)
        decisions = fold(self.fleet, state, fact)
        if fact.ts_ms > self._watermark_ms:
            self._watermark_ms = fact.ts_ms
        horizon = self._watermark_ms - self.fleet.tool_ttl_ms
        while tools:
            oldest = next(iter(tools.values()))
            if oldest.last_ts_ms >= horizon and len(tools) <= self.max_tools:
                break
            tools.popitem(last=False)
        return decisions


def fold(fleet: FleetThresholds, state: ToolState, fact: ToolFact) -> tuple[ScopeDecision, ...]:
    """Fold one fact into its key; the decisions it crossed."""
    if fact.ts_ms > state.last_ts_ms:
        state.last_ts_ms = fact.ts_ms
    window = str(fact.window_ms)
    counts = state.windows.get(window)
    if counts is None:
        windows = state.windows
        if len(windows) >= MAX_TOOL_WINDOWS and fact.window_ms < min(map(int, windows)):
            # older than every window kept: too late to count, and its fired mark may be gone (it would
            # repeat that window's pause, same id); only the half-open cycle still hears it
            return _half_open(fleet, state, fact) if state.pause is not None else ()
        counts = windows[window] = [0, 0, [], 0]
        if len(windows) > MAX_TOOL_WINDOWS:
            del windows[min(windows, key=int)]
    counts[0] += fact.calls
    counts[1] += fact.transient
    runs: list[str] = counts[2]
    for run in fact.failing_runs:
        if len(runs) >= fleet.storm_min_runs:
            break
        if run not in runs:
            runs.append(run)
    counts[3] = max(counts[3], fact.retry_after_ms)

    if state.pause is not None:
        return _half_open(fleet, state, fact)
    calls, transient = counts[0], counts[1]
    if not (fleet.storm_min_runs and len(runs) >= fleet.storm_min_runs and 2 * transient >= calls
            and ("tool_storm\x1f" + window) not in state.fired):
        return ()
    state.fired.add("tool_storm\x1f" + window)
    _trim_fired(state)
    wait = min(counts[3], fleet.storm_max_wait_ms) if counts[3] else fleet.storm_wait_ms
    decision = _decision(
        fleet, fact, "pause", window,
        {"rule": "storm", "window_start_ms": fact.window_ms, "runs": len(runs), "calls": calls,
         "transient": transient, "wait_ms": wait, "pauses": 1, "storm_min_runs": fleet.storm_min_runs},
        f"tool {fact.tool} of {fact.upstream} is failing for the whole fleet: {transient} of {calls} calls "
        f"in a minute failed transiently, from {len(runs)} runs; paused for {wait / 1000:g} s, then one "
        "call per wait per runtime until one succeeds")
    if decision.action == "pause":  # in shadow mode an alert, and nothing is paused
        state.pause = [fact.ts_ms, wait, 1, window]
    return (decision,)


def _half_open(fleet: FleetThresholds, state: ToolState, fact: ToolFact) -> tuple[ScopeDecision, ...]:
    """A fact while the key is paused: ``resume`` at a success after the wait, or ``pause`` again (the
    wait doubled, capped) at a fact twice the wait after the pause."""
    assert state.pause is not None
    since, wait, ordinal, paused_window = state.pause
    if fact.success_ts_ms >= since + wait:
        state.pause = None
        # the failures counted so far were the storm's: only a window after this one starts another
        state.fired.update("tool_storm\x1f" + w for w in state.windows)
        _trim_fired(state)
        return (_decision(fleet, fact, "resume", f"{paused_window}:{ordinal}",
                          {"rule": "recovered", "paused_at_ms": since, "wait_ms": wait, "pauses": ordinal},
                          f"tool {fact.tool} of {fact.upstream} recovered: a call succeeded after the "
                          f"{wait / 1000:g} s pause ({fact.tenant or 'no tenant'})"),)
    if fact.ts_ms >= since + 2 * wait:
        wait = min(2 * wait, fleet.storm_max_wait_ms)
        state.pause = [fact.ts_ms, wait, ordinal + 1, paused_window]
        return (_decision(fleet, fact, "pause", f"{paused_window}:{ordinal + 1}",
                          {"rule": "still_failing", "window_start_ms": int(paused_window), "wait_ms": wait,
                           "pauses": ordinal + 1},
                          f"tool {fact.tool} of {fact.upstream} did not recover within twice its pause: "
                          f"paused again for {wait / 1000:g} s"),)
    return ()


def _trim_fired(state: ToolState) -> None:
    """Keep the fired marks of the last ``MAX_TOOL_WINDOWS`` windows (the older ones cannot fire again)."""
    while len(state.fired) > MAX_TOOL_WINDOWS:
        state.fired.discard(min(state.fired, key=lambda f: int(f.split("\x1f")[1])))


def _decision(fleet: FleetThresholds, fact: ToolFact, action: str, part: str, evidence: dict[str, Any],
              reason: str) -> ScopeDecision:
    key = fact.key
    if fleet.shadow and action == "pause":
        evidence = {**evidence, "shadow": True, "would": action}
        action = "alert"
    return ScopeDecision("tool", key, action, "tool_storm", fact.event_id, fact.run_id,
                         scope_decision_id("tool", key, action, "tool_storm", part), fact.ts_ms, reason,
                         {"upstream": fact.upstream, **evidence}, fact.tenant)
