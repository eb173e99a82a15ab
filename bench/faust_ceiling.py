"""The framework ceilings: loopwarden's exact Faust configuration with an input that does nothing.

    python -m bench.faust_ceiling COUNT [--batch]     (worker settings from the LOOPWARDEN_* environment)

Without ``--batch``: faust's stock per-event path, an agent that takes the topic with ``take_events``
(``LOOPWARDEN_BATCH_MAX`` events, a 5 ms window: the worker's path until the batch path replaced it) and
only counts; offsets acknowledged and committed as faust does. With ``--batch``: the worker's own batch
path (``stream_app.worker.delivery``: the consumer hands fetched records to a sink the agent drains, in
sequence, acknowledged in bulk) with a handler that only counts. Events per second from the first batch
past ``WARM`` events to ``COUNT`` go to stdout as JSON, then the worker stops itself. What separates these
figures from raw aiokafka consume is the framework's delivery; what separates the loopwarden worker
from the batch figure is the worker's own work (decode, state, detector, changelog, decisions).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from stream_app.worker import delivery
from stream_app.worker.app import configured_app, telemetry_topic
from stream_app.worker.main import serve
from stream_app.worker.settings import WorkerSettings

WARM = 2_000
#: The stock path's batch window (the worker's default before the batch path).
WITHIN_S = 0.005


def main(argv: list[str]) -> int:
    count = int(argv[0])
    batch_path = "--batch" in argv[1:]
    if count <= WARM:
        raise SystemExit(f"COUNT must be above {WARM}")
    settings = WorkerSettings.from_env()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    app = configured_app(settings)
    seen = base = 0
    started = 0.0

    def counted(n: int) -> bool:
        """Count ``n`` more events; True once ``count`` are counted (the result is printed)."""
        nonlocal seen, base, started
        seen += n
        if not started and seen >= WARM:
            base, started = seen, time.perf_counter()
        elif started and seen >= count:
            print(json.dumps({"events_per_s": (seen - base) / (time.perf_counter() - started)}), flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return True
        return False

    topic = telemetry_topic(app, settings)
    if batch_path:
        sink = delivery.BatchSink(settings.telemetry_topic, settings.batch_max, lambda n: None)
        delivery.install(app, [sink], lambda: None)
        fatal = delivery.FatalStop()

        async def count_batch(records: Sequence[Any]) -> None:
            counted(len(records))

        @app.agent(topic, concurrency=1)
        async def count_batches(stream):  # type: ignore[no-untyped-def]
            await delivery.drain(app, sink, fatal, count_batch, lambda n: None)
    else:
        @app.agent(topic, concurrency=1)
        async def count_only(stream):  # type: ignore[no-untyped-def]
            async for batch in stream.take_events(settings.batch_max, within=WITHIN_S):
                if counted(len(batch)):
                    return

    serve(app, "WARNING", on_ready=lambda: None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
