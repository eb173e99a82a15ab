"""Telemetry decoding names what is wrong; every control message validates against its schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from stream_app.core import Detector, InvalidEvent, RunTable, decode_event, parse_event
from stream_app.devtools.fleet_sim import simulate_fleet

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"
GOOD: dict[str, Any] = {"run_id": "r", "event_id": "e", "tool": "t", "ts_ms": 1, "outcome": "error",
                        "args": {}, "result": None}


def _validator(name: str) -> Draft202012Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


@pytest.mark.parametrize(
    ("change", "field", "reason"),
    [
        ({"run_id": None}, "run_id", "required field is missing"),
        ({"run_id": 7}, "run_id", "must be a string, got number"),
        ({"event_id": ""}, "event_id", "must not be empty"),
        ({"ts_ms": "yesterday"}, "ts_ms", "must be an integer, got string"),
        ({"ts_ms": 1.5}, "ts_ms", "must be an integer, got 1.5"),
        ({"ts_ms": 1e30}, "ts_ms", "must be an integer, got 1e+30 (past the 64-bit range)"),  # orjson reads 10**30 so
        ({"cost_usd": -1}, "cost_usd", "must be a number >= 0, got -1"),
        ({"ts_ms": True}, "ts_ms", "must be an integer, got boolean"),
        ({"ts_ms": -1}, "ts_ms", "must be >= 0"),
        ({"ts_ms": 253_402_300_800_000}, "ts_ms", "must be <= 253402300799999 (9999-12-31T23:59:59.999Z)"),
        ({"outcome": "failed"}, "outcome", "must be one of"),
        ({"outcome": None}, "outcome", "required field is missing"),
        ({"args": None}, "args", "one of args or args_hash is required"),
        ({"args": [1]}, "args", "must be an object, got array"),
        ({"retry_budget": -2}, "retry_budget", "must be >= 0"),
        ({"retry_budget": 10**6}, "retry_budget", "must be <="),
        ({"side_effect": "yes"}, "side_effect", "must be a boolean"),
        ({"result_fp": 7}, "result_fp", "must be a non-empty string"),
        ({"result_fp": ""}, "result_fp", "must be a non-empty string"),
        ({"latency_ms": "fast"}, "latency_ms", "must be a number"),
        ({"schema_version": "2"}, "schema_version", "unsupported version"),
        ({"tool": "x" * 600}, "tool", "longer than 512"),
        ({"parent_run_id": "p"}, "root_run_id", "required when parent_run_id is set"),
        ({"root_run_id": 3}, "root_run_id", "must be a string"),
        ({"depth": -1}, "depth", "must be >= 0"),
        ({"depth": 10_001}, "depth", "must be <= 10000"),
        ({"depth": "deep"}, "depth", "must be an integer"),
        ({"task_hash": ""}, "task_hash", "must be a non-empty string"),
        ({"child_run_id": "x" * 513}, "child_run_id", "longer than 512"),
        ({"upstream": 443}, "upstream", "must be a string"),
        ({"retry_after_ms": -5}, "retry_after_ms", "must be >= 0"),
        ({"retry_after_ms": 1.5}, "retry_after_ms", "must be an integer"),
        ({"trigger": "cron"}, "trigger", "must be one of user, schedule, webhook, agent"),
        ({"thread_key": ["pr", 7]}, "thread_key", "must be a string"),
        ({"caused_by_run_id": 9}, "caused_by_run_id", "must be a string"),
    ],
)
def test_bad_fields_are_named(change: dict[str, Any], field: str, reason: str) -> None:
    """Each contract violation raises InvalidEvent naming the field and the reason."""
    raw = {**GOOD, **change}
    raw = {k: v for k, v in raw.items() if not (v is None and k in change and k != "result")}
    with pytest.raises(InvalidEvent) as info:
        decode_event(raw)
    assert info.value.field == field
    assert reason in info.value.reason


def test_result_null_is_a_result_but_absent_is_not() -> None:
    """``"result": null`` is a valid (empty) result; leaving result and result_hash out is not."""
    assert decode_event(GOOD).has_result
    with pytest.raises(InvalidEvent, match="one of result or result_hash"):
        decode_event({k: v for k, v in GOOD.items() if k != "result"})


def test_non_object_event_is_rejected() -> None:
    with pytest.raises(InvalidEvent, match="must be a JSON object, got array"):
        decode_event([GOOD])


def test_the_schema_accepts_what_the_decoder_accepts() -> None:
    """Every event of the simulated fleet is valid for both the decoder and telemetry.v1.json."""
    validator = _validator("telemetry.v1.json")
    _, stream = simulate_fleet(60, seed=3)
    for raw in stream:
        decode_event(raw)
        validator.validate(raw)


def test_every_emitted_control_message_validates() -> None:
    """All decisions the detector makes over a mixed fleet validate against control.v1.json."""
    validator = _validator("control.v1.json")
    table = RunTable(Detector())
    _, stream = simulate_fleet(400, seed=11)
    verdicts = set()
    for raw in stream:
        for decision in table.observe(decode_event(raw)).decisions:
            validator.validate(decision.to_control())
            verdicts.add(decision.verdict)
    assert verdicts == {"recursion", "semantic_loop", "cycle", "iteration_ceiling", "duplicate_call",
                        "circuit_open", "polling"}


def test_bundled_examples_validate() -> None:
    """The examples in schemas/examples/ are valid instances of their schemas."""
    telemetry, control = _validator("telemetry.v1.json"), _validator("control.v1.json")
    examples = sorted((SCHEMAS / "examples").glob("*.json"))
    assert examples
    for path in examples:
        (control if path.name.startswith("control") else telemetry).validate(json.loads(path.read_text()))


def test_every_round_2_decision_validates() -> None:
    """The decisions of the detection-round-2 rules (fingerprint streaks, no progress by reads and by
    model calls, oscillation, noop writes, each budget) validate against control.v1.json."""
    from stream_app.core import Policy

    validator = _validator("control.v1.json")
    policy = Policy.from_mapping({"defaults": {"max_tokens": 50, "max_model_calls_without_tool": 3},
                                  "agents": {"spender": {"max_cost_usd": 0.5}},
                                  "tools": {"browse": {"max_calls": 2}}})
    table = RunTable(Detector(policy))

    def ev(run_id: str, n: int, tool: str = "t", outcome: str = "success", **extra: Any) -> dict[str, Any]:
        return {"run_id": run_id, "event_id": f"{run_id}-{n}", "tool": tool, "ts_ms": n, "outcome": outcome,
                "args": {"q": 1}, "result": {"r": 1}, **extra}

    stream = [ev("fp", n, outcome="error", result=f"timeout after {100 + n}ms") for n in range(4)]
    stream += [ev("reads", n, tool_class="read", target="/a") for n in range(4)]
    stream += [ev("edits", n, tool_class="write", target="/a", state_hash=str(n % 2) * 64) for n in range(5)]
    stream += [ev("noops", n, tool_class="write", target="/a", state_hash="1" * 64) for n in range(5)]
    stream += [{"run_id": "model", "event_id": f"m{n}", "tool": "claude-x", "ts_ms": n, "outcome": "success",
                "kind": "model_call"} for n in range(3)]
    stream += [ev("tokens", n, tokens=30) for n in range(2)]
    stream += [ev("spender", n, agent_id="spender", cost_usd=0.3) for n in range(2)]
    stream += [ev("browser", n, tool="browse", args={"u": n}) for n in range(3)]
    seen = set()
    advised = set()
    for raw in stream:
        for decision in table.observe(decode_event(raw)).decisions:
            validator.validate(decision.to_control())
            if decision.action == "advise":
                advised.add(decision.verdict)
                continue
            seen.add((decision.verdict, decision.evidence.get("match") or decision.evidence.get("rule")
                      or decision.evidence.get("budget") or decision.evidence.get("effective_outcome")))
    assert seen == {("recursion", "fingerprint"), ("no_progress", "reads"), ("oscillation", None),
                    ("recursion", "exact"), ("no_progress", "model_calls"), ("budget_exceeded", "tokens"),
                    ("budget_exceeded", "cost"), ("budget_exceeded", "calls")}
    assert advised == {"recursion", "no_progress", "oscillation", "budget_exceeded"}


def test_every_tree_decision_validates_and_names_no_run() -> None:
    """Scope-tree decisions (each tree rule, its shadow form) validate against control.v1.json, which
    refuses a run_id on them (runtimes that do not know scopes must not act on them)."""
    from stream_app.core.fleet import TreeFact, TreeFold
    from stream_app.core.policy import FleetThresholds

    validator = _validator("control.v1.json")

    def fact(run: str, n: int, **kw: Any) -> TreeFact:
        fields = {"parent": None, "depth": None, "cost_micro": 0, "spawn": False, "child_run_id": None,
                  "child_agent_id": None, "task_hash": None, **kw}
        return TreeFact("root", run, f"{run}-{n}", n, fields["parent"], fields["depth"], fields["cost_micro"],
                        fields["spawn"], fields["child_run_id"], fields["child_agent_id"], fields["task_hash"], "t")

    facts = [fact("root", i, spawn=True, child_run_id=f"c{i}", child_agent_id="w", task_hash="a" * 16)
             for i in range(4)] + [fact("deep", 9, parent="c1", depth=7, cost_micro=3_000_000)]
    verdicts = set()
    for shadow in (False, True):
        fold = TreeFold(FleetThresholds(max_tree_runs=4, max_tree_cost_usd=1.0, shadow=shadow))
        for f in facts:
            for decision in fold.observe(f):
                message = decision.to_control()
                validator.validate(message)
                verdicts.add(decision.verdict)
                with pytest.raises(Exception, match="should not be valid"):
                    validator.validate({**message, "run_id": "root"})
    assert verdicts == {"tree_depth", "tree_recursion", "tree_fanout", "tree_budget"}


def test_every_thread_decision_validates_and_names_no_run() -> None:
    """Scope-thread decisions (each thread rule, its shadow form) validate against control.v1.json and
    carry the thread's tenant and key, never a run_id."""
    from stream_app.core.fleet import ThreadFact, ThreadFold
    from stream_app.core.policy import FleetThresholds

    validator = _validator("control.v1.json")
    day = 86_400_000
    facts = [ThreadFact("", "pr-1", f"b{i}", f"e{i}", i, "webhook", f"b{i - 1}" if i else None, None)
             for i in range(8)]
    facts += [ThreadFact("acme", "nightly", f"s{i}", f"f{i}", i * day, "schedule", None, "auth") for i in range(3)]
    verdicts = set()
    for shadow in (False, True):
        fold = ThreadFold(FleetThresholds(shadow=shadow))
        for f in facts:
            for decision in fold.observe(f):
                message = decision.to_control()
                validator.validate(message)
                verdicts.add(decision.verdict)
                with pytest.raises(Exception, match="should not be valid"):
                    validator.validate({**message, "run_id": "b1"})
                with pytest.raises(Exception, match="thread_key"):
                    validator.validate({k: v for k, v in message.items() if k != "thread_key"})
    assert verdicts == {"self_trigger", "schedule_failing", "thread_rate"}


