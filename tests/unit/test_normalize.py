"""Normalisation: what makes two calls the same call."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stream_app.core import FieldFilter, NormalisationError, normalise, semantic_hash

json_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20) | st.floats(
    allow_nan=False, allow_infinity=False
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
objects = st.dictionaries(st.text(max_size=8), json_values, max_size=6)


def _shuffled(value, rnd):
    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        return {k: _shuffled(v, rnd) for k, v in items}
    if isinstance(value, list):
        return [_shuffled(v, rnd) for v in value]
    return value


def _respaced(value):
    if isinstance(value, str):
        return "  " + value.replace(" ", " \t ") + "\n"
    if isinstance(value, dict):
        return {k: _respaced(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_respaced(v) for v in value]
    return value


@given(objects, st.randoms())
def test_hash_is_invariant_under_key_permutation(obj, rnd) -> None:
    """Invariant: reordering keys at any depth never changes the hash."""
    assert semantic_hash(_shuffled(obj, rnd)) == semantic_hash(obj)


@given(objects)
def test_hash_is_invariant_under_whitespace(obj) -> None:
    """Invariant: extra, leading and trailing whitespace in strings never changes the hash."""
    assert semantic_hash(_respaced(obj)) == semantic_hash(obj)


@given(objects)
def test_hash_survives_a_json_round_trip(obj) -> None:
    """Invariant: a runtime that serialises with any JSON encoder produces the same hash."""
    assert semantic_hash(json.loads(json.dumps(obj, indent=2))) == semantic_hash(obj)


@given(objects, st.sampled_from(["timestamp", "nonce", "attempt", "requestId", "X-Request-ID", "created_at"]),
       json_scalars)
def test_noise_fields_never_change_the_hash(obj, noise, value) -> None:
    """Invariant: adding a non-semantic field anywhere does not change the hash."""
    assert semantic_hash({**obj, noise: value}) == semantic_hash(obj)
    assert semantic_hash({"outer": {**obj, noise: value}}) == semantic_hash({"outer": obj})


@given(objects, objects)
def test_different_semantic_content_hashes_differently(a, b) -> None:
    """Property: distinct normal forms have distinct hashes (SHA-256 of canonical JSON)."""
    if normalise(a) != normalise(b):
        assert semantic_hash(a) != semantic_hash(b)


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ({"n": 1}, {"n": 1.0}, True),  # integral floats are integers in every runtime
        ({"n": 1}, {"n": 1.5}, False),
        ({"q": "a b"}, {"q": "ab"}, False),  # whitespace is collapsed, not removed
        ({"q": "x"}, {"Q": "x"}, False),  # key names are case sensitive
        ({"list": [1, 2]}, {"list": [2, 1]}, False),  # order of arrays is meaning
        ({"start_time": "9am"}, {"start_time": "10am"}, False),  # a time the user asked for is meaning
        ({"sent_at": "9am"}, {"sent_at": "10am"}, True),  # an *_at stamp is not
        ({"big": 2**70}, {"big": str(2**70)}, True),  # ints past 64 bits are spelled as strings
    ],
)
def test_normal_form_table(a, b, same) -> None:
    """Which pairs of argument objects are the same call."""
    assert (semantic_hash(a) == semantic_hash(b)) is same


def test_whitespace_collapse_can_be_switched_off() -> None:
    """Tools that take code keep their whitespace."""
    code_a, code_b = {"src": "if x:\n    y"}, {"src": "if x: y"}
    assert semantic_hash(code_a) == semantic_hash(code_b)
    assert semantic_hash(code_a, collapse_whitespace=False) != semantic_hash(code_b, collapse_whitespace=False)


def test_tool_specific_ignore_and_keep_fields() -> None:
    """A tool can add noise fields and keep built-in ones that mean something to it."""
    extra = FieldFilter(ignore=("session_token",))
    assert semantic_hash({"q": 1, "session_token": "a"}, extra) == semantic_hash({"q": 1}, extra)
    keep_ts = FieldFilter(keep=("ts",))
    assert semantic_hash({"ts": 1}, keep_ts) != semantic_hash({"ts": 2}, keep_ts)


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), {"deep": object()}, {"s": {1, 2}}],
)
def test_values_without_a_canonical_form_are_refused(value) -> None:
    """Non-finite numbers and non-JSON types raise NormalisationError instead of hashing arbitrarily."""
    with pytest.raises(NormalisationError):
        normalise(value)


def test_nesting_depth_is_bounded() -> None:
    """A pathologically deep structure is refused, not recursed into until the stack breaks."""
    deep: dict = {}
    node = deep
    for _ in range(200):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(NormalisationError, match="nesting deeper"):
        normalise(deep)
