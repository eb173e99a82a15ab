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
    except yaml.YAMLError as exc:
        raise PolicyError(f"{path}: not valid YAML: {exc}") from exc
    try:
        return Policy.from_mapping(document)
    except PolicyError as exc:
        raise PolicyError(f"{path}: {exc}") from exc
