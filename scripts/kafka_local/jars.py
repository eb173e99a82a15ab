"""Where the broker's code comes from: the Apache Kafka jars on Maven Central, resolved once into a cache.

The only things this machine (and CI) can reach are package registries, so there is no Kafka tarball
and no Docker image: Maven resolves ``org.apache.kafka:kafka_2.13`` and a logging backend into
``<cache>/kafka-<version>/libs``, and everything else here runs ``java -cp 'libs/*'``. Kafka 3.x and
4.x log through different backends, hence the per-major-version ``KafkaLogging``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import KafkaLocalError, output_tail

REPO = Path(__file__).resolve().parents[2]
DEFAULT_VERSION = "3.9.1"
# Pinned so that `mvn dependency:copy-dependencies` does not depend on whatever the newest plugin is.
DEPENDENCY_PLUGIN_VERSION = "3.8.1"
#: For Kafka's short-lived JVM tools (StorageTool, AclCommand): the C1 compiler and the serial GC
#: halve their ~2 s start.
TOOL_JVM_FLAGS = ("-Xmx256m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")


@dataclass(frozen=True)
class KafkaLogging:
    """How one Kafka major version logs: Maven artifacts, the JVM flag and a config file."""

    artifacts: tuple[tuple[str, str, str], ...]
    jvm_flag: str
    file_name: str
    config: str


# Kafka 3.x logs through slf4j 1.7 + reload4j (log4j 1.x syntax).
_LOGGING_3 = KafkaLogging(
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
_LOGGING_4 = KafkaLogging(
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


def major_version(version: str) -> int:
    return int(version.split(".", 1)[0])


def logging_for(version: str) -> KafkaLogging:
    return _LOGGING_3 if major_version(version) < 4 else _LOGGING_4


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
    deps = [("org.apache.kafka", "kafka_2.13", version), *logging_for(version).artifacts]
    dep_xml = "\n".join(
        f"    <dependency><groupId>{g}</groupId><artifactId>{a}</artifactId><version>{v}</version></dependency>"
        for g, a, v in deps
    )
    return f"""\
<?xml version="1.0" encoding="UTF-8"?>
<!-- Written by scripts/kafka_local: only used to resolve the broker's runtime classpath. -->
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
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the ``with`` block."""
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
    with file_lock(home / ".lock"):
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
            raise KafkaLocalError(
                f"Maven could not resolve Kafka {version} (exit {result.returncode}):\n{output_tail(result.stdout)}"
            )
        jars = len(list(libs.glob("*.jar")))
        marker.write_text(f"kafka {version}: {jars} jars\n")
        print(
            f"kafka_local: resolved {jars} jars in {time.monotonic() - began:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    return libs


def java_binary() -> str:
    """The ``java`` binary: ``$JAVA_HOME/bin/java``, else the one on PATH."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise KafkaLocalError("java is not on PATH and JAVA_HOME is not set; Kafka needs Java 17+")
    return found
