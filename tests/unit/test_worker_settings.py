"""Worker settings that shape the batch path (stream_app.worker.settings, worker.app.configured_app)."""

from __future__ import annotations

import pytest

faust = pytest.importorskip("faust")

from stream_app.worker.app import configured_app  # noqa: E402
from stream_app.worker.settings import SETTINGS, WorkerSettings  # noqa: E402

BASE = {"LOOPWARDEN_ALLOW_UNSIGNED": "true"}


def test_the_batch_window_is_accepted_for_one_release_with_a_notice() -> None:
    settings = WorkerSettings.from_env({**BASE, "LOOPWARDEN_BATCH_WITHIN_S": "0.02"})
    (notice,) = settings.notices
    assert notice.startswith("LOOPWARDEN_BATCH_WITHIN_S is ignored") and "remove the variable" in notice
    assert WorkerSettings.from_env(BASE).notices == ()
    assert "LOOPWARDEN_BATCH_WITHIN_S" not in {var for _, var, _, _ in SETTINGS.rows}


def test_a_batch_is_at_most_batch_max_records_per_fetch(tmp_path) -> None:
    settings = WorkerSettings.from_env({**BASE, "LOOPWARDEN_BATCH_MAX": "750", "LOOPWARDEN_STATE_DIR": str(tmp_path)})
    conf = configured_app(settings).conf
    assert conf.broker_max_poll_records == 750
    assert conf.stream_wait_empty  # the batch in hand is waited for in wait_empty
    assert conf.producer_max_batch_size >= 256 * 1024


def test_the_engine_is_native_when_installed_and_named_in_a_metric(tmp_path) -> None:
    pytest.importorskip("loopwarden_native")
    from stream_app.core import Detector
    from stream_app.worker.app import batch_fold, create_app
    from stream_app.worker.batch import BatchFold, NativeBatchFold
    from stream_app.worker.metrics import WorkerMetrics

    for engine, expected in (("auto", NativeBatchFold), ("native", NativeBatchFold), ("python", BatchFold)):
        settings = WorkerSettings.from_env({**BASE, "LOOPWARDEN_ENGINE": engine})
        assert type(batch_fold(settings, Detector(), None)) is expected
    metrics = WorkerMetrics()
    create_app(WorkerSettings.from_env({**BASE, "LOOPWARDEN_STATE_DIR": str(tmp_path)}), Detector().policy, metrics)
    assert metrics.registry.get_sample_value("loopwarden_engine_info", {"engine": "native"}) == 1


def test_asking_for_the_native_engine_without_it_is_a_start_up_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from stream_app.core import Detector
    from stream_app.worker.app import batch_fold
    from stream_app.worker.batch import BatchFold
    from stream_app.worker.settings import SettingsError

    monkeypatch.setitem(sys.modules, "loopwarden_native", None)  # as if not installed
    with pytest.raises(SettingsError, match=r"LOOPWARDEN_ENGINE=native but the native engine .* pip install ./native"):
        batch_fold(WorkerSettings.from_env({**BASE, "LOOPWARDEN_ENGINE": "native"}), Detector(), None)
    assert type(batch_fold(WorkerSettings.from_env(BASE), Detector(), None)) is BatchFold  # auto falls back
    with pytest.raises(SettingsError, match="LOOPWARDEN_ENGINE='rust'"):
        WorkerSettings.from_env({**BASE, "LOOPWARDEN_ENGINE": "rust"})


def test_writing_an_older_state_format_warns_what_cannot_fire(caplog: pytest.LogCaptureFixture) -> None:
    """During a rolling upgrade the operator may keep writing format 1: the worker says what that costs."""
    from stream_app.core import Detector
    from stream_app.worker.app import batch_fold

    batch_fold(WorkerSettings.from_env({**BASE, "LOOPWARDEN_STATE_WRITE_VERSION": "1"}), Detector(), None)
    assert "budgets, max_calls and max_model_calls_without_tool cannot fire" in caplog.text
    caplog.clear()
    batch_fold(WorkerSettings.from_env(BASE), Detector(), None)
    assert "cannot fire" not in caplog.text
