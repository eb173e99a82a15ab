"""The rules across runs in the fleet: facts re-keyed by scope key, folded by keyed folds of their own.

The per-run side (``Effects``) takes each batch's facts (``BatchResult.facts``: what new events tell the
folds of ``core/fleet``, as encoded items with their source telemetry partition and offset and their
scope key; the format is ``worker/facts.py``'s) and publishes them to the facts topic
(``FactsPublisher``): one message per facts-topic partition per batch, the partition Kafka's default
partitioner gives the fact's scope key (``tree/ROOT``, ``thread/TENANT/THREAD``,
``tool/TENANT/TOOL/UPSTREAM``), so a key's facts always meet in one partition, in the order each source
partition produced them. Like decisions, their acknowledgement is awaited before the runs' state is
written: a crash can publish a batch's facts again, never lose them.

``FleetEffects.process`` is the body of the facts topic's agent (``delivery`` hands it batches, in offset
order, committed once processed). Each kind of key (``KINDS``: trees, threads, tools) has its own table
(RocksDB, changelog, standbys: as the runs table), co-partitioned with the facts topic. For each key of
the batch:

1. its stored record is read from its kind's table (or, if newer, the record a batch since the last
   commit left to write);
2. facts at or below the key's high-water offset of their source partition were folded before (a batch
   published again after a crash, or facts fetched again) and are skipped, so each counts once;
3. the rest are folded (``core.fleet.trees.fold``, ``threads.fold``, ``tools.fold``);
4. the decisions (scope ``tree`` or ``thread``, keyed by the scope key; signed) go to the control topic,
   and to the alerts topic for on-call; a halt also goes to the scopes topic (compacted, keyed
   ``SCOPE/KEY``, with ``expires_ms``: the trigger's time + the kind's ttl), which runtimes read from its
   beginning when they start, so one started later still refuses a halted tree's children or a halted
   thread's new runs. All are acknowledged before the keys' new records are kept to be written.

The new records are written (RocksDB, changelog) at the start of the consumer's next commit, before it
works out the offsets to commit, when a revoke or stop has let the batch in hand finish (``flush``,
``delivery.install``'s ``state_writers``) and before each sweep (every 0.5 s), not after every batch: a
tree busy in every batch is written once in that time, not once a batch (on the bench's trees, per
300,000 events: 7,600 records and 26 MB batch by batch, 1,800 and 5 MB so). Nothing is committed ahead
of its state: a crash loses only facts whose offsets were not committed, which are fetched and folded
again (their decisions, ids derived from the scope key, published again); the keys' high-water offsets
are in the written records, so facts folded into a written record count once.

An operator's halt or resume of a tree or a thread (``loopwarden halt|resume --tree|--thread``) comes on
the facts topic too, keyed and partitioned like the key's facts, so it is applied in order with them.
Signed by a key of ``LOOPWARDEN_OPERATOR_KEYS`` and recent (``LOOPWARDEN_OPERATOR_MAX_AGE_S``), it is
answered with a signed ``operator_halt``/``operator_resume`` decision of the scope (control, alerts), and
the scopes topic gets the halt (with its expiry) or, on a resume, a tombstone of the key; anything else
goes to the dead-letter topic with the reason.

A key whose facts a fold fails on (a bug: an exception no fact should raise) is left as it was, its
batch's facts not folded, and the facts records they came from are dead-lettered with reason
``internal``; the batch's other keys fold, so the agent does not crash on it after every restart.

A key with no fact for its kind's ttl of event time is forgotten by the sweep, a few per partition per
sweep, as the runs' sweep does; once a pass over a partition is complete, the next starts only when the
event time has passed its oldest key's time + the ttl (keys written meanwhile lower that bound), so an
idle sweep decodes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from ..bus.clock import wall_clock_ms
from ..bus.signing import SignatureRejected, Signer
from ..bus.wire import KIND_HEADER, OPERATOR_KIND, encode_scope_control, header
from ..core import InvalidEvent
from ..core.fleet import ScopeDecision
from ..core.fleet.scope import ScopeCommand, decode_scope_command
from ..core.policy import FleetThresholds
from ..core.stored import StoredRecordError
from .batch import FoldFailed, Verifier
from .delivery import Record
from .effects import CACHED_KEYS, MAX_AHEAD_MS, DeadLetters, DecisionProducer, Topics, key_hash
from .facts import FACTS_FORMAT, KIND_OF_SCOPE, KINDS, TOOLS, FactItem, Kind, decode_facts, message
from .metrics import WorkerMetrics
from .store import Change, RunStore

__all__ = ["DECODED_KEYS", "FACTS_FORMAT", "KINDS", "FactsPublisher", "FleetEffects", "decode_facts", "partition_of"]

log = logging.getLogger(__name__)

#: Decoded states kept between batches (a key's record is decoded again only when what is stored is not
#: what this worker wrote last: after a rebalance, a recovery, a sweep).
DECODED_KEYS = 4096

def partition_of(scope_key: str, partitions: int) -> int:
    """The facts topic partition of a scope key (``tree/ROOT``): Kafka's default partitioner on it."""
    return key_hash(scope_key.encode()) % partitions


