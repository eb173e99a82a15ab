"""A single-node Apache Kafka (KRaft) broker for development, tests and CI, without Docker.

loopwarden's worker runs on faust + aiokafka against real Kafka, and the only things this machine (and CI)
can reach are package registries. So the broker comes from the ``org.apache.kafka:kafka_2.13`` jars on
Maven Central: Maven resolves them once into a cache, and a JVM runs ``kafka.Kafka`` in combined
broker+controller mode on loopback ports.

Readiness (Metadata showing our cluster id and a registered broker) and topic creation go through
aiokafka's admin client, behind a synchronous API that also works inside a running event loop.

A secured broker (``BrokerSecurity``; ``start --secure``) has a SASL_SSL listener with SCRAM-SHA-512
and PLAIN users, and ACLs enforced by the StandardAuthorizer. Its TLS files are made with the
``cryptography`` package (``make_tls_files``); ACLs are added with Kafka's own ``kafka-acls``
(AclCommand) run from the same jars. See docs/security.md.

Where things are: ``jars`` (Maven, the cache, versions, java), ``broker`` (``LocalKafka``: the process,
its properties, storage and readiness; the CLI's state file), ``security`` (TLS files, SASL users,
ACLs), ``admin`` (the synchronous aiokafka admin calls), ``cli`` (the commands below).

Used two ways:

* as a CLI (see ``--help``), from the repository root::

      python -m scripts.kafka_local resolve                    # fetch the jars only (CI warm-up)
      export $(python -m scripts.kafka_local start)            # KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:PORT
      python -m scripts.kafka_local create-topics events:3 state:3:compact
      python -m scripts.kafka_local status                     # exit 0 while it runs
      python -m scripts.kafka_local stop
      export $(python -m scripts.kafka_local start --secure --user worker=w0rker-pw --user runtime=runt1me-pw)
      python -m scripts.kafka_local acls --worker worker --runtime runtime --create-topics 8

* imported (``from scripts import kafka_local``) by the integration tests and the benchmarks:
  ``LocalKafka`` is a context manager that starts a broker, can stop, kill and restart it on the same
  data dir and port, and creates topics.

Environment: ``KAFKA_VERSION`` (default 3.9.1), ``LOOPWARDEN_CACHE`` (default ``<repo>/.cache``),
``KAFKA_START_TIMEOUT`` seconds (default 90).
"""

from __future__ import annotations

from .admin import ClusterInfo, SaslLogin, TopicSpec, create_topics, describe_cluster, run_sync
from .broker import DEFAULT_START_TIMEOUT, STOP_TIMEOUT, LocalKafka
from .errors import BrokerStartError, BrokerUnreachable, KafkaLocalError
from .jars import DEFAULT_VERSION, REPO, cache_dir, kafka_version, resolve
from .security import (
    ADMIN_USER,
    BrokerSecurity,
    LoopwardenAcls,
    TlsFiles,
    acl_command_line,
    add_acls,
    make_tls_files,
)

__all__ = [
    "ADMIN_USER",
    "DEFAULT_START_TIMEOUT",
    "DEFAULT_VERSION",
    "REPO",
    "STOP_TIMEOUT",
    "BrokerSecurity",
    "BrokerStartError",
    "BrokerUnreachable",
    "ClusterInfo",
    "KafkaLocalError",
    "LocalKafka",
    "LoopwardenAcls",
    "SaslLogin",
    "TlsFiles",
    "TopicSpec",
    "acl_command_line",
    "add_acls",
    "cache_dir",
    "create_topics",
    "describe_cluster",
    "kafka_version",
    "make_tls_files",
    "resolve",
    "run_sync",
]
