"""Where a restore receives a fetched part (gpuckpt/tiers/placement.py): straight into the
arrays of the state where that is safe, into a buffer otherwise; and a load from the bytes
so received gives exactly the saved state.

Each test saves a real part to disk, then plays the receiving side by hand: the files'
bytes are "received" message by message (as :func:`message_sizes` cuts them) into the
places :func:`placement` names or into scratch, and loaded through ``mem://``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import CheckpointCorruptedError, MetadataError
from gpuckpt.format.checksum import CRC_BYTES
from gpuckpt.format.documents import ROOT_KEY
from gpuckpt.storage.stores import in_memory
from gpuckpt.tiers.placement import message_sizes, placement
from tests.received_parts import receive


def _saved(tmp_path: Path, state: dict[str, Any], **kw: Any) -> Path:
    path = tmp_path / "part"
    gpuckpt.save(state, path, **kw)
    return path


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(11)
    return {
        "w": rng.standard_normal((64, 32)).astype(np.float32),
        "layers": [rng.integers(0, 9, (5, 7)).astype(np.int64), rng.standard_normal(3)],
        "scalar": np.full((), 2.5),
        "step": 3,
    }


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "w": np.zeros_like(state["w"]),
        "layers": [np.zeros_like(a) for a in state["layers"]],
        "scalar": np.zeros(()),
        "step": None,
    }


def test_chunk_files_travel_as_bytes_and_trailer_and_others_whole() -> None:
    assert message_sizes("w/c.0.0", 100) == [100 - CRC_BYTES, CRC_BYTES]
    assert message_sizes("w/c", 12) == [12 - CRC_BYTES, CRC_BYTES]
    assert message_sizes("w/zarr.json", 300) == [300]
    assert message_sizes(ROOT_KEY, 900) == [900]
    assert message_sizes("w/c.0", CRC_BYTES) == [CRC_BYTES]  # (an empty chunk's trailer alone: whole)
    assert message_sizes("w/c.0", 0) == []


def test_whole_host_arrays_are_placed_and_the_load_gives_the_saved_state(tmp_path: Path) -> None:
    state = _state()
    path = _saved(tmp_path, state)
    target = _zeros_like(state)
    targets = placement((path / ROOT_KEY).read_bytes(), "part", target)
    names = {rel.split("/")[0] for rel in targets}
    assert names == {"w", "layers.0", "layers.1", "scalar"}, targets.keys()
    files = receive(path, targets)
    assert np.array_equal(target["w"], state["w"])  # the bytes arrived in place, before the load
    with in_memory(files) as url:
        gpuckpt.load(target, url)
    assert np.array_equal(target["w"], state["w"]) and target["step"] == 3
    assert all(np.array_equal(a, b) for a, b in zip(target["layers"], state["layers"], strict=True))
    assert target["scalar"] == 2.5


def test_a_damaged_byte_received_in_place_fails_the_load(tmp_path: Path) -> None:
    state = _state()
    path = _saved(tmp_path, state)
    target = _zeros_like(state)
    targets = placement((path / ROOT_KEY).read_bytes(), "part", target)
    files = receive(path, targets)
    target["w"].view(np.uint8).reshape(-1)[77] ^= 0x01  # a byte damaged on its way
    with in_memory(files) as url, pytest.raises(CheckpointCorruptedError, match="'w'"):
        gpuckpt.load(target, url)


def test_arrays_that_are_not_safe_to_receive_into_are_not_placed(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    base = rng.standard_normal((8, 6))
    state = {
        "fortran": np.asfortranarray(base),
        "readonly": base.copy(),
        "same_a": base.copy(),
        "same_b": base.copy(),
        "view_a": base.copy(),
        "view_b": base[:4].copy(),
        "big_endian": base.astype(">f8"),
        "wrong_dtype": base.astype(np.float32),
        "fine": base.copy(),
    }
    path = _saved(tmp_path, state)
    shared = np.zeros_like(base)
    whole = np.zeros_like(base)
    target = {
        "fortran": np.zeros_like(base, order="F"),
        "readonly": np.zeros_like(base),
        "same_a": shared,
        "same_b": shared,  # one array under two names
        "view_a": whole,
        "view_b": whole[2:6],  # a view into another target
        "big_endian": np.zeros(base.shape, ">f8"),
        "wrong_dtype": np.zeros(base.shape, np.float64),  # the load refuses it; nothing placed
        "fine": np.zeros_like(base),
    }
    target["readonly"].flags.writeable = False
    targets = placement((path / ROOT_KEY).read_bytes(), "part", target)
    assert {rel.split("/")[0] for rel in targets} == {"fine"}


def test_chunked_and_compressed_tensors_are_not_placed(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    state = {"chunked": rng.standard_normal((256, 64)), "small": np.arange(10.0)}
    chunked = _saved(tmp_path / "a", state, chunk_bytes=16 << 10)
    target = {k: np.zeros_like(v) for k, v in state.items()}
    assert set(placement((chunked / ROOT_KEY).read_bytes(), "a", target)) == {"small/c.0"}
    packed = _saved(tmp_path / "b", {"z": np.zeros(1 << 16)}, compression="zstd")
    assert placement((packed / ROOT_KEY).read_bytes(), "b", {"z": np.ones(1 << 16)}) == {}


def test_a_damaged_root_document_places_nothing_and_raises(tmp_path: Path) -> None:
    path = _saved(tmp_path, _state())
    root = bytearray((path / ROOT_KEY).read_bytes())
    root[len(root) // 2] ^= 0x20
    with pytest.raises(MetadataError):  # (the tier then places nothing: the load says what is wrong)
        placement(bytes(root), "part", _zeros_like(_state()))