class FactsPublisher:
    """The per-run side's half: a batch's facts to the facts topic, one message per partition."""

    def __init__(self, topic: str, partitions: int, producer: DecisionProducer) -> None:
        self.topic = topic
        self.partitions = partitions
        self.producer = producer
        #: Scope key -> facts partition (aiokafka's murmur2 is pure Python: ~5 us a key; keys recur).
        self._partition_of: dict[str, int] = {}

    async def send(self, items: Sequence[FactItem]) -> list[asyncio.Future[Any]]:
        """Queue a batch's fact items (``worker/facts.py``), each kind's in source offset order in its
        partition's message; the futures resolve when the broker has them."""
        by_partition: dict[int, tuple[list[bytes], ...]] = {}
        partitions = self.partitions
        known = self._partition_of
        if len(known) > CACHED_KEYS:
            known.clear()
        # In source offset order: a batch's facts come run by run, and the keyed folds skip a fact at or
        # below a key's high-water offset of its source partition as folded before (runs A, B of one tree
        # at offsets 5, 7 (A), 6 (B): B's fact would be skipped).
        for _, _, kind, key, item in sorted(items, key=_source_offset):
            partition = known.get(key)
            if partition is None:
                partition = known[key] = partition_of(key, partitions)
            lists = by_partition.get(partition)
            if lists is None:
                lists = by_partition[partition] = tuple([] for _ in KINDS)
            lists[kind].append(item)
        return [await self.producer.send_to(self.topic, partition, message(lists))
                for partition, lists in by_partition.items()]


_source_offset = operator.itemgetter(0, 1)

#: A fact's source partition as its keyed state names it (``TreeState.sources``' keys are strings: JSON).
_SOURCE_NAMES: dict[int, str] = {partition: str(partition) for partition in range(1024)}


