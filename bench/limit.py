"""The limit: what the broker and client library give before loopwarden does anything.

Two figures every loopwarden figure is compared with, measured on the same broker in the same run:

- raw consume throughput: an aiokafka group consumer reading the fleet benchmark's telemetry messages
  with ``getmany`` and doing nothing with them (the ceiling of any Python consumer of this topic);
- the Faust ceiling (``bench.faust_ceiling``): the worker's own Faust configuration with an agent that
  does nothing, on the same topic, through faust's per-event path (the ceiling of a stock Faust worker
  of this topic here), and the same through the worker's batch path with a no-op handler (the ceiling of
  the loopwarden worker);
- quixstreams' per-run stateful fold (``bench/quix_fold.py``, in a venv of its own: a labelled
  comparison, not product code): what the simplest per-run fold with RocksDB state and a changelog costs
  a Python team on quixstreams 3.28.1 (confluent-kafka) reading the same messages on the same broker;
- produce-to-consume round trip of one message with latency-oriented settings (no linger, short
  fetch wait): the floor of any halt latency, which needs two such trips (telemetry in, decision out).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from .loadgen import LoadGen
from .stats import percentiles, progress

PARTITIONS = 8


async def fill_topic(bootstrap: str, topic: str, template: Path, count: int) -> None:
    """Produce ``count`` corpus messages to ``topic`` as fast as the load generator can."""
    gen = LoadGen(bootstrap, topic, template, rate=count * 1000.0, duration_s=0.001, prefix="raw")
    await gen.prepare()
    await gen.go()
    final = await gen.wait()
    if final["acked"] != count:
        raise RuntimeError(f"filling {topic}: {final['acked']} of {count} messages acknowledged")


async def consume_rate(bootstrap: str, topic: str, count: int) -> float:
    """Messages per second for a fresh group consumer to ``getmany`` all ``count`` messages, timed from
    the first batch (group join excluded)."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=f"raw-{uuid.uuid4().hex[:8]}",
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        seen = 0
        started: float | None = None
        deadline = time.monotonic() + 120
        while seen < count and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            if batches and started is None:
                started = time.perf_counter()
            seen += sum(len(records) for records in batches.values())
        if seen < count or started is None:
            raise RuntimeError(f"raw consume: {seen} of {count} messages in 120 s")
        return count / (time.perf_counter() - started)
    finally:
        await consumer.stop()


#: Events a Faust ceiling run counts (at a few thousand per second: seconds, not minutes).
FAUST_CEILING_EVENTS = 30_000
#: Events a batch-path ceiling run counts (hundreds of thousands per second).
BATCH_CEILING_EVENTS = 100_000


async def faust_ceiling(bootstrap: str, topic: str, count: int, batch_path: bool = False) -> float:
    """Events per second of ``bench.faust_ceiling`` (``batch_path``: with ``--batch``) reading ``topic``
    from the start (a fresh group)."""
    with tempfile.TemporaryDirectory(prefix="faust-ceiling-") as state:
        env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap, "LOOPWARDEN_TELEMETRY_TOPIC": topic,
               "LOOPWARDEN_APP_ID": f"ceiling-{uuid.uuid4().hex[:8]}", "LOOPWARDEN_PARTITIONS": str(PARTITIONS),
               "LOOPWARDEN_STATE_DIR": state, "LOOPWARDEN_ALLOW_UNSIGNED": "true"}  # it publishes nothing
        # The worker stops itself after printing, but faust's shutdown can hang after the agent has
        # returned, so the process is not waited for beyond a grace period.
        return await _events_per_s("faust ceiling", [sys.executable, "-m", "bench.faust_ceiling", str(count),
                                                     *(["--batch"] if batch_path else [])], env, grace_s=10)


#: The quixstreams comparison's own venv (``make bench`` creates it; quixstreams is no dependency of ours).
QUIX_VERSION = "3.28.1"
QUIX_VENV = Path(__file__).resolve().parent.parent / ".cache" / "quix-venv"


def quix_python() -> Path | None:
    """The quix venv's interpreter, made on first use; None when it cannot be installed (offline)."""
    python = QUIX_VENV / "bin" / "python"
    stamp = QUIX_VENV / f".quixstreams-{QUIX_VERSION}"
    if not stamp.exists():
        progress(f"limit: installing quixstreams {QUIX_VERSION} into {QUIX_VENV} (once)")
        import subprocess

        try:
            subprocess.run([sys.executable, "-m", "venv", str(QUIX_VENV)], check=True, capture_output=True)
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            f"quixstreams=={QUIX_VERSION}"], check=True, capture_output=True)
        except subprocess.CalledProcessError as exc:
            progress(f"limit: quixstreams not installed ({exc.stderr.decode(errors='replace')[-300:]}); no quix row")
            return None
        stamp.touch()
    return python


async def quix_fold(bootstrap: str, topic: str, count: int) -> float:
    """Events per second of ``bench/quix_fold.py`` folding ``topic`` from the start (a fresh group)."""
    python = quix_python()
    if python is None:
        raise RuntimeError("quixstreams is not installed")
    with tempfile.TemporaryDirectory(prefix="quix-state-") as state:
        env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap, "QUIX_TOPIC": topic, "QUIX_STATE_DIR": state}
        return await _events_per_s("quix fold", [str(python), str(Path(__file__).parent / "quix_fold.py"), str(count)],
                                   env, grace_s=20)


