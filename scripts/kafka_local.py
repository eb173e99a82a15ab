#!/usr/bin/env python3
"""A single-node Apache Kafka (KRaft) broker for development, tests and CI, without Docker.

loopwarden's worker runs on faust + aiokafka against real Kafka, and the only things this machine (and CI)
can reach are package registries. So the broker comes from the ``org.apache.kafka:kafka_2.13`` jars on
Maven Central: Maven resolves them once into a cache, and a JVM runs ``kafka.Kafka`` in combined
broker+controller mode on loopback ports.

Readiness is checked with hand-written Kafka protocol requests (ApiVersions, then Metadata showing our
cluster id and a registered broker), and topics are created with CreateTopics over the same tiny client,
so this file needs nothing but the standard library, Java and Maven.

A secured broker (``BrokerSecurity``; ``start --secure``) has a SASL_SSL listener with SCRAM-SHA-512
and PLAIN users, and ACLs enforced by the StandardAuthorizer. Its TLS files are made with the
``cryptography`` package (``make_tls_files``), the only thing beyond the standard library; ACLs are
added with Kafka's own ``kafka-acls`` (AclCommand) run from the same jars. See docs/security.md.

Used two ways:

* as a CLI (see ``--help``)::

      python scripts/kafka_local.py resolve                    # fetch the jars only (CI warm-up)
      export $(python scripts/kafka_local.py start)            # KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:PORT
      python scripts/kafka_local.py create-topics events:3 state:3:compact
      python scripts/kafka_local.py status                     # exit 0 while it runs
      python scripts/kafka_local.py stop
      export $(python scripts/kafka_local.py start --secure --user worker=w0rker-pw --user runtime=runt1me-pw)
      python scripts/kafka_local.py acls --worker worker --runtime runtime --create-topics 8

* imported by the integration tests: ``LocalKafka`` is a context manager that starts a broker, can stop,
  kill and restart it on the same data dir and port, and creates topics.

Environment: ``KAFKA_VERSION`` (default 3.9.1), ``LOOPWARDEN_CACHE`` (default ``<repo>/.cache``),
``KAFKA_START_TIMEOUT`` seconds (default 90).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import fcntl
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VERSION = "3.9.1"
DEFAULT_START_TIMEOUT = 90.0
STOP_TIMEOUT = 30.0
LOG_TAIL_LINES = 40
# Pinned so that `mvn dependency:copy-dependencies` does not depend on whatever the newest plugin is.
DEPENDENCY_PLUGIN_VERSION = "3.8.1"


class KafkaLocalError(RuntimeError):
    """Resolving, starting, stopping or talking to the local broker failed."""


class BrokerStartError(KafkaLocalError):
    """The broker did not become ready; the message ends with the tail of its logs."""


# --------------------------------------------------------------------------------------------------
# Versions, cache and jar resolution


@dataclass(frozen=True)
class _Logging:
    """How one Kafka major version logs: Maven artifacts, the JVM flag and a config file."""

    artifacts: tuple[tuple[str, str, str], ...]
    jvm_flag: str
    file_name: str
    config: str


# Kafka 3.x logs through slf4j 1.7 + reload4j (log4j 1.x syntax).
_LOGGING_3 = _Logging(
    artifacts=(
        ("org.slf4j", "slf4j-api", "1.7.36"),
        ("org.slf4j", "slf4j-reload4j", "1.7.36"),
        ("ch.qos.reload4j", "reload4j", "1.2.25"),
    ),
    jvm_flag="-Dlog4j.configuration=file:{path}",
    file_name="log4j.properties",
    config="""\
# Quiet: warnings and errors, plus the few INFO lines that show startup and shutdown.
log4j.rootLogger=WARN, file
log4j.appender.file=org.apache.log4j.FileAppender
log4j.appender.file.File={log}
log4j.appender.file.Append=true
log4j.appender.file.layout=org.apache.log4j.PatternLayout
log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka.server.KafkaRaftServer=INFO
log4j.logger.kafka.server.BrokerServer=INFO
log4j.logger.kafka.server.ControllerServer=INFO
""",
)

# Kafka 4.x logs through log4j2.
_LOGGING_4 = _Logging(
    artifacts=(
        ("org.slf4j", "slf4j-api", "2.0.17"),
        ("org.apache.logging.log4j", "log4j-core", "2.24.3"),
        ("org.apache.logging.log4j", "log4j-slf4j2-impl", "2.24.3"),
    ),
    jvm_flag="-Dlog4j2.configurationFile={path}",
    file_name="log4j2.properties",
    config="""\
# Quiet: warnings and errors, plus the few INFO lines that show startup and shutdown.
status = warn
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.append = true
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.file.ref = FILE
logger.raft.name = kafka.server.KafkaRaftServer
logger.raft.level = INFO
logger.broker.name = kafka.server.BrokerServer
logger.broker.level = INFO
logger.controller.name = kafka.server.ControllerServer
logger.controller.level = INFO
""",
)


def _logging_for(version: str) -> _Logging:
    major = int(version.split(".", 1)[0])
    return _LOGGING_3 if major < 4 else _LOGGING_4


def kafka_version(version: str | None = None) -> str:
    """The Kafka version to use: the argument, else ``$KAFKA_VERSION``, else the default."""
    return version or os.environ.get("KAFKA_VERSION") or DEFAULT_VERSION


def cache_dir(cache: Path | None = None) -> Path:
    """The cache root: the argument, else ``$LOOPWARDEN_CACHE``, else ``<repo>/.cache``."""
    if cache is not None:
        return cache
    env = os.environ.get("LOOPWARDEN_CACHE")
    return Path(env) if env else REPO / ".cache"


def _pom(version: str) -> str:
    deps = [("org.apache.kafka", "kafka_2.13", version), *_logging_for(version).artifacts]
    dep_xml = "\n".join(
        f"    <dependency><groupId>{g}</groupId><artifactId>{a}</artifactId><version>{v}</version></dependency>"
        for g, a, v in deps
    )
    return f"""\
<?xml version="1.0" encoding="UTF-8"?>
<!-- Written by scripts/kafka_local.py: only used to resolve the broker's runtime classpath. -->
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.loopwarden</groupId>
  <artifactId>kafka-broker-classpath</artifactId>
  <version>{version}</version>
  <packaging>pom</packaging>
  <dependencies>
{dep_xml}
  </dependencies>
  <build>
    <plugins>
      <plugin>
        <groupId>org.apache.maven.plugins</groupId>
        <artifactId>maven-dependency-plugin</artifactId>
        <version>{DEPENDENCY_PLUGIN_VERSION}</version>
      </plugin>
    </plugins>
  </build>
