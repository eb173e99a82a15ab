"""The framework versions the worker's delivery path was built and tested against.

``delivery`` subclasses faust's consumer and reads private attributes of faust, mode and aiokafka (listed
in its docstring). A different release of any of them may rename or change one without notice and the
worker would then lose or duplicate work silently, so the worker refuses to start on untested versions
unless ``LOOPWARDEN_ALLOW_UNTESTED_FAUST=true`` (then it warns once). The README's upgrade checklist says
what to check before moving a pin here and in pyproject.toml.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

from ..core import LoopwardenError

#: Distribution name -> the exact version tested (pyproject.toml pins the same).
PINNED = {
    "faust-streaming": "0.15.3",
    "mode-streaming": "0.7.1",
    "aiokafka": "0.14.0",
}


class UntestedFramework(LoopwardenError, RuntimeError):
    """faust-streaming, mode-streaming or aiokafka at a version the delivery path was not tested with.
    Operator action: install the pinned versions (``pip install 'loopwarden[worker]'``), or set
    LOOPWARDEN_ALLOW_UNTESTED_FAUST=true after going through the README's upgrade checklist."""


def mismatches(version: Callable[[str], str] = metadata.version) -> list[str]:
    """``name installed (tested pinned)`` for each pinned distribution at another version or missing."""
    found = []
    for name, pinned in PINNED.items():
        try:
            installed = version(name)
        except metadata.PackageNotFoundError:
            installed = "missing"
        if installed != pinned:
            found.append(f"{name} {installed} (tested: {pinned})")
    return found


def check(allow_untested: bool, version: Callable[[str], str] = metadata.version) -> str | None:
    """Raise UntestedFramework on a mismatch unless ``allow_untested``; then return the warning to log."""
    found = mismatches(version)
    if not found:
        return None
    listed = ", ".join(found)
    if not allow_untested:
        raise UntestedFramework(
            f"untested framework versions: {listed}; the worker's delivery path relies on their private "
            "internals (stream_app/worker/delivery.py). Install the pinned versions, or set "
            "LOOPWARDEN_ALLOW_UNTESTED_FAUST=true after the README's upgrade checklist")
    return f"LOOPWARDEN_ALLOW_UNTESTED_FAUST=true: running on untested framework versions: {listed}"
