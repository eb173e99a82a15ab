"""What makes a local broker secured, and what loopwarden needs from a secured cluster.

A secured broker (``BrokerSecurity``; ``start --secure``) has a SASL_SSL listener with SCRAM-SHA-512
and PLAIN users, and ACLs enforced by the StandardAuthorizer. Its TLS files are made here with the
``cryptography`` package (``make_tls_files``), imported only when they are needed; ACLs are added with
Kafka's own ``kafka-acls`` (AclCommand) run from the broker's jars, so what the tests prove is what an
operator runs. ``LoopwardenAcls`` is the one list of loopwarden's ACLs, which docs/security.md shows
and the integration tests apply. See docs/security.md.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import secrets
import shlex
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import jars
from .admin import SaslLogin, TopicSpec
from .errors import KafkaLocalError, output_tail

ADMIN_USER = "admin"
_PLAIN_LOGIN = "org.apache.kafka.common.security.plain.PlainLoginModule"
_SCRAM_LOGIN = "org.apache.kafka.common.security.scram.ScramLoginModule"
_STANDARD_AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
# User names and passwords go into JAAS strings and `--add-scram name=...,password=...` unquoted.
_CREDENTIAL = re.compile(r"[A-Za-z0-9._~-]+")


def write_private(path: Path, data: str) -> None:
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
        write_private(key_path, key_pem)
    return files


@dataclass(frozen=True)
class BrokerSecurity:
    """What makes a ``LocalKafka`` secured: its client listener is SASL_SSL, with SCRAM-SHA-512 and PLAIN.

    Every user in ``users`` (name -> password), and ``admin``, the one super user (kafka_local and Kafka's
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

    def admin_login(self, mechanism: str = "PLAIN") -> SaslLogin:
        """How kafka_local's admin client logs in: as ``admin``, with the client certificate (which
        ``client_auth="required"`` needs and the other settings ignore)."""
        return SaslLogin(ADMIN_USER, self.admin_password, self.tls.ca, self.tls.client_cert, self.tls.client_key,
                         mechanism)

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
            "# Written by scripts/kafka_local: Kafka's tools as the super user (--command-config).",
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
    facts_topic: str = "loopwarden.facts"
    scopes_topic: str = "loopwarden.scopes"

    @property
    def changelog_topic(self) -> str:
        """Faust's changelog of the worker's ``runs`` table."""
        return f"{self.app_id}-runs-changelog"

    @property
    def trees_changelog_topic(self) -> str:
        """Faust's changelog of the worker's ``trees`` table (the rules across runs)."""
        return f"{self.app_id}-trees-changelog"

    @property
    def threads_changelog_topic(self) -> str:
        """Faust's changelog of the worker's ``threads`` table (the rules across runs)."""
        return f"{self.app_id}-threads-changelog"

    @property
    def tools_changelog_topic(self) -> str:
        """Faust's changelog of the worker's ``tools`` table (the rules across runs)."""
        return f"{self.app_id}-tools-changelog"

    def topic_specs(self, partitions: int) -> list[TopicSpec]:
        """The topics as the worker would create them (every one with ``partitions`` partitions)."""
        return [
            TopicSpec(self.telemetry_topic, partitions),
            TopicSpec(self.control_topic, partitions),
            TopicSpec(self.alerts_topic, partitions),
            TopicSpec(self.dlq_topic, partitions),
            TopicSpec(self.changelog_topic, partitions, compact=True),
            TopicSpec(self.facts_topic, partitions),
            TopicSpec(self.trees_changelog_topic, partitions, compact=True),
            TopicSpec(self.threads_changelog_topic, partitions, compact=True),
            TopicSpec(self.tools_changelog_topic, partitions, compact=True),
            TopicSpec(self.scopes_topic, partitions, compact=True),
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
            allow(worker, ["Read"], topic=[self.telemetry_topic, self.changelog_topic, self.facts_topic,
                                           self.trees_changelog_topic, self.threads_changelog_topic,
                                           self.tools_changelog_topic],
                  group=[self.app_id]),
            allow(worker, ["Write", "Create"], topic=[self.telemetry_topic, self.changelog_topic,
                                                      self.control_topic, self.alerts_topic, self.dlq_topic,
                                                      self.facts_topic, self.trees_changelog_topic,
                                                      self.threads_changelog_topic, self.tools_changelog_topic,
                                                      self.scopes_topic]),
            allow(self.runtimes, ["Write"], topic=[self.telemetry_topic]),
            allow(self.runtimes, ["Read"], topic=[self.control_topic, self.scopes_topic]),
        ]
        if self.notify:
            commands.append(allow(self.notify, ["Read"], topic=[self.alerts_topic], group=[self.notify_group]))
        if self.operators:
            commands += [
                allow(self.operators, ["Write"], topic=[self.telemetry_topic, self.facts_topic]),
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
    version = jars.kafka_version(version)
    if jars.major_version(version) >= 4:
        raise KafkaLocalError(
            f"Kafka {version} ships AclCommand in kafka-tools, which kafka_local does not fetch; use Kafka 3.9"
        )
    classpath, java = f"{jars.resolve(version, cache)}/*", jars.java_binary()

    def run(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [java, *jars.TOOL_JVM_FLAGS, "-cp", classpath, "kafka.admin.AclCommand", "--bootstrap-server",
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
            raise KafkaLocalError(
                f"kafka-acls --add {shlex.join(args)} failed (exit {result.returncode}):\n{output_tail(result.stdout)}"
            )
