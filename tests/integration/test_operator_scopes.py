"""`loopwarden halt|resume --tree ROOT | --thread TENANT/THREAD` on the real broker: the command goes to the
keyed fold that owns the key, the workers answer with a signed decision of that scope, the scopes topic
keeps the halt (a resume tombstones it) for runtimes started later, and a command the workers do not
trust is refused with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from stream_app.bus.signing import generate
from stream_app.client import Guard, KafkaClientConfig, ThreadHalted, TreeHalted

from .workers import REPO, Fleet, consume, run

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fleet(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    deployment = Fleet(kafka_bootstrap, tmp_path_factory.mktemp("operator-scopes"), partitions=2,
                       settings={"fleet_rules": True})
    deployment.start_worker()
    try:
        yield deployment
    finally:
        deployment.stop()


def _operator(fleet: Fleet, action: str, *target: str, key: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": fleet.bootstrap, "LOOPWARDEN_OPERATOR": "alice",
           "LOOPWARDEN_WORKER_KEYS": str(fleet.keys / "worker.pub"), "LOOPWARDEN_FACTS_TOPIC": fleet.facts_topic,
           "LOOPWARDEN_CONTROL_TOPIC": fleet.control_topic, "LOOPWARDEN_DLQ_TOPIC": fleet.dlq_topic}
    return subprocess.run([sys.executable, "-m", "stream_app", action, *target, "--reason", "runaway delegation",
                           "--key", str(key or fleet.keys / "operator.key"), "--wait", "--timeout", "30"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=90)


async def _refusals(fleet: Fleet, *, root: str, tenant: str, thread: str) -> tuple[bool, bool]:
    """A runtime that starts now (no control history): does it refuse a child of ``root``, and a new run
    on the thread?"""
    async with Guard.fleet(KafkaClientConfig(fleet.bootstrap), fleet.telemetry_topic, fleet.control_topic,
                           trusted_keys=fleet.trusted_keys(), lookback_ms=0, scopes_topic=fleet.scopes_topic) as guard:
        tree = guard.board.tree_halt(root)
        thread_halt = guard.board.thread_halt(tenant, thread)
        for halt in (tree, thread_halt):
            if halt is not None:
                assert halt["verdict"] == "operator_halt" and halt["evidence"]["operator"] == "alice"
        if tree is not None:
            with pytest.raises(TreeHalted):
                guard.run(f"kid-{time.monotonic_ns()}", parent_run_id=root, root_run_id=root)
        if thread_halt is not None:
            with pytest.raises(ThreadHalted):
                guard.run(f"run-{time.monotonic_ns()}", tenant=tenant, thread_key=thread)
        return tree is not None, thread_halt is not None


def test_an_operator_halts_and_resumes_a_tree_and_a_thread(fleet: Fleet) -> None:
    root, thread = f"root-{time.monotonic_ns()}", f"pr-{time.monotonic_ns()}"
    for target in (("--tree", root), ("--thread", f"acme/{thread}")):
        result = _operator(fleet, "halt", *target)
        print(result.stdout, result.stderr)  # the transcript, for the closing note
        assert result.returncode == 0, result.stderr + fleet.workers[0].log_tail()
        assert "applied: operator_halt decision" in result.stdout
        assert f"signed by worker key {fleet.trusted_keys().key_ids[0]}" in result.stdout
    assert run(_refusals(fleet, root=root, tenant="acme", thread=thread)) == (True, True)
    assert run(_refusals(fleet, root=f"{root}-other", tenant="other", thread=thread)) == (False, False)

    control = [orjson.loads(r.value) for r in run(consume(fleet.bootstrap, fleet.control_topic, 2, settle=0.5))]
    halts = [m for m in control if m["verdict"] == "operator_halt" and m.get("scope") in ("tree", "thread")]
    assert {(m["scope"], m.get("root_run_id") or m.get("thread_key")) for m in halts} >= {("tree", root),
                                                                                         ("thread", thread)}
    assert all("run_id" not in m for m in halts)

    result = _operator(fleet, "resume", "--tree", root)
    assert result.returncode == 0 and "applied: operator_resume decision" in result.stdout, result.stderr
    assert run(_refusals(fleet, root=root, tenant="acme", thread=thread)) == (False, True)  # the tree's tombstone
    scopes = run(consume(fleet.bootstrap, fleet.scopes_topic, 3, settle=0.5))
    assert [r.value for r in scopes if r.key == f"tree/{root}".encode()][-1] is None


def test_an_operator_pauses_and_resumes_a_tool(fleet: Fleet) -> None:
    """`halt --tool` pauses it with no half-open (nothing goes through until `resume --tool`)."""
    from stream_app.client import ToolPaused

    tool = f"tool-{time.monotonic_ns()}"
    result = _operator(fleet, "halt", "--tool", f"acme/{tool}/api.example.com")
    assert result.returncode == 0 and "applied: operator_halt decision" in result.stdout, result.stderr

    async def refused() -> bool:
        async with Guard.fleet(KafkaClientConfig(fleet.bootstrap), fleet.telemetry_topic, fleet.control_topic,
                               trusted_keys=fleet.trusted_keys(), lookback_ms=0,
                               scopes_topic=fleet.scopes_topic) as guard:
            try:
                await guard.run(f"r-{time.monotonic_ns()}", tenant="acme").call(tool, lambda **_: "ok", {},
                                                                                upstream="api.example.com")
            except ToolPaused as exc:
                return exc.verdict == "operator_halt"
            return False

    assert run(refused())
    result = _operator(fleet, "resume", "--tool", f"acme/{tool}/api.example.com")
    assert result.returncode == 0 and "applied: operator_resume decision" in result.stdout, result.stderr
    assert not run(refused())


def test_a_scope_command_the_workers_do_not_trust_is_refused_and_a_bad_key_is_named(
        fleet: Fleet, tmp_path: Path) -> None:
    private, _, key_id = generate(tmp_path, "mallory")
    result = _operator(fleet, "halt", "--tree", "root-x", key=private)
    print(result.stdout, result.stderr)
    assert result.returncode == 3
    assert "refused by the workers: signature: operator command refused (unknown_key)" in result.stderr
    assert key_id in result.stderr and "Traceback" not in result.stderr
    result = _operator(fleet, "halt", "--tool", "acme/search")
    assert result.returncode == 2 and "expected TENANT/TOOL/UPSTREAM" in result.stderr
    result = _operator(fleet, "halt", "--thread", "no-slash")
    assert result.returncode == 2 and "expected TENANT/THREAD" in result.stderr
