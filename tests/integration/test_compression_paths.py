"""Compression on every save path: "auto", async saves, distributed saves, incremental saves, the
manager, and S3 (multipart uploads of compressed chunks)."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import ml_dtypes
import numpy as np
import pytest

import gpuckpt
from gpuckpt import ShardedArray
from gpuckpt.distributed import run_ranks
from gpuckpt.options import SaveOptions
from gpuckpt.saving.compression import AUTO_MIN_BYTES, resolve
from gpuckpt.saving.sources import describe_state
from gpuckpt.storage.stores import BACKENDS
from gpuckpt.verify import verify_checkpoint

pytest.importorskip("obstore")
pytest.importorskip("moto.server")

from gpuckpt.testing.s3server import loopback_s3, s3_options

BUCKET = "compression"


def _weights(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {
        "w": _weights(1 << 20).reshape(1024, 1024),  # 2 MiB of bf16
        "noise": rng.integers(0, 256, 2 << 20, dtype=np.uint8),  # incompressible
        "small": np.ones(100, np.float32),
        "step": 5,
    }


def _codecs(path: Path | str, options: dict[str, Any] | None = None) -> dict[str, str | None]:
    md = gpuckpt.read_metadata(path, storage_options=options)
    return {f: e.get("codec", {}).get("name") for f, e in md.storage_data["tensors"].items()}


def test_auto_skips_incompressible_and_small_tensors_and_fast_stores(tmp_path: Path) -> None:
    state = _state()
    local, sources = describe_state(state, allow_pickle=False)
    options = SaveOptions(compression="auto")
    # a store slower than any compressor (registered as every back end is): compression pays,
    # for the compressible tensor only
    slow = dataclasses.replace(BACKENDS["s3"], write_bytes_per_s=1e6)
    with mock.patch.dict(BACKENDS, {"slow": slow}):
        c = resolve("slow://bucket/x", options, local, sources)
    assert c is not None and c.skip == {"noise", "small"}
    assert c.codec_for("w", np.dtype(ml_dtypes.bfloat16), 1 << 20) is not None
    assert c.codec_for("noise", np.dtype(np.uint8), 1 << 20) is None
    # a local file system writes faster than two cores compress: nothing compressed
    nothing = resolve(tmp_path / "c", options, local, sources)
    assert nothing is not None and nothing.keep_all  # every tensor as it is, screened or not
    assert all(
        nothing.codec_for(f, np.dtype(np.float32), 1 << 20) is None for f in ("w", "noise", "small", "x")
    )
    assert nothing.report["decision"].startswith("nothing compressed")
    gpuckpt.save(state, tmp_path / "c", compression="auto")
    assert gpuckpt.read_metadata(tmp_path / "c").version == "1"
    assert state["small"].nbytes < AUTO_MIN_BYTES


def _why(path: Path) -> dict[str, Any]:
    return gpuckpt.read_metadata(path).planner_data["gpuckpt.why_compression"]


def test_auto_keeps_what_it_decided_and_inspect_shows_it(tmp_path: Path) -> None:
    """Every save path keeps "auto"'s decision and its reasons in the checkpoint; inspect prints
    them (text and JSON); a save with another choice keeps none."""
    import subprocess
    import sys

    state = _state()
    gpuckpt.save(state, tmp_path / "one", compression="auto")
    gpuckpt.async_save(state, tmp_path / "async", compression="auto").result()

    def rank(c: Any) -> None:
        gpuckpt.save(state, tmp_path / "ranks", coordinator=c, compression="auto")

    run_ranks(2, rank)
    for name in ("one", "async", "ranks"):
        why = _why(tmp_path / name)
        assert why["decision"].startswith("nothing compressed"), (name, why)  # a local disk
        assert why["tensors"]["noise"].startswith("incompressible"), (name, why)
        assert "small" not in why["tensors"] and why["store_bytes_per_s"] > 0
    slow = dataclasses.replace(BACKENDS["file"], write_bytes_per_s=1e6)  # compression pays
    with mock.patch.dict(BACKENDS, {"file": slow}):
        gpuckpt.save(state, tmp_path / "slow", compression="auto")
    assert _why(tmp_path / "slow")["decision"].startswith("1 of 3 tensor(s) compressed: predicted")
    assert _codecs(tmp_path / "slow") == {"w": "blosc", "noise": None, "small": None}
    cli = [sys.executable, "-m", "gpuckpt.cli", "inspect"]
    text = subprocess.run([*cli, str(tmp_path / "slow")], capture_output=True, text=True, check=True).stdout
    assert 'compression "auto": 1 of 3 tensor(s) compressed' in text
    assert "  noise: incompressible: its screen promises" in text
    got = json.loads(
        subprocess.run(
            [*cli, "--json", str(tmp_path / "one")], capture_output=True, text=True, check=True
        ).stdout
    )
    assert got["auto_compression"]["decision"].startswith("nothing compressed")
    assert set(got["auto_compression"]["tensors"]) == {"noise"}
    gpuckpt.save(state, tmp_path / "zstd", compression="zstd")
    assert "gpuckpt.why_compression" not in gpuckpt.read_metadata(tmp_path / "zstd").planner_data
    plain = subprocess.run([*cli, str(tmp_path / "zstd")], capture_output=True, text=True, check=True).stdout
    assert 'compression "auto"' not in plain


def test_async_save_compresses_its_snapshot(tmp_path: Path) -> None:
    state = _state()
    fut = gpuckpt.async_save(state, tmp_path / "c", compression="zstd", chunk_bytes=512 << 10)
    state["w"][:] = 0  # after the snapshot: not saved
    md = fut.result()
    assert md.version == "4" and _codecs(tmp_path / "c")["w"] == "blosc"
    back = gpuckpt.load_state_dict(tmp_path / "c")
    assert back["w"].tobytes() == _state()["w"].tobytes()
    assert verify_checkpoint(tmp_path / "c").ok


def test_distributed_save_of_sharded_boxes_compresses_every_rank(tmp_path: Path) -> None:
    full = _weights(4 * 512 * 64, seed=2).reshape(4 * 512, 64)

    def rank(c: Any) -> None:
        r = c.rank
        box = ShardedArray(full[r * 512 : (r + 1) * 512], (r * 512, 0), full.shape)
        gpuckpt.save(
            {"w": box, "step": 1},
            tmp_path / "c",
            coordinator=c,
            compression={"codec": "zstd"},
            chunk_bytes=16 << 10,
        )

    run_ranks(4, rank)
    assert _codecs(tmp_path / "c")["w"] == "zstd"
    assert gpuckpt.load_state_dict(tmp_path / "c")["w"].tobytes() == full.tobytes()
    assert verify_checkpoint(tmp_path / "c").ok

    # a resharding load: 3 ranks, column blocks (each compressed chunk read whole and decoded)
    def reshard(c: Any) -> bool:
        cols = [(0, 21), (21, 43), (43, 64)][c.rank]
        mine = np.zeros((full.shape[0], cols[1] - cols[0]), full.dtype)
        gpuckpt.load(
            {"w": ShardedArray(mine, (0, cols[0]), full.shape)}, tmp_path / "c", coordinator=c, strict=False
        )
        return mine.tobytes() == np.ascontiguousarray(full[:, cols[0] : cols[1]]).tobytes()

    assert run_ranks(3, reshard) == [True, True, True]


def test_incremental_save_shares_equal_compressed_chunks(tmp_path: Path) -> None:
    state = {"a": _weights(1 << 18, 1), "b": _weights(1 << 18, 2)}
    gpuckpt.save(state, tmp_path / "s1", compression="zstd", content_hash=True, chunk_bytes=128 << 10)
    state["b"] = _weights(1 << 18, 3)
    gpuckpt.save(state, tmp_path / "s2", compression="zstd", base=tmp_path / "s1", chunk_bytes=128 << 10)
    same = (tmp_path / "s1" / "a" / "c.0").stat().st_ino == (tmp_path / "s2" / "a" / "c.0").stat().st_ino
    assert same  # a hard link of the base's compressed chunk
    assert (tmp_path / "s1" / "b" / "c.0").stat().st_ino != (tmp_path / "s2" / "b" / "c.0").stat().st_ino
    back = gpuckpt.load_state_dict(tmp_path / "s2")
    assert back["a"].tobytes() == state["a"].tobytes() and back["b"].tobytes() == state["b"].tobytes()
    assert verify_checkpoint(tmp_path / "s2").ok


def test_the_manager_saves_compressed_steps(tmp_path: Path) -> None:
    with gpuckpt.CheckpointManager(tmp_path / "run", max_to_keep=2, compression="lz4") as mgr:
        for step in range(3):
            mgr.save(step, {"w": _weights(1 << 16, step), "step": step})
        mgr.wait()
        out = mgr.restore_state_dict()
    assert out["step"] == 2 and out["w"].tobytes() == _weights(1 << 16, 2).tobytes()
    latest = sorted(p for p in (tmp_path / "run").iterdir() if p.name.startswith("step"))[-1]
    assert _codecs(latest)["w"] == "blosc"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with loopback_s3(BUCKET) as url:
        yield url


def test_s3_multipart_save_and_load_of_compressed_chunks(endpoint: str) -> None:
    opts = s3_options(endpoint) | {"part_bytes": 5 << 20}
    url = f"s3://{BUCKET}/c-{uuid.uuid4().hex[:8]}"
    state = {"w": _weights(12 << 20).reshape(-1, 1024), "noise": _state()["noise"], "step": 2}
    md = gpuckpt.save(state, url, compression="zstd", storage_options=opts, chunk_bytes=64 << 20)
    assert md.version == "4" and _codecs(url, opts) == {"w": "blosc", "noise": "blosc"}
    sizes = {e["key"]: e["nbytes"] for e in md.storage_data["tensors"]["w"]["chunks"]}
    assert sizes["c.0.0"] < state["w"].nbytes / 1.3 and sizes["c.0.0"] > 5 << 20  # more than a part
    back = gpuckpt.load_state_dict(url, storage_options=opts)
    assert back["w"].tobytes() == state["w"].tobytes() and back["noise"].tobytes() == state["noise"].tobytes()
    assert verify_checkpoint(url, storage_options=opts).ok
    assert json.loads(json.dumps(md.storage_data["tensors"]["w"]["codec"]))["name"] == "blosc"


def test_device_arrays_are_compressed_after_staging_and_decompressed_into_staging(tmp_path: Path) -> None:
    from gpuckpt.device.host_backend import HostBackend
    from gpuckpt.testing.fakedevice import EmulatedDeviceArray

    backend = HostBackend()
    w = _weights(300 * 1024, 5).reshape(300, 1024)
    # chunks of 64 rows: four whole ones and an edge chunk, each staged before it is compressed
    gpuckpt.save(
        {"w": EmulatedDeviceArray(w, backend)}, tmp_path / "c", compression="zstd", chunk_bytes=128 << 10
    )
    assert _codecs(tmp_path / "c")["w"] == "blosc"
    out = EmulatedDeviceArray(np.zeros_like(w), backend)
    gpuckpt.load({"w": out}, tmp_path / "c")
    assert out.data.tobytes() == w.tobytes()
