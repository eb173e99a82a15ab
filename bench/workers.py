"""Real loopwarden workers for the benchmarks: ``python -m stream_app worker`` subprocesses.

A ``Deployment`` is one isolated loopwarden (its own app id, topics, RocksDB state dirs and metrics
ports) on the bench broker, configured only through the worker's documented environment variables, so
a setting the benchmarks recommend is one an operator can set. Progress and lag are read from each
worker's Prometheus endpoint, as an operator would; CPU time from ``/proc``.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from stream_app.signing import KeyRing, ensure_pairs

REPO = Path(__file__).resolve().parent.parent
_COMMIT_OVERLAP = re.compile(r"Timer commit is overlapping \(interval=[\d.]+ runtime=([\d.]+)\)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition as {'name{labels}': value}."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def total(samples: dict[str, float], metric: str) -> float:
    """Sum of every labelled sample of ``metric``."""
    return sum(v for k, v in samples.items() if k == metric or k.startswith(metric + "{"))


@dataclass
class Worker:
    """One worker process, its metrics port and its log."""

    process: subprocess.Popen[bytes]
    metrics_port: int
    log_path: Path

    def scrape(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return parse_metrics(response.read().decode())

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the worker process has used so far (Linux /proc)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def commit_overruns(self) -> dict[str, float]:
        """faust's "Timer commit is overlapping" warnings in the log so far: how many, and the longest
        commit they report, in seconds (a commit flushes the changelog buffer first)."""
        runtimes = [float(m) for m in _COMMIT_OVERLAP.findall(self.log_path.read_text(errors="replace"))]
        return {"count": len(runtimes), "max_s": max(runtimes, default=0.0)}

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if (await asyncio.to_thread(self.scrape)).get("loopwarden_worker_ready") == 1:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError(f"worker not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


@dataclass
class Deployment:
    """One isolated loopwarden deployment (a consumer group of workers) on the bench broker."""

    bootstrap: str
    workdir: Path
    partitions: int = 8
    env: dict[str, str] = field(default_factory=dict)
    name: str = field(default_factory=lambda: f"bench-{uuid.uuid4().hex[:8]}")
    workers: list[Worker] = field(default_factory=list)

    @property
    def telemetry_topic(self) -> str:
        return f"{self.name}.telemetry"

    @property
    def control_topic(self) -> str:
        return f"{self.name}.control"

    @property
    def keys(self) -> Path:
        """The deployment's worker key pair (signs decisions), generated on first use."""
        return ensure_pairs(self.workdir / self.name / "keys", "worker")

    def trusted_keys(self) -> KeyRing:
        return KeyRing.from_paths([self.keys / "worker.pub"])

    def _env(self, index: int, metrics_port: int) -> dict[str, str]:
        return {
            **os.environ,
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "LOOPWARDEN_APP_ID": self.name,
            "LOOPWARDEN_TELEMETRY_TOPIC": self.telemetry_topic,
            "LOOPWARDEN_CONTROL_TOPIC": self.control_topic,
            "LOOPWARDEN_ALERTS_TOPIC": f"{self.name}.alerts",
            "LOOPWARDEN_DLQ_TOPIC": f"{self.name}.dlq",
            "LOOPWARDEN_PARTITIONS": str(self.partitions),
            "LOOPWARDEN_STATE_DIR": str(self.workdir / self.name / f"state-{index}"),
            "LOOPWARDEN_METRICS_PORT": str(metrics_port),
            "LOOPWARDEN_METRICS_HOST": "127.0.0.1",
            "LOOPWARDEN_SIGNING_KEY": str(self.keys / "worker.key"),
            **self.env,
        }

    async def start_worker(self) -> Worker:
        """Start one more worker in the group and wait until it is ready."""
        index = len(self.workers)
        port = free_port()
        (self.workdir / self.name).mkdir(parents=True, exist_ok=True)
        log_path = self.workdir / self.name / f"worker-{index}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen([sys.executable, "-m", "stream_app", "worker"], cwd=REPO,
                                       env=self._env(index, port), stdout=log, stderr=subprocess.STDOUT)
        worker = Worker(process, port, log_path)
        self.workers.append(worker)
        await worker.wait_ready()
        return worker

    async def scrape(self) -> list[dict[str, float]]:
        return list(await asyncio.gather(*(asyncio.to_thread(w.scrape) for w in self.workers)))

    async def processed(self) -> int:
        """Telemetry messages the group has applied or skipped as duplicates."""
        samples = await self.scrape()
        return int(sum(total(s, "loopwarden_events_total") + total(s, "loopwarden_duplicate_events_total")
                       for s in samples))

    async def progress(self) -> tuple[int, int]:
        """(messages processed, consumer lag summed over partitions) of the whole group."""
        samples = await self.scrape()
        processed = sum(total(s, "loopwarden_events_total") + total(s, "loopwarden_duplicate_events_total")
                        for s in samples)
        return int(processed), int(sum(total(s, "loopwarden_consumer_lag") for s in samples))

    async def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until the group has applied nothing new for a second (its backlog is gone)."""
        deadline = time.monotonic() + timeout_s
        last, quiet_since = -1, time.monotonic()
        while time.monotonic() < deadline:
            processed = await self.processed()
            if processed != last:
                last, quiet_since = processed, time.monotonic()
            elif time.monotonic() - quiet_since >= 1.0:
                return
            await asyncio.sleep(0.25)

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers.clear()
        for state in (self.workdir / self.name).glob("state-*"):
            shutil.rmtree(state, ignore_errors=True)
