"""aiokafka's fetcher deciding what to fetch next, and its fetch request and response, at a cost that does
not grow with paused partitions nor with aiokafka's generic protocol code.

aiokafka's fetch routine wakes at least twice a worker cycle (a fetch answered, its records taken) and
each time ``Fetcher._get_actions_per_node`` walks every assigned partition, then ``asyncio.wait`` takes a
set of the pending fetch tasks and the resume future of every paused partition. A worker is assigned
its tables' changelog partitions too, paused once recovered: 32 of 48 with the shipped topics, so each
wake-up added and removed 32 done-callbacks and asked ``asyncio.iscoroutine`` of 32 futures (an ABC
check). At 1,000 events/s (185 cycles/s) the routine was 17.6% of the worker's CPU (py-spy, 2026-12-06):
10.8% the walk, 6.5% the wait; ~300 us a cycle. Each cycle also builds and encodes a fetch request for
the 16 fetchable partitions and decodes its response with aiokafka's generic ``Struct`` code (a call per
field): ~100 us and ~80-100 us (4.4% and ~3% of the worker at 1,000 events/s).

``install`` gives one fetcher a ``_get_actions_per_node`` that decides the same actions from the same
state, with the fetcher's and assignment's fields read once per call instead of once per partition,
and hands the wait one future for all paused partitions: done when any of their resume futures is
(made once for a set of paused partitions and kept while that set is unchanged; the same set of futures
aiokafka's would wait on, so the routine wakes on the same events). Its requests are ``FastFetchRequest``:
for version 11 (what aiokafka 0.14.0 sends to brokers since Kafka 2.3) encoded by hand to aiokafka's
bytes (~20 us), the response decoded by hand to aiokafka's fields (~25 us); other versions are
aiokafka's own. ``tests/unit/test_fetch_plan.py`` holds both to aiokafka's code on generated requests
and responses; ``tests/integration/test_fetch_plan.py`` the actions, against the real broker.

aiokafka 0.14.0 internals this relies on (``versions.PINNED``; the method replaced is that release's,
kept in the same order of checks): ``Fetcher._get_actions_per_node``'s contract (fetch requests, partitions
awaiting reset per leader, timeout, whether metadata is invalid, futures to wake on) and its fields
``_records``, ``_in_flight``, ``_preferred_read_replica``, ``_select_read_replica``, ``_client.cluster``,
``_fetch_max_wait_ms``, ``_fetch_min_bytes``, ``_fetch_max_bytes``, ``_isolation_level``,
``_max_partition_fetch_bytes``, ``_client_rack``, ``_fetcher_timeout``; ``Assignment._tp_state`` and
``TopicPartitionState._paused``, ``_resume_fut``, ``_position``; ``FetchResult.calculate_backoff``;
``FetchRequest._topics`` and its other fields, ``build`` and ``prepare``; the ``FetchRequest_v11`` and
``FetchResponse_v11`` schemas (``Struct.__dict__`` holding the fields by name, ``RESPONSE_TYPE``).
"""

from __future__ import annotations

import asyncio
import random
import struct
import types
from collections import defaultdict
from typing import Any

from aiokafka.protocol.fetch import FetchRequest, FetchRequest_v11, FetchResponse_v11

_HEAD = struct.Struct(">iiiibii")  # replica id, max wait, min bytes, max bytes, isolation level, session id, epoch
_PARTITION = struct.Struct(">iiqqi")  # partition, leader epoch, fetch offset, log start offset, max bytes
_COUNT = struct.Struct(">i")
_LENGTH = struct.Struct(">h")
_RESPONSE_HEAD = struct.Struct(">ihi")  # throttle time, error code, session id
_PARTITION_HEAD = struct.Struct(">ihqqq")  # partition, error code, high watermark, last stable, log start
_ABORTED = struct.Struct(">qq")  # producer id, first offset


def _string(text: str | None) -> bytes:
    if text is None:
        return _LENGTH.pack(-1)
    raw = text.encode()
    return _LENGTH.pack(len(raw)) + raw


