"""bench/host.py: the host's and each role's CPU over a halt level's window."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest

from bench import host

PROC_STAT = ("cpu  100 5 50 800 40 3 2 1 7 0\n"
             "cpu0 50 2 25 400 20 1 1 0 0 0\n"
             "intr 12345\n")


def test_busy_is_every_jiffy_but_idle_and_iowait() -> None:
    busy, total = host.host_busy_ticks(PROC_STAT)
    assert total == 100 + 5 + 50 + 800 + 40 + 3 + 2 + 1  # guest time (7) is inside user already
    assert busy == total - 800 - 40


def test_a_process_name_with_spaces_and_parentheses_is_read_past() -> None:
    stat = "4242 (python -m (x) y) S 1 4242 4242 0 -1 4194560 900 0 0 0 31 9 0 0 20 0 3 0"
    assert host.process_ticks(stat) == 31 + 9


def test_roles_come_from_the_command_line_and_this_process_is_the_runtimes() -> None:
    assert host.role_of("/v/bin/python -m stream_app worker ", 10, 99) == "worker"
    assert host.role_of("/usr/bin/java -Xmx512m kafka.Kafka /tmp/server.properties", 11, 99) == "broker"
    assert host.role_of("python -m bench.loadgen --bootstrap 127.0.0.1:9092", 12, 99) == "load generator"
    assert host.role_of("python -m bench --only halt", 99, 99) == host.RUNTIMES
    assert host.role_of("sshd: root", 13, 99) is None


def test_a_window_counts_the_cpu_this_process_burned() -> None:
    window = host.HostCpu()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    cpu = window.finish()
    assert cpu["cores"] >= 1
    assert cpu["by_role"][host.RUNTIMES] > 0
    assert 0 < cpu["busy_cores"] <= cpu["cores"]


def test_a_threads_schedstat_is_its_time_on_a_core_then_waiting_for_one() -> None:
    assert host.thread_ns("123456789 2000 17\n") == (123_456_789, 2_000)


def test_a_window_measures_each_workers_event_loop_by_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process the bench takes for a worker (by its command line: here a token of this test's own, so that
    workers of other tests on this host are not counted) spins for the window: its main thread ran most of
    it; a window without such a process has no loop figures."""
    token = f"loopwarden-spinner-{uuid.uuid4().hex}"
    monkeypatch.setattr(host, "ROLES", (("worker", token),))
    assert host.HostCpu().finish()["worker_loop"] == {}
    spin = "import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass"
    worker = subprocess.Popen([sys.executable, "-c", spin, token])
    try:
        time.sleep(0.2)
        window = host.HostCpu()
        time.sleep(0.6)
        loop = window.finish()["worker_loop"]
    finally:
        worker.kill()
        worker.wait()
    assert loop["running"] > 0.2  # a core of the 2 for most of the window, however busy the host
    assert 0 <= loop["waiting"] <= 1
    assert loop["running"] + loop["waiting"] <= 1.1
