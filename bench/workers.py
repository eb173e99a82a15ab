"""The benchmarks' worker deployments: the harness's (``stream_app.devtools.harness``) with progress read
the way an operator reads it, from every worker's Prometheus endpoint, from inside the event loop.

A deployment is configured only through the worker's documented settings, so a setting the benchmarks
recommend is one an operator can set.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka.admin import AIOKafkaAdminClient

from stream_app.devtools.harness import Deployment, WorkerProcess, metric_total

REPO = Path(__file__).resolve().parent.parent
_COMMIT_OVERLAP = re.compile(r"Timer commit is overlapping \(interval=[\d.]+ runtime=([\d.]+)\)")


def commit_overruns(worker: WorkerProcess) -> dict[str, float]:
    """faust's "Timer commit is overlapping" warnings in the worker's log so far: how many, and the
    longest commit they report, in seconds (a commit flushes the changelog buffer first)."""
    runtimes = [float(m) for m in _COMMIT_OVERLAP.findall(worker.log_path.read_text(errors="replace"))]
    return {"count": len(runtimes), "max_s": max(runtimes, default=0.0)}


@dataclass
class BenchDeployment(Deployment):
    """A deployment on the bench broker, 8 partitions as shipped, its state removed when stopped."""

    partitions: int = 8
    name: str = field(default_factory=lambda: f"bench-{uuid.uuid4().hex[:8]}")

    async def scrape_async(self) -> list[dict[str, float]]:
        return list(await asyncio.gather(*(asyncio.to_thread(w.metrics) for w in self.workers)))

    async def progress(self) -> tuple[int, int]:
        """(telemetry messages applied or skipped as duplicates, consumer lag summed over partitions)."""
        samples = await self.scrape_async()
        processed = sum(metric_total(s, "loopwarden_events_total") + metric_total(s, "loopwarden_duplicate_events_total")
                        for s in samples)
        return int(processed), int(sum(metric_total(s, "loopwarden_consumer_lag") for s in samples))

    async def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until the group has applied nothing new for a second (its backlog is gone)."""
        deadline = time.monotonic() + timeout_s
        last, quiet_since = -1, time.monotonic()
        while time.monotonic() < deadline:
            processed, _ = await self.progress()
            if processed != last:
                last, quiet_since = processed, time.monotonic()
            elif time.monotonic() - quiet_since >= 1.0:
                return
            await asyncio.sleep(0.25)

    def stop(self) -> None:
        super().stop()
        self.workers.clear()
        for state in self.root.glob("state-*"):
            shutil.rmtree(state, ignore_errors=True)
        # Its topics too: probes in a row otherwise meet a broker with ever more logs to keep and compact
        # (the last probes of a configuration with more topics got slower, round after round).
        thread = threading.Thread(target=asyncio.run, args=(_delete_topics(self.bootstrap, self.name),))
        thread.start()
        thread.join()


async def _delete_topics(bootstrap: str, prefix: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        topics = [topic for topic in await admin.list_topics() if topic.startswith(prefix)]
        if topics:
            await admin.delete_topics(topics)
    finally:
        await admin.close()
