"""The Faust ceiling: a worker with loopwarden's exact Faust configuration whose agent does nothing.

    python -m bench.faust_ceiling COUNT     (worker settings from the LOOPWARDEN_* environment)

The agent takes the topic in the worker's batches (``take_events``, same size and window) and only
counts; offsets are acknowledged and committed as in the worker. Events per second from the first
batch past ``WARM`` events to ``COUNT`` go to stdout as JSON, then the worker stops itself. What separates
this figure from raw aiokafka consume is Faust's per-event delivery path; what separates the loopwarden
worker from it is the worker's own work (decode, state, detector, changelog, decisions).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from stream_app.worker.app import configured_app, telemetry_topic
from stream_app.worker.main import serve
from stream_app.worker.settings import WorkerSettings

WARM = 2_000


def main(argv: list[str]) -> int:
    count = int(argv[0])
    if count <= WARM:
        raise SystemExit(f"COUNT must be above {WARM}")
    settings = WorkerSettings.from_env()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    app = configured_app(settings)
    seen = base = 0
    started = 0.0

    @app.agent(telemetry_topic(app, settings), concurrency=1)
    async def count_only(stream):  # type: ignore[no-untyped-def]
        nonlocal seen, base, started
        async for batch in stream.take_events(settings.batch_max, within=settings.batch_within_s):
            seen += len(batch)
            if not started and seen >= WARM:
                base, started = seen, time.perf_counter()
            elif started and seen >= count:
                print(json.dumps({"events_per_s": (seen - base) / (time.perf_counter() - started)}), flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    serve(app, "WARNING", on_ready=lambda: None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
