"""bench.halt_ab: which source tree stands for a ref, and the pooled report."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench import halt_ab
from bench.workers import REPO


def test_this_tree_stands_for_dot_and_a_commit_gets_its_own_worktree(tmp_path: Path) -> None:
    assert halt_ab.tree_of(".", worktrees=tmp_path) == REPO
    commit = subprocess.run(["git", "-C", str(REPO), "rev-list", "-n1", "HEAD~1"], check=True, capture_output=True,
                            text=True).stdout.strip()
    tree = halt_ab.tree_of("HEAD~1", worktrees=tmp_path)
    try:
        assert tree == tmp_path / commit[:12]
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], check=True, capture_output=True,
                              text=True).stdout.strip()
        assert head == commit and (tree / "stream_app" / "worker").is_dir()
        assert halt_ab.tree_of(commit, worktrees=tmp_path) == tree  # made once
        assert halt_ab.worker_env(tree) == {"PYTHONPATH": str(tree)}
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)


def test_an_unknown_ref_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError):
        halt_ab.tree_of("no-such-ref-anywhere", worktrees=tmp_path)


def test_the_report_pools_every_halt_of_a_ref() -> None:
    lines = halt_ab.report({"a": ([float(i) for i in range(1, 101)], [1.0, 3.0]), "b": ([5.0, 5.0], [2.0, 2.0])})
    assert lines[0].startswith("a: 100 halts, latency p50 50.5 ms, p95 95.0, p99 99.0, max 100.0; inbound p50 2.0")
    assert lines[1].startswith("b: 2 halts, latency p50 5.0 ms")


def test_the_two_refs_must_differ() -> None:
    with pytest.raises(SystemExit):
        halt_ab.main([".", "."])
