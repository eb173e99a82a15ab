"""``loopwarden demo`` (what ``make run`` runs) as a user runs it, on the real broker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def test_demo_halts_every_runaway_and_nothing_else(kafka_bootstrap: str, tmp_path: Path) -> None:
    """The demo's fleet ends with a table: every runaway scenario halted with its verdict, no false halt,
    exit status 0."""
    result = subprocess.run(
        [sys.executable, "-m", "stream_app", "demo", "--runs", "21", "--seed", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    table = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line[:1].isalpha()}
    for scenario, verdict in [("runaway", "recursion"), ("mutating_loop", "semantic_loop"),
                              ("cycle", "cycle"), ("duplicate_email", "circuit_open")]:
        assert verdict in table[scenario], table[scenario]
    assert "false halts: 0; runaways not stopped: 0" in result.stdout
    tree = next(line for line in result.stdout.splitlines() if line.startswith("sub-agent tree "))
    assert "5 levels deep, then halted (tree_depth)" in tree and "the fleet's tree fold confirmed it" in tree, tree
    assert sum(line.startswith("sub-agent tree ") for line in result.stdout.splitlines()) == 1  # one tree halt
    storm = next(line for line in result.stdout.splitlines() if line.startswith("tool storm on "))
    assert "; 1 incident: paused" in storm and "forecasters halted: 0" in storm and "resumed" in storm, storm
    assert "runs 21" in result.stderr  # progress lines were shown
