"""Loading a policy file (YAML, as it lives in a Kubernetes ConfigMap) into a core ``Policy``."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..core import Policy, PolicyError


def load_policy(path: str | Path | None) -> Policy:
    """The policy in ``path``, or the defaults when no path is given; raise PolicyError naming the file."""
    if path is None:
        return Policy()
    try:
        document = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read policy file: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise PolicyError(f"{path}: not UTF-8 text (byte {exc.start}): a policy file is YAML in UTF-8") from exc
    except yaml.YAMLError as exc:
        raise PolicyError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from exc
    try:
        return Policy.from_mapping(document)
    except PolicyError as exc:
        raise PolicyError(f"{path}: {exc}") from exc


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong and where (PyYAML's own text spans several, with a caret)."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem is None:
        return " ".join(str(exc).split())
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(problem)