class _FetchResponseV11(FetchResponse_v11):  # type: ignore[misc]  # aiokafka is untyped
    """aiokafka's FetchResponse v11, decoded by hand into the same fields (tuples and lists where aiokafka's
    ``Struct.decode`` makes them, None for a null array or bytes): ~80 us for 16 partitions its way."""

    @classmethod
    def decode(cls, data: Any) -> _FetchResponseV11:
        raw = data.read() if hasattr(data, "read") else bytes(data)
        try:
            return cls._read(raw)
        except struct.error as exc:
            raise ValueError(f"Buffer underrun decoding a fetch response: {exc}") from exc

    @classmethod
    def _read(cls, raw: bytes) -> _FetchResponseV11:
        unpack_count, unpack_length = _COUNT.unpack_from, _LENGTH.unpack_from
        unpack_partition, unpack_aborted = _PARTITION_HEAD.unpack_from, _ABORTED.unpack_from
        throttle, error_code, session_id = _RESPONSE_HEAD.unpack_from(raw, 0)
        at = _RESPONSE_HEAD.size
        (count,), at = unpack_count(raw, at), at + 4
        topics: list[Any] | None = None if count == -1 else []  # aiokafka's Array: only -1 is null
        for _ in range(max(count, 0)):
            (length,), at = unpack_length(raw, at), at + 2
            topic = None if length < 0 else raw[at:at + length].decode()
            at += max(length, 0)
            (count,), at = unpack_count(raw, at), at + 4
            partitions: list[Any] | None = None if count == -1 else []
            for _ in range(max(count, 0)):
                partition, p_error, high, stable, start = unpack_partition(raw, at)
                at += _PARTITION_HEAD.size
                (aborted_count,), at = unpack_count(raw, at), at + 4
                aborted: list[Any] | None = None if aborted_count == -1 else []
                for _ in range(max(aborted_count, 0)):
                    aborted.append(unpack_aborted(raw, at))  # type: ignore[union-attr]
                    at += 16
                (replica,), at = unpack_count(raw, at), at + 4
                (size,), at = unpack_count(raw, at), at + 4
                if size < 0:
                    records = None
                else:
                    records = raw[at:at + size]
                    if len(records) < size:
                        raise ValueError("Buffer underrun decoding a fetch response's records")
                    at += size
                partitions.append((partition, p_error, high, stable, start, aborted, replica, records))  # type: ignore[union-attr]
            topics.append((topic, partitions))  # type: ignore[union-attr]
        response = cls.__new__(cls)
        response.__dict__.update(throttle_time_ms=throttle, error_code=error_code, session_id=session_id,
                                 topics=topics)
        return response


class _FetchV11(FetchRequest_v11):  # type: ignore[misc]
    """aiokafka's FetchRequest v11 struct, encoded by hand: the same bytes as its generic ``Struct.encode``
    (Schema, Array, Int32... objects, one call per field: ~100 us for a worker's 16 partitions); its
    response decoded by ``_FetchResponseV11``."""

    RESPONSE_TYPE = _FetchResponseV11

    def __init__(self, *fields: Any) -> None:  # the fields in schema order, as Struct takes them
        self.__dict__.update(zip(self.SCHEMA.names, fields, strict=True))

    def encode(self) -> bytes:
        d = self.__dict__
        out = [_HEAD.pack(d["replica_id"], d["max_wait_time"], d["min_bytes"], d["max_bytes"],
                          d["isolation_level"], d["session_id"], d["session_epoch"]), _COUNT.pack(len(d["topics"]))]
        for topic, partitions in d["topics"]:
            out += (_string(topic), _COUNT.pack(len(partitions)))
            out += [_PARTITION.pack(*partition) for partition in partitions]
        out.append(_COUNT.pack(len(d["forgotten_topics_data"])))
        for topic, partitions in d["forgotten_topics_data"]:
            out += (_string(topic), _COUNT.pack(len(partitions)))
            out += [_COUNT.pack(partition) for partition in partitions]
        out.append(_string(d["rack_id"]))
        return b"".join(out)


class FastFetchRequest(FetchRequest):  # type: ignore[misc]
    """aiokafka's FetchRequest, built for version 11 (what aiokafka 0.14.0 asks of brokers since Kafka 2.3)
    as ``_FetchV11``; other versions as aiokafka builds them."""

    def build(self, request_struct_class: Any) -> Any:
        if request_struct_class is not FetchRequest_v11:
            return super().build(request_struct_class)
        topics = [(topic, [(partition, -1, offset, -1, max_bytes) for partition, offset, max_bytes in partitions])
                  for topic, partitions in self._topics]
        return _FetchV11(-1, self._max_wait_ms, self._min_bytes, self._max_bytes, self._isolation_level, 0, -1,
                         topics, [], self._rack_id)


