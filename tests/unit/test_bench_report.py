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


def _probe(rate: float, cpu_us: float) -> dict[str, float]:
    return {"applied_per_s": rate, "worker_cpu_us_per_event": cpu_us}


def _settings(measured: dict[str, str]) -> dict[str, object]:
    return {"measured": measured, "tried": [
        {"label": "default", "applied_per_s": 40_000, "worker_cpu_us_per_event": 25,
         "probes": [_probe(39_000, 25), _probe(41_000, 25)]},
        {"label": "producer linger 10 ms: PRODUCER_LINGER_MS=10", "applied_per_s": 42_000,
         "worker_cpu_us_per_event": 23, "probes": [_probe(42_000, 23)]}]}


def _page(tmp_path: Path, fleet_measured: dict[str, str], settings_measured: dict[str, str]) -> report.Page:
    page = report.Page(tmp_path)
    page.fleet = {"measured": fleet_measured, "1w": {"probe": _probe(64_000, 15)}}
    page.settings = _settings(settings_measured)
    return page


def test_a_carried_over_settings_section_is_compared_with_its_own_default_probes(tmp_path: Path) -> None:
    """A settings section from another run than the fleet section's: its default reads 1.00x, not
    40,000 / 64,000 (an hour of the shared machine against another)."""
    page = _page(tmp_path, {"commit": "b", "date_utc": "2026-12-04 22:40"}, {"commit": "a", "date_utc": "2026-12-04 04:02"})
    page.settings_section()
    text = "\n".join(page.lines)
    assert "| default | 40,000 (39,000, 41,000) | 1.00x |" in text
    assert "| 1.05x |" in text  # the linger probe: 42,000 / 40,000
    assert "own default probes (measured at a, 2026-12-04 04:02 UTC" in text
    assert page._setting("producer linger 10 ms").startswith("1.05x the default's saturated events/s")


def test_a_settings_section_of_the_fleet_run_is_compared_with_every_default_probe(tmp_path: Path) -> None:
    same = {"commit": "a", "date_utc": "2026-12-04 04:02"}
    page = _page(tmp_path, same, same)
    page.settings_section()
    text = "\n".join(page.lines)
    assert "| default | 40,000 (39,000, 41,000) | 0.83x |" in text  # 40,000 / mean(39,000, 41,000, 64,000)
    assert "the fleet section's included: 48,000 events/s" in text


def _halt_page(tmp_path: Path, halt_p99: float, raw_p99: float) -> report.Page:
    page = report.Page(tmp_path)
    page.limit = {"round_trip_ms_median": {"p50": 2.0, "p95": 4.0, "p99": 6.0, "max": 9.0}}
    cuts = {"p50": 12.0, "p95": 40.0, "p99": halt_p99, "max": halt_p99 + 5}
    raw = {"p50": 1.5, "p95": 3.0, "p99": raw_p99, "max": raw_p99 + 1}
    page.halt = {"duration_s": 8.0, "levels": [
        {"level": 0.5, "load_per_s": 14_000, "median": cuts, "split_median": {"inbound_p50": 9.0, "outbound_p50": 4.0},
         "runs": [{"inject_per_s": 10.0, "halted": 80, "injected": 80}], "raw_round_trips_ms": [raw, raw, raw],
         "raw_round_trip_ms": raw}]}
    page.overshoot = {"loads": [{"runs": {"1000": [{"overshoot": 0}]}}]}
    return page


def test_the_halt_table_sets_each_load_beside_a_raw_trip_at_that_load_and_says_whose_the_tail_is(tmp_path: Path) -> None:
    """The raw round trip measured alone over the same background load is its own column, with the halt's p99
    against it; the finding names the worker when two such trips are under half the halt's p99, else the host."""
    page = _halt_page(tmp_path, halt_p99=52.0, raw_p99=6.5)
    page.halt_section()
    text = "\n".join(page.lines)
    assert "| 50% | 14,000 | 10.0 | 80/80 | 12 | 40 | 52 | 57 | 6.0x | 8.7x | 1.50 / 6.50 | 8.0x | 9.0 / 4.0 | - | - |" in text
    bullets = "\n".join(page._halt_bullets())
    assert "the halt's tail is the worker's, not the broker's" in bullets
    assert "p99 6.5 ms (1.1x the idle trip's 6.00 ms; p50 1.50 ms; medians of 3 windows" in bullets
    assert "at most 13 ms of it" in bullets and "inbound half's p50 is 9.0 ms" in bullets

    loaded = _halt_page(tmp_path, halt_p99=52.0, raw_p99=20.0)
    assert "much of the halt's tail is the broker's and the host's" in "\n".join(loaded._halt_bullets())


def test_the_worker_loop_running_and_waiting_for_a_core_are_medians_over_a_levels_runs(tmp_path: Path) -> None:
    """Each level gives its worker loop's shares of the window (medians over its runs; runs that did not measure
    it left out), in the table and in the 50% finding with the idle rest."""
    page = _halt_page(tmp_path, halt_p99=52.0, raw_p99=6.5)
    cpu = {"cores": 2, "busy_cores": 1.4, "by_role": {"worker": 0.8}}
    page.halt["levels"][0]["runs"] = [
        {"inject_per_s": 10.0, "halted": 80, "injected": 80,
         "host_cpu": {**cpu, "worker_loop": {"running": running, "waiting": waiting}}}
        for running, waiting in ((0.60, 0.10), (0.70, 0.30), (0.64, 0.20))
    ] + [{"inject_per_s": 10.0, "halted": 80, "injected": 80, "host_cpu": {**cpu, "worker_loop": {}}}]
    page.halt_section()
    assert "| 1.40 of 2 (0.80 / 0.00 / 0.00 / 0.00) | 0.64 / 0.20 |" in "\n".join(page.lines)
    assert ("The worker's event loop ran 64% of the time and waited for a core 20% of it (idle 16%)"
            in "\n".join(page._halt_bullets()))
