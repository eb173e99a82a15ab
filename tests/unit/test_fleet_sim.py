"""Over the simulated fleet, every run gets exactly the halt its scenario calls for: no false halts,
no missed loops. This is the accuracy claim ``make run`` shows."""

from __future__ import annotations

from stream_app.core import Detector, RunTable, decode_event
from stream_app.devtools.fleet_sim import simulate_fleet


def test_every_run_gets_the_verdict_its_scenario_expects() -> None:
    fleet, stream = simulate_fleet(500, seed=5)
    table = RunTable(Detector())
    halts: dict[str, list[str]] = {}
    for raw in stream:
        for decision in table.observe(decode_event(raw)).decisions:
            if decision.action == "halt":
                halts.setdefault(decision.run_id, []).append(decision.verdict)
    for run in fleet:
        expected = [run.scenario.expected_halt] if run.scenario.expected_halt else []
        assert halts.get(run.run_id, []) == expected, (run.run_id, run.scenario.name)
    assert {run.scenario.name for run in fleet} >= {"healthy", "flaky_retry", "runaway", "mutating_loop",
                                                    "cycle", "polling", "duplicate_email", "endless"}
