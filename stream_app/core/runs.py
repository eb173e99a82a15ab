"""In-memory run states for the replay CLI and the in-process SDK mode (the worker keeps its own in
a RocksDB table). Runs silent for ``run_ttl_ms`` of event time, or beyond ``max_runs``, are forgotten,
so memory stays bounded however many runs pass through."""

from __future__ import annotations

from collections import OrderedDict

from .contract import TelemetryEvent
from .detector import Detector, Evaluation, RunState

#: Runs tracked at most (the least recently active are forgotten first).
DEFAULT_MAX_RUNS = 1_000_000


class RunTable:
    """Run id -> RunState, least recently active first, with event-time eviction."""

    def __init__(self, detector: Detector, max_runs: int = DEFAULT_MAX_RUNS) -> None:
        self.detector = detector
        self.max_runs = max_runs
        self.evicted = 0
        self._ttl_ms = detector.policy.defaults.run_ttl_ms
        self._runs: OrderedDict[str, RunState] = OrderedDict()
        self._watermark_ms = 0

    def __len__(self) -> int:
        return len(self._runs)

    def get(self, run_id: str) -> RunState | None:
        return self._runs.get(run_id)

    def observe(self, event: TelemetryEvent) -> Evaluation:
        """Evaluate one event against its run, creating the run on first sight."""
        runs = self._runs
        state = runs.get(event.run_id)
        if state is None:
            state = runs[event.run_id] = RunState()
        else:
            runs.move_to_end(event.run_id)
        evaluation = self.detector.evaluate(state, event)
        if event.ts_ms > self._watermark_ms:
            self._watermark_ms = event.ts_ms
        self._evict()
        return evaluation

    def halt(self, run_id: str, decision_id: str) -> bool:
        """A halt made elsewhere (an operator's): the run folds nothing more until resumed; False if the
        run is not tracked."""
        state = self._runs.get(run_id)
        if state is None:
            return False
        state.halted_by = decision_id
        return True

    def resume(self, run_id: str) -> bool:
        """Operator resume; False if the run is not tracked."""
        state = self._runs.get(run_id)
        if state is None:
            return False
        self.detector.resume(state)
        return True

    def _evict(self) -> None:
        runs = self._runs
        horizon = self._watermark_ms - self._ttl_ms
        while runs:
            oldest = next(iter(runs.values()))
            if oldest.last_ts_ms >= horizon and len(runs) <= self.max_runs:
                return
            runs.popitem(last=False)
            self.evicted += 1
