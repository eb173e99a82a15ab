"""Kafka connection settings shared by every Kafka client in the project (SDK publisher and listener,
worker).

One frozen dataclass, so PLAINTEXT, SASL (PLAIN, SCRAM-SHA-256/512) and TLS are configured the same way
everywhere and checked once: ``aiokafka_kwargs()`` for aiokafka clients, ``faust_credentials()`` for the
Faust app. Settings that would be silently ignored (a CA file with PLAINTEXT, a SASL user without SASL)
are refused, because a half-applied security setting is worse than a refused one.

aiokafka and faust are imported only when a TLS context or Faust credentials are asked for, so the
in-process SDK works with the base install (orjson and PyYAML only).
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ..core import LoopwardenError

SECURITY_PROTOCOLS: Final = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS: Final = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


class KafkaConfigError(LoopwardenError, ValueError):
    """Kafka settings that cannot work together. Operator action: fix the setting named first."""


class KafkaUnreachable(LoopwardenError, ConnectionError):
    """No broker could be reached, or it refused the certificate or the login; the message is one line
    saying what to check."""


@dataclass(frozen=True, slots=True)
class KafkaClientConfig:
    """How to reach the Kafka cluster; validated on construction."""

    #: ``host:port[,host:port...]``
    bootstrap_servers: str
    #: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL.
    security_protocol: str = "PLAINTEXT"
    #: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512; required with the SASL protocols, refused without.
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    #: CA bundle that signs the brokers' certificates (default: the system's).
    ssl_cafile: str | None = None
    #: Client certificate and key for mutual TLS.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_check_hostname: bool = True

    def __post_init__(self) -> None:
        if not self.bootstrap_servers.strip():
            raise KafkaConfigError("bootstrap_servers: required (host:port[,host:port])")
        if self.security_protocol not in SECURITY_PROTOCOLS:
            raise KafkaConfigError(
                f"security_protocol: {self.security_protocol!r} is not one of {', '.join(SECURITY_PROTOCOLS)}"
            )
        if self.uses_sasl:
            if self.sasl_mechanism not in SASL_MECHANISMS:
                raise KafkaConfigError(
                    f"sasl_mechanism: {self.sasl_mechanism!r} is not one of {', '.join(SASL_MECHANISMS)}"
                )
            if not self.sasl_username or self.sasl_password is None:
                raise KafkaConfigError("sasl_username, sasl_password: both are required with SASL")
        elif self.sasl_mechanism or self.sasl_username or self.sasl_password is not None:
            raise KafkaConfigError(
                f"sasl_*: set, but security_protocol is {self.security_protocol}; use SASL_PLAINTEXT or SASL_SSL"
            )
        if not self.uses_ssl and (self.ssl_cafile or self.ssl_certfile or self.ssl_keyfile):
            raise KafkaConfigError(
                f"ssl_*: set, but security_protocol is {self.security_protocol}; use SSL or SASL_SSL"
            )
        if self.ssl_keyfile and not self.ssl_certfile:
            raise KafkaConfigError("ssl_keyfile: needs ssl_certfile (the client certificate it belongs to)")

    @property
    def uses_sasl(self) -> bool:
        return self.security_protocol.startswith("SASL")

    @property
    def uses_ssl(self) -> bool:
        return self.security_protocol.endswith("SSL")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KafkaClientConfig:
        """From KAFKA_BOOTSTRAP_SERVERS (default 127.0.0.1:9092), KAFKA_SECURITY_PROTOCOL,
        KAFKA_SASL_MECHANISM, KAFKA_SASL_USERNAME, KAFKA_SASL_PASSWORD, KAFKA_SSL_CAFILE,
        KAFKA_SSL_CERTFILE, KAFKA_SSL_KEYFILE and KAFKA_SSL_CHECK_HOSTNAME (true/false)."""

        def get(name: str) -> str | None:
            return env.get(name, "").strip() or None

        return cls(
            bootstrap_servers=get("KAFKA_BOOTSTRAP_SERVERS") or "127.0.0.1:9092",
            security_protocol=(get("KAFKA_SECURITY_PROTOCOL") or "PLAINTEXT").upper(),
            sasl_mechanism=get("KAFKA_SASL_MECHANISM"),
            sasl_username=get("KAFKA_SASL_USERNAME"),
            sasl_password=get("KAFKA_SASL_PASSWORD"),
            ssl_cafile=get("KAFKA_SSL_CAFILE"),
            ssl_certfile=get("KAFKA_SSL_CERTFILE"),
            ssl_keyfile=get("KAFKA_SSL_KEYFILE"),
            ssl_check_hostname=(get("KAFKA_SSL_CHECK_HOSTNAME") or "true").lower()
            not in ("false", "0", "no"),
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for SSL and SASL_SSL (None otherwise), built by aiokafka's helper."""
        if not self.uses_ssl:
            return None
        from aiokafka.helpers import create_ssl_context

        context: ssl.SSLContext = create_ssl_context(
            cafile=self.ssl_cafile, certfile=self.ssl_certfile, keyfile=self.ssl_keyfile
        )
        context.check_hostname = self.ssl_check_hostname
        return context

    def aiokafka_kwargs(self) -> dict[str, Any]:
        """Connection keyword arguments for AIOKafkaProducer, AIOKafkaConsumer and AIOKafkaAdminClient."""
        kwargs: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "security_protocol": self.security_protocol,
        }
        if self.uses_ssl:
            kwargs["ssl_context"] = self.ssl_context()
        if self.uses_sasl:
            kwargs.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.sasl_username,
                sasl_plain_password=self.sasl_password,
            )
        return kwargs

    async def check_connection(self, timeout_s: float = 10.0) -> None:
        """Open one connection to a bootstrap server the way every client does (TCP, TLS, ApiVersions,
        SASL) and close it; raise ``KafkaUnreachable`` saying what to check. aiokafka's clients only log
        why they could not connect and raise "Unable to bootstrap", which names no cause."""
        from aiokafka.conn import create_conn
        from aiokafka.errors import (
            AuthenticationFailedError,
            AuthenticationMethodNotSupported,
            IllegalSaslStateError,
            KafkaError,
            SaslAuthenticationFailed,
            UnsupportedSaslMechanismError,
        )

        options = {k: v for k, v in self.aiokafka_kwargs().items() if k != "bootstrap_servers"}
        problems = []
        for server in self.bootstrap_servers.split(","):
            host, _, port = server.strip().rpartition(":")
            try:
                conn = await create_conn(host or "127.0.0.1", int(port), request_timeout_ms=int(timeout_s * 1000),
                                         **options)
            except ValueError as exc:
                raise KafkaUnreachable(f"KAFKA_BOOTSTRAP_SERVERS={self.bootstrap_servers!r}: expected "
                                       f"host:port[,host:port] ({exc})") from exc
            except ssl.SSLCertVerificationError as exc:
                raise KafkaUnreachable(
                    f"Kafka at {server}: TLS refused the broker's certificate ({exc.verify_message}); check "
                    "KAFKA_SSL_CAFILE and that the certificate names the host (KAFKA_SSL_CHECK_HOSTNAME)") from exc
            except ssl.SSLError as exc:
                raise KafkaUnreachable(
                    f"Kafka at {server}: TLS failed ({exc.reason or exc}); check KAFKA_SECURITY_PROTOCOL, "
                    "KAFKA_SSL_CAFILE, KAFKA_SSL_CERTFILE and KAFKA_SSL_KEYFILE") from exc
            except (AuthenticationFailedError, AuthenticationMethodNotSupported, IllegalSaslStateError,
                    SaslAuthenticationFailed, UnsupportedSaslMechanismError) as exc:
                raise KafkaUnreachable(
                    f"Kafka at {server} refused the {self.sasl_mechanism} login of {self.sasl_username!r}: "
                    f"check KAFKA_SASL_USERNAME, KAFKA_SASL_PASSWORD and KAFKA_SASL_MECHANISM") from exc
            except (OSError, KafkaError) as exc:  # OSError covers refused connections and timeouts
                problems.append(f"{server}: {str(exc) or type(exc).__name__}")
                continue
            await conn.close()
            return
        raise KafkaUnreachable(f"cannot reach Kafka at {self.bootstrap_servers} ({self.security_protocol}): "
                               f"{'; '.join(problems)}; check KAFKA_BOOTSTRAP_SERVERS and that the broker is up")

    def faust_credentials(self) -> Any:
        """``broker_credentials`` for ``faust.App`` (None for PLAINTEXT); needs the worker extra."""
        if self.security_protocol == "PLAINTEXT":
            return None
        import faust

        if self.uses_sasl:
            return faust.SASLCredentials(
                username=self.sasl_username,
                password=self.sasl_password,
                mechanism=self.sasl_mechanism,
                ssl_context=self.ssl_context(),
            )
        return faust.SSLCredentials(self.ssl_context())
