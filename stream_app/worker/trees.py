"""Sub-agent trees in the fleet: facts re-keyed by root run id, folded by a keyed fold of their own.

The per-run side (``Effects``) takes each batch's tree facts (``BatchResult.facts``: what new events
tell ``core/fleet/trees.py``, each with its source telemetry partition and offset) and publishes them
to the facts topic (``FactsPublisher``): one message per facts-topic partition per batch, the partition
Kafka's default partitioner gives the root run id, so a tree's facts always meet in one partition, in
the order each source partition produced them. Like decisions, their acknowledgement is awaited before
the runs' state is written: a crash can publish a batch's facts again, never lose them.

``TreeEffects.process`` is the body of the facts topic's agent (``delivery`` hands it batches, in offset
order, committed once processed), for each tree of the batch:

1. its stored record is read from the trees table (RocksDB, changelog, standbys: as the runs table);
2. facts at or below the tree's high-water offset of their source partition were folded before (a
   batch published again after a crash, or facts fetched again) and are skipped, so each counts once;
3. the rest are folded (``core.fleet.trees.fold``);
4. the decisions (scope ``tree``, keyed by root run id; signed) go to the control topic, and to the
   alerts topic for on-call; a halt also goes to the scopes topic (compacted, keyed ``tree/<root>``,
   with ``expires_ms``: the trigger's time + ``tree_ttl_ms``), which runtimes read from its beginning
   when they start, so one started later still refuses the halted tree's children. All are
   acknowledged before the trees' new records are written.

A tree with no fact for ``tree_ttl_ms`` of event time is forgotten by the sweep, a few per partition
per sweep, as the runs' sweep does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import orjson
from aiokafka.partitioner import murmur2

from ..bus.signing import Signer
from ..bus.wire import encode_scope_control
from ..core import InvalidEvent
from ..core.fleet import ScopeDecision, TreeFact, TreeState
from ..core.fleet.trees import fold
from ..core.policy import FleetThresholds
from ..core.stored import StoredRecordError
from .delivery import Record
from .effects import DeadLetters, DecisionProducer, Topics
from .metrics import WorkerMetrics
from .store import Change, RunStore

log = logging.getLogger(__name__)

FACTS_FORMAT = 1
#: Decoded tree states kept between batches (a tree's record is decoded again only when what is stored
#: is not what this worker wrote last: after a rebalance, a recovery, a sweep).
DECODED_TREES = 4096


def partition_of(root: str, partitions: int) -> int:
    """The facts topic partition of a tree: Kafka's default partitioner on the root run id."""
    return int(murmur2(root.encode()) & 0x7FFFFFFF) % partitions


class FactsPublisher:
    """The per-run side's half: a batch's tree facts to the facts topic, one message per partition."""

    def __init__(self, topic: str, partitions: int, producer: DecisionProducer) -> None:
        self.topic = topic
        self.partitions = partitions
        self.producer = producer

    async def send(self, facts: Sequence[tuple[int, int, TreeFact]]) -> list[asyncio.Future[Any]]:
        """Queue the facts; the futures resolve when the broker has them."""
        by_partition: dict[int, list[list[Any]]] = {}
        partitions = self.partitions
        for source_partition, offset, fact in facts:
            by_partition.setdefault(partition_of(fact.root, partitions), []).append(
                [source_partition, offset, *fact.to_tuple()])
        pending = []
        for partition, items in by_partition.items():
            value = orjson.dumps({"v": FACTS_FORMAT, "facts": items})
            pending.append(await self.producer.send_to(self.topic, partition, value))
        return pending


def decode_facts(value: bytes | None) -> list[tuple[int, int, TreeFact]]:
    """The facts of one facts-topic message; InvalidEvent naming what is wrong."""
    try:
        obj = orjson.loads(value or b"")
    except orjson.JSONDecodeError as exc:
        raise InvalidEvent("facts", f"not JSON: {exc.msg}") from exc
    if type(obj) is not dict or obj.get("v") != FACTS_FORMAT or type(obj.get("facts")) is not list:
        raise InvalidEvent("facts", f"not a tree facts message of format {FACTS_FORMAT}")
    out = []
    for item in obj["facts"]:
        if type(item) is not list or len(item) != 14:
            raise InvalidEvent("facts", "a fact must be a list of 14 fields")
        source_partition, offset, *fields = item
        try:
            fact = TreeFact(*fields)
        except TypeError as exc:
            raise InvalidEvent("facts", str(exc)) from exc
        if type(source_partition) is not int or type(offset) is not int or type(fact.root) is not str \
                or type(fact.run_id) is not str or type(fact.ts_ms) is not int or type(fact.cost_micro) is not int:
            raise InvalidEvent("facts", "a fact's source, run, time or cost has the wrong type")
        out.append((source_partition, offset, fact))
    return out


