"""The telemetry the Kafka benchmarks produce: the simulated fleet, serialised once, renamed per use.

Every benchmark step needs events of runs the worker has never seen: re-sending the same run ids would
hit the per-run dedupe (same event ids) and halted runs, both cheaper than real traffic. So the fleet of
``stream_app.devtools.fleet_sim`` (the mix ``make run`` and the parity tests use: healthy runs, retries, loops,
cycles, polling, duplicate e-mails) is serialised once to a template file, and each pass over it swaps
the run-id prefix (``run-`` becomes e.g. ``s3c1-``) in the bytes, before any timing starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson

from stream_app.bus.wire import encode_telemetry
from stream_app.devtools.fleet_sim import simulate_fleet, simulate_storm, simulate_threads, simulate_trees

#: Run ids in the template start with this (``fleet_sim`` names runs ``run-000123``).
TEMPLATE_PREFIX = b"run-"

Record = tuple[bytes, bytes]


def write_template(path: Path, runs: int, seed: int = 7) -> int:
    """Write ``runs`` simulated runs' events (interleaved by time, no redeliveries) as ``key\\tvalue``
    lines; return the number of events."""
    _, stream = simulate_fleet(runs, seed=seed, redeliver_fraction=0.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as out:
        for event in stream:
            key, value = encode_telemetry(event)
            out.write(key + b"\t" + value + b"\n")
    return len(stream)


def write_tree_template(path: Path, runs: int, trees: int, seed: int = 7) -> tuple[int, int]:
    """The fleet of ``write_template`` as the SDK sends it (every event names its run's tree:
    ``root_run_id``, the run itself; and the upstream its tool calls: every call a tool fact),
    interleaved with ``trees`` sub-agent trees of every kind (``fleet_sim.TREE_KINDS``, run ids
    ``run-t...``), as many threads of every kind (``THREAD_KINDS``, ``run-h...``) and a storm of 24 runs
    (``run-s...``); return (events, the facts they make for the folds across runs)."""
    _, stream = simulate_fleet(runs, seed=seed, redeliver_fraction=0.0)
    for event in stream:
        event["root_run_id"] = event["run_id"]
        event["upstream"] = f"{event['tool']}.example.com"
    _, tree_stream = simulate_trees(trees, seed=seed, redeliver_fraction=0.0, prefix="run-t")
    _, thread_stream = simulate_threads(trees, seed=seed, redeliver_fraction=0.0, prefix="run-h",
                                        start_ms=1_764_000_000_000 - 4 * 86_400_000)
    storm = simulate_storm(seed=seed, redeliver_fraction=0.0, prefix="run-s")
    facts = len(stream) + len(thread_stream) + len(storm) + sum(
        e["run_id"] != e["root_run_id"] or e.get("tool_class") == "spawn" for e in tree_stream)
    merged = sorted([*stream, *tree_stream, *thread_stream, *storm], key=lambda e: (e["ts_ms"], e["event_id"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as out:
        for event in merged:
            key, value = encode_telemetry(event)
            out.write(key + b"\t" + value + b"\n")
    return len(merged), facts


def read_template(path: Path) -> list[Record]:
    """The template's (key, value) records."""
    records = []
    with path.open("rb") as handle:
        for line in handle:
            key, _, value = line.rstrip(b"\n").partition(b"\t")
            records.append((key, value))
    return records


def renamed(template: list[Record], prefix: str) -> list[Record]:
    """The template with every run id (key, ``run_id`` and ``event_id``) under ``prefix``."""
    new = prefix.encode()
    quoted_old, quoted_new = b'"' + TEMPLATE_PREFIX, b'"' + new
    return [(new + key[len(TEMPLATE_PREFIX):], value.replace(quoted_old, quoted_new)) for key, value in template]


def records(template: list[Record], count: int, prefix: str) -> Iterator[Record]:
    """``count`` records: passes over the template, each under its own prefix (``{prefix}c{n}-``)."""
    cycle = 0
    while count > 0:
        batch = renamed(template, f"{prefix}c{cycle}-")[:count]
        yield from batch
        count -= len(batch)
        cycle += 1


def mean_size(template: list[Record]) -> float:
    """Mean value size in bytes."""
    return sum(len(value) for _, value in template) / max(len(template), 1)


def check_renamed(template: list[Record]) -> None:
    """Fail loudly if renaming would miss a run id (the template format changed)."""
    key, value = renamed(template[:1], "x-")[0]
    event = orjson.loads(value)
    if event["run_id"].encode() != key or not event["event_id"].startswith("x-"):
        raise RuntimeError("bench corpus: run-id renaming no longer matches fleet_sim's event format")