class _AnyResumed:
    """One future done when any of a set of paused partitions' resume futures is: the fetcher waits on
    it instead of on each (they are done only when their partition resumes)."""

    def __init__(self) -> None:
        self.futures: tuple[asyncio.Future[Any], ...] = ()
        self.waiter: asyncio.Future[None] | None = None

    def of(self, futures: list[asyncio.Future[Any]]) -> list[asyncio.Future[Any]]:
        """What to wait on for ``futures``: one future (the same while they are)."""
        if not futures:
            return []
        key = tuple(futures)
        waiter = self.waiter
        if waiter is None or waiter.done() or key != self.futures:
            if waiter is not None and not waiter.done():
                waiter.cancel()  # nobody waits on it any more: the set changed
            for future in self.futures:
                future.remove_done_callback(self._resumed)
            waiter = self.waiter = futures[0].get_loop().create_future()
            self.futures = key
            for future in futures:
                if future.done():
                    waiter.set_result(None)
                    break
                future.add_done_callback(self._resumed)
        return [waiter]

    def _resumed(self, resumed: asyncio.Future[Any]) -> None:
        if not any(future is resumed for future in self.futures):
            return  # a callback queued before its set was replaced: not this waiter's partition
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _get_actions_per_node(self: Any, assignment: Any) -> tuple[list[Any], Any, float, bool, list[Any]]:
    """aiokafka 0.14.0's ``Fetcher._get_actions_per_node``, same checks in the same order (see the module
    docstring)."""
    fetchable: defaultdict[int, list[Any]] = defaultdict(list)
    awaiting_reset: defaultdict[int, list[Any]] = defaultdict(list)
    backoff_by_nodes: defaultdict[int, list[float]] = defaultdict(list)
    resume_futures: list[asyncio.Future[Any]] = []
    invalid_metadata = False
    records = self._records
    in_flight = self._in_flight
    preferred = self._preferred_read_replica
    select = self._select_read_replica
    cluster = self._client.cluster
    leader_for = cluster.leader_for_partition
    states = assignment._tp_state

    for tp in assignment.tps:
        tp_state = states.get(tp)
        node_id = select(tp) if preferred else leader_for(tp)
        if tp in records:
            backoff = records[tp].calculate_backoff()
            if backoff:
                backoff_by_nodes[node_id].append(backoff)
        elif node_id in in_flight:
            continue
        elif node_id is None or node_id == -1:
            invalid_metadata = True
        elif tp_state._position is None:
            leader_id = leader_for(tp)
            if leader_id is None or leader_id == -1:
                invalid_metadata = True
            else:
                awaiting_reset[leader_id].append(tp)
        elif tp_state._paused:
            resume_futures.append(tp_state._resume_fut)
        else:
            fetchable[node_id].append((tp, tp_state._position))

    fetch_requests = []
    for node_id, partition_data in fetchable.items():
        if node_id in backoff_by_nodes or node_id in awaiting_reset:
            continue
        random.shuffle(partition_data)
        by_topics: defaultdict[str, list[tuple[int, int, int]]] = defaultdict(list)
        for tp, position in partition_data:
            by_topics[tp.topic].append((tp.partition, position, self._max_partition_fetch_bytes))
        fetch_requests.append((node_id, FastFetchRequest(
            self._fetch_max_wait_ms, self._fetch_min_bytes, self._fetch_max_bytes, self._isolation_level,
            list(by_topics.items()), rack_id=self._client_rack or "")))

    backoff = min(map(max, backoff_by_nodes.values())) if backoff_by_nodes else self._fetcher_timeout
    return fetch_requests, awaiting_reset, backoff, invalid_metadata, self._lw_any_resumed.of(resume_futures)


def install(fetcher: Any) -> None:
    """Give this aiokafka ``Fetcher`` the ``_get_actions_per_node`` above (its routine looks the method up
    on every turn)."""
    fetcher._lw_any_resumed = _AnyResumed()
    fetcher._get_actions_per_node = types.MethodType(_get_actions_per_node, fetcher)
