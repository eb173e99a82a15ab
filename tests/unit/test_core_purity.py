"""The core is pure: importing it pulls in no Kafka, Faust, metrics or YAML, and it reads no clock."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "stream_app" / "core"


def test_core_import_pulls_in_no_worker_stack() -> None:
    code = (
        "import sys, stream_app.core;"
        "bad = [m for m in ('faust', 'aiokafka', 'prometheus_client', 'rocksdict', 'yaml') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=CORE.parents[1])
    assert result.returncode == 0, result.stdout + result.stderr


def test_core_reads_no_clock_environment_or_files() -> None:
    """No module of the core calls time.*, datetime.now, os.environ or open()."""
    forbidden = {"time", "datetime", "os", "random", "socket"}
    for path in CORE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & forbidden, path.name
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] not in forbidden, path.name
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "open", path.name
