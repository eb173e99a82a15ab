"""``loopwarden notify`` against the real broker and a local webhook that fails its first attempts.

The webhook is stdlib ``http.server`` in a thread on loopback; the alerts are real control decisions
(the detector over a simulated fleet), published the way the worker publishes them (CloudEvents binary
mode). Formatting and settings are checked offline below the integration tests.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from stream_app.bus.wire import encode_control
from stream_app.commands.notify import (
    NOTIFY_SETTINGS,
    BadAlert,
    Notifier,
    NotifySettings,
    NotifySettingsError,
    NotifyStats,
    WebhookError,
    _retry_after_s,
    decode_alert,
    format_json,
    format_slack,
    post_webhook,
    serve_metrics,
)
from stream_app.core import Decision, Detector, RunTable, decode_event
from stream_app.devtools.fleet_sim import simulate_fleet

from .workers import REPO, free_port

SOURCE = "/loopwarden/test"


# --------------------------------------------------------------------------------------------------
# A webhook on loopback


@dataclass
class Received:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class Webhook:
    """Answers each POST with the next status of ``script`` (then 200); records every request."""

    script: list[int] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    fail_all: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""

    def answer(self, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str]]:
        with self.lock:
            status = 503 if self.fail_all else (self.script.pop(0) if self.script else 200)
            self.received.append(Received(status, headers, body))
        return status, ({"Retry-After": "0"} if status == 429 else {})

    @property
    def delivered(self) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.status < 300]

    @property
    def failed(self) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.status >= 300]


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status, extra = hook.answer({k.lower(): v for k, v in self.headers.items()}, body)
            self.send_response(status)
            for name, value in extra.items():
                self.send_header(name, value)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    hook.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/T000/secret"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hook
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------------------------------
# Alerts as the worker publishes them


def halts(runs: int = 40, seed: int = 3) -> list[Decision]:
    """Real halt decisions: the detector over a simulated fleet."""
    _, stream = simulate_fleet(runs, seed=seed)
    table = RunTable(Detector())
    return [d for raw in stream for d in table.observe(decode_event(raw)).decisions if d.action == "halt"]


Record = tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]


def as_records(decisions: list[Decision]) -> list[Record]:
    return [encode_control(d, SOURCE) for d in decisions]


BAD_RECORDS: list[tuple[Record, str]] = [
    ((b"run-x", b"{not json", []), "json"),                                   # not JSON
    ((b"run-x", b"[1, 2]", []), "payload"),                                   # JSON, not an object
    ((b"run-x", orjson.dumps({"decision_id": "d" * 32, "action": "halt"}), []), "run_id"),  # fields missing
    ((b"run-x", None, []), "no_value"),                                       # a tombstone
]


async def publish(bootstrap: str, topic: str, records: list[Record]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for key, value, headers in records:
            await producer.send_and_wait(topic, key=key, value=value, headers=headers)
    finally:
        await producer.stop()


def settings_for(bootstrap: str, topic: str, url: str, **extra: str) -> NotifySettings:
    return NotifySettings.from_env({
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "LOOPWARDEN_ALERTS_TOPIC": topic,
        "LOOPWARDEN_NOTIFY_URL": url,
        "LOOPWARDEN_NOTIFY_GROUP": f"notify-{uuid.uuid4().hex[:8]}",
        "LOOPWARDEN_NOTIFY_START": "earliest",
        "LOOPWARDEN_NOTIFY_BACKOFF_S": "0.05",
        "LOOPWARDEN_NOTIFY_BACKOFF_MAX_S": "0.5",
        **extra,
    })


async def until(condition: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


# --------------------------------------------------------------------------------------------------
# Integration: real broker


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
@pytest.mark.e2e
def test_restarts_never_post_twice_and_lose_nothing(
        kafka_bootstrap: str, topic_factory: Callable[..., str], webhook: Webhook, tmp_path: Path) -> None:
    """`loopwarden notify --format slack` as a process: stopped (SIGTERM) after delivering three alerts,
    then stopped again while the webhook is down and an alert is being retried, then restarted with the
    webhook back. Each alert reaches the webhook exactly once: offsets are committed only after a post
    succeeded."""
    decisions = halts()[:6]
    topic = topic_factory(2, prefix="alerts")
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "LOOPWARDEN_ALERTS_TOPIC": topic,
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


# --------------------------------------------------------------------------------------------------
# Offline: decoding, formats, settings, the HTTP client


@pytest.mark.parametrize(("record", "reason"), BAD_RECORDS)
def test_bad_messages_are_classified(record: Record, reason: str) -> None:
    """Each kind of bad message on the alerts topic raises BadAlert with its reason class."""
    with pytest.raises(BadAlert) as caught:
        decode_alert(record[1], record[2])
    assert caught.value.reason == reason


def test_json_format_is_a_structured_cloudevent_from_the_binary_headers() -> None:
    """The ce_* headers of the Kafka message become the CloudEvent's attributes (traceparent too)."""
    decision = halts()[0]
    _, value, headers = encode_control(decision, SOURCE)
    body, content_type = format_json(decode_alert(value, headers))
    event = orjson.loads(body)
    assert content_type.startswith("application/cloudevents+json")
    assert {k: v for k, v in event.items() if k != "data"} == {
        **{k[3:]: v.decode() for k, v in headers if k.startswith("ce_")}, "datacontenttype": "application/json"}
    assert event["data"] == decision.to_control()


def test_json_format_without_headers_derives_the_attributes() -> None:
    """A decision published without CloudEvents headers still gets id, type, source, time and subject."""
    decision = halts()[0].to_control()
    event = orjson.loads(format_json(decode_alert(orjson.dumps(decision)))[0])
    assert event["id"] == decision["decision_id"] and event["type"] == "dev.loopwarden.halt"
    assert event["subject"] == decision["run_id"] and event["time"].endswith("Z")