def test_an_operators_tree_and_thread_decisions_validate_and_bad_commands_name_their_field() -> None:
    import orjson

    from stream_app.core.fleet.scope import ScopeCommand, decode_scope_command

    validator = _validator("control.v1.json")
    for scope, key in (("tree", ("root-1",)), ("thread", ("", "pr-7")), ("thread", ("acme", "pr-7")),
                       ("tool", ("acme", "search", "api.example.com"))):
        for action in ("pause" if scope == "tool" else "halt", "resume"):
            command = ScopeCommand(scope, key, action, "op-1", "alice", "runaway", 5, "ops-key")
            again = decode_scope_command(orjson.dumps(command.to_json()), "ops-key")
            assert again == command
            message = again.decision().to_control()
            validator.validate(message)
            assert message["verdict"] == ("operator_resume" if action == "resume" else "operator_halt")
            assert message["action"] == action and "run_id" not in message
            assert message["evidence"] == {"operator": "alice", "reason": "runaway", "command_id": "op-1",
                                           "key_id": "ops-key"}
    good = ScopeCommand("thread", ("acme", "pr-7"), "halt", "op-1", "alice", "why", 5).to_json()
    for change, field in (({"scope": "galaxy"}, "scope"), ({"thread_key": ""}, "thread_key"), ({"tenant": 3}, "tenant"),
                          ({"action": "pause"}, "action"), ({"ts_ms": -1}, "ts_ms"), ({"reason": ""}, "reason")):
        with pytest.raises(InvalidEvent) as info:
            decode_scope_command(orjson.dumps({**good, **change}))
        assert info.value.field == field


