"""``handoff_loop``: agents handing a run back and forth (A->B, B->A, ...) three round trips with no
successful call of another kind between halt the run at the 6th handoff; both engines agree."""

from __future__ import annotations

import io
from typing import Any

import orjson
import pytest

from stream_app.commands.replay import replay
from stream_app.core import Detector, Policy, RunState, decode_event
from stream_app.core.stored import StoredRun, decode_run, encode_run


def _handoff(n: int, source: str, target: str) -> dict[str, Any]:
    return {"run_id": "r", "event_id": f"e{n}", "tool": f"transfer_to_{target}", "ts_ms": 1_000 + n,
            "outcome": "success", "args": {}, "result": "handed off", "agent_id": source, "child_agent_id": target,
            "tool_class": "handoff"}


def _call(n: int, outcome: str = "success", agent: str = "triage") -> dict[str, Any]:
    return {"run_id": "r", "event_id": f"e{n}", "tool": "lookup_order", "ts_ms": 1_000 + n, "outcome": outcome,
            "args": {"order": n}, "result": f"order {n}", "agent_id": agent}


def _ping_pong(handoffs: int, start: int = 0) -> list[dict[str, Any]]:
    return [_handoff(start + i, *(("triage", "billing") if i % 2 == 0 else ("billing", "triage")))
            for i in range(handoffs)]


def _decisions(events: list[dict[str, Any]], policy: Policy | None = None) -> list[tuple[str, str, str]]:
    detector, state = Detector(policy or Policy()), RunState()
    return [(d.action, d.verdict, d.trigger_event_id) for e in events
            for d in detector.evaluate(state, decode_event(e)).decisions]


def test_the_6th_handoff_of_3_round_trips_halts_the_run() -> None:
    assert _decisions(_ping_pong(6)) == [("halt", "handoff_loop", "e5")]
    assert _decisions(_ping_pong(5)) == []


def test_a_successful_call_of_another_kind_between_resets_and_a_failing_one_does_not() -> None:
    progress = [*_ping_pong(4), _call(4), *_ping_pong(5, start=5)]
    assert _decisions(progress) == []  # 4, then 5 handoffs: no 6 in a row
    failing = [*_ping_pong(4), _call(4, outcome="error"), *_ping_pong(2, start=5)]
    assert _decisions(failing) == [("halt", "handoff_loop", "e6")]


def test_a_handoff_to_a_third_agent_is_not_a_round_trip() -> None:
    events = [*_ping_pong(3), _handoff(3, "triage", "refunds"), _handoff(4, "refunds", "triage"),
              _handoff(5, "triage", "refunds")]
    assert _decisions(events) == []


def test_the_rule_follows_the_policy() -> None:
    assert _decisions(_ping_pong(10), Policy.from_mapping({"defaults": {"handoff_round_trips": 0}})) == []
    assert _decisions(_ping_pong(4), Policy.from_mapping({"defaults": {"handoff_round_trips": 2}})) == \
        [("halt", "handoff_loop", "e3")]


def test_a_ping_pong_saved_mid_way_goes_on_from_its_stored_record() -> None:
    detector, state = Detector(), RunState()
    events = _ping_pong(6)
    for event in events[:3]:
        detector.evaluate(state, decode_event(event))
    again = decode_run(encode_run(StoredRun(state))).state
    verdicts = [d.verdict for e in events[3:] for d in detector.evaluate(again, decode_event(e)).decisions]
    assert verdicts == ["handoff_loop"]


def test_both_engines_replay_handoffs_byte_for_byte() -> None:
    pytest.importorskip("loopwarden_native")
    events = [*_ping_pong(4), _call(4), *_ping_pong(7, start=5)]
    for other in ("r2", "r3"):
        events += [{**e, "run_id": other, "event_id": f"{other}-{e['event_id']}"} for e in _ping_pong(6)]
    lines = [orjson.dumps(e) + b"\n" for e in events]
    outputs = []
    for name in ("native", "python"):
        out = io.BytesIO()
        replay(lines, Policy(), out, io.StringIO(), engine=name)  # type: ignore[arg-type]
        outputs.append(out.getvalue())
    assert outputs[0] == outputs[1]
    assert outputs[0].count(b'"verdict":"handoff_loop"') == 3
