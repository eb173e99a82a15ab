"""The worker's batch function (stream_app.worker.batch), in-process: no Kafka, no Faust, no RocksDB.

Batches are built the way the consumer delivers them (records with partition, offset, key, value and
headers); stored runs are carried from one batch to the next the way the worker's table carries them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from stream_app.bus.signing import KeyRing, Signer, generate
from stream_app.bus.wire import encode_operator, encode_telemetry
from stream_app.core import Detector, OperatorCommand, RunTable, decode_event
from stream_app.core.stored import FORMAT_VERSION, StateVersionError, StoredRun, decode_run, encode_run
from stream_app.devtools.fleet_sim import simulate_fleet
from stream_app.worker.batch import BatchFold, BatchResult, RawRecord

BATCH = Path(__file__).resolve().parents[2] / "stream_app" / "worker" / "batch.py"
NOW_MS = 1_764_000_500_000
PARTITIONS = 4


class Worker:
    """A worker's view of its partitions: offsets per partition and stored runs by (partition, key)."""

    def __init__(self, fold: BatchFold | None = None) -> None:
        self.fold = fold or BatchFold(Detector())
        self.stored: dict[tuple[int, bytes], bytes] = {}
        self.next_offset = [0] * PARTITIONS

    def record(self, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]] | None = None,
               partition: int | None = None) -> RawRecord:
        partition = (sum(key or b"") % PARTITIONS) if partition is None else partition
        offset = self.next_offset[partition]
        self.next_offset[partition] += 1
        return RawRecord(partition, offset, key, value, headers or [])

    def telemetry(self, event: dict[str, Any]) -> RawRecord:
        return self.record(*encode_telemetry(event))

    def apply(self, records: list[RawRecord], now_ms: int = NOW_MS) -> BatchResult:
        stored = {pair: self.stored.get(pair) for pair in BatchFold.keys(records)}
        result = self.fold.fold(records, stored, now_ms)
        for partition, changes in result.records.items():
            for key, value in changes:
                self.stored[(partition, key)] = value
        return result


def _failing(run_id: str, n: int, **extra: Any) -> dict[str, Any]:
    return {"run_id": run_id, "event_id": f"{run_id}-{n}", "tool": "search", "ts_ms": 1_764_000_000_000 + n,
            "outcome": "error", "args": {"q": "x"}, "result": {"error": "down"}, **extra}


def test_batch_by_batch_the_decisions_are_replays() -> None:
    """A mixed corpus (with redeliveries) folded in batches of 50 makes exactly replay's decisions, in
    replay's order per run."""
    _, stream = simulate_fleet(120, seed=3)
    table = RunTable(Detector())
    expected = [d for raw in stream for d in table.observe(decode_event(raw)).decisions]
    worker = Worker()
    got = []
    for start in range(0, len(stream), 50):
        got.extend(worker.apply([worker.telemetry(e) for e in stream[start:start + 50]]).decisions)
    assert sorted(d.decision_id for d in got) == sorted(d.decision_id for d in expected)
    for run_id in {d.run_id for d in expected}:
        assert [d for d in got if d.run_id == run_id] == [d for d in expected if d.run_id == run_id]


def test_a_redelivered_batch_changes_nothing() -> None:
    """Faust re-delivers everything after the last commit: records at or below a run's stored offset
    are skipped (counted as duplicates), make no decision and write no record."""
    worker = Worker()
    batch = [worker.telemetry(_failing("run-a", n)) for n in range(4)]
    first = worker.apply(batch)
    assert [d.verdict for d in first.decisions] == ["recursion"]
    again = worker.apply(batch)
    assert (again.decisions, again.records, again.duplicates, sum(again.applied.values())) == ([], {}, 4, 0)


def test_a_batch_half_applied_before_a_crash_applies_only_its_new_half() -> None:
    worker = Worker()
    batch = [worker.telemetry(_failing("run-a", n)) for n in range(4)]
    worker.apply(batch[:2])
    result = worker.apply(batch)  # redelivered from the last commit, which was before the first half
    assert result.duplicates == 2
    assert [(d.verdict, d.trigger_event_id) for d in result.decisions] == [("recursion", "run-a-3")]


def test_a_resent_event_id_is_a_duplicate_at_a_new_offset() -> None:
    worker = Worker()
    worker.apply([worker.telemetry(_failing("run-a", 0))])
    result = worker.apply([worker.telemetry(_failing("run-a", 0))])
    assert (result.duplicates, sum(result.applied.values()), result.decisions) == (1, 0, [])
    assert result.records  # the run's offset moved past the resent record


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (None, "payload"),  # a tombstone: no value at all
        (b"{not json", "json"),
        (b"[1, 2]", "payload"),
        (orjson.dumps({**_failing("run-b", 0), "ts_ms": "noon"}), "ts_ms"),
        (orjson.dumps({**_failing("run-b", 0), "outcome": "exploded"}), "outcome"),
        (b'{"pad": "' + b"x" * 2000 + b'"}', "payload"),  # over max_event_bytes
    ],
)
def test_a_bad_record_is_a_dead_letter_with_its_reason_and_the_rest_still_folds(value: bytes | None,
                                                                                   reason: str) -> None:
    worker = Worker(BatchFold(Detector(), max_event_bytes=1000))
    records = [worker.telemetry(_failing("run-a", 0)), worker.record(b"run-b", value),
               *[worker.telemetry(_failing("run-a", n)) for n in range(1, 4)]]
    result = worker.apply(records)
    assert [(d.index, d.reason) for d in result.dead_letters] == [(1, reason)]
    assert [d.verdict for d in result.decisions] == ["recursion"]


