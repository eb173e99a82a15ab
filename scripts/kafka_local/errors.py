"""The errors every part of kafka_local raises, in one module the others import without importing each other."""

from __future__ import annotations

#: How many lines of a log or a tool's output an error message quotes.
LOG_TAIL_LINES = 40


class KafkaLocalError(RuntimeError):
    """Resolving, starting, stopping or talking to the local broker failed."""


class BrokerStartError(KafkaLocalError):
    """The broker did not become ready; the message ends with the tail of its logs."""


class BrokerUnreachable(KafkaLocalError):
    """No connection to the broker, or no answer in time: worth retrying while it starts. A refused
    certificate or login is a plain KafkaLocalError, which waiting does not cure."""


def output_tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a tool's output, for an error message."""
    return "\n".join(text.strip().splitlines()[-lines:])
