"""The README's examples as code: integration tests execute them, so the documentation cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def example(heading: str) -> str:
    """The first ```python block after the README heading ``heading`` (e.g. "### MCP servers")."""
    text = README.read_text()
    at = text.find(f"\n{heading}\n")
    if at < 0:
        raise LookupError(f"README.md has no heading {heading!r}")
    match = re.compile(r"```python\n(.*?)```", re.DOTALL).search(text, at)
    if match is None:
        raise LookupError(f"README.md has no python example after {heading!r}")
    return match.group(1)
