"""Halts that explain themselves (issue 16 part 5): the streak's event ids, the failure as the telemetry
named it, and what changed in the arguments (``core/argsdiff.py``), alike on both engines and across a
stored state."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stream_app.core import Policy
from stream_app.core.argsdiff import MAX_ENTRIES, args_diff
from stream_app.core.stored import StoredRun, decode_run, encode_run

from .conftest import Run, event, replay_both


def _line(run_id: str, n: int, **fields: Any) -> bytes:
    raw = {"run_id": run_id, "event_id": f"{run_id}-{n}", "tool": "search", "ts_ms": 1_700_000_000_000 + n,
           "outcome": "error", "result": "HTTP 503", **fields}
    return orjson.dumps(raw) + b"\n"


def _decisions(lines: list[bytes], policy: Policy | None = None) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in replay_both(lines, policy or Policy()).splitlines()]


def test_a_halt_lists_the_first_and_the_last_nine_event_ids_each_cut_to_64_characters() -> None:
    long = "x" * 70
    lines = [_line(long, n, args={"q": "a"}, retry_budget=11) for n in range(12)]
    halt, = (d for d in _decisions(lines) if d["action"] == "halt")
    assert halt["trigger_event_id"] == f"{long}-11"
    assert halt["evidence"]["event_ids"] == [f"{long}-0"[:64]] + [f"{long}-{n}"[:64] for n in range(3, 12)]
    assert halt["evidence"]["first_event_id"] == f"{long}-0"  # uncut, as before


def test_a_short_streak_lists_every_member_and_its_warning_the_members_so_far() -> None:
    lines = [_line("r", n, args={"q": "a"}) for n in range(4)]
    advise, halt = _decisions(lines)
    assert (advise["action"], advise["evidence"]["event_ids"]) == ("advise", ["r-0", "r-1", "r-2"])
    assert (halt["action"], halt["evidence"]["event_ids"]) == ("halt", ["r-0", "r-1", "r-2", "r-3"])


def test_a_streak_broken_by_a_success_starts_its_ids_again() -> None:
    lines = [_line("r", 0, args={"q": "a"}), _line("r", 1, args={"q": "a"}, outcome="success", result="ok")]
    lines += [_line("r", n, args={"q": "a"}) for n in range(2, 6)]
    halt = _decisions(lines)[-1]
    assert halt["evidence"]["event_ids"] == ["r-2", "r-3", "r-4", "r-5"]


def test_a_semantic_loop_shows_what_changed_since_the_streak_began() -> None:
    args = [{"q": "cats", "page": 1}, {"q": "cats ", "page": 2}, {"q": "dogs", "page": 2, "lang": ["en"]},
            {"q": "birds"}]
    advise, halt = _decisions([_line("r", n, args=a) for n, a in enumerate(args)])
    assert advise["evidence"]["args_diff"] == {"changed": {"page": [1, 2], "q": ["cats", "dogs"]},
                                               "added": {"lang[0]": "en"}}
    assert halt["verdict"] == "semantic_loop"
    assert halt["evidence"]["args_diff"] == {"changed": {"q": ["cats", "birds"]}, "removed": {"page": 1}}


def test_a_recursion_has_an_empty_diff_and_hashed_arguments_have_none() -> None:
    decisions = _decisions([_line("raw", n, args={"q": "a"}) for n in range(4)]
                           + [_line("hashed", n, args_hash="ab" * 32) for n in range(4)])
    halts = {d["run_id"]: d["evidence"]["args_diff"] for d in decisions if d["action"] == "halt"}
    assert halts == {"raw": {}, "hashed": "unavailable"}


def test_arguments_over_512_bytes_are_not_kept_so_their_diff_is_unavailable() -> None:
    lines = [_line("r", n, args={"q": str(n) * 600}) for n in range(4)]
    halt = _decisions(lines)[-1]
    assert (halt["verdict"], halt["evidence"]["args_diff"]) == ("semantic_loop", "unavailable")


def test_the_diff_never_quotes_a_secret() -> None:
    args = [{"session_token": "s3cr3t-1", "q": "token=abc123 find"}, {"session_token": "s3cr3t-2", "q": "x"}]
    lines = [_line("r", n, args=args[min(n, 1)]) for n in range(4)]
    halt = _decisions(lines)[-1]
    assert halt["evidence"]["args_diff"] == {"changed": {"q": ["token=*** find", "x"],
                                                         "session_token": ["***", "***"]}}
    assert b"s3cr3t" not in orjson.dumps(halt) and b"abc123" not in orjson.dumps(halt)


def test_a_halt_and_its_warning_quote_the_failure_the_telemetry_named() -> None:
    lines = [_line("r", n, args={"q": "a"}, error_class="http_503", error_head="upstream unavailable")
             for n in range(4)]
    for decision in _decisions(lines):
        assert (decision["evidence"]["error_class"], decision["evidence"]["error_head"]) == (
            "http_503", "upstream unavailable")


def test_a_polling_alert_lists_its_event_ids() -> None:
    lines = [_line("r", n, args={"q": "a"}, outcome="success", result="pending") for n in range(20)]
    alert, = _decisions(lines)
    assert (alert["verdict"], alert["trigger_event_id"]) == ("polling", "r-19")
    assert alert["evidence"]["event_ids"] == ["r-0"] + [f"r-{n}" for n in range(11, 20)]
    assert "args_diff" not in alert["evidence"]


def test_the_story_survives_a_stored_state(run: Run) -> None:
    """Saved mid-streak and restored (as after a worker restart), the halt tells the same story."""
    calls = [event(args={"q": f"v{n}"}, event_id=f"e{n}", ts_ms=n) for n in range(4)]
    whole = Run().feed_all(calls).decisions
    run.feed_all(calls[:2])
    run.state = decode_run(encode_run(StoredRun(run.state))).state
    run.feed_all(calls[2:])
    assert [d for _, d in run.decisions] == [d for _, d in whole]
    assert whole[0][1].evidence["event_ids"] == ["e0", "e1", "e2", "e3"]
    assert whole[0][1].evidence["args_diff"] == {"changed": {"q": ["v0", "v3"]}}


def test_the_diff_lists_at_most_ten_entries_and_counts_the_rest() -> None:
    first = {f"k{i:02}": i for i in range(15)}
    diff = args_diff(orjson.dumps(first).decode(), orjson.dumps({k: -v for k, v in first.items()}).decode())
    assert isinstance(diff, dict)
    assert len(diff["changed"]) == MAX_ENTRIES and diff["more"] == 14 - MAX_ENTRIES  # k00 is 0 == -0


def test_the_diff_tells_types_apart_and_cuts_long_strings() -> None:
    diff = args_diff('{"a":1,"b":true,"c":"' + "y" * 100 + '"}', '{"a":"1","b":1,"c":"z"}')
    assert diff == {"changed": {"a": [1, "1"], "b": [True, 1], "c": ["y" * 61 + "...", "z"]}}


_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                 max_size=3), max_leaves=8)


@given(_json, _json)
def test_a_diff_is_empty_exactly_when_the_arguments_are_identical(a: Any, b: Any) -> None:
    first, last = (orjson.dumps(v, option=orjson.OPT_SORT_KEYS).decode() for v in (a, b))
    assert (args_diff(first, last) == {}) == (first == last)


def test_keys_that_are_not_plain_names_are_quoted_so_paths_never_clash() -> None:
    assert args_diff('{"a.b":1}', '{"a":{"b":1}}') == {"added": {"a.b": 1}, "removed": {'["a.b"]': 1}}


@pytest.mark.parametrize(("first", "last"), [("", '{"a":1}'), ('{"a":1}', "")])
def test_the_diff_is_unavailable_without_both_sides(first: str, last: str) -> None:
    assert args_diff(first, last) == "unavailable"
