"""The alert rules, the compose Prometheus and Alertmanager configs, checked by the real promtool and
amtool (Debian's prometheus and prometheus-alertmanager packages)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from .tools import REPO, metric_names, run, tool, worker_series

pytestmark = pytest.mark.deploy

RULES = REPO / "helm/loopwarden/files/loopwarden-rules.yml"
RULE_TESTS = REPO / "deploy/prometheus/tests/loopwarden-rules.test.yml"
PROMETHEUS_CONFIG = REPO / "deploy/prometheus/prometheus.yml"
ALERTMANAGER_CONFIG = REPO / "deploy/alertmanager/alertmanager.yml"

# What the issue asks the rules to cover, and the alert that covers it.
REQUIRED_ALERTS = {
    "a run halted, by verdict": "LoopwardenRunHalted",
    "circuit breaker opened": "LoopwardenCircuitOpened",
    "DLQ rate above a threshold": "LoopwardenDeadLetterRateHigh",
    "consumer lag growing": "LoopwardenConsumerLagGrowing",
    "workers down": "LoopwardenWorkerDown",
    "no worker at all": "LoopwardenNoWorkerUp",
}


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_promtool_check_rules() -> None:
    """The rules file is valid for Prometheus (syntax, PromQL, templates)."""
    result = run(tool("promtool"), "check", "rules", str(RULES))
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_promtool_unit_tests_of_the_alerts() -> None:
    """`promtool test rules`: every alert fires (and stays quiet) on synthetic series as specified."""
    result = run(tool("promtool"), "test", "rules", str(RULE_TESTS))
    assert "SUCCESS" in result.stdout


def test_every_alert_is_unit_tested_firing() -> None:
    """Each alert has at least one promtool case where it is expected to fire."""
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    firing = {check["alertname"] for case in cases for check in case.get("alert_rule_test", []) if check["exp_alerts"]}
    assert {rule["alert"] for rule in rules()} <= firing


@pytest.mark.parametrize(("need", "alert"), sorted(REQUIRED_ALERTS.items()))
def test_required_alert_exists(need: str, alert: str) -> None:
    """The rules cover what the on-call needs (the issue's list)."""
    assert alert in {rule["alert"] for rule in rules()}, need


@pytest.mark.parametrize("rule", rules(), ids=lambda rule: rule["alert"])
def test_rule_is_actionable(rule: dict[str, Any]) -> None:
    """Each alert has a severity, a one-line summary and a description that says what to do, and only
    refers to series the worker exports, under the job name both deployments give it."""
    assert rule["labels"]["severity"] in ("warning", "critical")
    summary, description = rule["annotations"]["summary"], rule["annotations"]["description"]
    assert "\n" not in summary and len(summary) < 90
    assert len(description) > 150 and any(verb in description.lower() for verb in (
        "check", "read", "fix", "add", "start", "raise", "should"))
    assert metric_names(rule["expr"]) <= worker_series()
    assert 'job="loopwarden"' in rule["expr"]


def _compose_prometheus_mounts() -> dict[str, Path]:
    """container path -> host path of the compose Prometheus' bind mounts."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    mounts = {}
    for volume in compose["services"]["prometheus"]["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            mounts[target] = REPO / source
    return mounts


def test_compose_prometheus_config_loads_the_rules(tmp_path: Path) -> None:
    """`promtool check config` on the compose Prometheus config, its rule_files resolved through the
    compose bind mounts: the single rules file is the one Prometheus loads."""
    mounts = _compose_prometheus_mounts()
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert mounts["/etc/prometheus/prometheus.yml"] == PROMETHEUS_CONFIG
    resolved = [str(mounts[path]) for path in config["rule_files"]]
    assert resolved == [str(RULES)]
    config["rule_files"] = resolved
    copy = tmp_path / "prometheus.yml"
    copy.write_text(yaml.safe_dump(config))
    result = run(tool("promtool"), "check", "config", str(copy))
    assert "SUCCESS: 1 rule files found" in result.stdout + result.stderr


def test_alertmanager_config_is_valid() -> None:
    """`amtool check-config` on the compose Alertmanager config."""
    result = run(tool("amtool"), "check-config", str(ALERTMANAGER_CONFIG))
    assert "SUCCESS" in result.stdout


def test_alertmanager_routes_every_alert_to_a_receiver() -> None:
    """Every loopwarden alert, at either severity, reaches the on-call receiver (`amtool config routes test`)."""
    for rule in rules():
        labels = [f"alertname={rule['alert']}", f"severity={rule['labels']['severity']}"]
        result = run(tool("amtool"), "config", "routes", "test", f"--config.file={ALERTMANAGER_CONFIG}", *labels)
        assert result.stdout.strip() == "on-call", (rule["alert"], result.stdout)


@pytest.mark.parametrize("rule", rules(), ids=lambda rule: rule["alert"])
def test_readme_lists_every_alert_with_its_severity(rule: dict[str, Any]) -> None:
    """The README's alert table is the rules file's list, severities included."""
    assert f"| `{rule['alert']}` | {rule['labels']['severity']} |" in (REPO / "README.md").read_text()
