"""bench.looptrace: a process started with its environment counts its event loop's steps by where they began."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench import looptrace

PROGRAM = textwrap.dedent("""
    import asyncio, time

    async def spins_then_waits():
        time.sleep(0.05)  # one step of the loop that takes 50 ms
        await asyncio.sleep(0.01)

    async def main():
        await asyncio.gather(*(spins_then_waits() for _ in range(3)))
        await asyncio.sleep(1.2)  # the writer's next snapshot

    asyncio.run(main())
""")


def test_a_traced_process_counts_each_kind_of_step_with_its_time(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    env = {**os.environ, **looptrace.worker_env(out)}
    subprocess.run([sys.executable, "-c", PROGRAM], env=env, check=True, timeout=60, cwd=tmp_path)
    at, steps = looptrace.read(out)
    assert at > 0
    # each task's first step, keyed by its coroutine's first line, holds the 50 ms spins
    (first,) = [value for key, value in steps.items() if key == "spins_then_waits:4"]
    assert first[0] == 3 and first[1] >= 0.15
    # the step after ``await asyncio.sleep`` (line 6), keyed by both frames: quick
    (resumed,) = [value for key, value in steps.items() if key.startswith("spins_then_waits:6>sleep:")]
    assert resumed[0] == 3 and resumed[1] < 0.05


def test_long_steps_are_kept_with_when_they_ended(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    env = {**os.environ, **looptrace.worker_env(out)}
    started = time.time()
    subprocess.run([sys.executable, "-c", PROGRAM], env=env, check=True, timeout=60, cwd=tmp_path)
    long = looptrace.stalls(out, started, time.time())
    # the three 50 ms spins, and none of the quick steps
    spins = long.pop("spins_then_waits:4")
    assert len(spins) == 3 and min(spins) >= 0.05
    assert all(key.startswith("gc generation") for key in long)
    assert looptrace.stalls(out, 0.0, started) == {}


def test_rates_are_the_difference_of_two_snapshots_per_second() -> None:
    before = (100.0, {"a": (10, 0.5), "b": (5, 0.1)})
    after = (102.0, {"a": (30, 1.5), "b": (5, 0.1), "c": (4, 0.2)})
    assert looptrace.rates(before, after) == {"a": (10.0, 0.5), "c": (2.0, 0.1)}
    with pytest.raises(ValueError, match="same time"):
        looptrace.rates(after, after)


def test_an_untraced_process_is_untouched(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    env = {**os.environ, **looptrace.worker_env(out)}
    del env[looptrace.ENV]
    subprocess.run([sys.executable, "-c", PROGRAM], env=env, check=True, timeout=60, cwd=tmp_path)
    assert looptrace.read(out) == (0.0, {})
