"""Checkpoints written by earlier releases still load: format drift fails here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

import gpuckpt
from gpuckpt.device.arrays import is_array
from gpuckpt.state import flatten_state_dict
from gpuckpt.testing.golden import golden_state

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "format-v1"


def leaves(sd: dict) -> dict:
    flat, _ = flatten_state_dict(sd, is_array)
    return {k: v.value for k, v in flat.items()}


def test_golden_v1_metadata_and_zarr_readers() -> None:
    md = gpuckpt.read_metadata(FIXTURE)
    assert md.version == "1"
    assert md.state_dict_metadata["layouts.channels_last"].properties.memory_format is gpuckpt.channels_last
    g = zarr.open_group(FIXTURE, mode="r")
    assert np.array_equal(
        g["dtypes.bfloat16"][...].view(np.uint16), golden_state()["dtypes"]["bfloat16"].view(np.uint16)
    )
    assert np.array_equal(g["layouts.chunked"][...], np.arange(1000).reshape(100, 10))


FIXTURE_V2 = Path(__file__).resolve().parents[1] / "fixtures" / "format-v2"


@pytest.mark.parametrize("fixture", ["format-v1", "format-v2", "format-v3"])
def test_golden_loads_bit_exact(fixture: str) -> None:
    """The golden checkpoint of each format version."""
    want = leaves(golden_state())
    got = leaves(gpuckpt.load_state_dict(FIXTURE.parent / fixture))
    assert got.keys() == want.keys()
    for k, v in want.items():
        if is_array(v):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert got[k].tobytes() == np.ascontiguousarray(v).tobytes(), k
            if v.ndim >= 4:
                assert got[k].strides == v.strides, k
        else:
            assert got[k] == v and type(got[k]) is type(v), k


def test_golden_v2_metadata_chunk_table_and_zarr_readers() -> None:
    md = gpuckpt.read_metadata(FIXTURE_V2)
    assert md.version == "2" and "chunk_table" in md.storage_data
    assert md.state_dict_metadata == gpuckpt.read_metadata(FIXTURE).state_dict_metadata
    chunked = md.state_dict_metadata["layouts.chunked"]
    assert [c.offsets for c in chunked.chunks][:3] == [(0, 0), (6, 0), (12, 0)]
    g = zarr.open_group(FIXTURE_V2, mode="r")
    assert np.array_equal(
        g["dtypes.bfloat16"][...].view(np.uint16), golden_state()["dtypes"]["bfloat16"].view(np.uint16)
    )
    assert np.array_equal(g["layouts.chunked"][...], np.arange(1000).reshape(100, 10))
    assert len(g["_gpuckpt.table.crc32c"][...]) == md.storage_data["chunk_table"]["rows"]


FIXTURE_V3 = Path(__file__).resolve().parents[1] / "fixtures" / "format-v3"


def test_golden_v3_metadata_is_that_of_v2_and_zarr_readers() -> None:
    """Version 3 spells the tensor entries of version 2 as columns: the same metadata."""
    md = gpuckpt.read_metadata(FIXTURE_V3)
    v2 = gpuckpt.read_metadata(FIXTURE_V2)
    assert md.version == "3" and v2.version == "2"
    assert md.state_dict_metadata == v2.state_dict_metadata
    assert md.storage_data["tensors"] == v2.storage_data["tensors"]
    assert md.planner_data == v2.planner_data
    g = zarr.open_group(FIXTURE_V3, mode="r")
    assert np.array_equal(g["layouts.chunked"][...], np.arange(1000).reshape(100, 10))
    assert len(g["_gpuckpt.table.crc32c"][...]) == md.storage_data["chunk_table"]["rows"]
