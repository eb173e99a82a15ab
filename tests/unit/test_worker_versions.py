"""The worker refuses framework versions its delivery path was not tested with (stream_app.worker.versions)."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from stream_app.worker import versions
from stream_app.worker.versions import PINNED, UntestedFramework

REPO = Path(__file__).resolve().parents[2]


def _installed(**overrides: str):
    def version(name: str) -> str:
        if overrides.get(name) == "missing":
            raise metadata.PackageNotFoundError(name)
        return overrides.get(name, PINNED[name])
    return version


def test_the_pins_are_the_ones_pyproject_installs_and_the_ones_installed() -> None:
    worker = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["worker"]
    pinned = dict(re.fullmatch(r"([a-z-]+)==([0-9.]+)", spec).groups() for spec in worker if "==" in spec)
    pytest.importorskip("faust")
    for name, version in PINNED.items():
        assert metadata.version(name) == version and pinned[name] == version, name
    assert versions.check(allow_untested=False) is None


@pytest.mark.parametrize(("name", "installed"), [("faust-streaming", "0.15.4"), ("mode-streaming", "0.8.0"),
                                                 ("aiokafka", "0.13.0"), ("aiokafka", "missing")])
def test_another_version_is_refused_naming_it_and_the_way_out(name: str, installed: str) -> None:
    with pytest.raises(UntestedFramework) as caught:
        versions.check(allow_untested=False, version=_installed(**{name: installed}))
    message = str(caught.value)
    assert f"{name} {installed} (tested: {PINNED[name]})" in message
    assert "LOOPWARDEN_ALLOW_UNTESTED_FAUST=true" in message and "delivery.py" in message
    assert sum(pin in message for pin in PINNED) == 1  # only the one that differs


def test_allowed_it_starts_with_a_warning() -> None:
    warning = versions.check(allow_untested=True, version=_installed(**{"faust-streaming": "0.16.0"}))
    assert warning is not None and "faust-streaming 0.16.0 (tested: 0.15.3)" in warning
    assert versions.check(allow_untested=True, version=_installed()) is None


def test_the_worker_refuses_before_it_touches_kafka(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("faust")
    from stream_app.worker.main import run_worker
    from stream_app.worker.settings import WorkerSettings

    monkeypatch.setitem(PINNED, "aiokafka", "0.0.1")
    settings = WorkerSettings.from_env({"LOOPWARDEN_ALLOW_UNSIGNED": "true", "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
                                        "LOOPWARDEN_STATE_DIR": str(tmp_path / "state")})
    with pytest.raises(UntestedFramework, match=re.escape("aiokafka 0.14.0 (tested: 0.0.1)")):
        run_worker(settings)
    assert not (tmp_path / "state").exists()
    allowed = WorkerSettings.from_env({"LOOPWARDEN_ALLOW_UNSIGNED": "true", "LOOPWARDEN_ALLOW_UNTESTED_FAUST": "true"})
    assert allowed.allow_untested_faust and not settings.allow_untested_faust


def test_the_delivery_docstring_names_the_pins() -> None:
    from stream_app.worker import delivery

    for name, version in (("faust-streaming", "0.15.3"), ("mode-streaming", "0.7.1"), ("aiokafka", "0.14.0")):
        assert f"{name} {version}" in (delivery.__doc__ or "") and PINNED[name] == version
