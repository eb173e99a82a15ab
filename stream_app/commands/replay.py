"""``loopwarden replay``: the detector over a telemetry JSONL file, no Kafka.

Decisions go to stdout as control v1 JSONL in input order; bad lines, progress and the summary go to
stderr. A bad line is reported with its number and reason and skipped; the exit status says whether
any line was bad.

Two engines give the same output byte for byte (the differential tests hold them to it):

* ``python``: the reference core (``stream_app.core``), as the worker and the SDK run it;
* ``native``: ``loopwarden_native``, the fold, normalisation and hashing in Rust (``native/``), several
  times faster. It hands back to the reference what it does not decode itself (bad or unusual lines),
  and the reference writes every decision's text. ``auto`` (the default) picks it when installed.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, BinaryIO, Literal, TextIO

import orjson

from ..core import (
    Decision,
    Detector,
    Finding,
    InvalidEvent,
    LoopwardenError,
    Policy,
    RunTable,
    TelemetryEvent,
    event_hashes,
    explain,
    parse_event,
)
from ..core.contract import MAX_EVENT_BYTES, micro_usd, token_count
from ..core.fleet import (
    ScopeDecision,
    ThreadFact,
    ThreadFold,
    ToolFact,
    ToolFold,
    TreeFact,
    TreeFold,
    root_cost,
    root_spent,
    thread_fact,
    tool_fact,
    tree_fact,
)
from ..core.runs import DEFAULT_MAX_RUNS

Engine = Literal["auto", "native", "python"]
ENGINES: tuple[Engine, ...] = ("auto", "native", "python")

#: Lines handed to the native engine per call (one at a time when reading a live stdin).
CHUNK_LINES = 4096


class EngineUnavailable(LoopwardenError, RuntimeError):
    """``--engine native`` without the native extension. Operator action: ``pip install ./native`` (or
    ``make install``), or use ``--engine python``."""


#: Halted run ids the summary names, at most.
HALTED_LISTED = 10
#: ``ts_ms`` values below this are 1973 in milliseconds, but today in seconds: a runtime's unit mistake.
SECONDS_LIKE_TS = 10**11


def _count(n: int, word: str, plural: str | None = None) -> str:
    return f"{n:,} {word if n == 1 else plural or word + 's'}"


@dataclass
class ReplaySummary:
    events: int = 0
    duplicates: int = 0
    bad_lines: int = 0
    runs: int = 0
    decisions: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: Halted runs in the order of their halts (the first ``HALTED_LISTED`` of them), and how many in all.
    halted: list[str] = field(default_factory=list)
    halted_runs: int = 0
    #: Halted sub-agent trees (root run ids) in the order of their first halts.
    halted_trees: list[str] = field(default_factory=list)
    #: Halted threads (``TENANT/THREAD``) in the order of their first halts.
    halted_threads: list[str] = field(default_factory=list)
    #: Paused tools (``TENANT/TOOL/UPSTREAM``) in the order of their first pauses.
    paused_tools: list[str] = field(default_factory=list)
    #: The newest event time seen (0: none).
    newest_ts_ms: int = 0

    def render(self) -> str:
        by_kind = ", ".join(f"{action}/{verdict} {n}" for (action, verdict), n in sorted(self.decisions.items()))
        text = (
            f"loopwarden replay: {_count(self.events, 'event')} ({_count(self.duplicates, 'duplicate')}) in "
            f"{_count(self.runs, 'run')}; {_count(sum(self.decisions.values()), 'decision')}"
            f"{': ' + by_kind if by_kind else ''}; {_count(self.bad_lines, 'bad line')}"
        )
        if self.halted_runs:
            more = self.halted_runs - len(self.halted)
            text += (f"\nhalted: {', '.join(self.halted)}" + (f" and {_count(more, 'more run')}" if more else ""))
        if self.halted_trees:
            listed = self.halted_trees[:HALTED_LISTED]
            more = len(self.halted_trees) - len(listed)
            text += (f"\nhalted trees: {', '.join(listed)}" + (f" and {_count(more, 'more tree')}" if more else ""))
        if self.halted_threads:
            listed = self.halted_threads[:HALTED_LISTED]
            more = len(self.halted_threads) - len(listed)
            text += (f"\nhalted threads: {', '.join(listed)}" + (f" and {_count(more, 'more thread')}" if more else ""))
        if self.paused_tools:
            listed = self.paused_tools[:HALTED_LISTED]
            more = len(self.paused_tools) - len(listed)
            text += (f"\npaused tools: {', '.join(listed)}" + (f" and {_count(more, 'more tool')}" if more else ""))
        if self.events and self.newest_ts_ms < SECONDS_LIKE_TS:
            text += ("\nwarning: every ts_ms is below 10^11, which looks like seconds, not milliseconds: windows "
                     "and run expiry would be a thousand times too long; send epoch milliseconds")
        return text


def replay(
    lines: Iterable[bytes],
    policy: Policy,
    out: BinaryIO,
    err: TextIO,
    flush_each: bool = False,
    progress_every_s: float | None = None,
    engine: Engine = "auto",
) -> ReplaySummary:
    """Run every line through the detector; write decisions to ``out`` and problems to ``err``."""
    writer = _Writer(out, err, flush_each, progress_every_s)
    native: Any = None
    if engine != "python":
        try:
            from loopwarden_native import Replayer
        except ImportError as exc:
            if engine == "native":
                raise EngineUnavailable("the native engine is not installed: pip install ./native (make install "
                                        "does), or use --engine python") from exc
        else:
            native = Replayer(policy, DEFAULT_MAX_RUNS, MAX_EVENT_BYTES)
    if native is None:
        _replay_python(lines, policy, writer)
    else:
        _replay_native(lines, policy, writer, native)
    writer.finish()
    return writer.summary


class _Writer:
    """Decisions to ``out``, bad lines and progress to ``err``, counts into the summary."""

    def __init__(self, out: BinaryIO, err: TextIO, flush_each: bool, progress_every_s: float | None) -> None:
        self.out, self.err, self.flush_each = out, err, flush_each
        self.summary = ReplaySummary()
        self.progress_every_s = progress_every_s
        self.next_progress = time.monotonic() + progress_every_s if progress_every_s else None

    def decision(self, decision: Decision) -> None:
        summary = self.summary
        summary.decisions[(decision.action, decision.verdict)] += 1
        if decision.action == "halt":
            summary.halted_runs += 1
            if len(summary.halted) < HALTED_LISTED:
                summary.halted.append(decision.run_id)
        self.out.write(orjson.dumps(decision.to_control()) + b"\n")
        if self.flush_each:
            self.out.flush()

    def scope_decision(self, decision: ScopeDecision) -> None:
        summary = self.summary
        summary.decisions[(decision.action, decision.verdict)] += 1
        if decision.action == "halt" or (decision.action == "pause" and decision.scope == "tool"):
            halted = {"tree": summary.halted_trees, "thread": summary.halted_threads}.get(decision.scope,
                                                                                       summary.paused_tools)
            if decision.key_text not in halted:
                halted.append(decision.key_text)
        self.out.write(orjson.dumps(decision.to_control()) + b"\n")
        if self.flush_each:
            self.out.flush()

    def bad_line(self, number: int, error: InvalidEvent) -> None:
        self.summary.bad_lines += 1
        self.err.write(f"line {number}: {error}\n")

    def progress(self, lines: int, runs_tracked: int) -> None:
        if self.next_progress is not None and time.monotonic() >= self.next_progress:
            self.err.write(f"\r{lines} lines, {runs_tracked} runs tracked ...")
            self.err.flush()
            self.next_progress = time.monotonic() + self.progress_every_s  # type: ignore[operator]

    def finish(self) -> None:
        if self.next_progress is not None:
            self.err.write("\r")
        self.out.flush()


def _replay_python(lines: Iterable[bytes], policy: Policy, writer: _Writer) -> None:
    table = RunTable(Detector(policy))
    folds = _Folds(policy)
    summary = writer.summary
    runs: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            event = parse_event(line)
        except InvalidEvent as exc:
            writer.bad_line(number, exc)
            continue
        summary.events += 1
        runs.add(event.run_id)
        if event.ts_ms > summary.newest_ts_ms:
            summary.newest_ts_ms = event.ts_ms
        state = table.get(event.run_id)
        spent = None if state is None else root_spent(state)
        evaluation = table.observe(event)
        if evaluation.duplicate:
            summary.duplicates += 1
            continue
        for decision in evaluation.decisions:
            writer.decision(decision)
        state = table.get(event.run_id)
        folds.event(writer, event, root_cost(spent, None if state is None else root_spent(state)))
        if number % 4096 == 0:
            writer.progress(number, len(table))
    summary.runs = len(runs)


class _Folds:
    """The folds across runs (``core/fleet``), fed each new event after its run's decisions."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.trees = TreeFold(policy.fleet)
        self.threads = ThreadFold(policy.fleet)
        self.tools = ToolFold(policy.fleet)

    def event(self, writer: _Writer, event: TelemetryEvent, spent: int | None) -> None:
        """``spent``: what the event adds to its tree's spend if its run is a root (``root_cost``: None
        until the run has spawned)."""
        if (event.root_run_id is not None and event.root_run_id != event.run_id) or event.tool_class in (None, "spawn") \
                or (spent is not None and event.cost_usd):
            tool_class = event.tool_class or self.policy.resolve(event.agent_id, event.tool).thresholds.tool_class
            self.tree(writer, tree_fact(event, tool_class, spent))
        if event.thread_key is not None:
            self.thread(writer, thread_fact(event))
        if event.upstream is not None:
            self.tool(writer, tool_fact(event))

    def tree(self, writer: _Writer, fact: TreeFact | None) -> None:
        if fact is not None:
            for decision in self.trees.observe(fact):
                writer.scope_decision(decision)

    def thread(self, writer: _Writer, fact: ThreadFact | None) -> None:
        if fact is not None:
            for decision in self.threads.observe(fact):
                writer.scope_decision(decision)

    def tool(self, writer: _Writer, fact: ToolFact | None) -> None:
        if fact is not None:
            for decision in self.tools.observe(fact):
                writer.scope_decision(decision)


