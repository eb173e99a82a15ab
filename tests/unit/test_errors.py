"""One error root: every exception class the package defines is a LoopwardenError, drawn in the tree of
``stream_app.core.errors``, and classified by class or field, never by its message."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import stream_app
from stream_app.core import InvalidEvent, LoopwardenError, NotJSON
from stream_app.core import errors as core_errors
from stream_app.worker.batch import DeadLetter

#: A simulated tool's own failure: what a tool raises, not what loopwarden raises.
NOT_OURS = {"stream_app.devtools.scenarios.ToolFailed", "stream_app.devtools.demo.Upstream503"}


def _exception_classes() -> list[type[BaseException]]:
    found = []
    for module_info in pkgutil.walk_packages(stream_app.__path__, "stream_app."):
        if module_info.name == "stream_app.__main__":
            continue
        module = importlib.import_module(module_info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                found.append(obj)
    return found


EXCEPTIONS = _exception_classes()
#: The tree's lines in core/errors.py's docstring.
TREE = [line for line in (core_errors.__doc__ or "").splitlines() if "LoopwardenError" in line or "──" in line]


@pytest.mark.parametrize("error", EXCEPTIONS, ids=lambda e: f"{e.__module__}.{e.__qualname__}")
def test_every_error_the_package_defines_is_a_loopwarden_error(error: type[BaseException]) -> None:
    if f"{error.__module__}.{error.__qualname__}" in NOT_OURS:
        assert not issubclass(error, LoopwardenError)
        return
    assert issubclass(error, LoopwardenError)
    drawn = {next(word for word in line.split() if word[0].isalpha()) for line in TREE}
    assert error.__qualname__.rsplit(".", 1)[-1] in drawn, "draw it in core/errors.py's tree"


def test_builtin_bases_callers_relied_on_are_kept() -> None:
    from stream_app.bus.kafka import KafkaConfigError
    from stream_app.bus.settings import SettingsError
    from stream_app.client import InvalidArgumentType, InvalidCall, UsageError
    from stream_app.commands.replay import EngineUnavailable
    from stream_app.worker.main import TopicMismatch

    for error, builtin in [(KafkaConfigError, ValueError), (SettingsError, ValueError), (InvalidCall, ValueError),
                           (InvalidArgumentType, TypeError), (UsageError, RuntimeError),
                           (EngineUnavailable, RuntimeError), (TopicMismatch, RuntimeError)]:
        assert issubclass(error, builtin), error


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (NotJSON("unexpected character"), "json"),
        (InvalidEvent("", "not JSON-looking at all, but an InvalidEvent"), "payload"),  # the text is not read
        (InvalidEvent("ts_ms", "not JSON: a field error whatever its text"), "ts_ms"),
    ],
)
def test_a_dead_letters_reason_is_its_class_or_field(error: InvalidEvent, reason: str) -> None:
    assert DeadLetter(0, error).reason == reason


def test_a_duplicate_refused_by_a_framework_is_the_sdks_duplicate_suppressed() -> None:
    """One class to catch, whatever integration refused it; the OpenAI Agents one is also an
    AgentsException (the only kind that SDK lets out of a hook)."""
    from agents import AgentsException

    from stream_app.client import DuplicateSuppressed
    from stream_app.integrations import langchain, openai_agents

    assert langchain.DuplicateSuppressed is DuplicateSuppressed
    assert issubclass(openai_agents.DuplicateSuppressed, DuplicateSuppressed)
    assert issubclass(openai_agents.DuplicateSuppressed, AgentsException)
    text = str(openai_agents.DuplicateSuppressed("run-1", "send_email", "a run hook", "LoopwardenToolGuardrails"))
    assert text == ("run run-1: loopwarden suppressed a duplicate call of send_email; a run hook cannot hand back "
                    "the earlier result, so the call is refused (LoopwardenToolGuardrails would answer it)")
