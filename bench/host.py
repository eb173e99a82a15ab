"""How busy the machine was while a latency was measured: its CPU over a window, in all and by role.

On this bench's host the worker shares its cores with the broker, the load generator and the runtimes
(this process); a latency measured while they left the worker no core of its own is not the worker's
alone. ``HostCpu`` reads ``/proc/stat`` (the host's busy jiffies: everything but idle and iowait) and each
process's ``/proc/PID/stat`` (user + system, all threads) at the start and the end of a window, and gives
both as cores used on average (CPU seconds per wall second). A process is put in a role by its command
line (``ROLES``); this process is ``runtimes``. Linux only, as the rest of the bench.

A worker's event loop is its main thread: one thread runs its batches, fetches and sends, so what it cannot
do at once queues. The scheduler's own count of that thread (``/proc/PID/task/PID/schedstat``: time on a
core, time runnable but waiting for one) tells how much of a window the loop ran and how much it waited
for a core held by another thread (the broker's, the load generator's, the runtimes', the worker's own
others): the part of a latency the worker's own work does not explain.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import TypedDict

#: (role, a fragment of its command line), first match wins.
ROLES: tuple[tuple[str, str], ...] = (
    ("worker", "stream_app worker"),
    ("broker", "kafka.Kafka"),
    ("load generator", "bench.loadgen"),
)
RUNTIMES = "runtimes"
_TICKS = os.sysconf("SC_CLK_TCK")


class Window(TypedDict):
    """What a window used: the host's cores, the cores busy on average, each role's cores, and the workers'
    event loops (``running`` and ``waiting`` for a core: shares of the window, the mean of the workers')."""

    cores: int
    busy_cores: float
    by_role: dict[str, float]
    worker_loop: dict[str, float]


def host_busy_ticks(stat: str) -> tuple[int, int]:
    """(busy, total) jiffies from ``/proc/stat``'s text: busy is all but idle and iowait."""
    fields = [int(value) for value in stat.split("\n", 1)[0].split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return total - fields[3] - fields[4], total


def process_ticks(stat: str) -> int:
    """User + system jiffies of a process from its ``/proc/PID/stat`` text (the name may hold spaces)."""
    fields = stat.rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def thread_ns(schedstat: str) -> tuple[int, int]:
    """(on a core, runnable waiting for one) nanoseconds from a thread's ``schedstat`` text."""
    running, waiting, _ = schedstat.split()
    return int(running), int(waiting)


def role_of(cmdline: str, pid: int, own_pid: int) -> str | None:
    if pid == own_pid:
        return RUNTIMES
    return next((role for role, fragment in ROLES if fragment in cmdline), None)


def _processes(own_pid: int) -> dict[int, tuple[str, int, tuple[int, int]]]:
    """pid -> (role, jiffies, its main thread's (running, waiting) nanoseconds: a worker's event loop; (0, 0)
    for the other roles) of the processes with a role."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            role = role_of(cmdline, int(entry.name), own_pid)
            if role is not None:
                loop = thread_ns((entry / "task" / entry.name / "schedstat").read_text()) if role == "worker" else (0, 0)
                found[int(entry.name)] = (role, process_ticks((entry / "stat").read_text()), loop)
        except OSError:  # it exited meanwhile
            continue
    return found


class HostCpu:
    """The CPU the host and each role used from its creation to ``finish``."""

    def __init__(self) -> None:
        self._own = os.getpid()
        self._started = time.monotonic()
        self._host = host_busy_ticks(Path("/proc/stat").read_text())
        self._processes = _processes(self._own)

    def finish(self) -> Window:
        """The window from the creation to now. A process that started inside it counts from its start;
        one that exited before its end is left out."""
        wall_s = max(time.monotonic() - self._started, 1e-6)
        busy, total = host_busy_ticks(Path("/proc/stat").read_text())
        cores = os.cpu_count() or 1
        busy_cores = (busy - self._host[0]) / max(total - self._host[1], 1) * cores
        by_role: dict[str, float] = {}
        loops: list[tuple[float, float]] = []
        for pid, (role, ticks, loop) in _processes(self._own).items():
            _, before, loop_before = self._processes.get(pid, (role, 0, (0, 0)))
            by_role[role] = by_role.get(role, 0.0) + (ticks - before) / _TICKS / wall_s
            if role == "worker":
                loops.append(((loop[0] - loop_before[0]) / 1e9 / wall_s, (loop[1] - loop_before[1]) / 1e9 / wall_s))
        worker_loop = ({"running": statistics.fmean(r for r, _ in loops), "waiting": statistics.fmean(w for _, w in loops)}
                       if loops else {})
        return {"cores": cores, "busy_cores": busy_cores, "by_role": by_role, "worker_loop": worker_loop}
