"""A labelled comparison, not product code: quixstreams' per-run stateful fold of the same telemetry.

    .cache/quix-venv/bin/python bench/quix_fold.py COUNT      (KAFKA_BOOTSTRAP_SERVERS, QUIX_TOPIC, QUIX_STATE_DIR)

What a Python team might write instead of loopwarden on quixstreams 3.28.1 (its own venv: it brings
confluent-kafka, whose consumer is librdkafka in C): the telemetry topic read from the start by a fresh
group, each event JSON-decoded and folded into its run's state (RocksDB, with quixstreams' changelog
topic, at-least-once, as shipped), keyed by the message key (the run id): the run's call count and the
streak of identical failing calls, the core rule's count without normalisation, budgets, the other rules,
decisions or signing. Events per second from the event past ``WARM`` to ``COUNT`` go to stdout as JSON.
So the figure bounds from above what the simplest per-run stateful fold costs on that stack; loopwarden's
worker does far more per event.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid

from quixstreams import Application

WARM = 2_000


def main(argv: list[str]) -> int:
    count = int(argv[0])
    app = Application(broker_address=os.environ["KAFKA_BOOTSTRAP_SERVERS"],
                      consumer_group=f"quix-{uuid.uuid4().hex[:8]}", auto_offset_reset="earliest",
                      state_dir=os.environ.get("QUIX_STATE_DIR", "/tmp/quix-state"), loglevel="WARNING")
    topic = app.topic(os.environ["QUIX_TOPIC"], key_deserializer="bytes", value_deserializer="json")
    seen = base = 0
    started = 0.0

    def fold(event: dict, state) -> None:  # type: ignore[no-untyped-def, type-arg]
        nonlocal seen, base, started
        # the call and its outcome, as canonical JSON (sorted keys): the identity the streak compares
        last = [event.get("tool"), json.dumps(event.get("args"), sort_keys=True), event.get("outcome"),
                json.dumps(event.get("result"), sort_keys=True)]
        failing = event.get("outcome") != "success"
        same = failing and state.get("last") == last
        state.set("calls", state.get("calls", 0) + 1)
        state.set("streak", state.get("streak", 0) + 1 if same else (1 if failing else 0))
        state.set("last", last)
        seen += 1
        if seen == WARM:
            base, started = seen, time.perf_counter()
        elif seen == count:
            print(json.dumps({"events_per_s": (seen - base) / (time.perf_counter() - started)}), flush=True)
            app.stop()

    app.dataframe(topic).update(fold, stateful=True)
    app.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
