"""``loopwarden replay``: the detector over a telemetry JSONL file, no Kafka.

Decisions go to stdout as control v1 JSONL in input order; bad lines, progress and the summary go to
stderr. A bad line is reported with its number and reason and skipped; the exit status says whether
any line was bad.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import BinaryIO, TextIO

import orjson

from .core import Detector, InvalidEvent, Policy, RunTable, parse_event


@dataclass
class ReplaySummary:
    events: int = 0
    duplicates: int = 0
    bad_lines: int = 0
    runs: set[str] = field(default_factory=set)
    decisions: Counter[tuple[str, str]] = field(default_factory=Counter)

    def render(self) -> str:
        by_kind = ", ".join(f"{action}/{verdict} {n}" for (action, verdict), n in sorted(self.decisions.items()))
        return (
            f"loopwarden replay: {self.events} events ({self.duplicates} duplicates) in {len(self.runs)} runs; "
            f"{sum(self.decisions.values())} decisions{': ' + by_kind if by_kind else ''}; "
            f"{self.bad_lines} bad line{'s' if self.bad_lines != 1 else ''}"
        )


def replay(
    lines: Iterable[bytes],
    policy: Policy,
    out: BinaryIO,
    err: TextIO,
    flush_each: bool = False,
    progress_every_s: float | None = None,
) -> ReplaySummary:
    """Run every line through the detector; write decisions to ``out`` and problems to ``err``."""
    table = RunTable(Detector(policy))
    summary = ReplaySummary()
    runs = summary.runs
    next_progress = time.monotonic() + progress_every_s if progress_every_s else None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            event = parse_event(line)
        except InvalidEvent as exc:
            summary.bad_lines += 1
            err.write(f"line {number}: {exc}\n")
            continue
        summary.events += 1
        runs.add(event.run_id)
        evaluation = table.observe(event)
        if evaluation.duplicate:
            summary.duplicates += 1
            continue
        for decision in evaluation.decisions:
            summary.decisions[(decision.action, decision.verdict)] += 1
            out.write(orjson.dumps(decision.to_control()) + b"\n")
            if flush_each:
                out.flush()
        if next_progress is not None and number % 4096 == 0 and time.monotonic() >= next_progress:
            err.write(f"\r{number} lines, {len(table)} runs tracked ...")
            err.flush()
            next_progress = time.monotonic() + progress_every_s  # type: ignore[operator]
    if progress_every_s and next_progress is not None:
        err.write("\r")
    out.flush()
    return summary


def run_replay(path: str, policy: Policy) -> int:
    """CLI entry: exit status 0, or 1 if any line was bad."""
    stdin = path == "-"
    source: BinaryIO = sys.stdin.buffer if stdin else open(path, "rb")  # noqa: SIM115
    try:
        summary = replay(
            source,
            policy,
            sys.stdout.buffer,
            sys.stderr,
            flush_each=stdin,
            progress_every_s=1.0 if sys.stderr.isatty() else None,
        )
    finally:
        if not stdin:
            source.close()
    sys.stderr.write(summary.render() + "\n")
    return 1 if summary.bad_lines else 0