def test_every_tool_storm_decision_validates_and_names_no_run() -> None:
    from stream_app.core.fleet import ToolFact, ToolFold
    from stream_app.core.policy import FleetThresholds

    validator = _validator("control.v1.json")
    t0 = 1_764_000_000_000 - 1_764_000_000_000 % 60_000
    facts = [ToolFact("acme", "search", "api", t0, f"e{i}", f"r{i}", t0 + i, 1, 1, -1, 0, (f"r{i}",)) for i in range(10)]
    facts += [ToolFact("acme", "search", "api", t0 + 120_000, "late", "r0", t0 + 125_000, 1, 1, -1, 0, ("r0",)),
              ToolFact("acme", "search", "api", t0 + 240_000, "ok", "r1", t0 + 250_000, 1, 0, t0 + 250_000, 0, ())]
    seen = set()
    for shadow in (False, True):
        fold = ToolFold(FleetThresholds(shadow=shadow))
        for f in facts:
            for decision in fold.observe(f):
                message = decision.to_control()
                validator.validate(message)
                seen.add((message["action"], message["evidence"]["rule"]))
                with pytest.raises(Exception, match="should not be valid"):
                    validator.validate({**message, "run_id": "r1"})
    assert seen == {("pause", "storm"), ("pause", "still_failing"), ("resume", "recovered"), ("alert", "storm")}


