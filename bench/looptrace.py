"""Where a worker's event loop spends its time, by kind of step: a diagnostic for ``bench.cycle --trace``.

A worker started with ``worker_env(path)`` counts every callback its event loop runs (``Handle._run``):
calls and seconds, keyed by where the step began. A task's step is keyed by two of the frames its
coroutine was suspended in, the task's own and the innermost (``_fetch_requests_routine:562>...>_wait:535``:
aiokafka's fetcher woken up; the first line of the task's coroutine on its first step); any other
callback by its function's name. The totals are written to ``path`` (JSON) every half second from a
thread, as cumulative counters: the difference of two snapshots is what the loop did between them. The
counting costs the worker a few microseconds a callback (a few percent of a core at thousands of
callbacks a second): compare traced runs with each other, not with untraced ones.

A halt's tail at partial load is made of the loop's long steps, not its averages: each step of at least
``STALL_S`` and each garbage collection of at least ``GC_STALL_S`` (inside some step: its time is also the
step's) is kept too, with when it ended (``stalls``).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import threading
import time
from collections import defaultdict, deque
from pathlib import Path
from typing import Any

#: The environment variable that makes a worker trace its loop into the file it names.
ENV = "BENCH_LOOPTRACE"  # not LOOPWARDEN_*: the harness keeps that prefix for worker settings
#: The key of a snapshot's wall-clock time (epoch seconds).
AT = "_written_at"
#: The key of a snapshot's long steps: [ended at (epoch seconds), kind, seconds], the last ``STALLS_KEPT``.
STALLS = "_stalls"
STALL_S = 0.005
GC_STALL_S = 0.001
STALLS_KEPT = 5_000

_SITECUSTOMIZE = f"""import os
if os.environ.get({ENV!r}):
    from bench import looptrace
    looptrace.install(os.environ[{ENV!r}])
"""


def worker_env(path: Path) -> dict[str, str]:
    """The environment that makes a worker (``python -m stream_app worker`` in this repository) trace its loop
    into ``path``: a ``sitecustomize`` (Python imports it at start-up) next to ``path``."""
    hook = path.parent / "looptrace-hook"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    repo = Path(__file__).resolve().parent.parent
    return {"PYTHONPATH": os.pathsep.join([str(hook), str(repo)]), ENV: str(path)}


def _where(task: asyncio.Task[Any]) -> str:
    coro: Any = task.get_coro()
    frames = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        frames.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    if len(frames) > 2:
        return f"{frames[0]}>...>{frames[-1]}"
    return ">".join(frames) or "task"


def install(path: str) -> None:
    """Count this process's event loop callbacks into ``path`` (see the module docstring)."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    long_steps: deque[tuple[float, str, float]] = deque(maxlen=STALLS_KEPT)
    run = asyncio.events.Handle._run
    clock = time.perf_counter
    gc_started = [0.0]

    def collected(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = clock()
        elif (took := clock() - gc_started[0]) >= GC_STALL_S:
            long_steps.append((time.time(), f"gc generation {info['generation']}", took))

    gc.callbacks.append(collected)

    def counted(handle: asyncio.events.Handle) -> None:
        callback = handle._callback  # type: ignore[attr-defined]
        owner = getattr(callback, "__self__", None)
        key = _where(owner) if isinstance(owner, asyncio.Task) else getattr(callback, "__qualname__",
                                                                             type(callback).__name__)
        started = clock()
        try:
            run(handle)
        finally:
            took = clock() - started
            entry = totals[key]
            entry[0] += 1
            entry[1] += took
            if took >= STALL_S:
                long_steps.append((time.time(), key, took))

    asyncio.events.Handle._run = counted  # type: ignore[method-assign,assignment]

    def write() -> None:
        target = Path(path)
        while True:
            time.sleep(0.5)
            try:
                snapshot: dict[str, Any] = {key: list(value) for key, value in list(totals.items())}
                snapshot[AT] = time.time()
                snapshot[STALLS] = list(long_steps)
                target.with_suffix(".tmp").write_text(json.dumps(snapshot))
                target.with_suffix(".tmp").replace(target)
            except Exception as exc:  # noqa: BLE001 - a diagnostic must not stop the worker
                print(f"looptrace: {exc!r}", file=sys.stderr)

    threading.Thread(target=write, name="looptrace", daemon=True).start()


Snapshot = tuple[float, dict[str, tuple[int, float]]]


def read(path: Path) -> Snapshot:
    """When the last snapshot was written (epoch seconds; 0: none yet), and its cumulative (calls, seconds)
    per kind of step."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return 0.0, {}
    at = float(raw.pop(AT))
    raw.pop(STALLS, None)
    return at, {key: (int(calls), float(seconds)) for key, (calls, seconds) in raw.items()}


def rates(before: Snapshot, after: Snapshot) -> dict[str, tuple[float, float]]:
    """Per kind of step, calls per second and seconds of loop time per second between two snapshots."""
    (t0, counts0), (t1, counts1) = before, after
    span = t1 - t0
    if span <= 0:
        raise ValueError("the two snapshots were written at the same time: wait at least a second between them")
    out = {}
    for key, (calls, seconds) in counts1.items():
        calls0, seconds0 = counts0.get(key, (0, 0.0))
        if calls > calls0:
            out[key] = ((calls - calls0) / span, (seconds - seconds0) / span)
    return out


def stalls(path: Path, since: float, until: float) -> dict[str, list[float]]:
    """Per kind, the durations (seconds, longest first) of the long steps and collections that ended between
    two epoch times, as the last snapshot holds them."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    out: dict[str, list[float]] = defaultdict(list)
    for at, key, seconds in raw.get(STALLS, []):
        if since <= at <= until:
            out[key].append(seconds)
    return {key: sorted(values, reverse=True) for key, values in out.items()}
