"""Open-loop telemetry producer, run as its own process so it never shares an event loop with consumers.

    python -m bench.loadgen --bootstrap HOST:PORT --topic T --template FILE --rate 5000 --duration 15 --prefix s1

Open loop: the schedule is fixed in advance (``rate`` events per second from the start), and the
producer sends whatever is due whether or not the workers keep up, the way a fleet of runtimes does.
Everything is serialised and partitioned (aiokafka's default partitioner, as ``send`` would) before the
start; every ``TICK_S`` what is due goes out as one record batch per partition through aiokafka's batch
API, the batches a 5 ms linger makes, at a third of ``send``'s CPU per message (11-12 vs 31-33 us at
17,700 events/s here): the generator stands in for runtimes on other machines, so the less of this
machine it takes, the less it disturbs what is measured. The process prints one JSON line when ready,
waits for ``go`` on stdin, prints progress lines (``sent``, ``acked``, ``behind``: events due but not yet sent)
every ``--report-s`` and a last line with ``"done": true``. ``LoadGen`` is the controller's side.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .corpus import read_template, records

#: How often what is due is sent: the linger of the producers it stands in for.
TICK_S = 0.005


async def produce(args: argparse.Namespace) -> None:
    """Prepare, wait for ``go``, then send on schedule and report."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.partitioner import DefaultPartitioner

    count = int(args.rate * args.duration)
    messages = list(records(read_template(args.template), count, args.prefix))
    # Stands in for many runtimes' SDK producers (acks=all, idempotent), with bigger batches so one
    # process can carry a fleet's traffic.
    producer = AIOKafkaProducer(bootstrap_servers=args.bootstrap, acks="all", enable_idempotence=True,
                                linger_ms=5, max_batch_size=256 * 1024)
    await producer.start()
    acked = failed = 0

    def delivered(size: int, future: asyncio.Future[Any]) -> None:
        nonlocal acked, failed
        if future.cancelled() or future.exception() is not None:
            failed += size
        else:
            acked += size

    async def ship(batch: Any, size: int, partition: int) -> None:
        (await producer.send_batch(batch, args.topic, partition=partition)).add_done_callback(
            functools.partial(delivered, size))

    try:
        partitions = sorted(await producer.partitions_for(args.topic))
        partitioner = DefaultPartitioner()
        partition_of = [partitioner(key, partitions, partitions) for key, _ in messages]
        _emit({"ready": True, "events": count})
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        start = time.monotonic()
        cpu_start = _cpu_s()
        next_report = start + args.report_s
        sent = behind_max = 0
        while sent < count:
            now = time.monotonic()
            due = min(count, int(args.rate * (now - start)))
            behind_max = max(behind_max, due - sent)
            batches: dict[int, tuple[Any, int]] = {}  # partition -> (its batch, messages in it)
            while sent < due:
                key, value = messages[sent]
                partition = partition_of[sent]
                batch, size = batches.get(partition) or (producer.create_batch(), 0)
                if batch.append(key=key, value=value, timestamp=None) is None:  # full: send it, start another
                    await ship(batch, size, partition)
                    batch, size = producer.create_batch(), 0
                    batch.append(key=key, value=value, timestamp=None)
                batches[partition] = (batch, size + 1)
                sent += 1
            for partition, (batch, size) in batches.items():
                await ship(batch, size, partition)
            if now >= next_report:
                _emit({"t": time.time(), "sent": sent, "acked": acked, "behind": due - sent})
                next_report += args.report_s
            await asyncio.sleep(TICK_S)
        send_s = time.monotonic() - start
        await producer.flush()
        _emit({"t": time.time(), "done": True, "sent": sent, "acked": acked, "failed": failed,
               "send_s": send_s, "behind_max": behind_max, "cpu_s": _cpu_s() - cpu_start})
    finally:
        await producer.stop()


def _cpu_s() -> float:
    """CPU seconds of this process, all threads (aiokafka's sender included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(orjson.dumps(obj).decode() + "\n")
    sys.stdout.flush()


@dataclass
class LoadGen:
    """Controller side: starts the producer process, says go, and follows its progress lines."""

    bootstrap: str
    topic: str
    template: Path
    rate: float
    duration_s: float
    prefix: str
    progress: list[dict[str, Any]] = field(default_factory=list)
    _proc: asyncio.subprocess.Process | None = None
    _reader: asyncio.Task[None] | None = None

    async def prepare(self) -> None:
        """Start the process and wait until its messages are built and its producer connected."""
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.loadgen", "--bootstrap", self.bootstrap, "--topic", self.topic,
            "--template", str(self.template), "--rate", str(self.rate), "--duration", str(self.duration_s),
            "--prefix", self.prefix, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert self._proc.stdout is not None
        line = await asyncio.wait_for(self._proc.stdout.readline(), 120)
        if not line:
            raise RuntimeError(f"bench.loadgen exited before it was ready (status {await self._proc.wait()})")

    async def go(self) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(b"go\n")
        await self._proc.stdin.drain()
        self._reader = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        async for line in self._proc.stdout:
            self.progress.append(orjson.loads(line))

    @property
    def acked(self) -> int:
        return int(self.progress[-1]["acked"]) if self.progress else 0

    @property
    def done(self) -> bool:
        return bool(self.progress) and bool(self.progress[-1].get("done"))

    async def wait(self) -> dict[str, Any]:
        """Wait for the end; return the final line."""
        assert self._proc is not None and self._reader is not None
        await self._reader
        status = await self._proc.wait()
        if status != 0 or not self.done:
            raise RuntimeError(f"bench.loadgen failed (status {status})")
        return self.progress[-1]

    async def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--template", type=Path, required=True)
    parser.add_argument("--rate", type=float, required=True, help="events per second")
    parser.add_argument("--duration", type=float, required=True, help="seconds")
    parser.add_argument("--prefix", required=True, help="run-id prefix of this load (fresh runs)")
    parser.add_argument("--report-s", type=float, default=0.5)
    asyncio.run(produce(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