</project>
"""


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def resolve(version: str | None = None, cache: Path | None = None) -> Path:
    """Make sure the broker's jars are in the cache and return the ``libs`` directory.

    Runs Maven once per version (a lock keeps concurrent callers from racing); a marker file written
    after success makes later calls free.
    """
    version = kafka_version(version)
    root = cache_dir(cache)
    home = root / f"kafka-{version}"
    libs = home / "libs"
    marker = home / "resolved.ok"
    if marker.exists():
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaLocalError("Maven (mvn) is not on PATH; it is needed once to fetch the Kafka jars")
    with _file_lock(home / ".lock"):
        if marker.exists():
            return libs
        shutil.rmtree(libs, ignore_errors=True)
        (home / "pom.xml").write_text(_pom(version))
        print(
            f"kafka_local: resolving Kafka {version} jars from Maven Central into {libs} "
            "(first run only, takes a while)...",
            file=sys.stderr,
            flush=True,
        )
        began = time.monotonic()
        result = subprocess.run(
            [
                mvn,
                "-B",
                "-q",
                "-f",
                str(home / "pom.xml"),
                "dependency:copy-dependencies",
                "-DincludeScope=runtime",
                f"-DoutputDirectory={libs}",
                f"-Dmaven.repo.local={root / 'm2'}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            tail = "\n".join(result.stdout.splitlines()[-LOG_TAIL_LINES:])
            raise KafkaLocalError(
                f"Maven could not resolve Kafka {version} (exit {result.returncode}):\n{tail}"
            )
        jars = len(list(libs.glob("*.jar")))
        marker.write_text(f"kafka {version}: {jars} jars\n")
        print(
            f"kafka_local: resolved {jars} jars in {time.monotonic() - began:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    return libs


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return str(Path(java_home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise KafkaLocalError("java is not on PATH and JAVA_HOME is not set; Kafka needs Java 17+")
    return java


# --------------------------------------------------------------------------------------------------
# A minimal Kafka protocol client: ApiVersions v0, Metadata v2, CreateTopics v2, and on a secured
# broker SaslHandshake v1 and SaslAuthenticate v0 (PLAIN, over TLS).
# All exist in Kafka 3.9 and 4.x (KIP-896 kept them), and none is a "flexible" version, so the
# encoding is the classic one: big-endian ints, int16-length strings, int32-length arrays.

_API_METADATA = 3
_API_SASL_HANDSHAKE = 17
_API_API_VERSIONS = 18
_API_CREATE_TOPICS = 19
_API_SASL_AUTHENTICATE = 36
_METADATA_VERSION = 2
_CREATE_TOPICS_VERSION = 2
_TOPIC_ALREADY_EXISTS = 36
# Errors a CreateTopics may return while a fresh controller settles; worth a retry.
_RETRIABLE_ERRORS = {7: "REQUEST_TIMED_OUT", 41: "NOT_CONTROLLER"}


def _string(value: str | None) -> bytes:
    if value is None:
        return struct.pack(">h", -1)
    raw = value.encode()
    return struct.pack(">h", len(raw)) + raw


class _Reader:
    """Sequential decoder for a response body."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def _take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self._data, self._pos)
        self._pos += struct.calcsize(fmt)
        return int(value)

    def int8(self) -> int:
        return self._take(">b")

    def int16(self) -> int:
        return self._take(">h")

    def int32(self) -> int:
        return self._take(">i")

    def string(self) -> str | None:
        length = self.int16()
        if length < 0:
            return None
        raw = self._data[self._pos : self._pos + length]
        self._pos += length
        return raw.decode()

    def count(self) -> int:
        return max(self.int32(), 0)


def _parse_bootstrap(bootstrap: str) -> list[tuple[str, int]]:
    addresses = []
    for item in bootstrap.split(","):
        host, _, port = item.strip().rpartition(":")
        addresses.append((host or "127.0.0.1", int(port)))
    return addresses


@dataclass(frozen=True)
class SaslLogin:
    """How this script's own client logs in to a secured broker: TLS that checks the broker's
    certificate and host name against ``cafile`` (presenting a client certificate if given), then
    SASL PLAIN. PLAIN rather than SCRAM keeps the client small; TLS protects the password."""

    username: str
    password: str = field(repr=False)
    cafile: Path
    certfile: Path | None = None
    keyfile: Path | None = None

    def wrap(self, sock: socket.socket, host: str) -> ssl.SSLSocket:
        context = ssl.create_default_context(cafile=str(self.cafile))
        if self.certfile is not None:
            context.load_cert_chain(self.certfile, self.keyfile)
        return context.wrap_socket(sock, server_hostname=host)


class _Connection:
    """One TCP connection to a broker, sending requests one at a time; with a ``login``, over TLS
    and authenticated before the first request."""

    def __init__(self, bootstrap: str, timeout: float, login: SaslLogin | None = None) -> None:
        errors = []
        for host, port in _parse_bootstrap(bootstrap):
            try:
                sock = socket.create_connection((host, port), timeout=timeout)
            except OSError as exc:
                errors.append(f"{host}:{port}: {exc}")
                continue
            try:
                self._sock = sock if login is None else login.wrap(sock, host)
            except ssl.SSLCertVerificationError as exc:
                sock.close()
                # Not worth retrying: the certificate will not change while we wait.
                raise KafkaLocalError(
                    f"{host}:{port}: TLS refused the broker's certificate: {exc.verify_message}"
                ) from exc
            except OSError:
                sock.close()
                raise
            break
        else:
            raise OSError("; ".join(errors))
        self._correlation_id = 0
        if login is not None:
            try:
                self._sasl_plain(login)
            except BaseException:
                self._sock.close()
                raise

    def _sasl_plain(self, login: SaslLogin) -> None:
        reply = self.request(_API_SASL_HANDSHAKE, 1, _string("PLAIN"))
        error = reply.int16()
        offered = [reply.string() for _ in range(reply.count())]
        if error:
            raise KafkaLocalError(f"the broker does not accept SASL PLAIN (error {error}; it offers {offered})")
        token = b"\0" + login.username.encode() + b"\0" + login.password.encode()
        reply = self.request(_API_SASL_AUTHENTICATE, 0, struct.pack(">i", len(token)) + token)
        error, message = reply.int16(), reply.string()
        if error:
            raise KafkaLocalError(f"SASL PLAIN login as {login.username!r} refused (error {error}): {message}")

    def __enter__(self) -> _Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close()

    def request(self, api_key: int, api_version: int, body: bytes) -> _Reader:
        self._correlation_id += 1
        header = struct.pack(">hhi", api_key, api_version, self._correlation_id) + _string("kafka_local")
        payload = header + body
        self._sock.sendall(struct.pack(">i", len(payload)) + payload)
        (size,) = struct.unpack(">i", self._recv(4))
        response = _Reader(self._recv(size))
        if response.int32() != self._correlation_id:
            raise OSError("Kafka response with an unexpected correlation id")
        return response

    def _recv(self, size: int) -> bytes:
        chunks = bytearray()
        while len(chunks) < size:
            chunk = self._sock.recv(size - len(chunks))
            if not chunk:
                raise OSError("connection closed by the broker")
            chunks += chunk
        return bytes(chunks)


