"""The worker's consumer commits only offsets it processed (stream_app.worker.acks).

faust acknowledges a message it skipped during a rebalance as if processed; right after a rebalance the
partition's acknowledgement list is empty and its committed offset forgotten, so that one stale
acknowledgement decides the next commit. These tests drive the real faust consumer's bookkeeping (no
broker needed: nothing here talks to Kafka).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

faust = pytest.importorskip("faust")

from faust.types import TP, Message  # noqa: E402

from stream_app.worker import acks  # noqa: E402
from stream_app.worker.app import configured_app  # noqa: E402
from stream_app.worker.settings import WorkerSettings  # noqa: E402

TOPIC = "agent.telemetry"
OTHER = "some.other.topic"
PARTITION = TP(TOPIC, 0)


def _message(offset: int, topic: str = TOPIC) -> Message:
    return Message(topic, 0, offset, 0.0, 0, None, b"run-1", b"{}", None)


def _app(tmp_path, name: str) -> faust.App:
    settings = WorkerSettings.from_env({"LOOPWARDEN_APP_ID": name, "LOOPWARDEN_STATE_DIR": str(tmp_path),
                                        "LOOPWARDEN_ALLOW_UNSIGNED": "true"})
    app = configured_app(settings)
    app.topics.acking_topics.update({TOPIC, OTHER})  # as the conductor does once agents subscribe
    return app


async def test_stock_faust_commits_past_a_skipped_message(tmp_path) -> None:
    """The hazard itself: a stale acknowledgement of offset 108 alone makes faust commit 109, although
    100-107 (fetched again after the rebalance) have not been processed yet."""
    consumer = _app(tmp_path, "stock").consumer
    consumer.ack(_message(108))
    assert consumer._new_offset(PARTITION) == 109


async def test_a_skipped_message_never_moves_the_commit(tmp_path) -> None:
    app = _app(tmp_path, "guarded")
    skipped: list[int] = []
    processed = acks.install(app, [TOPIC], lambda: skipped.append(1))
    consumer = app.consumer
    stale = _message(108)
    consumer._unacked_messages.add(stale)

    assert consumer.ack(stale) is False
    assert stale.acked and stale not in consumer._unacked_messages  # nothing waits for it any more
    assert consumer._new_offset(PARTITION) is None
    assert skipped == [1]

    batch = [_message(offset) for offset in range(100, 110)]
    processed.mark_processed([SimpleNamespace(message=m) for m in batch])
    assert all(consumer.ack(m) for m in batch)
    assert consumer._new_offset(PARTITION) == 110  # the re-fetched, processed 100-109 commit normally
    assert skipped == [1]


async def test_other_topics_are_acknowledged_as_faust_does(tmp_path) -> None:
    app = _app(tmp_path, "other")
    acks.install(app, [TOPIC], lambda: None)
    assert app.consumer.ack(_message(5, topic=OTHER))
    assert app.consumer._new_offset(TP(OTHER, 0)) == 6
