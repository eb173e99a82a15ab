"""Volatile tokens (stream_app.core.volatile) and the fingerprint streaks they give, on both engines.

The table in the module docstring is the spec: each row has a masked example and a kept counter-example
here, checked with the reference's ``re`` and the native engine's ``fancy-regex`` reading the same
pattern text. Properties: masking is idempotent, never merges texts that differ in a kept token, and
the two engines mask every string alike.
"""

from __future__ import annotations

import loopwarden_native
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_app.bus.wire import encode_telemetry
from stream_app.client import FinishedCall, TelemetryBuilder
from stream_app.core import (
    Detector,
    Policy,
    PolicyError,
    RunTable,
    TelemetryEvent,
    decode_event,
    semantic_hash,
)
from stream_app.core.volatile import DEFAULT_PATTERN, VolatileMask, pattern

from .conftest import Run, event, replay_both

MASK = VolatileMask()

# (rule, text, masked): the masked examples and the kept counter-examples of every row.
TABLE = [
    ("prefix req_", "request req_5f1cA9 failed", "request req_<id> failed"),
    ("prefix req_ kept", "required field", "required field"),
    ("prefix id=", "user_id=42 id=abc-1", "user_id=<id> id=<id>"),
    ("prefix id= kept", "rapid=5 valid=yes", "rapid=5 valid=yes"),
    ("keyword", "pid 4242, tid=17, attempt #3, RETRY: 2", "pid <n>, tid=<n>, attempt #<n>, RETRY: <n>"),
    ("keyword kept", "pids 42 tidy 3 attempts 4", "pids 42 tidy 3 attempts 4"),
    ("uuid", "job 550e8400-e29b-41d4-a716-446655440000 lost", "job <uuid> lost"),
    ("uuid kept", "ref 55008400-1234-4000", "ref 55008400-1234-4000"),
    ("iso date-time", "at 2026-12-01T15:25:56.123Z, 2026/12/01 15:25", "at <datetime>, <datetime>"),
    ("iso offset", "since 2026-12-01 15:25:56+01:00", "since <datetime>"),
    ("date kept", "expires 2026-12-01", "expires 2026-12-01"),
    ("common log", '[01/Dec/2026:15:25:56 +0000] "GET /"', '[<datetime>] "GET /"'),
    ("0x hex", "segfault at 0x7ffd5e8c", "segfault at <hex>"),
    ("0x kept", "0xyz", "0xyz"),
    ("hex run", "nonce 5f1c2a3b9e, sha deadbeef", "nonce <hex>, sha <hex>"),
    ("hex run kept", "order 12345678 abcdef1", "order 12345678 abcdef1"),
    ("long number", "epoch 1733065556123", "epoch <num>"),
    ("long number kept", "id 123456789", "id 123456789"),
    ("time of day", "at 15:25:56.120 and 9:05:33", "at <time> and <time>"),
    ("file:line:col kept", "app.py:12:34 a.py:10:15:20 10:15", "app.py:12:34 a.py:10:15:20 10:15"),
    ("duration", "timeout after 812ms, 30.2 s, 5 sec, 2 hours", "timeout after <duration>, <duration>, "
                                                               "<duration>, <duration>"),
    ("duration kept", "HTTP 503, 3 services, port 8080, exit 137", "HTTP 503, 3 services, port 8080, exit 137"),
    ("kept", "ECONNREFUSED /var/run/app.sock HTTP 429", "ECONNREFUSED /var/run/app.sock HTTP 429"),
    ("the issue's example", "upstream timeout after 30412ms (request req_5f1c9a) at 2026-12-01T15:25:56Z",
     "upstream timeout after <duration> (request req_<id>) at <datetime>"),
]


@pytest.mark.parametrize(("rule", "text", "masked"), TABLE, ids=[row[0] for row in TABLE])
def test_the_masking_table_on_both_engines(rule: str, text: str, masked: str) -> None:
    assert MASK.text(text) == masked
    assert loopwarden_native.mask_text(DEFAULT_PATTERN, text) == masked


def test_the_table_is_extendable_per_tool() -> None:
    custom = VolatileMask(pattern(prefixes=["trace-"], keywords=["worker"]))
    text = "trace-a1b2 on worker 7 (pid 9)"
    assert custom.text(text) == "trace-<id> on worker <n> (pid <n>)"
    assert loopwarden_native.mask_text(custom.pattern, text) == custom.text(text)
    assert MASK.text(text) == "trace-a1b2 on worker 7 (pid <n>)"


def test_prefixes_and_keywords_the_engines_cannot_hold_alike_are_refused() -> None:
    for bad in ("", "é=", "x" * 33, "a\nb"):
        with pytest.raises(PolicyError, match="volatile_prefixes"):
            Policy.from_mapping({"tools": {"t": {"volatile_prefixes": [bad]}}})
    with pytest.raises(PolicyError, match="list of strings"):
        Policy.from_mapping({"tools": {"t": {"volatile_keywords": "worker"}}})


