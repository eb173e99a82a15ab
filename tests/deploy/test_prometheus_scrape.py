"""A real Prometheus (Debian's package) scrapes a real worker fed by the local Kafka, evaluates the
project's alert rules and sends to a real Alertmanager: a halt shows up in the scraped series and its
alert fires and reaches Alertmanager.

Prometheus runs the compose Prometheus config (deploy/prometheus/prometheus.yml) with 1 s scrape and
evaluation intervals and loopback targets; Alertmanager the compose Alertmanager config.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.workers import REPO, Fleet, WorkerProcess, free_ports, produce, run

from .tools import tool

pytestmark = pytest.mark.deploy

RULES = REPO / "helm/loopwarden/files/loopwarden-rules.yml"
DASHBOARD = REPO / "helm/loopwarden/files/dashboards/loopwarden.json"


def http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@dataclass
class Stack:
    fleet: Fleet
    worker: WorkerProcess
    prometheus: str
    alertmanager: str
    logs: Path

    def query(self, promql: str) -> list[dict[str, Any]]:
        reply = http_json(f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        assert reply["status"] == "success", reply
        return list(reply["data"]["result"])

    def alerts(self) -> list[dict[str, Any]]:
        return list(http_json(f"{self.prometheus}/api/v1/alerts")["data"]["alerts"])

    def wait(self, condition: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.logs.glob("*.log"))
                raise AssertionError(f"timed out waiting for {what}\n{logs}")
            time.sleep(0.25)


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"{url} exited:\n{log.read_text(errors='replace')}"
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready:\n{log.read_text(errors='replace')}")


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prometheus_bin, alertmanager_bin = tool("prometheus"), tool("alertmanager")
    workdir = tmp_path_factory.mktemp("prometheus")
    fleet = Fleet(kafka_bootstrap, workdir, partitions=2)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        worker = fleet.start_worker()
        am_port, prom_port = free_ports(2, avoid={worker.metrics_port})
        am_log = workdir / "alertmanager.log"
        processes.append(_start([
            alertmanager_bin, f"--config.file={REPO / 'deploy/alertmanager/alertmanager.yml'}",
            f"--storage.path={workdir / 'alertmanager'}", f"--web.listen-address=127.0.0.1:{am_port}",
            "--cluster.listen-address=",  # no gossip port: a single instance
        ], am_log))
        alertmanager = f"http://127.0.0.1:{am_port}"
        _wait_ready(alertmanager, processes[-1], am_log)

        # The compose config, with test intervals and loopback targets.
        config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(RULES)]
        config["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{am_port}"]}]
        (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "loopwarden"]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{worker.metrics_port}"]}]
        config["scrape_configs"] = [job]
        config_file = workdir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        prom_log = workdir / "prometheus.log"
        processes.append(_start([
            prometheus_bin, f"--config.file={config_file}", f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ], prom_log))
        prometheus = f"http://127.0.0.1:{prom_port}"
        _wait_ready(prometheus, processes[-1], prom_log)
        yield Stack(fleet, worker, prometheus, alertmanager, workdir)
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        fleet.stop()


def runaway(run_id: str, now_ms: int) -> list[dict[str, Any]]:
    """The same search failing identically 5 times: the 4th halts (recursion)."""
    return [{"run_id": run_id, "event_id": f"{run_id}-{i}", "tool": "search_docs", "ts_ms": now_ms + i * 200,
             "outcome": "error", "args": {"query": "refund policy"}, "result": {"error": "index timeout"},
             "agent_id": "support-agent", "seq": i} for i in range(5)]


def duplicate_email(run_id: str, now_ms: int) -> list[dict[str, Any]]:
    """The same e-mail sent 4 times within a minute: suppressed twice, then the circuit opens."""
    return [{"run_id": run_id, "event_id": f"{run_id}-{i}", "tool": "send_email", "side_effect": True,
             "ts_ms": now_ms + i * 500, "outcome": "success", "args": {"to": "a@b.c", "body": "refund sent"},
             "result": {"status": "queued"}, "agent_id": "billing-agent", "seq": i} for i in range(4)]


def test_prometheus_scrapes_the_worker(stack: Stack) -> None:
    """The worker is up and ready in Prometheus under job "loopwarden"; no alert fires for a healthy
    worker that has halted nothing."""
    stack.wait(lambda: stack.query('loopwarden_worker_ready{job="loopwarden"} == 1'), "the worker's ready gauge")
    assert [float(s["value"][1]) for s in stack.query('up{job="loopwarden"}')] == [1.0]
    assert [a["labels"]["alertname"] for a in stack.alerts() if a["state"] == "firing"] == []


def test_a_halt_is_scraped_and_its_alert_fires(stack: Stack) -> None:
    """A runaway run and a repeated e-mail, fed through Kafka: the halts appear in the scraped series
    (with their creation time), LoopwardenRunHalted (verdict recursion) and LoopwardenCircuitOpened fire
    within seconds, and Alertmanager receives them."""
    now_ms = int(time.time() * 1000)
    run(produce(stack.fleet.bootstrap, stack.fleet.telemetry_topic,
                runaway("prom-runaway-1", now_ms) + duplicate_email("prom-email-1", now_ms)))

    halted = stack.wait(lambda: stack.query('loopwarden_decisions_total{job="loopwarden", action="halt"}'),
                        "the halt series")
    stack.wait(lambda: len(stack.query('loopwarden_decisions_total{job="loopwarden", action="halt"}')) == 2,
               "both halts")
    halted = {s["metric"]["verdict"]: float(s["value"][1])
              for s in stack.query('loopwarden_decisions_total{job="loopwarden", action="halt"}')}
    assert halted == {"recursion": 1.0, "circuit_open": 1.0}
    created = stack.query('time() - loopwarden_decisions_created{job="loopwarden", action="halt"}')
    assert len(created) == 2 and all(0 <= float(s["value"][1]) < 120 for s in created)
    suppressed = stack.query('loopwarden_decisions_total{job="loopwarden", action="suppress"}')
    assert [float(s["value"][1]) for s in suppressed] == [2.0]

    def firing() -> dict[str, dict[str, Any]]:
        found = {a["labels"]["alertname"]: a for a in stack.alerts() if a["state"] == "firing"}
        return found if {"LoopwardenRunHalted", "LoopwardenCircuitOpened"} <= set(found) else {}

    alerts = stack.wait(firing, "the halt alerts to fire", timeout=30)
    run_halted = alerts["LoopwardenRunHalted"]
    assert run_halted["labels"] == {"alertname": "LoopwardenRunHalted", "severity": "warning", "verdict": "recursion"}
    assert run_halted["annotations"]["description"].startswith(
        "loopwarden halted 1 agent run(s) with verdict recursion in the last 10 minutes")
    assert alerts["LoopwardenCircuitOpened"]["annotations"]["summary"] == (
        "loopwarden opened the circuit on a repeated side-effecting call")
    assert set(alerts) == {"LoopwardenRunHalted", "LoopwardenCircuitOpened"}

    def received() -> set[str]:
        names = {a["labels"]["alertname"] for a in http_json(f"{stack.alertmanager}/api/v2/alerts")}
        return names if {"LoopwardenRunHalted", "LoopwardenCircuitOpened"} <= names else set()

    stack.wait(received, "Alertmanager to receive the alerts", timeout=30)


def test_dashboard_queries_run_on_the_real_series(stack: Stack) -> None:
    """Every query of the Grafana dashboard, its variables filled in as Grafana would, is valid PromQL
    on this Prometheus and the main panels have data."""
    run(produce(stack.fleet.bootstrap, stack.fleet.telemetry_topic, runaway("prom-runaway-2", int(time.time() * 1000))))
    stack.wait(lambda: stack.query('loopwarden_decisions_total{job="loopwarden", action="halt", verdict="recursion"} >= 1'),
               "a halt")
    time.sleep(2.0)  # a few more scrapes, for the rate() panels
    dashboard = json.loads(DASHBOARD.read_text())
    empty = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = (target["expr"].replace("$namespace", ".*").replace("$instance", ".*")
                    .replace("$__rate_interval", "1m").replace("$__range", "10m"))
            if not stack.query(expr):
                empty.append(panel["title"])
    assert "Runs halted (range)" not in empty and "Workers up" not in empty and "Halts by verdict" not in empty
