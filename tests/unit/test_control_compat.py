"""Control v1 is open to new actions, verdicts and evidence fields: the ControlBoard of the release before
detection round 2 (``tests/fixtures/control_board/listener_2e9ea20.py``, verbatim) given every kind of
message this release writes. A warning (``advise``, also its shadow alert) changes no run's state there; a
halt with a new verdict halts, as a halt must."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson

from stream_app.commands.replay import replay
from stream_app.core import Policy

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "control_board" / "listener_2e9ea20.py"


def _board_of_2e9ea20() -> ModuleType:
    name = "stream_app.client._listener_2e9ea20"
    spec = importlib.util.spec_from_file_location(name, FIXTURE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _line(run_id: str, n: int, tool: str, outcome: str, args: Any, result: Any, **fields: Any) -> bytes:
    return orjson.dumps({"run_id": run_id, "event_id": f"{run_id}-{n}", "tool": tool, "ts_ms": 1_700_000_000_000 + n,
                         "outcome": outcome, "args": args, "result": result, **fields}) + b"\n"


#: A run per rule that warns before it halts.
LINES = [
    *(_line("recursion", n, "search", "error", {"q": "a"}, "HTTP 503") for n in range(4)),
    *(_line("semantic", n, "search", "error", {"q": n}, "HTTP 503") for n in range(4)),
    *(_line("cycle", n, *(("read", "success", {"p": 1}, "x") if n % 2 else ("patch", "error", {"p": 1}, "no")))
      for n in range(8)),
    *(_line("reads", n, "read_file", "success", {"p": 1}, "same", tool_class="read") for n in range(4)),
    *(_line("edits", n, "apply_patch", "success", {"n": n}, "ok", tool_class="write", target="/a",
            state_hash=str(n % 2) * 64) for n in range(5)),
    *(_line("spender", n, "fetch", "success", {"u": n}, n, tokens=45) for n in range(3)),
]


def _decisions(policy: Policy) -> list[dict[str, Any]]:
    out = io.BytesIO()
    replay(LINES, policy, out, io.StringIO(), engine="python")
    return [orjson.loads(line) for line in out.getvalue().splitlines()]


def test_every_new_kind_of_message_leaves_an_old_runtime_as_it_was() -> None:
    decisions = _decisions(Policy.from_mapping({"defaults": {"max_tokens": 100}}))
    shadow = [d for d in _decisions(Policy.from_mapping({"defaults": {"shadow": True, "max_tokens": 100}}))
              if d["evidence"].get("would") == "advise"]
    warnings = [d for d in decisions if d["action"] == "advise"]
    assert {d["verdict"] for d in warnings} == {"recursion", "semantic_loop", "cycle", "no_progress", "oscillation",
                                                "budget_exceeded"}
    assert shadow
    old = _board_of_2e9ea20().ControlBoard(watch_all=True)
    for message in [*warnings, *shadow]:
        assert old.apply(message) in ("ignored", "applied")
        assert old.halt_decision(message["run_id"]) is None, message
        assert not old.is_suppressed(message["run_id"], message["evidence"]["tool"],
                                     message["evidence"]["args_hash"], message["ts_ms"] + 1)
    new_halts = [d for d in decisions if d["action"] == "halt"
                 and d["verdict"] in ("no_progress", "oscillation", "budget_exceeded")]
    assert {d["verdict"] for d in new_halts} == {"no_progress", "oscillation", "budget_exceeded"}
    for halt in new_halts:
        assert old.apply(halt) == "applied"
        assert old.halt_decision(halt["run_id"]) == halt  # a halt with a verdict it never heard of still halts


FIXTURE_73FBECA = FIXTURE.with_name("listener_73fbeca.py")


def _load_73fbeca() -> ModuleType:
    spec = importlib.util.spec_from_file_location("stream_app.client._listener_73fbeca", FIXTURE_73FBECA)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_tree_scoped_message_is_acted_on_by_no_runtime_that_does_not_know_scopes() -> None:
    """The ControlBoard of the release before scopes (73fbeca, verbatim), watching every run, given each
    tree rule's halt (and the fanout alert): it names no run, so no run there changes state; the board
    counts it and goes on."""
    module = _load_73fbeca()
    lines = [_line("root", n, "Task", "success", {"n": n}, "ok", tool_class="spawn", child_run_id=f"kid{n}",
                   child_agent_id="explorer", task_hash="f" * 16, cost_usd=0.4) for n in range(4)]
    lines += [_line("kid9", 0, "search", "success", {}, "ok", root_run_id="root", parent_run_id="kid3", depth=9)]
    out = io.BytesIO()
    replay(lines, Policy.from_mapping({"fleet": {"max_tree_runs": 4, "max_tree_cost_usd": 1.0}}), out,
           io.StringIO(), engine="python")
    tree = [orjson.loads(line) for line in out.getvalue().splitlines()]
    assert {m["verdict"] for m in tree} == {"tree_depth", "tree_recursion", "tree_fanout", "tree_budget"}
    old = module.ControlBoard(watch_all=True)
    for run in ("root", "kid0", "kid3", "kid9"):
        old.watch(run)
    for message in tree:
        assert "run_id" not in message
        assert old.apply(message) == "malformed"
        assert all(old.halt_decision(run) is None for run in ("root", "kid0", "kid3", "kid9"))


def test_thread_tool_and_operator_scope_messages_are_acted_on_by_no_runtime_that_does_not_know_scopes() -> None:
    """The same board given every other scoped message this release writes: the thread rules' halts and
    alert, a storm's pauses and resume (scope tool), and an operator's halt/pause and resume of a tree, a
    thread and a tool, as ``loopwarden halt|resume --tree|--thread|--tool`` gets them answered. None names
    a run, so none changes a run there; a run's own halt still does."""
    from stream_app.core.fleet.scope import ScopeCommand
    from stream_app.devtools.fleet_sim import simulate_storm, simulate_threads

    module = _load_73fbeca()
    _, threads = simulate_threads(8, seed=5)
    stream = sorted(threads + simulate_storm(seed=3), key=lambda e: (e["ts_ms"], e["event_id"]))
    out = io.BytesIO()
    replay([orjson.dumps(e) + b"\n" for e in stream], Policy(), out, io.StringIO(), engine="python")
    decided = [orjson.loads(line) for line in out.getvalue().splitlines()]
    scoped = [d for d in decided if d.get("scope") in ("thread", "tool")]
    assert {(d["scope"], d["action"]) for d in scoped} >= {("thread", "halt"), ("thread", "alert"),
                                                           ("tool", "pause"), ("tool", "resume")}
    keys = {"tree": ("root-7",), "thread": ("acme", "pr-7"), "tool": ("acme", "weather.lookup", "api.weather.example")}
    for scope, key in keys.items():
        for action in ("pause" if scope == "tool" else "halt", "resume"):
            command = ScopeCommand(scope, key, action, f"op-{scope}-{action}", "alice", "incident 42", 1_700_000_000_000)
            scoped.append(command.decision().to_control())
    assert {d["verdict"] for d in scoped} >= {"self_trigger", "tool_storm", "operator_halt", "operator_resume"}
    runs = sorted({e["run_id"] for e in stream})
    old = module.ControlBoard(watch_all=True)
    for run in runs:
        old.watch(run)
    for message in scoped:
        assert "run_id" not in message, message
        assert old.apply(message) == "malformed", message
    assert all(old.halt_decision(run) is None for run in runs)
    [run_halt] = [d for d in _decisions(Policy()) if d["action"] == "halt" and d["run_id"] == "recursion"]
    assert old.apply(run_halt) == "applied" and old.halt_decision("recursion") == run_halt
