"""Telemetry out: a finished tool call becomes one telemetry v1 event, published keyed by run id.

Arguments and results are hashed here, on the runtime, by default: the detector only compares calls,
so it needs their semantic hashes, not their content, and customer data in tool arguments then never
crosses the bus. A tool is opted in to raw ``args``/``result`` (``raw_tools``) when the worker must see
them, e.g. for a ``strict_args`` policy. Either way the value is first put in the exact JSON form it
would travel in, so a client-side hash equals the one the worker would compute from the raw event. A
failing call's result also gets its fingerprint here (``result_fp``: the hash with volatile tokens such
as request ids and durations masked, ``core/volatile.py``), so the fleet matches repeated failures whose
text differs only in those without ever seeing the text.

Secrets are removed before anything else: fields named like a password, a token, a key, a cookie or an
e-mail body (``redact``, default ``DEFAULT_REDACTED_FIELDS``) are dropped at any depth from arguments,
results and ``attrs``, for hashed and raw tools alike. Removing them before hashing keeps a raw tool's
event hashing as the client hashes it, and keeps low-entropy secrets out of reach of a dictionary attack
on the hashes. Redaction goes by field name only: a secret inside a free-text value stays (hashed,
unless the tool is raw).

The producer is idempotent with ``acks=all``: a retried send is never written twice, and an
acknowledged event survives a broker failure. It lingers a few milliseconds to batch a burst of calls.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, Final

import orjson

from ..bus.kafka import KafkaClientConfig, KafkaConfigError
from ..bus.wire import encode_telemetry
from ..core import FieldFilter, NormalisationError, Outcome, Policy, semantic_hash
from ..core.contract import MAX_ERROR_HEAD_BYTES
from ..core.secrets import DEFAULT_REDACTED_FIELDS as DEFAULT_REDACTED_FIELDS
from ..core.secrets import mask_secrets_in_text
from .errors import InvalidArgumentType, UsageError
from .lifecycle import StartStop

if TYPE_CHECKING:
    from aiokafka import AIOKafkaProducer
    from aiokafka.structs import RecordMetadata

logger = logging.getLogger(__name__)

#: Hash sent for a value with no JSON form. Every such value of a tool compares equal, which can only
#: halt sooner (the core treats an unhashable result the same way): fail closed.
UNHASHABLE: Final = "unhashable"


@dataclass(frozen=True, slots=True)
class FinishedCall:
    """One finished tool call, as the runtime saw it. ``result`` is the body to report (for an
    exception: its class and message)."""

    run_id: str
    tool: str
    args: Mapping[str, Any]
    outcome: Outcome
    result: Any
    ts_ms: int
    latency_ms: float
    seq: int | None = None
    agent_id: str | None = None
    tenant: str | None = None
    #: None leaves it to the policy (an explicit False would override a policy's ``side_effect: true``).
    side_effect: bool | None = None
    retry_budget: int | None = None
    plan_step: int | None = None
    error_class: str | None = None
    #: The error's message, raw: sent (as ``error_head``: cut, secrets masked) only where the policy's
    #: ``send_error_head`` opts the tool in.
    error_message: str | None = None
    trace_id: str | None = None
    span_id: str | None = None
    parent_span_id: str | None = None
    attrs: Mapping[str, Any] | None = None
    tool_class: str | None = None
    target: str | None = None
    state_hash: str | None = None
    #: ``model_call`` for an inference (``tool`` is the model; no args or result travel).
    kind: str | None = None
    tokens: int | float | None = None
    cost_usd: int | float | None = None
    #: The run's fields for the rules across runs (``root_run_id``, ``parent_run_id``, ``depth``,
    #: ``thread_key``, ``trigger``, ``caused_by_run_id``) and a spawn's (``child_run_id``,
    #: ``child_agent_id``, ``task_hash``), already checked.
    fleet: Mapping[str, Any] | None = None
    #: The event's id if chosen before the call ended (a spawn, folded into its tree as it starts), else new.
    event_id: str | None = None


class TelemetryBuilder:
    """Builds telemetry v1 events, hashing arguments and results with the policy's per-tool field filter
    and whitespace setting, except for the tools in ``raw_tools``; fields matching ``redact`` are
    removed first, from every tool's arguments, results and attrs."""

    def __init__(
        self,
        policy: Policy | None = None,
        raw_tools: Iterable[str] = (),
        *,
        redact: Iterable[str] = DEFAULT_REDACTED_FIELDS,
    ) -> None:
        if isinstance(redact, str):
            raise InvalidArgumentType("redact: give a list of field-name patterns, not one string")
        self.policy = policy or Policy()
        self.raw_tools = frozenset(raw_tools)
        self.redact = tuple(redact)
        # The normaliser's matcher (folding, globs, a cache per key) with the secret names as its list.
        self._secrets = FieldFilter(self.redact)
        self._warned_strict: set[str] = set()

    def args_hash(self, agent_id: str | None, tool: str, args: Mapping[str, Any]) -> str:
        """The semantic hash of a call's redacted arguments, as the detector computes it."""
        return self._hashed(agent_id, tool, args, "args")[0]

    def build(self, call: FinishedCall, *, args_hash: str | None = None) -> dict[str, Any]:
        """The telemetry v1 object of ``call``; pass ``args_hash`` if it is already known."""
        event: dict[str, Any] = {
            "schema_version": "1",
            "run_id": call.run_id,
            # unique across processes: a restarted run is never deduplicated
            "event_id": call.event_id or uuid.uuid4().hex,
            "tool": call.tool,
            "ts_ms": call.ts_ms,
            "outcome": call.outcome,
        }
        if call.kind == "model_call":
            event["kind"] = "model_call"
        elif call.tool in self.raw_tools:
            for name, value in (("args", call.args), ("result", call.result)):
                hashed, form = self._hashed(call.agent_id, call.tool, value, name)
                if form is _NO_FORM:
                    event[f"{name}_hash"] = hashed
                else:
                    event[name] = form  # may be null: a present ``result: null`` is a result
        else:
            self._warn_if_strict(call.agent_id, call.tool)
            event["args_hash"] = args_hash or self.args_hash(call.agent_id, call.tool, call.args)
            result_hash, form = self._hashed(call.agent_id, call.tool, call.result, "result")
            event["result_hash"] = result_hash
            if call.outcome != "success" and form is not _NO_FORM:
                result_fp = self._fingerprint(call.agent_id, call.tool, form)
                if result_fp is not None:
                    event["result_fp"] = result_fp
        event["latency_ms"] = round(max(call.latency_ms, 0.0), 3)
        event["policy_digest"] = self.policy.digest
        if call.error_message and self.policy.resolve(call.agent_id, call.tool).thresholds.send_error_head:
            event["error_head"] = error_head(call.error_message)
        for name in ("seq", "agent_id", "tenant", "side_effect", "retry_budget", "plan_step", "error_class",
                     "trace_id", "span_id", "parent_span_id", "tool_class", "target", "state_hash", "tokens",
                     "cost_usd"):
            value = getattr(call, name)
            if value is not None:
                event[name] = value
        if call.fleet:
            event.update(call.fleet)
        if call.attrs:
            attrs = self._redacted(call.tool, "attrs", call.attrs)
            if attrs:
                event["attrs"] = attrs
        return event

    def _hashed(self, agent_id: str | None, tool: str, value: Any, part: str) -> tuple[str, Any]:
        """(semantic hash, JSON form) of a redacted value; (UNHASHABLE, _NO_FORM) when it has no JSON form."""
        call_policy = self.policy.resolve(agent_id, tool)
        try:
            form = self._redacted(tool, part, _json_form(value))
            return semantic_hash(form, call_policy.fields, call_policy.thresholds.collapse_whitespace), form
        except NormalisationError as exc:
            logger.debug("value of tool %s has no canonical form: %s", tool, exc, extra={"tool": tool})
            return UNHASHABLE, _NO_FORM

    def _fingerprint(self, agent_id: str | None, tool: str, form: Any) -> str | None:
        """The failing result's fingerprint (its redacted form with volatile tokens masked), as the
        detector computes it from a raw result; None when masking is off for the tool (the result hash
        is then the fingerprint)."""
        call_policy = self.policy.resolve(agent_id, tool)
        if call_policy.mask is None:
            return None
        return call_policy.mask.fingerprint(form, call_policy.fields, call_policy.thresholds.collapse_whitespace)

    def _redacted(self, tool: str, part: str, value: Any) -> Any:
        """``value`` without the secret fields, at any depth; what was removed is logged by name only."""
        removed: list[str] = []
        kept = _without(value, self._secrets, removed)
        if removed:
            logger.debug("redacted %d field(s) from the %s of tool %s: %s", len(removed), part, tool,
                         ", ".join(sorted(set(removed))), extra={"tool": tool})
        return kept

    def _warn_if_strict(self, agent_id: str | None, tool: str) -> None:
        if tool in self._warned_strict or not self.policy.resolve(agent_id, tool).thresholds.strict_args:
            return
        self._warned_strict.add(tool)
        logger.warning(
            "tool %s has strict_args in the policy but its arguments travel only as a hash, so loopwarden "
            "compares its calls by tool name alone; add it to raw_tools",
            tool,
            extra={"tool": tool},
        )


