"""Settings tables: the one reader of every ``(field, VAR, default, doc)`` table in the project.

A process that runs on the bus (the worker, the notifier) is configured by environment variables only,
read once at start-up into a frozen dataclass and validated there. Its table is the single source of
the variable names, the defaults and the documentation: the README's tables are checked against it,
and the test and bench harnesses build a worker's environment from it (``SettingsTable.env``), so a
variable renamed here cannot linger anywhere else.

A value is converted by the type its dataclass field is annotated with (``int``, ``float``, ``bool``,
``str``, ``Path`` or ``Path | None``); a value that does not convert raises the table's error naming
the variable, before anything starts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Final

from ..core import LoopwardenError

#: (dataclass field, environment variable, default as written in the environment, meaning)
Row = tuple[str, str, str, str]

_TRUE: Final = ("true", "1", "yes")
_FALSE: Final = ("false", "0", "no")


class SettingsError(LoopwardenError, ValueError):
    """An environment variable has a value the process cannot use. Operator action: fix that variable."""


@dataclass(frozen=True)
class SettingsTable(Sequence[Row]):
    """The rows of one process's settings, a sequence of ``Row``."""

    rows: tuple[Row, ...]
    #: Raised for a bad value (a subclass of SettingsError names the process in tracebacks).
    error: type[SettingsError] = SettingsError

    def __post_init__(self) -> None:
        names = [row[0] for row in self.rows]
        if len(set(names)) != len(names):
            raise SettingsError(f"settings table repeats a field: {names}")

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Row:  # type: ignore[override]
        return self.rows[index]

    def var(self, name: str) -> str:
        """The environment variable of field ``name``."""
        for field_name, var, _, _ in self.rows:
            if field_name == name:
                return var
        raise SettingsError(f"{name}: not a setting of this table")

    def read(self, target: type, env: Mapping[str, str], overrides: Mapping[str, object] | None = None
             ) -> dict[str, Any]:
        """Every field's value from ``env`` (defaults for what is unset), converted to the type
        ``target`` (a dataclass) annotates it with; ``overrides`` (None values skipped) win over the
        environment, e.g. command-line options."""
        types = {f.name: str(f.type) for f in fields(target)}
        given = {name: str(value) for name, value in (overrides or {}).items() if value is not None}
        values: dict[str, Any] = {}
        for name, var, default, _ in self.rows:
            raw = given.get(name, env.get(var, default)).strip()
            values[name] = self._convert(var, raw, types[name])
        return values

    def env(self, **values: object) -> dict[str, str]:
        """The environment that sets these fields (by field name), for harnesses that start a process;
        an unknown field name is a SettingsError, so a typo cannot pass unnoticed."""
        out: dict[str, str] = {}
        for name, value in values.items():
            var = self.var(name)
            out[var] = ("true" if value else "false") if isinstance(value, bool) else str(value)
        return out

    def _convert(self, var: str, raw: str, kind: str) -> object:
        try:
            if kind == "int":
                return int(raw)
            if kind == "float":
                value = float(raw)
                if not math.isfinite(value):  # nan passes every comparison a check makes: refused here
                    raise ValueError(raw)
                return value
            if kind == "bool":
                lowered = raw.lower()
                if lowered not in _TRUE + _FALSE:
                    raise ValueError(raw)
                return lowered in _TRUE
            if kind == "Path":
                return Path(raw)
            if kind == "Path | None":
                return Path(raw) if raw else None
            if kind == "str":
                return raw
        except ValueError as exc:
            raise self.error(f"{var}={raw!r}: expected {'a finite number' if kind == 'float' else kind}") from exc
        raise SettingsError(f"{var}: settings of type {kind} are not supported by the table reader")
