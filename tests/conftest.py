"""Fixtures for tests against a real Kafka broker (integration and end-to-end tiers).

``kafka_bootstrap`` uses ``$KAFKA_BOOTSTRAP_SERVERS`` when it is set (e.g. a broker started once with
``scripts/kafka_local.py start``); otherwise it starts a broker from ``scripts/kafka_local.py`` for the
test session. Tests create their own uniquely named topics with ``topic_factory``, and tests that must
stop, kill or misconfigure a broker get a private one from ``kafka_broker_factory``.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _load_kafka_local() -> ModuleType:
    """Import scripts/kafka_local.py by path: scripts/ is not a package."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "kafka_local.py"
    spec = importlib.util.spec_from_file_location("kafka_local", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up in sys.modules
    spec.loader.exec_module(module)
    return module


kafka_local = _load_kafka_local()


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``host:port`` of a running broker, shared by the whole session."""
    external = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if external:
        yield external
        return
    broker = kafka_local.LocalKafka(data_dir=tmp_path_factory.mktemp("kafka"))
    broker.start()
    try:
        yield broker.bootstrap
    finally:
        broker.close()


@pytest.fixture(scope="session")
def topic_factory(kafka_bootstrap: str) -> Callable[..., str]:
    """``make(partitions=1, *, compact=False, prefix="test") -> name``: create a fresh, unique topic."""

    def make(partitions: int = 1, *, compact: bool = False, prefix: str = "test") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        kafka_local.create_topics(kafka_bootstrap, [kafka_local.TopicSpec(name, partitions, compact=compact)])
        return name

    return make


@pytest.fixture
def kafka_broker_factory(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``make(**LocalKafka kwargs) -> LocalKafka`` (not started) with its own data dir; all closed at teardown.

    For tests that stop, kill, restart or misconfigure a broker (``extra_properties=...``), so the
    session broker stays untouched.
    """
    brokers: list[Any] = []
    numbers = itertools.count()

    def make(**kwargs: Any) -> Any:
        kwargs.setdefault("data_dir", tmp_path / f"broker-{next(numbers)}")
        broker = kafka_local.LocalKafka(**kwargs)
        brokers.append(broker)
        return broker

    yield make
    for broker in brokers:
        broker.close()