# Texts: kept tokens, volatile tokens and separators, with non-ASCII letters and digits (which ASCII
# classes must not take for letters or digits).
volatile_tokens = st.sampled_from([
    "req_5f1c", "id=42", "pid 4242", "550e8400-e29b-41d4-a716-446655440000", "2026-12-01T15:25:56.1Z",
    "01/Dec/2026:15:25:56 +0000", "0x7ffd", "5f1c2a3b9e", "1733065556123", "15:25:56", "812ms", "30.2 s",
])
kept_tokens = st.sampled_from([
    "HTTP", "503", "429", "ECONNREFUSED", "exit", "1", "port", "8080", "/var/run/x.sock", "app.py:12:34", "failed",
    "timeout", "after", "12345678", "row", "7", "é", "٣", "ǅ", "K",
])
separators = st.sampled_from([" ", "", ":", "-", "_", ".", ",", "=", "#", "/", "(", ")", "\n", "é"])
texts = st.lists(st.tuples(volatile_tokens | kept_tokens | st.text(max_size=4), separators), max_size=8).map(
    lambda parts: "".join(a + b for a, b in parts))


@given(texts)
@settings(max_examples=1500, deadline=None)
def test_both_engines_mask_every_text_alike(text: str) -> None:
    assert loopwarden_native.mask_text(DEFAULT_PATTERN, text) == MASK.text(text)


@given(texts)
@settings(max_examples=500, deadline=None)
def test_masking_is_idempotent(text: str) -> None:
    once = MASK.text(text)
    assert MASK.text(once) == once


# Kept tokens only, joined by spaces: no rule can take any of them (no unit words, no keywords, no dates).
kept_words = st.sampled_from(["HTTP", "ECONNREFUSED", "exit", "port", "row", "failed", "timeout", "after",
                              "/var/run/x.sock", "app.py:12:34", "E42"]) | st.integers(0, 999_999_999).map(str)


@given(st.lists(kept_words, min_size=1, max_size=6), st.lists(kept_words, min_size=1, max_size=6))
@settings(max_examples=500, deadline=None)
def test_masking_never_merges_texts_that_differ_in_a_kept_token(a: list[str], b: list[str]) -> None:
    left, right = " ".join(a), " ".join(b)
    if left != right:
        assert MASK.text(left) != MASK.text(right)


@given(st.recursive(texts | st.integers(-(2**63), 2**63 - 1) | st.none(), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(["error", "message", "pid", "at"]), inner, max_size=3),
                    max_leaves=8))
@settings(max_examples=300, deadline=None)
def test_result_fingerprints_match_the_reference(value: object) -> None:
    policy = Policy().resolve(None, "t")
    expected = semantic_hash(MASK.value(value), policy.fields)
    assert loopwarden_native.result_fingerprint(orjson.dumps(value), policy.fields, True, DEFAULT_PATTERN) == expected


# --- the streaks -----------------------------------------------------------------------------------

def _timeouts(n: int, **extra: object) -> list:
    return [event("search_docs", result={"error": f"upstream timeout after {30412 + 97 * i}ms (request "
                                                  f"req_5f1c{i:04x}) at 2026-12-01T15:25:{10 + i:02d}Z"},
                  ts_ms=1_000 * i, **extra) for i in range(n)]


def test_identical_failures_modulo_volatile_tokens_halt_at_the_fourth(run: Run) -> None:
    """The issue's example: 12 identical search_docs calls with a fresh duration, request id and time in
    each error made no decision before; with the defaults the 4th halts."""
    run.feed_all(_timeouts(12))
    assert run.halts() == [(4, "recursion")]
    evidence = run.decisions[0][1].evidence
    assert evidence["match"] == "fingerprint" and evidence["count"] == 4
    assert evidence["result_fp"] != evidence["result_hash"]
    assert "up to volatile tokens" in run.decisions[0][1].reason


def test_exact_repetition_says_exact(run: Run) -> None:
    run.feed_all([event(result="HTTP 503", ts_ms=i) for i in range(4)])
    assert run.halts() == [(4, "recursion")]
    assert run.decisions[0][1].evidence["match"] == "exact"
    assert "result_fp" not in run.decisions[0][1].evidence


def test_kept_tokens_still_break_the_streak(run: Run) -> None:
    run.feed_all([event(result=f"HTTP {code}", ts_ms=i) for i, code in enumerate([503, 429, 503, 429, 503, 429])])
    assert run.halts() == []


def test_masking_switched_off_per_tool_keeps_exact_hashes() -> None:
    run = Run(Policy.from_mapping({"tools": {"search_docs": {"mask_volatile": False}}}))
    run.feed_all(_timeouts(12))
    assert run.halts() == []


def test_successful_results_are_never_fingerprinted(run: Run) -> None:
    """Polling that returns a fresh timestamp each time is not the same result: only failures match
    on fingerprints."""
    run.feed_all([event(outcome="success", result=f"done at 2026-12-01T15:25:{i:02d}Z", ts_ms=i) for i in range(30)])
    assert run.actions() == []


