"""What changed in a call's arguments between the first call of a streak and the call a decision is
about: the ``args_diff`` of a halt's evidence, for on-call.

Both sides are canonical JSON of normalised arguments (what the detector compared: ignored fields are
gone, whitespace collapsed), kept only when the runtime sent raw arguments; without both the diff is
``"unavailable"``. The diff flattens each side to leaf paths (``query``, ``filters.lang``, ``ids[2]``) and
lists, sorted by path (a key that is not a plain name is quoted: ``["a.b"]``, so paths never clash),
those ``changed`` (``[before, after]``), ``added`` and ``removed``: at most
``MAX_ENTRIES`` of them (``more`` counts the rest), strings cut to ``MAX_CHARS`` characters. ``{}`` means
identical after normalisation (a recursion's arguments always are).

Evidence travels further than telemetry (alerts, webhooks, chat), so the diff never quotes a secret: a
value under a field named like one (``core/secrets.py``, the names the SDK strips) is shown as ``***``,
and secrets inside strings are masked as in ``error_head``.
"""

from __future__ import annotations

import re
from typing import Any, Final

import orjson

from .normalize import FieldFilter
from .secrets import DEFAULT_REDACTED_FIELDS, mask_secrets_in_text

UNAVAILABLE: Final = "unavailable"
MAX_ENTRIES: Final = 10
MAX_CHARS: Final = 64
MASKED: Final = "***"
_SECRETS: Final = FieldFilter(DEFAULT_REDACTED_FIELDS)
_PLAIN: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def args_diff(first: str, last: str) -> dict[str, Any] | str:
    """The diff of two calls' canonical arguments (``""``: not available)."""
    if not first or not last:
        return UNAVAILABLE
    if first == last:
        return {}
    before, after = _leaves(orjson.loads(first)), _leaves(orjson.loads(last))
    entries: list[tuple[str, str, Any]] = []
    for path in sorted(before.keys() | after.keys()):
        if path not in after:
            entries.append(("removed", path, _cut(before[path])))
        elif path not in before:
            entries.append(("added", path, _cut(after[path])))
        elif before[path] != after[path] or type(before[path]) is not type(after[path]):
            entries.append(("changed", path, [_cut(before[path]), _cut(after[path])]))
    diff: dict[str, Any] = {}
    for kind in ("changed", "added", "removed"):
        listed = {path: value for which, path, value in entries[:MAX_ENTRIES] if which == kind}
        if listed:
            diff[kind] = listed
    if len(entries) > MAX_ENTRIES:
        diff["more"] = len(entries) - MAX_ENTRIES
    return diff


def _leaves(value: Any, path: str = "", out: dict[str, Any] | None = None, secret: bool = False) -> dict[str, Any]:
    """Leaf path -> value (``MASKED`` under a secret's name); an empty object or array is a leaf, and so
    is the whole of a scalar."""
    if out is None:
        out = {}
    if type(value) is dict and value:
        for key, item in value.items():
            step = key if _PLAIN.fullmatch(key) else f"[{orjson.dumps(key).decode()}]"
            _leaves(item, f"{path}.{step}" if path and step[0] != "[" else path + step, out,
                    secret or _SECRETS.is_ignored(key))
    elif type(value) is list and value:
        for index, item in enumerate(value):
            _leaves(item, f"{path}[{index}]", out, secret)
    else:
        out[path or "$"] = (MASKED, value) if secret else value  # still compared by value
    return out


def _cut(value: Any) -> Any:
    if type(value) is tuple:
        return MASKED
    if type(value) is str:
        value = mask_secrets_in_text(value)
        if len(value) > MAX_CHARS:
            return value[: MAX_CHARS - 3] + "..."
    return value
