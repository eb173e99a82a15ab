"""The native replay engine (native/, ``loopwarden_native``) against the reference core, differentially:
same semantic hashes, same decisions byte for byte, and a fast path that never accepts a line the
reference refuses. ``make install`` builds the engine, so these tests run in ``make test``.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import loopwarden_native
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stream_app.commands.replay import replay
from stream_app.core import (
    DEFAULT_IGNORED_FIELDS,
    FieldFilter,
    InvalidEvent,
    Policy,
    parse_event,
    semantic_hash,
)

REPO = Path(__file__).resolve().parents[2]

FILTERS = {
    "default": FieldFilter(),
    "custom": FieldFilter((*DEFAULT_IGNORED_FIELDS, "*_token", "session?"), keep=("ts",)),
}

# Keys from the ignore list (every spelling the filter folds), near misses and plain names.
keys = st.sampled_from(["query", "limit", "url", "page", "attempt", "requestId", "Request-ID", "nonce",
                        "created_at", "ts", "retry_count", "api_token", "session1", "attempts_left",
                        "é", "Z", "a b", "\u2028"]) | st.text(max_size=8)
# Whitespace Python splits on (wider than Unicode's White_Space), and characters that JSON escapes.
texts = st.text(alphabet=st.sampled_from(" \t\n\x0b\x0c\r\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u200a\u2028"
                                         "\u202f\u205f\u3000\u200b\x00\x01\x7f\"\\/éa1ZΣς😀"), max_size=12)
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | texts | st.text(max_size=10)
           | st.floats(allow_nan=False, allow_infinity=False))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
                           max_leaves=20)


def _native_hash(raw: bytes, fields: FieldFilter, collapse: bool) -> str | None:
    return loopwarden_native.semantic_hash(raw, fields, collapse)


def _reference_hash(raw: bytes, fields: FieldFilter, collapse: bool) -> str | None:
    from stream_app.core import NormalisationError

    try:
        return semantic_hash(orjson.loads(raw), fields, collapse)
    except NormalisationError:
        return None


@given(json_values, st.sampled_from(sorted(FILTERS)), st.booleans())
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_semantic_hash_matches_the_reference(value, filter_name, collapse) -> None:
    raw = orjson.dumps(value)
    fields = FILTERS[filter_name]
    assert _native_hash(raw, fields, collapse) == _reference_hash(raw, fields, collapse)


def test_every_character_collapses_and_escapes_as_the_reference_does() -> None:
    """Python's str.split() whitespace, JSON escapes and UTF-8 for every code point, 256 at a time."""
    fields = FILTERS["default"]
    for start in range(0, sys.maxunicode + 1, 256):
        chars = [chr(c) for c in range(start, start + 256) if not 0xD800 <= c <= 0xDFFF]
        raw = orjson.dumps([f"a{c}b{c}" for c in chars] + ["".join(chars)])
        assert _native_hash(raw, fields, True) == _reference_hash(raw, fields, True), hex(start)


def test_numbers_beyond_json_integers_and_nesting_limits_match() -> None:
    fields = FILTERS["default"]
    for raw in [b'{"n": 18446744073709551616}', b'{"n": -9223372036854775809}', b"[-0, -0.0, 0.0, 1.0]",
                b"[1e16, 9007199254740993, 9007199254740992.0, 1e-5, 1e-6, 123e-7, 5e-324]",
                b"[" * 63 + b"1" + b"]" * 63, b"[" * 64 + b"1" + b"]" * 64, b'{"a":' * 64 + b"1" + b"}" * 64,
                b'{"a":' * 65 + b"1" + b"}" * 65, b'{"a": 1, "a": 2}']:
        assert _native_hash(raw, fields, True) == _reference_hash(raw, fields, True), raw


# --- whole replays ------------------------------------------------------------------------------------