def test_a_record_keyed_by_something_else_is_rekeyed_not_folded() -> None:
    worker = Worker()
    result = worker.apply([worker.record(b"agent-7", orjson.dumps(_failing("run-a", 0)))])
    assert [(r.index, r.key) for r in result.rekeys] == [(0, b"run-a")]
    assert (result.records, sum(result.applied.values())) == ({}, 0)


def test_watermarks_are_the_newest_event_time_per_partition() -> None:
    worker = Worker()
    records = [worker.telemetry(_failing("run-a", n)) for n in (5, 3)] + [worker.telemetry(_failing("run-z", 9))]
    result = worker.apply(records)
    partitions = {records[0].partition: 1_764_000_000_005, records[2].partition: 1_764_000_000_009}
    assert result.watermarks == partitions


@pytest.mark.parametrize("version", range(FORMAT_VERSION + 1))
def test_records_are_written_in_the_configured_format_version(version: int) -> None:
    worker = Worker(BatchFold(Detector(), write_version=version))
    result = worker.apply([worker.telemetry(_failing("run-a", 0))])
    [(key, value)] = [change for changes in result.records.values() for change in changes]
    assert key == b"run-a"
    assert orjson.loads(value).get("v", 0) == version
    assert decode_run(value).offset == 0


def test_a_stored_record_of_a_newer_format_stops_the_fold_with_the_operator_action() -> None:
    worker = Worker()
    record = worker.telemetry(_failing("run-a", 0))
    newer = orjson.loads(encode_run(StoredRun(decode_run(None).state, -1)))
    newer["v"] = FORMAT_VERSION + 1
    worker.stored[(record.partition, b"run-a")] = orjson.dumps(newer)
    with pytest.raises(StateVersionError, match=rf"format version {FORMAT_VERSION + 1}.*Operator action"):
        worker.apply([record])


# --- operator commands: signed, recent, in order with the run's calls ---------------------------------

@pytest.fixture(scope="module")
def operator(tmp_path_factory: pytest.TempPathFactory) -> tuple[Signer, KeyRing]:
    folder = tmp_path_factory.mktemp("keys")
    private, public, _ = generate(folder, "operator")
    return Signer.from_file(private), KeyRing.from_paths([public])


def _command(signer: Signer | None, worker: Worker, ts_ms: int = NOW_MS - 1_000,
             action: str = "halt") -> RawRecord:
    command = OperatorCommand("run-a", action, f"op-{action}-{ts_ms}", "alice", "on-call", ts_ms)  # type: ignore[arg-type]
    key, value, headers = encode_operator(command)
    if signer is not None:
        headers = [*headers, *signer.headers(value)]
    return worker.record(key, value, headers)


def test_a_signed_recent_operator_halt_is_applied_in_order(operator: tuple[Signer, KeyRing]) -> None:
    signer, keys = operator
    worker = Worker(BatchFold(Detector(), operator_keys=keys))
    result = worker.apply([worker.telemetry(_failing("run-a", 0)), _command(signer, worker),
                           *[worker.telemetry(_failing("run-a", n)) for n in range(1, 5)]])
    assert [(d.action, d.verdict) for d in result.decisions] == [("halt", "operator_halt")]
    assert result.decisions[0].evidence["key_id"] == keys.key_ids[0]


@pytest.mark.parametrize(
    ("signed", "trusted", "age_ms", "reason"),
    [
        (False, True, 1_000, "signature"),  # unsigned
        (True, False, 1_000, "signature"),  # operator commands disabled (no keys)
        (True, True, 901_000, "ts_ms"),  # older than the maximum age: a replay
    ],
)
def test_an_operator_command_that_is_not_trusted_is_a_dead_letter(
        operator: tuple[Signer, KeyRing], signed: bool, trusted: bool, age_ms: int, reason: str) -> None:
    signer, keys = operator
    worker = Worker(BatchFold(Detector(), operator_keys=keys if trusted else None))
    result = worker.apply([_command(signer if signed else None, worker, ts_ms=NOW_MS - age_ms)])
    assert [d.reason for d in result.dead_letters] == [reason]
    assert result.decisions == []


# --- purity --------------------------------------------------------------------------------------------

def test_the_batch_module_imports_no_kafka_faust_or_rocksdb() -> None:
    """Like the core: importing the batch function pulls in none of the worker's I/O stack."""
    code = ("import sys, stream_app.worker.batch;"
            "bad = [m for m in ('faust', 'mode', 'aiokafka', 'rocksdict', 'prometheus_client') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    imported = {node.module.split(".")[0] for node in ast.walk(ast.parse(BATCH.read_text()))
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    imported |= {alias.name.split(".")[0] for node in ast.walk(ast.parse(BATCH.read_text()))
                 if isinstance(node, ast.Import) for alias in node.names}
    assert not imported & {"faust", "mode", "aiokafka", "rocksdict", "prometheus_client", "time", "os"}
