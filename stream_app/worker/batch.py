"""The worker's batch algorithm, as one pure function: raw records and stored runs in, a result out.

``BatchFold.fold(records, stored, now_ms)`` is everything the worker decides about one batch, with no
Kafka, Faust or RocksDB in sight (this module imports none of them; a test checks), so it is tested
in-process and a native implementation can replace it whole. The I/O around it (reading stored runs,
publishing, writing state) is ``effects``; the consumer plumbing is ``delivery``.

For each record, in batch order:

1. an operator command (header ``lw_kind: operator``) is accepted only if signed by one of the operator
   keys and younger than the maximum age at ``now_ms`` (else it is dead-lettered: ``signature``,
   ``ts_ms``); anything else is decoded as telemetry v1 (a bad one is dead-lettered with its reason);
2. a good record whose key is not its run id is re-keyed (the effects re-publish it keyed by run id,
   where it is folded when it comes back) and not folded here;
3. the rest is grouped by (partition, run) in offset order and folded through the core detector into
   the run's stored state: a record at or below the offset stored with the run was folded before (the
   input is re-delivered after a crash) and is skipped, as is an event id the run has seen.

A record whose decoding or folding raises what no bad input should (a bug) is dead-lettered
(``FoldFailed``, reason ``internal``) and its run folded again from its stored record without it; the
native engine hands a batch it fails on to the reference. Only ``StoredRecordError`` leaves ``fold``.

The result holds each changed run's new stored record (one per run per batch, in the format version
the worker writes), the decisions in the order they were made, the dead letters and re-keys by record
index, counts for the metrics (events whose ``policy_digest`` is not the worker's policy's among
them), and ``facts``: what the folds keyed by something other than the run learn from the batch's new
events (redeliveries excluded), with the source partition and offset of each, encoded as the facts
topic's items (``core/fleet``; the format: ``worker/facts.py``; the worker publishes them re-keyed:
``worker/fleet.py``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from ..bus.signing import SignatureRejected
from ..bus.wire import KIND_HEADER, OPERATOR_KIND, header
from ..core import (
    Decision,
    Detector,
    Finding,
    InvalidEvent,
    OperatorCommand,
    TelemetryEvent,
    decode_operator_command,
    explain,
    parse_event,
)
from ..core.fleet import root_cost, root_spent, thread_fact, tool_fact, tree_fact
from ..core.stored import FORMAT_VERSION, StoredRecordError, StoredRun, decode_run, encode_run
from .facts import Fact, FactItem, fact_items

log = logging.getLogger(__name__)

__all__ = ["BatchFold", "BatchResult", "DeadLetter", "FoldFailed", "InputRecord", "NativeBatchFold", "RawRecord", "Rekey", "Verifier",
           "is_operator", "merge"]

Headers = Sequence[tuple[str, bytes]]


class Verifier(Protocol):
    """Checks a value's signature headers; returns the signing key's id or raises SignatureRejected
    (``bus.signing.KeyRing``)."""

    def verify(self, value: bytes, headers: Any) -> str: ...


class InputRecord(Protocol):
    """One input record as the consumer delivered it (aiokafka's ``ConsumerRecord`` is one)."""

    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Headers: ...


@dataclass(frozen=True, slots=True)
class RawRecord:
    """An input record made by hand (tests, tools): the fields ``fold`` reads."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Headers = ()


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Record ``index`` of the batch is refused; ``reason`` is its metric label and DLQ header."""

    index: int
    error: InvalidEvent

    @property
    def reason(self) -> str:
        return self.error.field or self.error.kind


@dataclass(frozen=True, slots=True)
class Rekey:
    """Record ``index`` of the batch belongs to run ``key``: publish it again keyed by that."""

    index: int
    key: bytes


class FoldFailed(InvalidEvent):
    """A record whose decoding or folding raised an error no bad input should (a loopwarden bug, the
    exception its ``cause``): dead-lettered with reason ``internal``, so the batch and the run's other
    records still fold and the record does not stop the worker's agent after every restart."""

    kind: ClassVar[str] = "internal"

    def __init__(self, cause: BaseException) -> None:
        super().__init__("", f"loopwarden failed on this record ({type(cause).__name__}: {cause}"[:500] + "); "
                         "its run was folded without it: a bug, please report it with the record")
        self.cause = cause


@dataclass(slots=True)
class _RunFold:
    """What folding one run of a batch gave (``BatchFold._fold_run``)."""

    decisions: list[Decision] = field(default_factory=list)
    applied: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    mismatches: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: (source offset, fact) of the run's new events.
    facts: list[tuple[int, Fact]] = field(default_factory=list)
    #: The run's new stored state, if any record was folded (or passed over).
    record: Any = None
    #: The record index being folded (None between records).
    at: int | None = None
    #: Record index -> the exception folding it raised (careful folds: ``BatchFold._fold_run``).
    failed: dict[int, BaseException] = field(default_factory=dict)


@dataclass(slots=True)
class BatchResult:
    #: New stored records by partition: (run key, encoded record), one per run the batch changed.
    records: dict[int, list[tuple[bytes, bytes]]] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    rekeys: list[Rekey] = field(default_factory=list)
    #: Telemetry events folded, by outcome class.
    applied: Counter[str] = field(default_factory=Counter)
    #: Records skipped as already folded (by offset or by event id).
    duplicates: int = 0
    #: The newest event time seen per partition (what run expiry goes by).
    watermarks: dict[int, int] = field(default_factory=dict)
    #: Folded events whose runtime's policy is not the worker's: (agent id or "", their digest) -> count.
    policy_mismatches: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: Tree, thread and tool facts of the new events as the facts topic's items (``worker/facts.py``),
    #: tool facts summed per source partition, key and window; the publisher sends them in source offset
    #: order.
    facts: list[FactItem] = field(default_factory=list)


def merge(result: BatchResult, indexes: Sequence[int], part: BatchResult) -> None:
    """Add ``part``, the result of a fold of the records at ``indexes`` of ``result``'s batch (its indexes are
    into that subset), to ``result``. Each run is wholly in one of them, or in ``part`` after ``result`` (a
    later part of the batch, folded on ``result``'s records): a run's new records and decisions keep their order."""
    for partition, changes in part.records.items():
        result.records.setdefault(partition, []).extend(changes)
    result.decisions.extend(part.decisions)
    result.dead_letters.extend(DeadLetter(indexes[d.index], d.error) for d in part.dead_letters)
    result.rekeys.extend(Rekey(indexes[r.index], r.key) for r in part.rekeys)
    result.applied.update(part.applied)
    result.duplicates += part.duplicates
    for partition, ts_ms in part.watermarks.items():
        if ts_ms > result.watermarks.get(partition, 0):
            result.watermarks[partition] = ts_ms
    result.policy_mismatches.update(part.policy_mismatches)
    # A tool key and window may now have an item from each part, each summed at its own last offset: in
    # source offset order (the publisher's) both count, as their sum would.
    result.facts.extend(part.facts)


Item = TelemetryEvent | OperatorCommand


def is_operator(record: InputRecord) -> bool:
    """Whether the record is an operator's command (``loopwarden halt|resume``), not telemetry."""
    return bool(record.headers) and header(record.headers, KIND_HEADER) == OPERATOR_KIND


class BatchFold:
    """The configured batch function of one worker."""

    def __init__(self, detector: Detector, *, operator_keys: Verifier | None = None,
                 operator_max_age_ms: int = 900_000, max_event_bytes: int = 1 << 20,
                 write_version: int = FORMAT_VERSION, facts: bool = True) -> None:
        self.detector = detector
        #: Whether ``fold`` lists the facts of the rules across runs (off: ``LOOPWARDEN_FLEET_RULES=false``,
        #: nothing would fold them).
        self.facts = facts
        self.operator_keys = operator_keys
        self.operator_max_age_ms = operator_max_age_ms
        self.max_event_bytes = max_event_bytes
        self.write_version = write_version
        self.policy_digest = detector.policy.digest

    @staticmethod
    def keys(records: Sequence[InputRecord]) -> set[tuple[int, bytes]]:
        """The (partition, key) pairs whose stored records ``fold`` needs."""
        return {(r.partition, r.key) for r in records if r.key is not None}

    def fold(self, records: Sequence[InputRecord], stored: Mapping[tuple[int, bytes], bytes | None],
             now_ms: int) -> BatchResult:
        """Fold ``records`` into the stored runs (``stored``: every pair of ``keys(records)``, None for a
        run not stored); ``now_ms`` judges operator commands' age. Raises ``StoredRecordError`` for a
        stored record this release cannot read (the worker must stop, not guess)."""
        result = BatchResult()
        by_run: dict[tuple[int, bytes], list[tuple[int, int, Item]]] = {}
        watermarks = result.watermarks
        for index, record in enumerate(records):
            try:
                item = self._decode(record, now_ms)
            except InvalidEvent as exc:
                result.dead_letters.append(DeadLetter(index, exc))
                continue
            except Exception as exc:  # a bug met on one record: that record is dead-lettered
                log.error("decoding record %d raised %r: dead-lettered (a loopwarden bug: please report it with "
                          "the record)", index, exc, exc_info=exc)
                result.dead_letters.append(DeadLetter(index, FoldFailed(exc)))
                continue
            key = item.run_id.encode()
            if record.key != key:
                result.rekeys.append(Rekey(index, key))
                continue
            by_run.setdefault((record.partition, key), []).append((index, record.offset, item))
            if item.ts_ms > watermarks.get(record.partition, 0):
                watermarks[record.partition] = item.ts_ms

        facts: list[tuple[int, int, Fact]] = []
        for (partition, key), items in by_run.items():
            raw = stored[(partition, key)]
            run = _RunFold()
            try:
                self._fold_run(run, raw, items, careful=False)
            except StoredRecordError:
                raise
            except Exception:
                if run.at is None:
                    raise
                # a bug met on one event: the run is folded again, each event on a copy of the state
                # before it, and those that fail are dead-lettered (their offsets consumed)
                run = _RunFold()
                self._fold_run(run, raw, items, careful=True)
            try:
                new_record = None if run.record is None else encode_run(run.record, self.write_version)
            except Exception as exc:  # a bug: the run's new state has no stored form; the run is left as it was
                log.error("the new state of run %r cannot be stored (%r): its %d records of the batch are "
                          "dead-lettered (a loopwarden bug: please report it with the records)", key, exc,
                          len(items), exc_info=exc)
                result.dead_letters.extend(DeadLetter(index, FoldFailed(exc)) for index, _, _ in items)
                continue
            result.dead_letters.extend(DeadLetter(index, FoldFailed(cause)) for index, cause in run.failed.items())
            result.decisions.extend(run.decisions)
            result.applied.update(run.applied)
            result.duplicates += run.duplicates
            result.policy_mismatches.update(run.mismatches)
            facts.extend((partition, offset, fact) for offset, fact in run.facts)
            if new_record is not None:
                result.records.setdefault(partition, []).append((key, new_record))
        if facts:
            result.facts = fact_items(facts)
        return result

    def _fold_run(self, out: _RunFold, stored: bytes | None, items: list[tuple[int, int, Item]],
                  careful: bool) -> None:
        """Fold one run's ``items`` (record index, offset, item) into ``out``, from its ``stored`` record.
        Not ``careful``: an exception leaves, ``out.at`` naming the item being folded. ``careful``: each item
        is folded on a copy of the state before it, and one that raises is passed over (the copy kept, its
        offset consumed) and listed in ``out.failed``."""
        run = decode_run(stored)
        applied = False
        for index, offset, item in items:
            if offset <= run.offset:
                out.duplicates += 1
                continue
            out.at = index
            before = run.state.copy() if careful else None
            try:
                evaluation, item_facts = self._fold_item(run, offset, item)
            except Exception as exc:
                if before is None:
                    raise
                run.state = before
                out.failed[index] = exc
                log.error("folding record %d of run %r raised %r: dead-lettered, the run folded without it (a "
                          "loopwarden bug: please report it with the record)", index, item.run_id, exc, exc_info=exc)
                run.offset = offset
                applied = True
                continue
            out.at = None
            if not isinstance(item, OperatorCommand):
                if not evaluation.duplicate:
                    out.applied[item.outcome] += 1
                if item.policy_digest is not None and item.policy_digest != self.policy_digest:
                    out.mismatches[(item.agent_id or "", item.policy_digest)] += 1
            out.facts.extend(item_facts)
            run.offset = offset
            applied = True
            if evaluation.duplicate:
                out.duplicates += 1
            out.decisions.extend(evaluation.decisions)
        if applied:
            out.record = run

    def _fold_item(self, run: StoredRun, offset: int, item: Item) -> tuple[Any, list[tuple[int, Fact]]]:
        """One item folded into ``run``'s state: its evaluation and the facts it makes."""
        if isinstance(item, OperatorCommand):
            return self.detector.operate(run.state, item), []
        spent = root_spent(run.state)
        evaluation = self.detector.evaluate(run.state, item)
        facts: list[tuple[int, Fact]] = []
        if not evaluation.duplicate and self.facts:
            policy = self.detector.policy
            fact = tree_fact(item, item.tool_class or policy.resolve(item.agent_id, item.tool)
                             .thresholds.tool_class, root_cost(spent, root_spent(run.state)))
            if fact is not None:
                facts.append((offset, fact))
            if item.thread_key is not None:
                facts.append((offset, thread_fact(item)))  # type: ignore[arg-type]
            if item.upstream is not None:
                tool = tool_fact(item)
                if tool is not None:
                    facts.append((offset, tool))
        return evaluation, facts

    def _decode(self, record: InputRecord, now_ms: int) -> Item:
        value = record.value
        if value is None:
            raise InvalidEvent("", "message has no value")
        if is_operator(record):
            return self._operator_command(value, record.headers, now_ms)
        return parse_event(value, self.max_event_bytes)

    def _operator_command(self, value: bytes, headers: Headers, now_ms: int) -> OperatorCommand:
        """A command signed by an operator key and recent; else InvalidEvent (unsigned, unknown key,
        tampered, malformed, or too old: a replay)."""
        if self.operator_keys is None:
            raise InvalidEvent("signature", "operator commands are disabled: LOOPWARDEN_OPERATOR_KEYS is empty")
        try:
            key_id = self.operator_keys.verify(value, headers)
        except SignatureRejected as exc:
            raise InvalidEvent("signature", f"operator command refused ({exc.reason}): {exc}") from exc
        command = decode_operator_command(value, key_id)
        age_ms = now_ms - command.ts_ms
        if age_ms > self.operator_max_age_ms:
            raise InvalidEvent("ts_ms", f"operator command is {age_ms / 1000:.0f} s old, over "
                                        "LOOPWARDEN_OPERATOR_MAX_AGE_S: refused as a replay")
        return command


#: The native engine's outcome order (``native/src/contract.rs``: ``OUTCOMES``).
_NATIVE_OUTCOMES = ("success", "error", "empty", "noop")


class NativeBatchFold(BatchFold):
    """``BatchFold`` with the telemetry folded by the native engine (``loopwarden_native.BatchFolder``).

    The native engine decodes each record, groups it by run, folds each run from its stored record and
    writes the new record (the same record the reference writes: either engine reads the other's) with
    the per-run offset guard. The reference (``BatchFold.fold``) keeps everything else, on the records
    the native engine hands back: runs with an operator command, a record the native fast path does not
    decode (bad: dead-lettered with the reference's reason; unusual: folded), a stored record it cannot
    read (the reference raises ``StoredRecordError``), a policy it cannot store. Decisions are built
    from the native findings by the reference's ``explain``, on the event the reference decodes. Each
    run is folded wholly by one engine, so its decisions are in order; runs' decisions are not
    interleaved as the reference alone would (the native runs' come first).
    """

    def __init__(self, detector: Detector, *, verify_decoded: bool = False, **kwargs: Any) -> None:
        """``verify_decoded`` (tests): the native engine checks each state it keeps decoded from the record it
        wrote (folded on when the stored record is that record) against a fresh decode of the record."""
        super().__init__(detector, **kwargs)
        self.verify_decoded = verify_decoded
        from loopwarden_native import BatchFolder  # raises ImportError when the engine is not installed

        self._native = BatchFolder(detector.policy, self.policy_digest, self.write_version, self.max_event_bytes,
                                   self.facts, verify_decoded=verify_decoded)

    def fold(self, records: Sequence[InputRecord], stored: Mapping[tuple[int, bytes], bytes | None],
             now_ms: int) -> BatchResult:
        try:
            return self._fold(records, stored, now_ms)
        except StoredRecordError:
            raise
        except BaseException as exc:  # a Rust panic is a BaseException (pyo3's PanicException)
            if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
                raise  # KeyboardInterrupt, SystemExit, a cancelled task
            if self.verify_decoded:
                raise  # a test checking the engine: what it raised is the finding, not to be folded over
            # a bug of the native engine met on some record: the reference folds the batch (from the same
            # stored records: the native engine changed nothing) and dead-letters what it cannot fold
            log.error("the native engine raised %r on a batch of %d records: the reference folds it (a loopwarden "
                      "bug: please report it)", exc, len(records), exc_info=exc)
            return super().fold(records, stored, now_ms)

    def _fold(self, records: Sequence[InputRecord], stored: Mapping[tuple[int, bytes], bytes | None],
              now_ms: int) -> BatchResult:
        operators = [i for i, record in enumerate(records) if record.headers and is_operator(record)]
        (new_records, findings, rekeys, deferred, applied, duplicates, watermarks,
         mismatches, facts) = self._native.fold(records if isinstance(records, list) else list(records), operators,
                                                stored)
        result = BatchResult(duplicates=duplicates, watermarks=dict(watermarks))
        for partition, key, record in new_records:
            result.records.setdefault(partition, []).append((key, record))
        policy = self.detector.policy
        for index, finding in findings:
            value = records[index].value
            assert value is not None  # the native engine decoded it
            event = parse_event(value, self.max_event_bytes)
            result.decisions.append(explain(event, policy.resolve(event.agent_id, event.tool).thresholds,
                                            Finding.of_native(finding)))
        result.rekeys.extend(Rekey(index, run_id.encode()) for index, run_id in rekeys)
        for outcome, count in zip(_NATIVE_OUTCOMES, applied, strict=True):
            if count:
                result.applied[outcome] += count
        for _, agent_id, digest in mismatches:
            result.policy_mismatches[(agent_id, digest)] += 1
        result.facts = facts  # the items, encoded as the reference's
        if deferred:
            merge(result, deferred, super().fold([records[i] for i in deferred], stored, now_ms))
        return result

