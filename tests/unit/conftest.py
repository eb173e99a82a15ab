"""Builders shared by the unit tests: a run is a list of calls fed through one RunState."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from stream_app.core import Decision, Detector, Policy, RunState, TelemetryEvent, decode_event

_ids = itertools.count()


def event(tool: str = "search", outcome: str = "error", args: dict[str, Any] | None = None,
          result: Any = "HTTP 503", *, run_id: str = "run-1", ts_ms: int = 1_000, **extra: Any) -> TelemetryEvent:
    """A valid telemetry event with sensible defaults; unique event id unless one is given."""
    raw: dict[str, Any] = {
        "run_id": run_id,
        "event_id": extra.pop("event_id", f"ev-{next(_ids)}"),
        "tool": tool,
        "ts_ms": ts_ms,
        "outcome": outcome,
        "args": {"q": "refund policy"} if args is None else args,
        "result": result,
        **extra,
    }
    return decode_event(raw)


class Run:
    """One run fed call by call; remembers which call (1-based) produced which decision."""

    def __init__(self, policy: Policy | None = None) -> None:
        self.detector = Detector(policy)
        self.state = RunState()
        self.calls = 0
        #: Every decision but the warnings before a halt, which go to ``advice`` (tests/unit/test_advise.py).
        self.decisions: list[tuple[int, Decision]] = []
        self.advice: list[tuple[int, Decision]] = []

    def feed(self, ev: TelemetryEvent) -> tuple[Decision, ...]:
        self.calls += 1
        decisions = self.detector.evaluate(self.state, ev).decisions
        for d in decisions:
            (self.advice if d.action == "advise" else self.decisions).append((self.calls, d))
        return decisions

    def feed_all(self, events: list[TelemetryEvent]) -> Run:
        for ev in events:
            self.feed(ev)
        return self

    def halts(self) -> list[tuple[int, str]]:
        return [(n, d.verdict) for n, d in self.decisions if d.action == "halt"]

    def actions(self) -> list[tuple[int, str, str]]:
        return [(n, d.action, d.verdict) for n, d in self.decisions]


@pytest.fixture
def run() -> Run:
    return Run()


def replay_both(lines: list[bytes], policy: Policy) -> bytes:
    """The decisions ``loopwarden replay`` writes for ``lines``, checked byte-identical on the native
    engine and the reference."""
    import io

    from stream_app.commands.replay import replay

    outputs = []
    for engine in ("native", "python"):
        out = io.BytesIO()
        replay(lines, policy, out, io.StringIO(), engine=engine)  # type: ignore[arg-type]
        outputs.append(out.getvalue())
    assert outputs[0] == outputs[1]
    return outputs[0]