def _api_versions(conn: _Connection) -> dict[int, tuple[int, int]]:
    reply = conn.request(_API_API_VERSIONS, 0, b"")
    error = reply.int16()
    if error:
        raise OSError(f"ApiVersions failed with error code {error}")
    versions = {}
    for _ in range(reply.count()):
        key, low, high = reply.int16(), reply.int16(), reply.int16()
        versions[key] = (low, high)
    return versions


@dataclass
class _Metadata:
    cluster_id: str | None
    brokers: list[int]
    # topic -> (error code, leader id of each partition in partition order)
    topics: dict[str, tuple[int, list[int]]]


def _metadata(conn: _Connection, topics: list[str] | None) -> _Metadata:
    if topics is None:
        body = struct.pack(">i", -1)
    else:
        body = struct.pack(">i", len(topics)) + b"".join(_string(t) for t in topics)
    reply = conn.request(_API_METADATA, _METADATA_VERSION, body)
    brokers = []
    for _ in range(reply.count()):
        brokers.append(reply.int32())
        reply.string()  # host
        reply.int32()  # port
        reply.string()  # rack
    cluster_id = reply.string()
    reply.int32()  # controller id
    result: dict[str, tuple[int, list[int]]] = {}
    for _ in range(reply.count()):
        error = reply.int16()
        name = reply.string() or ""
        reply.int8()  # is_internal
        leaders: dict[int, int] = {}
        for _ in range(reply.count()):
            reply.int16()  # partition error
            index, leader = reply.int32(), reply.int32()
            for _ in range(2):  # replicas, isr
                for _ in range(reply.count()):
                    reply.int32()
            leaders[index] = leader
        result[name] = (error, [leaders[i] for i in sorted(leaders)])
    return _Metadata(cluster_id=cluster_id, brokers=brokers, topics=result)


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


def create_topics(
    bootstrap: str, topics: Iterable[TopicSpec], timeout: float = 30.0, login: SaslLogin | None = None
) -> None:
    """Create topics (replication factor 1) and wait until every partition has a leader; ``login`` for a
    secured broker (the admin, or a user allowed to create them).

    Idempotent: a topic that already exists is fine, as long as it has the requested partition count.
    """
    specs = list(topics)
    if not specs:
        return
    deadline = time.monotonic() + timeout
    body = struct.pack(">i", len(specs))
    for spec in specs:
        configs = spec.all_configs()
        body += _string(spec.name) + struct.pack(">ihi", spec.partitions, 1, 0)
        body += struct.pack(">i", len(configs)) + b"".join(
            _string(k) + _string(v) for k, v in configs.items()
        )
    body += struct.pack(">ib", int(timeout * 1000), 0)
    pending = {spec.name for spec in specs}
    with _Connection(bootstrap, timeout, login) as conn:
        while pending:
            reply = conn.request(_API_CREATE_TOPICS, _CREATE_TOPICS_VERSION, body)
            reply.int32()  # throttle time
            retry = False
            for _ in range(reply.count()):
                name, error, message = reply.string() or "", reply.int16(), reply.string()
                if error in (0, _TOPIC_ALREADY_EXISTS):
                    pending.discard(name)
                elif error in _RETRIABLE_ERRORS and time.monotonic() < deadline:
                    retry = True
                else:
                    raise KafkaLocalError(
                        f"creating topic {name!r} failed: error {error} {message or ''}".rstrip()
                    )
            if pending and not retry:
                raise KafkaLocalError(f"CreateTopics did not answer for {sorted(pending)}")
            if retry:
                time.sleep(0.1)
        _wait_for_leaders(conn, specs, deadline)


def _wait_for_leaders(conn: _Connection, specs: list[TopicSpec], deadline: float) -> None:
    wanted = {spec.name: spec.partitions for spec in specs}
    while True:
        topics = _metadata(conn, list(wanted)).topics
        ready = True
        for name, partitions in wanted.items():
            error, leaders = topics.get(name, (-1, []))
            if error == 0 and leaders and len(leaders) != partitions:
                raise KafkaLocalError(
                    f"topic {name!r} exists with {len(leaders)} partitions, wanted {partitions}"
                )
            ready = ready and error == 0 and len(leaders) == partitions and min(leaders) >= 0
        if ready:
            return
        if time.monotonic() > deadline:
            raise KafkaLocalError(f"topics {sorted(wanted)} have no leaders yet: {topics}")
        time.sleep(0.05)


# --------------------------------------------------------------------------------------------------
# A secured broker: TLS material, SASL users, ACLs

ADMIN_USER = "admin"
_PLAIN_LOGIN = "org.apache.kafka.common.security.plain.PlainLoginModule"
_SCRAM_LOGIN = "org.apache.kafka.common.security.scram.ScramLoginModule"
_STANDARD_AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
# User names and passwords go into JAAS strings and `--add-scram name=...,password=...` unquoted.
_CREDENTIAL = re.compile(r"[A-Za-z0-9._~-]+")
# A short-lived JVM tool: the C1 compiler and the serial GC halve its ~2 s start.
_TOOL_JVM_FLAGS = ("-Xmx256m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")


def _write_private(path: Path, data: str) -> None:
    """Write a file only its owner can read: it holds a private key or a password."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(data)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS listener: the CA, the broker's certificate chain and key, and one client
    certificate chain and key for mutual TLS. Keys are unencrypted PKCS#8, which Kafka's PEM key store
    reads without ``ssl.key.password``."""

    ca: Path
    broker_cert: Path
    broker_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def in_directory(cls, directory: Path) -> TlsFiles:
        """The files ``make_tls_files(directory)`` writes."""
        return cls(
            ca=directory / "ca.pem",
            broker_cert=directory / "broker.pem",
            broker_key=directory / "broker.key",
            client_cert=directory / "client.pem",
            client_key=directory / "client.key",
        )