POLICIES = [
    Policy(),
    Policy.from_mapping({"defaults": {"retry_budget": 1, "iteration_ceiling": 12, "poll_alert_after": 3,
                                      "cycle_occurrences": 2, "window_calls": 5, "dedupe_window": 3},
                         "tools": {"send": {"side_effect": True, "circuit_open_at": 3},
                                   "code": {"collapse_whitespace": False, "strict_args": True},
                                   "lo*": {"shadow": True, "ignore_fields": ["page"]},
                                   "fetch": {"mask_volatile": False, "tool_class": "read", "no_progress_at": 2},
                                   "log": {"tool_class": "write", "oscillation_revisits": 1},
                                   "search": {"volatile_keywords": ["after"], "volatile_prefixes": ["(pid "]}}}),
    Policy.from_mapping({"defaults": {"max_cost_usd": 8.5, "max_tokens": 20, "max_model_calls_without_tool": 3},
                         "tools": {"search": {"max_calls": 2}, "send": {"max_calls": 1, "shadow": True}}}),
    Policy.from_mapping({"defaults": {"window_ms": 50, "side_effect_window_ms": 30, "run_ttl_ms": 200,
                                      "shadow": True},
                         "agents": {"b*": {"shadow": False, "retry_budget": 0}}}),
    Policy.from_mapping({"tools": {"code": {"tool_class": "spawn"}},
                         "fleet": {"max_tree_depth": 1, "max_tree_runs": 3, "tree_task_repeats": 2,
                                   "max_tree_cost_usd": 1.0}}),
    Policy.from_mapping({"defaults": {"handoff_round_trips": 1},
                         "fleet": {"self_trigger_generation": 1, "schedule_failing_runs": 2,
                                   "max_thread_runs_per_hour": 1, "storm_min_runs": 2, "storm_wait_ms": 5}}),
]

tools = st.sampled_from(["search", "send", "code", "log", "fetch"])
outcomes = st.sampled_from(["success", "error", "empty", "noop"])
small_args = st.sampled_from([{"q": "a"}, {"q": "a", "attempt": 2}, {"q": " a  "}, {"page": 1}, {"page": 2},
                              {"q": [1, 2.0]}, {}])
results = st.sampled_from(["503", "ok", None, {"e": 1}, 1.5, "  503 "]) | st.builds(
    lambda ms, pid, rid: {"error": f"timeout after {ms}ms (pid {pid}, req_{rid:x})"},
    st.sampled_from([5, 812]), st.sampled_from([1, 42]), st.sampled_from([0xa1, 0xb2]))


