"""The I/O around the batch function: stored runs in, decisions, dead letters and state out; the sweep.

For one batch (``Effects.process``), in this order:

1. the stored records of the batch's runs are read from the runs table's RocksDB partitions;
2. ``BatchFold.fold`` decides everything (``batch``);
3. dead letters go to the DLQ with the reason in their headers, re-keyed records back to the telemetry
   topic keyed by run id;
4. decisions are signed with the worker's Ed25519 key and published (CloudEvents on the control topic;
   halts and operator decisions also on the alerts topic) through a producer of their own
   (``DecisionProducer``), and so are the batch's facts (to the facts topic: ``facts``);
5. the runs' new records are kept for the next flush (``store.RunStore.keep``), which writes them to
   the local RocksDB and the changelog: before every commit and at a revoke or stop once the batch in
   hand is done (``flush``, one of ``delivery.install``'s ``state_writers``), and at once when a batch
   leaves more than ``KEEP_MAX_RECORDS`` kept. The next batch folds on the kept records.

The broker's acknowledgement of every decision and fact is awaited *before* any state is written (and so
before any offset is committed), so a crash can duplicate a decision (same id, deduplicated by runtimes)
or a fact (skipped by its source offset) but never lose one. A batch does not wait for it: the next one
folds while the last one's sends are in flight, and each write of state first waits for every send of the
batches processed before it (``_write_kept``). When every batch waited for its sends, each one's cycle
took a broker round trip more: on the halt bench's 50% load (decisions in most batches, a 2-core machine
shared with the broker) the wait was 28 ms of a 53 ms batch cycle while the worker fell behind, and halts
reached the runtime in 18.3 ms at p50 and 93 ms at p99, 15.1 and 82 ms without the wait (medians of 8
interleaved runs each). A send never acknowledged (the producer gave up on it) stops the worker
(``delivery.PublishFailed``): the batches folded after it are neither written nor committed, and the
restart folds them again.

A batch, a flush and a sweep all read or write stored runs, awaiting in between, so they take turns.
The sweep (a timer, off the batch path) forgets runs silent for ``run_ttl_ms`` of event time, a few
stored runs of one partition per tick, resuming where the last one stopped; the deletions are kept like a
batch's records, written by the next flush.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.client import ConnectionGroup
from aiokafka.conn import CloseReason
from aiokafka.errors import KafkaError, RequestTimedOutError
from aiokafka.partitioner import DefaultPartitioner, murmur2
from aiokafka.producer.sender import SendProduceReqHandler
from faust.exceptions import NotReady
from faust.types import TP, TopicT

from ..bus.clock import wall_clock_ms
from ..bus.kafka import KafkaClientConfig
from ..bus.signing import Signer
from ..bus.wire import Headers, encode_control
from ..core import Decision, InvalidEvent
from ..core.stored import last_ts_ms
from .batch import BatchFold, BatchResult, is_operator, merge
from .delivery import FatalStop, ProducerFailed, PublishFailed, Record
from .metrics import WorkerMetrics
from .store import Change, RunStore

log = logging.getLogger(__name__)

#: How far past the wall clock a partition's event-time watermark may go (the runs' sweep, and the keyed
#: folds' in ``fleet``): event times further ahead fold as they are but do not move the sweep's horizon
#: (one event dated years ahead made every run of its partition silent for longer than ``run_ttl_ms``).
MAX_AHEAD_MS = 60_000

#: Sends of processed batches awaiting their acknowledgement past this many batches: the done ones are let go.
UNACKED_PRUNE_AT = 256

#: A batch of more records than this is folded this many at a time, and each part's decisions are published as
#: soon as it is folded, before the next part folds (``Effects._fold``).
FOLD_PART = 250

#: The decisions producer's record batch per partition, bytes (aiokafka's default is 16 KiB). aiokafka keeps one
#: open batch per partition and a send finding it full waits until the sender has taken it, which it does only
#: once the broker answered the request in flight: ~14 decisions (~1.2 KB each with their headers) filled one,
#: and at the halt bench's 50% load a 1,000-record batch waited for the broker up to four times while it folded
#: (43 waits, up to 8.3 ms each, in a 24-s run: 2026-12-06). The same as faust's producer here
#: (``producer_max_batch_size``), below the broker's 1 MB record batch limit.
DECISIONS_BATCH_BYTES = 256 * 1024
#: A batch that leaves more records kept than this writes them at once (memory: ~1.3 KB a run record), not
#: with the next commit.
KEEP_MAX_RECORDS = 20_000
#: After the sweep reached a partition's last stored run, the partition rests this share of ``run_ttl_ms``
#: (at most ``SWEEP_REST_MAX_S``) before its next pass: a silent run is forgotten that much later at most,
#: and a partition holding fewer runs than a second's scans (256 per turn, 16 turns a second with 8
#: partitions) is not decoded run by run every half second.
SWEEP_REST_SHARE = 0.05
SWEEP_REST_MAX_S = 30.0

#: Dead-lettered values are cut to this many bytes (header ``value_bytes``: the original size), below the
#: producer's 1 MB request limit: the telemetry topic may allow larger messages than the DLQ does.
DLQ_VALUE_LIMIT = 256 * 1024


@dataclass(frozen=True)
class Topics:
    """The worker's topics, made once by the app."""

    telemetry: TopicT
    control: TopicT
    alerts: TopicT
    dlq: TopicT


