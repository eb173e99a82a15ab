"""Small shared helpers: percentiles, medians of repeats, progress lines."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence

_STARTED = time.monotonic()


def percentiles(samples: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99/max and the sample count (inclusive method: never beyond the extremes)."""
    if len(samples) < 2:
        raise ValueError(f"need at least two samples, got {len(samples)}")
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return {"p50": cuts[49], "p95": cuts[94], "p99": cuts[98], "max": max(samples), "n": float(len(samples))}


def progress(message: str) -> None:
    """One progress line on stderr, stamped with the time since the benchmarks started."""
    elapsed = time.monotonic() - _STARTED
    print(f"[bench {int(elapsed // 60):2d}:{int(elapsed % 60):02d}] {message}", file=sys.stderr, flush=True)
