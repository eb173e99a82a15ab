"""Test doubles shared by the SDK and guard tests: a counting tool, and a tap on a guard's telemetry."""

from __future__ import annotations

from typing import Any

from stream_app.client import Guard


class Counted:
    """A tool that counts its executions and returns (or raises) ``answer``."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls = 0

    def __call__(self, **kwargs: Any) -> Any:
        self.calls += 1
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def telemetry_of(guard: Guard) -> list[dict[str, Any]]:
    """Every telemetry event the guard builds from now on (in-process, they go to its detector)."""
    events: list[dict[str, Any]] = []
    build = guard.builder.build

    def recording(*args: Any, **kwargs: Any) -> dict[str, Any]:
        events.append(build(*args, **kwargs))
        return events[-1]

    guard.builder.build = recording  # type: ignore[method-assign]
    return events
