"""The broker the Kafka benchmarks run on: ``KAFKA_BOOTSTRAP_SERVERS`` if set, else a local single-node
broker from ``scripts.kafka_local`` started for the run and removed after it."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from scripts import kafka_local


@contextmanager
def broker() -> Iterator[tuple[str, str]]:
    """(bootstrap, Kafka version) of the broker to use for the whole run."""
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if bootstrap:
        yield bootstrap, os.environ.get("KAFKA_VERSION", "external")
        return
    with kafka_local.LocalKafka() as local:
        yield local.bootstrap, local.version


def create_topics(bootstrap: str, topics: Iterable[tuple[str, int]]) -> None:
    """Create plain topics (existing ones are fine)."""
    kafka_local.create_topics(bootstrap, [kafka_local.TopicSpec(name, partitions) for name, partitions in topics])
