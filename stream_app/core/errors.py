"""Errors raised by the detector core.

Tree::

    LoopwardenError
    ├── InvalidEvent        a telemetry event breaks the v1 contract (names the field)
    ├── NormalisationError  arguments or a result cannot be put in canonical form
    └── PolicyError         a policy file is malformed (names the setting's path)

``InvalidEvent`` and ``PolicyError`` are for people to fix; their messages say what is wrong and where.
"""

from __future__ import annotations

from typing import ClassVar


class LoopwardenError(Exception):
    """Root of every error loopwarden raises on purpose."""


class InvalidEvent(LoopwardenError):
    """A telemetry event that cannot be processed; ``field`` names the offending field ('' = whole event).

    ``field or kind`` classifies it (the worker's dead-letter reason and metric label): a field name, or
    for a whole event ``payload`` (not an event) or ``json`` (not JSON at all, ``NotJSON``).
    """

    kind: ClassVar[str] = "payload"

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}" if field else reason)


class NotJSON(InvalidEvent):
    """The bytes are not JSON (invalid UTF-8, NaN, nesting too deep...)."""

    kind: ClassVar[str] = "json"

    def __init__(self, reason: str) -> None:
        super().__init__("", f"not JSON: {reason}")


class NormalisationError(LoopwardenError):
    """A value has no canonical JSON form (non-finite float, unsupported type, nesting too deep)."""


class PolicyError(LoopwardenError):
    """A policy document is malformed. Operator action: fix the setting named in the message."""
