"""``loopwarden notify`` offline: decoding, formats, settings, the HTTP client, the metrics endpoint."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import orjson
import pytest

from stream_app.bus.wire import encode_control
from stream_app.commands.notify import (
    NOTIFY_SETTINGS,
    BadAlert,
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
from stream_app.devtools.harness import free_port
from tests.notify_support import BAD_RECORDS, SOURCE, Record, Webhook, halts

REPO = Path(__file__).resolve().parents[2]


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
    ({"LOOPWARDEN_NOTIFY_URL": "http://h/x"}, "LOOPWARDEN_WORKER_KEYS: required"),  # nobody's alerts trusted
    ({"LOOPWARDEN_NOTIFY_URL": "http://h/x", "LOOPWARDEN_NOTIFY_ALLOW_UNSIGNED": "perhaps"}, "expected bool"),
])
def test_settings_refuse_what_cannot_work(env: dict[str, str], message: str) -> None:
    """Settings errors name the variable to fix."""
    with pytest.raises(NotifySettingsError, match=message):
        NotifySettings.from_env(env)


def test_settings_defaults_and_overrides() -> None:
    """Defaults follow NOTIFY_SETTINGS; command-line options win over the environment; the URL's secret
    path never appears in what is logged."""
    settings = NotifySettings.from_env({"LOOPWARDEN_NOTIFY_URL": "https://hooks.slack.com/services/T/B/secret",
                                        "LOOPWARDEN_WORKER_KEYS": "/keys/worker.pub"}, format="slack", url=None)
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