def make_tls_files(directory: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"), days: int = 30) -> TlsFiles:
    """A new CA, and a broker and a client certificate it signs (EC P-256, ``days`` valid), written to
    ``directory``. ``hosts`` (IP addresses or DNS names) are the broker certificate's subject alternative
    names, which clients that check host names compare with the address they connect to."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as exc:
        raise KafkaLocalError(
            "a TLS broker needs the cryptography package (in loopwarden's kafka and worker extras)"
        ) from exc

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "loopwarden local CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def issue(name: str, usages: list[x509.ObjectIdentifier], sans: list[x509.GeneralName]) -> tuple[str, str]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode()
        return key_pem, cert.public_bytes(serialization.Encoding.PEM).decode() + ca_pem

    def san(host: str) -> x509.GeneralName:
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            return x509.DNSName(host)

    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM).decode()
    # The broker is also a TLS client (of itself, between listeners), hence clientAuth.
    broker = issue("loopwarden local broker", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                   [san(host) for host in hosts])
    client = issue("loopwarden local client", [ExtendedKeyUsageOID.CLIENT_AUTH], [])
    files = TlsFiles.in_directory(directory)
    files.ca.write_text(ca_pem)
    for (key_pem, chain_pem), cert_path, key_path in (
        (broker, files.broker_cert, files.broker_key),
        (client, files.client_cert, files.client_key),
    ):
        cert_path.write_text(chain_pem)
        _write_private(key_path, key_pem)
    return files


@dataclass(frozen=True)
class BrokerSecurity:
    """What makes a ``LocalKafka`` secured: its client listener is SASL_SSL, with SCRAM-SHA-512 and PLAIN.

    Every user in ``users`` (name -> password), and ``admin``, the one super user (this script and Kafka's
    tools log in as it), can log in with either mechanism: SCRAM credentials are added when the storage
    is formatted, so they are fixed from a data dir's first start on; PLAIN users are JAAS
    ``user_<name>`` entries, read at every start. ``client_auth`` is ``ssl.client.auth`` (``required``
    for mutual TLS: clients then also present a certificate the CA signed; set on the listener, as
    the broker-wide setting does not apply to SASL_SSL). With ``acls`` the
    StandardAuthorizer denies every request that no ACL allows.
    """

    tls: TlsFiles
    users: Mapping[str, str] = field(default_factory=dict, repr=False)
    admin_password: str = field(default_factory=lambda: secrets.token_urlsafe(18), repr=False)
    client_auth: str = "none"
    acls: bool = True

    def __post_init__(self) -> None:
        if ADMIN_USER in self.users:
            raise KafkaLocalError(f"user {ADMIN_USER!r} is reserved for the super user; set admin_password")
        for name, password in self.all_users().items():
            if not (_CREDENTIAL.fullmatch(name) and _CREDENTIAL.fullmatch(password)):
                raise KafkaLocalError(
                    f"user {name!r}: names and passwords may only use letters, digits and ._~-"
                )
        if self.client_auth not in ("none", "requested", "required"):
            raise KafkaLocalError(f"client_auth {self.client_auth!r}: expected none, requested or required")

    def all_users(self) -> dict[str, str]:
        return {ADMIN_USER: self.admin_password, **self.users}

    def admin_login(self) -> SaslLogin:
        return SaslLogin(ADMIN_USER, self.admin_password, self.tls.ca, self.tls.client_cert, self.tls.client_key)

    def format_args(self) -> list[str]:
        """StorageTool ``format`` options that create the SCRAM-SHA-512 credentials."""
        return [
            arg
            for name, password in self.all_users().items()
            for arg in ("--add-scram", f"SCRAM-SHA-512=[name={name},password={password}]")
        ]

    def server_properties(self, port: int, controller_port: int, keystore: Path) -> dict[str, str]:
        """Listener, SASL, TLS and authorizer settings; ``keystore`` holds the broker's key and chain.

        The controller listener carries only this node's own KRaft traffic, on loopback: SASL PLAIN as
        ``admin`` without TLS (SCRAM cannot be used there, its credentials live in the metadata the
        controller serves). Between listeners the broker is a client of itself as ``admin`` too.
        """
        admin = f'username="{ADMIN_USER}" password="{self.admin_password}"'
        plain_users = " ".join(f'user_{name}="{password}"' for name, password in self.all_users().items())
        properties = {
            "listeners": f"SASL_SSL://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            "advertised.listeners": f"SASL_SSL://127.0.0.1:{port}",
            "listener.security.protocol.map": "CONTROLLER:SASL_PLAINTEXT,SASL_SSL:SASL_SSL",
            "inter.broker.listener.name": "SASL_SSL",
            "sasl.enabled.mechanisms": "SCRAM-SHA-512,PLAIN",
            "sasl.mechanism.inter.broker.protocol": "PLAIN",
            "listener.name.sasl_ssl.plain.sasl.jaas.config": f"{_PLAIN_LOGIN} required {admin} {plain_users};",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": f"{_SCRAM_LOGIN} required;",
            "sasl.mechanism.controller.protocol": "PLAIN",
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config": (
                f'{_PLAIN_LOGIN} required {admin} user_{ADMIN_USER}="{self.admin_password}";'
            ),
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(keystore),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(self.tls.ca),
            # Only the listener's own setting applies to a SASL_SSL listener (KIP-684); the broker-wide
            # ssl.client.auth is ignored there.
            "listener.name.sasl_ssl.ssl.client.auth": self.client_auth,
            "super.users": f"User:{ADMIN_USER}",
        }
        if self.acls:
            properties["authorizer.class.name"] = _STANDARD_AUTHORIZER
        return properties

    def admin_client_properties(self, keystore: Path) -> str:
        """A ``--command-config`` file for Kafka's tools (kafka-acls, kafka-topics, ...) as ``admin``,
        over SCRAM-SHA-512; ``keystore`` holds the client key and chain."""
        return "\n".join([
            "# Written by scripts/kafka_local.py: Kafka's tools as the super user (--command-config).",
            "security.protocol=SASL_SSL",
            "sasl.mechanism=SCRAM-SHA-512",
            f'sasl.jaas.config={_SCRAM_LOGIN} required username="{ADMIN_USER}" password="{self.admin_password}";',
            "ssl.truststore.type=PEM",
            f"ssl.truststore.location={self.tls.ca}",
            "ssl.keystore.type=PEM",
            f"ssl.keystore.location={keystore}",
            "",
        ])


@dataclass(frozen=True)
class LoopwardenAcls:
    """The ACLs loopwarden needs on a cluster with an authorizer, as ``kafka-acls`` arguments (one list
    per command). docs/security.md shows them for the default names; the integration tests apply them.

    The worker reads telemetry and writes it too (it re-publishes misrouted events keyed by run id),
    writes control, alerts and the DLQ, reads and writes its table's changelog, joins its consumer
    group (the app id), and may create those five topics: Faust declares its topics at start-up with a
    CreateTopics request, which Kafka authorizes before it looks whether the topic exists, so Create is
    needed even when an admin created them (``topic_specs``). Runtimes write telemetry
    and read control (without a group: each runtime reads every partition). Notifiers read alerts in
    their group. Operators write telemetry (``loopwarden halt|resume`` sends signed overrides there)
    and read control, alerts and the DLQ. Nothing else is allowed to anyone.
    """

    worker: str
    runtimes: Sequence[str]
    notify: Sequence[str] = ()
    operators: Sequence[str] = ()
    app_id: str = "loopwarden"
    telemetry_topic: str = "agent.telemetry"
    control_topic: str = "agent.control"
    alerts_topic: str = "agent.alerts"
    dlq_topic: str = "agent.telemetry.dlq"
    notify_group: str = "loopwarden-notify"

    @property
    def changelog_topic(self) -> str:
        """Faust's changelog of the worker's ``runs`` table."""
        return f"{self.app_id}-runs-changelog"

    def topic_specs(self, partitions: int) -> list[TopicSpec]:
        """The topics as the worker would create them (every one with ``partitions`` partitions)."""
        return [
            TopicSpec(self.telemetry_topic, partitions),
            TopicSpec(self.control_topic, partitions),
            TopicSpec(self.alerts_topic, partitions),
            TopicSpec(self.dlq_topic, partitions),
            TopicSpec(self.changelog_topic, partitions, compact=True),
        ]

    def commands(self) -> list[list[str]]:
        def allow(principals: Iterable[str], operations: Iterable[str], **resources: Iterable[str]) -> list[str]:
            return [
                *(arg for p in principals for arg in ("--allow-principal", f"User:{p}")),
                *(arg for op in operations for arg in ("--operation", op)),
                *(arg for kind, names in resources.items() for name in names for arg in (f"--{kind}", name)),
            ]

        # Kafka's tool starts a JVM per command (seconds each), so each role gets one command per
        # operation: Read applies to topics and groups alike.
        worker = [self.worker]
        commands = [
            allow(worker, ["Read"], topic=[self.telemetry_topic, self.changelog_topic], group=[self.app_id]),
            allow(worker, ["Write", "Create"], topic=[self.telemetry_topic, self.changelog_topic,
                                                      self.control_topic, self.alerts_topic, self.dlq_topic]),
            allow(self.runtimes, ["Write"], topic=[self.telemetry_topic]),
            allow(self.runtimes, ["Read"], topic=[self.control_topic]),
        ]
        if self.notify:
            commands.append(allow(self.notify, ["Read"], topic=[self.alerts_topic], group=[self.notify_group]))
        if self.operators:
            commands += [
                allow(self.operators, ["Write"], topic=[self.telemetry_topic]),
                allow(self.operators, ["Read"], topic=[self.control_topic, self.alerts_topic, self.dlq_topic]),
            ]
        return commands


def acl_command_line(args: Sequence[str], bootstrap: str = "$KAFKA", command_config: str = "admin.properties") -> str:
    """One ``kafka-acls.sh --add`` command line, as an operator types it."""
    return f"kafka-acls.sh --bootstrap-server {bootstrap} --command-config {command_config} --add {shlex.join(args)}"


def add_acls(
    bootstrap: str,
    command_config: Path,
    commands: Sequence[Sequence[str]],
    version: str | None = None,
    cache: Path | None = None,
    timeout: float = 120.0,
) -> None:
    """Add ACLs with Kafka's own ``kafka-acls`` (AclCommand, run from the broker's jars), a JVM per
    command, a few at a time; ``command_config`` logs it in. Raises KafkaLocalError with the tool's
    output if a command fails."""
    version = kafka_version(version)
    if int(version.split(".", 1)[0]) >= 4:
        raise KafkaLocalError(
            f"Kafka {version} ships AclCommand in kafka-tools, which this script does not fetch; use Kafka 3.9"
        )
    classpath, java = f"{resolve(version, cache)}/*", _java()

    def run(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [java, *_TOOL_JVM_FLAGS, "-cp", classpath, "kafka.admin.AclCommand", "--bootstrap-server",
             bootstrap, "--command-config", str(command_config), "--add", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )

    # Each JVM is mostly start-up CPU: three at a time keep two cores busy without thrashing.
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(run, commands))
    for args, result in zip(commands, results, strict=True):
        if result.returncode != 0:
            output = "\n".join(result.stdout.strip().splitlines()[-LOG_TAIL_LINES:])
            raise KafkaLocalError(
                f"kafka-acls --add {shlex.join(args)} failed (exit {result.returncode}):\n{output}"
            )


# --------------------------------------------------------------------------------------------------
# The broker process


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _random_cluster_id() -> str:
    """A Kafka Uuid as ``StorageTool random-uuid`` prints it (16 random bytes in URL-safe base64).

    Made here to save a JVM launch (~1 s) per fresh broker.
    """
    while True:
        text = base64.urlsafe_b64encode(os.urandom(16)).rstrip(b"=").decode()
        if not text.startswith("-"):
            return text


def _escape_property(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log file)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"


def _pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _is_our_broker(pid: int, properties: Path) -> bool:
    """Guard against pid reuse: the process must be kafka.Kafka running our properties file."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return False
    return b"kafka.Kafka" in cmdline and str(properties).encode() in cmdline


