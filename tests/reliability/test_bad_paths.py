"""A checkpoint path of the wrong type, an empty one or one of an unknown scheme is a typed
error naming what was given and what to give instead, raised before anything is written
or read; an earlier checkpoint stays loadable."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt import CheckpointManager, InvalidPathError
from gpuckpt.verify import verify_checkpoint

BAD_PATHS: list[tuple[Any, str]] = [
    ({"w": np.zeros(2)}, "the state dict comes first"),
    (None, "found NoneType"),
    (7, "found int"),
    (b"/tmp/ckpt", "os.fsdecode"),
    ("", "is empty"),
    ("file://", "is empty"),
    ("gs://bucket/run", "no storage back end for gs://"),
]


@pytest.fixture
def earlier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # the working directory is where a path read as "" or "file://" would land
    monkeypatch.chdir(tmp_path)
    gpuckpt.save({"w": np.arange(4.0)}, tmp_path / "earlier")
    return tmp_path / "earlier"


def _unchanged(tmp_path: Path, earlier: Path) -> None:
    assert sorted(os.listdir(tmp_path)) == ["earlier"]
    sd = {"w": np.zeros(4)}
    gpuckpt.load(sd, earlier)
    np.testing.assert_array_equal(sd["w"], np.arange(4.0))


@pytest.mark.parametrize(("path", "says"), BAD_PATHS, ids=[repr(p)[:20] for p, _ in BAD_PATHS])
def test_save_and_async_save_refuse_bad_paths(tmp_path: Path, earlier: Path, path: Any, says: str) -> None:
    state = {"w": np.ones(3)}
    with pytest.raises(InvalidPathError, match=says) as info:
        gpuckpt.save(state, path)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)
    with pytest.raises(InvalidPathError, match=says):
        gpuckpt.async_save(state, path).result(timeout=60)
    _unchanged(tmp_path, earlier)


@pytest.mark.parametrize(("path", "says"), BAD_PATHS, ids=[repr(p)[:20] for p, _ in BAD_PATHS])
def test_load_read_metadata_and_verify_refuse_bad_paths(
    tmp_path: Path, earlier: Path, path: Any, says: str
) -> None:
    sd = {"w": np.full(4, 9.0)}
    with pytest.raises(InvalidPathError, match=says):
        gpuckpt.load(sd, path)
    np.testing.assert_array_equal(sd["w"], np.full(4, 9.0))
    with pytest.raises(InvalidPathError, match=says):
        gpuckpt.read_metadata(path)
    with pytest.raises(InvalidPathError, match=says):
        verify_checkpoint(path)
    _unchanged(tmp_path, earlier)


def test_swapped_load_arguments_name_the_order(tmp_path: Path, earlier: Path) -> None:
    sd = {"w": np.zeros(4)}
    with pytest.raises(InvalidPathError, match=r"load\(state_dict, path\)"):
        gpuckpt.load(str(earlier), sd)  # type: ignore[arg-type]
    np.testing.assert_array_equal(sd["w"], np.zeros(4))


@pytest.mark.parametrize("root", [None, 3, b"runs", "", "gs://bucket/runs"])
def test_manager_refuses_a_bad_root_at_construction(tmp_path: Path, earlier: Path, root: Any) -> None:
    with pytest.raises(InvalidPathError):
        CheckpointManager(root)
    _unchanged(tmp_path, earlier)
