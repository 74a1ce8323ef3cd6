"""Damaged checkpoints are detected with typed errors that name what is damaged."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.format.checksum import crc32c


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    sd = {
        "layer": {"weight": rng.standard_normal((64, 16)).astype(np.float32)},
        "bias": np.ones(5),
        "step": 3,
    }
    gpuckpt.save(sd, tmp_path / "c", chunk_bytes=1024)
    return tmp_path / "c"


def test_flipped_byte_names_tensor_and_chunk(ckpt: Path) -> None:
    chunk = ckpt / "layer.weight" / "c.1.0"
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0x40
    chunk.write_bytes(raw)
    with pytest.raises(gpuckpt.ChecksumError, match=r"chunk c\.1\.0 of tensor 'layer\.weight'"):
        gpuckpt.load_state_dict(ckpt)
    # the undamaged tensor still loads on its own
    assert gpuckpt.load_state_dict(ckpt, keys=["bias"])["bias"].all()


def test_checksum_error_carries_its_fields_through_pickling(ckpt: Path) -> None:
    chunk = ckpt / "layer.weight" / "c.1.0"
    listed = gpuckpt.read_metadata(ckpt).storage_data["tensors"]["layer.weight"]["chunks"][1]
    raw = bytearray(chunk.read_bytes())
    stored = int.from_bytes(raw[-4:], "little")
    raw[100] ^= 0x40
    chunk.write_bytes(raw)
    with pytest.raises(gpuckpt.ChecksumError) as info:
        gpuckpt.load_state_dict(ckpt)
    for exc in (info.value, pickle.loads(pickle.dumps(info.value))):
        assert type(exc) is gpuckpt.ChecksumError and str(exc) == str(info.value)
        assert (exc.fqn, exc.key) == ("layer.weight", "c.1.0") and listed["key"] == "c.1.0"
        assert exc.computed == crc32c(bytes(raw[:-4])) != stored
        assert (exc.stored, exc.expected) == (stored, listed["crc32c"])
        assert exc.mismatch == (
            f"its bytes do not match their checksum: computed {exc.computed:#010x}, "
            f"chunk file {stored:#010x}, metadata {stored:#010x}"
        )
        assert exc.mismatch in str(exc)  # the message says the same


def test_flipped_checksum_byte(ckpt: Path) -> None:
    chunk = ckpt / "bias" / "c.0"
    raw = bytearray(chunk.read_bytes())
    raw[-1] ^= 1
    chunk.write_bytes(raw)
    with pytest.raises(gpuckpt.ChecksumError, match="'bias'"):
        gpuckpt.load({"bias": np.zeros(5)}, ckpt)


def test_swapped_valid_chunks_are_detected(ckpt: Path) -> None:
    a, b = ckpt / "layer.weight" / "c.0.0", ckpt / "layer.weight" / "c.1.0"
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    with pytest.raises(gpuckpt.ChecksumError, match="not the one the metadata lists"):
        gpuckpt.load_state_dict(ckpt)


def test_missing_chunk(ckpt: Path) -> None:
    os.remove(ckpt / "layer.weight" / "c.2.0")
    with pytest.raises(gpuckpt.MissingChunkError, match=r"c\.2\.0 of tensor 'layer\.weight' is missing"):
        gpuckpt.load_state_dict(ckpt)


def test_truncated_chunk_detected_before_allocating(ckpt: Path) -> None:
    p = ckpt / "layer.weight" / "c.0.0"
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(gpuckpt.CheckpointCorruptedError, match="truncated"):
        gpuckpt.load_state_dict(ckpt)


def test_damaged_root_metadata(ckpt: Path) -> None:
    root = ckpt / "zarr.json"
    text = root.read_text()
    root.write_text(text.replace('"step"', '"stop"', 1))
    with pytest.raises(gpuckpt.MetadataError, match="checksum mismatch"):
        gpuckpt.read_metadata(ckpt)
    root.write_text(text[: len(text) // 2])
    with pytest.raises(gpuckpt.MetadataError, match="not valid JSON"):
        gpuckpt.load_state_dict(ckpt)


def _rewrite_metadata(ckpt: Path, edit: object) -> None:
    from gpuckpt.format.checksum import crc32c
    from gpuckpt.format.documents import _canonical

    doc = json.loads((ckpt / "zarr.json").read_text())
    md = doc["attributes"]["gpuckpt"]["metadata"]
    edit(md)  # type: ignore[operator]
    doc["attributes"]["gpuckpt"]["metadata_crc32c"] = crc32c(_canonical(md))
    (ckpt / "zarr.json").write_text(json.dumps(doc))


def test_hostile_huge_shape_fails_before_allocating(ckpt: Path) -> None:
    def edit(md: dict) -> None:
        n = 1 << 40
        e = md["state_dict_metadata"]["bias"]
        e["size"] = [n]
        e["chunks"] = [{"offsets": [0], "sizes": [n]}]
        s = md["storage_data"]["tensors"]["bias"]
        s["chunk_grid"]["configuration"]["chunk_shape"] = [n]
        s["chunks"][0]["nbytes"] = n * 8 + 4

    _rewrite_metadata(ckpt, edit)
    # an allocation of 8 TiB would fail loudly; the size check comes first
    with pytest.raises(gpuckpt.CheckpointCorruptedError, match="expected 8796093022212"):
        gpuckpt.load_state_dict(ckpt)


@pytest.mark.parametrize("name", ["../outside", "/etc", "..", "zarr.json", "a/b"])
def test_hostile_array_names_are_refused(ckpt: Path, name: str) -> None:
    def edit(md: dict) -> None:
        md["storage_data"]["tensors"]["bias"]["name"] = name

    _rewrite_metadata(ckpt, edit)
    with pytest.raises(gpuckpt.MetadataError, match="not a safe"):
        gpuckpt.load_state_dict(ckpt)


def test_symlinked_array_directory_is_not_followed(ckpt: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    os.rename(ckpt / "bias", outside)
    os.symlink(outside, ckpt / "bias")
    with pytest.raises(gpuckpt.MissingChunkError, match="'bias'"):
        gpuckpt.load_state_dict(ckpt, keys=["bias"])


def test_symlinked_chunk_is_not_followed(ckpt: Path, tmp_path: Path) -> None:
    target = ckpt / "bias" / "c.0"
    os.rename(target, tmp_path / "stolen")
    os.symlink(tmp_path / "stolen", target)
    with pytest.raises(gpuckpt.MissingChunkError):
        gpuckpt.load_state_dict(ckpt, keys=["bias"])


@pytest.mark.parametrize(
    "edit",
    [
        lambda md: md["storage_data"]["tensors"]["bias"]["chunks"][0].__setitem__("key", "../../x"),
        lambda md: md["storage_data"]["tensors"]["bias"]["chunks"][0].__setitem__("nbytes", "44"),
        lambda md: md["storage_data"]["tensors"]["bias"]["chunks"][0].__setitem__("crc32c", -1),
        lambda md: md["storage_data"]["tensors"].pop("bias"),
        lambda md: md["storage_data"]["objects"].pop("step"),
        lambda md: md["storage_data"].__setitem__("tensors", []),
        lambda md: md["planner_data"].pop("structure"),
        lambda md: md["state_dict_metadata"]["bias"]["chunks"].append({"offsets": [0], "sizes": [1]}),
        lambda md: md["storage_data"]["tensors"]["bias"].__setitem__("chunk_grid", {"name": "regular"}),
    ],
)
def test_inconsistent_metadata_is_a_metadata_error(ckpt: Path, edit: object) -> None:
    _rewrite_metadata(ckpt, edit)
    with pytest.raises(gpuckpt.MetadataError):
        gpuckpt.load_state_dict(ckpt)
