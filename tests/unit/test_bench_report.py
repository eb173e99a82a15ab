"""bench/report.py's record of what was measured: a checkout whose only changes are the bench's own outputs
(the results and BENCHMARKS.md an earlier section wrote) is the commit it names, not "uncommitted"."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench import report


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_the_bench_outputs_do_not_make_a_checkout_uncommitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bench" / "results").mkdir(parents=True)
    for name in ("BENCHMARKS.md", "bench/results/halt.json", "bench/stats.py"):
        (tmp_path / name).write_text("a\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "first")
    monkeypatch.setattr(report, "REPO", tmp_path)
    assert not report._dirty()
    (tmp_path / "BENCHMARKS.md").write_text("b\n")
    (tmp_path / "bench/results/halt.json").write_text("b\n")
    (tmp_path / "bench/results/new.png").write_text("b\n")
    assert not report._dirty()
    (tmp_path / "bench/stats.py").write_text("b\n")  # code: the figures are of uncommitted changes
    assert report._dirty()