def _replay_native(lines: Iterable[bytes], policy: Policy, writer: _Writer, engine: Any) -> None:
    folds = _Folds(policy)

    def decide(event: TelemetryEvent, finding: tuple[Any, ...]) -> None:
        writer.decision(explain(event, policy.resolve(event.agent_id, event.tool).thresholds,
                                Finding.of_native(finding)))

    done = 0
    for chunk in _chunks(lines, 1 if writer.flush_each else CHUNK_LINES):
        start = 0
        while True:
            stop, findings = engine.feed(chunk, start)
            facts = engine.take_facts()
            if facts:  # the folds across runs after each line's run decisions, in line order
                steps = sorted([(index, 0, n, finding) for n, (index, finding) in enumerate(findings)]
                               + [(item[0], 1, n, item) for n, item in enumerate(facts)])
                for index, is_fact, _, item in steps:
                    if is_fact:
                        _, tree, thread, tool = item
                        folds.tree(writer, None if tree is None else TreeFact(*tree))
                        folds.thread(writer, None if thread is None else ThreadFact(*thread))
                        folds.tool(writer, None if tool is None else ToolFact.of(*tool))
                    else:
                        decide(parse_event(chunk[index]), item)
            else:
                for index, finding in findings:
                    decide(parse_event(chunk[index]), finding)  # rare: the reference decodes it for the text
            if stop == len(chunk):
                break
            # A line the fast path did not decode: the reference reports it, or decodes and hashes it.
            try:
                event = parse_event(chunk[stop])
            except InvalidEvent as exc:
                writer.bad_line(done + stop + 1, exc)
            else:
                spent = engine.root_spent(event.run_id)
                duplicate, event_findings = _observe(engine, event, policy)
                for finding in event_findings:
                    decide(event, finding)
                if not duplicate:
                    folds.event(writer, event, root_cost(spent, engine.root_spent(event.run_id)))
            start = stop + 1
        done += len(chunk)
        writer.progress(done, len(engine))
    summary = writer.summary
    summary.events, summary.duplicates, summary.runs = engine.events, engine.duplicates, engine.runs_seen
    summary.newest_ts_ms = engine.watermark_ms


