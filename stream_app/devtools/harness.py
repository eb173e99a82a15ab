"""Real worker processes for the demo, the tests and the benchmarks: isolated deployments on one broker.

A ``Deployment`` is one loopwarden (a consumer group of workers) with its own app id, topic names,
RocksDB state dirs, key pairs and metrics ports, so any number of them share a broker without sharing
anything else. Workers run as ``python -m stream_app worker`` subprocesses, the way an operator runs
them, so they can be stopped, SIGKILLed and restarted on their state. Their ``LOOPWARDEN_*``
environment is built from the worker's settings table (``SETTINGS.env``) here and nowhere else, so a
harness can only set what an operator can. Readiness and progress are read from each worker's
Prometheus endpoint, as an operator would; CPU time from ``/proc``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..bus.signing import KeyRing, ensure_pairs
from ..core import LoopwardenError
from ..worker.settings import SETTINGS, SettingsError

#: The readiness gauge a worker sets once it has recovered its state and consumes.
READY_METRIC = "loopwarden_worker_ready"


class WorkerStartError(LoopwardenError, RuntimeError):
    """A worker process exited or did not become ready; the message ends with its log's tail."""


def free_port(avoid: Collection[int] = ()) -> int:
    """A TCP port on loopback that was free a moment ago, not one of ``avoid`` (ports handed out before and
    maybe not bound yet: the system may hand out a port again as soon as its probe socket is closed)."""
    return free_ports(1, avoid)[0]


def free_ports(count: int, avoid: Collection[int] = ()) -> list[int]:
    """``count`` distinct TCP ports on loopback that were free a moment ago, none of ``avoid``: their probe
    sockets are held open together, so two calls of ``free_port`` in a row cannot return one port twice."""
    sockets: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < count:
            sock = socket.socket()
            sockets.append(sock)
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if port not in avoid:
                ports.append(port)
        return ports
    finally:
        for sock in sockets:
            sock.close()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition as ``{'name{labels}': value}``."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def metric_total(samples: Mapping[str, float], metric: str) -> float:
    """The sum of every labelled sample of ``metric``."""
    return sum(v for k, v in samples.items() if k == metric or k.startswith(metric + "{"))