def error_head(message: str) -> str:
    """The start of an error message as ``error_head``: secrets masked, then cut to at most
    ``MAX_ERROR_HEAD_BYTES`` of UTF-8 (on a character boundary)."""
    return mask_secrets_in_text(message).encode()[:MAX_ERROR_HEAD_BYTES].decode("utf-8", "ignore")


def _without(value: Any, secrets: FieldFilter, removed: list[str]) -> Any:
    """A copy of ``value`` without the object keys ``secrets`` matches, at any depth; their names are
    appended to ``removed``. The input is never changed (it is the caller's, e.g. a tool's result)."""
    if isinstance(value, Mapping):
        kept: dict[Any, Any] = {}
        for key, item in value.items():
            if secrets.is_ignored(str(key)):
                removed.append(str(key))
            else:
                kept[key] = _without(item, secrets, removed)
        return kept
    if isinstance(value, list | tuple):
        return [_without(item, secrets, removed) for item in value]
    return value


class _NoForm:
    """Marks a value that has no JSON form (None is a valid JSON form)."""


_NO_FORM: Final = _NoForm()


def _json_form(value: Any) -> Any:
    """``value`` as the JSON it would travel as (orjson's types; NaN becomes null); raise
    NormalisationError if it has none."""
    try:
        return orjson.loads(orjson.dumps(value, default=_json_default, option=orjson.OPT_NON_STR_KEYS))
    except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
        raise NormalisationError(f"no JSON form: {exc}") from exc


