"""The per-run table value: the core's RunState plus the offset of the last message applied to it.

The offset makes at-least-once delivery harmless: after a crash Faust re-delivers everything since the
last commit, and a message at or below the stored offset was already folded into this state, so it is
skipped. (The core's event-id ring catches runtimes that publish the same event twice.)
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from ..core import RunState


@dataclass(slots=True)
class StoredRun:
    state: RunState
    offset: int = -1


def encode_run(run: StoredRun) -> bytes:
    record = run.state.to_record()
    record["offset"] = run.offset
    return orjson.dumps(record)


def decode_run(raw: bytes | None) -> StoredRun:
    """The stored run, or a fresh one for a run never seen (or evicted)."""
    if raw is None:
        return StoredRun(RunState())
    record = orjson.loads(raw)
    return StoredRun(RunState.from_record(record), record.get("offset", -1))
