"""Input found to stop a real worker, fed to one on the real broker: each goes to the dead-letter topic
or folds harmlessly, the worker stays up and still halts the runaway sent after them."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest

from stream_app.bus.wire import header

from .workers import Fleet, consume, decisions_of, produce, produce_raw, run

pytestmark = pytest.mark.integration

YEAR_10000 = 253_402_300_800_000
YEAR_9999 = 253_402_300_799_000


def test_input_that_stopped_a_worker_is_dead_lettered_and_the_worker_goes_on(kafka_bootstrap: str,
                                                                              tmp_path: Path) -> None:
    """One partition, the rules across runs on. In: a failing result nested 500 levels deep (it crashed the
    telemetry agent on every restart); a sub-agent's event in year 10000 (its tree halt's CloudEvents time
    crashed the facts agent, then the worker hung stopping); forged tool facts summing past 64 bits (the
    facts agent crashed storing them); one event dated in year 9999, valid (the partition's sweep then
    forgot every run after each batch). Then a runaway at the wall clock's time: halted at its 4th call."""
    fleet = Fleet(kafka_bootstrap, tmp_path, partitions=1, settings={"fleet_rules": True})
    worker = fleet.start_worker()
    try:
        deep = b"[" * 500 + b'"boom"' + b"]" * 500
        nested = orjson.dumps({"run_id": "deep", "event_id": "d1", "tool": "t", "ts_ms": 1_764_000_000_000,
                               "outcome": "error", "args": {}, "result": "?"}).replace(b'"?"', deep)
        far = {"run_id": "far-kid", "parent_run_id": "far", "root_run_id": "far", "depth": 10_000, "event_id": "f1",
               "tool": "t", "ts_ms": YEAR_10000, "outcome": "success", "args": {}, "result": "ok"}
        broken_clock = {"run_id": "broken-clock", "event_id": "b1", "tool": "t", "ts_ms": YEAR_9999,
                        "outcome": "success", "args": {}, "result": 1}
        run(produce_raw(kafka_bootstrap, fleet.telemetry_topic,
                        [(b"deep", nested), (b"far-kid", orjson.dumps(far)), (b"broken-clock", orjson.dumps(broken_clock))]))
        forged = orjson.dumps({"v": 1, "tools": [
            [0, n, "", "ovf", "u", 1_796_508_840_000, "e", "r", 1_796_508_850_443, 2**64 - 1, 0, -1, 0, [], [n], []]
            for n in (1, 2)]})
        run(produce_raw(kafka_bootstrap, fleet.facts_topic, [(b"tool//ovf/u", forged)]))
        now = int(time.time() * 1000)
        for n in range(1, 5):  # a batch a call: each batch is swept after the one dated 9999
            run(produce(kafka_bootstrap, fleet.telemetry_topic, [
                {"run_id": "runaway", "event_id": f"r{n}", "tool": "deploy", "ts_ms": now + n, "outcome": "error",
                 "args": {"env": "prod"}, "result": "permission denied"}]))
            time.sleep(0.6)
        control = decisions_of(run(consume(kafka_bootstrap, fleet.control_topic, 2, timeout=30.0)))
        dlq = run(consume(kafka_bootstrap, fleet.dlq_topic, 2, timeout=30.0, settle=1.0))
        assert worker.process.poll() is None, worker.log_tail()
        log = worker.log_path.read_text()
    finally:
        fleet.stop()
    assert [(d["action"], d["run_id"]) for d in control] == [("advise", "runaway"), ("halt", "runaway")]
    reasons = sorted((header(r.headers, "source_topic").decode(), header(r.headers, "error_field").decode(),
                      header(r.headers, "error").decode()) for r in dlq)
    assert [(topic.rsplit(".", 1)[-1], field) for topic, field, _ in reasons] == [("facts", ""), ("telemetry", "ts_ms")]
    assert "loopwarden failed on this record (TypeError" in reasons[0][2]
    assert "Crashed" not in log and "stopping the worker" not in log
