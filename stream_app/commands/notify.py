"""``loopwarden notify``: each halt on the alerts topic, posted to a webhook, for teams without Prometheus.

The workers publish every halt to ``agent.alerts`` (CloudEvents in Kafka binary mode, value = control
v1 JSON). The notifier reads that topic in a consumer group and posts each decision to one webhook:

- ``json``: the decision as a CloudEvent in structured mode (``application/cloudevents+json``), its
  attributes taken from the message's ``ce_*`` headers, so any CloudEvents or generic JSON receiver
  takes it; ``slack``: a Slack incoming-webhook message (``text`` plus ``blocks``; Mattermost and
  Rocket.Chat accept the same ``text``).
- Delivery is one message at a time, in order per partition. A failed post (connection error, timeout,
  any status outside 2xx) is retried with exponential backoff (``backoff_s`` doubling up to
  ``backoff_max_s``; a ``Retry-After`` from the server wins), by seeking back and polling again, so a
  long outage never trips the group's poll interval. After ``max_attempts`` failed posts (0: never) the
  alert is dropped, logged and counted.
- The offset is committed only after the post succeeded (or the message was skipped), so a restart
  resumes at the first alert not yet delivered: a stopped and restarted notifier never posts an alert
  twice. Only a crash between a post and its commit re-posts that one alert; every post carries the
  decision id (CloudEvent ``id``, ``Idempotency-Key`` header) for receivers that deduplicate.
- A worker that crashed may re-send a decision (same ``decision_id``); ids posted recently are
  remembered and not posted again.
- Only alerts signed by a worker key it trusts (``LOOPWARDEN_WORKER_KEYS``, as runtimes do) are posted:
  an unsigned, forged or tampered one is skipped, logged and counted by reason. Without keys the
  notifier refuses to start, unless ``LOOPWARDEN_NOTIFY_ALLOW_UNSIGNED=true`` (development only).
- A bad message (no value, not JSON, not a control v1 decision) is skipped, logged and counted by
  reason; it never stops the notifier.

Configured by environment variables (``NOTIFY_SETTINGS``; Kafka connection as for the worker, through
``KafkaClientConfig.from_env``). Needs aiokafka (the ``kafka`` extra); prometheus-client only for the
optional metrics endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import os
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from ..bus import logs
from ..bus.kafka import KafkaClientConfig
from ..bus.settings import SettingsError, SettingsTable
from ..bus.signing import KeyRing, SignatureRejected
from ..bus.wire import CE_TYPE_PREFIX, rfc3339
from ..core import LoopwardenError

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import ConsumerRecord, TopicPartition

log = logging.getLogger(__name__)

FORMATS = ("json", "slack")
RECENT_IDS = 10_000  # decision ids remembered to skip a worker's re-sent decisions

class NotifySettingsError(SettingsError):
    """A notifier setting has a value it cannot use. Operator action: fix the variable named."""


#: The notifier's configuration, read like the worker's.
NOTIFY_SETTINGS = SettingsTable((
    ("url", "LOOPWARDEN_NOTIFY_URL", "", "webhook URL (http or https); required"),
    ("format", "LOOPWARDEN_NOTIFY_FORMAT", "json", "json (a CloudEvent, structured mode) or slack"),
    ("alerts_topic", "LOOPWARDEN_ALERTS_TOPIC", "agent.alerts", "topic the workers publish halts to"),
    ("group_id", "LOOPWARDEN_NOTIFY_GROUP", "loopwarden-notify", "consumer group; notifiers sharing it split the partitions"),
    ("start_from", "LOOPWARDEN_NOTIFY_START", "latest", "where a new group starts: latest (alerts from now on) or earliest (the whole topic)"),
    ("timeout_s", "LOOPWARDEN_NOTIFY_TIMEOUT_S", "10", "timeout of one post, seconds"),
    ("backoff_s", "LOOPWARDEN_NOTIFY_BACKOFF_S", "1", "wait after the first failed post, seconds; doubles on each failure"),
    ("backoff_max_s", "LOOPWARDEN_NOTIFY_BACKOFF_MAX_S", "60", "longest wait between attempts, seconds"),
    ("max_attempts", "LOOPWARDEN_NOTIFY_MAX_ATTEMPTS", "0", "posts of one alert before it is dropped; 0 retries until it is delivered"),
    ("metrics_port", "LOOPWARDEN_NOTIFY_METRICS_PORT", "0", "Prometheus metrics port of the notifier; 0 disables"),
    ("worker_keys", "LOOPWARDEN_WORKER_KEYS", "", "the workers' Ed25519 public keys (PEM files or directories, comma-separated): only alerts they signed are posted; required unless LOOPWARDEN_NOTIFY_ALLOW_UNSIGNED=true"),
    ("allow_unsigned", "LOOPWARDEN_NOTIFY_ALLOW_UNSIGNED", "false", "post alerts without checking their signature (development only: anyone who can write the alerts topic could page you)"),
    ("log_level", "LOOPWARDEN_LOG_LEVEL", "info", "log level"),
    ("log_format", "LOOPWARDEN_LOG_FORMAT", "json", "log lines on stderr: `json` (one JSON object per line) or `text`"),
), error=NotifySettingsError)


class BadAlert(LoopwardenError, ValueError):
    """A message on the alerts topic that is not a control v1 decision; ``reason`` is its class."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class WebhookError(LoopwardenError):
    """A post that did not succeed; ``retry_after_s`` is the server's Retry-After, when it sent one."""

    def __init__(self, message: str, status: int | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class NotifySettings:
    kafka: KafkaClientConfig
    url: str
    format: str
    alerts_topic: str
    group_id: str
    start_from: str
    timeout_s: float
    backoff_s: float
    backoff_max_s: float
    max_attempts: int
    metrics_port: int
    worker_keys: str
    allow_unsigned: bool
    log_level: str
    log_format: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> NotifySettings:
        """Build and validate the settings from the environment; ``overrides`` (None values ignored)
        come from command-line options. Raises NotifySettingsError naming the variable at fault."""
        env = os.environ if environ is None else environ
        values = NOTIFY_SETTINGS.read(cls, env, overrides)
        parsed = urllib.parse.urlsplit(values["url"])
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise NotifySettingsError(f"{_var('url')}: required, an http:// or https:// URL (got {_redact(values['url'])!r})")
        if values["format"] not in FORMATS:
            raise NotifySettingsError(f"{_var('format')}={values['format']!r}: expected one of {', '.join(FORMATS)}")
        if values["start_from"] not in ("latest", "earliest"):
            raise NotifySettingsError(f"{_var('start_from')}={values['start_from']!r}: expected latest or earliest")
        for name in ("timeout_s", "backoff_s", "backoff_max_s"):
            if values[name] <= 0:
                raise NotifySettingsError(f"{_var(name)} must be > 0, got {values[name]}")
        if values["max_attempts"] < 0:
            raise NotifySettingsError(f"{_var('max_attempts')} must be >= 0, got {values['max_attempts']}")
        if values["log_format"] not in logs.FORMATS:
            raise NotifySettingsError(f"{_var('log_format')}={values['log_format']!r}: expected json or text")
        if not values["worker_keys"] and not values["allow_unsigned"]:
            raise NotifySettingsError(f"{_var('worker_keys')}: required, the workers' public key(s), so that only "
                                      "alerts they signed are posted; LOOPWARDEN_NOTIFY_ALLOW_UNSIGNED=true posts "
                                      "unverified alerts (development only)")
        return cls(kafka=KafkaClientConfig.from_env(env), **values)

    @property
    def endpoint(self) -> str:
        """The webhook URL without its path and query, which often hold a secret (Slack's do)."""
        return _redact(self.url)


_var = NOTIFY_SETTINGS.var


def _redact(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}/..." if parts.netloc else url


# --------------------------------------------------------------------------------------------------
# Decoding and formatting (no Kafka, no network)

_REQUIRED: tuple[tuple[str, type | tuple[type, ...]], ...] = (
    ("decision_id", str), ("run_id", str), ("action", str), ("verdict", str), ("reason", str), ("ts_ms", int),
)


@dataclass(frozen=True)
class Alert:
    """One decision from the alerts topic, with its CloudEvents attributes (from the ce_* headers)."""

    decision: dict[str, Any]
    attributes: dict[str, str]

    @property
    def decision_id(self) -> str:
        return str(self.decision["decision_id"])


def decode_alert(value: bytes | None, headers: Any = ()) -> Alert:
    """The alert in a message's value and headers; raises BadAlert (reason: no_value, json, payload,
    or the name of the missing or mistyped field)."""
    if value is None:
        raise BadAlert("no_value", "message has no value")
    try:
        decision = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise BadAlert("json", f"not JSON: {exc}") from exc
    if not isinstance(decision, dict):
        raise BadAlert("payload", f"not a JSON object but {type(decision).__name__}")
    for name, kind in _REQUIRED:
        item = decision.get(name)
        if not isinstance(item, kind) or isinstance(item, bool) or item == "":
            raise BadAlert(name, f"{name}: missing or not a {getattr(kind, '__name__', kind)}")
    attributes: dict[str, str] = {}
    for key, raw in (headers.items() if isinstance(headers, dict) else headers or ()):
        if isinstance(key, str) and key.startswith("ce_") and raw is not None:
            attributes[key[3:]] = raw.decode("utf-8", "replace") if isinstance(raw, bytes | bytearray) else str(raw)
    # Without headers (a producer other than the worker) the attributes follow from the decision.
    attributes.setdefault("specversion", "1.0")
    attributes.setdefault("id", decision["decision_id"])
    attributes.setdefault("source", "/loopwarden")
    attributes.setdefault("type", f"{CE_TYPE_PREFIX}{decision['action']}")
    attributes.setdefault("time", rfc3339(decision["ts_ms"]))
    attributes.setdefault("subject", decision["run_id"])
    return Alert(decision, attributes)


def format_json(alert: Alert) -> tuple[bytes, str]:
    """(body, content type): the decision as a structured-mode CloudEvent."""
    event: dict[str, Any] = dict(alert.attributes)
    event["datacontenttype"] = "application/json"
    event["data"] = alert.decision
    return orjson.dumps(event), "application/cloudevents+json; charset=utf-8"


def format_slack(alert: Alert) -> tuple[bytes, str]:
    """(body, content type): a Slack incoming-webhook message, ``text`` for notifications and
    clients without blocks, ``blocks`` for the details."""
    d = alert.decision
    raw_evidence = d.get("evidence")
    evidence: dict[str, Any] = raw_evidence if isinstance(raw_evidence, dict) else {}
    who = f" (agent {_slack(d['agent_id'])})" if isinstance(d.get("agent_id"), str) and d["agent_id"] else ""
    icon = ":octagonal_sign:" if d["action"] == "halt" else ":warning:"
    headline = f"{icon} loopwarden {_slack(d['action'])} run `{_slack(d['run_id'])}`{who}: {_slack(d['verdict'])}"
    fields = [("Verdict", d["verdict"]), ("Run", d["run_id"])]
    if who:
        fields.append(("Agent", d["agent_id"]))
    if evidence.get("tool"):
        fields.append(("Tool", evidence["tool"]))
    if isinstance(evidence.get("count"), int):
        budget = evidence.get("budget", evidence.get("ceiling"))
        fields.append(("Count", f"{evidence['count']}" + (f" (budget {budget})" if budget is not None else "")))
    if d.get("tenant"):
        fields.append(("Tenant", d["tenant"]))
    message = {
        "text": f"{headline}. {_slack(d['reason'])}",
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": f"*{headline}*\n{_slack(d['reason'])}"}},
            {"type": "section", "fields": [{"type": "mrkdwn", "text": f"*{name}*\n{_slack(str(value))}"}
                                           for name, value in fields[:10]]},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": (
                f"decision `{_slack(alert.decision_id)}` · trigger `{_slack(str(d.get('trigger_event_id', '')))}`"
                f" · {alert.attributes.get('time', '')}")}]},
        ],
    }
    return orjson.dumps(message), "application/json; charset=utf-8"


