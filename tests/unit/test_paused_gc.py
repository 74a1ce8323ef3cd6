"""Loads pause the cyclic garbage collector and always put it back as they found it."""

from __future__ import annotations

import gc
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import CheckpointNotFoundError, ShapeMismatchError
from gpuckpt.runtime.collector import paused_gc


@pytest.fixture
def gc_state():  # type: ignore[no-untyped-def]
    was = gc.isenabled()
    yield
    gc.enable() if was else gc.disable()


def test_paused_gc_restores_the_previous_state(gc_state: None) -> None:
    gc.enable()
    with paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    with paused_gc():
        assert not gc.isenabled()
    assert not gc.isenabled(), "a collector the caller had turned off stays off"


def test_paused_gc_restores_it_when_the_body_fails(gc_state: None) -> None:
    gc.enable()
    with pytest.raises(RuntimeError, match="boom"), paused_gc():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_loads_run_with_the_collector_paused_and_restore_it(tmp_path: Path, gc_state: None) -> None:
    gc.enable()
    path = tmp_path / "ckpt"
    gpuckpt.save({"w": np.arange(10.0), "step": 1}, path)
    seen: list[bool] = []

    def progress(done: int, total: int) -> None:
        seen.append(gc.isenabled())

    target = {"w": np.zeros(10), "step": 0}
    gpuckpt.load(target, path, progress=progress)
    assert target["step"] == 1 and seen and not any(seen)
    assert gc.isenabled()
    seen.clear()
    assert gpuckpt.load_state_dict(path, progress=progress)["step"] == 1
    assert seen and not any(seen) and gc.isenabled()
    gpuckpt.read_metadata(path)
    assert gc.isenabled()
    with pytest.raises(ShapeMismatchError):
        gpuckpt.load({"w": np.zeros(3)}, path)
    assert gc.isenabled()
    with pytest.raises(CheckpointNotFoundError):
        gpuckpt.load_state_dict(tmp_path / "missing")
    assert gc.isenabled()


def test_saves_run_with_the_collector_paused_and_restore_it(tmp_path: Path, gc_state: None) -> None:
    """A save describes and plans every tensor before writing: no collection may walk those
    objects meanwhile (an async save: until it returns, not while it writes in the background)."""
    gc.enable()
    seen: list[bool] = []

    def progress(done: int, total: int) -> None:
        seen.append(gc.isenabled())

    state = {f"t{i}": np.full(4, i, np.float32) for i in range(50)}
    gpuckpt.save(state, tmp_path / "a", progress=progress)
    assert seen and not any(seen)
    assert gc.isenabled()
    with pytest.raises(gpuckpt.CheckpointExistsError):
        gpuckpt.save(state, tmp_path / "a")
    assert gc.isenabled()
    fut = gpuckpt.async_save(state, tmp_path / "b")
    assert gc.isenabled()
    fut.result()
    np.testing.assert_array_equal(gpuckpt.load_state_dict(tmp_path / "b")["t7"], state["t7"])


@pytest.mark.parametrize("kind", ["save", "async_save"])
def test_no_collection_runs_while_a_save_describes_and_plans(
    tmp_path: Path, gc_state: None, kind: str
) -> None:
    gc.enable()
    threshold = gc.get_threshold()
    inside: list[str] = []
    # an async save writes in the background with the collector on: only its caller's part
    # counts (the plan of 2,000 tensors is made in the background: BACKGROUND_PLAN_MIN)
    steps = {"describe_state", "snapshot"}
    if kind == "save":
        steps |= {"plan_save", "execute_save", "commit_save", "root_document"}

    def count(phase: str, info: dict[str, int]) -> None:
        frame: types.FrameType | None = sys._getframe(1)
        while phase == "start" and frame is not None:
            if frame.f_code.co_name in steps:
                inside.append(frame.f_code.co_name)
            frame = frame.f_back

    state = {f"t{i}": np.full(4, i, np.float32) for i in range(2000)}
    path = tmp_path / "c"
    gc.set_threshold(50)  # a collection every 50 allocations, were the collector on
    gc.callbacks.append(count)
    try:
        if kind == "save":
            gpuckpt.save(state, path)
        else:
            gpuckpt.async_save(state, path).result()
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
    assert inside == []
