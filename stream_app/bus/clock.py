"""The wall clock, read at the edges only: the core never reads a clock (time comes from events).

Runtimes stamp their telemetry with it, workers judge an operator command's age and a decision's
latency with it, and listeners a decision's age.
"""

from __future__ import annotations

import time


def wall_clock_ms() -> int:
    """Epoch milliseconds now."""
    return time.time_ns() // 1_000_000
