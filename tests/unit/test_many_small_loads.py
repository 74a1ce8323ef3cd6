"""Loads of many small tensors: exact, independent arrays; a damaged chunk among many named before anything is read."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.loading.checks import BACKGROUND_CHECK_MIN


def test_load_state_dict_of_many_small_tensors_is_exact_and_independent(tmp_path: Any) -> None:
    rng = np.random.default_rng(2)
    state = {
        "w": {f"t{i}": rng.standard_normal(int(rng.integers(1, 400))).astype(np.float32) for i in range(300)},
        "img": np.ascontiguousarray(rng.standard_normal((2, 5, 4, 3)).astype(np.float16)).transpose(
            0, 3, 1, 2
        ),
        "big": rng.standard_normal((1 << 18) + 10).astype(np.float32),
    }
    gpuckpt.save(state, tmp_path / "ck")
    out = gpuckpt.load_state_dict(tmp_path / "ck")
    for k, v in state["w"].items():
        np.testing.assert_array_equal(out["w"][k], v)
    np.testing.assert_array_equal(out["img"], state["img"])
    assert out["img"].strides == state["img"].strides  # channels-last memory kept
    np.testing.assert_array_equal(out["big"], state["big"])
    out["w"]["t0"][...] = 7
    np.testing.assert_array_equal(out["w"]["t1"], state["w"]["t1"])


@pytest.mark.parametrize("count", [50, 3 * BACKGROUND_CHECK_MIN])
@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_damaged_chunk_among_many_is_named_before_anything_is_read(
    tmp_path: Any, damage: str, count: int
) -> None:
    """Below BACKGROUND_CHECK_MIN chunks the sizes are asked for in the load's thread, from
    it on another thread while the load checks its targets and makes their reads."""
    state = {f"t{i}": np.full(100, i, np.int32) for i in range(count)}
    gpuckpt.save(state, tmp_path / "ck")
    chunk = next((tmp_path / "ck" / "t37").glob("c*"))
    if damage == "missing":
        chunk.unlink()
        error: type[Exception] = gpuckpt.errors.MissingChunkError
    else:
        chunk.write_bytes(chunk.read_bytes()[:-9])
        error = gpuckpt.errors.CheckpointCorruptedError
    target: dict[str, Any] = {k: np.zeros_like(v) for k, v in state.items()}
    with pytest.raises(error, match="'t37'"):
        gpuckpt.load(target, tmp_path / "ck")
    assert all(not v.any() for v in target.values())  # nothing was written into the targets
    # a target to allocate among them (a placeholder): the check still comes first
    target["t5"] = None
    with pytest.raises(error, match="'t37'"):
        gpuckpt.load(target, tmp_path / "ck")
    assert target["t5"] is None and all(not v.any() for k, v in target.items() if k != "t5")


def test_a_wrong_target_is_named_before_a_damaged_chunk_of_another(tmp_path: Any) -> None:
    """The targets are checked while the sizes are asked for: an error of the targets comes
    first, as when the check followed them."""
    state = {f"t{i}": np.full(10, i, np.int16) for i in range(3 * BACKGROUND_CHECK_MIN)}
    gpuckpt.save(state, tmp_path / "ck")
    next((tmp_path / "ck" / "t3").glob("c*")).unlink()
    target = {k: np.zeros_like(v) for k, v in state.items()}
    target["t700"] = np.zeros(11, np.int16)
    with pytest.raises(gpuckpt.errors.ShapeMismatchError, match="'t700'"):
        gpuckpt.load(target, tmp_path / "ck")
    target["t700"] = np.zeros(10, np.int16)
    with pytest.raises(gpuckpt.errors.MissingChunkError, match="'t3'"):
        gpuckpt.load(target, tmp_path / "ck")
    assert all(not v.any() for v in target.values())
    state["t3"] = np.full(10, 3, np.int16)
    gpuckpt.save(state, tmp_path / "ck", overwrite=True)
    gpuckpt.load(target, tmp_path / "ck")
    assert all(np.array_equal(target[k], v) for k, v in state.items())