def _hashed(i: int, **extra: object) -> TelemetryEvent:
    """A failing call as a client-hashing runtime sends it: no raw result, a fresh result hash."""
    return decode_event({"run_id": "run-1", "event_id": f"h{i}", "tool": "search", "ts_ms": i, "outcome": "error",
                         "args_hash": "a" * 64, "result_hash": f"{i + 16:02x}" * 32, **extra})


def test_a_sent_fingerprint_is_used_and_a_raw_result_overrides_it(run: Run) -> None:
    """Runtimes that hash on the client send result_fp beside result_hash; with only result_hash, the
    hash is the fingerprint; a raw result is masked here whatever was sent."""
    run.feed_all([_hashed(i, result_fp="ab" * 32) for i in range(4)])
    assert run.halts() == [(4, "recursion")]
    other = Run()
    other.feed_all([_hashed(i) for i in range(6)])
    assert other.halts() == []
    raw = Run()
    raw.feed_all([event(result=f"timeout after {100 + i}ms", result_fp=f"{i + 16:02x}" * 32, ts_ms=i) for i in range(4)])
    assert raw.halts() == [(4, "recursion")]


def test_arguments_are_never_masked(run: Run) -> None:
    """merge PR 101 and merge PR 102 are different calls: a semantic loop, not a recursion."""
    run.feed_all([event("merge", args={"pr": f"merge PR {101 + i} at 2026-12-01T15:25:0{i}Z"},
                        result="merge conflict", ts_ms=i) for i in range(4)])
    assert run.halts() == [(4, "semantic_loop")]


def test_a_fingerprint_streak_matches_on_the_native_engine_too() -> None:
    lines = [orjson.dumps({"run_id": "r", "event_id": f"e{i}", "tool": "search_docs", "ts_ms": 1000 * i,
                           "outcome": "error", "args": {"q": "x"},
                           "result": f"timeout after {300 + i}ms req_{i:08x}"}) + b"\n" for i in range(6)]
    output = replay_both(lines, Policy())
    decisions = [d for d in map(orjson.loads, output.splitlines()) if d["action"] != "advise"]
    assert [(d["trigger_event_id"], d["evidence"]["match"]) for d in decisions] == [("e3", "fingerprint")]


# --- the SDK: fingerprints computed on the client ----------------------------------------------------

def _finished(i: int, outcome: str = "error") -> FinishedCall:
    error = {"error_class": "TimeoutError", "message": f"upstream timeout after {30412 + i}ms (request "
                                                          f"req_5f1c{i:04x}, customer Quigglesworth)"}
    return FinishedCall("run-c", "search_docs", {"q": "refund"}, outcome, error, 1_764_000_000_000 + i, 1.0)


def test_the_sdk_sends_the_fingerprint_and_never_the_result() -> None:
    """A hashed tool's failing call carries result_fp beside result_hash, equal to what the worker
    computes from the raw result; neither the error text nor any token of it travels."""
    hashed, raw = TelemetryBuilder(), TelemetryBuilder(raw_tools={"search_docs"})
    event = orjson.loads(encode_telemetry(hashed.build(_finished(0)))[1])
    assert "result" not in event and "Quigglesworth" not in orjson.dumps(event).decode()
    assert "req_5f1c" not in orjson.dumps(event).decode()
    raw_event = decode_event(orjson.loads(encode_telemetry(raw.build(_finished(0)))[1]))
    policy = Policy().resolve(None, "search_docs")
    assert policy.mask is not None
    assert event["result_fp"] == policy.mask.fingerprint(raw_event.result, policy.fields)
    assert "result_fp" not in hashed.build(_finished(1, outcome="success"))


def test_client_hashed_and_raw_failures_form_one_fingerprint_streak() -> None:
    """Hashed and raw events of the same failure, each with fresh volatile tokens, halt at the 4th."""
    hashed, raw = TelemetryBuilder(), TelemetryBuilder(raw_tools={"search_docs"})
    table = RunTable(Detector())
    decisions = []
    for i, builder in enumerate((hashed, raw, hashed, raw, hashed)):
        wire = orjson.loads(encode_telemetry(builder.build(_finished(i)))[1])
        decisions.extend((i, d) for d in table.observe(decode_event(wire)).decisions if d.action != "advise")
    assert [(i, d.verdict, d.evidence["match"]) for i, d in decisions] == [(3, "recursion", "fingerprint")]


def test_the_sdk_sends_no_fingerprint_where_masking_is_off() -> None:
    builder = TelemetryBuilder(Policy.from_mapping({"tools": {"search_docs": {"mask_volatile": False}}}))
    assert "result_fp" not in builder.build(_finished(0))


def test_a_long_error_text_without_volatile_tokens_is_masked_by_both_engines() -> None:
    """A 300,000-character failing result (events may be 1 MiB): the native regex engine must not give
    up where Python's re does not (fancy-regex's default backtrack limit would)."""
    text = "x " * 150_000 + "pid 7"
    assert loopwarden_native.mask_text(DEFAULT_PATTERN, text) == MASK.text(text) == "x " * 150_000 + "pid <n>"
