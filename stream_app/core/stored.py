"""The stored run: the one owner of the format a run's state is kept in (the worker's RocksDB table and
its changelog topic), with a version, so workers of two releases can share a changelog.

A record is one JSON object: the core's ``RunState`` (bytes as hex, arrays as lists), the offset of the
last telemetry message folded into it, and ``v``, the format version. The offset makes at-least-once
delivery harmless: after a crash the worker re-reads everything since its last commit, and a message at
or below the stored offset was already folded in, so it is skipped (the event-id ring in the state
catches runtimes that publish the same event twice).

Versions:

- 0: the records of every release before versioning (no ``v`` key);
- 1: version 0 plus ``v``;
- 2: version 1 plus, each only when it differs from its default (absent: the default), ``streak_fp``
  (hex) and ``streak_fuzzy`` (the fingerprint streak, ``core/volatile.py``),
  ``reads`` (null, or ``[[digest hex, occurrences], ...]`` least recently seen first) and ``targets``
  (null, or ``[[target digest hex, after-states hex, revisits], ...]`` least recently written first),
  ``cost_micro``, ``tokens``, ``model_streak`` (integers) and ``tool_counts`` (null, or ``[[tool digest hex,
  calls], ...]``), ``advised`` (bits: advice given for the current streak, cycle), ``streak_ids`` (the
  streak's member ids after the first, most recent last, each at most 64 characters) and ``streak_args``
  (the canonical JSON text of its first call's arguments): the evidence's story of a streak;
  ``streak_transient`` (true: every failure of the streak was transient), ``streak_pauses`` (the pauses
  it had instead of a halt) and ``handoffs`` (``[count, from agent digest hex, to agent digest hex]``: the
  handoff ping-pong in progress), and ``spawned`` (true: the run made a spawn-class call; as a tree's
  root its spending from then on is the tree's). These four were added to version 2 without a new version: a reader of
  an earlier release ignores them (every reader ignores keys it does not know) and, writing the record
  again, drops them, which only makes a transient streak halt by recursion as before (a pause is a
  courtesy, never a safety rule), a handoff count start again and a root's calls after its spawn leave
  its tree's cost until its next spawn, so no rolling-upgrade step is needed.
  Written as version 0 or 1 they are left out: the run's current streak then goes on by exact hashes only,
  its read and write history starts again, and what it spent and its per-tool and model-call counts are
  lost at every write (and with them the warnings given and a streak's member ids and first arguments,
  so a warning may come once more and a halt's story starts at the upgrade), so budgets, ``max_calls`` and ``max_model_calls_without_tool`` cannot fire while
  workers write version 1 (keep it only for the roll-out; the worker warns at start-up).

A reader decodes every version up to ``FORMAT_VERSION``, and a worker writes the version its operator
sets (``LOOPWARDEN_STATE_WRITE_VERSION``, default ``FORMAT_VERSION``), so a rolling upgrade rolls the
readers out first and raises the write version after. A record newer than the reader is refused with
``StateVersionError``, which says what to do, never decoded half-way.

A change to the record bumps ``FORMAT_VERSION``, teaches ``decode_run`` the previous version (and
``encode_run`` to still write it, for the roll-out), and adds a fixture of the previous version
(``tests/fixtures/state/``, made with ``python -m tests.fixtures.state.make_fixture`` before the change).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, Final

import orjson

from .detector import RunState
from .errors import LoopwardenError

#: The version this release writes by default, and the newest it reads.
FORMAT_VERSION: Final = 2
#: The key of the version in a record; absent in version 0.
VERSION_KEY: Final = "v"


class StoredRecordError(LoopwardenError, RuntimeError):
    """A stored run record that cannot be decoded. Operator action: find what else writes the changelog
    topic (only workers of this app id may), and restore the record or delete the run's key."""


class StateVersionError(StoredRecordError):
    """A stored run record of a format this release cannot read or write."""

    def __init__(self, version: object, action: str) -> None:
        self.version = version
        super().__init__(
            f"stored run record has format version {version!r}; this release reads versions 0 to "
            f"{FORMAT_VERSION}. Operator action: {action}"
        )


@dataclass(slots=True)
class StoredRun:
    """A run's state and the offset of the last message folded into it (-1: none yet)."""

    state: RunState
    offset: int = -1


def encode_run(run: StoredRun, version: int = FORMAT_VERSION) -> bytes:
    """The record of ``run`` in format ``version`` (0 to ``FORMAT_VERSION``)."""
    if type(version) is not int or not 0 <= version <= FORMAT_VERSION:
        raise StateVersionError(version, f"set LOOPWARDEN_STATE_WRITE_VERSION to 0..{FORMAT_VERSION}")
    state = run.state
    record = _record_of(state)
    if version >= 2:  # only what differs from the defaults: most runs never use these (records stay small)
        if state.streak_fp:
            record["streak_fp"] = state.streak_fp.hex()
        if state.streak_fuzzy:
            record["streak_fuzzy"] = True
        if state.reads:
            record["reads"] = [[k.hex(), n] for k, n in state.reads.items()]
        if state.targets:
            record["targets"] = [[k.hex(), states.hex(), revisits] for k, (states, revisits) in state.targets.items()]
        for name in ("cost_micro", "tokens", "model_streak"):
            if getattr(state, name):
                record[name] = getattr(state, name)
        if state.tool_counts:
            record["tool_counts"] = [[k.hex(), n] for k, n in state.tool_counts.items()]
        if state.advised:
            record["advised"] = state.advised
        if state.streak_id_lens:
            record["streak_ids"] = state.streak_id_list()
        if state.streak_args:
            record["streak_args"] = state.streak_args.decode()
        if state.streak_transient:
            record["streak_transient"] = True
        if state.streak_pauses:
            record["streak_pauses"] = state.streak_pauses
        if state.handoffs:
            record["handoffs"] = [state.handoffs, state.handoff_from.hex(), state.handoff_to.hex()]
        if state.spawned:
            record["spawned"] = True
    record["offset"] = run.offset
    if version >= 1:
        record[VERSION_KEY] = version
    return orjson.dumps(record)


