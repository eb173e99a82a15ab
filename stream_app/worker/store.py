"""The runs table's storage, read and written a batch at a time.

Faust's Table API costs ~400 us of worker CPU per write here (a FutureMessage, a buffered changelog
send, a callback that writes the persisted offset to RocksDB for every key), which capped the worker
near 1,000 events/s. The worker keeps the Table for what Faust does well (changelog topic, recovery,
standbys, partition assignment) and writes its storage directly:

* one rocksdict ``WriteBatch`` per partition per batch;
* one changelog message per written key, in the same order, sent through the app's own producer (its
  aiokafka producer) as record batches the worker builds itself (``create_batch``/``send_batch``): one
  future per partition per batch, not one ``send`` and one future per record (at ~770 runs written per
  batch of 1,000 events, faust's ``send`` path and aiokafka resolving each record's future were a tenth
  of a saturated worker's CPU);
* the persisted offset (where changelog recovery resumes on restart) once per partition, when the last
  changelog record of the batch is acknowledged, as Faust's own callback does.

Restart safety is unchanged: Faust flushes that producer before it commits input offsets, so a
committed input offset never runs ahead of the changelog.

A batch's new records need not be written after every batch: ``keep`` holds them (the latest of each key)
and ``get`` reads them first, so the next batch folds on them; ``flush`` writes what is kept, and the
worker awaits it before every commit and in a revoke's ``wait_empty`` (``delivery.install``'s
``state_writers``), so no offset is committed, and no partition handed over, ahead of its state. The runs'
writer (``Effects.flush``) takes the kept records out at once (``take``) and writes them a partition at a
time once the batches' decisions are acknowledged (``write_taken``); ``get`` reads taken records until
they are written, so batches go on meanwhile. A key changed in every batch is then written once a commit,
and a batch of a few events costs no RocksDB write and no changelog request: at a few thousand events per
second a worker made a write and a produce request every 3-4 ms for a handful of events.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import faust
import rocksdict
from faust.types import TP, TableT

#: faust keeps its own bookkeeping (the persisted changelog offset) under this prefix in the same DB.
FAUST_RESERVED_PREFIX = b"__faust"

Change = tuple[bytes, bytes | None]  # (key, new value or None to delete)


class _NotInMemory:
    """What ``RunStore._in_memory`` returns for a key neither kept nor taken (None is a deletion kept)."""


_NOT_IN_MEMORY = _NotInMemory()


class RunStore:
    """Per-partition reads and batched writes of the runs table (keys and values are raw bytes)."""

    def __init__(self, app: faust.App, table: TableT[bytes, bytes | None], changelog_topic: str) -> None:
        self.app = app
        self.table = table
        self.changelog_topic = changelog_topic
        #: Records kept for the next ``flush`` by partition and key (None: delete), newest of each key.
        self._kept: dict[int, dict[bytes, bytes | None]] = {}
        #: How many records ``_kept`` holds.
        self.kept = 0
        #: Kept records taken out to be written (``take``), oldest first: ``get`` reads them until written.
        self._taken: list[dict[int, dict[bytes, bytes | None]]] = []
        #: The task handing the last flush's (or ``write``'s) changelog records to the producer: the next
        #: one's wait for it.
        self._sending: asyncio.Future[None] | None = None

    @property
    def _store(self) -> Any:
        # faust's RocksDB store (pinned faust-streaming version): one DB per partition.
        return self.table.data

    def get(self, partition: int, key: bytes) -> bytes | None:
        """``key``'s record: the one kept for the next flush, else one taken to be written (``take``), else
        the stored one (``write_taken`` writes RocksDB before it lets a partition's taken records go)."""
        found = self._in_memory(partition, key)
        return self.read(partition, key) if isinstance(found, _NotInMemory) else found

    def latest(self, partition: int, key: bytes, stored: bytes) -> bytes | None:
        """``key``'s record as ``get`` would return it, given its ``stored`` one (read by ``scan``)."""
        found = self._in_memory(partition, key)
        return stored if isinstance(found, _NotInMemory) else found

    def _in_memory(self, partition: int, key: bytes) -> bytes | _NotInMemory | None:
        """``key``'s record kept, else taken (the newest first), else ``_NOT_IN_MEMORY``."""
        kept = self._kept.get(partition)
        if kept is not None and key in kept:
            return kept[key]
        for taken in reversed(self._taken):
            items = taken.get(partition)
            if items is not None and key in items:
                return items[key]
        return _NOT_IN_MEMORY

    def read(self, partition: int, key: bytes) -> bytes | None:
        """``key``'s stored record (RocksDB), whatever is kept."""
        value: bytes | None = self._store._db_for_partition(partition).get(key)
        return value

    def keep(self, changes: Mapping[int, Sequence[Change]]) -> None:
        """Hold ``changes`` for the next ``flush`` (``get`` returns them meanwhile)."""
        kept = self._kept
        for partition, items in changes.items():
            if items:
                by_key = kept.setdefault(partition, {})
                before = len(by_key)
                by_key.update(items)
                self.kept += len(by_key) - before

    async def flush(self, partitions: Iterable[int] | None = None) -> None:
        """Write what ``keep`` holds (of ``partitions`` only, if given): ``write_kept``, its changelog records
        handed to the producer before this returns."""
        await self.write_kept(partitions)

    def write_kept(self, partitions: Iterable[int] | None = None) -> asyncio.Future[None]:
        """Write what ``keep`` holds (of ``partitions`` only, if given) to RocksDB now, and hand its changelog
        records to the producer in a task of its own; returns that task (done once they are handed over, not
        acknowledged: faust flushes the producer before it commits).

        The caller's state lock need not be held while the task waits: aiokafka takes a partition's next
        record batch only once its previous one went out (one request in flight per broker), so a flush
        of a few hundred records could hold the lock for tens of milliseconds while the broker answered,
        and every batch waited. The local write is done before this returns, so a read after it finds the
        records in RocksDB. Each flush's records go to the producer after the previous flush's (or ``write``'s):
        a newer record of a key never goes ahead of an older one in the changelog. Records kept meanwhile wait
        for the next flush. If the write fails, all it held is kept again (under any newer record of the
        same key; written twice is harmless)."""
        if partitions is None:
            pending, self._kept = self._kept, {}
        else:
            pending = {p: self._kept.pop(p) for p in partitions if p in self._kept}
        self.kept -= sum(map(len, pending.values()))
        return self._write_pending(pending)

    def _write_pending(self, pending: dict[int, dict[bytes, bytes | None]]) -> asyncio.Future[None]:
        """``_write`` of records taken out of memory, kept again if it fails; a done future if there are none."""
        if not pending:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        try:
            return self._write({partition: list(items.items()) for partition, items in pending.items()},
                               functools.partial(self._keep_again, pending))
        except BaseException:
            self._keep_again(pending)
            raise

    def _keep_again(self, pending: dict[int, dict[bytes, bytes | None]]) -> None:
        """A flush of ``pending`` failed: keep its records again, under any newer record of the same key: one
        kept, or one taken since (every snapshot in ``_taken`` other than ``pending``'s own is newer: writes go
        in the order they were taken, each after the one before it is done)."""
        for partition, items in pending.items():
            newer = self._kept.get(partition, {})
            taken_since = [taken[partition] for taken in self._taken if partition in taken]
            if taken_since:
                items = {key: value for key, value in items.items() if not any(key in t for t in taken_since)}
            self._kept[partition] = {**items, **newer}
            self.kept += len(self._kept[partition]) - len(newer)

    def take(self) -> dict[int, dict[bytes, bytes | None]]:
        """Take every kept record out, to be written by ``write_taken`` (a partition at a time, in the order
        they were taken); ``get`` reads them meanwhile, and records kept after them come first."""
        taken, self._kept = self._kept, {}
        self.kept = 0
        if taken:
            self._taken.append(taken)
        return taken

    def write_taken(self, taken: dict[int, dict[bytes, bytes | None]], partition: int) -> asyncio.Future[None]:
        """Write ``partition``'s records of ``taken`` (``take``) as ``write_kept`` does: to RocksDB now (read from
        there from then on), their changelog records handed to the producer by the task returned. If the
        write fails, they are kept again."""
        items = taken.pop(partition, None)
        return self._write_pending({partition: items} if items else {})

    def untake(self, taken: dict[int, dict[bytes, bytes | None]]) -> None:
        """What ``taken`` still holds is not written: kept again (under any newer record of the same key)."""
        self._taken = [other for other in self._taken if other is not taken]
        self._keep_again(taken)

    def kept_partitions(self) -> set[int]:
        """The partitions with records kept for the next flush."""
        return set(self._kept)

    def drop(self, partitions: set[int]) -> int:
        """Forget the records kept for ``partitions`` (revoked: no longer this worker's to write), taken ones
        not written yet included; how many."""
        dropped = sum(len(self._kept.pop(partition, {})) for partition in partitions)
        self.kept -= dropped
        for taken in self._taken:
            dropped += sum(len(taken.pop(partition, {})) for partition in partitions)
        return dropped

    async def write(self, changes: Mapping[int, Sequence[Change]]) -> None:
        """Apply ``changes`` (by partition) locally and hand their changelog records to the producer, after
        any flush's before them; returns once they are handed over (not acknowledged)."""
        await self._write(changes)

    def _write(self, changes: Mapping[int, Sequence[Change]],
               on_failure: Callable[[], None] | None = None) -> asyncio.Future[None]:
        """Apply ``changes`` to RocksDB now and build their changelog batches (one record per change, in
        the same order); the task that sends them, after the previous one's (``on_failure`` runs if it
        fails)."""
        store = self._store
        # faust's producer is aiokafka's underneath; faust's flush before a commit flushes it.
        producer = self.app.producer._ensure_producer()  # type: ignore[attr-defined]
        batches: list[tuple[int, Any, int]] = []  # (partition, aiokafka batch, index of its last record)
        for partition, items in changes.items():
            if not items:
                continue
            batch = rocksdict.WriteBatch(raw_mode=True)
            for key, value in items:
                if value is None:
                    batch.delete(key)
                else:
                    batch.put(key, value)
            store._db_for_partition(partition).write(batch)
            records = producer.create_batch()
            count = 0
            for key, value in items:
                if records.append(key=key, value=value, timestamp=None) is None:  # full: another one
                    batches.append((partition, records, -1))
                    records, count = producer.create_batch(), 0
                    records.append(key=key, value=value, timestamp=None)  # the first record always fits
                count += 1
            batches.append((partition, records, count - 1))
        sending = asyncio.ensure_future(self._send(producer, batches, self._sending, on_failure))
        self._sending = sending
        return sending

    async def _send(self, producer: Any, batches: list[tuple[int, Any, int]], previous: asyncio.Future[None] | None,
                    on_failure: Callable[[], None] | None) -> None:
        try:
            if previous is not None and not previous.done():
                await asyncio.wait([previous])  # in order after it, whatever became of it
            for partition, records, last in batches:
                sent: asyncio.Future[Any] = await producer.send_batch(records, self.changelog_topic,
                                                                      partition=partition)
                if last >= 0:  # a partition's last batch: recovery may resume after its last record
                    sent.add_done_callback(functools.partial(self._persist_offset, last))
        except BaseException:
            if on_failure is not None:
                on_failure()
            raise

    def _persist_offset(self, last: int, sent: asyncio.Future[Any]) -> None:
        """``sent``'s records are acknowledged: recovery may resume after its record ``last`` (the batch's
        base offset + ``last``)."""
        if sent.cancelled() or sent.exception() is not None:
            return  # the producer fails the app on send errors; recovery then replays from the older offset
        metadata = sent.result()
        if metadata.partition in self._store._dbs:  # still ours (not closed by a rebalance)
            self._store.set_persisted_offset(TP(metadata.topic, metadata.partition), metadata.offset + last)

    def scan(self, partition: int, start: bytes, limit: int) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """Up to ``limit`` (key, value) pairs of ``partition`` from ``start`` on (faust's own keys
        skipped), and where the next scan resumes (``b""``: back to the first key)."""
        cursor = self._store._db_for_partition(partition).iter()
        cursor.seek(start)
        found: list[tuple[bytes, bytes]] = []
        for _ in range(limit):
            if not cursor.valid():
                return found, b""
            key = cursor.key()
            if not key.startswith(FAUST_RESERVED_PREFIX):
                found.append((key, cursor.value()))
            cursor.next()
        return found, cursor.key() if cursor.valid() else b""

    def count(self, partition: int) -> int:
        """The runs stored in ``partition``, counted key by key (faust's own keys skipped)."""
        cursor = self._store._db_for_partition(partition).iter()
        cursor.seek_to_first()
        runs = 0
        while cursor.valid():
            runs += not cursor.key().startswith(FAUST_RESERVED_PREFIX)
            cursor.next()
        return runs
