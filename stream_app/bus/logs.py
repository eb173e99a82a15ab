"""Logging of the processes on the bus (the worker, the notifier): one line per record on stderr.

``json`` (the default, ``LOOPWARDEN_LOG_FORMAT``): every line is one JSON object, whoever wrote it
(loopwarden, faust, mode, aiokafka, Python's warnings, an uncaught exception's traceback), so a log
shipper needs no multi-line rules: ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``msg``, ``exc`` (the
traceback as one string) and any ``extra`` fields. ``text``: ``ts level logger: msg``, for people at a
terminal. The core logs nothing; quiet by default (``LOOPWARDEN_LOG_LEVEL=warning`` for the worker).
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Final, TextIO

import orjson

FORMATS: Final = ("json", "text")
_STANDARD: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """A record as one JSON object on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({name: value for name, value in record.__dict__.items()
                      if name not in _STANDARD and not name.startswith("_")})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(entry, default=repr).decode()


TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: str, fmt: str, stream: TextIO | None = None) -> None:
    """Route every logger, Python's warnings and uncaught exceptions to one handler on ``stream``
    (stderr) in format ``fmt``; ``level`` for the root logger."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    logging.getLogger("loopwarden").critical("uncaught %s", kind.__name__, exc_info=(kind, exc, tb))


def fatal(command: str, message: str, fmt: str) -> None:
    """A one-line error a person must act on: a JSON record in ``json``, the plain line in ``text``."""
    if fmt == "json":
        print(orjson.dumps({"ts": datetime.now(tz=UTC).isoformat(timespec="milliseconds"), "level": "CRITICAL",
                            "logger": f"loopwarden.{command}", "msg": f"loopwarden {command}: {message}"}).decode(),
              file=sys.stderr)
    else:
        print(f"loopwarden {command}: {message}", file=sys.stderr)