class FleetEffects:
    """The facts topic's agent body (see the module docstring); ``stores``: each kind's table by name."""

    def __init__(self, topics: Topics, stores: Mapping[str, RunStore], fleet: FleetThresholds, metrics: WorkerMetrics,
                 dead_letters: DeadLetters, signer: Signer | None, event_source: str,
                 decisions: DecisionProducer, evict_scan_per_sweep: int, scopes_topic: str = "",
                 operator_keys: Verifier | None = None, operator_max_age_ms: int = 900_000,
                 clock: Callable[[], int] = wall_clock_ms,
                 decode: Callable[[bytes | None], list[tuple[Kind, int, int, Any]]] = decode_facts) -> None:
        self.topics = topics
        #: ``decode_facts``, or the native engine's reader of the same (``facts.decoder``).
        self.decode = decode
        self.operator_keys = operator_keys
        self.operator_max_age_ms = operator_max_age_ms
        self.clock = clock
        self.stores = stores
        self.fleet = fleet
        self.metrics = metrics
        self.dead_letters = dead_letters
        self.signer = signer
        self.event_source = event_source
        self.decisions = decisions
        self.evict_scan_per_sweep = evict_scan_per_sweep
        self.scopes_topic = scopes_topic
        self._lock = asyncio.Lock()
        self._watermark_ms: dict[tuple[str, int], int] = {}
        self._sweep_from: dict[tuple[str, int], bytes] = {}
        #: (kind, partition) -> the event time before which none of its keys can expire: the oldest
        #: ``last_ts_ms`` of the last complete scan (and of every key written since) plus the ttl. The
        #: sweep scans nothing until the watermark reaches it.
        self._expires_at: dict[tuple[str, int], int] = {}
        #: The oldest ``last_ts_ms`` kept so far by the scan under way (its pass not complete).
        self._pass_oldest: dict[tuple[str, int], int] = {}
        self._tracked: dict[str, int] = dict.fromkeys(stores, 0)
        # the metrics' children, looked up once (``labels`` is a few microseconds a call, several per batch)
        self._counted = {(name, state): metrics.fleet_facts.labels(fold=name, state=state)
                         for name in stores for state in ("folded", "redelivered")}
        self._tracked_gauges = {name: metrics.fleet_keys_tracked.labels(fold=name) for name in stores}
        #: (kind, partition, key) -> (the record this worker wrote, its decoded state): most active last.
        self._decoded: OrderedDict[tuple[str, int, bytes], tuple[bytes, Any]] = OrderedDict()

    async def process(self, records: Sequence[Record]) -> None:
        async with self._lock:
            await self._process(records)

    async def _process(self, records: Sequence[Record]) -> None:
        # The batch's facts by (kind, partition, key), in offset order (the key as ``Kind.key_of`` gives it).
        by_key: dict[tuple[Kind, int, Any], list[tuple[Kind, int, int, Any]]] = {}
        #: The records each key's facts came from (only read when folding a key fails).
        sources_of: dict[tuple[Kind, int, Any], list[Record]] = {}
        for record in records:
            if record.headers and header(record.headers, KIND_HEADER) == OPERATOR_KIND:
                try:
                    kind, command = self._operator(record.value, record.headers)
                except InvalidEvent as exc:
                    await self.dead_letters.send(record, exc)
                    continue
                # in order with the key's facts; no source offset: a command applied twice is one decision
                grouped = (kind, record.partition, kind.key_of(command.key))
                by_key.setdefault(grouped, []).append((kind, -1, -1, command))
                sources_of.setdefault(grouped, []).append(record)  # aligned with the key's items
                continue
            try:
                facts = self.decode(record.value)
            except InvalidEvent as exc:
                await self.dead_letters.send(record, exc)
                continue
            partition = record.partition
            for item in facts:
                kind = item[0]
                grouped = (kind, partition, kind.key_of(item[3]))
                group = by_key.get(grouped)
                if group is None:
                    by_key[grouped] = [item]
                    sources_of[grouped] = [record]
                else:
                    group.append(item)
                    sources_of[grouped].append(record)
        decisions: list[tuple[Kind, ScopeDecision]] = []
        folded: dict[str, int] = {}
        redelivered: dict[str, int] = {}
        written: list[tuple[tuple[str, int, bytes], bytes, Any]] = []
        fleet = self.fleet
        failed: list[tuple[Record, Exception]] = []
        for grouped, items in by_key.items():
            kind, partition, _ = grouped
            store = self.stores[kind.name]
            key_text = items[0][3].key_text  # a fact's and a command's alike
            key = (kind.name, partition, key_text.encode())
            raw = store.get(partition, key[2])  # kept for the next flush, else stored
            known = self._decoded.pop(key, None)  # put back once folded: a failed batch leaves no folded copy
            if raw is None:
                state = kind.state()
            elif known is not None and known[0] == raw:
                state = known[1]  # what this worker wrote last: no decode
            else:
                state = _decode(kind, raw, key_text)
            mark_decisions = len(decisions)
            passed: dict[int, Exception] = {}
            while True:
                at = [-1]
                try:
                    new, skipped = self._fold_key(kind, state, items, decisions, passed, at)
                    for _, decision in decisions[mark_decisions:]:
                        encode_scope_control(decision, self.event_source)  # what _publish will send, encodable
                    record = state.encode()
                    break
                except Exception as exc:  # a bug met on this key's facts
                    del decisions[mark_decisions:]
                    log.error("folding the facts of %s %s raised %r (a loopwarden bug: please report it with the "
                              "records)", kind.label, key_text, exc, exc_info=exc)
                    if at[0] < 0 or at[0] in passed:  # not one fact's (its record or a decision): none of them
                        passed = dict.fromkeys(range(len(items)), exc)
                        record = None
                        break
                    passed[at[0]] = exc  # that fact is dead-lettered; the key folds again without it
                    state = kind.state() if raw is None else _decode(kind, raw, key_text)
            sources = sources_of[grouped]
            for index, cause in passed.items():
                if not any(sources[index] is earlier for earlier, _ in failed):
                    failed.append((sources[index], cause))
            if record is None:
                continue
            if raw is None:
                self._tracked[kind.name] += 1
            sources = state.sources
            if kind is TOOLS:
                _trim_window_marks(sources, state)
            if skipped:
                redelivered[kind.name] = redelivered.get(kind.name, 0) + skipped
            if new:
                folded[kind.name] = folded.get(kind.name, 0) + new
            written.append((key, record, state))
            mark = (kind.name, partition)
            if state.last_ts_ms > self._watermark_ms.get(mark, 0):
                # not past the wall clock by more than a minute: one fact dated years ahead would move the
                # sweep's horizon past every key of the partition
                self._watermark_ms[mark] = min(state.last_ts_ms, self.clock() + MAX_AHEAD_MS)
            self._keep_until(mark, state.last_ts_ms, kind.ttl_ms(fleet))
        for source_record, cause in failed:
            await self.dead_letters.send(source_record, FoldFailed(cause))
        if decisions:
            await self._publish(decisions)
        decoded = self._decoded
        kept: dict[str, dict[int, list[Change]]] = {}
        for key, record, state in written:
            kept.setdefault(key[0], {}).setdefault(key[1], []).append((key[2], record))
            decoded[key] = (record, state)
            decoded.move_to_end(key)
        for name, changes in kept.items():
            self.stores[name].keep(changes)  # written with the next commit
        while len(decoded) > DECODED_KEYS:
            decoded.popitem(last=False)
        counted = self._counted
        for name, count in folded.items():
            counted[name, "folded"].inc(count)
        for name, count in redelivered.items():
            counted[name, "redelivered"].inc(count)
        tracked = self._tracked_gauges
        for name, count in self._tracked.items():
            tracked[name].set(count)

    def _fold_key(self, kind: Kind, state: Any, items: list[tuple[Kind, int, int, Any]],
                  decisions: list[tuple[Kind, ScopeDecision]], passed: Mapping[int, Exception] | None = None,
                  at: list[int] | None = None) -> tuple[int, int]:
        """Fold one key's ``items`` into its ``state`` (in place), appending the decisions they cross, but
        those at ``passed`` indexes; the facts folded and those skipped as folded before. ``at[0]`` is the
        index of the item being folded when an exception leaves (-1: none)."""
        fleet = self.fleet
        sources_named = _SOURCE_NAMES
        sources = state.sources
        fold = kind.fold
        new = skipped = 0
        for index, (_, source_partition, offset, fact) in enumerate(items):
            if passed and index in passed:
                continue
            if at is not None:
                at[0] = index
            if type(fact) is ScopeCommand:
                decisions.append((kind, fact.decision()))
                if kind is TOOLS and fact.action == "resume":
                    state.pause = None  # an operator lifted it: no resume or pause again of the fold's
                continue
            source = sources_named.get(source_partition)
            if source is None:
                source = str(source_partition)
            if offset <= sources.get(source, -1):
                skipped += 1
                continue
            if kind is TOOLS:
                # a batch folded again after a crash, cut elsewhere: only its calls past the mark of the
                # fact's window count (per window: one batch's sums of two windows interleave in offsets)
                window_mark = f"{source}@{fact.window_ms}"
                window_high = sources.get(window_mark, -1)
                if window_high >= 0:
                    fact = fact.past(window_high)
                sources[window_mark] = offset
            sources[source] = offset
            new += 1
            crossed = fold(fleet, state, fact)
            if crossed:
                decisions.extend([(kind, decision) for decision in crossed])
        if at is not None:
            at[0] = -1  # folded: what fails after is no one fact's
        return new, skipped

    def _operator(self, value: bytes | None, headers: Any) -> tuple[Kind, ScopeCommand]:
        """An operator's signed, recent scope command; else InvalidEvent."""
        if self.operator_keys is None:
            raise InvalidEvent("signature", "operator commands are disabled: LOOPWARDEN_OPERATOR_KEYS is empty")
        try:
            key_id = self.operator_keys.verify(value or b"", headers)
        except SignatureRejected as exc:
            raise InvalidEvent("signature", f"operator command refused ({exc.reason}): {exc}") from exc
        command = decode_scope_command(value or b"", key_id)
        age_ms = self.clock() - command.ts_ms
        if age_ms > self.operator_max_age_ms:
            raise InvalidEvent("ts_ms", f"operator command is {age_ms / 1000:.0f} s old, over "
                                        "LOOPWARDEN_OPERATOR_MAX_AGE_S: refused as a replay")
        return KIND_OF_SCOPE[command.scope], command

    async def _publish(self, decisions: list[tuple[Kind, ScopeDecision]]) -> None:
        pending = []
        control, alerts = self.topics.control.get_topic_name(), self.topics.alerts.get_topic_name()
        for kind, decision in decisions:
            key, value, headers = encode_scope_control(decision, self.event_source)
            if self.signer is not None:
                headers.extend(self.signer.headers(value))
            pending.append(await self.decisions.send(control, key, value, headers))
            pending.append(await self.decisions.send(alerts, key, value, headers))
            if decision.action in ("halt", "pause") and self.scopes_topic:
                expires_ms = decision.ts_ms + kind.ttl_ms(self.fleet)
                in_force = orjson.dumps({**decision.to_control(), "expires_ms": expires_ms})
                scope_headers = [h for h in headers if h[0] in ("content-type", "ce_id", "ce_type", "ce_subject")]
                if self.signer is not None:
                    scope_headers.extend(self.signer.headers(in_force))
                pending.append(await self.decisions.send(self.scopes_topic, f"{decision.scope}/{decision.key_text}"
                                                         .encode(), in_force, scope_headers))
            elif decision.action == "resume" and self.scopes_topic:  # lifted: a tombstone of the key
                pending.append(await self.decisions.send(self.scopes_topic, f"{decision.scope}/{decision.key_text}"
                                                         .encode(), None, []))
        await self.decisions.flush()
        await asyncio.gather(*pending)
        now = time.time()
        for kind, decision in decisions:
            self.metrics.decisions.labels(action=decision.action, verdict=decision.verdict).inc()
            self.metrics.decision_latency.observe(max(0.0, now - decision.ts_ms / 1000))
            log.info("%s %s: %s %s: %s", kind.label, decision.key_text, decision.action, decision.verdict,
                     decision.reason)

    async def flush(self) -> None:
        """Write the records of the batches processed so far (the consumer awaits this before every commit,
        and at a revoke or stop once the batch in hand is done: ``delivery.install``'s ``state_writers``)."""
        async with self._lock:
            await self._flush()

    async def _flush(self) -> None:
        for store in self.stores.values():
            await store.flush()

    async def forget(self, partitions: set[int]) -> None:
        """``partitions`` (the facts topic's) were revoked: nothing of them may be written any more (their
        records were written when the revoke's ``wait_empty`` flushed; a batch that outlived it is
        dropped, its offsets not committed here)."""
        async with self._lock:
            for name, store in self.stores.items():
                if dropped := store.drop(partitions):
                    log.warning("%d %s records of facts partitions %s not written before their revoke: dropped, "
                                "their facts are folded again by the partitions' next owner", dropped, name,
                                sorted(partitions))

    async def sweep(self, partitions: set[int]) -> None:
        """Forget keys silent for their kind's ttl of event time in ``partitions`` (the facts topic's)."""
        async with self._lock:
            await self._flush()  # the sweep reads and deletes stored records: they must be the latest
            for kind in KINDS:
                store = self.stores.get(kind.name)
                if store is None:
                    continue
                expired: dict[int, list[Change]] = {}
                ttl_ms = kind.ttl_ms(self.fleet)
                for partition in partitions:
                    mark = (kind.name, partition)
                    watermark = self._watermark_ms.get(mark)
                    if watermark is None or watermark <= self._expires_at.get(mark, watermark - 1):
                        continue  # no key can be silent for the ttl yet
                    horizon = watermark - ttl_ms
                    # a pass starts at the first key (its oldest bounds all of them), goes on where it was
                    start = self._sweep_from.get(mark, b"") if mark in self._pass_oldest else b""
                    found, self._sweep_from[mark] = store.scan(partition, start, self.evict_scan_per_sweep)
                    stale: list[Change] = []
                    oldest = self._pass_oldest.get(mark, watermark)
                    for key, value in found:
                        last_ts_ms = _decode(kind, value, key.decode(errors="replace")).last_ts_ms
                        if last_ts_ms < horizon:
                            stale.append((key, None))
                        elif last_ts_ms < oldest:
                            oldest = last_ts_ms
                    if self._sweep_from[mark]:
                        self._pass_oldest[mark] = oldest
                    else:  # a pass complete: nothing expires before its oldest key's time + the ttl
                        self._pass_oldest.pop(mark, None)
                        self._expires_at[mark] = oldest + ttl_ms
                    if stale:
                        expired[partition] = stale
                if expired:
                    await store.write(expired)
                    self._tracked[kind.name] = max(0, self._tracked[kind.name] - sum(map(len, expired.values())))
                    self._tracked_gauges[kind.name].set(self._tracked[kind.name])

    def _keep_until(self, mark: tuple[str, int], last_ts_ms: int, ttl_ms: int) -> None:
        """A key of ``mark`` was written with ``last_ts_ms``: the sweep's bounds must not pass it."""
        if mark in self._expires_at and last_ts_ms + ttl_ms < self._expires_at[mark]:
            self._expires_at[mark] = last_ts_ms + ttl_ms
        if mark in self._pass_oldest and last_ts_ms < self._pass_oldest[mark]:
            self._pass_oldest[mark] = last_ts_ms

    def recount(self, name: str, partitions: set[int]) -> None:
        """Count ``name``'s stored keys in ``partitions`` (on its table's recovery)."""
        self._tracked[name] = sum(self.stores[name].count(p) for p in partitions)
        for mark in [mark for mark in self._expires_at.keys() | self._pass_oldest.keys() if mark[0] == name]:
            self._expires_at.pop(mark, None)  # keys another worker wrote may be older: scan again
            self._pass_oldest.pop(mark, None)
        self._tracked_gauges[name].set(self._tracked[name])


def _trim_window_marks(sources: dict[str, int], state: Any) -> None:
    """Forget the window marks of windows the tool state no longer keeps."""
    if len(sources) > 2 * len(state.windows) + 8:
        for mark in [m for m in sources if "@" in m and m.split("@", 1)[1] not in state.windows]:
            del sources[mark]


def _decode(kind: Kind, raw: bytes, key: str) -> Any:
    try:
        return kind.state.decode(raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise StoredRecordError(f"stored {kind.label} record of {key!r} cannot be read ({exc}). Operator action: "
                                f"find what else writes the {kind.name} changelog topic (only workers of this app id "
                                "may), and restore the record or delete the key") from exc
