"""The broker the Kafka benchmarks run on: ``KAFKA_BOOTSTRAP_SERVERS`` if set, else a local single-node
broker from ``scripts/kafka_local.py`` started for the run and removed after it."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def _load_kafka_local() -> ModuleType:
    """Import scripts/kafka_local.py by path: scripts/ is not a package."""
    module = sys.modules.get("kafka_local")
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location("kafka_local", REPO / "scripts" / "kafka_local.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up in sys.modules
    spec.loader.exec_module(module)
    return module


kafka_local = _load_kafka_local()


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
