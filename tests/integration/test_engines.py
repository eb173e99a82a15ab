"""Mixed engines on the real broker: a worker folding with one engine hands its state (RocksDB and the
changelog) to a worker folding with the other, in both directions, and the decisions are replay's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from stream_app.core import Detector, RunTable, decode_event
from stream_app.devtools.fleet_sim import simulate_fleet
from stream_app.devtools.harness import WorkerProcess, metric_total

from .workers import Fleet, consume, decisions_of, produce, run

pytestmark = pytest.mark.integration


def _applied(worker: WorkerProcess) -> float:
    samples = worker.metrics()
    return metric_total(samples, "loopwarden_events_total") + metric_total(samples, "loopwarden_duplicate_events_total")


@pytest.mark.parametrize(("first", "then"), [("python", "native"), ("native", "python")])
@pytest.mark.parametrize("state", ["local", "changelog"])
def test_a_worker_of_the_other_engine_goes_on_from_the_state_one_engine_wrote(
        kafka_bootstrap: str, tmp_path: Path, first: str, then: str, state: str) -> None:
    """Half the corpus folded by ``first``, the worker stopped; the other half by ``then`` on the same
    local state (``local``) or on none, recovered from the changelog (``changelog``). The runs that span
    the switch continue where they were: every decision equals replay's, none is published twice."""
    pytest.importorskip("loopwarden_native")
    _, stream = simulate_fleet(300, seed=31)
    half = len(stream) // 2
    table = RunTable(Detector())
    expected = {d.decision_id: d.to_control() for raw in stream for d in table.observe(decode_event(raw)).decisions}
    assert any(d["action"] == "halt" for d in expected.values())
    # runs with events on both sides of the switch: the second engine reads what the first wrote
    spanning = {e["run_id"] for e in stream[:half]} & {e["run_id"] for e in stream[half:]}
    assert len(spanning) > 50
    fleet = Fleet(kafka_bootstrap, tmp_path, partitions=4, settings={"engine": first})
    try:
        worker = fleet.start_worker(0)
        assert worker.metrics().get(f'loopwarden_engine_info{{engine="{first}"}}') == 1
        run(produce(fleet.bootstrap, fleet.telemetry_topic, stream[:half]))
        deadline = time.monotonic() + 60
        while _applied(worker) < half and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _applied(worker) == half
        worker.stop()  # graceful: commits what it processed
        fleet.settings["engine"] = then
        second = fleet.start_worker(0 if state == "local" else 1)
        assert second.metrics().get(f'loopwarden_engine_info{{engine="{then}"}}') == 1
        run(produce(fleet.bootstrap, fleet.telemetry_topic, stream[half:]))
        got = decisions_of(run(consume(fleet.bootstrap, fleet.control_topic, len(expected), timeout=60)))
    finally:
        fleet.stop()
    by_id = {d["decision_id"]: d for d in got}
    assert len(got) == len(by_id), "a decision was published twice"
    assert by_id == expected