def test_slack_format_escapes_and_summarises() -> None:
    """The Slack message names the run, agent, verdict, tool and count, and escapes &, < and >."""
    decision = halts()[0].to_control()
    decision["run_id"] = "run <1> & co"
    message = orjson.loads(format_slack(decode_alert(orjson.dumps(decision)))[0])
    assert message["text"].startswith(":octagonal_sign: loopwarden halt run `run &lt;1&gt; &amp; co`")
    assert decision["verdict"] in message["text"] and decision["reason"].replace("&", "&amp;")[:40] in message["text"]
    fields = {f["text"].split("\n")[0].strip("*"): f["text"].split("\n")[1] for f in message["blocks"][1]["fields"]}
    assert fields["Verdict"] == decision["verdict"] and fields["Tool"] == decision["evidence"]["tool"]
    assert fields["Count"].startswith(str(decision["evidence"]["count"]))


@pytest.mark.parametrize(("env", "message"), [
    ({}, "LOOPWARDEN_NOTIFY_URL: required"),                                             # no URL
    ({"LOOPWARDEN_NOTIFY_URL": "hooks.example/x"}, "LOOPWARDEN_NOTIFY_URL: required"),   # no scheme
    ({"LOOPWARDEN_NOTIFY_URL": "http://h/x", "LOOPWARDEN_NOTIFY_FORMAT": "xml"}, "LOOPWARDEN_NOTIFY_FORMAT"),
    ({"LOOPWARDEN_NOTIFY_URL": "http://h/x", "LOOPWARDEN_NOTIFY_BACKOFF_S": "0"}, "LOOPWARDEN_NOTIFY_BACKOFF_S"),
    ({"LOOPWARDEN_NOTIFY_URL": "http://h/x", "LOOPWARDEN_NOTIFY_MAX_ATTEMPTS": "two"}, "expected int"),
    ({"LOOPWARDEN_NOTIFY_URL": "http://h/x", "LOOPWARDEN_NOTIFY_START": "middle"}, "LOOPWARDEN_NOTIFY_START"),
])
def test_settings_refuse_what_cannot_work(env: dict[str, str], message: str) -> None:
    """Settings errors name the variable to fix."""
    with pytest.raises(NotifySettingsError, match=message):
        NotifySettings.from_env(env)


def test_settings_defaults_and_overrides() -> None:
    """Defaults follow NOTIFY_SETTINGS; command-line options win over the environment; the URL's secret
    path never appears in what is logged."""
    settings = NotifySettings.from_env({"LOOPWARDEN_NOTIFY_URL": "https://hooks.slack.com/services/T/B/secret"},
                                       format="slack", url=None)
    assert (settings.format, settings.alerts_topic, settings.group_id, settings.start_from) == (
        "slack", "agent.alerts", "loopwarden-notify", "latest")
    assert settings.max_attempts == 0 and settings.kafka.bootstrap_servers == "127.0.0.1:9092"
    assert "secret" not in settings.endpoint and settings.endpoint.startswith("https://hooks.slack.com")


def test_post_webhook_reports_status_and_retry_after(webhook: Webhook) -> None:
    """A 2xx returns its status; anything else raises WebhookError with the status and Retry-After."""
    webhook.script = [429, 404]
    with pytest.raises(WebhookError) as caught:
        post_webhook(webhook.url, b"{}", "application/json", "k", 5)
    assert (caught.value.status, caught.value.retry_after_s) == (429, 0.0)
    with pytest.raises(WebhookError) as caught:
        post_webhook(webhook.url, b"{}", "application/json", "k", 5)
    assert caught.value.status == 404
    assert post_webhook(webhook.url, b"{}", "application/json", "k", 5) == 200
    with pytest.raises(WebhookError):
        post_webhook("http://127.0.0.1:9/nothing-listens", b"{}", "application/json", "k", 2)


@pytest.mark.parametrize(("header", "seconds"), [
    (None, None),                                  # absent
    ("7", 7.0),                                    # delta-seconds
    ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),        # an HTTP date in the past
    ("soon", None),                                # garbage
])
def test_retry_after(header: str | None, seconds: float | None) -> None:
    """Retry-After as delta-seconds or an HTTP date; unusable values are ignored."""
    assert _retry_after_s(header) == seconds


@pytest.mark.parametrize(("name", "var", "default", "doc"), NOTIFY_SETTINGS)
def test_every_notify_setting_is_documented_with_its_default(name: str, var: str, default: str, doc: str) -> None:
    """The README's notify table is NOTIFY_SETTINGS itself."""
    shown = f"`{default}`" if default else "(empty)"
    assert f"| `{var}` | {shown} | {doc} |" in (REPO / "README.md").read_text()


def test_metrics_endpoint_exports_the_counts() -> None:
    """With a metrics port the notifier's counts are Prometheus counters, bad messages by reason."""
    stats = NotifyStats(posted=3, failed_attempts=2, dropped=1, duplicates=1)
    stats.bad["json"] += 2
    port = free_port()
    server, thread = serve_metrics(stats, port, host="127.0.0.1")
    try:
        stats.posted += 1  # read at scrape time
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        thread.join(5)
    for line in ("loopwarden_notify_posted_total 4.0", "loopwarden_notify_failed_attempts_total 2.0",
                 "loopwarden_notify_dropped_total 1.0", "loopwarden_notify_duplicates_total 1.0",
                 'loopwarden_notify_bad_messages_total{reason="json"} 2.0'):
        assert line in text