def decode_run(raw: bytes | None) -> StoredRun:
    """The stored run, or a fresh one for a run never seen (or evicted)."""
    if raw is None:
        return StoredRun(RunState())
    record = _load(raw)
    try:
        return StoredRun(_state_of(record), record.get("offset", -1))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise StoredRecordError(f"stored run record is damaged ({type(exc).__name__}: {exc})") from exc


def last_ts_ms(raw: bytes) -> int:
    """The event time of the run's last event (what expiry goes by), without building its state."""
    value = _load(raw).get("last_ts_ms")
    if type(value) is not int:
        raise StoredRecordError(f"stored run record is damaged: last_ts_ms is {value!r}")
    return value


def _load(raw: bytes) -> dict[str, Any]:
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise StoredRecordError(f"stored run record is not JSON: {exc}") from exc
    if type(record) is not dict:
        raise StoredRecordError(f"stored run record is a JSON {type(record).__name__}, not an object")
    version = record.get(VERSION_KEY, 0)
    if type(version) is not int or not 0 <= version <= FORMAT_VERSION:
        raise StateVersionError(
            version, "a worker of a newer release wrote this record; upgrade this worker to that release "
                     "(or newer) before it reads the state, and raise LOOPWARDEN_STATE_WRITE_VERSION only "
                     "once every worker reads the new version")
    return record


def _record_of(state: RunState) -> dict[str, Any]:
    """A JSON-ready dict of ``state`` (bytes as hex); ``_state_of`` inverts it."""
    return {
        "calls": state.calls,
        "last_ts_ms": state.last_ts_ms,
        "halted_by": state.halted_by,
        "plan_step": state.plan_step,
        "seen_ids": state.seen_ids.hex(),
        "streak_key": state.streak_key.hex(),
        "streak_call": state.streak_call.hex(),
        "streak_varied": state.streak_varied,
        "streak_ts": state.streak_ts.tolist(),
        "streak_first_event_id": state.streak_first_event_id,
        "streak_alerted": state.streak_alerted,
        "recent_sigs": state.recent_sigs.hex(),
        "recent_ts": state.recent_ts.tolist(),
        "recent_failing": state.recent_failing,
        "side_effects": (
            {k.hex(): v for k, v in state.side_effects.items()} if state.side_effects else None
        ),
    }


def _state_of(record: dict[str, Any]) -> RunState:
    side_effects = record.get("side_effects")
    return RunState(
        calls=record["calls"],
        last_ts_ms=record["last_ts_ms"],
        halted_by=record["halted_by"],
        plan_step=record["plan_step"],
        seen_ids=bytes.fromhex(record["seen_ids"]),
        streak_key=bytes.fromhex(record["streak_key"]),
        streak_call=bytes.fromhex(record["streak_call"]),
        streak_varied=record["streak_varied"],
        streak_ts=array("q", record["streak_ts"]),
        streak_first_event_id=record["streak_first_event_id"],
        streak_alerted=record["streak_alerted"],
        recent_sigs=bytes.fromhex(record["recent_sigs"]),
        recent_ts=array("q", record["recent_ts"]),
        recent_failing=record["recent_failing"],
        streak_fp=bytes.fromhex(record["streak_fp"]) if "streak_fp" in record else b"",
        streak_fuzzy=record.get("streak_fuzzy", False),
        reads={bytes.fromhex(k): n for k, n in reads} if (reads := record.get("reads")) else None,
        targets=({bytes.fromhex(k): [bytes.fromhex(states), revisits] for k, states, revisits in targets}
                 if (targets := record.get("targets")) else None),
        cost_micro=record.get("cost_micro", 0),
        tokens=record.get("tokens", 0),
        model_streak=record.get("model_streak", 0),
        tool_counts={bytes.fromhex(k): n for k, n in counts} if (counts := record.get("tool_counts")) else None,
        advised=record.get("advised", 0),
        streak_ids="".join(ids := [i[:64] for i in record.get("streak_ids") or ()][-9:]),
        streak_id_lens=bytes(map(len, ids)),
        streak_args=record.get("streak_args", "").encode(),
        streak_transient=record.get("streak_transient", False),
        streak_pauses=record.get("streak_pauses", 0),
        handoffs=(handoffs := record.get("handoffs") or [0, "", ""])[0],
        handoff_from=bytes.fromhex(handoffs[1]),
        handoff_to=bytes.fromhex(handoffs[2]),
        spawned=record.get("spawned", False) is True,
        side_effects=(
            {bytes.fromhex(k): list(v) for k, v in side_effects.items()} if side_effects else None
        ),
    )
