"""When an expiry sweep has anything to do: the passes over a table's partitions and their bounds.

The runs' sweep (``effects.Effects``) and the keyed folds' (``fleet.FleetEffects``) forget keys silent
for a ttl of event time, a few stored keys per partition per sweep, resuming where the last one stopped.
A pass over a partition starts at its first key; once complete, nothing in the partition can expire
before its oldest key's time + the ttl (keys written since lower that bound: ``written``), so the next
pass starts only when the partition's event time has passed it, and an idle sweep reads nothing: on a
busy worker, where nothing is silent for the ttl, the sweep no longer decodes 256 stored records per
partition every 0.5 s.

A mark is what one pass covers (a partition, or a kind of key and a partition). Until this worker has
completed a pass over a mark (a new assignment, a recovery: keys another worker wrote may be older), a
sweep always scans it. Pure bookkeeping: no I/O, no clock (times are event times).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class SweepPasses:
    """The passes of one sweep, by mark (see the module docstring)."""

    def __init__(self) -> None:
        #: Where the pass under way resumes (b"": at the first key).
        self._resume: dict[Hashable, bytes] = {}
        #: The oldest key time kept so far by the pass under way (a mark without one has no pass under way).
        self._pass_oldest: dict[Hashable, int] = {}
        #: The event time before which no key of the mark can expire: the oldest key time of its last
        #: complete pass (and of every key written since) plus the ttl.
        self._expires_at: dict[Hashable, int] = {}

    def due(self, mark: Hashable, watermark_ms: int) -> bool:
        """Whether a key of ``mark`` may be silent for the ttl at event time ``watermark_ms``."""
        expires_at = self._expires_at.get(mark)
        return expires_at is None or watermark_ms > expires_at

    def resume(self, mark: Hashable) -> bytes:
        """Where the next scan of ``mark`` starts: where the pass under way stopped, else its first key."""
        return self._resume.get(mark, b"") if mark in self._pass_oldest else b""

    def scanned(self, mark: Hashable, next_key: bytes, oldest_ms: int | None, watermark_ms: int, ttl_ms: int) -> None:
        """A scan of ``mark`` stopped before ``next_key`` (b"": the pass is complete) having kept keys whose
        oldest time is ``oldest_ms`` (None: it kept none)."""
        oldest = self._pass_oldest.get(mark, watermark_ms)
        if oldest_ms is not None and oldest_ms < oldest:
            oldest = oldest_ms
        self._resume[mark] = next_key
        if next_key:
            self._pass_oldest[mark] = oldest
        else:
            self._pass_oldest.pop(mark, None)
            self._expires_at[mark] = oldest + ttl_ms

    def written(self, mark: Hashable, ts_ms: int, ttl_ms: int) -> None:
        """Keys of ``mark`` were written, the oldest with time ``ts_ms``: no bound may pass it."""
        expires_at = self._expires_at.get(mark)
        if expires_at is not None and ts_ms + ttl_ms < expires_at:
            self._expires_at[mark] = ts_ms + ttl_ms
        pass_oldest = self._pass_oldest.get(mark)
        if pass_oldest is not None and ts_ms < pass_oldest:
            self._pass_oldest[mark] = ts_ms

    def forget(self, marks: Iterable[Hashable]) -> None:
        """Start afresh on ``marks`` (revoked, or recovered: keys another worker wrote may be older)."""
        for mark in marks:
            self._resume.pop(mark, None)
            self._pass_oldest.pop(mark, None)
            self._expires_at.pop(mark, None)

    def marks(self) -> set[Hashable]:
        """Every mark with a pass under way or a bound."""
        return self._pass_oldest.keys() | self._expires_at.keys() | self._resume.keys()
