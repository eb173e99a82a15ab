"""The admin requests kafka_local makes (is the broker ready? create these topics), synchronous, over aiokafka.

Readiness is Metadata showing our cluster id and a registered broker; topic creation is CreateTopics
and then Metadata until every partition has a leader. aiokafka's ``AIOKafkaAdminClient`` speaks both,
over the same TLS and SASL the worker and the SDK use, so this package has no protocol code of its own.

Its callers are synchronous (the CLI, ``LocalKafka.start()``, test fixtures, the benchmarks), and some
of them run inside an event loop: an ``async def`` test that asks ``topic_factory`` for a topic. So
every public function here blocks, and ``run_sync`` decides where the coroutine runs.

aiokafka is imported inside the functions, so that ``resolve`` and ``--help`` work before it is installed.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import BrokerUnreachable, KafkaLocalError

if TYPE_CHECKING:
    from aiokafka.admin import AIOKafkaAdminClient

T = TypeVar("T")

CLIENT_ID = "kafka_local"
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


@dataclass(frozen=True)
class SaslLogin:
    """How kafka_local's own client logs in to a secured broker: TLS that checks the broker's certificate
    and host name against ``cafile`` (presenting a client certificate if given), then SASL ``mechanism``.

    PLAIN by default: the broker reads its PLAIN users from the JAAS entries written at every start, so
    it accepts whatever admin password this start wrote, while SCRAM credentials are fixed when the
    storage is formatted. TLS protects the password either way.
    """

    username: str
    password: str = field(repr=False)
    cafile: Path
    certfile: Path | None = None
    keyfile: Path | None = None
    mechanism: str = "PLAIN"

    def __post_init__(self) -> None:
        if self.mechanism not in SASL_MECHANISMS:
            raise KafkaLocalError(f"SASL mechanism {self.mechanism!r}: expected one of {', '.join(SASL_MECHANISMS)}")

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.cafile))
        if self.certfile is not None:
            context.load_cert_chain(self.certfile, self.keyfile)
        return context

    def client_options(self) -> dict[str, Any]:
        """aiokafka client keyword arguments (``AIOKafkaAdminClient``, ``create_conn``) for this login."""
        return {
            "security_protocol": "SASL_SSL",
            "ssl_context": self.ssl_context(),
            "sasl_mechanism": self.mechanism,
            "sasl_plain_username": self.username,
            "sasl_plain_password": self.password,
        }


@dataclass(frozen=True)
class TopicSpec:
    """A topic to create: name, partition count, and whether it is compacted (plus any other configs)."""

    name: str
    partitions: int = 1
    compact: bool = False
    configs: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> TopicSpec:
        """Parse the CLI form ``NAME:PARTITIONS[:compact]``."""
        parts = text.split(":")
        if len(parts) not in (2, 3) or not parts[1].isdigit() or (len(parts) == 3 and parts[2] != "compact"):
            raise ValueError(f"bad topic spec {text!r}: expected NAME:PARTITIONS[:compact]")
        return cls(name=parts[0], partitions=int(parts[1]), compact=len(parts) == 3)

    def all_configs(self) -> dict[str, str]:
        configs = dict(self.configs)
        if self.compact:
            configs["cleanup.policy"] = "compact"
        return configs


@dataclass(frozen=True)
class ClusterInfo:
    """What Metadata says about the cluster: its id and the ids of the registered brokers."""

    cluster_id: str | None
    brokers: list[int]


def run_sync(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run the coroutine ``make()`` returns to completion and return its result, from any thread.

    Without a running loop in this thread, ``asyncio.run``. With one (the caller is a coroutine, or a
    callback of that loop), the coroutine cannot run on that loop: blocking until it finishes would stop
    the very loop it needs. So it gets a private loop in a worker thread, and this thread waits. The
    caller's loop is blocked meanwhile, as by any blocking call; its other tasks resume after.
    ``make`` is called in the thread that runs the coroutine, so no coroutine is left un-awaited if
    that never happens.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kafka_local-admin") as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


def describe_cluster(bootstrap: str, timeout: float = 10.0, login: SaslLogin | None = None) -> ClusterInfo:
    """The cluster id and broker ids the broker at ``bootstrap`` reports (``timeout`` per request).

    Raises ``BrokerUnreachable`` while it cannot be reached or does not answer, and ``KafkaLocalError``
    if it refuses the certificate or the login.
    """
    return run_sync(partial(_with_admin, bootstrap, login, timeout, _describe_cluster))


def create_topics(
    bootstrap: str, topics: Iterable[TopicSpec], timeout: float = 30.0, login: SaslLogin | None = None
) -> None:
    """Create topics (replication factor 1) and wait until every partition has a leader; ``login`` for a
    secured broker (the admin, or a user allowed to create them).

    Idempotent: a topic that already exists is fine, as long as it has the requested partition count
    (its configs are not compared).
    """
    specs = list(topics)
    if not specs:
        return
    run_sync(partial(_with_admin, bootstrap, login, timeout, partial(_create_topics, specs=specs, timeout=timeout)))


def _addresses(bootstrap: str) -> list[tuple[str, int]]:
    addresses = []
    for item in bootstrap.split(","):
        host, _, port = item.strip().rpartition(":")
        addresses.append((host or "127.0.0.1", int(port)))
    return addresses


async def _check_login(bootstrap: str, login: SaslLogin | None, timeout: float) -> None:
    """Open one connection the way aiokafka's clients do (TCP, TLS, ApiVersions, SASL), then close it.

    ``AIOKafkaAdminClient.start()`` only logs why it could not connect, an ERROR line per attempt, and
    raises "Unable to bootstrap". Connecting first says why, tells a refused certificate or login
    (``KafkaLocalError``: waiting will not help) from a broker that is not up yet
    (``BrokerUnreachable``), and keeps a readiness poll from logging an error every 100 ms. The cost
    is one more connection per call.
    """
    from aiokafka.conn import create_conn
    from aiokafka.errors import (
        AuthenticationFailedError,
        AuthenticationMethodNotSupported,
        IllegalSaslStateError,
        KafkaError,
        SaslAuthenticationFailed,
        UnsupportedSaslMechanismError,
    )

    refused_logins = (
        AuthenticationFailedError,
        AuthenticationMethodNotSupported,
        IllegalSaslStateError,
        SaslAuthenticationFailed,
        UnsupportedSaslMechanismError,
    )
    options = login.client_options() if login is not None else {}
    errors = []
    for host, port in _addresses(bootstrap):
        try:
            conn = await create_conn(
                host, port, client_id=CLIENT_ID, request_timeout_ms=int(timeout * 1000), **options
            )
        except ssl.SSLCertVerificationError as exc:
            assert login is not None  # only TLS raises it
            # Not worth retrying: the certificate will not change while we wait.
            raise KafkaLocalError(
                f"{host}:{port}: TLS refused the broker's certificate: {exc.verify_message} "
                f"(check the CA file {login.cafile} and that the certificate names {host})"
            ) from exc
        except refused_logins as exc:
            assert login is not None  # only SASL raises these
            raise KafkaLocalError(
                f"{host}:{port}: SASL {login.mechanism} login as {login.username!r} refused: {exc}"
            ) from exc
        except (OSError, KafkaError) as exc:  # OSError includes TimeoutError
            errors.append(f"{host}:{port}: {str(exc) or type(exc).__name__}")
            continue
        await conn.close()
        return
    raise BrokerUnreachable(f"cannot reach a broker at {bootstrap}: {'; '.join(errors)}")


async def _with_admin(
    bootstrap: str,
    login: SaslLogin | None,
    timeout: float,
    operation: Callable[[AIOKafkaAdminClient], Awaitable[T]],
) -> T:
    """Run ``operation`` with an admin client started against ``bootstrap``, each request bounded by
    ``timeout``; aiokafka's errors become ``BrokerUnreachable`` (retriable) or ``KafkaLocalError``."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import KafkaError

    await _check_login(bootstrap, login, timeout)
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap,
        client_id=CLIENT_ID,
        request_timeout_ms=int(timeout * 1000),
        **(login.client_options() if login is not None else {}),
    )
    try:
        await admin.start()
        return await operation(admin)
    except TimeoutError as exc:
        raise BrokerUnreachable(f"{bootstrap}: no answer within {timeout:g}s") from exc
    except KafkaError as exc:
        error = BrokerUnreachable if exc.retriable else KafkaLocalError
        raise error(f"{bootstrap}: {type(exc).__name__}: {exc}") from exc
    finally:
        await admin.close()


