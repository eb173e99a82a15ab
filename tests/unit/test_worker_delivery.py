"""In-order, processed-only delivery on top of faust (stream_app.worker.delivery).

The consumer tests drive the real faust consumer's bookkeeping (nothing here talks to Kafka); the
sequencer tests give it a stand-in for the consumer's ``seek``, which is all it calls.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

faust = pytest.importorskip("faust")

from aiokafka.errors import IllegalStateError  # noqa: E402
from faust.types import TP, Message  # noqa: E402

from stream_app.worker import delivery  # noqa: E402
from stream_app.worker.app import configured_app  # noqa: E402
from stream_app.worker.settings import WorkerSettings  # noqa: E402

TOPIC = "agent.telemetry"
OTHER = "some.other.topic"
PARTITION = TP(TOPIC, 0)


def _message(offset: int, topic: str = TOPIC, partition: int = 0) -> Message:
    return Message(topic, partition, offset, 0.0, 0, None, b"run-1", b"{}", None)


def _events(*offsets: int, partition: int = 0) -> list[Any]:
    return [SimpleNamespace(message=_message(o, partition=partition)) for o in offsets]


def _app(tmp_path, name: str) -> faust.App:
    settings = WorkerSettings.from_env({"LOOPWARDEN_APP_ID": name, "LOOPWARDEN_STATE_DIR": str(tmp_path),
                                        "LOOPWARDEN_ALLOW_UNSIGNED": "true"})
    app = configured_app(settings)
    app.topics.acking_topics.update({TOPIC, OTHER})  # as the conductor does once agents subscribe
    return app


# --- the consumer: only processed offsets, only confirmed gaps --------------------------------------

async def test_stock_faust_commits_past_a_skipped_message(tmp_path) -> None:
    """The hazard itself: a stale acknowledgement of offset 108 alone makes faust commit 109, although
    100-107 (fetched again after the rebalance) have not been processed yet."""
    consumer = _app(tmp_path, "stock").consumer
    consumer.ack(_message(108))
    assert consumer._new_offset(PARTITION) == 109


async def test_a_skipped_message_never_moves_the_commit(tmp_path) -> None:
    app = _app(tmp_path, "guarded")
    skipped: list[int] = []
    processed = delivery.install(app, [TOPIC], lambda: skipped.append(1))
    consumer = app.consumer
    stale = _message(108)
    consumer._unacked_messages.add(stale)

    assert consumer.ack(stale) is False
    assert stale.acked and stale not in consumer._unacked_messages  # nothing waits for it any more
    assert consumer._new_offset(PARTITION) is None
    assert skipped == [1]

    batch = _events(*range(100, 110))
    processed.mark_processed(batch)
    assert all(consumer.ack(e.message) for e in batch)
    assert consumer._new_offset(PARTITION) == 110  # the re-fetched, processed 100-109 commit normally
    assert skipped == [1]


async def test_other_topics_are_acknowledged_as_faust_does(tmp_path) -> None:
    app = _app(tmp_path, "other")
    delivery.install(app, [TOPIC], lambda: None)
    assert app.consumer.ack(_message(5, topic=OTHER))
    assert app.consumer._new_offset(TP(OTHER, 0)) == 6


async def test_only_confirmed_gaps_let_the_commit_pass(tmp_path) -> None:
    """faust's own gap detection (it fires on offsets it dropped itself) is ignored; a gap the sequencer
    confirmed is filled into the commit."""
    app = _app(tmp_path, "gaps")
    processed = delivery.install(app, [TOPIC], lambda: None)
    consumer = app.consumer
    done = _events(10, 11, 15)
    processed.mark_processed(done)
    for event in done:
        consumer.ack(event.message)
    await consumer._add_gap(PARTITION, 12, 14)  # what faust's drain loop would do
    assert consumer._new_offset(PARTITION) == 12
    await consumer.confirm_gap(PARTITION, 12, 14)
    assert consumer._new_offset(PARTITION) == 16


# --- the sequencer ------------------------------------------------------------------------------------

class _Consumer:
    def __init__(self) -> None:
        self.seeks: list[tuple[TP, int]] = []
        self.gaps: list[tuple[TP, int, int]] = []
        self.assigned = True

    async def seek(self, tp: TP, offset: int) -> None:
        if not self.assigned:
            raise IllegalStateError(f"No current assignment for partition {tp}")
        self.seeks.append((tp, offset))

    async def confirm_gap(self, tp: TP, offset_from: int, offset_to: int) -> None:
        self.gaps.append((tp, offset_from, offset_to))


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _sequencer() -> tuple[delivery.Sequencer, _Consumer, _Clock, list[int]]:
    consumer, clock, seeks = _Consumer(), _Clock(), []
    sequencer = delivery.Sequencer(SimpleNamespace(consumer=consumer), lambda: seeks.append(1), clock)
    return sequencer, consumer, clock, seeks


def _offsets(events: list[Any]) -> list[tuple[int, int]]:
    return [(e.message.partition, e.message.offset) for e in events]


async def test_messages_in_sequence_and_redeliveries_pass() -> None:
    sequencer, consumer, _, _ = _sequencer()
    assert _offsets(await sequencer.admit(_events(5, 6, 7))) == [(0, 5), (0, 6), (0, 7)]
    assert _offsets(await sequencer.admit(_events(3, 4, 5, 6, 7, 8))) == [(0, o) for o in (3, 4, 5, 6, 7, 8)]
    assert consumer.seeks == []


async def test_a_jump_holds_the_partition_back_and_seeks_to_the_first_missing_offset() -> None:
    """The chaos trial's case: 366 processed, then faust delivers 370 (367-369 dropped)."""
    sequencer, consumer, _, seeks = _sequencer()
    await sequencer.admit(_events(365, 366))
    batch = _events(370, 371) + _events(40, 41, partition=1)
    assert _offsets(await sequencer.admit(batch)) == [(1, 40), (1, 41)]  # other partitions go on
    assert consumer.seeks == [(PARTITION, 367)]
    assert _offsets(await sequencer.admit(_events(372))) == []  # stale ones fetched before the seek
    assert consumer.seeks == [(PARTITION, 367)] * 2
    assert _offsets(await sequencer.admit(_events(367, 368, 369, 370))) == [(0, o) for o in (367, 368, 369, 370)]
    assert len(seeks) == 2 and consumer.gaps == []