#: Keys whose hash (``key_hash``) a partitioner remembers (then it starts afresh).
CACHED_KEYS = 65_536


def key_hash(key: bytes) -> int:
    """The hash Kafka's default partitioner places ``key`` by (its partition: this modulo the partition
    count), as every producer of the key computes it."""
    return int(murmur2(key)) & 0x7FFFFFFF


class KeyedPartitioner:
    """Kafka's default partitioner (aiokafka's: murmur2 of the key) with each key's hash remembered: aiokafka's
    murmur2 is pure Python, ~3 us a key, and a run's decisions come in twos and threes (its advice, its halt
    to the control and the alerts topics), a tree's or a tool's in more. Keyless messages go where aiokafka's
    would (a random available partition)."""

    def __init__(self, cached: int = CACHED_KEYS) -> None:
        self._hashes: dict[bytes, int] = {}
        self._cached = cached

    def __call__(self, key: bytes | None, all_partitions: list[int], available: list[int]) -> int:
        if key is None:
            anywhere: int = DefaultPartitioner()(key, all_partitions, available)
            return anywhere
        hashes = self._hashes
        hashed = hashes.get(key)
        if hashed is None:
            if len(hashes) >= self._cached:
                hashes.clear()
            hashed = hashes[key] = key_hash(key)
        return all_partitions[hashed % len(all_partitions)]


