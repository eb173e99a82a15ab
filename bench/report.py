"""BENCHMARKS.md and its plots, rendered from ``bench/results/*.json``.

    python -m bench.report        # re-render from the last results, no measuring

Kept apart from the measuring so the page can be re-rendered (or its wording fixed) without a new
run, and so every number on the page comes from a results file that sits next to it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

from .workers import REPO

TARGET_CORE_EVENTS_PER_S = 100_000
TARGET_EVENTS_PER_S = 20_000
TARGET_P99_MS_AT_HALF = 50.0
#: One worker's saturated rate when raw consume reaches RAW_FOR_ABSOLUTE; below that, shares of the limits.
RAW_FOR_ABSOLUTE = 300_000
TARGET_SHARE_OF_RAW = 0.05
TARGET_TIMES_FAUST = 3.0
TARGET_CPU_US = 50.0
TARGET_P50_RTT_RATIO_AT_TENTH = 3.0
TARGET_P99_RTT_RATIO_AT_HALF = 5.0
TARGET_TWO_WORKER_CPU_RATIO = 1.2
HOST_CORES = 16
#: Per-run rules in fleet mode, local rules on: the call after the triggering one is refused at any pace.
TARGET_OVERSHOOT = {"10": 0, "100": 0, "1000": 0}
PACKAGES = ("faust-streaming", "aiokafka", "rocksdict", "orjson", "prometheus-client", "mode-streaming")


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    mem_kb = next((int(line.split()[1]) for line in _read("/proc/meminfo").splitlines()
                   if line.startswith("MemTotal:")), 0)
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    java = subprocess.run(["java", "-version"], capture_output=True, text=True, check=False).stderr
    from stream_app.worker.settings import SETTINGS

    worker_defaults = {var: default for _, var, default, _ in SETTINGS
                       if var in ("LOOPWARDEN_BATCH_MAX", "LOOPWARDEN_ENGINE", "LOOPWARDEN_COMMIT_INTERVAL_S",
                                  "LOOPWARDEN_PARTITIONS", "LOOPWARDEN_STANDBY_REPLICAS",
                                  "LOOPWARDEN_EVICT_SCAN_PER_SWEEP")}
    return {
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
        "commit": _git("rev-parse", "--short", "HEAD") + (" (with uncommitted changes)" if _dirty() else ""),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kb / 2**20, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "java": java.splitlines()[0] if java else "unknown",
        "packages": versions,
        "worker_defaults": worker_defaults,
        "load_at_start": os.getloadavg()[0],
    }


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


#: What a bench run writes itself: changed by the runs before it, no sign of code measured uncommitted.
BENCH_OUTPUTS = ("BENCHMARKS.md", "bench/results")


def _dirty() -> bool:
    """Whether the checkout differs from HEAD outside the bench's own outputs."""
    return bool(_git("status", "--porcelain", "--", ".", *(f":(exclude){path}" for path in BENCH_OUTPUTS)))


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False).stdout.strip()


def _load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _n(value: float) -> str:
    return f"{value:,.0f}"


def _ms(value: float) -> str:
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def _host_cpu(runs: list[dict[str, Any]]) -> str:
    """A level's host CPU (``bench.host``), medians over its runs: "1.7 of 2 (0.7 / 0.8 / 0.2 / 0.1)"."""
    cpus = [run["host_cpu"] for run in runs if run.get("host_cpu")]
    if not cpus:
        return "-"
    roles = ("worker", "broker", "load generator", "runtimes")
    shares = " / ".join(f"{statistics.median(cpu['by_role'].get(role, 0.0) for cpu in cpus):.2f}" for role in roles)
    return f"{statistics.median(cpu['busy_cores'] for cpu in cpus):.2f} of {cpus[0]['cores']} ({shares})"


def _worker_loop(runs: list[dict[str, Any]]) -> dict[str, float] | None:
    """A level's worker event loop (``bench.host``): medians over its runs of the shares of the window it ran
    and waited for a core; None when no run measured it."""
    loops = [run["host_cpu"]["worker_loop"] for run in runs if (run.get("host_cpu") or {}).get("worker_loop")]
    if not loops:
        return None
    return {"running": statistics.median(loop["running"] for loop in loops),
            "waiting": statistics.median(loop["waiting"] for loop in loops)}


