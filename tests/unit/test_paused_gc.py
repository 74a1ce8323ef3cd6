"""Loads pause the cyclic garbage collector and always put it back as they found it."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import CheckpointNotFoundError, ShapeMismatchError
from gpuckpt.reading import paused_gc


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