async def _events_per_s(name: str, command: list[str], env: dict[str, str], grace_s: float) -> float:
    """Run ``command`` and return ``events_per_s`` from the first JSON line it prints (within 300 s); the
    process is then terminated, and killed after ``grace_s``."""
    process = await asyncio.create_subprocess_exec(*command, env=env, cwd=Path(__file__).parent.parent,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    assert process.stdout is not None
    try:
        async with asyncio.timeout(300):
            while (line := await process.stdout.readline()) and not line.startswith(b"{"):
                pass
    except TimeoutError:
        line = b""
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), grace_s)
            except TimeoutError:
                process.kill()
                await process.wait()
    if not line.startswith(b"{"):
        raise RuntimeError(f"{name}: no result (exit {process.returncode})")
    return float(json.loads(line)["events_per_s"])


async def round_trips(bootstrap: str, topic: str, trips: int, pause_s: float = 0.005) -> list[float]:
    """Milliseconds from ``send`` of one message to a consumer holding it, ``trips`` times in a row."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                fetch_max_wait_ms=5)
    await producer.start()
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)
        arrived: asyncio.Queue[float] = asyncio.Queue()

        async def receive() -> None:
            while True:
                batches = await consumer.getmany(tp, timeout_ms=100)
                now = time.perf_counter()
                for _ in batches.get(tp, ()):
                    arrived.put_nowait(now)

        receiver = asyncio.create_task(receive())
        samples = []
        try:
            for i in range(trips + 20):  # the first 20 warm connections and the fetch session up
                sent = time.perf_counter()
                await producer.send(topic, b"%d" % i, partition=0)
                received = await asyncio.wait_for(arrived.get(), 10)
                if i >= 20:
                    samples.append((received - sent) * 1000)
                await asyncio.sleep(pause_s)
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
        return samples
    finally:
        await consumer.stop()
        await producer.stop()


async def measure(bootstrap: str, name: str, template: Path, messages: int, repeats: int,
                  trips: int) -> dict[str, Any]:
    """The limit figures; ``name`` prefixes the topics (created here)."""
    from .kafka import create_topics

    raw_topic, rtt_topic = f"{name}.raw", f"{name}.rtt"
    create_topics(bootstrap, [(raw_topic, PARTITIONS), (rtt_topic, 1)])
    progress(f"limit: producing {messages:,} corpus messages to {raw_topic}")
    await fill_topic(bootstrap, raw_topic, template, messages)
    rates = []
    for attempt in range(repeats):
        rates.append(await consume_rate(bootstrap, raw_topic, messages))
        progress(f"limit: raw group consume {attempt + 1}/{repeats}: {rates[-1]:,.0f} msg/s")
    ceiling_count = min(messages, FAUST_CEILING_EVENTS)
    ceilings = []
    for attempt in range(repeats):
        ceilings.append(await faust_ceiling(bootstrap, raw_topic, ceiling_count))
        progress(f"limit: faust no-op agent {attempt + 1}/{repeats}: {ceilings[-1]:,.0f} events/s")
    batch_count = min(messages, BATCH_CEILING_EVENTS)
    batch_ceilings = []
    for attempt in range(repeats):
        batch_ceilings.append(await faust_ceiling(bootstrap, raw_topic, batch_count, batch_path=True))
        progress(f"limit: batch path, no-op handler {attempt + 1}/{repeats}: {batch_ceilings[-1]:,.0f} events/s")
    quix: list[float] = []
    if quix_python() is not None:
        for attempt in range(repeats):
            quix.append(await quix_fold(bootstrap, raw_topic, batch_count))
            progress(f"limit: quixstreams per-run fold {attempt + 1}/{repeats}: {quix[-1]:,.0f} events/s")
    rtts: list[dict[str, float]] = []
    for attempt in range(repeats):
        cuts = percentiles(await round_trips(bootstrap, rtt_topic, trips))
        rtts.append(cuts)
        progress(f"limit: round trip {attempt + 1}/{repeats}: p50 {cuts['p50']:.2f} ms, "
                 f"p99 {cuts['p99']:.2f} ms")
    return {
        "messages": messages,
        "partitions": PARTITIONS,
        "consume_msgs_per_s": rates,
        "consume_msgs_per_s_median": statistics.median(rates),
        "faust_ceiling_events": ceiling_count,
        "faust_ceiling_per_s": ceilings,
        "faust_ceiling_per_s_median": statistics.median(ceilings),
        "batch_ceiling_events": batch_count,
        "batch_ceiling_per_s": batch_ceilings,
        "batch_ceiling_per_s_median": statistics.median(batch_ceilings),
        **({"quix_fold_events": batch_count, "quix_fold_per_s": quix, "quix_fold_per_s_median": statistics.median(quix),
            "quix_version": QUIX_VERSION} if quix else {}),
        "round_trip_ms": rtts,
        "round_trip_ms_median": {k: statistics.median(r[k] for r in rtts) for k in rtts[0]},
        "round_trips_per_repeat": trips,
    }
