"""Operator halts and resumes, and shadow mode: the core's side of issue 7's audited overrides."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import orjson
import pytest

from stream_app.core import InvalidEvent, OperatorCommand, Policy, decode_operator_command

from .conftest import Run, event

SCHEMA = orjson.loads((Path(__file__).parents[2] / "schemas" / "control.v1.json").read_bytes())


def _command(action: str, command_id: str = "cmd-1", ts_ms: int = 5_000) -> OperatorCommand:
    return OperatorCommand("run-1", action, command_id, "alice", "false positive on a batch job", ts_ms,  # type: ignore[arg-type]
                           "ed25519:00112233aabbccdd")


def test_an_operator_resume_lifts_a_halt_with_fresh_streaks() -> None:
    """Halted at the 4th identical failure; resumed; the same failure must fill a whole budget again."""
    run = Run()
    run.feed_all([event(ts_ms=1000 + i) for i in range(4)])
    resumed = run.detector.operate(run.state, _command("resume")).decisions
    assert [(d.action, d.verdict, d.trigger_event_id) for d in resumed] == [("resume", "operator_resume", "cmd-1")]
    assert resumed[0].evidence == {"operator": "alice", "reason": "false positive on a batch job",
                                   "command_id": "cmd-1", "key_id": "ed25519:00112233aabbccdd"}
    run.feed_all([event(ts_ms=6000 + i) for i in range(4)])
    assert run.halts() == [(4, "recursion"), (8, "recursion")]


def test_an_operator_halt_stops_the_run_and_a_repeated_command_is_a_duplicate() -> None:
    run = Run()
    run.feed(event(outcome="success", result="ok"))
    first = run.detector.operate(run.state, _command("halt"))
    assert [(d.action, d.verdict) for d in first.decisions] == [("halt", "operator_halt")]
    assert run.detector.operate(run.state, _command("halt")).duplicate
    run.feed_all([event(ts_ms=2000 + i) for i in range(10)])
    assert run.decisions == []  # halted: later calls decide nothing


def test_operator_decisions_validate_against_the_control_schema() -> None:
    run = Run()
    for action, command_id in (("halt", "c-1"), ("resume", "c-2")):
        for decision in run.detector.operate(run.state, _command(action, command_id)).decisions:
            jsonschema.validate(decision.to_control(), SCHEMA)


def test_operator_command_round_trips_and_bad_fields_are_named() -> None:
    command = _command("resume")
    decoded = decode_operator_command(orjson.dumps(command.to_json()), command.key_id)
    assert decoded == command
    for field, value in (("action", "delete"), ("operator", ""), ("ts_ms", "now"), ("kind", "telemetry")):
        with pytest.raises(InvalidEvent) as caught:
            decode_operator_command(orjson.dumps(command.to_json() | {field: value}))
        assert caught.value.field == field


SHADOW = Policy.from_mapping({"tools": {"search": {"shadow": True}, "send_email": {"shadow": True}}})


def test_shadow_mode_alerts_instead_of_halting_and_the_run_goes_on() -> None:
    """A shadowed tool's loop is reported as an alert each time it fills its budget (and its warning
    before, as an alert that would have advised: it reaches no model); another tool's loop in the same run
    still halts."""
    run = Run(SHADOW)
    run.feed_all([event(ts_ms=1000 + i) for i in range(8)])
    assert [(n, a, v, d.evidence["would"]) for (n, d), (_, a, v) in zip(run.decisions, run.actions(), strict=True)] == [
        (3, "alert", "recursion", "advise"), (4, "alert", "recursion", "halt"),
        (7, "alert", "recursion", "advise"), (8, "alert", "recursion", "halt")]
    alert = run.decisions[1][1]
    assert alert.evidence["shadow"] is True and alert.evidence["would"] == "halt"
    assert alert.reason.startswith("shadow mode, would halt: ")
    jsonschema.validate(alert.to_control(), SCHEMA)
    run.feed_all([event(tool="fetch", ts_ms=2000 + i) for i in range(4)])
    assert run.halts() == [(12, "recursion")]
    assert [(n, d.action) for n, d in run.advice] == [(11, "advise")]  # not shadowed: a real warning


def test_shadow_mode_turns_suppress_into_alerts() -> None:
    run = Run(SHADOW)
    run.feed_all([event(tool="send_email", outcome="success", result="sent", side_effect=True, ts_ms=1000 + i)
                  for i in range(3)])
    assert [(n, a, v, d.evidence.get("would")) for (n, d), (_, a, v) in zip(run.decisions, run.actions(), strict=True)] == [
        (2, "alert", "duplicate_call", "suppress"), (3, "alert", "duplicate_call", "suppress")]


@pytest.mark.parametrize(("scope", "target", "key"), [
    ("thread", "acme/pr-7", ("acme", "pr-7")),
    ("thread", "/pr-7", ("", "pr-7")),
    ("thread", "acme/pr/7", ("acme", "pr/7")),  # the last part as it is
    ("thread", "acme%2Feu/pr-7", ("acme/eu", "pr-7")),  # a tenant with a slash, as its scope key writes it
    ("thread", "100%25/pr-7", ("100%", "pr-7")),
    ("tool", "acme%2Feu/search%2Fv2/api.example.com/v1", ("acme/eu", "search/v2", "api.example.com/v1")),
    ("tree", "root%2F1", ("root%2F1",)),  # one part: the last, as it is
])
def test_an_operators_scope_target_is_read_as_its_scope_key_writes_it(scope: str, target: str,
                                                                       key: tuple[str, ...]) -> None:
    """``--thread`` and ``--tool`` name a key as ``key_text`` writes it, so a tenant with a ``/`` can be
    named (it could not: the tenant ended at its first ``/``, and ``%2F`` was taken literally)."""
    from stream_app.commands.operator import parse_scope
    from stream_app.core.fleet.scope import key_text

    assert parse_scope(scope, target) == key
    assert key_text(key) == target
