"""COMPARISON BASELINE, not product code: the naive loop detector, written from its description.

"Keep the whole history of a run and rescan it on every call": each call is appended to the run's
history, and each rule looks back over the history to decide (identical failing calls within the
window, the same failure with mutating arguments, 2- and 3-call cycles, side-effect duplicates within
60 s). It reaches the same verdicts as the product on the same input; what it costs per call grows
with the run, which is what ``bench.core`` measures beside ours.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stream_app.core import TelemetryEvent, semantic_hash

FAILING = frozenset(("error", "empty", "noop"))


@dataclass
class Call:
    tool: str
    args_hash: str
    outcome: str
    result_hash: str
    ts_ms: int
    side_effect: bool


@dataclass
class NaiveRun:
    history: list[Call] = field(default_factory=list)
    halted: bool = False


def observe(run: NaiveRun, event: TelemetryEvent, budget: int = 3, window_ms: int = 600_000,
            ceiling: int = 10**9) -> str | None:
    """Append the call and rescan the history; return a halt verdict or None."""
    if run.halted:
        return None
    call = Call(event.tool, event.args_hash or semantic_hash(event.args), event.outcome,
                event.result_hash or semantic_hash(event.result), event.ts_ms, bool(event.side_effect))
    history = run.history
    history.append(call)
    horizon = call.ts_ms - window_ms
    recent = [c for c in history if c.ts_ms >= horizon]  # the rescan: every call, every time
    verdict = None
    if len(history) > ceiling:
        verdict = "iteration_ceiling"
    if verdict is None and call.side_effect:
        same = [c for c in history if c.side_effect and c.tool == call.tool and c.args_hash == call.args_hash
                and 0 <= call.ts_ms - c.ts_ms <= 60_000]
        if len(same) >= 4:
            verdict = "circuit_open"
    if verdict is None and call.outcome in FAILING:
        streak = []
        for c in reversed(recent):
            if (c.tool, c.outcome, c.result_hash) != (call.tool, call.outcome, call.result_hash):
                break
            streak.append(c)
        if len(streak) > budget:
            verdict = "recursion" if len({c.args_hash for c in streak}) == 1 else "semantic_loop"
    if verdict is None:
        signatures = [(c.tool, c.args_hash, c.outcome, c.result_hash) for c in recent]
        for period in (2, 3):
            tail = signatures[-4 * period:]
            unit = tail[-period:]
            if (len(tail) == 4 * period and tail == unit * 4 and len(set(unit)) > 1
                    and any(s[2] in FAILING for s in unit)):
                verdict = "cycle"
                break
    if verdict:
        run.halted = True
    return verdict
