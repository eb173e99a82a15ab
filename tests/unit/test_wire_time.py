"""``wire.rfc3339``: the CloudEvents time of every published decision, exact to the millisecond."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from stream_app.bus.wire import rfc3339
from stream_app.core.contract import MAX_TS_MS

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _exact(ts_ms: int) -> str:
    """The same time by calendar arithmetic on whole milliseconds (no float seconds anywhere)."""
    return (EPOCH + timedelta(milliseconds=ts_ms)).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@given(st.integers(min_value=0, max_value=MAX_TS_MS))
def test_every_time_a_decision_can_carry_is_said_to_the_millisecond(ts_ms: int) -> None:
    """Over the whole range telemetry may carry (datetime's float seconds said 131,383 of 300,000 random times
    of the range a millisecond early, none before 2242 and a quarter to half after: 6443-02-10T07:59:23.529Z
    for ...530)."""
    assert rfc3339(ts_ms) == _exact(ts_ms)


def test_the_ends_of_the_range_and_beyond_are_said_as_the_nearest_time_there_is() -> None:
    assert rfc3339(0) == "1970-01-01T00:00:00.000Z"
    assert rfc3339(141_157_756_763_530) == "6443-02-10T07:59:23.530Z"
    assert rfc3339(MAX_TS_MS) == rfc3339(MAX_TS_MS + 5_000) == "9999-12-31T23:59:59.999Z"
    assert rfc3339(-1) == rfc3339(-10**15) == "1970-01-01T00:00:00.000Z"
    assert rfc3339(1_764_000_000_123) == "2025-11-24T16:00:00.123Z"