@st.composite
def telemetry_lines(draw) -> list[bytes]:
    """A stream of telemetry lines over a few runs: repeats, loops, redeliveries, odd but valid
    encodings, and bad lines."""
    lines: list[bytes] = []
    ts = draw(st.integers(0, 10**12))
    for i in range(draw(st.integers(1, 60))):
        ts += draw(st.sampled_from([0, 1, 7, 40, 1000]))
        event: dict = {"run_id": draw(st.sampled_from(["r1", "r2", "r3"])),
                       "event_id": draw(st.sampled_from([f"e{i}", "e0", "dup"])),
                       "tool": draw(tools), "ts_ms": ts, "outcome": draw(outcomes)}
        if draw(st.booleans()):
            event["args"] = draw(small_args)
        else:
            event["args_hash"] = draw(st.sampled_from(["a" * 64, "0123456789abcdef", "not hex", "0a 0b 0c 0d 0e 0f 1a"]))
        if draw(st.integers(0, 4)):
            event["result"] = draw(results)
        else:
            event["result_hash"] = draw(st.sampled_from(["f" * 64, "x", "e" * 64]))
        if draw(st.integers(0, 3)) == 0:
            event["result_fp"] = draw(st.sampled_from(["c" * 64, "fp"]))
        if draw(st.integers(0, 5)) == 0:  # a model call: no args or result needed
            event["kind"] = "model_call"
            if draw(st.booleans()):
                event.pop("args", None)
                event.pop("args_hash", None)
                event.pop("result", None)
                event.pop("result_hash", None)
        for name in ("tokens", "cost_usd"):
            if draw(st.integers(0, 3)) == 0:
                event[name] = draw(st.sampled_from([0, 1, 7, 2.5, 0.3, 10**6, 1e300]))
        if draw(st.integers(0, 2)) == 0:  # tool classes: reads that repeat, writes that revisit states
            event["tool_class"] = draw(st.sampled_from(["read", "write", "write", "poll", "other", "spawn", "handoff",
                                                        "handoff"]))
            if event["tool_class"] == "handoff":  # agents handing the run back and forth
                event["agent_id"] = draw(st.sampled_from(["a1", "bot"]))
                event["child_agent_id"] = {"a1": "bot", "bot": "a1"}[event["agent_id"]]
            if draw(st.integers(0, 3)):
                event["target"] = draw(st.sampled_from(["/a", "/b", ""]))
            if draw(st.integers(0, 3)):
                event["state_hash"] = draw(st.sampled_from(["1" * 64, "0" * 64, "2" * 64, "s1"]))
        for name, values in (("agent_id", st.sampled_from(["a1", "bot", ""])),
                             ("retry_budget", st.integers(0, 4)), ("plan_step", st.integers(0, 3)),
                             ("side_effect", st.booleans()), ("seq", st.integers(-3, 3)),
                             ("latency_ms", st.sampled_from([0, 1.5])), ("tenant", st.just("t")),
                             ("attrs", st.just({"k": 1})), ("schema_version", st.just("1"))):
            if draw(st.integers(0, 5)) == 0:
                event[name] = draw(values)
        if draw(st.integers(0, 2)) == 0:  # sub-agent trees: children, spawns naming them, their tasks
            event["root_run_id"] = draw(st.sampled_from(["r1", "r2", "root"]))
            for name, values in (("parent_run_id", st.sampled_from(["r1", "r2", "r3"])),
                                 ("depth", st.integers(0, 3)), ("child_run_id", st.sampled_from(["r2", "r3", "k"])),
                                 ("child_agent_id", st.just("w")), ("task_hash", st.sampled_from(["a" * 16, "b" * 16])),
                                 ("cost_usd", st.sampled_from([0.4, 0.7]))):
                if draw(st.booleans()):
                    event[name] = draw(values)
        if draw(st.booleans()):  # threads: runs causing runs, schedules failing
            event["thread_key"] = draw(st.sampled_from(["pr-1", "pr-1", "pr-1", "pr-2", ""]))
            # r1 and r2 mostly scheduled (failing streaks), r3 caused by others (generations)
            trigger = {"r1": "schedule", "r2": "schedule", "r3": "webhook"}[event["run_id"]]
            for name, values in (("trigger", st.sampled_from([trigger, trigger, "user", "agent"])),
                                 ("caused_by_run_id", st.sampled_from(["r1", "r2", "r3"])),
                                 ("error_class", st.sampled_from(["auth", "auth", "http_500"])),
                                 ("tenant", st.just("t"))):
                if draw(st.booleans()):
                    event[name] = draw(values)
        if draw(st.booleans()):  # storms: calls naming their upstream, failing transiently or not
            event["upstream"] = draw(st.sampled_from(["api", "api", "mcp"]))
            for name, values in (("error_class", st.sampled_from(["http_503", "http_429", "timeout", "http_404"])),
                                 ("retry_after_ms", st.sampled_from([0, 3, 30_000]))):
                if draw(st.booleans()):
                    event[name] = draw(values)
        line = orjson.dumps(event)
        mutation = draw(st.integers(0, 14))
        if mutation == 1:
            line = line.replace(b'"ts_ms":', b'"ts_ms":-0,"x":', 1)  # valid, but not on the fast path
        elif mutation == 2:
            line = b"{not json"
        elif mutation == 3:
            line = line.replace(b'"outcome":"', b'"outcome":"x', 1)
        elif mutation == 4:
            line = line.replace(b'"run_id":"', b'"run_id":1,"y":"', 1)
        elif mutation == 5:
            line = b"   "
        elif mutation == 6:
            line = line.replace(b'"ts_ms":', b'"ts_ms":1e3,"z":', 1)
        lines.append(line + b"\n")
    return lines


def _run(lines: list[bytes], policy: Policy, engine: str) -> tuple[bytes, str, str]:
    out, err = io.BytesIO(), io.StringIO()
    summary = replay(lines, policy, out, err, engine=engine)  # type: ignore[arg-type]
    return out.getvalue(), err.getvalue(), summary.render()


