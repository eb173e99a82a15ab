"""Volatile tokens in failing results: what changes between two identical failures and carries no meaning.

The same call failing the same way rarely returns the same bytes: the error text carries a fresh request
id, a timestamp, a duration, a pid or a memory address each time, so no two result hashes are equal and a
loop on the result hash alone runs to the ceiling. For failing outcomes the detector therefore also keeps
a *fingerprint* (``result_fp``): the semantic hash of the result after every string in it has had its
volatile tokens replaced by a marker. Streaks match on the exact hash or, failing that, the fingerprint.

The table below is the spec (``tests/unit/test_volatile.py`` holds a masked example and a kept
counter-example per row, on both engines). Character classes are ASCII only (``[0-9]``, never ``\\d``);
a token must start and end at a boundary (no ASCII letter or digit right before or after it):

==================  ===============================================  ==========================  ===========
rule                masked (marker)                                  example masked              kept
==================  ===============================================  ==========================  ===========
id after a prefix   ``req_``, ``id=`` (+ the tool's                  ``req_5f1cA9`` ->           ``required``
                    ``volatile_prefixes``) then ``[A-Za-z0-9_-]+``   ``req_<id>``
                    (``<id>``)
number after a      ``pid``, ``tid``, ``attempt``, ``retry`` (any    ``pid 4242`` ->             ``pids 42``
keyword             case; + ``volatile_keywords``), up to 3 of       ``pid <n>``
                    `` =:#``, then digits (``<n>``)
UUID                8-4-4-4-12 hex digits (``<uuid>``)               ``550e8400-e29b-41d4-a716-  ``550e8400-e29b``
                                                                     446655440000``
date-time           ``YYYY-MM-DD`` or ``YYYY/MM/DD``, ``T`` or a     ``2026-12-01T15:25:56.1Z``  ``2026-12-01``
                    space, ``HH:MM[:SS[.fff]]``, optional ``Z`` or   ``-> <datetime>``
                    ``+HH[:]MM``; and the common log format
                    ``01/Dec/2026:15:25:56 +0000`` (``<datetime>``)
``0x`` hex          ``0x`` then hex digits (``<hex>``)               ``0x7ffd5e8c``              ``0xyz``
hex run             8+ hex digits with at least one of a-f / A-F     ``5f1c2a3b9e``              ``12345678``
                    (``<hex>``)
long number         10+ digits (``<num>``)                           ``1733065556123``           ``123456789``
time of day         ``H:MM:SS`` / ``HH:MM:SS[.fff]``, not after a    ``15:25:56.120``            ``app.py:12:34``
                    ``:`` and not before ``:`` and a digit (``<time>``)
duration            a number, an optional space and a unit (``ns``,  ``812ms``, ``30.2 s``      ``HTTP 503``
                    ``us``, ``ms``, ``s``, ``sec``, ``secs``,
                    ``second(s)``, ``min``, ``mins``, ``minute(s)``,
                    ``h``, ``hr``, ``hrs``, ``hour(s)``)
                    (``<duration>``)
==================  ===============================================  ==========================  ===========

Everything else is kept: HTTP status codes, errno names, exit codes, ports, paths, ``file:line:col``,
words, numbers under 10 digits, so ``HTTP 503`` and ``HTTP 429`` stay different. Arguments are never
masked: ``merge PR 101`` and ``merge PR 102`` are different calls.

Per tool (policy): ``mask_volatile: false`` switches masking off (the fingerprint is then the exact
hash); ``volatile_prefixes`` and ``volatile_keywords`` extend the two open rows (ASCII, at most 32
characters each). The rules are one regular expression, written here and compiled by both engines from
the same text (the native one with ``fancy-regex``, which backtracks as Python's ``re`` does); masking is
idempotent (markers contain nothing a rule matches).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Final

from .errors import PolicyError
from .normalize import DEFAULT_FILTER, MAX_DEPTH, FieldFilter, semantic_hash

#: Built-in prefixes whose following id is masked.
DEFAULT_PREFIXES: Final = ("req_", "id=")
#: Built-in words whose following number is masked.
DEFAULT_KEYWORDS: Final = ("pid", "tid", "attempt", "retry")
#: Longest prefix or keyword a policy may add.
MAX_TOKEN_LENGTH: Final = 32

_B: Final = r"(?<![A-Za-z0-9])"
_E: Final = r"(?![A-Za-z0-9])"
_D: Final = "[0-9]"
_H: Final = "[0-9A-Fa-f]"
_MONTHS: Final = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
# Longest first: leftmost-first alternation then never needs to back off a shorter unit.
_UNITS: Final = "seconds|second|secs|sec|minutes|minute|mins|min|hours|hour|hrs|hr|ns|us|ms|s|h"

#: The marker of each group, in group order (group names are ``g0``..``g9``).
MARKERS: Final = ("<id>", "<n>", "<uuid>", "<datetime>", "<datetime>", "<hex>", "<hex>", "<num>", "<time>",
                  "<duration>")


def _literal(text: str) -> str:
    """``text`` as a pattern both engines read alike: ASCII letters, digits and ``_`` as themselves,
    anything else as ``\\xHH``."""
    return "".join(c if c.isascii() and (c.isalnum() or c == "_") else f"\\x{ord(c):02x}" for c in text)


def _caseless(word: str) -> str:
    """``word`` matched in any ASCII case, spelled out as classes (no ``(?i)``: Unicode case folding
    would let ``K`` (Kelvin sign) match ``k`` in one engine's reading and not the other's)."""
    return "".join(f"[{c.upper()}{c.lower()}]" if c.isascii() and c.isalpha() else _literal(c) for c in word)


def check_tokens(name: str, tokens: Iterable[str]) -> None:
    """Refuse prefixes or keywords the pattern cannot hold alike in both engines."""
    for token in tokens:
        if not 0 < len(token) <= MAX_TOKEN_LENGTH or not token.isascii() or not token.isprintable():
            raise PolicyError(f"{name}: each entry must be 1 to {MAX_TOKEN_LENGTH} printable ASCII characters, "
                              f"got {token!r}")


def pattern(prefixes: Iterable[str] = (), keywords: Iterable[str] = ()) -> str:
    """The masking rules with the built-in and the given prefixes and keywords, as one pattern text."""
    prefix_alt = "|".join(_literal(p) for p in sorted({*DEFAULT_PREFIXES, *prefixes}, key=lambda p: (-len(p), p)))
    keyword_alt = "|".join(_caseless(k) for k in sorted({*DEFAULT_KEYWORDS, *keywords}, key=lambda k: (-len(k), k)))
    d, h = _D, _H
    rules = (
        f"{_B}(?:{prefix_alt})(?P<g0>[A-Za-z0-9_-]+)",
        f"{_B}(?:{keyword_alt})[ =:#]{{0,3}}(?P<g1>{d}+){_E}",
        f"{_B}(?P<g2>{h}{{8}}-{h}{{4}}-{h}{{4}}-{h}{{4}}-{h}{{12}}){_E}",
        f"{_B}(?P<g3>{d}{{4}}(?:-{d}{{2}}-|/{d}{{2}}/){d}{{2}}[T ]{d}{{2}}:{d}{{2}}(?::{d}{{2}}(?:[.,]{d}+)?)?"
        f"(?:Z|[+-]{d}{{2}}(?::?{d}{{2}})?)?){_E}",
        f"{_B}(?P<g4>{d}{{2}}/(?:{_MONTHS})/{d}{{4}}:{d}{{2}}:{d}{{2}}:{d}{{2}}(?: [+-]{d}{{4}})?){_E}",
        f"{_B}(?P<g5>0[xX]{h}+){_E}",
        f"{_B}(?P<g6>(?={d}*[A-Fa-f]){h}{{8,}}){_E}",
        f"{_B}(?P<g7>{d}{{10,}}){_E}",
        f"(?<![A-Za-z0-9:])(?P<g8>{d}{{1,2}}:{d}{{2}}:{d}{{2}}(?:[.,]{d}+)?)(?![A-Za-z0-9]|:[0-9<])",
        f"{_B}(?P<g9>{d}+(?:\\.{d}+)? ?(?:{_UNITS})){_E}",
    )
    return "|".join(rules)


#: The pattern of the default policy.
DEFAULT_PATTERN: Final = pattern()


class VolatileMask:
    """Masks the volatile tokens of every string in a JSON-like value (keys are left alone)."""

    __slots__ = ("_regex", "pattern")

    def __init__(self, pattern_text: str = DEFAULT_PATTERN) -> None:
        self.pattern = pattern_text
        self._regex = re.compile(pattern_text)

    def text(self, value: str) -> str:
        """``value`` with its volatile tokens replaced by their markers."""
        return self._regex.sub(_replace, value)

    def value(self, value: Any, depth: int = 0) -> Any:
        """A copy of ``value`` with every string masked; other values as they are. A container at
        ``MAX_DEPTH`` (``normalize``) or deeper is left as it is: the fingerprint never reads it (the
        semantic hash has no form for it, unless a field dropped above it drops it too), and masking
        it would recurse as deep as the result nests (a failing result 500 levels deep overflowed
        Python's stack and stopped the worker's agent)."""
        kind = type(value)
        if kind is str:
            return self._regex.sub(_replace, value)
        if depth >= MAX_DEPTH:
            return value
        if kind is dict:
            return {k: self.value(v, depth + 1) for k, v in value.items()}
        if kind is list or kind is tuple:
            return [self.value(v, depth + 1) for v in value]
        return value


    def fingerprint(self, value: Any, fields: FieldFilter = DEFAULT_FILTER, collapse_whitespace: bool = True) -> str:
        """The result fingerprint (``result_fp``): the semantic hash of ``value`` masked; raises
        ``NormalisationError`` as ``semantic_hash`` does."""
        return semantic_hash(self.value(value), fields, collapse_whitespace)


def _replace(match: re.Match[str]) -> str:
    group = match.lastgroup
    assert group is not None  # every alternative is one named group
    start = match.start(group) - match.start()
    return match.group()[:start] + MARKERS[int(group[1:])]
