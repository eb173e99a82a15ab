"""Semantic normalisation and hashing of tool arguments and results.

Two calls that mean the same thing must hash the same, or a loop that only changes a nonce, an attempt
counter or the order of keys slips past the detector. So before hashing:

- object keys are sorted and JSON formatting disappears (canonical JSON, one pinned encoder: orjson);
- whitespace inside string values is collapsed and trimmed (a tool may opt out, e.g. one that runs code);
- fields that carry no meaning are dropped at every depth: timestamps, nonces, attempt/retry counters,
  request and correlation ids. They are matched by name after folding (``requestId``, ``Request-ID``
  and ``request_id`` are one name), against the built-in patterns below plus a tool's own;
- integral floats become integers (``1.0`` and ``1`` are the same number in every runtime's JSON), and
  integers outside 64 bits are spelled as strings, since no JSON peer can carry them faithfully.

Hash: SHA-256 (hex) of the canonical JSON. Runtimes that send ``args_hash``/``result_hash`` compute it
with this same module.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from fnmatch import fnmatchcase
from typing import Any

import orjson

from .errors import NormalisationError

#: Names (after folding to snake_case) dropped before hashing. Globs are matched with fnmatch.
DEFAULT_IGNORED_FIELDS: tuple[str, ...] = (
    "timestamp", "*_timestamp", "ts", "*_ts", "now", "*_at",
    "nonce", "*_nonce", "cnonce", "cache_buster",
    "attempt", "attempts", "attempt_number", "attempt_count", "*_attempt",
    "retry", "retries", "retry_count", "retry_number", "retry_attempt",
    "request_id", "*_request_id", "req_id", "correlation_id", "idempotency_key",
    "trace_id", "span_id", "traceparent", "tracestate",
)

MAX_DEPTH = 64

_INT64_MIN = -(2**63)
_UINT64_MAX = 2**64 - 1
_FLOAT_EXACT_INT = 2**53
_CAMEL_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def fold_field_name(name: str) -> str:
    """``requestId``, ``Request-ID`` and ``request_id`` all fold to ``request_id``."""
    return _CAMEL_BOUNDARY.sub("_", name).lower().replace("-", "_").replace(" ", "_")


class FieldFilter:
    """Decides which object keys are noise. Folding and matching are cached per key name."""

    __slots__ = ("_cache", "_exact", "_globs", "_keep")

    _CACHE_LIMIT = 4096

    def __init__(self, ignore: Iterable[str] = DEFAULT_IGNORED_FIELDS, keep: Iterable[str] = ()) -> None:
        patterns = [fold_field_name(p) for p in ignore]
        self._exact = frozenset(p for p in patterns if not any(c in p for c in "*?["))
        self._globs = tuple(p for p in patterns if any(c in p for c in "*?["))
        self._keep = frozenset(fold_field_name(k) for k in keep)
        self._cache: dict[str, bool] = {}

    def is_ignored(self, key: str) -> bool:
        hit = self._cache.get(key)
        if hit is None:
            folded = fold_field_name(key)
            hit = folded not in self._keep and (
                folded in self._exact or any(fnmatchcase(folded, g) for g in self._globs)
            )
            if len(self._cache) >= self._CACHE_LIMIT:
                self._cache.clear()
            self._cache[key] = hit
        return hit


DEFAULT_FILTER = FieldFilter()


def normalise(value: Any, fields: FieldFilter = DEFAULT_FILTER, collapse_whitespace: bool = True) -> Any:
    """Return the semantic form of a JSON-like value; raise NormalisationError if it has none."""
    kind = type(value)
    if kind is dict:
        return _normalise_object(value, fields, collapse_whitespace, 0)
    if kind is str:
        return " ".join(value.split()) if collapse_whitespace else value
    return _normalise(value, fields, collapse_whitespace, 0)


# The hot path of every event: scalars are handled inline in the container loops, so a leaf costs no
# function call, and key decisions come from the filter's cache without a method call.
def _normalise_object(value: dict[Any, Any], fields: FieldFilter, collapse: bool, depth: int) -> dict[str, Any]:
    if depth >= MAX_DEPTH:
        raise NormalisationError(f"nesting deeper than {MAX_DEPTH} levels")
    cache = fields._cache
    out: dict[str, Any] = {}
    for key, item in value.items():
        if type(key) is not str:
            key = str(key)
        ignored = cache.get(key)
        if ignored is None:
            ignored = fields.is_ignored(key)
        if ignored:
            continue
        kind = type(item)
        if kind is str:
            out[key] = " ".join(item.split()) if collapse else item
        elif kind is bool or item is None or (kind is int and _INT64_MIN <= item <= _UINT64_MAX):
            out[key] = item
        elif kind is dict:
            out[key] = _normalise_object(item, fields, collapse, depth + 1)
        else:
            out[key] = _normalise(item, fields, collapse, depth + 1)
    return out


def _normalise(value: Any, fields: FieldFilter, collapse: bool, depth: int) -> Any:
    kind = type(value)
    if kind is str:
        return " ".join(value.split()) if collapse else value
    if kind is dict:
        return _normalise_object(value, fields, collapse, depth)
    if kind is list or kind is tuple:
        if depth >= MAX_DEPTH:
            raise NormalisationError(f"nesting deeper than {MAX_DEPTH} levels")
        return [_normalise(item, fields, collapse, depth + 1) for item in value]
    if kind is int:
        return value if _INT64_MIN <= value <= _UINT64_MAX else str(value)
    if kind is float:
        if value != value or value in (float("inf"), float("-inf")):
            raise NormalisationError(f"non-finite number {value!r} has no JSON form")
        if value.is_integer() and -_FLOAT_EXACT_INT <= value <= _FLOAT_EXACT_INT:
            return int(value)
        return value
    if value is None or kind is bool:
        return value
    raise NormalisationError(f"unsupported value of type {kind.__name__}")


def canonical_json(value: Any) -> bytes:
    """Canonical JSON bytes of an already normalised value: sorted keys, no whitespace."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def semantic_hash(value: Any, fields: FieldFilter = DEFAULT_FILTER, collapse_whitespace: bool = True) -> str:
    """SHA-256 hex of the canonical JSON of the normalised value: the ``args_hash``/``result_hash``."""
    return hashlib.sha256(canonical_json(normalise(value, fields, collapse_whitespace))).hexdigest()