class DecisionProducer:
    """The producer decisions go out on: aiokafka's, of its own, beside faust's.

    faust's producer also carries the batch's changelog (hundreds of records of ~0.8 KB per batch), and
    a decision sent through it waited behind those requests and faust's send buffer: the ack wait of a
    batch's decisions was ~7.8 ms at 8,800 events/s (3x a raw round trip) and the whole batch cycle 18 ms.
    On a producer of its own with no linger (decisions are few and each one is awaited) the wait is one
    round trip, 2.3 ms, and the cycle 6.7 ms (one worker, dev broker). Its record batches
    (``DECISIONS_BATCH_BYTES``) hold ~200 decisions a partition, so a batch's decisions are queued without
    waiting for the request in flight to be answered. acks=all, as every output. Not
    idempotent, so the worker's principal needs no IdempotentWrite ACL: a retried send can only repeat a
    decision, which runtimes apply once by its id.

    Started with the app (or on the first send), stopped once faust's consumer has stopped (the batch in
    hand at a stop publishes through it first).

    ``flush_now`` writes what is queued to the broker's socket before it returns. aiokafka's sender takes
    three turns of the event loop to do it (its waiter's callback, its own wake-up, the produce request's
    task), and on a worker at 10% load each turn waits behind the fetches and batches already queued: a
    halt's produce request reached the socket 0.73 ms (p50) after the send, 0.35 ms when the flush started
    the request's task (the halt reached the runtime 2.74 ms after it was sent instead of 3.03: medians of
    9 interleaved runs of the halt bench's 10% load each), and from the halt's send to the end of that
    turn p50 0.47 ms, p90 3.4 (one worker at 4,000 events/s, 2026-12-06: the turn ran the handles queued
    before it, a fetch response's or another producer's request among them). It does what one pass of the
    sender's loop does, and what the request's task does up to its write (``_Written``: the request built
    by aiokafka's handler and written on the broker's connection here, the rest of the handler's work, its
    answer, errors and retries, in a task); the answer wakes the sender (retries and batches queued
    meanwhile are the sender's again). Without a connected connection to the broker (at start, after a
    disconnect) the request's task is aiokafka's own, from the loop's next turn. aiokafka 0.14.0's private
    attributes used (``versions.PINNED``): ``AIOKafkaProducer._sender`` and ``._message_accumulator``;
    ``Sender._in_flight``, ``._muted_partitions``, ``._send_produce_req``, ``._acks`` and ``.client``;
    ``AIOKafkaClient._conns``; ``SendProduceReqHandler`` (its ``do``, ``create_request`` and ``_client``);
    ``MessageAccumulator.drain_by_nodes``, ``._waiter_future``, ``.fail_all`` and ``._exception``.

    A producer whose sender failed refuses every send for good (aiokafka fails what it held and keeps the
    error); its next send raises ``delivery.ProducerFailed`` and the worker stops (exit status 3) instead
    of crashing and restarting its agent on every batch while nothing is published.
    """

    def __init__(self, kafka: KafkaClientConfig) -> None:
        self._kwargs = {**kafka.aiokafka_kwargs(), "acks": "all", "linger_ms": 0, "client_id": "loopwarden-decisions",
                        "partitioner": KeyedPartitioner(), "max_batch_size": DECISIONS_BATCH_BYTES}
        self._producer: AIOKafkaProducer | None = None
        self._starting = asyncio.Lock()
        #: Produce requests ``flush_now`` started (held so they are not garbage-collected mid-flight).
        self._requests: set[asyncio.Future[None]] = set()

    async def start(self) -> AIOKafkaProducer:
        async with self._starting:
            if self._producer is None:
                producer = AIOKafkaProducer(**self._kwargs)
                await producer.start()
                self._producer = producer
            return self._producer

    async def send(self, topic: str, key: bytes, value: bytes | None, headers: Headers) -> asyncio.Future[Any]:
        """Queue one message; the future resolves when the broker has it."""
        return await self._queue(topic, value, key=key, headers=list(headers))

    async def send_to(self, topic: str, partition: int, value: bytes) -> asyncio.Future[Any]:
        """Queue one unkeyed message to ``partition``; the future resolves when the broker has it."""
        return await self._queue(topic, value, partition=partition)

    async def _queue(self, topic: str, value: bytes | None, **how: Any) -> asyncio.Future[Any]:
        producer = self._producer or await self.start()
        try:
            sent: asyncio.Future[Any] = await producer.send(topic, value, **how)
        except Exception as exc:
            _check_alive(producer, exc)
            raise
        return sent

    def flush_now(self) -> bool:
        """Write what is queued now instead of after the sender's turns (see the class docstring); whether a
        request is left to aiokafka's task, to be written in the loop's next turn (no connection yet)."""
        producer = self._producer
        if producer is None:
            return False
        sender, accumulator = producer._sender, producer._message_accumulator
        ready, _ = accumulator.drain_by_nodes(ignore_nodes=sender._in_flight, muted_partitions=sender._muted_partitions)
        deferred = False
        for node_id, batches in ready.items():
            sender._in_flight.add(node_id)
            sender._muted_partitions.update(batches)
            written = _Written.write(sender, node_id, batches)
            if written is None:
                deferred = True
                request = asyncio.ensure_future(sender._send_produce_req(node_id, batches))
            else:
                request = asyncio.ensure_future(written.answer(node_id))
            self._requests.add(request)
            request.add_done_callback(functools.partial(self._answered, accumulator))
        return deferred

    async def flush(self) -> None:
        """``flush_now``; when a request was left to aiokafka's task, one turn of the event loop, in which it
        is written. The caller is a batch, which goes on only once its decisions are on the wire: when the
        next batch was already fetched, the agent folded it before the request's task ran, and a batch's
        decisions waited for the next one too (one worker at 4,000 events/s, 2026-12-06: from a halt's send
        to its produce request written p50 0.7-1.2 ms, p90 1.6-4.7, p99 11-22; with the turn 0.53-0.55,
        0.9-1.1, 2.3-4.0)."""
        if self.flush_now():
            await asyncio.sleep(0)

    def _answered(self, accumulator: Any, request: asyncio.Future[None]) -> None:
        self._requests.discard(request)
        if not request.cancelled() and (error := request.exception()) is not None:
            # what aiokafka's sender does when its own loop fails: every pending send fails with it
            failed = KafkaError("Unexpected error during batch delivery")
            failed.__cause__ = error
            accumulator.fail_all(failed)
        waiter = accumulator._waiter_future  # the sender's turn: batches queued meanwhile, retries
        if not waiter.done():
            waiter.set_result(None)

    async def stop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()


