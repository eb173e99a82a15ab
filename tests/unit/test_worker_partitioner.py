"""The decisions producer's partitioner: Kafka's default one (a key's partition is the same whichever client
sends it: a run's decisions, its operator's commands and its telemetry agree), with its hashes remembered."""

from __future__ import annotations

from aiokafka.partitioner import DefaultPartitioner
from hypothesis import given
from hypothesis import strategies as st

from stream_app.worker.effects import KeyedPartitioner


@given(st.lists(st.binary(max_size=40), min_size=1, max_size=60), st.integers(min_value=1, max_value=64))
def test_every_key_goes_where_kafkas_default_partitioner_sends_it_also_once_its_memory_is_full(
        keys: list[bytes], partitions: int) -> None:
    cached = KeyedPartitioner(cached=4)  # cleared every few keys: hits, misses and clears all met
    every = list(range(partitions))
    for key in keys + keys[::-1]:
        assert cached(key, every, every) == DefaultPartitioner()(key, every, every)
    assert len(cached._hashes) <= 4


def test_a_keyless_message_goes_to_an_available_partition() -> None:
    assert KeyedPartitioner()(None, [0, 1, 2, 3], [2]) == 2
    assert KeyedPartitioner()(None, [0, 1], []) in (0, 1)
