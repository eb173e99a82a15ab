"""The test tiers, and the fixtures for tests against a real Kafka broker.

A test's tier is its folder, and its folder's marker is put on it here; a tier marker that contradicts
the folder fails the collection (move the test, or drop the marker):

- ``unit/``: offline and in-process (loopback sockets and ``python -c`` subprocesses at most), no marker;
- ``integration/``: real parts: the local Kafka broker, the agent frameworks' own libraries;
- ``e2e/``: the CLI and workers run as processes, the way a user runs them;
- ``deploy/``: the deploy tools (helm, promtool, prometheus, alertmanager, compose-check);
- ``chaos/``: fault injection; ``make test`` runs one short trial of each, ``make chaos`` the suite.

``kafka_bootstrap`` uses ``$KAFKA_BOOTSTRAP_SERVERS`` when it is set (e.g. a broker started once with
``python -m scripts.kafka_local start``); otherwise it starts a broker (``scripts.kafka_local``) for the
test session (``make test`` runs two pytest-xdist processes: a broker each). Tests create their own
uniquely named topics with ``topic_factory``, and tests that must
stop, kill or misconfigure a broker get a private one from ``kafka_broker_factory``. ``secure_kafka`` is
a second, secured session broker (SASL_SSL, mutual TLS, ACLs), started by the first test that asks.
"""

from __future__ import annotations

import itertools
import os
import secrets
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from scripts import kafka_local
from tests.notify_support import Webhook, serving

if TYPE_CHECKING:
    from stream_app.client import KafkaClientConfig


TESTS = Path(__file__).resolve().parent
#: Folder -> the marker of its tier (None: the unit tier has none).
TIERS: dict[str, str | None] = {"unit": None, "integration": "integration", "e2e": "e2e", "deploy": "deploy",
                                "chaos": "chaos"}
TIER_MARKERS = {marker for marker in TIERS.values() if marker}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.relative_to(TESTS).parts[0]
        if folder not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in one of tests/{{{','.join(TIERS)}}}/")
        marker = TIERS[folder]
        wrong = {m.name for m in item.iter_markers() if m.name in TIER_MARKERS} - {marker}
        if wrong:
            raise pytest.UsageError(f"{item.nodeid}: marked {', '.join(sorted(wrong))} but it lives in "
                                    f"tests/{folder}/: move it to that tier's folder, or drop the marker")
        if marker:
            item.add_marker(marker)


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


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    """A webhook on loopback that records every post and fails on cue (``tests.notify_support``)."""
    with serving(Webhook()) as hook:
        yield hook


#: Users of the secured broker, one per role; ACLs are the tests' to grant.
SECURE_USERS = ("worker", "runtime-a", "notify", "operator", "stranger")


@dataclass(frozen=True)
class SecureKafka:
    """The secured session broker, and how a client logs in to it as one of ``SECURE_USERS``."""

    broker: Any  # kafka_local.LocalKafka with BrokerSecurity
    passwords: dict[str, str]

    @property
    def bootstrap(self) -> str:
        return str(self.broker.bootstrap)

    def env(self, user: str, mechanism: str = "SCRAM-SHA-512", *, password: str | None = None,
            client_cert: bool = True) -> dict[str, str]:
        """The KAFKA_* variables that log a worker, notifier or SDK in as ``user``."""
        tls = self.broker.security.tls
        env = {
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "KAFKA_SASL_MECHANISM": mechanism,
            "KAFKA_SASL_USERNAME": user,
            "KAFKA_SASL_PASSWORD": self.passwords[user] if password is None else password,
            "KAFKA_SSL_CAFILE": str(tls.ca),
        }
        if client_cert:
            env.update(KAFKA_SSL_CERTFILE=str(tls.client_cert), KAFKA_SSL_KEYFILE=str(tls.client_key))
        return env

    def config(self, user: str, mechanism: str = "SCRAM-SHA-512", **kwargs: Any) -> KafkaClientConfig:
        """A client config for ``user``, read from ``env`` the way every loopwarden client reads it."""
        from stream_app.client import KafkaClientConfig

        return KafkaClientConfig.from_env(self.env(user, mechanism, **kwargs))


@pytest.fixture(scope="session")
def secure_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureKafka]:
    """A local broker with a SASL_SSL listener (SCRAM-SHA-512 and PLAIN), client certificates required
    and the StandardAuthorizer on; TLS files made for this session; the users ``SECURE_USERS`` (and
    ``admin``, the super user) with random passwords and no ACLs. Always started here, even when
    KAFKA_BOOTSTRAP_SERVERS names another broker."""
    root = tmp_path_factory.mktemp("secure-kafka")
    passwords = {user: secrets.token_urlsafe(12) for user in SECURE_USERS}
    security = kafka_local.BrokerSecurity(
        kafka_local.make_tls_files(root / "tls"), passwords, client_auth="required"
    )
    broker = kafka_local.LocalKafka(data_dir=root / "broker", security=security)
    broker.start()
    try:
        yield SecureKafka(broker, {**passwords, kafka_local.ADMIN_USER: security.admin_password})
    finally:
        broker.close()