def test_a_transient_streaks_pauses_and_halt_validate() -> None:
    """Where recursion would halt and every failure was transient: two pauses (the wait asked for), then
    the halt; each validates against control.v1.json."""
    from stream_app.core import RunState

    validator = _validator("control.v1.json")
    detector, run = Detector(), RunState()
    seen = []
    for n in range(12):
        event = decode_event({"run_id": "r", "event_id": f"e{n}", "tool": "t", "ts_ms": n, "outcome": "error",
                              "args": {}, "result": "503", "error_class": "http_503", "upstream": "u",
                              "retry_after_ms": 5_000})
        for decision in detector.evaluate(run, event).decisions:
            message = decision.to_control()
            validator.validate(message)
            seen.append((message["action"], message["evidence"].get("pause"), message["evidence"].get("wait_ms")))
    assert seen == [("advise", None, None), ("pause", 1, 5_000), ("pause", 2, 5_000), ("halt", None, None)]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"run_id":"\xff"}', "not JSON: invalid UTF-8 (invalid start byte) at byte 12"),
        (b'{"run_id":"ab\xc3"}', "not JSON: invalid UTF-8 (invalid continuation byte) at byte 14"),
        (b'{"run_id": 1 2}', "not JSON: unexpected character, expected ',' or '}' at byte 14"),
        (b'{"run_id":"r","event_id":"e","tool":"t","ts_ms":1000000000000000000000000000000,"outcome":"success",'
         b'"args":{},"result":1}', "ts_ms: must be an integer, got 1e+30 (past the 64-bit range)"),
    ],
)
def test_bytes_that_are_no_event_say_where(raw: bytes, reason: str) -> None:
    """A bad byte is pointed at where it is (orjson checks UTF-8 first and points at byte 0 for every bad
    byte); an integer past 64 bits, which orjson reads as a float, is shown."""
    with pytest.raises(InvalidEvent) as info:
        parse_event(raw)
    assert str(info.value) == reason
