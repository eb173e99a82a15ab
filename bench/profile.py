"""Where a worker's time goes under load: py-spy samples of the running worker, summarised.

py-spy attaches to the worker process by pid (no restart, no instrumentation; the profile covers exactly
the loaded window) and records the collapsed stack of whichever thread holds the GIL (``--gil``): where
the Python CPU time goes. The summary groups each sample's innermost frame by the library it is in
(self time) and counts samples under a few named stages of the batch path (inclusive time), so
BENCHMARKS.md can say where an event's cost goes.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

#: (label, path fragment of the innermost frame), first match wins.
LAYERS: tuple[tuple[str, str], ...] = (
    ("loopwarden detector core", "stream_app/core/"),
    ("loopwarden worker (batch function, effects, store)", "stream_app/"),
    ("faust RocksDB store", "faust/stores/"),
    ("faust tables (changelog)", "faust/tables/"),
    ("faust streams, agents, conductor", "faust/"),
    ("mode (faust's service framework)", "mode/"),
    ("aiokafka (protocol, producer, fetcher)", "aiokafka/"),
    ("asyncio event loop", "asyncio/"),
    ("logging (disabled debug calls)", "logging/"),
    ("prometheus_client", "prometheus_client/"),
)

#: (label, function names whose presence anywhere in a stack puts the sample in the stage; ``A+B``: both;
#: ``A+!B``: A without B).
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Effects.process (whole batch: fold, state, decisions)", ("Effects.process",)),
    ("  fold by the native engine (NativeBatchFold.fold)", ("NativeBatchFold.fold",)),
    ("  fold by the Python reference (Detector.evaluate)", ("Detector.evaluate",)),
    ("  state read (RocksDB get)", ("RunStore.get",)),
    ("  state write (RocksDB batch + changelog sends)", ("RunStore.write",)),
    ("  publish decisions, wait for acks", ("Effects._publish",)),
    ("  expiry sweep + runs_tracked gauge", ("Effects._sweep",)),
    ("  facts to the facts topic (FactsPublisher.send)", ("FactsPublisher.send",)),
    ("the folds across runs' agent (FleetEffects.process)", ("FleetEffects.process",)),
    ("  their state read and write (RunStore get, write)", ("FleetEffects._process+RunStore.get",
                                                             "FleetEffects._process+RunStore.write")),
    ("batch delivery (BatchConsumer.getmany, sink, sequencer)", ("BatchConsumer.getmany", "BatchSink.offer",
                                                                 "BatchSink.next", "Sequencer.admit")),
    ("  records read from fetch responses (aiokafka's Fetcher.fetched_records)", ("Fetcher.fetched_records",)),
    ("standby changelog writes (StandbyApplier)", ("StandbyApplier.apply",)),
    # faust's drain loop is BatchConsumer.getmany's caller: only its own work is the per-message path
    ("faust per-message path (conductor, streams)", ("Consumer._drain_messages+!BatchConsumer.getmany",
                                                     "Stream._c_aiter", "Conductor._compile_message_handler")),
    ("faust producer buffer (decisions, DLQ)", ("ProducerBuffer._handle_pending", "ProducerBuffer.flush_atmost",
                                         "ProducerBuffer.wait_until_ebb")),
    ("aiokafka producer sender", ("Sender._sender_routine", "SendProduceReqHandler.do")),
    ("aiokafka fetcher", ("Fetcher._fetch_requests_routine", "Fetcher._proc_fetch_request")),
    ("offset commit", ("Consumer.commit", "Consumer._commit", "Consumer.maybe_wait_for_commit_to_finish")),
)


def available() -> bool:
    return shutil.which("py-spy") is not None or (Path(sys.executable).parent / "py-spy").exists()


async def record(pid: int, duration_s: float, out: Path, rate_hz: int = 100) -> Path:
    """Record ``duration_s`` of collapsed stacks (the GIL holder's) of ``pid`` into ``out``."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    proc = await asyncio.create_subprocess_exec(
        exe, "record", "--pid", str(pid), "--duration", str(int(duration_s)), "--rate", str(rate_hz),
        "--format", "raw", "--gil", "--nonblocking", "--output", str(out),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy failed ({proc.returncode}): {err.decode(errors='replace')[-500:]}")
    return out


def _frame_path(frame: str) -> str:
    """``func (path/to/file.py:12)`` -> ``path/to/file.py``."""
    _, _, where = frame.rpartition(" (")
    return where.rpartition(":")[0]


def summarise(raw: Path, events: int, top: int = 12) -> dict[str, Any]:
    """Self time by library, inclusive time by stage, and the hottest innermost frames, as shares of
    all samples; ``events`` is the number applied during the recording."""
    layers: Counter[str] = Counter()
    stages: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        samples += count
        path = _frame_path(frames[-1])
        layer = next((label for label, fragment in LAYERS if fragment in path), "other (stdlib, C extensions)")
        layers[layer] += count
        leaves[frames[-1]] += count
        names = {frame.partition(" (")[0] for frame in frames}
        for label, functions in STAGES:
            if any(all((part[1:] not in names) if part.startswith("!") else (part in names)
                       for part in name.split("+")) for name in functions):
                stages[label] += count
    share = {k: v / samples for k, v in layers.most_common()} if samples else {}
    return {
        "samples": samples,
        "events": events,
        "layers": share,
        "stages": {label: stages[label] / samples for label, _ in STAGES} if samples else {},
        "hottest": [(frame, n / samples) for frame, n in leaves.most_common(top)] if samples else [],
    }