class _Written(SendProduceReqHandler):  # type: ignore[misc]
    """aiokafka's handler of a produce request (``SendProduceReqHandler``), for a request it built and
    ``write`` wrote at once on the broker's connection: ``answer`` is the rest of what aiokafka's request task
    does (``Sender._send_produce_req``: the handler's ``do``, which awaits the answer here instead of sending,
    then the broker and partitions released), so errors, retries and the batches' futures are aiokafka's."""

    def __init__(self, sender: Any, batches: dict[Any, Any], conn: Any) -> None:
        super().__init__(sender, batches)
        self._request = super().create_request()
        self._conn = conn
        self._reply: Any = None
        self._client = _Replied(sender.client, self)

    @classmethod
    def write(cls, sender: Any, node_id: int, batches: dict[Any, Any]) -> _Written | None:
        """The handler of ``batches``' request, written now; None when there is no connected connection
        to the broker (``AIOKafkaClient.send`` would make one) or no answer comes (acks=0)."""
        conn = sender.client._conns.get((node_id, ConnectionGroup.DEFAULT))
        if conn is None or not conn.connected() or sender._acks == 0:
            return None
        handler = cls(sender, batches, conn)
        try:
            handler._reply = conn.send(handler._request)  # on the socket: what AIOKafkaClient.send does
        except KafkaError as exc:  # a broken connection (closed by aiokafka): handled as a failed send
            handler._reply = exc
        return handler

    def create_request(self) -> Any:
        return self._request

    async def answer(self, node_id: int) -> None:
        sender = self._sender
        await self.do(node_id)
        sender._in_flight.remove(node_id)
        for tp in self._batches:
            sender._muted_partitions.remove(tp)

    async def reply(self) -> Any:
        """The broker's answer, as ``AIOKafkaClient.send`` returns it (a timeout closes the connection)."""
        if isinstance(self._reply, BaseException):
            raise self._reply
        try:
            return await self._reply
        except TimeoutError as exc:
            self._conn.close(reason=CloseReason.CONNECTION_TIMEOUT)
            raise RequestTimedOutError() from exc


class _Replied:
    """The client as a ``_Written`` handler sees it: ``send`` is the written request's answer; the rest is
    the client's."""

    def __init__(self, client: Any, written: _Written) -> None:
        self._real = client
        self._written = written

    async def send(self, node_id: int, request: Any) -> Any:
        return await self._written.reply()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _check_alive(producer: AIOKafkaProducer, exc: Exception) -> None:
    """Raise ``ProducerFailed`` if ``exc`` is aiokafka refusing every send from now on (its accumulator
    keeps the error that failed its sender: private ``MessageAccumulator._exception``, aiokafka 0.14.0),
    not a send that may work when tried again (a timeout, a broker away)."""
    failed = producer._message_accumulator._exception
    if failed is not None:
        raise ProducerFailed(f"the decisions producer failed for good ({failed!r}): publishing needs a new "
                             "one; the worker stops so that its restart makes it") from exc


class DeadLetters:
    """Sends rejected messages to the DLQ with the reason in their headers, and counts them."""

    def __init__(self, dlq: TopicT, metrics: WorkerMetrics) -> None:
        self.dlq = dlq
        self.metrics = metrics

    async def send(self, record: Record, error: InvalidEvent, *, operator: bool = False) -> None:
        """``operator``: the record is an operator's command, whose refusal an operator is waiting on
        (logged as a warning; other bad input only at info level, it can be a flood)."""
        self.metrics.dlq.labels(reason=error.field or error.kind).inc()
        if operator:
            log.warning("operator command refused, %s[%d]@%d: %s", record.topic, record.partition,
                        record.offset, error)
        else:
            log.info("dead-lettered %s[%d]@%d: %s", record.topic, record.partition, record.offset, error)
        headers: Headers = [
            ("error", str(error)[:1024].encode()),
            ("error_field", error.field.encode()),
            ("source_topic", record.topic.encode()),
            ("source_partition", str(record.partition).encode()),
            ("source_offset", str(record.offset).encode()),
        ]
        value = record.value or b""
        if len(value) > DLQ_VALUE_LIMIT:  # a multi-megabyte payload must not fail the DLQ send too
            headers.append(("value_bytes", str(len(value)).encode()))
            value = value[:DLQ_VALUE_LIMIT]
        await self.dlq.send(key=record.key, value=value, headers=headers)