def _met(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


class Page:
    """The markdown, section by section, from the results that exist."""

    def __init__(self, results: Path) -> None:
        self.results = results
        self.machine = _load(results, "machine") or machine()
        self.elapsed_s = self.machine.get("elapsed_s")
        self.core = _load(results, "core")
        self.limit = _load(results, "limit")
        self.fleet = _load(results, "fleet")
        self.halt = _load(results, "halt")
        self.overshoot = _load(results, "overshoot")
        self.settings = _load(results, "settings")
        self.trees = _load(results, "trees")
        self.treehalt = _load(results, "treehalt")
        self.stormpause = _load(results, "stormpause")
        self.lines: list[str] = []

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def render(self) -> str:
        self.header()
        self.targets()
        self.core_section()
        self.limit_section()
        self.fleet_section()
        self.halt_section()
        self.overshoot_section()
        self.profile_section()
        self.settings_section()
        self.trees_section()
        self.findings_section()
        return "\n".join(self.lines) + "\n"

    # -- sections -------------------------------------------------------------------------------

    def header(self) -> None:
        m = self.machine
        took = f" The whole run took {self.elapsed_s / 60:.1f} min." if self.elapsed_s else ""
        packages = ", ".join(f"{k} {v}" for k, v in m["packages"].items())
        self.add(
            "# Benchmarks",
            "",
            f"Generated by `make bench` (`python -m bench`) on {m['date_utc']} UTC at commit {m['commit']}."
            f"{took} Every figure below is the median of several runs unless it says otherwise; the command",
            "that reproduces it is given with it (each starts its own local broker unless",
            "`KAFKA_BOOTSTRAP_SERVERS` is set). Raw results: `bench/results/*.json`.",
            "",
            *self._provenance(),
            "| machine | |",
            "|---|---|",
            f"| CPU | {m['cpu']}, {m['cores']} cores |",
            f"| memory | {m['memory_gib']} GiB |",
            f"| OS | {m['os']} |",
            f"| Python | {m['python']} |",
            f"| Kafka | Apache Kafka {m.get('kafka', '?')} (single KRaft node on loopback, "
            f"`scripts/kafka_local`), {m['java']} |",
            f"| packages | {packages} |",
            "| worker defaults | " + ", ".join(f"`{k}={v}`" for k, v in m.get("worker_defaults", {}).items()) + " |",
            f"| corpus | `stream_app.devtools.fleet_sim` mix, {_n(m.get('corpus_events', 0))} events per pass, "
            f"{m.get('corpus_mean_bytes', 0):.0f} B mean value, fresh run ids per pass |",
            f"| load average (1 min) | {m['load_at_start']:.1f} at the start, "
            f"{m.get('load_at_end', float('nan')):.1f} at the end |",
            "",
            *(["**This page comes from a `--quick` run: short phases for trying the harness; do not quote it.**", ""]
              if m.get("plan") == "quick" else []),
            "The machine is shared with other work (builds, test suites): broker, workers, load generator and",
            "the other work all compete for the same cores, so absolute figures are lower and noisier than",
            "on a dedicated host. Ratios measured in the same run (fleet vs raw consume, halt vs round",
            "trip, setting vs default) travel better than the absolute numbers. Worker CPU time per event",
            "(from `/proc`) is given next to throughputs because it is the figure least affected by sharing.",
            "",
        )

    def _provenance(self) -> list[str]:
        """Which sections this run measured, and when the others were (a partial run re-renders all)."""
        measured = self.machine.get("sections")
        if not measured:
            return []
        older, later = [], []
        for name in ("core", "limit", "fleet", "halt", "overshoot", "settings", "trees", "treehalt", "stormpause"):
            data = getattr(self, name, None)
            if not data or name == "core":
                continue
            when = data.get("measured", {})
            if name not in measured:
                older.append(f"{name} ({when['date_utc']}, commit {when['commit']})" if when else f"{name} (an earlier run)")
            elif when and when.get("date_utc") != self.machine.get("date_utc"):
                later.append(f"{name} ({when['date_utc']}, commit {when['commit']})")
        out = []
        if older:
            out += [f"This run measured: {', '.join(measured)}. Carried over from earlier runs: {', '.join(older)}.", ""]
        if later:
            out += [f"Measured again since, alone (`python -m bench --skip-core --only ...`, the table below of this "
                    f"run's machine): {', '.join(later)}.", ""]
        return out

    def targets(self) -> None:
        rows = []
        if self.core and "replay_python_events_per_s" in self.core:
            c = self.core
            rows.append(("core replay >= 100,000 events/s on one core, parsing included",
                         f"{_n(c['replay_events_per_s'])} events/s native "
                         f"({_n(c['replay_python_events_per_s'])} Python reference)",
                         _met(c["replay_events_per_s"] >= TARGET_CORE_EVENTS_PER_S and c["engines_identical"])))
            rows.append(("core memory < 2 KB per tracked run", f"{_n(c['bytes_per_tracked_run'])} B native, "
                         f"{_n(c['bytes_per_tracked_run_python'])} B Python",
                         _met(max(c["bytes_per_tracked_run"], c["bytes_per_tracked_run_python"]) < 2048)))
        rows.extend(self._fleet_targets())
        if self.overshoot:
            idle = self.overshoot["loads"][0]["runs"]
            for rate, limit in TARGET_OVERSHOOT.items():
                counts = _overshoots(idle.get(rate, []))
                if counts:
                    rows.append((f"overshoot <= {limit} call{'' if limit == 1 else 's'} at {rate} calls/s",
                                 f"median {statistics.median(counts):g}, max {max(counts)} (idle fleet)",
                                 _met(max(counts) <= limit)))
        if not rows:
            return
        self.add("## Targets", "", "| target | measured | |", "|---|---|---|")
        self.add(*(f"| {a} | {b} | {c} |" for a, b, c in rows))
        self.add("")
        lim = self.limit
        if lim:
            m = self.machine
            self.add("Beside them, the limits measured in the same run (section below) and the machine's load:", "",
                     "| limit | value |", "|---|---|",
                     f"| raw aiokafka group consume | {_n(lim['consume_msgs_per_s_median'])} msg/s |",
                     *([f"| Faust's per-event delivery, no-op agent | {_n(lim['faust_ceiling_per_s_median'])} events/s |"]
                       if "faust_ceiling_per_s_median" in lim else []),
                     *([f"| the worker's batch path, no-op handler | {_n(lim['batch_ceiling_per_s_median'])} events/s |"]
                       if "batch_ceiling_per_s_median" in lim else []),
                     *([f"| quixstreams {lim['quix_version']} per-run stateful fold (labelled comparison) | "
                        f"{_n(lim['quix_fold_per_s_median'])} events/s |"] if "quix_fold_per_s_median" in lim else []),
                     f"| one-message round trip p50 / p99 | {lim['round_trip_ms_median']['p50']:.2f} / "
                     f"{lim['round_trip_ms_median']['p99']:.2f} ms |",
                     f"| load average (1 min) at the start / end of the run | {m['load_at_start']:.1f} / "
                     f"{m.get('load_at_end', float('nan')):.1f} |",
                     *([f"| load average before / after the limit section | {lim['load_before']:.1f} / "
                        f"{lim['load_after']:.1f} |"] if "load_before" in lim else []),
                     "")

    def one_worker(self) -> dict[str, float] | None:
        """One default worker saturated: medians over every default probe of the run (the fleet
        section's and the settings section's), so one noisy probe does not decide a target."""
        probes = self._default_probes()
        if not probes:
            return None
        return {"applied_per_s": statistics.median(p["applied_per_s"] for p in probes),
                "worker_cpu_us_per_event": statistics.median(p["worker_cpu_us_per_event"] for p in probes),
                "probes": len(probes)}

    def _fleet_targets(self) -> list[tuple[str, str, str]]:
        rows: list[tuple[str, str, str]] = []
        one = self.one_worker()
        lim = self.limit or {}
        raw = lim.get("consume_msgs_per_s_median")
        faust = lim.get("faust_ceiling_per_s_median")
        if one:
            rate = one["applied_per_s"]
            each = f"median of {one['probes']} probes"
            if raw and raw >= RAW_FOR_ABSOLUTE:
                rows.append((f"one worker saturated >= 20,000 events/s (raw consume {_n(raw)} msg/s >= 300,000)",
                             f"{_n(rate)} events/s ({each})", _met(rate >= TARGET_EVENTS_PER_S)))
            elif raw and faust:
                rows.append((f"one worker saturated >= 5% of raw consume and >= 3x Faust's no-op ceiling (raw "
                             f"{_n(raw)} msg/s < 300,000: the absolute target does not apply)",
                             f"{_n(rate)} events/s ({each}): {rate / raw:.1%} of raw, {rate / faust:.1f}x Faust",
                             _met(rate >= TARGET_SHARE_OF_RAW * raw and rate >= TARGET_TIMES_FAUST * faust)))
            rows.append(("one worker <= 50 us worker CPU per event (all threads, /proc)",
                         f"{one['worker_cpu_us_per_event']:.1f} us ({each})",
                         _met(one["worker_cpu_us_per_event"] <= TARGET_CPU_US)))
        if self.fleet and "1w" in self.fleet and "2w" in self.fleet:
            two = self.fleet["2w"]["probe"]["worker_cpu_us_per_event"]
            base = (one or self.fleet["1w"]["probe"])["worker_cpu_us_per_event"]
            rows.append(("two workers: summed worker CPU per applied event within 20% of one worker's",
                         f"{two:.1f} vs {base:.1f} us ({two / base:.2f}x)", _met(two <= TARGET_TWO_WORKER_CPU_RATIO * base)))
        rtt = lim.get("round_trip_ms_median")
        if self.halt and rtt:
            levels = {round(lv["level"], 2): lv for lv in self.halt["levels"] if lv["median"]}
            if 0.1 in levels:
                p50 = levels[0.1]["median"]["p50"]
                rows.append(("fleet-path halt p50 at 10% load <= 3x the raw round trip p50",
                             f"{_ms(p50)} ms vs {rtt['p50']:.2f} ms ({p50 / rtt['p50']:.1f}x)",
                             _met(p50 <= TARGET_P50_RTT_RATIO_AT_TENTH * rtt["p50"])))
            if 0.5 in levels:
                p99 = levels[0.5]["median"]["p99"]
                rows.append(("fleet-path halt p99 at 50% load <= 50 ms and <= 5x the raw round trip p99",
                             f"{_ms(p99)} ms vs {rtt['p99']:.2f} ms ({p99 / rtt['p99']:.1f}x)",
                             _met(p99 <= TARGET_P99_MS_AT_HALF and p99 <= TARGET_P99_RTT_RATIO_AT_HALF * rtt["p99"])))
        return rows

    def core_section(self) -> None:
        self.add("## Detector core (no Kafka)", "")
        if not self.core:
            self.add("`bench/results/core.json` is missing (run `python -m bench.core --json "
                     "bench/results/core.json`).", "")
            return
        c = self.core
        self.add("Command: `python -m bench.core --json bench/results/core.json` (part of `make bench`; it can be",
                 "re-run alone, so this section may be newer than the Kafka sections).", "",
                 "| figure | value |", "|---|---|")
        for key, label, unit in (
                ("replay_events_per_s", "replay path (JSONL -> decisions), native engine, events/s", ""),
                ("replay_python_events_per_s", "replay path, Python reference engine, events/s", ""),
                ("replay_hashed_events_per_s", "replay path, hashes sent by the SDK, native, events/s", ""),
                ("replay_hashed_python_events_per_s", "replay path, hashes sent by the SDK, Python, events/s", ""),
                ("detector_only_events_per_s", "Python detector alone (pre-decoded events), events/s", ""),
                ("bytes_per_tracked_run", "memory per tracked run, native (heap, its allocator's count)", " B"),
                ("bytes_per_tracked_run_python", "memory per tracked run, Python (tracemalloc)", " B")):
            if key in c:
                self.add(f"| {label} | {_n(c[key])}{unit} |")
        if "engines_identical" in c:
            self.add(f"| native and Python decisions byte-identical | {'yes' if c['engines_identical'] else '**no**'} |")
        self.add("")
        if c.get("cost_vs_run_length"):
            self.add("Per-event cost against run length (the naive baseline re-scans the run's whole history):",
                     "", "| calls in run | ours, us/event | naive, us/event |", "|---|---|---|")
            for row in c["cost_vs_run_length"]:
                self.add(f"| {row['calls']:,} | {row['ours_us']:.1f} | {row['naive_us']:.1f} |")
            self.add("", "![per-event cost vs run length](bench/results/core_cost_vs_run_length.png)", "")

    def limit_section(self) -> None:
        if not self.limit:
            return
        lim = self.limit
        rtt = lim["round_trip_ms_median"]
        self.add(
            "## The limit: the broker, aiokafka and Faust alone",
            "",
            "Command: `python -m bench --skip-core --only limit`.",
            "",
            f"- Raw group consume (`AIOKafkaConsumer.getmany`, no processing) of {_n(lim['messages'])} of the",
            f"  same telemetry messages from {lim['partitions']} partitions: **{_n(lim['consume_msgs_per_s_median'])}"
            f" msg/s** (median of {len(lim['consume_msgs_per_s'])}: "
            f"{', '.join(_n(r) for r in lim['consume_msgs_per_s'])}).",
            *(["- The Faust ceiling (`bench.faust_ceiling`): the worker's exact Faust configuration with an agent",
               f"  that only counts its batches, over {_n(lim['faust_ceiling_events'])} of the same messages: "
               f"**{_n(lim['faust_ceiling_per_s_median'])} events/s**",
               f"  (median of {len(lim['faust_ceiling_per_s'])}: {', '.join(_n(r) for r in lim['faust_ceiling_per_s'])};"
               f" {lim['faust_ceiling_per_s_median'] / lim['consume_msgs_per_s_median']:.2%} of raw consume).",
               "  This is what Faust's per-event delivery (consumer thread, conductor, channel, stream, acks)",
               "  leaves of the raw rate on this machine, before any work: no Faust worker of this topic goes faster."]
              if "faust_ceiling_per_s_median" in lim else []),
            *(["- The worker's batch path (`bench.faust_ceiling --batch`: `stream_app.worker.delivery` with a handler",
               f"  that only counts) over {_n(lim['batch_ceiling_events'])} of the same messages: "
               f"**{_n(lim['batch_ceiling_per_s_median'])} events/s** (median of {len(lim['batch_ceiling_per_s'])}: "
               f"{', '.join(_n(r) for r in lim['batch_ceiling_per_s'])}; {lim['batch_ceiling_per_s_median'] / lim['consume_msgs_per_s_median']:.0%}"
               " of raw consume): what faust leaves a loopwarden worker before its own work."]
              if "batch_ceiling_per_s_median" in lim else []),
            *([f"- **A labelled comparison, not product code**: quixstreams {lim['quix_version']} (`bench/quix_fold.py`, its own",
               "  venv `.cache/quix-venv`; confluent-kafka underneath) folding the same messages into a per-run state",
               "  (RocksDB with its changelog topic, at-least-once as shipped: call count and the streak of identical",
               f"  failing calls, none of loopwarden's other work): **{_n(lim['quix_fold_per_s_median'])} events/s** (median of "
               f"{len(lim['quix_fold_per_s'])}: {', '.join(_n(r) for r in lim['quix_fold_per_s'])})."]
              if "quix_fold_per_s_median" in lim else []),
            "- Produce-to-consume round trip of one message (`linger_ms=0`, `acks=all`, consumer",
            f"  `fetch_max_wait_ms=5`), {lim['round_trips_per_repeat']} sequential trips per run: p50 **{rtt['p50']:.2f} ms**,"
            f" p95 {rtt['p95']:.2f} ms, p99 **{rtt['p99']:.2f} ms** (medians of {len(lim['round_trip_ms'])} runs).",
            "",
        )

    def fleet_section(self) -> None:
        if not self.fleet:
            return
        f = self.fleet
        d = f["definition"]
        raw = self.limit["consume_msgs_per_s_median"] if self.limit else None
        self.add(
            "## Fleet throughput",
            "",
            "Command: `python -m bench --skip-core --only fleet`.",
            "",
            "Real workers (`python -m stream_app worker`, default settings, 8 partitions, RocksDB table with",
            "its changelog, standby replicas 1) read telemetry that a separate process (`bench.loadgen`)",
            "produces open loop: a fixed schedule of events per second, sent whether or not the workers keep",
            "up, each step with run ids the workers have never seen.",
            "",
            "1. **Saturation probe**: a backlog (sized from the first probe to outlast the measurement) is",
            "   produced as fast as possible while the workers are held (SIGSTOP 6 s at a time, inside the group's",
            "   session timeout, with 0.3 s runs between holds for their heartbeats; else they eat a backlog as it",
            "   is made); the workers' apply rate once warm (events applied per second,",
            "   from `loopwarden_events_total`), measured while the producer is idle, is their capacity.",
            f"2. **Open-loop steps** of {f['step_s']:.0f} s on the same deployment, at "
            f"{', '.join(f'{x:.0%}' for x in f['step_fractions'])} of that capacity while they keep up,",
            "   then bisecting between the highest step that kept up (or zero) and the lowest that did not;",
            "   three steps at most, each drained before the next.",
            "",
            "**Keeps up** (the definition every figure here uses): the backlog is the events the producer",
            "had acknowledged minus the events the workers had applied, sampled every 0.5 s. A step keeps up",
            f"when (a) the producer sent at least {d['min_producer_share']:.0%} of its schedule on time,",
            f"(b) over the step's second half the backlog's least-squares slope is at most {d['max_backlog_slope']:.0%} of the rate",
            f"(it is not growing) and (c) the backlog when production ends is at most {d['max_end_backlog_s']:g} s of input.",
            "The **sustained rate** is the highest step that keeps up. These are single measurements per group",
            "size (one probe, one series of steps), not medians: the default worker's repeated probes in the",
            "settings section show how much one probe varies on this machine.",
            "",
            "| workers | saturated, events/s | sustained, events/s | worker CPU per event | vs raw consume "
            "| vs Faust ceiling |",
            "|---|---|---|---|---|---|",
        )
        ceiling = self.limit.get("faust_ceiling_per_s_median") if self.limit else None
        for key, label in (("1w", "1"), ("2w", "2 (one group)"), ("2w_no_standby", "2, standby replicas 0 (probe only)")):
            if key not in f:
                continue
            g = f[key]
            sustained = g.get("sustained_per_s")
            ratio = f"{g['probe']['applied_per_s'] / raw:.1%}" if raw else "-"
            to_ceiling = f"{g['probe']['applied_per_s'] / ceiling:.1f}x" if ceiling else "-"
            self.add(f"| {label} | {_n(g['probe']['applied_per_s'])} | {_n(sustained) if sustained is not None else '-'} | "
                     f"{g['probe']['worker_cpu_us_per_event']:.1f} us | {ratio} | {to_ceiling} |")
        self.add("", "(The two ratio columns are of the saturated rate.)", "", "Steps:", "",
                 "| workers | offered | produced | applied | backlog at end | backlog slope "
                 "| drained in | load generator CPU | keeps up |", "|---|---|---|---|---|---|---|---|---|")
        for key in ("1w", "2w"):
            for s in f.get(key, {}).get("steps", []):
                drained = f"{s['drain_s']:.1f} s" if s["drain_s"] is not None else "no (15 s)"
                gen = s.get("loadgen_cpu_share")
                self.add(f"| {key[0]} | {_n(s['rate'])}/s | {_n(s['produced_per_s'])}/s | {_n(s['applied_per_s'])}/s"
                         f" | {_n(s['end_backlog'])} | {s['backlog_slope_per_s']:+,.0f}/s | {drained} | "
                         f"{f'{gen:.0%} of a core' if gen else '-'} | {'yes' if s['keeps_up'] else 'no'} |")
        self.add("", "Load generator CPU is its process's CPU time over its sending time: near 100% of a core, the",
                 "generator (one Python process) was the limit of that step, not the workers.")
        self._scale_out()
        self.add("", "![backlog during each step](bench/results/fleet_backlog.png)", "")
        self.add("The backlog comes from producer acks and `loopwarden_events_total` (the findings compare it with",
                 "`loopwarden_consumer_lag`).", "")

    def _scale_out(self) -> None:
        """Two workers against one, the standby choice, and what a 16-core host would sustain."""
        f = self.fleet or {}
        if "1w" not in f or "2w" not in f:
            self.add("")
            return
        one, two = f["1w"]["probe"], f["2w"]["probe"]
        lines = ["", "**Scaling out.** Two workers vs one: "
                 f"{two['applied_per_s'] / one['applied_per_s']:.2f}x saturated"
                 + (f", {f['2w']['sustained_per_s'] / f['1w']['sustained_per_s']:.2f}x sustained"
                    if f["1w"].get("sustained_per_s") else "")
                 + f"; summed worker CPU per applied event {two['worker_cpu_us_per_event']:.1f} us against one worker's "
                 f"{one['worker_cpu_us_per_event']:.1f} us ({two['worker_cpu_us_per_event'] / one['worker_cpu_us_per_event']:.2f}x)."
                 " The workers, the broker and the load generator share the machine's cores, so the two-worker"
                 " throughput is a floor; CPU per event is the figure that carries to a bigger host."]
        nostandby = f.get("2w_no_standby", {}).get("probe")
        if nostandby:
            lines[-1] += (f" Without standby replicas the same two workers spend {nostandby['worker_cpu_us_per_event']:.1f} us"
                          f" per event: keeping a standby copy of the peer's partitions (`LOOPWARDEN_STANDBY_REPLICAS=1`,"
                          f" the shipped default, written a fetch at a time by `delivery.StandbyApplier`) costs"
                          f" {two['worker_cpu_us_per_event'] - nostandby['worker_cpu_us_per_event']:+.1f} us per event.")
        per_event = two["worker_cpu_us_per_event"]
        host = HOST_CORES * 1e6 / per_event
        lines += ["", f"**A {HOST_CORES}-core host**, from the per-core figure: {HOST_CORES} workers (one per core, at least"
                  f" {HOST_CORES} partitions, the broker on other hosts) x 1,000,000 us / {per_event:.1f} us per event (the"
                  f" two-worker group's summed CPU per event, standbys included) = **{_n(host)} events/s**, if CPU per"
                  " event stays at the two-worker figure as workers are added (it rose"
                  f" {two['worker_cpu_us_per_event'] / one['worker_cpu_us_per_event'] - 1:+.0%} from one worker to two here).", ""]
        self.add(*lines)

    def halt_section(self) -> None:
        if not self.halt:
            return
        h = self.halt
        rtt = self.limit["round_trip_ms_median"] if self.limit else None
        self.add(
            "## Halt latency",
            "",
            "Command: `python -m bench --skip-core --only fleet,halt` (the loads are fractions of the",
            "one-worker sustained rate from the fleet section).",
            "",
            "The fleet path: what a decision only the fleet can make costs (an operator's, a run several",
            "processes share). With local rules (the default) a runtime makes per-run halts itself, before",
            "the next call; here the guard is `Guard.fleet(..., local_rules=False, linger_ms=0)`. One worker.",
            "A separate process produces background telemetry; meanwhile this process injects runaway runs",
            "(4 identical failing calls back to back; the 4th triggers `recursion`) at a steady pace. Latency",
            "runs from the moment the 4th `call` has returned (its telemetry queued to the SDK's producer,",
            "linger 0) to the moment the runtime's `Guard.on_decision` callback receives the halt.",
            f"{h['duration_s']:.0f} s per run; p50/p95/p99 are medians over the runs of each run's percentiles.",
            "The worker starts with the section; before the first level, 10 s of the lowest load warm it and the",
            "broker's JVM (without them the first 10% run measured their warming: 8 ms at p50, then 6 and 5).",
            "Each level's runaways start with its load: the step from idle to the load is in its p99.",
            "",
            "| load | events/s | runaways/s | halted | p50 ms | p95 ms | p99 ms | max ms | p50 / raw RTT p50 "
            "| p99 / raw RTT p99 | raw RTT p50 / p99 ms at this load | p99 / raw RTT p99 at this load "
            "| inbound / outbound p50 ms | host CPU busy: cores (worker / broker / load gen / runtimes) "
            "| worker's event loop: running / waiting for a core |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        )
        for lv in h["levels"]:
            med = lv["median"]
            halted = sum(r["halted"] for r in lv["runs"])
            injected = sum(r["injected"] for r in lv["runs"])
            if med is None:
                self.add(f"| {lv['level']:.0%} | {_n(lv['load_per_s'])} | - | 0/{injected} | - | - | - | - | - | - | - | - | - | - "
                         "| - |")
                continue
            ratio50 = f"{med['p50'] / rtt['p50']:.1f}x" if rtt else "-"
            ratio99 = f"{med['p99'] / rtt['p99']:.1f}x" if rtt else "-"
            raw = lv.get("raw_round_trip_ms")
            loaded = f"{raw['p50']:.2f} / {raw['p99']:.2f}" if raw else "-"
            ratio_loaded = f"{med['p99'] / raw['p99']:.1f}x" if raw else "-"
            split = lv.get("split_median")
            parts = f"{_ms(split['inbound_p50'])} / {_ms(split['outbound_p50'])}" if split else "-"
            loop = _worker_loop(lv["runs"])
            loop_text = f"{loop['running']:.2f} / {loop['waiting']:.2f}" if loop else "-"
            self.add(f"| {lv['level']:.0%} | {_n(lv['load_per_s'])} | {lv['runs'][0]['inject_per_s']:.1f} | "
                     f"{halted}/{injected} | {_ms(med['p50'])} | {_ms(med['p95'])} | {_ms(med['p99'])} | "
                     f"{_ms(med['max'])} | {ratio50} | {ratio99} | {loaded} | {ratio_loaded} | {parts} | "
                     f"{_host_cpu(lv['runs'])} | {loop_text} |")
        self.add("", "Inbound is from the trigger produced to the worker's producer creating the halt record (its",
                 "Kafka timestamp): the SDK's producer, the broker, the worker's fetch, the batch in hand and",
                 "its fold. Outbound is from there to the runtime's callback: the worker's linger and wait for",
                 "acks, the broker, the halt listener's fetch. Both are wall-clock differences in milliseconds.",
                 "Host CPU busy: the machine's cores in use over the injection window (from `/proc/stat`: all but",
                 "idle and iowait) and each role's share (`/proc/PID/stat`; runtimes: the bench process with the",
                 "guard and its halt listener), medians over the runs. Everything shares this host's cores: a",
                 "latency measured with the host near all its cores busy includes waits for a core.",
                 "The worker's event loop: its main thread, which runs every batch, fetch and send in turn, from the",
                 "scheduler's count (`/proc/PID/task/PID/schedstat`): the share of the window it ran on a core and",
                 "the share it was ready to run but waited for one (medians over the runs). Running plus waiting near 1",
                 "means the loop had no idle time: whatever arrived queued behind what it was doing.",
                 "Raw RTT at this load: after each level's runs, the raw round trip of the limits section (one",
                 "message, acks all, linger 0, to a consumer holding it; a trip every ~30 ms) on a topic of its own,",
                 "while the same background telemetry goes through the worker for as long as a run: what the broker",
                 "and the shared cores alone give one trip at that load. A halt is two such trips plus the worker's",
                 "fetch and fold; the targets above compare with the idle round trip of the limits section.",
                 "", "![halt latency vs load](bench/results/latency_vs_load.png)", "")
        if h.get("wrong_trigger"):
            self.add(f"{h['wrong_trigger']} halts named a trigger other than the 4th call.", "")

    def overshoot_section(self) -> None:
        if not self.overshoot:
            return
        self.add(
            "## Overshoot",
            "",
            "Command: `python -m bench --skip-core --only fleet,overshoot`.",
            "",
            "A runaway agent calls a tool through `Guard.fleet` as shipped (local rules on) at a fixed pace; the",
            "tool fails at once with the same error. Overshoot = calls made after the call that triggered the halt (the decision's",
            "`evidence.seq`) before the guard raised `RunHalted`. Runaways run one after another against one",
            "worker: with no other telemetry (the worker drained between paces), then at 10 and 100 calls/s",
            "over background telemetry at 50% of the one-worker sustained rate. A runaway not halted within",
            "5,000 calls gives up and is counted as never halted.",
            "",
            "| calls/s | background | runs | overshoot median | max | all |",
            "|---|---|---|---|---|---|",
        )
        for load in self.overshoot["loads"]:
            for rate, runs in load["runs"].items():
                counts = _overshoots(runs)
                missed = len(runs) - len(counts)
                body = (f"{statistics.median(counts):g} | {max(counts)} | {sorted(counts)}" if counts
                        else "- | - | -")
                self.add(f"| {rate} | {_n(load['background_per_s'])} ev/s | {len(runs)}"
                         f"{f' ({missed} never halted)' if missed else ''} | {body} |")
        self.add("", "With local rules the runtime folds its own runs through the core and refuses the call after",
                 "the triggering one itself, whatever the pace; the fleet's copy of the halt (same decision id)",
                 "arrives later and is applied once. Without them (`local_rules=False`) overshoot is about the",
                 "halt latency above times the call rate.", "")

    def profile_section(self) -> None:
        probe = (self.fleet or {}).get("1w", {}).get("probe", {})
        prof = probe.get("profile")
        if not self.fleet:
            return
        if not prof:
            self.add("## Where a worker's time goes", "", "Not profiled: py-spy is not installed "
                     "(`pip install 'loopwarden[bench]'`).", "")
            return
        self.add(
            "## Where a worker's time goes",
            "",
            "py-spy (`py-spy record --pid --gil`, 100 Hz: the stack of whichever thread holds the GIL, so where",
            "the Python CPU time goes) on the one-worker saturation probe; the raw collapsed stacks are in",
            f"`bench/results/profile-1w.txt` ({prof['samples']:,} samples while {prof['events']:,} events were applied).",
            "",
            "| innermost frame in | share |",
            "|---|---|",
        )
        self.add(*(f"| {layer} | {share:.0%} |" for layer, share in prof["layers"].items()))
        self.add("", "| stage (inclusive) | share |", "|---|---|")
        self.add(*(f"| {stage.replace('  ', '&nbsp;&nbsp;')} | {share:.0%} |" for stage, share in prof["stages"].items()))
        self.add("", "Hottest innermost frames:", "")
        self.add(*(f"- {share:.1%} `{frame}`" for frame, share in prof["hottest"]))
        self.add("")

    def settings_section(self) -> None:
        if not self.settings:
            return
        tried = self.settings["tried"]
        base = self._settings_defaults()[0]
        rounds = len(tried[0].get("probes", [None]))
        if self._settings_same_run():
            whose = "every default probe of the run, the fleet section's included"
        else:  # carried over: the fleet section above is another run's, on another hour's machine
            measured = self.settings.get("measured", {})
            whose = (f"this section's own default probes (measured at {measured.get('commit', '?')}, "
                     f"{measured.get('date_utc', '?')} UTC; the fleet section above is another run's)")
        self.add(
            "## Worker settings tried",
            "",
            "Command: `python -m bench --skip-core --only fleet,settings`. One worker, saturation probe as above,",
            f"each setting on a fresh deployment, in {rounds} interleaved rounds of the same run. The baseline",
            f"is the mean of {whose}: {_n(base)} events/s.",
            "",
            "| setting | events/s saturated (median; each probe) | vs default | worker CPU per event |",
            "|---|---|---|---|",
        )
        for t in tried:
            each = ", ".join(_n(p["applied_per_s"]) for p in t.get("probes", []))
            self.add(f"| {t['label']} | {_n(t['applied_per_s'])} ({each}) | {t['applied_per_s'] / base:.2f}x | "
                     f"{_n(t['worker_cpu_us_per_event'])} us |")
        self.add("", f"The default's probes spread {self._noise(self._settings_probes()):.0%} either side of their "
                 "mean: differences",
                 "smaller than that are not shown to be real by this run.", "")


    def trees_section(self) -> None:
        if not self.trees:
            return
        corpus, tried = self.trees["corpus"], self.trees["tried"]
        rounds = len(tried[0].get("probes", [None]))
        ratio = self.trees["cpu_ratio"]
        self.add(
            "## Rules across runs (sub-agent trees, threads, tool storms)",
            "",
            "Command: `python -m bench --skip-core --only trees`. One worker, saturation probe as above, on the",
            "simulated fleet as the SDK sends it (every event names its tree and its upstream) with "
            f"{corpus['trees']} sub-agent trees",
            f"and as many threads of every kind and a storm: {_n(corpus['events'])} events, "
            f"{_n(corpus['tree_facts'])} facts for the folds across runs. Each",
            f"configuration on a fresh deployment, in {rounds} interleaved rounds, each probe measured over "
            f"{statistics.median(p['window_s'] for t in tried for p in t.get('probes', [])):.0f} s. Every fold: "
            "the per-run fold,",
            "the facts published re-keyed by scope key, and the keyed folds' agent, all in the one worker.",
            "",
            "| configuration | events/s saturated (median; each probe) | worker CPU per event (median) |",
            "|---|---|---|",
        )
        for t in tried:
            each = ", ".join(_n(p["applied_per_s"]) for p in t.get("probes", []))
            cpus = ", ".join(_n(p["worker_cpu_us_per_event"]) for p in t.get("probes", []))
            self.add(f"| {t['label']} | {_n(t['applied_per_s'])} ({each}) | {_n(t['worker_cpu_us_per_event'])} us "
                     f"({cpus}) |")
        pairs = self.trees.get("round_ratios")
        if pairs:
            self.add("", f"Worker CPU per event with every fold: {ratio:.2f}x the per-run rules' alone, the median of "
                     f"the rounds' ratios ({', '.join(f'{r:.2f}' for r in pairs)}: each round's two probes back to "
                     "back, in alternating order) (target <= 1.2x: "
                     f"{_met(ratio <= 1.2)}); the ratio of the two medians above: "
                     f"{self.trees['ratio_of_medians']:.2f}x.", "")
        else:  # results of a run before round ratios were kept
            self.add("", f"Worker CPU per event with every fold: {ratio:.2f}x the per-run rules' alone (target <= "
                     f"1.2x: {_met(ratio <= 1.2)}).", "")
        profiled = [(t["label"], p) for t in tried for p in t.get("probes", [])[:1] if p.get("profile")]
        if len(profiled) == len(tried):
            self.add("Where the difference goes (py-spy of each configuration's first probe, as in \"Where a",
                     "worker's time goes\"; a stage's share of the samples times that probe's worker CPU per event):",
                     "", "| stage (inclusive) | " + " | ".join(label for label, _ in profiled) + " |",
                     "|---|" + "---|" * len(profiled))
            for stage in profiled[0][1]["profile"]["stages"]:
                cells = [f"{p['profile']['stages'].get(stage, 0.0) * p['worker_cpu_us_per_event']:.1f} us"
                         for _, p in profiled]
                if any(cell != "0.0 us" for cell in cells):
                    self.add(f"| {stage.replace('  ', '&nbsp;&nbsp;')} | " + " | ".join(cells) + " |")
            self.add("| whole probe (worker CPU per event) | "
                     + " | ".join(f"{p['worker_cpu_us_per_event']:.1f} us" for _, p in profiled) + " |", "",
                     "The raw stacks: `bench/results/profile-trees.txt` (every fold), "
                     "`bench/results/profile-trees-off.txt`.", "")
        peaks = [(t["label"], t["rss_peak_mb"]) for t in tried if "rss_peak_mb" in t]
        if peaks:
            self.add("Worker peak resident memory (VmHWM) over its probes: "
                     + ", ".join(f"{label} {mb:,.0f} MiB" for label, mb in peaks)
                     + f" (the chart's limit: 1 GiB; {_met(all(mb <= 1024 for _, mb in peaks))}).", "")
        if self.treehalt:
            t = self.treehalt
            self.add("Tree halts reaching a guarded run in another process (`python -m bench --skip-core --only "
                     "treehalt`): one runtime", "spawns a chain of sub-agents on the fleet path (no local rules) "
                     "until the tree is 6 deep; a second", "guards another run of the tree. From the crossing "
                     f"spawn's end to the second runtime's board, over {t['trees']} trees:",
                     f"p50 {_ms(t['p50_ms'])} ms, p95 {_ms(t['p95_ms'])} ms, max {_ms(t['max_ms'])} ms (target p95 <= 500 ms: "
                     f"{_met(t['p95_ms'] <= 500)}).", "")
            if "threads" in t:
                h = t["threads"]
                self.add("Thread halts the same way: the first runtime starts runs on one thread, each caused by the "
                         "one before,", "until the 3rd generation's first event (`self_trigger`); the second guards "
                         f"a run of the thread; over {h['count']} threads:",
                         f"p50 {_ms(h['p50_ms'])} ms, p95 {_ms(h['p95_ms'])} ms, max {_ms(h['max_ms'])} ms (target p95 "
                         f"<= 500 ms: {_met(h['p95_ms'] <= 500)}).", "")
        if self.stormpause:
            t = self.stormpause
            self.add("Storm pauses reaching a runtime (`python -m bench --skip-core --only stormpause`): over "
                     f"{_n(t['background_per_s'])} events/s of", f"background telemetry ({t['level']:.0%} of one "
                     "worker's sustained rate), ten runs of one runtime (fleet path) fail once each on a",
                     "fresh tool key; from the end of the 10th failing call to a second runtime's board applying "
                     f"the pause, over {t['storms']} storms:",
                     f"p50 {_ms(t['p50_ms'])} ms, p95 {_ms(t['p95_ms'])} ms, max {_ms(t['max_ms'])} ms (target p95 <= 1 s: "
                     f"{_met(t['p95_ms'] <= 1000)}).", "")

    def _settings_same_run(self) -> bool:
        fleet = self.fleet or {}
        return not fleet or (self.settings or {}).get("measured") == fleet.get("measured")

    def _settings_probes(self) -> list[dict[str, Any]]:
        """What the tried settings are compared with: every default probe when the settings section was
        measured in the fleet section's run, else (carried over from another run) its own default probes
        only: a ratio of two runs' figures compares two hours of this shared machine, not two settings (a
        carried section read 0.62x the default for the default itself)."""
        if self._settings_same_run():
            return self._default_probes()
        return [p for t in (self.settings or {}).get("tried", []) if t["label"] == "default" for p in t.get("probes", [t])]

    def _settings_defaults(self) -> tuple[float, float]:
        """Mean saturated events/s and worker CPU us per event of the probes the settings compare with."""
        probes = self._settings_probes()
        return (float(statistics.mean(p["applied_per_s"] for p in probes)),
                float(statistics.mean(p["worker_cpu_us_per_event"] for p in probes)))

    def _default_probes(self) -> list[dict[str, Any]]:
        """The default configuration's one-worker saturation probes of the fleet section's run: the settings
        section's only when it was measured in that same run (a carried-over section's probes come from
        another day's machine: mixed in, they made a 18,477 events/s run read 42,286)."""
        fleet = self.fleet or {}
        same_run = self.settings is not None and self.settings.get("measured") == fleet.get("measured")
        probes = [p for t in (self.settings or {}).get("tried", []) if t["label"] == "default"
                  for p in t.get("probes", [t])] if same_run or not fleet else []
        return probes + ([fleet["1w"]["probe"]] if fleet else [])

    def _noise(self, probes: list[dict[str, Any]] | None = None) -> float:
        """Half the range of the default's saturated rates (``probes``, else every default probe of the fleet
        section's run), as a share of their mean."""
        rates = [p["applied_per_s"] for p in (self._default_probes() if probes is None else probes)]
        return (max(rates) - min(rates)) / 2 / statistics.mean(rates) if rates else 0.0

    def _setting(self, prefix: str) -> str:
        """How the tried setting whose label starts with ``prefix`` compares with the default, or ''."""
        hit = next((t for t in (self.settings or {}).get("tried", []) if t["label"].startswith(prefix)), None)
        if hit is None:
            return ""
        rate, cpu = self._settings_defaults()
        ratio = hit["applied_per_s"] / rate
        noise = " (within this machine's run-to-run noise)" if abs(ratio - 1) <= self._noise(self._settings_probes()) else ""
        return (f"{ratio:.2f}x the default's saturated events/s{noise} and "
                f"{hit['worker_cpu_us_per_event'] / cpu:.2f}x its worker CPU per event")

    def _lag_vs_backlog(self) -> tuple[int, int] | None:
        """(lag gauge, true backlog) where the gauge fell furthest short, over the steps' samples with a
        backlog of at least 1,000 events (below that, sampling skew between the two dominates)."""
        samples = [x for key in ("1w", "2w") for step in (self.fleet or {}).get(key, {}).get("steps", [])
                   for x in step["samples"] if x["acked"] - x["processed"] >= 1000]
        if not samples:
            return None
        worst = min(samples, key=lambda x: x["lag"] / (x["acked"] - x["processed"]))
        return worst["lag"], worst["acked"] - worst["processed"]

    def findings_section(self) -> None:
        probe = (self.fleet or {}).get("1w", {}).get("probe", {})
        prof = probe.get("profile")
        if not prof:
            return
        layers, stages = prof["layers"], prof["stages"]
        cpu_us = (self.one_worker() or probe)["worker_cpu_us_per_event"]
        framework = sum(v for k, v in layers.items() if k.split()[0] in ("faust", "mode", "aiokafka", "asyncio",
                                                                           "logging"))
        sweep = stages.get("  expiry sweep + runs_tracked gauge", 0.0)
        write = stages.get("  state write (RocksDB batch + changelog sends)", 0.0)
        changelog = stages.get("aiokafka producer sender", 0.0)
        top = ", ".join(f"{layer} {share:.0%}" for layer, share in list(layers.items())[:4])
        self.add(
            "## Findings and recommendations",
            "",
            f"- **Where a saturated worker's {cpu_us:.0f} us per event go** (py-spy, section above): {top}; faust, mode,",
            f"  aiokafka and the asyncio loop together {framework:.0%}. Before the batch path (issue 15) Faust's per-message",
            "  delivery alone (one `Service.wait_first` per message, the conductor, a channel, the stream, one ack per",
            "  event) cost ~115 us of main-thread CPU per event and one worker saturated at 2,700-5,800 events/s.",
            *self._delivery_bullet(probe),
            *self._fold_bullet(),
            *self._sweep_bullet(sweep),
            "- **State is written a batch at a time** (`stream_app/worker/store.py`): one RocksDB `WriteBatch` per",
            "  partition per batch, the changelog sent through the app's producer, the persisted offset once per",
            f"  partition; {write:.0%} of samples in that write, {changelog:.0%} in aiokafka's sender (changelog and",
            "  decisions).",
            *self._producer_bullet(),
            *self._lag_bullet(),
            *self._halt_bullets(),
            self._target_bullet(cpu_us),
            "",
        )

    def _delivery_bullet(self, probe: dict[str, Any]) -> list[str]:
        lim = self.limit or {}
        batch = lim.get("batch_ceiling_per_s_median")
        line = ("- **Batches straight from the consumer**: saturated, batches averaged"
                f" {probe.get('mean_batch_events', 0):.0f} events (`LOOPWARDEN_BATCH_MAX`"
                f" {self.machine.get('worker_defaults', {}).get('LOOPWARDEN_BATCH_MAX', '?')}, which also caps each fetch),"
                " with no window to fill them: a batch is what the consumer had fetched.")
        if batch:
            line += (f" The path itself (no-op handler) runs at {_n(batch)} events/s, {1e6 / batch:.1f} us per event:"
                     " what remains is the worker's own work.")
        line += (" Until 2026-12-03 a saturated worker idled most of the time: faust builds its consumer with"
                 " `fetch_max_wait_ms=1500`, and the fetch sent while a backlog's records sat in aiokafka's buffer"
                 " asked only for partitions with nothing new and parked at the broker, so the partitions drained"
                 " meanwhile could not be fetched until it returned (and faust waited up to a second for records"
                 " of the partitions still active while a full sink held the others back). One worker ran at"
                 " 13,000-14,000 events/s on 0.3 of a core; with a 100 ms fetch wait and a 10 ms poll while a sink is"
                 " full (`loop_consumer.FETCH_MAX_WAIT_MS`, `delivery.BUFFERED_POLL_S`) the same probe gave"
                 " 33,000-36,000 at the same CPU per event (`/tmp` probes, one worker, 2026-12-03).")
        return [line]

    def _fold_bullet(self) -> list[str]:
        fold = (self.core or {}).get("batch_fold")
        if not fold:
            return []
        native = fold.get("native_us_per_event")
        return [f"- **The fold** (`bench.core`, no Kafka: the fleet mix in batches of {fold['batch']:,}):"
                f" {fold['python_us_per_event']:.1f} us per event in the Python reference"
                + (f", {native:.1f} us in the native engine ({fold['python_us_per_event'] / native:.1f}x less)" if native else "")
                + (f"; {unkept:.1f} us in the native engine without the decoded states it keeps of the records it"
                   f" wrote (each stored record read again: {unkept / native:.2f}x; passes interleaved)"
                   if native and (unkept := fold.get("native_unkept_us_per_event")) else "")
                + f". A batch writes {fold['runs_written_per_batch']:.0f} runs (the mix interleaves thousands of runs,"
                f" so most events touch a run of their own in their batch); decoding and re-encoding one stored run"
                f" ({fold['stored_record_bytes_mean']:.0f} B) costs {fold['python_codec_us_per_run']:.1f} us in Python,"
                " which the native engine does in Rust inside the same call (reading events and records by field"
                " name without serde_json's sorted maps: `native/src/fields.rs`), and not at all for a record it"
                " wrote last: it keeps that record's state (`Decoded` in `native/src/lib.rs`). With the folds across runs"
                " on, a batch's facts borrow their fields from the events' calls until encoded (`batch_facts`)."
                " *Recommendation*: each field is still a `serde_json::Value` (strings and arrays allocated):"
                " borrowing them from the message is the next cut."]

    def _producer_bullet(self) -> list[str]:
        lines = []
        batch16 = self._setting("producer batches of 16 KiB")
        linger = self._setting("producer linger 10 ms")
        python = self._setting("the Python reference")
        if batch16 or linger:
            lines.append("- **Producer settings for batches of hundreds**: the worker's producer sends with"
                         " `producer_max_batch_size` 256 KiB (a batch's changelog, ~0.8 KB a record, in few requests) and"
                         " linger 1 ms."
                         + (f" faust's default of 16 KiB: {batch16}." if batch16 else "")
                         + (f" A 10 ms linger: {linger}; it would add up to 10 ms to every decision." if linger else ""))
        if python:
            lines.append(f"- **Engine**: folding with the Python reference (`LOOPWARDEN_ENGINE=python`) gives {python}.")
        return lines

    def _sweep_bullet(self, share: float) -> list[str]:
        per_sweep = self.machine.get("worker_defaults", {}).get("LOOPWARDEN_EVICT_SCAN_PER_SWEEP", "?")
        return [f"- **The expiry sweep is off the batch path** (a timer every 0.5 s, up to {per_sweep} stored runs"
                f" per partition): {share:.0%} of samples."
                + (" It reads `last_ts_ms` by decoding each stored run with orjson; it is not where the time goes."
                   if share < 0.05 else
                   " *Recommendation*: scan fewer runs per sweep, or keep `last_ts_ms` readable without decoding"
                   " the whole stored run.")]

    def _lag_bullet(self) -> list[str]:
        seen = self._lag_vs_backlog()
        if not seen:
            return []
        return ["- **`loopwarden_consumer_lag` against the backlog**: the gauge is each partition's end offset, read",
                "  from the broker every 0.5 s, minus the next offset to process. Over the steps' samples with a",
                f"  backlog of 1,000 events or more it read at worst {_n(seen[0])} while {_n(seen[1])} events were",
                f"  unapplied ({seen[0] / seen[1]:.0%}; the two are sampled up to 0.5 s apart). (Until 2026-12-02 it"
                "  came from the fetch's high-water mark, which stops moving while faust pauses a partition, and",
                "  read as little as 0% of the backlog.)"]

    def _halt_bullets(self) -> list[str]:
        if not self.halt or not self.overshoot:
            return []
        low = self.halt["levels"][0]
        split = low.get("split_median") or {}
        idle = self.overshoot["loads"][0]["runs"]
        fast = _overshoots(idle.get("1000", []))
        never = len(idle.get("1000", [])) - len(fast)
        overruns = self.halt.get("commit_overruns") or {}
        rtt = self.limit["round_trip_ms_median"]["p50"] if self.limit else None
        lines = ["- **Halt latency is two trips through the broker plus the worker's queue.**"
                 + (f" At 10% load the inbound half (trigger to halt sent) takes {_ms(split['inbound_p50'])} ms and the"
                    f" outbound half {_ms(split['outbound_p50'])} ms (medians)" if split else "")
                 + (f"; one raw round trip is {_ms(rtt)} ms, so the way back (the decisions producer's send, the"
                    f" broker, the halt listener's fetch) is {split['outbound_p50'] / rtt:.1f} trips and the way in"
                    f" {split['inbound_p50'] / rtt:.1f} (the SDK's send, the worker's fetch cycle, the batch in hand,"
                    " the fold)." if split and rtt else ".")
                 + " Each half is about a raw trip plus waits in the worker's event loop: at 10% load a batch is"
                 " one or two events, so every event pays the per-fetch and per-batch costs (aiokafka's fetch"
                 " bookkeeping and protocol code, a batch's RocksDB and changelog writes, the awaited decision)."
                 " Under load the inbound half grows: a busy worker answers late, whatever the network does. It"
                 " matters for what only the fleet decides: per-run halts are made in the runtime."]
        half = next((lv for lv in self.halt["levels"] if round(lv["level"], 2) == 0.5 and lv["median"]), None)
        raw = half.get("raw_round_trip_ms") if half else None
        if half and raw and self.limit:
            idle99 = self.limit["round_trip_ms_median"]["p99"]
            p99 = half["median"]["p99"]
            lines.append(
                ("- **At 50% load the halt's tail is the worker's, not the broker's.**" if 2 * raw["p99"] < p99 / 2 else
                 "- **At 50% load much of the halt's tail is the broker's and the host's.**")
                + f" A raw round trip alone, with the same background telemetry going through the worker, has p99"
                f" {raw['p99']:.1f} ms ({raw['p99'] / idle99:.1f}x the idle trip's {idle99:.2f} ms; p50"
                f" {raw['p50']:.2f} ms; medians of {len(half.get('raw_round_trips_ms', [])) or 1} windows, one after"
                f" each halt run; the broker, the load generator and the worker share {self.machine.get('cores', 2)}"
                f" cores). The halt's p99 of {_ms(p99)} ms is {p99 / raw['p99']:.1f}x that: its two trips account for"
                f" at most {2 * raw['p99']:.0f} ms of it; the rest is the worker's queue (the inbound half's"
                f" p50 is {_ms((half.get('split_median') or {}).get('inbound_p50', float('nan')))} ms)."
                + (f" The worker's event loop ran {loop['running']:.0%} of the time and waited for a core"
                   f" {loop['waiting']:.0%} of it (idle {max(0.0, 1 - loop['running'] - loop['waiting']):.0%}): both"
                   " its own work and the cores the other processes held keep a trigger in its queue."
                   if (loop := _worker_loop(half["runs"])) else ""))
        if overruns.get("count", 0) >= 3 or overruns.get("max_s", 0.0) >= 2.0:
            lines.append(
                f"- **Offset commits overran**: during the halt and overshoot runs faust logged {overruns['count']}"
                f" commits overrunning their 1 s interval, the longest {overruns['max_s']:.1f} s. Before committing,"
                " faust waits until its producer has delivered everything queued (the batches' changelog records);"
                " decisions go out on a producer of their own, so they do not queue behind that traffic, but a"
                " broker slow to acknowledge the changelog delays commits (redelivery after a crash grows).")
        if fast or never:
            lines.append(
                "- **Overshoot, local rules on**: at 1000 calls/s "
                f"{', '.join(str(c) for c in sorted(fast)) or '-'}"
                + (f", {never} never halted within 5,000 calls" if never else "")
                + ": the runtime refuses the call after the triggering one itself, however fast the agent calls.")
        return lines

    def _target_bullet(self, cpu_us: float) -> str:
        """How the worker's per-event cost compares with what the throughput target allows."""
        budget_us = 1e6 / TARGET_EVENTS_PER_S
        text = (f"- **The 20,000 events/s target leaves {budget_us:.0f} us per event on one core.** A saturated worker"
                f" spends {cpu_us:.1f} us of CPU per event on all its threads ({cpu_us / budget_us:.2f}x the budget;"
                " faust's consumer runs on the worker's own event loop, so one worker uses at most about one core"
                " of Python, plus RocksDB's background threads).")
        if self.limit:
            text += (f" Raw aiokafka consume costs {1e6 / self.limit['consume_msgs_per_s_median']:.1f} us per message"
                     " here; the broker and the load generator share the same cores.")
        return text + (" Beyond one worker, the rate is reached by partitions spread over worker processes on"
                       " enough cores (the scaling paragraph in the fleet section).")


def _overshoots(runs: list[dict[str, Any]]) -> list[int]:
    return [r["overshoot"] for r in runs if r.get("overshoot") is not None]


def plot(results: Path) -> list[Path]:
    """The PNG plots the results allow; returns the files written (none without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        print("bench.report: matplotlib is not installed; no plots (pip install 'loopwarden[bench]')")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    halt = _load(results, "halt")
    limit = _load(results, "limit")
    if halt and any(lv["median"] for lv in halt["levels"]):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        levels = [lv for lv in halt["levels"] if lv["median"]]
        x = [lv["load_per_s"] for lv in levels]
        for key, style in (("p50", "o-"), ("p95", "s--"), ("p99", "^-")):
            ax.plot(x, [lv["median"][key] for lv in levels], style, label=f"halt latency {key}")
        if limit:
            ax.axhline(2 * limit["round_trip_ms_median"]["p99"], color="grey", linestyle=":",
                       label="2 x raw round trip p99")
        ax.axhline(TARGET_P99_MS_AT_HALF, color="red", linestyle="-.", linewidth=1, label="target p99 at 50% load")
        ax.set_xlabel("telemetry load, events/s (one worker)")
        ax.set_ylabel("ms, trigger produced -> runtime holds the halt")
        ax.set_yscale("log")
        ax.set_title("Halt latency vs load")
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        written.append(_save(fig, results / "latency_vs_load.png"))
    core = _load(results, "core")
    if core and core.get("cost_vs_run_length"):
        rows = core["cost_vs_run_length"]
        fig, ax = plt.subplots(figsize=(7, 4.2))
        ax.plot([r["calls"] for r in rows], [r["ours_us"] for r in rows], "o-", label="loopwarden detector")
        ax.plot([r["calls"] for r in rows], [r["naive_us"] for r in rows], "s--", label="naive (full history)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("calls in the run")
        ax.set_ylabel("us per event")
        ax.set_title("Per-event cost vs run length")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
        written.append(_save(fig, results / "core_cost_vs_run_length.png"))
    fleet = _load(results, "fleet")
    if fleet:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
        for ax, key in zip(axes, ("1w", "2w"), strict=True):
            for step in fleet.get(key, {}).get("steps", []):
                ax.plot([s["t"] for s in step["samples"]], [max(0, s["acked"] - s["processed"]) for s in step["samples"]],
                        label=f"{step['rate']:,.0f}/s{'' if step['keeps_up'] else ' (falls behind)'}")
            ax.set_title(f"{key[0]} worker{'s' if key == '2w' else ''}: backlog during each step")
            ax.set_xlabel("s since the step started")
            ax.set_ylabel("events produced, not yet applied")
            ax.legend(fontsize=8)
            ax.grid(True, alpha=0.3)
        written.append(_save(fig, results / "fleet_backlog.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write(results: Path, page: Path) -> None:
    """Render the plots and the page."""
    plot(results)
    page.write_text(Page(results).render())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    args = parser.parse_args(argv)
    write(args.results, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