class TreeEffects:
    """The facts topic's agent body (see the module docstring)."""

    def __init__(self, app: Any, topics: Topics, store: RunStore, fleet: FleetThresholds, metrics: WorkerMetrics,
                 dead_letters: DeadLetters, signer: Signer | None, event_source: str,
                 decisions: DecisionProducer, evict_scan_per_sweep: int, scopes_topic: str = "") -> None:
        self.app = app
        self.topics = topics
        self.store = store
        self.fleet = fleet
        self.metrics = metrics
        self.dead_letters = dead_letters
        self.signer = signer
        self.event_source = event_source
        self.decisions = decisions
        self.evict_scan_per_sweep = evict_scan_per_sweep
        self.scopes_topic = scopes_topic
        self._lock = asyncio.Lock()
        self._watermark_ms: dict[int, int] = {}
        self._sweep_from: dict[int, bytes] = {}
        self._tracked = 0
        #: (partition, root) -> (the record this worker wrote, its decoded state): most active last.
        self._decoded: OrderedDict[tuple[int, bytes], tuple[bytes, TreeState]] = OrderedDict()

    async def process(self, records: Sequence[Record]) -> None:
        async with self._lock:
            await self._process(records)

    async def _process(self, records: Sequence[Record]) -> None:
        # The batch's facts by (partition, root), in offset order.
        by_tree: dict[tuple[int, str], list[tuple[int, int, TreeFact]]] = {}
        for record in records:
            try:
                facts = decode_facts(record.value)
            except InvalidEvent as exc:
                await self.dead_letters.send(record, exc)
                continue
            for item in facts:
                by_tree.setdefault((record.partition, item[2].root), []).append(item)
        decisions: list[ScopeDecision] = []
        changes: dict[int, list[Change]] = {}
        folded = redelivered = 0
        written: list[tuple[tuple[int, bytes], bytes, TreeState]] = []
        for (partition, root), facts in by_tree.items():
            key = (partition, root.encode())
            raw = self.store.get(*key)
            known = self._decoded.pop(key, None)  # put back once written: a failed batch leaves no folded copy
            if raw is None:
                state = TreeState()
                self._tracked += 1
            elif known is not None and known[0] == raw:
                state = known[1]  # what this worker wrote last: no decode
            else:
                state = _decode(raw, root)
            sources = state.sources
            for source_partition, offset, fact in facts:
                source = str(source_partition)
                if offset <= sources.get(source, -1):
                    redelivered += 1
                    continue
                sources[source] = offset
                folded += 1
                decisions.extend(fold(self.fleet, state, fact))
            record = state.encode()
            changes.setdefault(partition, []).append((key[1], record))
            written.append((key, record, state))
            if state.last_ts_ms > self._watermark_ms.get(partition, 0):
                self._watermark_ms[partition] = state.last_ts_ms
        if decisions:
            await self._publish(decisions)
        await self.store.write(changes)
        decoded = self._decoded
        for key, record, state in written:
            decoded[key] = (record, state)
            decoded.move_to_end(key)
        while len(decoded) > DECODED_TREES:
            decoded.popitem(last=False)
        self.metrics.tree_facts.labels(state="folded").inc(folded)
        if redelivered:
            self.metrics.tree_facts.labels(state="redelivered").inc(redelivered)
        self.metrics.trees_tracked.set(self._tracked)

    async def _publish(self, decisions: list[ScopeDecision]) -> None:
        pending = []
        control, alerts = self.topics.control.get_topic_name(), self.topics.alerts.get_topic_name()
        for decision in decisions:
            key, value, headers = encode_scope_control(decision, self.event_source)
            if self.signer is not None:
                headers.extend(self.signer.headers(value))
            pending.append(await self.decisions.send(control, key, value, headers))
            pending.append(await self.decisions.send(alerts, key, value, headers))
            if decision.action == "halt" and self.scopes_topic:
                in_force = orjson.dumps({**decision.to_control(), "expires_ms": decision.ts_ms + self.fleet.tree_ttl_ms})
                scope_headers = [h for h in headers if h[0] in ("content-type", "ce_id", "ce_type", "ce_subject")]
                if self.signer is not None:
                    scope_headers.extend(self.signer.headers(in_force))
                pending.append(await self.decisions.send(self.scopes_topic, f"{decision.scope}/{decision.key_text}"
                                                         .encode(), in_force, scope_headers))
        await asyncio.gather(*pending)
        now = time.time()
        for decision in decisions:
            self.metrics.decisions.labels(action=decision.action, verdict=decision.verdict).inc()
            self.metrics.decision_latency.observe(max(0.0, now - decision.ts_ms / 1000))
            log.info("sub-agent tree %s: %s %s: %s", decision.key_text, decision.action, decision.verdict,
                     decision.reason)

    async def sweep(self, partitions: set[int]) -> None:
        """Forget trees silent for ``tree_ttl_ms`` of event time in ``partitions`` (the trees table's)."""
        async with self._lock:
            expired: dict[int, list[Change]] = {}
            for partition in partitions & self._watermark_ms.keys():
                horizon = self._watermark_ms[partition] - self.fleet.tree_ttl_ms
                found, self._sweep_from[partition] = self.store.scan(
                    partition, self._sweep_from.get(partition, b""), self.evict_scan_per_sweep)
                stale: list[Change] = [(key, None) for key, value in found
                                       if _decode(value, key.decode(errors="replace")).last_ts_ms < horizon]
                if stale:
                    expired[partition] = stale
            if expired:
                await self.store.write(expired)
                self._tracked = max(0, self._tracked - sum(map(len, expired.values())))
                self.metrics.trees_tracked.set(self._tracked)

    def recount(self, partitions: set[int]) -> None:
        self._tracked = sum(self.store.count(p) for p in partitions)
        self.metrics.trees_tracked.set(self._tracked)


def _decode(raw: bytes, root: str) -> TreeState:
    try:
        return TreeState.decode(raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise StoredRecordError(f"stored tree record of {root!r} cannot be read ({exc}). Operator action: find what "
                                "else writes the trees changelog topic (only workers of this app id may), and "
                                "restore the record or delete the tree's key") from exc
