"""A/B of the native replay path between two trees: run it in each (with that tree's native engine
installed or on PYTHONPATH) and compare, interleaved, several times: the machine is noisy.

    python -m bench.core_ab            # this tree: {"old_corpus": events/s, "volatile_corpus": ..., ...}
    # another tree (its bench.core and its native engine, built with pip install --target DIR ./native):
    cd OTHER_TREE && PYTHONPATH=DIR:. python /path/to/this/tree/bench/core_ab.py

The old corpus is ``bench.core``'s default mix; the round-2 corpus (volatile tokens in failures, tool
classes) exists from detection round 2 on, so an older tree prints the old corpus only.
"""

from __future__ import annotations

import json

from bench.core import generate_lines, replay_rates


def main() -> int:
    lines = generate_lines(10_000, 100)
    rates, _ = replay_rates(lines, "native", 1, "native")
    out: dict[str, float | int] = {"old_corpus": rates[0]}
    try:
        volatile = generate_lines(10_000, 100, volatile=True)  # type: ignore[call-arg]
    except TypeError:  # a tree before the round-2 corpus
        print(json.dumps(out))
        return 0
    rates, decisions = replay_rates(volatile, "native", 1, "native, round-2 corpus")
    out["volatile_corpus"] = rates[0]
    out["fingerprint_decisions"] = decisions.count(b'"match":"fingerprint"')
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
