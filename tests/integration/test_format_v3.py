"""A checkpoint of format version 3 (tensor entries as columns) through every reader of the
root document: loads, read_metadata, verify, inspect, convert, an incremental save on it, and
zarr-python for the arrays."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import gpuckpt
from gpuckpt.cli import main
from gpuckpt.errors import ChecksumError
from gpuckpt.verify import verify_checkpoint

N = 1100  # tensors: from commit.COLUMNS_MIN_TENSORS (1,024) on, with a chunk table


def _state() -> dict[str, Any]:
    layers = {
        f"{i:04d}": {"w": np.full(6, i, np.float32), "b": np.arange(5, dtype=np.int16) + i}
        for i in range(N // 2)
    }
    return {"layers": layers, "odd key/é": np.ones(7, np.float64), "step": 11, "name": "v3"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("v3") / "ck"
    gpuckpt.save(_state(), path, chunk_bytes=4, sync="none")  # 4,951 chunks: a chunk table
    return path


def _root(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((path / "zarr.json").read_bytes())["attributes"]["gpuckpt"]["metadata"]
    return doc


def test_it_is_written_as_version_3_and_loads(ckpt: Path) -> None:
    root = _root(ckpt)
    assert root["version"] == "3" and len(root["tensor_columns"]["fqn"]) == N + 1
    assert set(root["state_dict_metadata"]) == {"step", "name"}
    names = dict(zip(root["tensor_columns"]["fqn"], root["tensor_columns"]["name"], strict=True))
    assert names["layers.0007.w"] is None and names["odd key/é"] not in (None, "odd key/é")
    out = gpuckpt.load_state_dict(ckpt)
    want = _state()
    assert out["step"] == 11 and out["name"] == "v3"
    assert np.array_equal(out["layers"]["0123"]["b"], want["layers"]["0123"]["b"])
    assert np.array_equal(out["odd key/é"], want["odd key/é"])
    target = _state()
    for layer in target["layers"].values():
        layer["w"][...] = 0
    gpuckpt.load(target, ckpt)
    assert all(np.array_equal(target["layers"][k]["w"], v["w"]) for k, v in want["layers"].items())
    # every tensor is a Zarr array of its own, whatever the root document says
    assert np.array_equal(zarr.open_array(ckpt / "layers.0123.w", mode="r")[...], want["layers"]["0123"]["w"])


def test_read_metadata_verify_and_inspect(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    md = gpuckpt.read_metadata(ckpt)
    assert md.version == "3" and len(md.state_dict_metadata) == N + 3
    assert md.storage_data["tensors"]["layers.0000.b"]["chunk_grid"]["configuration"]["chunk_shape"] == [2]
    report = verify_checkpoint(ckpt)
    assert report.ok, report.to_json()
    assert main(["inspect", str(ckpt), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["version"] == "3"


def test_damage_in_a_version_3_checkpoint_is_found(ckpt: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(ckpt, copy)
    chunk = copy / "layers.0042.w" / "c.1"
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="layers.0042.w"):
        gpuckpt.load_state_dict(copy)
    report = verify_checkpoint(copy)
    assert report.damaged_tensors() == ["layers.0042.w"]


def test_convert_and_an_incremental_save_on_it(ckpt: Path, tmp_path: Path) -> None:
    st = tmp_path / "m.safetensors"
    assert main(["convert", "-q", str(ckpt), str(st)]) == 0
    assert main(["convert", "-q", str(st), str(tmp_path / "back")]) == 0
    back = gpuckpt.load_state_dict(tmp_path / "back")
    assert np.array_equal(back["layers"]["0500"]["w"], np.full(6, 500, np.float32))
    assert gpuckpt.read_metadata(tmp_path / "back").version == "1"  # 1,101 chunks: no table needed
    # an incremental save with the version 3 checkpoint as its base
    state = _state()
    state["layers"]["0001"]["w"][...] = -1
    gpuckpt.save(state, tmp_path / "next", base=ckpt, chunk_bytes=4, sync="none")
    out = gpuckpt.load_state_dict(tmp_path / "next")
    assert np.array_equal(out["layers"]["0001"]["w"], np.full(6, -1, np.float32))
    assert np.array_equal(out["layers"]["0002"]["w"], np.full(6, 2, np.float32))
