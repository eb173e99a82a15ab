"""`loopwarden halt|resume --wait` on the real broker: what the operator is told, and its exit status,
when the workers apply the command, refuse it (an untrusted key, a command too old) or never answer."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stream_app.bus.kafka import KafkaClientConfig
from stream_app.bus.signing import KeyRing, Signer, generate
from stream_app.commands.operator import NOT_CONFIRMED, REFUSED, build_command, send_and_wait

from .workers import REPO, Fleet

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fleet(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    deployment = Fleet(kafka_bootstrap, tmp_path_factory.mktemp("operator-wait"), partitions=2)
    deployment.start_worker()
    try:
        yield deployment
    finally:
        deployment.stop()


def _halt(fleet: Fleet, key: Path, *extra: str, topics: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    topics = topics or {"TELEMETRY": fleet.telemetry_topic, "CONTROL": fleet.control_topic, "DLQ": fleet.dlq_topic}
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": fleet.bootstrap, "LOOPWARDEN_OPERATOR": "alice",
           "LOOPWARDEN_WORKER_KEYS": str(fleet.keys / "worker.pub"),
           **{f"LOOPWARDEN_{name}_TOPIC": topic for name, topic in topics.items()}}
    return subprocess.run([sys.executable, "-m", "stream_app", "halt", f"run-{time.monotonic_ns()}", "--reason",
                           "looping on the refund tool", "--key", str(key), "--wait", *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_applied(fleet: Fleet) -> None:
    result = _halt(fleet, fleet.keys / "operator.key")
    print(result.stdout, result.stderr)  # the transcript, for the closing note
    assert result.returncode == 0, result.stderr
    assert "applied: operator_halt decision" in result.stdout
    assert f"signed by worker key {fleet.trusted_keys().key_ids[0]}" in result.stdout


def test_refused_for_an_untrusted_key(fleet: Fleet, tmp_path: Path) -> None:
    private, _, key_id = generate(tmp_path, "mallory")
    result = _halt(fleet, private)
    print(result.stdout, result.stderr)
    assert result.returncode == REFUSED
    assert "refused by the workers: signature: operator command refused (unknown_key)" in result.stderr
    assert key_id in result.stderr and "Traceback" not in result.stderr
    assert "operator command refused" in fleet.workers[0].log_path.read_text()  # logged at WARNING


def test_refused_as_too_old(fleet: Fleet) -> None:
    """A command older than LOOPWARDEN_OPERATOR_MAX_AGE_S (15 min by default) is a replay."""
    signer = Signer.from_file(fleet.keys / "operator.key")
    command = build_command("halt", "run-replayed", "replayed", "alice", int(time.time() * 1000) - 3_600_000)
    outcome = asyncio.run(send_and_wait(
        KafkaClientConfig(fleet.bootstrap),
        {"telemetry": fleet.telemetry_topic, "control": fleet.control_topic, "dlq": fleet.dlq_topic},
        command, signer, KeyRing.from_paths([fleet.keys / "worker.pub"]), 30.0))
    print(outcome)
    assert outcome.status == REFUSED
    assert "refused by the workers: ts_ms: operator command is 3600 s old" in outcome.message


def test_not_confirmed_without_a_worker(fleet: Fleet, topic_factory: Callable[..., str]) -> None:
    topics = {"TELEMETRY": topic_factory(2), "CONTROL": topic_factory(2), "DLQ": topic_factory(2)}
    started = time.monotonic()
    result = _halt(fleet, fleet.keys / "operator.key", "--timeout", "2", topics=topics)
    print(result.stdout, result.stderr)
    assert result.returncode == NOT_CONFIRMED
    assert "no worker confirmed" in result.stderr and time.monotonic() - started < 30