def _json_default(value: Any) -> Any:
    """JSON forms of common tool values orjson does not know (it knows dataclasses, datetimes, UUIDs and
    enums): bytes (base64), a ``Decimal`` (its exact text: ``Decimal("10.50")`` is not ``10.5``), a path
    (its text), a set (its members' forms, sorted by their canonical JSON), and pydantic v2 models. Arguments
    with none hash alike (``UNHASHABLE``): a charge of ``Decimal`` amounts was one call whatever the
    amount."""
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(value).decode()
    if isinstance(value, Decimal | PurePath):
        return str(value)
    if isinstance(value, set | frozenset):
        forms = [orjson.loads(orjson.dumps(item, default=_json_default, option=orjson.OPT_NON_STR_KEYS))
                 for item in value]
        return sorted(forms, key=lambda form: orjson.dumps(form, option=orjson.OPT_SORT_KEYS))
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


class TelemetryPublisher(StartStop):
    """Publishes telemetry events to Kafka, keyed by run id, in order.

    Telemetry must never stall the agent it describes, nor be lost to a broker blip: ``publish`` puts
    the event in a bounded local buffer and returns at once; a background task hands events to the
    idempotent producer in order, waiting out an unreachable broker (retrying with backoff) instead of
    dropping. Only a full buffer (``buffer_events``) drops events, counted in ``failed`` like deliveries
    the producer gave up on. ``stop`` waits at most ``close_timeout_s`` for what is buffered.
    """

    def __init__(
        self,
        config: KafkaClientConfig,
        topic: str = "agent.telemetry",
        *,
        linger_ms: int = 5,
        buffer_events: int = 100_000,
        close_timeout_s: float = 10.0,
        client_id: str = "loopwarden-sdk",
    ) -> None:
        self.config = config
        self.topic = topic
        self.linger_ms = linger_ms
        self.close_timeout_s = close_timeout_s
        self.client_id = client_id
        self.published = 0
        self.failed = 0
        self.pending = 0
        self._buffer: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue(buffer_events)
        self._producer: AIOKafkaProducer | None = None
        self._pump: asyncio.Task[None] | None = None
        self._closing: asyncio.Future[None] | None = None

    async def start(self) -> None:
        """Connect, and check that the topic exists (so a wrong name fails here, not on a tool call)."""
        from aiokafka import AIOKafkaProducer

        if self._producer is not None:
            return
        producer = AIOKafkaProducer(
            **self.config.aiokafka_kwargs(),
            client_id=self.client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=self.linger_ms,
        )
        try:
            await producer.start()  # inside the try: a refused login or certificate still closes the client
            if self.topic not in (await producer.client.fetch_all_metadata()).topics():
                raise KafkaConfigError(
                    f"telemetry topic {self.topic!r} does not exist, or this principal may not see it (Kafka "
                    "hides topics a principal cannot describe). Operator action: check the name and the ACLs "
                    "(docs/security.md), or start the worker with LOOPWARDEN_CREATE_TOPICS=true"
                )
            await producer.partitions_for(self.topic)  # the first send then needs no metadata round trip
        except BaseException:
            await producer.stop()
            raise
        self._producer = producer
        self._pump = asyncio.create_task(self._send_buffered(producer))

    async def stop(self) -> None:
        """Deliver what is buffered (waiting at most ``close_timeout_s``), then close."""
        producer, self._producer = self._producer, None
        if producer is None:
            return
        pump, self._pump = self._pump, None
        try:
            await asyncio.wait_for(self._drain(producer), self.close_timeout_s)
        except TimeoutError:
            logger.warning(
                "telemetry to %s: %d events undelivered after %.0f s; closing without them",
                self.topic,
                self.pending + self._buffer.qsize(),
                self.close_timeout_s,
                extra={"topic": self.topic},
            )
        if pump is not None:
            pump.cancel()
        closing = asyncio.ensure_future(producer.stop())
        try:
            await asyncio.wait_for(asyncio.shield(closing), self.close_timeout_s)
        except TimeoutError:
            self._closing = closing  # it completes if the broker comes back; the loop's end cancels it

    @property
    def started(self) -> bool:
        return self._producer is not None

    async def publish(self, event: Mapping[str, Any]) -> None:
        """Buffer one telemetry event (a dict with at least ``run_id``); returns at once."""
        if self._producer is None:
            raise UsageError("TelemetryPublisher is not started: await start() or use 'async with'")
        try:
            self._buffer.put_nowait(encode_telemetry(dict(event)))
        except asyncio.QueueFull:
            self.failed += 1
            logger.warning("telemetry buffer for %s is full; event dropped", self.topic, extra={"topic": self.topic})

    async def flush(self) -> None:
        """Wait until every buffered event is acknowledged or has failed."""
        if self._producer is not None:
            await self._drain(self._producer)

    async def _drain(self, producer: AIOKafkaProducer) -> None:
        await self._buffer.join()
        await producer.flush()

    async def _send_buffered(self, producer: AIOKafkaProducer) -> None:
        """Hand buffered events to the producer in order; an unreachable broker is waited out."""
        from aiokafka.errors import KafkaError

        backoff = 0.1
        while True:
            key, value = await self._buffer.get()
            while True:
                try:
                    delivery = await producer.send(self.topic, value, key=key)
                    break
                except (KafkaError, TimeoutError) as exc:
                    logger.warning("telemetry to %s waits for the broker: %r", self.topic, exc,
                                   extra={"topic": self.topic})
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
            backoff = 0.1
            self.pending += 1
            delivery.add_done_callback(self._delivered)
            self._buffer.task_done()

    def _delivered(self, delivery: asyncio.Future[RecordMetadata]) -> None:
        self.pending -= 1
        error = None if delivery.cancelled() else delivery.exception()
        if delivery.cancelled() or error is not None:
            self.failed += 1
            logger.warning(
                "telemetry delivery to %s failed: %r", self.topic, error, extra={"topic": self.topic}
            )
        else:
            self.published += 1