def _observe(engine: Any, event: TelemetryEvent, policy: Policy) -> tuple[bool, list[tuple[Any, ...]]]:
    """Fold an event the reference decoded into the native engine, with the reference's hashes: whether
    it was a redelivery, and its findings."""
    args_hash, args_verified, result_hash, result_fp, args_text = event_hashes(
        event, policy.resolve(event.agent_id, event.tool))
    duplicate, findings = engine.observe(
        event.run_id, event.event_id, event.tool, event.agent_id, event.ts_ms, event.outcome, args_hash,
        args_verified, result_hash, result_fp, event.retry_budget, event.plan_step, event.side_effect,
        event.tool_class, event.target, event.state_hash, event.kind == "model_call", token_count(event.tokens),
        micro_usd(event.cost_usd), args_text, event.error_class, event.child_agent_id, event.upstream)
    return bool(duplicate), list(findings)


def _chunks(lines: Iterable[bytes], size: int) -> Iterator[list[bytes]]:
    iterator = iter(lines)
    while chunk := list(islice(iterator, size)):
        yield chunk


def run_replay(path: str, policy: Policy, engine: Engine = "auto") -> int:
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
            engine=engine,
        )
    finally:
        if not stdin:
            source.close()
    sys.stderr.write(summary.render() + "\n")
    return 1 if summary.bad_lines else 0