async def _describe_cluster(admin: AIOKafkaAdminClient) -> ClusterInfo:
    metadata = await admin.describe_cluster()
    return ClusterInfo(metadata["cluster_id"], [broker["node_id"] for broker in metadata["brokers"]])


async def _create_topics(admin: AIOKafkaAdminClient, specs: list[TopicSpec], timeout: float) -> None:
    from aiokafka.admin import NewTopic
    from aiokafka.errors import NotControllerError, RequestTimedOutError, TopicAlreadyExistsError, for_code

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    # Errors a CreateTopics may return while a fresh controller settles; worth a retry.
    settling = {RequestTimedOutError.errno, NotControllerError.errno}
    pending = {spec.name: spec for spec in specs}
    while pending:
        response = await admin.create_topics(
            [NewTopic(s.name, s.partitions, 1, topic_configs=s.all_configs()) for s in pending.values()],
            timeout_ms=max(1, int((deadline - loop.time()) * 1000)),
        )
        retry = False
        for result in response.to_object()["topic_errors"]:
            name, code, message = result["topic"], result["error_code"], result.get("error_message")
            if code in (0, TopicAlreadyExistsError.errno):
                pending.pop(name, None)
            elif code in settling and loop.time() < deadline:
                retry = True
            else:
                raise KafkaLocalError(
                    f"creating topic {name!r} failed: {for_code(code).__name__} (error {code})"
                    + (f": {message}" if message else "")
                )
        if pending and not retry:
            raise KafkaLocalError(f"CreateTopics did not answer for {sorted(pending)}")
        if retry:
            await asyncio.sleep(0.1)
    await _wait_for_leaders(admin, specs, deadline)


async def _wait_for_leaders(admin: AIOKafkaAdminClient, specs: list[TopicSpec], deadline: float) -> None:
    loop = asyncio.get_running_loop()
    wanted = {spec.name: spec.partitions for spec in specs}
    while True:
        # topic -> (error code, leader id of each partition in partition order); -1: not in the answer
        topics: dict[str, tuple[int, list[int]]] = {
            t["topic"]: (t["error_code"], [p["leader"] for p in sorted(t["partitions"], key=lambda p: p["partition"])])
            for t in await admin.describe_topics(list(wanted))
        }
        ready = True
        for name, partitions in wanted.items():
            error, leaders = topics.get(name, (-1, []))
            if error == 0 and leaders and len(leaders) != partitions:
                raise KafkaLocalError(f"topic {name!r} exists with {len(leaders)} partitions, wanted {partitions}")
            ready = ready and error == 0 and len(leaders) == partitions and min(leaders) >= 0
        if ready:
            return
        if loop.time() > deadline:
            raise KafkaLocalError(f"topics {sorted(wanted)} have no leaders yet: {topics}")
        await asyncio.sleep(0.05)
