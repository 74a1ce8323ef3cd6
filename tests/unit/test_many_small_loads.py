"""Loads of many small tensors: exact, independent arrays; a damaged chunk among many named before anything is read."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import gpuckpt


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


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_damaged_chunk_among_many_is_named_before_anything_is_read(tmp_path: Any, damage: str) -> None:
    state = {f"t{i}": np.full(100, i, np.int32) for i in range(50)}
    gpuckpt.save(state, tmp_path / "ck")
    chunk = next((tmp_path / "ck" / "t37").glob("c*"))
    if damage == "missing":
        chunk.unlink()
        error: type[Exception] = gpuckpt.errors.MissingChunkError
    else:
        chunk.write_bytes(chunk.read_bytes()[:-9])
        error = gpuckpt.errors.CheckpointCorruptedError
    target = {k: np.zeros_like(v) for k, v in state.items()}
    with pytest.raises(error, match="'t37'"):
        gpuckpt.load(target, tmp_path / "ck")
    assert all(not v.any() for v in target.values())  # nothing was written into the targets