@given(telemetry_lines(), st.sampled_from(range(len(POLICIES))))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
def test_replay_output_is_byte_identical_to_the_reference(lines, policy_index) -> None:
    policy = POLICIES[policy_index]
    assert _run(lines, policy, "native") == _run(lines, policy, "python")


def test_the_golden_fleet_exercises_every_verdict_identically() -> None:
    lines = (REPO / "schemas" / "examples" / "fleet.jsonl").read_bytes().splitlines(keepends=True)
    native = _run(lines, Policy(), "native")
    assert native == _run(lines, Policy(), "python")
    verdicts = {json.loads(line)["verdict"] for line in native[0].splitlines()}
    assert {"recursion", "semantic_loop", "cycle", "iteration_ceiling", "duplicate_call", "circuit_open",
            "polling"} <= verdicts


# --- the fast path refuses what the reference refuses ----------------------------------------------

# Boundary values of every rule in the contract, and values of every JSON type.
field_values = st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats(allow_nan=False) \
    | st.text(max_size=3) | st.just({}) | st.just([]) | st.sampled_from(
        ["success", "error", "1", "", "r", "x" * 512, "x" * 513, "é" * 512, "é" * 513, 10_000, 10_001, -1, 0,
         2**63 - 1, 2**63, -(2**63), 0.0, -0.5, 1.0, "read", "write", "poll", "Read", "model_call", "tool_call",
         "operator", "user", "schedule", "webhook", "agent", "User", "a" * 64])
field_names = st.sampled_from(["run_id", "event_id", "tool", "ts_ms", "outcome", "args", "args_hash", "result",
                               "result_hash", "agent_id", "tenant", "seq", "plan_step", "retry_budget",
                               "side_effect", "latency_ms", "tokens", "cost_usd", "attrs", "schema_version",
                               "trace_id", "span_id", "parent_span_id", "error_class", "result_fp", "tool_class",
                               "target", "state_hash", "kind", "other", "parent_run_id", "root_run_id", "depth",
                               "child_run_id", "child_agent_id", "task_hash", "upstream", "retry_after_ms",
                               "trigger", "caused_by_run_id", "thread_key"])


@given(st.dictionaries(field_names, field_values, max_size=3))
@settings(max_examples=3000, deadline=None)
def test_the_fast_path_never_accepts_a_line_the_reference_refuses(mutations) -> None:
    event = {"run_id": "r", "event_id": "e", "tool": "t", "ts_ms": 1, "outcome": "error", "args": {}, "result": 1}
    event.update(mutations)
    try:
        line = orjson.dumps(event)
    except orjson.JSONEncodeError:
        return  # an integer beyond 64 bits: not a JSON line orjson writes
    engine = loopwarden_native.Replayer(Policy(), 10, 1 << 20)
    stop, _findings = engine.feed([line], 0)
    if stop == 1:  # the fast path took it: the reference must accept it too
        try:
            parse_event(line)
        except InvalidEvent as exc:
            raise AssertionError(f"fast path accepted {line!r}, reference refuses: {exc}") from exc


def test_replay_of_trees_and_threads_is_byte_identical_and_reaches_every_rule_across_runs() -> None:
    """The simulated trees and threads (each kind with its expected decisions) through both engines."""
    from stream_app.devtools.fleet_sim import simulate_storm, simulate_threads, simulate_trees

    events = simulate_trees(4)[1] + simulate_threads(8)[1] + simulate_storm(runs=12)
    events.sort(key=lambda e: (e["ts_ms"], e["event_id"]))
    lines = [orjson.dumps(e) + b"\n" for e in events]
    native = _run(lines, Policy(), "native")
    assert native == _run(lines, Policy(), "python")
    verdicts = {(m["action"], m["verdict"]) for m in map(orjson.loads, native[0].splitlines())}
    assert {("halt", "self_trigger"), ("halt", "schedule_failing"), ("alert", "thread_rate"),
            ("halt", "tree_depth"), ("halt", "tree_recursion"), ("halt", "tree_fanout"), ("pause", "tool_storm"),
            ("pause", "semantic_loop"),
            ("resume", "tool_storm")} <= verdicts
