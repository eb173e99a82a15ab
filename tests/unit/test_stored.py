"""The stored run format (stream_app.core.stored): versions, the fixtures of earlier releases, errors.

``tests/fixtures/state/v0`` is the runs-table changelog exactly as the worker at a25ae47 (the last
release before versioning) wrote it, ``v1`` as the worker at 2e9ea20 (the last release writing format 1)
wrote it; the integration tier recovers a worker from each.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from stream_app.core import RunState
from stream_app.core.stored import (
    FORMAT_VERSION,
    StateVersionError,
    StoredRecordError,
    StoredRun,
    decode_run,
    encode_run,
    last_ts_ms,
)

from .conftest import Run, event

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "state"


def _fixture(version: int) -> list[bytes]:
    lines = (FIXTURES / f"v{version}" / "changelog.jsonl").read_bytes().splitlines()
    return [orjson.loads(line)["value"].encode() for line in lines]


@pytest.mark.parametrize("raw", _fixture(0), ids=lambda raw: orjson.loads(raw)["streak_first_event_id"])
def test_version_0_records_read_and_write_back_byte_for_byte(raw: bytes) -> None:
    """A record of the release before versioning decodes, and writing it as version 0 gives its exact
    bytes: a worker told to write version 0 (during a rolling upgrade) writes what old workers read."""
    stored = decode_run(raw)
    assert encode_run(stored, version=0) == raw
    assert last_ts_ms(raw) == stored.state.last_ts_ms


@pytest.mark.parametrize("raw", _fixture(0))
def test_version_1_is_version_0_with_its_version(raw: bytes) -> None:
    v1 = encode_run(decode_run(raw), version=1)
    assert orjson.loads(v1) == {**orjson.loads(raw), "v": 1}
    assert decode_run(v1) == decode_run(raw)


@pytest.mark.parametrize("raw", _fixture(1), ids=lambda raw: orjson.loads(raw)["streak_first_event_id"])
def test_version_1_records_read_and_write_back_byte_for_byte(raw: bytes) -> None:
    assert orjson.loads(raw)["v"] == 1
    assert encode_run(decode_run(raw), version=1) == raw


@pytest.mark.parametrize("raw", _fixture(1))
def test_version_2_is_version_1_with_the_fingerprint_streak(raw: bytes) -> None:
    """Read from version 1, a run has no fingerprint streak yet (it goes on by exact hashes), nor any of
    version 2's other keys: its version 2 record is its version 1 record with ``v: 2``, no bigger."""
    v2 = encode_run(decode_run(raw), version=2)
    assert orjson.loads(v2) == {**orjson.loads(raw), "v": 2}  # the new keys only where they differ from defaults
    assert decode_run(v2) == decode_run(raw)


def test_a_fingerprint_streak_survives_version_2_and_is_dropped_by_version_1(run: Run) -> None:
    failures = [event(ts_ms=i, outcome="error", result={"error": f"timeout after {100 + i}ms"}) for i in range(2)]
    run.feed_all(failures)
    assert run.state.streak_fuzzy and run.state.streak_fp
    assert decode_run(encode_run(StoredRun(run.state), version=2)).state == run.state
    older = decode_run(encode_run(StoredRun(run.state), version=1)).state
    assert (older.streak_fp, older.streak_fuzzy) == (b"", False)


def test_the_default_write_version_is_the_newest() -> None:
    assert orjson.loads(encode_run(StoredRun(RunState(), 3)))["v"] == FORMAT_VERSION


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, 99, -1, True, "1", None])
def test_a_record_of_an_unknown_version_is_refused_with_the_operator_action(version: object) -> None:
    """Never half-decoded, never a KeyError: the error names the version and what to do."""
    record = {**orjson.loads(encode_run(StoredRun(RunState()))), "v": version}
    with pytest.raises(StateVersionError, match=r"format version .*Operator action: a worker of a newer"):
        decode_run(orjson.dumps(record))
    with pytest.raises(StateVersionError):
        last_ts_ms(orjson.dumps(record))


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, -1])
def test_an_unknown_write_version_is_refused(version: int) -> None:
    with pytest.raises(StateVersionError, match="LOOPWARDEN_STATE_WRITE_VERSION"):
        encode_run(StoredRun(RunState()), version=version)


@pytest.mark.parametrize("raw", [b"{not json", b"[1]", b'{"calls": 1}', b'{"v": 1, "last_ts_ms": "noon"}'])
def test_a_damaged_record_is_a_stored_record_error(raw: bytes) -> None:
    with pytest.raises(StoredRecordError):
        decode_run(raw)
    with pytest.raises(StoredRecordError):
        last_ts_ms(raw)


def test_a_state_saved_mid_streak_continues_exactly(run: Run) -> None:
    """Stored and restored after 2 side-effecting duplicates, the 4th still opens the circuit."""
    run.feed_all([event(ts_ms=i, side_effect=True) for i in range(2)])
    restored = decode_run(encode_run(StoredRun(run.state, 7)))
    assert (restored.state, restored.offset) == (run.state, 7)
    run.state = restored.state
    run.feed_all([event(ts_ms=2, side_effect=True), event(ts_ms=3, side_effect=True)])
    assert run.halts() == [(4, "circuit_open")]


def test_a_copy_of_a_state_is_independent(run: Run) -> None:
    """The guard asks "would this call be stopped?" on a copy; the run's own state must not move."""
    run.feed_all([event(ts_ms=i, side_effect=True) for i in range(3)])
    copy = run.state.copy()
    assert copy == run.state
    before = encode_run(StoredRun(run.state))
    run.detector.evaluate(copy, event(ts_ms=3, side_effect=True))
    copy.streak_ts.append(99)
    assert encode_run(StoredRun(run.state)) == before
    assert copy != run.state


def test_a_transient_streaks_pauses_survive_version_2_and_a_reader_that_drops_them_halts_as_before() -> None:
    """The two keys a transient streak adds to version 2: written only when set, read back; a record
    without them (an earlier release's reader wrote it again) is a streak that halts by recursion."""
    from stream_app.core import Detector, decode_event

    detector = Detector()
    state = RunState()
    for n in range(5):
        detector.evaluate(state, decode_event({"run_id": "r", "event_id": f"e{n}", "tool": "t", "ts_ms": n,
                                               "outcome": "error", "args": {}, "result": "503",
                                               "error_class": "http_503"}))
    assert state.streak_transient and state.streak_pauses == 1
    record = orjson.loads(encode_run(StoredRun(state)))
    assert (record["streak_transient"], record["streak_pauses"]) == (True, 1)
    again = decode_run(orjson.dumps(record)).state
    assert (again.streak_transient, again.streak_pauses) == (True, 1)
    dropped = decode_run(orjson.dumps({k: v for k, v in record.items()
                                       if k not in ("streak_transient", "streak_pauses")})).state
    actions = []
    for n in range(5, 10):
        actions += [d.action for d in detector.evaluate(dropped, decode_event({
            "run_id": "r", "event_id": f"e{n}", "tool": "t", "ts_ms": n, "outcome": "error", "args": {},
            "result": "503", "error_class": "http_503"})).decisions]
    assert "halt" in actions and "pause" not in actions
    plain = orjson.loads(encode_run(StoredRun(RunState())))
    assert "streak_transient" not in plain and "streak_pauses" not in plain
