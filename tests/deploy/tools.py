"""The deploy tools the `deploy` tests run for real, as scripts/install-deploy-tools installs them.

``tool(name)`` finds a binary in ``$LOOPWARDEN_CACHE/tools/bin`` (default ``<repo>/.cache``), then on
PATH. A missing tool skips the test on a developer's machine with the command that installs it, and
fails it in CI (``CI`` set), where ``make test`` installs the tools first and a skip would hide a gap.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("LOOPWARDEN_CACHE") or REPO / ".cache")
TOOLS_BIN = CACHE / "tools" / "bin"
# Debian names the Alertmanager binary prometheus-alertmanager.
_ALIASES = {"alertmanager": ("alertmanager", "prometheus-alertmanager")}


def tool(name: str) -> str:
    """The path of deploy tool ``name`` (skip or, in CI, fail when it is not installed)."""
    for candidate in _ALIASES.get(name, (name,)):
        local = TOOLS_BIN / candidate
        if local.exists() and os.access(local, os.X_OK):
            return str(local)
        found = shutil.which(candidate)
        if found:
            return found
    message = f"{name} is not installed: run scripts/install-deploy-tools (make test does)"
    if os.environ.get("CI"):
        pytest.fail(message)
    # a developer without the tools (CI fails above instead); a module asking while it is collected
    # (test_compose's parameters come from compose-check's model) is skipped whole
    pytest.skip(message, allow_module_level=True)


def run(*args: str, check: bool = True, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a tool; on failure the assertion shows its output."""
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"{' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


def worker_series() -> set[str]:
    """Every series name a worker's /metrics can expose (counters with _total and _created, histograms
    with _bucket, _sum, _count and _created), from the worker's own metrics registry."""
    from stream_app.worker.metrics import WorkerMetrics

    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",)}
    return {family.name + suffix for family in WorkerMetrics().registry.collect()
            for suffix in suffixes[family.type]}


def metric_names(promql: str) -> set[str]:
    """The loopwarden_* metric names a PromQL expression refers to."""
    import re

    return set(re.findall(r"\bloopwarden_[a-z_]+\b", promql))
