"""Shapes claimed by files ``convert`` reads are bounded: a typed error naming the file and the tensor.

A hostile safetensors header, or a ``torch.save`` file holding an empty tensor
of a huge size, used to pass validation and then fail inside NumPy with a bare
``ValueError`` that named neither.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.convert import convert, read_safetensors
from gpuckpt.convert.safetensors_io import read_safetensors_header
from gpuckpt.format.shapes import MAX_DIMS


def _safetensors(path: Path, shape: list[int], code: str = "F32") -> Path:
    """A safetensors file whose one tensor ``evil`` claims ``shape`` (zero bytes of data)."""
    header = json.dumps({"evil": {"dtype": code, "shape": shape, "data_offsets": [0, 0]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    return path


HOSTILE = {
    # NumPy: "Maximum allowed dimension exceeded"
    "axis-beyond-int64": ([0, 10**30], "longer than any array"),
    # NumPy: "array is too big"
    "axes-overflowing-together": ([0, 2**62, 2**62], "longer than any array"),
    "non-empty-axes-too-big": ([0, 2**31, 2**31], "more than any array can hold"),
    # NumPy: "maximum supported dimension for an ndarray is currently 64"
    "100-dimensions": ([0] * 100, "100 dimensions"),
    "33-dimensions": ([1] * 32 + [0], "33 dimensions"),
}


@pytest.mark.parametrize(("shape", "match"), HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_safetensors_shape_is_a_metadata_error_naming_file_and_tensor(
    tmp_path: Path, shape: list[int], match: str
) -> None:
    path = _safetensors(tmp_path / "hostile.safetensors", shape)
    for read in (read_safetensors_header, read_safetensors):
        with pytest.raises(gpuckpt.MetadataError, match=match) as info:
            read(path)
        assert str(path) in str(info.value) and "tensor 'evil'" in str(info.value)
        assert len(str(info.value)) < 1000  # a shape of many axes is shortened
    with pytest.raises(gpuckpt.MetadataError, match=match):
        convert(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bounds_keep_every_shape_numpy_and_gpuckpt_hold(tmp_path: Path) -> None:
    """Empty tensors of large but possible shapes, and the most dimensions gpuckpt holds, still read."""
    for i, (shape, code) in enumerate(
        [([0, 2**40], "F64"), ([0, 2**30, 2**29], "U8"), ([1] * (MAX_DIMS - 1) + [0], "F32")]
    ):
        path = _safetensors(tmp_path / f"ok{i}.safetensors", shape, code)
        got = read_safetensors(path)[0]["evil"]
        assert got.shape == tuple(shape) and got.dtype.itemsize == {"F64": 8, "U8": 1, "F32": 4}[code]


@pytest.mark.torch
def test_hostile_torch_save_shape_is_a_metadata_error_naming_file_and_tensor(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    # torch makes an empty tensor of this size without storage; NumPy says "array is too big"
    path = tmp_path / "hostile.pt"
    torch.save({"nested": {"evil": torch.empty(0, 2**31, 2**31)}, "ok": torch.ones(2)}, path)
    with pytest.raises(gpuckpt.MetadataError, match="more than any array can hold") as info:
        convert(path, tmp_path / "out")
    assert str(path) in str(info.value) and "tensor 'nested.evil'" in str(info.value)
    assert not (tmp_path / "out").exists()
    torch.save({"ok": torch.empty(0, 2**20, 3)}, tmp_path / "fine.pt")
    convert(tmp_path / "fine.pt", tmp_path / "fine")
    back = gpuckpt.load_state_dict(tmp_path / "fine")["ok"]
    assert back.shape == (0, 2**20, 3) and back.dtype == np.float32


@pytest.mark.torch
def test_a_damaged_torch_save_file_is_a_metadata_error_naming_it(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(6.0)}, good)
    raw = bytearray(good.read_bytes())
    for i, cut in enumerate((len(raw) // 2, 40)):
        bad = tmp_path / f"bad{i}.pt"
        bad.write_bytes(bytes(raw[:cut]))  # truncated: torch raises its own bare error
        with pytest.raises(gpuckpt.MetadataError, match="cannot be read as a torch.save state dict") as info:
            convert(bad, tmp_path / f"out{i}")
        assert str(bad) in str(info.value)
        assert not (tmp_path / f"out{i}").exists()
