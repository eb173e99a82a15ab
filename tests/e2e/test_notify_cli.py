"""``loopwarden notify`` as a process, stopped and restarted, on the real broker."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.notify_support import WORKER_KEYS, Webhook, as_records, halts, publish

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_restarts_never_post_twice_and_lose_nothing(
        kafka_bootstrap: str, topic_factory: Callable[..., str], webhook: Webhook, tmp_path: Path) -> None:
    """`loopwarden notify --format slack` as a process: stopped (SIGTERM) after delivering three alerts,
    then stopped again while the webhook is down and an alert is being retried, then restarted with the
    webhook back. Each alert reaches the webhook exactly once: offsets are committed only after a post
    succeeded."""
    decisions = halts()[:6]
    topic = topic_factory(2, prefix="alerts")
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "LOOPWARDEN_ALERTS_TOPIC": topic,
           "LOOPWARDEN_WORKER_KEYS": WORKER_KEYS,
           "LOOPWARDEN_NOTIFY_URL": webhook.url, "LOOPWARDEN_NOTIFY_GROUP": f"notify-{uuid.uuid4().hex[:8]}",
           "LOOPWARDEN_NOTIFY_START": "earliest", "LOOPWARDEN_NOTIFY_BACKOFF_S": "0.1",
           "LOOPWARDEN_NOTIFY_BACKOFF_MAX_S": "0.2"}

    logs: dict[int, Path] = {}

    def start(n: int) -> subprocess.Popen[bytes]:
        log = tmp_path / f"notify-{n}.log"
        process = subprocess.Popen([sys.executable, "-m", "stream_app", "notify", "--format", "slack"], cwd=REPO,
                                   env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        logs[process.pid] = log
        return process

    def stop(process: subprocess.Popen[bytes]) -> None:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, logs[process.pid].read_text()

    def wait_for(condition: Callable[[], bool], what: str, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 90
        while not condition():
            assert process.poll() is None, f"notify exited: {logs[process.pid].read_text()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {logs[process.pid].read_text()}"
            time.sleep(0.05)

    asyncio.run(publish(kafka_bootstrap, topic, as_records(decisions[:3])))
    first = start(0)
    wait_for(lambda: len(webhook.delivered) == 3, "the first three alerts", first)
    time.sleep(1.0)
    stop(first)

    webhook.fail_all = True
    asyncio.run(publish(kafka_bootstrap, topic, as_records(decisions[3:])))
    second = start(1)
    wait_for(lambda: len(webhook.failed) >= 3, "failing posts", second)
    stop(second)  # while an alert waits for its next attempt
    webhook.fail_all = False

    third = start(2)
    wait_for(lambda: len(webhook.delivered) == 6, "the last three alerts", third)
    time.sleep(1.5)  # no late duplicates
    stop(third)

    texts = [r.json["text"] for r in webhook.delivered]
    expected = {d.decision_id: d for d in decisions}
    ids = [r.json["blocks"][2]["elements"][0]["text"].split("`")[1] for r in webhook.delivered]
    assert sorted(ids) == sorted(expected) and len(set(ids)) == 6
    for text, decision_id in zip(texts, ids, strict=True):
        assert f"run `{expected[decision_id].run_id}`" in text and expected[decision_id].verdict in text
