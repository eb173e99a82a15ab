"""The worker puts what start-up made out of the garbage collector's reach once started
(stream_app/worker/main.py ``freeze_startup_objects``): full collections then walk only what it made since."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from stream_app.worker import main


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_start_up_objects_are_frozen_after_a_collection_and_later_garbage_is_still_collected() -> None:
    before = _Cycle()
    dead_before = weakref.ref(before)
    del before  # garbage made before the freeze: a collection frees it first, so none is frozen in
    kept = _Cycle()
    main.freeze_startup_objects()
    assert dead_before() is None
    assert gc.get_freeze_count() > 1000  # modules, classes, functions of this process
    assert not any(obj is kept for obj in gc.get_objects())  # frozen: no generation holds it
    later = _Cycle()
    dead_later = weakref.ref(later)
    del later
    gc.collect()
    assert dead_later() is None  # made after the freeze: collected as usual
    assert kept.me is kept


def test_the_worker_freezes_them_when_it_has_started_before_it_says_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    import faust

    seen: list[tuple[str, int]] = []

    class _Worker:  # faust.Worker's part serve relies on: its start-up callback, then the run
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        async def on_startup_finished(self) -> None:
            seen.append(("started", gc.get_freeze_count()))

        def execute_from_commandline(self) -> None:
            asyncio.run(self.on_startup_finished())

    monkeypatch.setattr(faust, "Worker", _Worker)
    main.serve(object(), "warning", on_ready=lambda: seen.append(("ready", gc.get_freeze_count())))
    assert [step for step, _ in seen] == ["started", "ready"]
    assert seen[0][1] == 0 and seen[1][1] > 1000