def _stop_pid(pid: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL (``timeout=0`` kills at once)."""

    def wait(seconds: float) -> bool:
        if proc is not None:
            try:
                proc.wait(seconds)
                return True
            except subprocess.TimeoutExpired:
                return False
        deadline = time.monotonic() + seconds
        while _pid_alive(pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    if timeout > 0:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if wait(timeout):
            return
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    wait(10.0)


class LocalKafka:
    """A single-node KRaft broker (combined broker+controller) on 127.0.0.1.

    ``data_dir`` keeps the properties, the formatted storage and the logs. Starting again on the same
    ``data_dir`` reuses its storage and, unless ``port`` says otherwise, its ports; with no ``data_dir`` a
    temporary one is created on first start and removed by ``close()``/the ``with`` block.
    ``extra_properties`` are added to (and override) the generated server.properties. With ``security``
    the client listener is SASL_SSL (see ``BrokerSecurity``); this class then logs in as its admin.
    """

    def __init__(
        self,
        data_dir: Path | None = None,
        port: int | None = None,
        version: str | None = None,
        extra_properties: Mapping[str, str] | None = None,
        start_timeout: float | None = None,
        cache: Path | None = None,
        security: BrokerSecurity | None = None,
    ) -> None:
        self.version = kafka_version(version)
        self.port = port
        self.extra_properties = dict(extra_properties or {})
        self.security = security
        self.start_timeout = start_timeout or float(
            os.environ.get("KAFKA_START_TIMEOUT", DEFAULT_START_TIMEOUT)
        )
        self.cache = cache_dir(cache)
        self._data_dir = data_dir.resolve() if data_dir is not None else None
        self._owns_data_dir = False
        self._proc: subprocess.Popen[bytes] | None = None

    # Paths inside the data dir.
    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise KafkaLocalError("the broker has no data dir yet: start it first")
        return self._data_dir

    @property
    def properties_path(self) -> Path:
        return self.data_dir / "server.properties"

    @property
    def log_path(self) -> Path:
        """The broker's log4j log."""
        return self.data_dir / "broker.log"

    @property
    def console_path(self) -> Path:
        """The JVM's stdout/stderr (empty unless something fails before logging is set up)."""
        return self.data_dir / "console.log"

    @property
    def admin_properties_path(self) -> Path:
        """Secured brokers: the ``--command-config`` file for Kafka's tools, as the admin."""
        return self.data_dir / "admin.properties"

    @property
    def bootstrap(self) -> str:
        if self.port is None:
            raise KafkaLocalError("the broker has no port yet: start it first")
        return f"127.0.0.1:{self.port}"

    @property
    def login(self) -> SaslLogin | None:
        """How this script logs in to the broker (None: PLAINTEXT)."""
        return self.security.admin_login() if self.security is not None else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> LocalKafka:
        """Start the broker and return once it serves requests; raise ``BrokerStartError`` otherwise."""
        if self.running():
            return self
        libs = resolve(self.version, self.cache)
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="loopwarden-kafka-"))
            self._owns_data_dir = True
        self.data_dir.mkdir(parents=True, exist_ok=True)
        saved = self._load_node()
        self.port = self.port or int(saved.get("port", 0)) or _free_port()
        controller_port = int(saved.get("controller_port", 0)) or _free_port()
        cluster_id = str(saved.get("cluster_id", "")) or _random_cluster_id()
        node = {"port": self.port, "controller_port": controller_port, "cluster_id": cluster_id}
        (self.data_dir / "node.json").write_text(json.dumps(node, indent=2) + "\n")

        logging = _logging_for(self.version)
        log_config = self.data_dir / logging.file_name
        log_config.write_text(logging.config.format(log=self.log_path))
        self._write_security_files()
        self._write_properties(controller_port)
        java = _java()
        classpath = f"{libs}/*"
        self._format_storage(java, classpath, cluster_id)

        with self.console_path.open("ab") as console:
            self._proc = subprocess.Popen(
                [
                    java,
                    "-Xmx512m",
                    logging.jvm_flag.format(path=log_config),
                    "-cp",
                    classpath,
                    "kafka.Kafka",
                    str(self.properties_path),
                ],
                cwd=self.data_dir,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_ready(self._proc, cluster_id)
        return self

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM the broker, wait up to ``timeout`` s, then SIGKILL. Idempotent; keeps the data dir."""
        if self._proc is None:
            return
        _stop_pid(self._proc.pid, timeout, self._proc)
        self._proc = None

    def kill(self) -> None:
        """SIGKILL the broker at once (for crash tests); ``start()`` brings it back on the same port."""
        self.stop(timeout=0)

    def close(self) -> None:
        """Stop the broker and remove the data dir if this object created it."""
        self.stop()
        if self._owns_data_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None
            self._owns_data_dir = False

    def create_topics(
        self, specs: Iterable[TopicSpec | tuple[str, int]], compact: bool = False, timeout: float = 30.0
    ) -> None:
        """Create topics; plain ``(name, partitions)`` tuples take ``compact`` from the argument."""
        create_topics(
            self.bootstrap,
            [s if isinstance(s, TopicSpec) else TopicSpec(s[0], s[1], compact=compact) for s in specs],
            timeout,
            self.login,
        )

    def add_acls(self, commands: Sequence[Sequence[str]]) -> None:
        """Add ACLs (``kafka-acls --add`` arguments, e.g. ``LoopwardenAcls(...).commands()``) as the admin."""
        if self.security is None or not self.security.acls:
            raise KafkaLocalError("this broker has no authorizer: start it with BrokerSecurity(acls=True)")
        add_acls(self.bootstrap, self.admin_properties_path, commands, self.version, self.cache)

    def __enter__(self) -> LocalKafka:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _load_node(self) -> dict[str, Any]:
        """Ports and cluster id of a previous start on this data dir, so a restart looks the same."""
        path = self.data_dir / "node.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _write_security_files(self) -> None:
        """Kafka's PEM key stores hold the key and its chain in one file: the broker's, and the admin's
        for Kafka's tools, with the tools' command config."""
        if self.security is None:
            return
        tls = self.security.tls
        for name, key, chain in (
            ("keystore.pem", tls.broker_key, tls.broker_cert),
            ("admin-keystore.pem", tls.client_key, tls.client_cert),
        ):
            _write_private(self.data_dir / name, key.read_text() + chain.read_text())
        _write_private(
            self.admin_properties_path,
            self.security.admin_client_properties(self.data_dir / "admin-keystore.pem"),
        )

    def _write_properties(self, controller_port: int) -> None:
        properties = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.data_dir / "kraft-logs"),
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
            "default.replication.factor": "1",
            "min.insync.replicas": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "1",
            "group.initial.rebalance.delay.ms": "0",
            "broker.session.timeout.ms": "3000",
            "broker.heartbeat.interval.ms": "500",
            "log.cleaner.dedupe.buffer.size": str(32 * 1024 * 1024),
        }
        if self.security is not None:
            properties.update(
                self.security.server_properties(self.port or 0, controller_port, self.data_dir / "keystore.pem")
            )
        properties.update(self.extra_properties)
        lines = [
            "# Written by scripts/kafka_local.py on every start; edits are overwritten.",
            "# Single node, loopback only; topics are created explicitly (faust needs exact partition counts).",
            "# The log cleaner's dedupe buffer is cut from 128 MiB to fit the 512 MiB heap.",
            "# A short broker session: after a SIGKILL the restarted node waits for its old registration",
            "# to expire (9 s by default) before it serves requests.",
        ]
        lines += [f"{key}={_escape_property(value)}" for key, value in properties.items()]
        # Private: with security on, it holds every user's password (the PLAIN JAAS entries).
        _write_private(self.properties_path, "\n".join(lines) + "\n")

    def _format_storage(self, java: str, classpath: str, cluster_id: str) -> None:
        """Format the storage once; a restart on the same data dir skips the extra JVM launch."""
        if (self.data_dir / "kraft-logs" / "meta.properties").exists():
            return
        logging = _logging_for(self.version)
        result = subprocess.run(
            [
                java,
                *_TOOL_JVM_FLAGS,
                logging.jvm_flag.format(path=self.data_dir / logging.file_name),
                "-cp",
                classpath,
                "kafka.tools.StorageTool",
                "format",
                "-t",
                cluster_id,
                "-c",
                str(self.properties_path),
                "--ignore-formatted",
                *(self.security.format_args() if self.security is not None else []),
            ],
            cwd=self.data_dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=self.start_timeout,
            check=False,
        )
        if result.returncode != 0:
            output = "\n".join(result.stdout.strip().splitlines()[-LOG_TAIL_LINES:])
            raise BrokerStartError(
                f"formatting the Kafka storage in {self.data_dir} failed (exit {result.returncode}):\n{output}"
            )

    def _wait_ready(self, proc: subprocess.Popen[bytes], cluster_id: str) -> None:
        """Poll until ApiVersions answers and Metadata shows our cluster with a registered broker."""
        deadline = time.monotonic() + self.start_timeout
        last_error = "no answer yet"
        while True:
            code = proc.poll()
            if code is not None:
                self._proc = None
                self._fail(f"the broker process exited with code {code} during startup")
            if time.monotonic() > deadline:
                self.kill()
                self._fail(f"the broker was not ready after {self.start_timeout:g}s ({last_error})")
            try:
                with _Connection(self.bootstrap, 2.0, self.login) as conn:
                    versions = _api_versions(conn)
                    for api, wanted in (
                        (_API_METADATA, _METADATA_VERSION),
                        (_API_CREATE_TOPICS, _CREATE_TOPICS_VERSION),
                    ):
                        low, high = versions.get(api, (0, -1))
                        if not low <= wanted <= high:
                            self.kill()
                            self._fail(
                                f"the broker does not serve API {api} v{wanted} (it has v{low}-v{high})"
                            )
                    meta = _metadata(conn, [])
                if meta.cluster_id == cluster_id and meta.brokers:
                    return
                last_error = f"cluster id {meta.cluster_id!r}, brokers {meta.brokers}"
            except (OSError, struct.error) as exc:
                last_error = str(exc) or type(exc).__name__
            except KafkaLocalError as exc:  # refused certificate or login: waiting will not help
                self.kill()
                self._fail(str(exc))
            time.sleep(0.1)

    def _fail(self, reason: str) -> None:
        message = (
            f"Kafka {self.version} on {self.bootstrap} failed to start: {reason}\n"
            f"--- last {LOG_TAIL_LINES} lines of {self.log_path} ---\n{_tail(self.log_path)}"
        )
        if self.console_path.exists() and self.console_path.stat().st_size:
            message += f"\n--- last lines of {self.console_path} ---\n{_tail(self.console_path)}"
        raise BrokerStartError(message)


# --------------------------------------------------------------------------------------------------
# CLI


def _default_state_file() -> Path:
    return cache_dir() / "kafka-local.json"


def _read_state(path: Path) -> dict[str, object] | None:
    """The state of the broker the CLI started, or None if there is none or it no longer runs."""
    if not path.exists():
        return None
    state: dict[str, object] = json.loads(path.read_text())
    pid, properties = int(str(state["pid"])), Path(str(state["properties"]))
    return state if _pid_alive(pid) and _is_our_broker(pid, properties) else None


def _state_login(state: Mapping[str, object]) -> SaslLogin | None:
    """The admin login of a secured broker the CLI started (None: PLAINTEXT)."""
    login = state.get("login")
    if not isinstance(login, dict):
        return None
    return SaslLogin(login["username"], login["password"], Path(login["cafile"]), Path(login["certfile"]),
                     Path(login["keyfile"]))


def _cli_security(args: argparse.Namespace, data_dir: Path) -> BrokerSecurity | None:
    """``start --secure``: the TLS files and the admin password are made at a data dir's first start and
    reused after, with its users (their SCRAM credentials are fixed when the storage is formatted) and,
    unless given again, its ``--client-auth``."""
    users = dict(item.split("=", 1) for item in args.user)
    if not args.secure:
        if users or args.client_auth:
            raise KafkaLocalError("--user and --client-auth need --secure")
        return None
    saved_path = data_dir / "secure.json"
    if saved_path.exists():
        saved = json.loads(saved_path.read_text())
        if users and users != saved["users"]:
            raise KafkaLocalError(
                f"{data_dir} was formatted with users {sorted(saved['users'])}: SCRAM users are fixed at the "
                "first start of a data dir; start without --user, or use a new --data-dir"
            )
        users, admin_password = saved["users"], saved["admin_password"]
        client_auth = args.client_auth or saved["client_auth"]
    elif (data_dir / "kraft-logs" / "meta.properties").exists():
        raise KafkaLocalError(f"{data_dir} was formatted without --secure: use a new --data-dir")
    else:
        admin_password, client_auth = secrets.token_urlsafe(18), args.client_auth or "none"
    tls_dir = data_dir / "tls"
    tls = TlsFiles.in_directory(tls_dir) if (tls_dir / "ca.pem").exists() else make_tls_files(tls_dir)
    security = BrokerSecurity(tls, users, admin_password, client_auth=client_auth)
    saved = {"users": users, "admin_password": admin_password, "client_auth": client_auth}
    _write_private(saved_path, json.dumps(saved) + "\n")
    return security


def _cmd_start(args: argparse.Namespace) -> int:
    state_file: Path = args.state_file
    running = _read_state(state_file)
    if running is not None:
        raise KafkaLocalError(
            f"a broker from {state_file} already runs at {running['bootstrap']}: stop it first"
        )
    port: int | None = args.port
    data_dir: Path | None = args.data_dir
    if data_dir is None:
        port = port or _free_port()
        data_dir = cache_dir() / f"broker-{port}"
    data_dir.mkdir(parents=True, exist_ok=True)
    extra = dict(item.split("=", 1) for item in args.property)
    security = _cli_security(args, data_dir)
    broker = LocalKafka(
        data_dir=data_dir, port=port, version=args.kafka_version, extra_properties=extra, security=security
    )
    broker.start()
    state: dict[str, object] = {
        "pid": broker.pid,
        "port": broker.port,
        "bootstrap": broker.bootstrap,
        "version": broker.version,
        "data_dir": str(broker.data_dir),
        "properties": str(broker.properties_path),
        "log": str(broker.log_path),
        "console_log": str(broker.console_path),
    }
    env = {"KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap}
    if security is not None:
        login = security.admin_login()
        state["admin_properties"] = str(broker.admin_properties_path)
        state["login"] = {"username": login.username, "password": login.password, "cafile": str(login.cafile),
                          "certfile": str(login.certfile), "keyfile": str(login.keyfile)}
        env.update(KAFKA_SECURITY_PROTOCOL="SASL_SSL", KAFKA_SSL_CAFILE=str(security.tls.ca))
        if security.client_auth != "none":
            env.update(KAFKA_SSL_CERTFILE=str(security.tls.client_cert),
                       KAFKA_SSL_KEYFILE=str(security.tls.client_key))
        print(
            f"kafka_local: SASL_SSL (SCRAM-SHA-512 or PLAIN) for {', '.join(sorted(security.users)) or 'no users'}"
            f"{', ACLs on' if security.acls else ''}; Kafka's tools as {ADMIN_USER}: "
            f"--command-config {broker.admin_properties_path}",
            file=sys.stderr,
        )
    state_file.parent.mkdir(parents=True, exist_ok=True)
    _write_private(state_file, json.dumps(state, indent=2) + "\n")  # a secured broker's admin password
    for name, value in env.items():
        print(f"{name}={value}")
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    state = _read_state(args.state_file)
    if state is None:
        print("kafka_local: no broker running", file=sys.stderr)
    else:
        _stop_pid(int(str(state["pid"])), STOP_TIMEOUT)
        print(f"kafka_local: stopped the broker at {state['bootstrap']}", file=sys.stderr)
    args.state_file.unlink(missing_ok=True)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    state = _read_state(args.state_file)
    if state is None:
        print("not running")
        return 1
    print(f"running: pid {state['pid']}, KAFKA_BOOTSTRAP_SERVERS={state['bootstrap']}, log {state['log']}")
    return 0


def _cmd_resolve(args: argparse.Namespace) -> int:
    print(resolve(args.kafka_version))
    return 0


def _cmd_create_topics(args: argparse.Namespace) -> int:
    bootstrap = args.bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        state = _read_state(args.state_file)
        if state is None:
            raise KafkaLocalError("no --bootstrap, no KAFKA_BOOTSTRAP_SERVERS and no running broker")
        bootstrap = str(state["bootstrap"])
    state = _read_state(args.state_file)
    login = _state_login(state) if state is not None and state["bootstrap"] == bootstrap else None
    create_topics(bootstrap, [TopicSpec.parse(text) for text in args.topics], login=login)
    return 0


def _cmd_acls(args: argparse.Namespace) -> int:
    """Print loopwarden's ACLs as kafka-acls commands, or add them to the secured broker the CLI started
    (creating loopwarden's topics first with ``--create-topics``)."""
    acls = LoopwardenAcls(
        worker=args.worker, runtimes=args.runtime, notify=args.notify, operators=args.operator,
        app_id=args.app_id, telemetry_topic=args.telemetry_topic, control_topic=args.control_topic,
        alerts_topic=args.alerts_topic, dlq_topic=args.dlq_topic, notify_group=args.notify_group,
    )
    if args.print:
        print("\n".join(acl_command_line(command) for command in acls.commands()))
        return 0
    state = _read_state(args.state_file)
    if state is None or "admin_properties" not in state:
        raise KafkaLocalError("no secured broker running: start one with `start --secure`, or use --print")
    bootstrap = str(state["bootstrap"])
    if args.create_topics:
        create_topics(bootstrap, acls.topic_specs(args.create_topics), login=_state_login(state))
    add_acls(bootstrap, Path(str(state["admin_properties"])), acls.commands(), str(state["version"]))
    print(f"kafka_local: loopwarden's ACLs added on {bootstrap}", file=sys.stderr)
    return 0


def _cmd_exec(args: argparse.Namespace) -> int:
    """Run a command with KAFKA_BOOTSTRAP_SERVERS set: the caller's broker if it is already set, else a
    broker started for the command and stopped after it, also on Ctrl-C."""
    command = [part for part in args.cmd if part != "--"]
    if not command:
        raise KafkaLocalError("exec needs a command after --")
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return subprocess.call(command)
    with LocalKafka(version=args.kafka_version) as broker:
        print(f"kafka_local: starting Apache Kafka {broker.version} ...", file=sys.stderr, flush=True)
        broker.start()
        print(f"kafka_local: broker ready at {broker.bootstrap}", file=sys.stderr, flush=True)
        child = subprocess.Popen(command, env={**os.environ, "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap})
        try:
            return child.wait()
        except KeyboardInterrupt:
            # The terminal sent SIGINT to the whole process group: give the command time to clean up.
            try:
                return child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                return 130


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", required=True)

    def with_state_file(sub: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sub.add_argument(
            "--state-file", type=Path, default=_default_state_file(), help="default: %(default)s"
        )
        return sub

    start = with_state_file(commands.add_parser("start", help="start a broker in the background"))
    start.add_argument("--data-dir", type=Path, help="default: <cache>/broker-<port>; reused if it exists")
    start.add_argument(
        "--port", type=int, help="broker port (default: the data dir's previous one, or a free one)"
    )
    start.add_argument("--kafka-version", help=f"default: $KAFKA_VERSION or {DEFAULT_VERSION}")
    start.add_argument(
        "--property",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra server property (repeatable)",
    )
    start.add_argument(
        "--secure",
        action="store_true",
        help="SASL_SSL listener (SCRAM-SHA-512 and PLAIN), ACLs on, TLS files made in <data-dir>/tls",
    )
    start.add_argument(
        "--user", action="append", default=[], metavar="NAME=PASSWORD", help="with --secure: a user (repeatable)"
    )
    start.add_argument(
        "--client-auth", choices=("none", "requested", "required"), help="with --secure: ssl.client.auth (default none)"
    )
    start.set_defaults(run=_cmd_start)
    with_state_file(commands.add_parser("stop", help="stop the broker started by `start`")).set_defaults(
        run=_cmd_stop
    )
    with_state_file(commands.add_parser("status", help="exit 0 if the broker runs")).set_defaults(
        run=_cmd_status
    )
    res = commands.add_parser("resolve", help="only fetch the jars (CI warm-up)")
    res.add_argument("--kafka-version", help=f"default: $KAFKA_VERSION or {DEFAULT_VERSION}")
    res.set_defaults(run=_cmd_resolve)
    topics = with_state_file(
        commands.add_parser("create-topics", help="create topics; existing ones are fine")
    )
    topics.add_argument("--bootstrap", help="default: $KAFKA_BOOTSTRAP_SERVERS, else the running broker")
    topics.add_argument("topics", nargs="+", metavar="TOPIC:PARTITIONS[:compact]")
    topics.set_defaults(run=_cmd_create_topics)
    acls = with_state_file(
        commands.add_parser("acls", help="loopwarden's ACLs: add them to the secured broker, or --print them")
    )
    acls.add_argument("--print", action="store_true", help="only print them as kafka-acls.sh commands")
    acls.add_argument("--create-topics", type=int, metavar="PARTITIONS", help="first create loopwarden's topics")
    acls.add_argument("--worker", required=True, metavar="USER", help="the workers' user")
    for flag, dest in (("--runtime", "runtime"), ("--notify", "notify"), ("--operator", "operator")):
        acls.add_argument(flag, dest=dest, action="append", default=[], metavar="USER", help="repeatable")
    for flag, default in (
        ("--app-id", "loopwarden"),
        ("--telemetry-topic", "agent.telemetry"),
        ("--control-topic", "agent.control"),
        ("--alerts-topic", "agent.alerts"),
        ("--dlq-topic", "agent.telemetry.dlq"),
        ("--notify-group", "loopwarden-notify"),
    ):
        acls.add_argument(flag, default=default, help="default: %(default)s")
    acls.set_defaults(run=_cmd_acls)
    run_with = commands.add_parser("exec", help="run a command against a broker (started if none is set)")
    run_with.add_argument("--kafka-version", help=f"default: $KAFKA_VERSION or {DEFAULT_VERSION}")
    run_with.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    run_with.set_defaults(run=_cmd_exec)

    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except (KafkaLocalError, ValueError) as exc:
        print(f"kafka_local: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
