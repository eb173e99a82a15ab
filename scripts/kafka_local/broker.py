"""The broker process: ``LocalKafka`` writes its properties, formats its storage, starts, stops, kills and
restarts the JVM, and waits until it is ready; plus the state file through which the CLI's ``start``,
``stop`` and ``status`` (separate processes) find the broker ``start`` left running.

One combined broker+controller node (KRaft) on loopback ports, running ``kafka.Kafka`` from the jars
``jars.resolve`` fetched. Ready means the admin client (``admin.describe_cluster``) sees our cluster id
and a registered broker, so a caller can create topics the moment ``start()`` returns.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

from . import jars
from .admin import SaslLogin, TopicSpec, create_topics, describe_cluster
from .errors import LOG_TAIL_LINES, BrokerStartError, BrokerUnreachable, KafkaLocalError, output_tail
from .security import BrokerSecurity, add_acls, write_private

DEFAULT_START_TIMEOUT = 90.0
STOP_TIMEOUT = 30.0
# Each readiness probe's request timeout: a broker that accepts connections but does not answer yet is
# asked again soon instead of holding the wait.
READY_PROBE_TIMEOUT = 2.0


def free_port(other_than: int = 0) -> int:
    """A port free on the loopback now, not ``other_than`` (the system may hand a port it just handed out
    again: a broker once got the same port for its two listeners and refused to start)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port != other_than:
            return port


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
        self.version = jars.kafka_version(version)
        self.port = port
        self.extra_properties = dict(extra_properties or {})
        self.security = security
        self.start_timeout = start_timeout or float(
            os.environ.get("KAFKA_START_TIMEOUT", DEFAULT_START_TIMEOUT)
        )
        self.cache = jars.cache_dir(cache)
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
        """How kafka_local's admin client logs in to the broker (None: PLAINTEXT)."""
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
        libs = jars.resolve(self.version, self.cache)
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="loopwarden-kafka-"))
            self._owns_data_dir = True
        self.data_dir.mkdir(parents=True, exist_ok=True)
        saved = self._load_node()
        self.port = self.port or int(saved.get("port", 0)) or free_port()
        controller_port = int(saved.get("controller_port", 0)) or free_port(other_than=self.port)
        cluster_id = str(saved.get("cluster_id", "")) or _random_cluster_id()
        node = {"port": self.port, "controller_port": controller_port, "cluster_id": cluster_id}
        (self.data_dir / "node.json").write_text(json.dumps(node, indent=2) + "\n")

        logging = jars.logging_for(self.version)
        log_config = self.data_dir / logging.file_name
        log_config.write_text(logging.config.format(log=self.log_path))
        self._write_security_files()
        self._write_properties(controller_port)
        java = jars.java_binary()
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
            write_private(self.data_dir / name, key.read_text() + chain.read_text())
        write_private(
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
            "# Written by scripts/kafka_local on every start; edits are overwritten.",
            "# Single node, loopback only; topics are created explicitly (faust needs exact partition counts).",
            "# The log cleaner's dedupe buffer is cut from 128 MiB to fit the 512 MiB heap.",
            "# A short broker session: after a SIGKILL the restarted node waits for its old registration",
            "# to expire (9 s by default) before it serves requests.",
        ]
        lines += [f"{key}={_escape_property(value)}" for key, value in properties.items()]
        # Private: with security on, it holds every user's password (the PLAIN JAAS entries).
        write_private(self.properties_path, "\n".join(lines) + "\n")

    def _format_storage(self, java: str, classpath: str, cluster_id: str) -> None:
        """Format the storage once; a restart on the same data dir skips the extra JVM launch."""
        if (self.data_dir / "kraft-logs" / "meta.properties").exists():
            return
        logging = jars.logging_for(self.version)
        result = subprocess.run(
            [
                java,
                *jars.TOOL_JVM_FLAGS,
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
            raise BrokerStartError(
                f"formatting the Kafka storage in {self.data_dir} failed (exit {result.returncode}):\n"
                f"{output_tail(result.stdout)}"
            )

    def _wait_ready(self, proc: subprocess.Popen[bytes], cluster_id: str) -> None:
        """Poll until Metadata shows our cluster with a registered broker; fail at once if the process
        exits or the broker refuses our certificate check or login."""
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
                cluster = describe_cluster(self.bootstrap, READY_PROBE_TIMEOUT, self.login)
            except BrokerUnreachable as exc:
                last_error = str(exc)
            except KafkaLocalError as exc:  # refused certificate or login: waiting will not help
                self.kill()
                self._fail(str(exc))
            else:
                if cluster.cluster_id == cluster_id and cluster.brokers:
                    return
                last_error = f"cluster id {cluster.cluster_id!r}, brokers {cluster.brokers}"
            time.sleep(0.1)

    def _fail(self, reason: str) -> NoReturn:
        message = (
            f"Kafka {self.version} on {self.bootstrap} failed to start: {reason}\n"
            f"--- last {LOG_TAIL_LINES} lines of {self.log_path} ---\n{_tail(self.log_path)}"
        )
        if self.console_path.exists() and self.console_path.stat().st_size:
            message += f"\n--- last lines of {self.console_path} ---\n{_tail(self.console_path)}"
        raise BrokerStartError(message)


# --------------------------------------------------------------------------------------------------
# The state file: how `stop`, `status`, `create-topics` and `acls` find the broker `start` left running.


def default_state_file() -> Path:
    return jars.cache_dir() / "kafka-local.json"


def write_state(path: Path, broker: LocalKafka) -> None:
    """Record a started broker in ``path``, private: a secured broker's entry holds the admin password."""
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
    login = broker.login
    if login is not None:
        state["admin_properties"] = str(broker.admin_properties_path)
        state["login"] = {"username": login.username, "password": login.password, "mechanism": login.mechanism,
                          "cafile": str(login.cafile), "certfile": str(login.certfile), "keyfile": str(login.keyfile)}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, json.dumps(state, indent=2) + "\n")


def read_state(path: Path) -> dict[str, object] | None:
    """The state of the broker the CLI started, or None if there is none or it no longer runs."""
    if not path.exists():
        return None
    state: dict[str, object] = json.loads(path.read_text())
    pid, properties = int(str(state["pid"])), Path(str(state["properties"]))
    return state if _pid_alive(pid) and _is_our_broker(pid, properties) else None


def state_login(state: Mapping[str, object]) -> SaslLogin | None:
    """The admin login of a secured broker the CLI started (None: PLAINTEXT)."""
    login = state.get("login")
    if not isinstance(login, dict):
        return None
    # State files written before the mechanism was recorded used PLAIN, the default.
    return SaslLogin(login["username"], login["password"], Path(login["cafile"]), Path(login["certfile"]),
                     Path(login["keyfile"]), login.get("mechanism", "PLAIN"))


def stop_state(state: Mapping[str, object]) -> None:
    """Stop the broker a state file describes (SIGTERM, then SIGKILL after ``STOP_TIMEOUT``)."""
    _stop_pid(int(str(state["pid"])), STOP_TIMEOUT)
