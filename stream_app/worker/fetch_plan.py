"""aiokafka's fetcher deciding what to fetch next, at a cost that does not grow with paused partitions.

aiokafka's fetch routine wakes at least twice a worker cycle (a fetch answered, its records taken) and
each time ``Fetcher._get_actions_per_node`` walks every assigned partition, then ``asyncio.wait`` takes a
set of the pending fetch tasks and the resume future of every paused partition. A worker is assigned
its tables' changelog partitions too, paused once recovered: 32 of 48 with the shipped topics, so each
wake-up added and removed 32 done-callbacks and asked ``asyncio.iscoroutine`` of 32 futures (an ABC
check). At 1,000 events/s (185 cycles/s) the routine was 17.6% of the worker's CPU (py-spy, 2026-12-06):
10.8% the walk, 6.5% the wait; ~300 us a cycle.

``install`` gives one fetcher a ``_get_actions_per_node`` that decides the same actions from the same
state, with the fetcher's and assignment's fields read once per call instead of once per partition,
and hands the wait one future for all paused partitions: done when any of their resume futures is
(made once for a set of paused partitions and kept while that set is unchanged; the same set of futures
aiokafka's would wait on, so the routine wakes on the same events).

aiokafka 0.14.0 internals this relies on (``versions.PINNED``; the method replaced is that release's,
kept in the same order of checks): ``Fetcher._get_actions_per_node``'s contract (fetch requests, partitions
awaiting reset per leader, timeout, whether metadata is invalid, futures to wake on) and its fields
``_records``, ``_in_flight``, ``_preferred_read_replica``, ``_select_read_replica``, ``_client.cluster``,
``_fetch_max_wait_ms``, ``_fetch_min_bytes``, ``_fetch_max_bytes``, ``_isolation_level``,
``_max_partition_fetch_bytes``, ``_client_rack``, ``_fetcher_timeout``; ``Assignment._tp_state`` and
``TopicPartitionState._paused``, ``_resume_fut``, ``_position``; ``FetchResult.calculate_backoff``.
"""

from __future__ import annotations

import asyncio
import random
import types
from collections import defaultdict
from typing import Any

from aiokafka.protocol.fetch import FetchRequest


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
            waiter = self.waiter = futures[0].get_loop().create_future()
            self.futures = key
            for future in futures:
                if future.done():
                    waiter.set_result(None)
                    break
                future.add_done_callback(self._resumed)
        return [waiter]

    def _resumed(self, _: asyncio.Future[Any]) -> None:
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
        fetch_requests.append((node_id, FetchRequest(
            self._fetch_max_wait_ms, self._fetch_min_bytes, self._fetch_max_bytes, self._isolation_level,
            list(by_topics.items()), rack_id=self._client_rack or "")))

    backoff = min(map(max, backoff_by_nodes.values())) if backoff_by_nodes else self._fetcher_timeout
    return fetch_requests, awaiting_reset, backoff, invalid_metadata, self._lw_any_resumed.of(resume_futures)


def install(fetcher: Any) -> None:
    """Give this aiokafka ``Fetcher`` the ``_get_actions_per_node`` above (its routine looks the method up
    on every turn)."""
    fetcher._lw_any_resumed = _AnyResumed()
    fetcher._get_actions_per_node = types.MethodType(_get_actions_per_node, fetcher)
