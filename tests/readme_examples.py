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


def blocks(heading: str) -> list[tuple[str, str]]:
    """Every fenced block (language, text) of the README section under ``heading``, in order, up to the
    next heading of the same or a higher level (lines inside fences are never headings)."""
    level = len(heading.split(" ", 1)[0])
    found: list[tuple[str, str]] = []
    inside, fence, body = False, "", []
    for line in README.read_text().splitlines():
        if not inside and line == heading:
            inside = True
            continue
        if not inside:
            continue
        if fence:
            if line.startswith("```"):
                found.append((fence, "\n".join(body) + "\n"))
                fence, body = "", []
            else:
                body.append(line)
        elif line.startswith("```"):
            fence = line[3:].strip() or "text"
        elif line.startswith("#") and len(line.split(" ", 1)[0]) <= level and set(line.split(" ", 1)[0]) == {"#"}:
            break
    if not inside:
        raise LookupError(f"README.md has no heading {heading!r}")
    return found
