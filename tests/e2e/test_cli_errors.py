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


def test_files_and_values_a_person_gets_wrong_are_one_line_each(tmp_path: Path) -> None:
    """A directory where a file is wanted, a policy file that is not UTF-8 or not YAML, a key folder that
    is a file, a key name with a directory in it, a worker setting that is not a finite number: each is
    one line naming it, exit status 2 (they were tracebacks)."""
    not_utf8, not_yaml, a_file = tmp_path / "latin1.yaml", tmp_path / "broken.yaml", tmp_path / "a-file"
    not_utf8.write_bytes(b"\xff\xfe")
    not_yaml.write_text("defaults: [\n")
    a_file.touch()
    cases: list[tuple[list[str], dict[str, str], str, tuple[str, ...]]] = [
        (["replay", str(tmp_path)], {}, "replay", (str(tmp_path), "Is a directory")),
        (["explain", "run-1", "--telemetry", str(tmp_path)], {}, "explain", ("Is a directory",)),
        (["policy", "check", str(not_utf8)], {}, "policy", ("not UTF-8",)),
        (["policy", "check", str(not_yaml)], {}, "policy", ("not valid YAML", "line 2, column 1")),
        (["keys", "generate", "--out", str(a_file)], {}, "keys", (str(a_file), "File exists")),
        (["keys", "generate", "--out", str(tmp_path), "--name", "../escaped"], {}, "keys", ("without a directory",)),
        (["worker"], {"LOOPWARDEN_COMMIT_INTERVAL_S": "nan"}, "worker", ("LOOPWARDEN_COMMIT_INTERVAL_S", "finite")),
    ]
    for args, env, command, words in cases:
        _one_line(_loopwarden(*args, env=env), command, *words)
    assert not (tmp_path.parent / "escaped.key").exists()


def test_simulate_read_in_part_ends_quietly_and_a_count_below_one_is_a_usage_error() -> None:
    """``simulate | head`` closes the pipe early: no traceback; ``--runs 0`` is refused by the parser."""
    piped = subprocess.run(f"{sys.executable} -m stream_app simulate --runs 3000 | head -c 100 > /dev/null",
                           shell=True, cwd=REPO, capture_output=True, text=True, timeout=90)
    assert "Traceback" not in piped.stderr and "BrokenPipe" not in piped.stderr, piped.stderr
    refused = _loopwarden("simulate", "--runs", "0", env={})
    assert refused.returncode == 2 and "--runs: must be at least 1, got 0" in refused.stderr