async def test_a_jump_that_persists_is_accepted_as_a_real_gap() -> None:
    """Records deleted by retention or transaction markers: after enough seeks over enough time the
    sequencer goes on, and tells the consumer the commit may pass the gap."""
    sequencer, consumer, clock, _ = _sequencer()
    await sequencer.admit(_events(9))
    for _ in range(delivery.GAP_CONFIRM_SEEKS):
        assert await sequencer.admit(_events(12)) == []
    clock.now = delivery.GAP_CONFIRM_S - 0.1
    assert await sequencer.admit(_events(12)) == []  # enough seeks, not yet long enough
    clock.now = delivery.GAP_CONFIRM_S
    assert _offsets(await sequencer.admit(_events(12, 13))) == [(0, 12), (0, 13)]
    assert consumer.gaps == [(PARTITION, 10, 11)]


async def test_a_revoked_partition_starts_again_from_what_is_delivered() -> None:
    sequencer, consumer, _, _ = _sequencer()
    await sequencer.admit(_events(5))
    sequencer.forget([PARTITION])
    assert _offsets(await sequencer.admit(_events(50))) == [(0, 50)]
    assert consumer.seeks == []


async def test_a_partition_revoked_before_its_seek_is_forgotten() -> None:
    sequencer, consumer, _, _ = _sequencer()
    await sequencer.admit(_events(5))
    consumer.assigned = False
    assert await sequencer.admit(_events(9)) == []
    assert _offsets(await sequencer.admit(_events(40))) == [(0, 40)]  # a new assignment starts afresh


# --- the fatal stop: nothing processed after a state this release cannot read -------------------------

async def test_a_fatal_stop_stops_once_and_runs_nothing_after_it() -> None:
    """The step that meets an unreadable stored record is not counted done, the worker is stopped once,
    the error does not escape (the agent's supervisor would restart it and go on), and no later step
    runs, the expiry sweep included."""
    from stream_app.core.stored import StateVersionError

    stops: list[int] = []
    fatal = delivery.FatalStop(stop=lambda: stops.append(1))
    ran: list[str] = []

    async def step(name: str, fail: bool = False) -> None:
        ran.append(name)
        if fail:
            raise StateVersionError("stored run record has format version 2", "upgrade this worker")

    assert await fatal.run(step("first")) is True
    assert await fatal.run(step("meets v2", fail=True)) is False
    assert await fatal.run(step("later batch")) is False
    assert await fatal.run(step("sweep")) is False
    assert ran == ["first", "meets v2"] and stops == [1]
    assert isinstance(fatal.reason, StateVersionError)


async def test_an_error_that_is_not_about_stored_state_still_crashes_the_step() -> None:
    fatal = delivery.FatalStop(stop=lambda: pytest.fail("stopped"))

    async def step() -> None:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        await fatal.run(step())
    assert fatal.reason is None
