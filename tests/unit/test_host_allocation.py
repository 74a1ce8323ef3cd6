"""Destination arrays of load_state_dict: small ones carved from shared blocks (HostMemory.allocate_many)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.device.arrays import _PACK_ALIGN, PACK_BLOCK, PACK_MAX, HostMemory

FORMATS: list[Any] = [None, "channels_last", "channels_last_3d"]


def _specs() -> list[tuple[tuple[int, ...], np.dtype[Any], Any]]:
    rng = np.random.default_rng(1)
    specs: list[tuple[tuple[int, ...], np.dtype[Any], Any]] = []
    for i in range(200):
        dtype = np.dtype(["float32", "float64", "uint8", "int16", "bool", "complex64"][i % 6])
        kind = i % 7
        if kind == 0:
            specs.append(((), dtype, None))
        elif kind == 1:
            specs.append(((0, 3), dtype, None))
        elif kind == 2:
            specs.append((tuple(int(x) for x in rng.integers(1, 6, 4)), dtype, "channels_last"))
        elif kind == 3:
            specs.append((tuple(int(x) for x in rng.integers(1, 5, 5)), dtype, "channels_last_3d"))
        else:
            specs.append(((int(rng.integers(1, 3000)),), dtype, None))
    specs.append(((PACK_MAX // 8 + 1,), np.dtype("float64"), None))  # just over the packing limit
    return specs


def test_packed_arrays_have_the_shapes_strides_and_formats_of_single_allocations() -> None:
    specs = _specs()
    mem = HostMemory()
    packed = mem.allocate_many(specs)
    for (shape, dtype, fmt), a in zip(specs, packed, strict=True):
        single = mem.allocate(shape, dtype, fmt)
        assert a.shape == single.shape and a.dtype == dtype and a.strides == single.strides, (shape, fmt)
        assert a.flags.writeable
        if 0 < a.nbytes <= PACK_MAX:  # carved from a block
            assert a.ctypes.data % _PACK_ALIGN == 0


def test_packed_arrays_do_not_overlap() -> None:
    specs = _specs()
    packed = HostMemory().allocate_many(specs)
    for i, a in enumerate(packed):
        a[...] = np.asarray(i % 97 + 1).astype(a.dtype)
    for i, a in enumerate(packed):
        assert (a == np.asarray(i % 97 + 1).astype(a.dtype)).all(), i
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in packed if a.nbytes)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))


def test_small_arrays_share_few_blocks_and_large_ones_get_their_own() -> None:
    n = 3000
    specs = [((4096,), np.dtype("float32"), None)] * n + [((PACK_MAX // 4 + 1,), np.dtype("float32"), None)]
    packed = HostMemory().allocate_many(specs)
    blocks = {
        id(a.base.base if a.base is not None and a.base.base is not None else a.base) for a in packed[:n]
    }
    assert len(blocks) == math.ceil(n * 16384 / PACK_BLOCK)
    assert packed[-1].base is None or packed[-1].base.nbytes == packed[-1].nbytes


def test_load_state_dict_of_many_small_tensors_is_exact_and_independent(tmp_path: Any) -> None:
    rng = np.random.default_rng(2)
    state = {
        "w": {f"t{i}": rng.standard_normal(int(rng.integers(1, 400))).astype(np.float32) for i in range(300)},
        "img": np.ascontiguousarray(rng.standard_normal((2, 5, 4, 3)).astype(np.float16)).transpose(
            0, 3, 1, 2
        ),
        "big": rng.standard_normal(PACK_MAX // 4 + 10).astype(np.float32),
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
