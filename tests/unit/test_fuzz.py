"""Bad input, fuzzed: whatever bytes arrive, decoding and detection either accept them or reject them
with InvalidEvent naming the problem; no other exception escapes, and accepted events hash stably."""

from __future__ import annotations

import random

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stream_app.core import Detector, InvalidEvent, RunState, parse_event

GOOD = {"run_id": "r", "event_id": "e", "tool": "t", "ts_ms": 1, "outcome": "error", "args": {"q": 1},
        "result": "boom"}
FIELDS = [*GOOD, "args_hash", "result_hash", "retry_budget", "plan_step", "side_effect", "seq", "agent_id",
          "tenant", "trace_id", "span_id", "parent_span_id", "latency_ms", "error_class", "tokens", "cost_usd",
          "attrs", "schema_version"]

json_scalars = (st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats() | st.text(max_size=30)
                | st.binary(max_size=10).map(lambda b: b.decode("latin-1")))
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c,
                                                                                             max_size=4), max_leaves=25)


def _outcome(raw: bytes) -> tuple[str, object]:
    """Decode and evaluate; return ('ok', decisions) or ('rejected', InvalidEvent). Anything else raises."""
    try:
        event = parse_event(raw)
    except InvalidEvent as exc:
        assert str(exc), "a rejection must say why"  # noqa: PT017 - the reason of every rejection, not one
        return "rejected", exc
    state = RunState()
    detector = Detector()
    first = detector.evaluate(state, event)
    second = Detector().evaluate(RunState(), event)
    assert [d.decision_id for d in first.decisions] == [d.decision_id for d in second.decisions]
    return "ok", first


def _encode(obj: object) -> bytes:
    try:
        return orjson.dumps(obj)
    except (TypeError, orjson.JSONEncodeError):
        return repr(obj).encode()


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(FIELDS), json_values)
def test_any_value_in_any_field_is_accepted_or_named(field: str, value: object) -> None:
    """Wrong types in every field: the error names the field (or the payload when it is not JSON)."""
    status, result = _outcome(_encode({**GOOD, field: value}))
    if status == "rejected":
        assert isinstance(result, InvalidEvent)
        assert result.field in (field, "", "args", "result")


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_random_bytes_never_escape_as_another_exception(raw: bytes) -> None:
    """Random bytes, invalid UTF-8 included."""
    _outcome(raw)


@settings(max_examples=300)
@given(st.integers(0, 2**32 - 1), st.integers(1, 8))
def test_mutated_valid_events_are_accepted_or_named(seed: int, flips: int) -> None:
    """A valid encoded event with bytes flipped, dropped or duplicated."""
    rng = random.Random(seed)
    raw = bytearray(orjson.dumps(GOOD))
    for _ in range(flips):
        at = rng.randrange(len(raw))
        choice = rng.randrange(3)
        if choice == 0:
            raw[at] = rng.randrange(256)
        elif choice == 1:
            del raw[at]
        else:
            raw.insert(at, raw[at])
    _outcome(bytes(raw))


def test_pathological_payloads() -> None:
    """Deep nesting, huge strings and arrays, NaN/Infinity, duplicate keys, integers past 64 bits,
    multi-megabyte payloads: each accepted (and hashed the same twice) or rejected with a reason."""
    nested = b'{"x":' * 500 + b"1" + b"}" * 500
    cases = {
        b"deep_args": orjson.dumps({**GOOD, "args": {}}).replace(b'"args":{}', b'"args":' + nested),
        b"huge_string": orjson.dumps({**GOOD, "args": {"q": "x" * 900_000}}),
        b"huge_array": orjson.dumps({**GOOD, "result": list(range(100_000))}),
        b"nan": orjson.dumps(GOOD).replace(b'"boom"', b"NaN"),
        b"infinity": orjson.dumps(GOOD).replace(b'"boom"', b"Infinity"),
        b"duplicate_keys": b'{"run_id":"a","run_id":"b","event_id":"e","tool":"t","ts_ms":1,"outcome":"error",'
                           b'"args":{},"result":1}',
        b"big_int": orjson.dumps(GOOD).replace(b'"boom"', str(2**70).encode()),
        b"multi_megabyte": orjson.dumps({**GOOD, "args": {"q": "x" * 3_000_000}}),
        b"deep_json": b'{"a":' * 2000 + b"1" + b"}" * 2000,
    }
    statuses = {name: _outcome(raw)[0] for name, raw in cases.items()}
    assert statuses[b"multi_megabyte"] == "rejected"
    assert statuses[b"nan"] == statuses[b"infinity"] == "rejected"
    assert statuses[b"big_int"] == "ok"  # orjson reads integers past 64 bits as floats: lossy but stable
    assert statuses[b"deep_json"] == "rejected"
    assert statuses[b"deep_args"] == "ok"  # accepted, and compared by tool name alone (fail closed)
    assert statuses[b"duplicate_keys"] == "ok"