FORMATTERS: dict[str, Callable[[Alert], tuple[bytes, str]]] = {"json": format_json, "slack": format_slack}


def _slack(text: str) -> str:
    """Escape the three characters Slack's mrkdwn gives meaning to."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# --------------------------------------------------------------------------------------------------
# Posting


def post_webhook(url: str, body: bytes, content_type: str, idempotency_key: str, timeout_s: float) -> int:
    """POST ``body``; returns the 2xx status, raises WebhookError for anything else (blocking: call
    it in a thread)."""
    request = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": content_type,
        "User-Agent": "loopwarden-notify",
        "Idempotency-Key": idempotency_key,
    })
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        retry_after = _retry_after_s(exc.headers.get("Retry-After") if exc.headers else None)
        raise WebhookError(f"HTTP {exc.code} {exc.reason}", status=exc.code, retry_after_s=retry_after) from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise WebhookError(f"{type(exc).__name__}: {reason}") from exc


def _retry_after_s(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


# --------------------------------------------------------------------------------------------------
# The consumer loop


@dataclass
class NotifyStats:
    """What the notifier did; exported as Prometheus counters when a metrics port is set."""

    posted: int = 0
    failed_attempts: int = 0
    dropped: int = 0
    duplicates: int = 0
    bad: Counter[str] = field(default_factory=Counter)
    #: Alerts refused because their signature did not verify, by reason (unsigned, unknown_key, bad_signature).
    rejected: Counter[str] = field(default_factory=Counter)

    def samples(self) -> Iterator[tuple[str, str, dict[str, str], float]]:
        yield "loopwarden_notify_posted", "Alerts posted to the webhook.", {}, self.posted
        yield ("loopwarden_notify_failed_attempts", "Posts that failed (and were retried, or led to a drop).",
               {}, self.failed_attempts)
        yield "loopwarden_notify_dropped", "Alerts given up after LOOPWARDEN_NOTIFY_MAX_ATTEMPTS posts.", {}, self.dropped
        yield "loopwarden_notify_duplicates", "Re-sent decisions (same decision id) not posted again.", {}, self.duplicates
        for reason, count in sorted(self.bad.items()):
            yield "loopwarden_notify_bad_messages", "Messages on the alerts topic skipped as not a decision.", {
                "reason": reason}, count
        for reason, count in sorted(self.rejected.items()):
            yield ("loopwarden_notify_rejected", "Alerts not posted: their signature is not a trusted worker's.",
                   {"reason": reason}, count)


class Notifier:
    """Consumes the alerts topic and delivers each alert; ``run()`` until ``stop()``."""

    def __init__(self, settings: NotifySettings, *, post: Callable[..., int] = post_webhook,
                 consumer_factory: Callable[[], AIOKafkaConsumer] | None = None) -> None:
        self.settings = settings
        self.stats = NotifyStats()
        self._post = post
        self._format = FORMATTERS[settings.format]
        self._consumer_factory = consumer_factory or self._default_consumer
        self._stopping = asyncio.Event()
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._attempts: dict[tuple[str, int, int], int] = {}
        self._keys = KeyRing.from_setting(settings.worker_keys) if settings.worker_keys else None

    def _default_consumer(self) -> AIOKafkaConsumer:
        from aiokafka import AIOKafkaConsumer

        return AIOKafkaConsumer(
            self.settings.alerts_topic,
            group_id=self.settings.group_id,
            enable_auto_commit=False,  # committed after each delivery, below
            auto_offset_reset=self.settings.start_from,
            **self.settings.kafka.aiokafka_kwargs(),
        )

    def stop(self) -> None:
        self._stopping.set()

    async def run(self, started: asyncio.Event | None = None) -> NotifyStats:
        consumer = self._consumer_factory()
        await consumer.start()
        log.info("notify: posting alerts from %s (group %s) to %s as %s", self.settings.alerts_topic,
                 self.settings.group_id, self.settings.endpoint, self.settings.format)
        if started is not None:
            started.set()
        try:
            while not self._stopping.is_set():
                batches = await consumer.getmany(timeout_ms=500, max_records=1)
                for records in batches.values():
                    for record in records:
                        await self._handle(consumer, record)
        finally:
            await consumer.stop()
        return self.stats

    async def _handle(self, consumer: AIOKafkaConsumer, record: ConsumerRecord[bytes, bytes]) -> None:
        from aiokafka.structs import TopicPartition

        tp = TopicPartition(record.topic, record.partition)
        where = f"{record.topic}[{record.partition}]@{record.offset}"
        if self._keys is not None:
            try:
                self._keys.verify(record.value or b"", record.headers)
            except SignatureRejected as exc:
                self.stats.rejected[exc.reason] += 1
                log.warning("notify: refused %s: %s (not a trusted worker's alert)", where, exc)
                await self._commit(consumer, tp, record.offset)
                return
        try:
            alert = decode_alert(record.value, record.headers)
        except BadAlert as exc:
            self.stats.bad[exc.reason] += 1
            log.warning("notify: skipped %s: %s", where, exc)
            await self._commit(consumer, tp, record.offset)
            return
        if alert.decision_id in self._recent:
            self.stats.duplicates += 1
            log.info("notify: %s repeats decision %s, already posted", where, alert.decision_id)
            await self._commit(consumer, tp, record.offset)
            return
        key = (record.topic, record.partition, record.offset)
        body, content_type = self._format(alert)
        try:
            await asyncio.to_thread(self._post, self.settings.url, body, content_type, alert.decision_id,
                                    self.settings.timeout_s)
        except WebhookError as exc:
            self.stats.failed_attempts += 1
            attempt = self._attempts.get(key, 0) + 1
            if self.settings.max_attempts and attempt >= self.settings.max_attempts:
                self._attempts.pop(key, None)
                self.stats.dropped += 1
                log.error("notify: dropped decision %s (%s) after %d failed posts to %s: %s", alert.decision_id,
                          where, attempt, self.settings.endpoint, exc)
                await self._commit(consumer, tp, record.offset)
                return
            self._attempts[key] = attempt  # at most one alert per partition waits for a retry
            delay = exc.retry_after_s if exc.retry_after_s is not None else self.settings.backoff_s * 2 ** (attempt - 1)
            delay = min(delay, self.settings.backoff_max_s)
            log.warning("notify: post %d of decision %s to %s failed (%s); again in %.1f s", attempt,
                        alert.decision_id, self.settings.endpoint, exc, delay)
            # Back to this record: the next poll fetches it again, so the group sees a live consumer.
            consumer.seek(tp, record.offset)
            await self._sleep(delay)
            return
        self._attempts.pop(key, None)
        self.stats.posted += 1
        self._recent[alert.decision_id] = None
        while len(self._recent) > RECENT_IDS:
            self._recent.popitem(last=False)
        log.info("notify: posted decision %s (%s %s, run %s) from %s", alert.decision_id, alert.decision["action"],
                 alert.decision["verdict"], alert.decision["run_id"], where)
        await self._commit(consumer, tp, record.offset)

    async def _commit(self, consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int) -> None:
        """Commit past ``offset``. If the partition moved to another notifier meanwhile (a rebalance),
        the commit fails and the new owner delivers from the last committed offset: at least once."""
        from aiokafka.errors import CommitFailedError, IllegalStateError

        try:
            await consumer.commit({tp: offset + 1})
        except (CommitFailedError, IllegalStateError) as exc:
            log.warning("notify: could not commit %s[%d]@%d (%s); its new owner resumes before it",
                        tp.topic, tp.partition, offset, exc)

    async def _sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or less if the notifier is stopped meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)


def serve_metrics(stats: NotifyStats, port: int, host: str = "0.0.0.0") -> Any:
    """Serve ``stats`` as Prometheus counters on ``port``; returns (server, thread)."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily

    class _Collector:
        def collect(self) -> Iterator[CounterMetricFamily]:
            families: dict[str, CounterMetricFamily] = {}
            for name, documentation, labels, value in stats.samples():
                family = families.get(name)
                if family is None:
                    family = families[name] = CounterMetricFamily(name, documentation, labels=sorted(labels))
                family.add_metric([labels[k] for k in sorted(labels)], value)
            for name, documentation in (
                    ("loopwarden_notify_bad_messages", "Messages on the alerts topic skipped as not a decision."),
                    ("loopwarden_notify_rejected", "Alerts not posted: their signature is not a trusted worker's.")):
                if name not in families:
                    families[name] = CounterMetricFamily(name, documentation, labels=["reason"])
            yield from families.values()

    registry = CollectorRegistry()
    registry.register(_Collector())
    return start_http_server(port, addr=host, registry=registry)


def run_notify(settings: NotifySettings) -> int:
    """Run the notifier in this process until SIGINT/SIGTERM; returns the exit status."""
    logs.configure(settings.log_level, settings.log_format)
    asyncio.run(settings.kafka.check_connection())  # KafkaUnreachable says what to check
    if settings.allow_unsigned:
        log.warning("notify: LOOPWARDEN_NOTIFY_ALLOW_UNSIGNED=true: alerts are posted without checking their "
                    "signature; anyone who can write %s can page you", settings.alerts_topic)
    notifier = Notifier(settings)
    if settings.metrics_port:
        serve_metrics(notifier.stats, settings.metrics_port)

    async def main() -> NotifyStats:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, notifier.stop)
        return await notifier.run()

    stats = asyncio.run(main())
    log.info("notify: stopped; posted %d, failed posts %d, dropped %d, duplicates %d, bad messages %d",
             stats.posted, stats.failed_attempts, stats.dropped, stats.duplicates, sum(stats.bad.values()))
    return 0
