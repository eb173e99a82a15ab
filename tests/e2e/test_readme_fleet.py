"""The README's fleet-mode instructions, run as written: the SDK snippet against a real worker, halted
by an operator mid-call, and the "Fleet by hand" section from the broker to the halt."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.workers import REPO, Fleet
from tests.readme_examples import blocks, example

pytestmark = pytest.mark.e2e

#: The tools the SDK snippet calls, as an agent's code would define them: the search hangs, so the
#: halt lands while the bound task awaits it.
TOOLS = '''
import asyncio, sys

async def search_docs(query):
    print("searching", flush=True)
    await asyncio.sleep(60)
    return {"hits": 3}

async def send_email(to, body):
    raise AssertionError("the halted run sent an e-mail")
'''


def _tails(hand: Path) -> str:
    """The end of each file the section writes under ``hand`` (the worker's log, the agent's output)."""
    return "\n".join(f"--- {path.name}:\n{path.read_text(errors='replace')[-3000:]}"
                     for path in sorted(hand.glob("*.*")) if path.is_file())


def _venv_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **extra}


def test_the_sdk_snippet_obeys_an_operator_halt_landing_mid_call(kafka_bootstrap: str, tmp_path: Path) -> None:
    """The snippet verbatim, with bind_task(), configured from the environment: an operator's halt
    (a decision only the fleet makes) lands while the bound task awaits a tool; the call raises
    RunHalted, the snippet's except runs, and the program exits 0."""
    fleet = Fleet(kafka_bootstrap, tmp_path, partitions=2)
    fleet.start_worker()
    env = _venv_env(KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap, LOOPWARDEN_TELEMETRY_TOPIC=fleet.telemetry_topic,
                    LOOPWARDEN_CONTROL_TOPIC=fleet.control_topic, LOOPWARDEN_DLQ_TOPIC=fleet.dlq_topic,
                    LOOPWARDEN_WORKER_KEYS=str(fleet.keys / "worker.pub"))
    script = tmp_path / "agent.py"
    script.write_text(TOOLS + example("### The runtime SDK"))
    agent = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert agent.stdout is not None
        assert agent.stdout.readline().strip() == "searching"
        halt = subprocess.run([sys.executable, "-m", "stream_app", "halt", "run-42", "--reason", "hung search",
                               "--key", str(fleet.keys / "operator.key"), "--wait"],
                              env=env, capture_output=True, text=True, timeout=60)
        assert halt.returncode == 0, halt.stdout + halt.stderr
        assert "applied: operator_halt decision" in halt.stdout and "signed by worker key" in halt.stdout
        out, err = agent.communicate(timeout=30)
    finally:
        agent.kill()
        fleet.stop()
    assert agent.returncode == 0, err
    assert out.startswith("halted: operator_halt halt by operator") and "hung search" in out
    assert "Traceback" not in err


def test_fleet_by_hand_runs_as_written() -> None:
    """Every block of the section, in order, in one shell that stops at the first failing command: a
    broker, keys, a worker, the agent (saved where the section says), the operator's halt with --wait,
    and the clean-up."""
    (first, agent, second) = blocks("### Fleet by hand")
    assert (first[0], agent[0], second[0]) == ("sh", "python", "sh")
    hand = REPO / "var" / "hand"
    shutil.rmtree(hand, ignore_errors=True)
    hand.mkdir(parents=True)
    (hand / "agent.py").write_text(agent[1])
    started = time.monotonic()
    env = _venv_env()
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    # its own session: on a timeout the shell and what it started in the background (broker, worker, agent)
    # are killed together, and what they printed so far says which step hung
    shell = subprocess.Popen(["bash", "-euo", "pipefail", "-c", first[1] + second[1]], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        try:
            stdout, stderr = shell.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(shell.pid, signal.SIGKILL)
            stdout, stderr = shell.communicate()
            pytest.fail(f"the section's commands did not finish in 240 s\n{stdout}\n{stderr}\n{_tails(hand)}")
        assert shell.returncode == 0, f"{stdout}\n{stderr}\n{_tails(hand)}"
        assert "halted: operator_halt halt by operator" in stdout
        assert "applied: operator_halt decision" in stdout
        assert time.monotonic() - started < 300
    finally:
        subprocess.run([sys.executable, "-m", "scripts.kafka_local", "stop", "--state-file", str(hand / "kafka.json")],
                       cwd=REPO, capture_output=True, timeout=60)
        shutil.rmtree(hand, ignore_errors=True)
