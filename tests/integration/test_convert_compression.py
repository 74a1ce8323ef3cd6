"""``convert(..., compression=)`` and ``gpuckpt convert --compression``: a gpuckpt target stores
compressed chunks that zarr-python reads bit-exactly; a bad value or another target is refused
before anything is read or written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import zarr

import gpuckpt
from gpuckpt.cli import main
from gpuckpt.convert import convert, write_safetensors
from gpuckpt.errors import InvalidOptionError
from gpuckpt.verify import verify_checkpoint


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    w = rng.standard_normal((256, 96), dtype=np.float32) * 0.02
    return {
        "model.w": w.astype(ml_dtypes.bfloat16),
        "model.fp32": np.abs(w) * 1e-3,
        "model.ids": rng.integers(0, 50, (3000,), dtype=np.int64),
    }


def _codecs(path: Path) -> dict[str, list[str]]:
    md = gpuckpt.read_metadata(path)
    out = {}
    for fqn in md.storage_data["tensors"]:
        doc = json.loads((path / fqn / "zarr.json").read_text())
        out[fqn] = [c["name"] for c in doc["codecs"]]
    return out


def _check_compressed(path: Path, tensors: dict[str, np.ndarray], codec: str) -> None:
    md = gpuckpt.read_metadata(path)
    assert md.version == "4"
    assert _codecs(path) == {fqn: ["bytes", codec, "crc32c"] for fqn in tensors}
    back = gpuckpt.load_state_dict(path)
    for fqn, value in tensors.items():
        assert back[fqn].dtype == value.dtype and back[fqn].tobytes() == value.tobytes(), fqn
        z = np.asarray(zarr.open_array(str(path / fqn), mode="r")[...])
        assert z.tobytes() == value.tobytes(), fqn
    stored = sum(int(c["nbytes"]) for e in md.storage_data["tensors"].values() for c in e["chunks"])
    assert stored < sum(a.nbytes for a in tensors.values())
    assert verify_checkpoint(path).ok


@pytest.mark.parametrize(
    ("choice", "codec"), [("zstd", "blosc"), ("lz4", "blosc"), ({"codec": "zstd", "level": 3}, "zstd")]
)
def test_safetensors_to_a_compressed_checkpoint(tmp_path: Path, choice: Any, codec: str) -> None:
    tensors = _tensors()
    write_safetensors(tensors, tmp_path / "m.safetensors")
    res = convert(tmp_path / "m.safetensors", tmp_path / "c", compression=choice, chunk_bytes=16 << 10)
    assert res.target_format == "gpuckpt" and res.tensors == 3
    _check_compressed(tmp_path / "c", tensors, codec)


def test_a_plain_checkpoint_converted_into_a_compressed_one(tmp_path: Path) -> None:
    tensors = _tensors()
    gpuckpt.save({**tensors, "step": 4}, tmp_path / "plain")
    assert gpuckpt.read_metadata(tmp_path / "plain").version != "4"
    convert(tmp_path / "plain", tmp_path / "c", compression="zstd")
    _check_compressed(tmp_path / "c", tensors, "blosc")
    assert gpuckpt.load_state_dict(tmp_path / "c")["step"] == 4


def test_a_hugging_face_directory_imported_compressed(tmp_path: Path) -> None:
    tensors = _tensors()
    gpuckpt.save(tensors, tmp_path / "plain")
    convert(tmp_path / "plain", tmp_path / "hf", target_format="hf")
    convert(tmp_path / "hf", tmp_path / "c", compression={"codec": "zstd"})
    _check_compressed(tmp_path / "c", tensors, "zstd")


def test_auto_leaves_random_bytes_as_they_are(tmp_path: Path) -> None:
    noise = np.random.default_rng(2).integers(0, 256, 2 << 20, dtype=np.uint8)
    write_safetensors({"noise": noise}, tmp_path / "m.safetensors")
    convert(tmp_path / "m.safetensors", tmp_path / "c", compression="auto")
    assert _codecs(tmp_path / "c")["noise"] == ["bytes", "crc32c"]
    assert gpuckpt.load_state_dict(tmp_path / "c")["noise"].tobytes() == noise.tobytes()


@pytest.mark.parametrize("bad", ["gzip", {"level": 99}, {"codec": "brotli"}, 3, {"shuffel": "bit"}])
def test_a_bad_value_is_refused_before_anything_is_read(tmp_path: Path, bad: Any) -> None:
    # the source does not exist: the value is refused first, and nothing is written
    with pytest.raises(InvalidOptionError, match="compression"):
        convert(tmp_path / "missing.safetensors", tmp_path / "c", compression=bad)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("target", ["safetensors", "torch", "hf"])
def test_compression_for_another_target_is_refused(tmp_path: Path, target: str) -> None:
    gpuckpt.save(_tensors(), tmp_path / "plain")
    with pytest.raises(InvalidOptionError, match=f"the {target} target stores tensors as they are"):
        convert(tmp_path / "plain", tmp_path / "out", target_format=target, compression="zstd")
    assert not (tmp_path / "out").exists()
    # None is no compression, for every target
    if target != "torch":
        convert(tmp_path / "plain", tmp_path / "out", target_format=target, compression=None)


def test_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = _tensors()
    write_safetensors(tensors, tmp_path / "m.safetensors")
    assert (
        main(["convert", "-q", "--compression", "lz4", str(tmp_path / "m.safetensors"), str(tmp_path / "a")])
        == 0
    )
    _check_compressed(tmp_path / "a", tensors, "blosc")
    spec = '{"codec": "zstd", "level": 5}'
    assert (
        main(["convert", "-q", "--compression", spec, str(tmp_path / "m.safetensors"), str(tmp_path / "b")])
        == 0
    )
    _check_compressed(tmp_path / "b", tensors, "zstd")
    doc = json.loads((tmp_path / "b" / "model.w" / "zarr.json").read_text())
    assert doc["codecs"][1]["configuration"]["level"] == 5
    assert (
        main(["convert", "-q", "--compression", "none", str(tmp_path / "m.safetensors"), str(tmp_path / "n")])
        == 0
    )
    assert gpuckpt.read_metadata(tmp_path / "n").version != "4"
    capsys.readouterr()
    # a bad value: a usage error naming the option; for another target too (an option the
    # library refuses is a bad argument: exit 2, as the help says)
    for bad in ("gzip", '{"level": 99}', "{not json"):
        assert (
            main(["convert", "--compression", bad, str(tmp_path / "m.safetensors"), str(tmp_path / "x")]) == 2
        )
        assert "--compression" in capsys.readouterr().err
    out = tmp_path / "x.safetensors"
    assert main(["convert", "--compression", "zstd", str(tmp_path / "a"), str(out)]) == 2
    assert "the safetensors target stores tensors as they are" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not out.exists()
