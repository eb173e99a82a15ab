"""Core benchmark: detector throughput with parsing, memory per tracked run, and the cost of one call
as a run grows, beside the naive design that keeps and rescans the whole history (bench/naive.py).

    python -m bench.core [--runs 10000] [--calls 100] [--repeat 3] [--json bench/results/core.json]

Generates ``runs x calls`` telemetry lines (1 million by default, 10,000 runs all active at once,
interleaved call by call), then times the replay path (JSONL bytes -> decode -> detector -> control
JSON) over them with both engines: the native one (``loopwarden replay``'s default when installed) and
the Python reference, and checks that their outputs are byte-identical. Prints the median of
``--repeat`` passes. The iteration ceiling is raised to 1,000 so that runs are not cut at 51 calls: a
halted run's events are nearly free, and counting them would flatter the figure.

Then the worker's batch function (``stream_app.worker.batch``) without Kafka: the fleet simulator's mix
folded in batches of 1,000 records (8 partitions, stored runs in a dict) by both engines, with the cost
of the stored-record codec alone (decode and encode each run a batch touches).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import orjson

from stream_app.commands.replay import Engine, replay
from stream_app.core import Detector, Policy, RunState, RunTable, TelemetryEvent, decode_event, semantic_hash

from . import naive

BATCH = 1_000
PARTITIONS = 8

BENCH_POLICY = Policy.from_mapping({"defaults": {"iteration_ceiling": 1000}})


def _run_calls(rng: random.Random, kind: str, calls: int) -> Iterator[dict[str, Any]]:
    """One run's calls (without ids and times) for a behaviour ``kind``."""
    for i in range(calls):
        if kind == "healthy":
            yield {"tool": rng.choice(("search", "read", "write", "plan")), "outcome": "success",
                   "args": {"query": f"item {i} {rng.randrange(10**6)}", "limit": 10, "filters": {"lang": "en"}},
                   "result": {"hits": rng.randrange(100)}, "plan_step": i // 5}
        elif kind == "flaky":
            ok = i % 3 == 2
            yield {"tool": "fetch", "outcome": "success" if ok else "error", "retry_budget": 5,
                   "args": {"url": f"https://api.example.com/v1/items/{i // 3}", "attempt": i % 3},
                   "result": {"items": [i]} if ok else {"status": 503, "error": "unavailable"}}
        elif kind == "polling":
            yield {"tool": "check_job", "outcome": "success", "args": {"job_id": "j-1"},
                   "result": {"state": "running"}}
        elif kind == "runaway":
            yield {"tool": "search", "outcome": "error", "args": {"query": "q3 report"},
                   "result": {"error": "index unavailable"}}
        elif kind == "volatile":  # the same failure with a fresh duration, request id and time each call
            yield {"tool": "search_docs", "outcome": "error", "args": {"query": "refund policy"},
                   "result": {"error": f"upstream timeout after {rng.randrange(30_000, 31_000)}ms (request "
                                       f"req_{rng.getrandbits(40):010x}) at 2026-12-01T15:{i % 60:02d}:"
                                       f"{rng.randrange(60):02d}.{rng.randrange(1000):03d}Z",
                              "status": 504}}
        elif kind == "rereads":  # tool classes: reads of files that never change, an edit now and then
            if i % 7 == 6:
                yield {"tool": "apply_patch", "outcome": "success", "tool_class": "write", "target": "/src/app.py",
                       "state_hash": f"{i:064x}", "args": {"path": "/src/app.py", "patch": f"p{i}"}, "result": "ok"}
            else:
                path = f"/src/{i % 3}.py"
                yield {"tool": "read_file", "outcome": "success", "tool_class": "read", "target": path,
                       "args": {"path": path}, "result": {"text": f"contents of {path}"}}
        elif kind == "edits":  # tool classes: an edit undone and redone
            yield {"tool": "apply_patch", "outcome": "success", "tool_class": "write", "target": "/src/app.py",
                   "state_hash": f"{i % 2:064x}", "args": {"path": "/src/app.py", "patch": f"p{i % 2}"},
                   "result": "ok"}
        elif kind == "mutating":
            yield {"tool": "search", "outcome": "error", "args": {"query": "refund", "token": f"{rng.getrandbits(48):x}"},
                   "result": {"error": "rate limited"}}
        else:  # side effects, mostly distinct
            yield {"tool": "send_email", "outcome": "success", "side_effect": True,
                   "args": {"to": f"user{rng.randrange(50)}@example.com", "subject": "update", "body": "text " * 8},
                   "result": {"id": f"m-{i}"}}


KINDS = ("healthy", "flaky", "polling", "runaway", "mutating", "side_effect")
WEIGHTS = (50, 15, 10, 10, 10, 5)
#: The detection-round-2 corpus: a tenth of the runs fail the same way with volatile tokens in the error,
#: a tenth read and write with tool classes (some rereading unchanged files, some undoing edits).
KINDS_VOLATILE = (*KINDS, "volatile", "rereads", "edits")
WEIGHTS_VOLATILE = (40, 10, 10, 5, 10, 5, 10, 7, 3)


def generate_lines(runs: int, calls: int, seed: int = 1, hashed: bool = False, volatile: bool = False) -> list[bytes]:
    """All events as JSONL lines, interleaved call by call across runs (every run active at once).
    ``hashed``: arguments and results travel as hashes, as the SDK sends them by default. ``volatile``:
    the round-2 mix, with runs whose identical failures differ only in volatile tokens."""
    rng = random.Random(seed)
    kinds, weights = (KINDS_VOLATILE, WEIGHTS_VOLATILE) if volatile else (KINDS, WEIGHTS)
    plans = [(f"run-{r:06d}", _run_calls(rng, rng.choices(kinds, weights)[0], calls)) for r in range(runs)]
    lines = []
    ts = 1_764_000_000_000
    for i in range(calls):
        for run_id, script in plans:
            ts += 1
            body = next(script)
            if hashed:
                body["args_hash"] = semantic_hash(body.pop("args"))
                body["result_hash"] = semantic_hash(body.pop("result"))
            lines.append(orjson.dumps({"run_id": run_id, "event_id": f"{run_id}-{i}", "ts_ms": ts,
                                       "agent_id": "bench-agent", **body}))
    return lines


def time_replay(lines: list[bytes], engine: Engine) -> tuple[float, bytes]:
    """Seconds for one replay pass over ``lines``, and the decisions written."""
    out = io.BytesIO()
    gc.collect()
    start = time.perf_counter()
    replay(lines, BENCH_POLICY, out, io.StringIO(), engine=engine)
    return time.perf_counter() - start, out.getvalue()


def replay_rates(lines: list[bytes], engine: Engine, repeat: int, label: str) -> tuple[list[float], bytes]:
    """Events/s of ``repeat`` passes (progress on stderr), and the decisions of the last one."""
    rates = []
    for attempt in range(repeat):
        elapsed, decisions = time_replay(lines, engine)
        rates.append(len(lines) / elapsed)
        written = decisions.count(b"\n")
        print(f"  {label} pass {attempt + 1}/{repeat}: {rates[-1]:,.0f} events/s ({written:,} decisions)",
              file=sys.stderr, flush=True)
    return rates, decisions


def time_core_only(lines: list[bytes]) -> float:
    """Seconds for the detector alone over pre-decoded events (no parsing, no output)."""
    events = [decode_event(orjson.loads(line)) for line in lines]
    table = RunTable(Detector(BENCH_POLICY))
    gc.collect()
    start = time.perf_counter()
    for event in events:
        table.observe(event)
    return time.perf_counter() - start


def native_bytes_per_run(runs: int, calls: int, volatile: bool = False) -> float:
    """Heap bytes the native engine holds per tracked run (states, digests, table entry, run-id keys),
    counted by its allocator as tracemalloc counts Python's."""
    from loopwarden_native import Replayer, heap_bytes

    lines = generate_lines(runs, calls, seed=2, volatile=volatile)
    before = heap_bytes()
    engine = Replayer(BENCH_POLICY, runs, 1 << 20)
    engine.feed(lines, 0)
    held: int = heap_bytes() - before
    assert len(engine) == runs
    return held / runs


def bytes_per_run(runs: int, calls: int, volatile: bool = False) -> float:
    """Traced heap bytes held per tracked run (states, digests, table entry, run-id key)."""
    lines = generate_lines(runs, calls, seed=2, volatile=volatile)
    events = [decode_event(orjson.loads(line)) for line in lines]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    table = RunTable(Detector(BENCH_POLICY))
    for event in events:
        table.observe(event)
    del events
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(table) == runs
    return held / runs


RUN_LENGTHS = (10, 100, 1_000, 10_000, 100_000)
TIMED_CALLS = 300


def _long_run_event(i: int) -> TelemetryEvent:
    """Call ``i`` of a long healthy run: distinct arguments and results, 1 ms apart, never halted."""
    return decode_event({"run_id": "long", "event_id": f"long-{i}", "tool": "browse", "ts_ms": 1_000_000 + i,
                         "outcome": "success", "args": {"page": i}, "result": {"links": i}})


def cost_vs_run_length() -> list[dict[str, float]]:
    """Microseconds per call after a run already has N calls, ours and naive (median of 3 timings)."""
    detector = Detector(Policy.from_mapping({"defaults": {"iteration_ceiling": 10**9}}))
    rows = []
    for length in RUN_LENGTHS:
        timed = [_long_run_event(length + i) for i in range(TIMED_CALLS)]
        ours, theirs = [], []
        for _ in range(3):
            state = RunState()
            for i in range(length):
                detector.evaluate(state, _long_run_event(i))
            start = time.perf_counter()
            for event in timed:
                detector.evaluate(state, event)
            ours.append((time.perf_counter() - start) / TIMED_CALLS * 1e6)
            # The naive history is built directly (feeding it call by call would take O(N^2) to set up).
            run = naive.NaiveRun([naive.Call("browse", f"a{i}", "success", f"r{i}", 1_000_000 + i, False)
                                  for i in range(length)])
            start = time.perf_counter()
            for event in timed:
                naive.observe(run, event)
            theirs.append((time.perf_counter() - start) / TIMED_CALLS * 1e6)
        rows.append({"calls": length, "ours_us": statistics.median(ours), "naive_us": statistics.median(theirs)})
        print(f"  run length {length:>7,}: ours {rows[-1]['ours_us']:8.1f} us/call, "
              f"naive {rows[-1]['naive_us']:10.1f} us/call", file=sys.stderr, flush=True)
    return rows


def _batches(runs: int) -> list[list[Any]]:
    """The fleet simulator's mix as input records, in batches of ``BATCH`` (partitioned by run id)."""
    import zlib

    from stream_app.bus.wire import encode_telemetry
    from stream_app.devtools.fleet_sim import simulate_fleet
    from stream_app.worker.batch import RawRecord

    _, stream = simulate_fleet(runs, seed=11)
    offsets = [0] * PARTITIONS
    records = []
    for event in stream:
        key, value = encode_telemetry(event)
        partition = zlib.crc32(key) % PARTITIONS
        records.append(RawRecord(partition, offsets[partition], key, value))
        offsets[partition] += 1
    return [records[i:i + BATCH] for i in range(0, len(records), BATCH)]


def _unkept() -> Any:
    """The native fold without its kept decoded states (every stored record read again each batch)."""
    from loopwarden_native import BatchFolder

    from stream_app.worker.batch import NativeBatchFold

    fold = NativeBatchFold(Detector())
    fold._native = BatchFolder(fold.detector.policy, fold.policy_digest, fold.write_version,
                               fold.max_event_bytes, fold.facts, decoded_runs=0)
    return fold


def batch_fold_costs(runs: int = 4_000, repeat: int = 3) -> dict[str, Any]:
    """Microseconds per event of ``BatchFold.fold`` (Python) and ``NativeBatchFold.fold`` (with and without
    the decoded states it keeps: passes of the two interleaved), and per run touched of the stored-record
    codec (Python: decode_run + encode_run), medians of ``repeat`` passes."""
    from stream_app.core.stored import decode_run, encode_run
    from stream_app.worker.batch import BatchFold, NativeBatchFold

    batches = _batches(runs)
    events = sum(map(len, batches))
    out: dict[str, Any] = {"events": events, "batch": BATCH, "runs": runs}
    engines: list[tuple[str, Any]] = [("python", lambda: BatchFold(Detector()))]
    try:
        import loopwarden_native  # noqa: F401
        engines.append(("native", lambda: NativeBatchFold(Detector())))
        engines.append(("native_unkept", _unkept))
    except ImportError:
        pass
    passes: dict[str, list[float]] = {name: [] for name, _ in engines}
    for n in range(repeat):
        for name, make in engines if n % 2 == 0 else engines[::-1]:  # order alternated: neither always first
            fold = make()
            store: dict[tuple[int, bytes], bytes] = {}
            touched = 0
            elapsed = 0.0
            for batch in batches:
                stored = {pair: store.get(pair) for pair in BatchFold.keys(batch)}
                started = time.perf_counter()
                result = fold.fold(batch, stored, now_ms=0)
                elapsed += time.perf_counter() - started
                for partition, items in result.records.items():
                    touched += len(items)
                    store.update(((partition, key), value) for key, value in items)
            passes[name].append(elapsed / events * 1e6)
            out["runs_written_per_batch"] = touched / len(batches)
            if name == "python" and "python_codec_us_per_run" not in out:
                records = list(store.values())
                started = time.perf_counter()
                for raw in records:
                    encode_run(decode_run(raw))
                out["python_codec_us_per_run"] = (time.perf_counter() - started) / len(records) * 1e6
                out["stored_record_bytes_mean"] = sum(map(len, records)) / len(records)
    for name, times in passes.items():
        out[f"{name}_us_per_event"] = statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON (for BENCHMARKS.md)")
    args = parser.parse_args(argv)
    n = args.runs * args.calls
    print(f"core: generating {n:,} events across {args.runs:,} runs ...", file=sys.stderr, flush=True)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    lines = generate_lines(args.runs, args.calls)
    rates, native_out = replay_rates(lines, "native", args.repeat, "native")
    python_rates, python_out = replay_rates(lines, "python", args.repeat, "python")
    identical = native_out == python_out
    print(f"  native and python decisions byte-identical: {identical}", file=sys.stderr, flush=True)
    core_rate = n / time_core_only(lines)
    del lines
    print("core: the round-2 mix (volatile tokens in failures, tool classes) ...", file=sys.stderr, flush=True)
    volatile_lines = generate_lines(args.runs, args.calls, volatile=True)
    volatile_rates, volatile_out = replay_rates(volatile_lines, "native", args.repeat, "native, volatile")
    volatile_python_rates, volatile_python_out = replay_rates(volatile_lines, "python", args.repeat,
                                                              "python, volatile")
    volatile_identical = volatile_out == volatile_python_out
    volatile_halts = volatile_out.count(b'"match":"fingerprint"')
    del volatile_lines
    print("core: the same events with client-side hashes (the SDK's default) ...", file=sys.stderr, flush=True)
    hashed_lines = generate_lines(args.runs, args.calls, hashed=True)
    hashed_rates, _ = replay_rates(hashed_lines, "native", args.repeat, "native, hashed")
    hashed_python_rates, _ = replay_rates(hashed_lines, "python", args.repeat, "python, hashed")
    del hashed_lines
    native_per_run = native_bytes_per_run(args.runs, 30)
    per_run = bytes_per_run(args.runs, 30)
    native_per_run_volatile = native_bytes_per_run(args.runs, 30, volatile=True)
    per_run_volatile = bytes_per_run(args.runs, 30, volatile=True)
    print("core: cost of one call as a run grows (ours vs naive history rescan) ...", file=sys.stderr, flush=True)
    growth = cost_vs_run_length()
    print("core: the worker's batch function, batches of 1,000 (both engines) ...", file=sys.stderr, flush=True)
    fold_costs = batch_fold_costs(repeat=args.repeat)
    result = {
        "events": n,
        "runs": args.runs,
        "replay_events_per_s": statistics.median(rates),
        "replay_passes": rates,
        "replay_python_events_per_s": statistics.median(python_rates),
        "replay_python_passes": python_rates,
        "engines_identical": identical,
        "replay_volatile_events_per_s": statistics.median(volatile_rates),
        "replay_volatile_passes": volatile_rates,
        "replay_volatile_python_events_per_s": statistics.median(volatile_python_rates),
        "volatile_engines_identical": volatile_identical,
        "volatile_fingerprint_decisions": volatile_halts,
        "replay_hashed_events_per_s": statistics.median(hashed_rates),
        "replay_hashed_python_events_per_s": statistics.median(hashed_python_rates),
        "detector_only_events_per_s": core_rate,
        "bytes_per_tracked_run": native_per_run,
        "bytes_per_tracked_run_python": per_run,
        "bytes_per_tracked_run_volatile": native_per_run_volatile,
        "bytes_per_tracked_run_volatile_python": per_run_volatile,
        "cost_vs_run_length": growth,
        "batch_fold": fold_costs,
    }
    print(f"core.replay_events_per_s (native engine, median of {args.repeat}, parsing included): "
          f"{result['replay_events_per_s']:,.0f}")
    print(f"core.replay_python_events_per_s (reference engine, median of {args.repeat}): "
          f"{result['replay_python_events_per_s']:,.0f} (native/python {result['replay_events_per_s'] / result['replay_python_events_per_s']:.1f}x)")
    print(f"core.engines_identical (decisions byte for byte): {identical}")
    print(f"core.replay_volatile_events_per_s (round-2 mix, native / python, median of {args.repeat}): "
          f"{result['replay_volatile_events_per_s']:,.0f} / {result['replay_volatile_python_events_per_s']:,.0f}; "
          f"{volatile_halts:,} decisions matched on fingerprints; engines identical: {volatile_identical}")
    print(f"core.replay_hashed_events_per_s (args/results as hashes, native / python): "
          f"{result['replay_hashed_events_per_s']:,.0f} / {result['replay_hashed_python_events_per_s']:,.0f}")
    print(f"core.detector_only_events_per_s (reference, pre-decoded events): {core_rate:,.0f}")
    print(f"core.bytes_per_tracked_run (native, {args.runs:,} runs x 30 calls, its allocator's count): "
          f"{native_per_run:,.0f}")
    print(f"core.bytes_per_tracked_run_python ({args.runs:,} runs x 30 calls, tracemalloc): {per_run:,.0f}")
    print(f"core.bytes_per_tracked_run on the round-2 mix (native / python): {native_per_run_volatile:,.0f} / "
          f"{per_run_volatile:,.0f}")
    first, last = growth[0], growth[-1]
    print(f"core.cost_per_call_us at {first['calls']:,} -> {last['calls']:,} calls: ours {first['ours_us']:.1f} -> "
          f"{last['ours_us']:.1f}, naive {first['naive_us']:.1f} -> {last['naive_us']:.1f}")
    print(f"core.batch_fold_us_per_event (batches of {BATCH}, python / native / native without its kept states): "
          f"{fold_costs['python_us_per_event']:.1f} / {fold_costs.get('native_us_per_event', float('nan')):.1f} / "
          f"{fold_costs.get('native_unkept_us_per_event', float('nan')):.1f}; "
          f"{fold_costs['runs_written_per_batch']:.0f} runs written per batch, Python codec "
          f"{fold_costs['python_codec_us_per_run']:.1f} us per run ({fold_costs['stored_record_bytes_mean']:.0f} B)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
