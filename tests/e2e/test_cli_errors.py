"""Every command a person runs says what to check in one line, never with a traceback, when the broker
is unreachable, the broker refuses the login, or the policy file is wrong (exit status 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stream_app.bus.signing import generate
from tests.conftest import SecureKafka
from tests.integration.workers import REPO

pytestmark = pytest.mark.e2e

NOWHERE = "127.0.0.1:1"  # nothing listens there


def _loopwarden(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stream_app", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=90, env={**os.environ, **env})


def _one_line(result: subprocess.CompletedProcess[str], command: str, *words: str) -> None:
    """One line says it; the worker and the notifier write theirs as a JSON log record (their default
    LOOPWARDEN_LOG_FORMAT), like every other line they write."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    if command in ("worker", "notify"):
        records = [json.loads(line) for line in lines]  # every line is JSON
        lines = [r["msg"] for r in records if r["level"] == "CRITICAL"]
    (line,) = [line for line in lines if line.startswith(f"loopwarden {command}: ")]
    for word in words:
        assert word in line, line


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("keys")
    generate(folder, "worker")
    generate(folder, "operator")
    return folder


def _commands(keys: Path, tmp_path: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each command that talks to Kafka, with what it needs besides the broker."""
    return {
        "worker": (["worker"], {"LOOPWARDEN_SIGNING_KEY": str(keys / "worker.key"),
                                "LOOPWARDEN_STATE_DIR": str(tmp_path / "state"), "LOOPWARDEN_METRICS_PORT": "0"}),
        "notify": (["notify"], {"LOOPWARDEN_NOTIFY_URL": "http://127.0.0.1:9/hook",
                                "LOOPWARDEN_WORKER_KEYS": str(keys / "worker.pub")}),
        "halt": (["halt", "run-1", "--reason", "test", "--key", str(keys / "operator.key"), "--no-wait"], {}),
        "demo": (["demo"], {}),
    }


@pytest.mark.parametrize("command", ["worker", "notify", "halt", "demo"])
def test_an_unreachable_broker_is_one_line(command: str, keys: Path, tmp_path: Path) -> None:
    args, env = _commands(keys, tmp_path)[command]
    result = _loopwarden(*args, env={**env, "KAFKA_BOOTSTRAP_SERVERS": NOWHERE})
    _one_line(result, command, f"cannot reach Kafka at {NOWHERE}", "check KAFKA_BOOTSTRAP_SERVERS")


@pytest.mark.parametrize("command", ["worker", "notify", "halt"])
def test_a_refused_login_is_one_line(command: str, keys: Path, tmp_path: Path, secure_kafka: SecureKafka) -> None:
    args, env = _commands(keys, tmp_path)[command]
    result = _loopwarden(*args, env={**env, **secure_kafka.env("worker", password="not-the-password")})
    _one_line(result, command, "refused the SCRAM-SHA-512 login of 'worker'", "KAFKA_SASL_PASSWORD")


@pytest.mark.parametrize("command", ["worker", "replay", "policy"])
def test_a_bad_policy_file_is_one_line(command: str, keys: Path, tmp_path: Path, kafka_bootstrap: str) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("defaults:\n  retry_budgte: 3\n")
    telemetry = tmp_path / "t.jsonl"
    telemetry.write_text("")
    args, env = {
        "worker": (["worker"], {**_commands(keys, tmp_path)["worker"][1], "LOOPWARDEN_POLICY": str(policy),
                                "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}),
        "replay": (["replay", str(telemetry), "--policy", str(policy)], {}),
        "policy": (["policy", "check", str(policy)], {}),
    }[command]
    _one_line(_loopwarden(*args, env=env), command, str(policy), "defaults.retry_budgte: unknown setting")