@dataclass
class WorkerProcess:
    """One worker process, its metrics port and its log."""

    process: subprocess.Popen[bytes]
    metrics_port: int
    log_path: Path

    def metrics(self) -> dict[str, float]:
        """The worker's metrics now (raises OSError while its endpoint is not up)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return parse_metrics(response.read().decode())

    def cpu_s(self) -> float:
        """CPU seconds (user + system, all threads) the process has used so far (Linux /proc)."""
        stat = Path(f"/proc/{self.process.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mb(self, peak: bool = False) -> float:
        """Resident memory of the process now (``peak``: its high-water mark), MiB (Linux /proc)."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        field = "VmHWM:" if peak else "VmRSS:"
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field))) / 1024

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def is_ready(self) -> bool:
        """Whether the worker reports ready; raises WorkerStartError if it exited."""
        if self.process.poll() is not None:
            raise WorkerStartError(f"worker exited with {self.process.returncode}; log {self.log_path}:\n"
                                   f"{self.log_tail()}")
        try:
            return self.metrics().get(READY_METRIC) == 1
        except OSError:
            return False

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            if time.monotonic() > deadline:
                raise self._not_ready(timeout_s)
            time.sleep(0.2)

    async def wait_ready_async(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(self.is_ready):
            if time.monotonic() > deadline:
                raise self._not_ready(timeout_s)
            await asyncio.sleep(0.2)

    def _not_ready(self, timeout_s: float) -> WorkerStartError:
        return WorkerStartError(f"worker not ready after {timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush, no commit."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (a graceful shutdown), then SIGKILL after ``timeout_s``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Deployment:
    """One isolated loopwarden deployment (a consumer group of workers) on a shared broker.

    ``settings`` are worker settings by field name (``worker.settings.SETTINGS``), over the harness's
    own (names, topics, partitions, state dir, metrics port, keys); ``env`` holds variables that are
    not worker settings (``KAFKA_*`` credentials, faust's own), never a ``LOOPWARDEN_*`` one.
    """

    bootstrap: str
    workdir: Path
    partitions: int = 4
    settings: dict[str, object] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    name: str = field(default_factory=lambda: f"lw-{uuid.uuid4().hex[:10]}")
    workers: list[WorkerProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        stray = sorted(var for var in self.env if var.startswith("LOOPWARDEN_"))
        if stray:
            raise SettingsError(f"{', '.join(stray)}: pass worker settings by field name in settings=, not env=")
        SETTINGS.env(**self.settings)  # an unknown field name fails here, not in a worker

    @property
    def root(self) -> Path:
        """Where this deployment's state, logs and keys live."""
        return self.workdir / self.name

    @property
    def telemetry_topic(self) -> str:
        return f"{self.name}.telemetry"

    @property
    def control_topic(self) -> str:
        return f"{self.name}.control"

    @property
    def alerts_topic(self) -> str:
        return f"{self.name}.alerts"

    @property
    def dlq_topic(self) -> str:
        return f"{self.name}.dlq"

    @property
    def changelog_topic(self) -> str:
        return f"{self.name}-runs-changelog"

    @property
    def facts_topic(self) -> str:
        return f"{self.name}.facts"

    @property
    def scopes_topic(self) -> str:
        return f"{self.name}.scopes"

    @property
    def keys(self) -> Path:
        """The deployment's key pairs, generated on first use as ``loopwarden keys generate`` would:
        ``worker`` signs control messages, ``operator`` signs ``loopwarden halt|resume``."""
        return ensure_pairs(self.root / "keys", "worker", "operator")

    def trusted_keys(self) -> KeyRing:
        """What a runtime of this deployment trusts: the workers' public key."""
        return KeyRing.from_paths([self.keys / "worker.pub"])

    def worker_env(self, index: int, metrics_port: int) -> dict[str, str]:
        """The whole environment of worker ``index``."""
        own: dict[str, object] = {
            "app_id": self.name,
            "telemetry_topic": self.telemetry_topic,
            "control_topic": self.control_topic,
            "alerts_topic": self.alerts_topic,
            "dlq_topic": self.dlq_topic,
            "facts_topic": self.facts_topic,
            "scopes_topic": self.scopes_topic,
            "partitions": self.partitions,
            "state_dir": self.root / f"state-{index}",
            "metrics_port": metrics_port,
            "metrics_host": "127.0.0.1",
            "signing_key": self.keys / "worker.key",
            "operator_keys": self.keys / "operator.pub",
        }
        return {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap, **self.env,
                **SETTINGS.env(**{**own, **self.settings})}

    def start_worker(self, index: int | None = None, wait: bool = True) -> WorkerProcess:
        """Start one more worker (``index``: whose state dir it uses, default a new one); with ``wait``,
        return once it is ready."""
        worker = self._spawn(index)
        if wait:
            worker.wait_ready()
        return worker

    async def start_worker_async(self, index: int | None = None) -> WorkerProcess:
        """``start_worker`` for code running in an event loop."""
        worker = self._spawn(index)
        await worker.wait_ready_async()
        return worker

    def _spawn(self, index: int | None) -> WorkerProcess:
        index = len(self.workers) if index is None else index
        port = free_port(avoid={worker.metrics_port for worker in self.workers})  # a worker just started may not listen yet
        self.root.mkdir(parents=True, exist_ok=True)
        log_path = self.root / f"worker-{index}-{len(self.workers)}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen([sys.executable, "-m", "stream_app", "worker"],
                                       env=self.worker_env(index, port), stdout=log, stderr=subprocess.STDOUT)
        worker = WorkerProcess(process, port, log_path)
        self.workers.append(worker)
        return worker

    def scrape(self) -> list[dict[str, float]]:
        """Every live worker's metrics."""
        return [worker.metrics() for worker in self.workers if worker.process.poll() is None]

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()
