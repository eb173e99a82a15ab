"""The layout's import rules, checked on the real modules (not by reading the tree by eye):

- the worker, the bus and the commands never import the runtime SDK (``stream_app.client``);
- the SDK needs only orjson and PyYAML for the in-process guard: with the whole worker stack (faust,
  mode, aiokafka, rocksdict, prometheus_client, cryptography, protobuf, OpenTelemetry) unimportable,
  ``from stream_app.client import Guard`` works and ``Guard.in_process()`` halts a runaway.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "stream_app"
#: Everything beyond the base install (orjson, PyYAML).
WORKER_STACK = ("faust", "mode", "aiokafka", "rocksdict", "prometheus_client", "cryptography", "google",
                "opentelemetry", "croniter", "yarl", "aiohttp", "venusian", "kafka")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)


@pytest.mark.parametrize("module", ["stream_app.worker.app", "stream_app.worker.main", "stream_app.commands.notify",
                                    "stream_app.commands.operator", "stream_app.sources.otlp", "stream_app.bus.wire",
                                    "stream_app.bus.signing", "stream_app.bus.kafka", "stream_app.bus.settings",
                                    "stream_app.bus.policy_file", "stream_app.bus.clock"])
def test_the_worker_and_the_bus_never_import_the_sdk(module: str) -> None:
    """Not directly, not transitively: what the importing process ends up with is what counts."""
    result = _run(f"import sys, {module}; bad = sorted(m for m in sys.modules if m.startswith('stream_app.client'));"
                  "print(bad); sys.exit(1 if bad else 0)")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("folder", ["worker", "bus", "core", "sources"])
def test_no_module_of_the_lower_layers_names_the_sdk(folder: str) -> None:
    """The same rule read off the source, so a lazy import inside a function cannot slip past."""
    for path in (PACKAGE / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = ("." * node.level) + (node.module or "")
                assert not target.startswith(("..client", "stream_app.client")), f"{path.name}: {target}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("stream_app.client") for a in node.names), path.name


def test_the_in_process_guard_works_with_the_worker_stack_blocked() -> None:
    code = f"""
import asyncio, importlib.abc, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {WORKER_STACK!r}:
            raise ImportError(f"{{name}} is blocked: not in the base install")
        return None

sys.meta_path.insert(0, Blocked())
from stream_app.client import Guard, RunHalted

async def main():
    run = Guard.in_process().run("r")
    async def tool():
        raise OSError("down")
    for _ in range(4):
        try:
            await run.call("t", tool)
        except OSError:
            pass
    try:
        await run.call("t", tool)
    except RunHalted as halted:
        print(halted.verdict)
        return
    sys.exit("not halted")

asyncio.run(main())
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {WORKER_STACK!r})
sys.exit(f"imported {{loaded}}" if loaded else 0)
"""
    result = _run(code)
    assert (result.returncode, result.stdout.strip()) == (0, "recursion"), result.stdout + result.stderr
