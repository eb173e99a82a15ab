"""``loopwarden notify`` against the real broker and a local webhook that fails its first attempts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from stream_app.bus.wire import encode_control
from stream_app.commands.notify import Notifier
from tests.notify_support import (
    BAD_RECORDS,
    SOURCE,
    Webhook,
    as_records,
    halts,
    publish,
    settings_for,
    signed,
    until,
)

pytestmark = pytest.mark.integration


async def test_each_halt_is_posted_once_in_order_through_failures(
        kafka_bootstrap: str, topic_factory: Callable[..., str], webhook: Webhook) -> None:
    """The webhook fails the first two posts (503, then 429 with Retry-After): the notifier retries with
    backoff and posts every halt exactly once, in topic order, as a CloudEvent carrying the decision;
    bad messages in between are skipped and counted, and a re-sent decision is not posted again."""
    decisions = halts()
    assert len(decisions) >= 6
    records = as_records(decisions[:3]) + [r for r, _ in BAD_RECORDS] + as_records(decisions[3:])
    records.append(as_records(decisions[:1])[0])  # a worker re-sends a decision after a crash
    topic = topic_factory(1, prefix="alerts")
    await publish(kafka_bootstrap, topic, records)
    webhook.script = [503, 429]

    notifier = Notifier(settings_for(kafka_bootstrap, topic, webhook.url))
    task = asyncio.create_task(notifier.run())
    try:
        await until(lambda: len(webhook.delivered) >= len(decisions) and
                    notifier.stats.duplicates == 1, what="every halt posted")
        await asyncio.sleep(1.0)  # nothing more arrives
    finally:
        notifier.stop()
        stats = await asyncio.wait_for(task, 30)

    posted = [r.json for r in webhook.delivered]
    assert [p["id"] for p in posted] == [d.decision_id for d in decisions]
    assert [p["data"] for p in posted] == [d.to_control() for d in decisions]
    first = webhook.delivered[0]
    assert first.headers["content-type"] == "application/cloudevents+json; charset=utf-8"
    assert first.headers["idempotency-key"] == decisions[0].decision_id
    assert posted[0]["type"] == "dev.loopwarden.halt" and posted[0]["source"] == SOURCE
    assert posted[0]["subject"] == decisions[0].run_id and posted[0]["specversion"] == "1.0"
    assert [r.status for r in webhook.failed] == [503, 429]
    assert webhook.failed[0].body == webhook.delivered[0].body  # the same alert, retried
    assert (stats.posted, stats.failed_attempts, stats.dropped, stats.duplicates) == (len(decisions), 2, 0, 1)
    assert dict(stats.bad) == {reason: 1 for _, reason in BAD_RECORDS}


async def test_an_alert_is_dropped_after_max_attempts(
        kafka_bootstrap: str, topic_factory: Callable[..., str], webhook: Webhook) -> None:
    """With LOOPWARDEN_NOTIFY_MAX_ATTEMPTS=3, an alert the webhook refuses three times is dropped and
    counted; the next one is still delivered."""
    decisions = halts()[:2]
    topic = topic_factory(1, prefix="alerts")
    await publish(kafka_bootstrap, topic, as_records(decisions))
    webhook.script = [500, 500, 500]
    notifier = Notifier(settings_for(kafka_bootstrap, topic, webhook.url, LOOPWARDEN_NOTIFY_MAX_ATTEMPTS="3"))
    task = asyncio.create_task(notifier.run())
    try:
        await until(lambda: len(webhook.delivered) >= 1, what="the second alert")
    finally:
        notifier.stop()
        stats = await asyncio.wait_for(task, 30)
    assert [r.json["id"] for r in webhook.delivered] == [decisions[1].decision_id]
    assert (stats.posted, stats.failed_attempts, stats.dropped) == (1, 3, 1)


async def test_alerts_not_signed_by_a_trusted_worker_are_not_posted(
        kafka_bootstrap: str, topic_factory: Callable[..., str], webhook: Webhook) -> None:
    """An unsigned, a stranger-signed and a tampered alert (a forged page for on-call) are refused and
    counted by reason; the genuine ones around them are posted."""
    decisions = halts()[:3]
    genuine = as_records(decisions)
    key, value, headers = encode_control(halts()[3], SOURCE)
    tampered_key, tampered_value, tampered_headers = genuine[1]
    forged = [(key, value, headers),                                          # unsigned
              signed((key, value, []), "stranger"),                           # a key nobody trusts
              (tampered_key, tampered_value.replace(b"halt", b"HALT"), tampered_headers)]  # altered after signing
    topic = topic_factory(1, prefix="alerts")
    await publish(kafka_bootstrap, topic, [genuine[0], *forged, genuine[1], genuine[2]])
    notifier = Notifier(settings_for(kafka_bootstrap, topic, webhook.url))
    task = asyncio.create_task(notifier.run())
    try:
        await until(lambda: len(webhook.delivered) >= 3, what="the genuine alerts")
        await asyncio.sleep(1.0)
    finally:
        notifier.stop()
        stats = await asyncio.wait_for(task, 30)
    assert [r.json["id"] for r in webhook.delivered] == [d.decision_id for d in decisions]
    assert dict(stats.rejected) == {"unsigned": 1, "unknown_key": 1, "bad_signature": 1}