class Effects:
    """Runs the batch function between the consumer and the outputs (see the module docstring)."""

    def __init__(self, app: object, topics: Topics, store: RunStore, fold: BatchFold, metrics: WorkerMetrics,
                 dead_letters: DeadLetters, signer: Signer | None, event_source: str,
                 evict_scan_per_sweep: int, decisions: DecisionProducer, facts: Any = None, *,
                 fatal: FatalStop) -> None:
        self.app = app
        self.fatal = fatal
        #: Where tree facts go (``trees.FactsPublisher``); None: the rules across runs are off.
        self.facts = facts
        self.decisions = decisions
        self.topics = topics
        self.store = store
        self.fold = fold
        self.metrics = metrics
        self.dead_letters = dead_letters
        self.signer = signer
        self.event_source = event_source
        self.evict_scan_per_sweep = evict_scan_per_sweep
        self._events_by_outcome = {o: metrics.events.labels(outcome=o) for o in ("success", "error", "empty", "noop")}
        #: (action, verdict) -> its child of ``loopwarden_decisions_total`` (``labels`` is ~3 us a call: one per
        #: decision acknowledged).
        self._decisions_by_kind: dict[tuple[str, str], Any] = {}
        self._run_ttl_ms = fold.detector.policy.defaults.run_ttl_ms
        self._watermark_ms: dict[int, int] = {}
        self._sweep_from: dict[int, bytes] = {}
        #: The partition the last sweep scanned (the next one goes on with the partition after it).
        self._swept_last = -1
        self._sweep_rest_s = min(SWEEP_REST_MAX_S, self._run_ttl_ms / 1000 * SWEEP_REST_SHARE)
        #: Per partition whose last pass reached its last run, when (``_monotonic``) its next pass may start.
        self._resting_until: dict[int, float] = {}
        self._monotonic = time.monotonic
        self._state_lock = asyncio.Lock()
        #: One future per processed batch with sends (decisions, facts), done once all are acknowledged;
        #: kept until done, so every writer of state waits for them (``_write_kept``). Pruned of done ones
        #: by ``_in_flight`` and ``_write_kept``.
        self._unacked: list[asyncio.Future[Any]] = []
        #: Why a batch's send was never acknowledged (the first one): from then on no state is written.
        self._unsent: PublishFailed | None = None
        self._mismatches_warned: set[str] = set()
        #: Runs stored per active partition (standbys excluded), counted on recovery, then kept up to date.
        self._tracked: dict[int, int] = {}
        #: The last write of kept records (``_write_kept``): the next one waits for it.
        self._writing: asyncio.Future[None] | None = None
        #: Runs the sweep expired per partition whose deletions are kept, not yet written: counted in
        #: ``loopwarden_evicted_runs_total`` once written (a revoke drops them, and the partition's next owner
        #: expires and counts the same runs).
        self._evicted_kept: dict[int, int] = {}

    async def process(self, batch: Sequence[Record]) -> None:
        async with self._state_lock:
            await self._process(batch)

    async def _process(self, records: Sequence[Record]) -> None:
        metrics = self.metrics
        metrics.batch_size.observe(len(records))
        store = self.store
        stored = {(partition, key): store.get(partition, key) for partition, key in BatchFold.keys(records)}
        result, sends, published = await self._fold(records, stored)

        for dead in result.dead_letters:
            await self.dead_letters.send(records[dead.index], dead.error, operator=is_operator(records[dead.index]))
        for rekey in result.rekeys:
            metrics.rekeyed.inc()
            record = records[rekey.index]
            await self.topics.telemetry.send(key=rekey.key, value=record.value, headers=list(record.headers))
        watermarks = self._watermark_ms
        ahead_ms = wall_clock_ms() + MAX_AHEAD_MS
        for partition, ts_ms in result.watermarks.items():
            if ts_ms > watermarks.get(partition, 0):
                watermarks[partition] = min(ts_ms, ahead_ms)

        if result.facts and self.facts is not None:
            sends += await self.facts.send(result.facts)
        if len(result.decisions) > published:
            sends += await self._publish(result.decisions[published:])  # its flush takes the facts along
        elif sends:
            await self.decisions.flush()
        if sends:
            self._in_flight(sends, result.decisions)
        store.keep(result.records)
        # counted once the batch is through (a batch failing before here is folded again: counted then)
        for outcome, count in result.applied.items():
            self._events_by_outcome[outcome].inc(count)
        for (agent_id, digest), count in result.policy_mismatches.items():
            metrics.policy_mismatch.labels(agent_id=agent_id).inc(count)
            if digest not in self._mismatches_warned and len(self._mismatches_warned) < 1000:
                self._mismatches_warned.add(digest)
                log.warning("telemetry of agent %r was folded by a runtime with policy %s, not this worker's %s: "
                            "runtime and worker may decide differently; give both the same policy file",
                            agent_id, digest[:16], self.fold.policy_digest[:16])
        if result.duplicates:
            metrics.duplicates.inc(result.duplicates)
        if store.kept > KEEP_MAX_RECORDS:
            await self._write_kept()
        tracked = self._tracked
        for partition, changes in result.records.items():
            if partition in tracked:  # a run a batch's parts both changed has two changes
                tracked[partition] += sum(stored[(partition, key)] is None for key in {key for key, _ in changes})
        metrics.runs_tracked.set(sum(tracked.values()))

    async def _fold(self, records: Sequence[Record], stored: dict[tuple[int, bytes], bytes | None]
                    ) -> tuple[BatchResult, list[asyncio.Future[Any]], int]:
        """The batch folded; the sends of the decisions already published, and how many they are (the first of
        the result's). A batch of more than ``FOLD_PART`` records is folded a part at a time, each part on the
        records the parts before it wrote, and each part's decisions but the last part's are published as
        soon as it is folded: a halt in a batch of 1,000 records, which a worker fetches after any pause (a
        commit's writes, a collection, the host's other processes), went out ~25 ms after its batch began
        folding, whichever record it was. Without a turn of the loop in between (the decisions producer writes
        them at once), so the batch is still one step."""
        now_ms = wall_clock_ms()
        if len(records) <= FOLD_PART:
            return self.fold.fold(records, stored, now_ms), [], 0
        result, sends, published = BatchResult(), [], 0
        folded_on = dict(stored)  # ``stored`` stays the batch's: what the batch found (runs tracked)
        for start in range(0, len(records), FOLD_PART):
            part_records = records[start:start + FOLD_PART]
            part = self.fold.fold(part_records, folded_on, now_ms)
            for partition, changes in part.records.items():
                for key, record in changes:
                    folded_on[(partition, key)] = record
            merge(result, range(start, start + len(part_records)), part)
            if part.decisions and start + FOLD_PART < len(records):
                sends += await self._publish(part.decisions)
                published = len(result.decisions)
        return result, sends, published

    async def flush(self) -> None:
        """Write the runs' records kept by the batches processed so far: taken out of the kept records in one
        short turn of the state lock (``RunStore.take``: batches read them meanwhile), then, with batches
        going on, written once the sends of the batches processed before are acknowledged (``_write_kept``).

        The lock is not held while the acknowledgements come. A flush a partition at a time, each partition
        waiting under the lock for the sends of the batch that ran since the last one, held the batches back a
        broker round trip per partition: at the halt bench's 50% load (23,000 events/s, a commit a second,
        ~2,000 records a flush) batches waited for the lock 320-450 ms in 19 s and a commit took 240 ms at p50
        (670 at most); taken at once, 40 ms and 120-170 (250-370), and a flush is out of the way sooner
        (one worker traced under ``bench.halt.halt_latency``, 2 runs of 8 s each way, 2026-12-07). Halts
        produced during a flush reached the runtime in 37-88 ms at p50 against 16-48 outside, before and after,
        that slow morning: what remains of a flush's cost is the broker's and the event loop's, not the lock's."""
        async with self._state_lock:
            write = self._write_kept()
        await write

    def _write_kept(self) -> asyncio.Future[None]:
        """Take the kept records and write them, a partition at a time, once the sends of the batches processed
        so far are acknowledged and every earlier write is done (a newer record of a key never goes to RocksDB
        or the changelog before an older one); the task that does it. Called with the state lock held."""
        taken = self.store.take()
        evicted = {partition: self._evicted_kept.pop(partition) for partition in list(self._evicted_kept)
                   if partition in taken}
        self._unacked = unacked = [sent for sent in self._unacked if not sent.done()]
        previous = self._writing
        writing = asyncio.ensure_future(self._write_taken(taken, evicted, list(unacked), previous))
        self._writing = writing
        return writing

    async def _write_taken(self, taken: dict[int, dict[bytes, bytes | None]], evicted: dict[int, int],
                           unacked: list[asyncio.Future[Any]], previous: asyncio.Future[None] | None) -> None:
        store = self.store
        written: set[int] = set()
        try:
            if previous is not None:
                await asyncio.wait([previous])
                if not previous.cancelled() and previous.exception() is not None:
                    raise PublishFailed(f"an earlier write of the runs' state failed ({previous.exception()!r}): "
                                        "no later one is written")
            if unacked:
                await asyncio.wait(unacked)
            if self._unsent is not None:
                raise PublishFailed(*self._unsent.args)
            for partition in sorted(taken):
                if partition not in taken:  # revoked meanwhile (``forget``): its next owner folds it again
                    continue
                sending = store.write_taken(taken, partition)
                written.add(partition)
                if count := evicted.get(partition):
                    self.metrics.evictions.inc(count)
                await sending  # the next partition's RocksDB write after this one's records reach the producer
        finally:
            store.untake(taken)  # what was not written (a failure, a cancel) is kept again, its expired runs
            kept = store.kept_partitions()  # counted when the next write writes them (not if revoked meanwhile)
            for partition, count in evicted.items():
                if partition not in written and partition in kept:
                    self._evicted_kept[partition] = self._evicted_kept.get(partition, 0) + count

    def _in_flight(self, sends: list[asyncio.Future[Any]], decisions: list[Decision]) -> None:
        """A processed batch's ``sends`` (its ``decisions``' and facts') are on their way: remembered until
        acknowledged (counted then), and a failure stops the worker."""
        unacked = self._unacked
        if len(unacked) >= UNACKED_PRUNE_AT:
            unacked[:] = [sent for sent in unacked if not sent.done()]
        acknowledged = asyncio.gather(*sends)
        acknowledged.add_done_callback(functools.partial(self._acknowledge, decisions))
        unacked.append(acknowledged)

    def _acknowledge(self, decisions: list[Decision], acknowledged: asyncio.Future[Any]) -> None:
        if acknowledged.cancelled() or acknowledged.exception() is not None:
            if self._unsent is None:
                cause = "cancelled" if acknowledged.cancelled() else repr(acknowledged.exception())
                self._unsent = PublishFailed(
                    f"a processed batch's decisions or facts were not acknowledged ({cause}): the state of the "
                    "batches folded since is not written and their offsets are not committed; the worker stops "
                    "and its restart folds them again")
            self.fatal.fail(self._unsent)
            return
        now = time.time()
        counters, latency = self._decisions_by_kind, self.metrics.decision_latency
        for decision in decisions:
            counter = counters.get((decision.action, decision.verdict))
            if counter is None:
                counter = counters[decision.action, decision.verdict] = self.metrics.decisions.labels(
                    action=decision.action, verdict=decision.verdict)
            counter.inc()
            latency.observe(max(0.0, now - decision.ts_ms / 1000))

    async def sweep(self) -> None:
        """Expire silent runs in the next assigned partition in turn (on a timer, off the per-batch path):
        one partition's scan (up to ``evict_scan_per_sweep`` stored runs decoded, ~2 ms) per turn of the state
        lock. The timer ticks ``partitions`` times per sweep interval, so a worker owning every partition sweeps
        each one every interval. Sweeping them all at once, a partition per turn of the lock, kept the event
        loop 8-20 ms every 0.5 s: a batch waiting for the lock took its turn between partitions, but the fetch
        that brings the next batch needs turns of the event loop of its own, so the batches waited out the
        whole sweep. At the halt bench's 50% load then (16,825 events/s), a sweep of one partition per tick
        took halts over 20 ms from 19 to 3 of 480, p99 31.1 to 19.0 ms (6 interleaved 8-s runs each,
        pooled). A partition whose pass reached its last run rests (``SWEEP_REST_SHARE`` of ``run_ttl_ms``, at most
        ``SWEEP_REST_MAX_S``) before the next: at 1,000 and 20,000 events/s the timers' turns, mostly the sweep's
        decoding the same runs again every half second, took 19 and 28 ms of the event loop a second (0.5 and
        0.7 ms each); with the rest, under 5 and 8 (``python -m bench.cycle --trace --rates 1000,20000``). A run
        is judged by its latest record (kept, else stored) and its deletion is kept like any record, written by
        the next flush: a sweep writes nothing itself."""
        now = self._monotonic()
        partitions = sorted(partition for partition in self._assigned() & self._watermark_ms.keys()
                            if self._resting_until.get(partition, 0.0) <= now)
        if not partitions:
            return
        partition = next((p for p in partitions if p > self._swept_last), partitions[0])
        self._swept_last = partition
        async with self._state_lock:
            if partition in self._assigned():  # not revoked while this sweep waited for the lock
                self._sweep(partition)

    def _assigned(self) -> set[int]:
        topic = self.topics.telemetry.get_topic_name()
        return {tp.partition for tp in self.app.consumer.assignment() if tp.topic == topic}  # type: ignore[attr-defined]

    def _sweep(self, partition: int) -> None:
        horizon = self._watermark_ms[partition] - self._run_ttl_ms
        store = self.store
        found, self._sweep_from[partition] = store.scan(
            partition, self._sweep_from.get(partition, b""), self.evict_scan_per_sweep)
        if not self._sweep_from[partition]:  # the pass reached the partition's last run
            self._resting_until[partition] = self._monotonic() + self._sweep_rest_s
        stale: list[Change] = []
        for key, stored in found:
            latest = store.latest(partition, key, stored)
            if latest is not None and last_ts_ms(latest) < horizon:  # None: deleted already, not written yet
                stale.append((key, None))
        if stale:
            store.keep({partition: stale})
            self._evicted_kept[partition] = self._evicted_kept.get(partition, 0) + len(stale)
            if partition in self._tracked:
                self._tracked[partition] -= len(stale)
            self.metrics.runs_tracked.set(sum(self._tracked.values()))

    async def forget(self, partitions: set[int]) -> None:
        """Partitions were revoked: their runs and their lag are another worker's to count, and their
        records not written by then (the revoke's ``wait_empty`` flushed; a batch that outlived its wait
        keeps its records once done, hence the lock) are dropped: their offsets are not committed here, so
        the next owner folds those events again."""
        async with self._state_lock:
            if dropped := self.store.drop(partitions):
                log.warning("%d run records of partitions %s not written before their revoke: dropped, their "
                            "events are folded again by the partitions' next owner", dropped, sorted(partitions))
        for partition in partitions:
            self._tracked.pop(partition, None)
            self._resting_until.pop(partition, None)
            self._evicted_kept.pop(partition, None)  # not written here: its next owner counts them
            with contextlib.suppress(KeyError):  # never reported here
                self.metrics.consumer_lag.remove(str(partition))
        self.metrics.runs_tracked.set(sum(self._tracked.values()))

    async def report_lag(self) -> None:
        """``loopwarden_consumer_lag``: each assigned input partition's end offset, read from the broker,
        minus the next offset to process (on a timer). The consumer's own high-water mark is no backlog
        gauge: it stops moving while faust pauses a partition and was read only when a batch was
        processed (it showed 0 with thousands of events unapplied)."""
        consumer: Any = self.app.consumer  # type: ignore[attr-defined]
        topic = self.topics.telemetry.get_topic_name()
        sequencer = consumer.sequencer
        # Partitions whose position is known (seeded when their assignment's recovery ended).
        seeded = [tp for tp in (TP(topic, p) for p in self._assigned()) if sequencer.expected(tp) is not None]
        if not seeded:
            return
        try:
            ends = await consumer.highwaters(*seeded)
        except (KafkaError, NotReady) as exc:  # a rebalance, a broker away: the next tick reads them again
            log.debug("end offsets not read for the lag gauge: %r", exc)
            return
        for tp in seeded:
            end, next_offset = ends.get(tp), sequencer.expected(tp)  # it may have moved meanwhile
            if end is not None and next_offset is not None:
                self.metrics.consumer_lag.labels(partition=str(tp.partition)).set(max(0, end - next_offset))

    async def recount(self) -> None:
        """Count the runs of every active partition afresh (faust calls it when recovery is complete:
        the partitions' state is then whole) and drop partitions no longer assigned."""
        async with self._state_lock:
            self._tracked = {partition: self.store.count(partition) for partition in sorted(self._assigned())}
            self.metrics.runs_tracked.set(sum(self._tracked.values()))

    async def _publish(self, decisions: list[Decision]) -> list[asyncio.Future[Any]]:
        """Send decisions (put on the wire at once); the futures of their sends."""
        pending = []
        control, alerts = self.topics.control.get_topic_name(), self.topics.alerts.get_topic_name()
        send = self.decisions.send
        for decision in decisions:
            key, value, headers = encode_control(decision, self.event_source)
            if self.signer is not None:
                headers.extend(self.signer.headers(value))
            pending.append(await send(control, key, value, headers))
            if decision.action == "halt" or decision.verdict in ("operator_halt", "operator_resume"):
                pending.append(await send(alerts, key, value, headers))
        await self.decisions.flush()
        return pending

