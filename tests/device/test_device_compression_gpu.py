"""Compression on a real GPU (``gpu`` marker): ``compression={"codec": "zstd", "device": True}``
compresses CuPy arrays' chunks with nvCOMP, and every host reader reads the frames (the pipeline
itself is tested without a GPU in tests/integration/test_device_compression.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import gpuckpt
from gpuckpt.device import compress
from gpuckpt.verify import verify_checkpoint

pytestmark = pytest.mark.gpu


def test_cupy_chunks_are_compressed_by_nvcomp_and_read_on_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cupy as cp

    if compress.nvcomp_module() is None:
        pytest.skip("the nvCOMP wheel (nvidia-nvcomp-cu12/13) is not installed")
    calls: list[int] = []
    real = compress.encode_device_chunks

    def counted(array: Any, chunks: Any, codec_name: str) -> Any:
        out = real(array, chunks, codec_name)
        calls.append(0 if out is None else len(out))
        return out

    monkeypatch.setattr(compress, "encode_device_chunks", counted)
    rng = cp.random.default_rng(3)
    host = {
        "w": (rng.standard_normal((1000, 1024), dtype=cp.float32) * 0.02).astype(cp.float16),  # edge chunk
        "m": rng.standard_normal((333, 77), dtype=cp.float32) ** 2,
        # channels-last memory of an NCHW tensor: stored in logical C order
        "conv": cp.ascontiguousarray(rng.standard_normal((8, 12, 12, 32), dtype=cp.float32)).transpose(
            0, 3, 1, 2
        ),
        "i": rng.integers(0, 100, 100_000, dtype=cp.int32),
    }
    ckpt = tmp_path / "c"
    gpuckpt.save(dict(host), ckpt, compression={"codec": "zstd", "device": True}, chunk_bytes=256 << 10)
    assert calls and all(n > 0 for n in calls)  # every array's chunks, on the device
    back = {k: cp.zeros_like(v) for k, v in host.items()}
    gpuckpt.load(back, ckpt)
    for k, v in host.items():
        assert bool((back[k] == v).all()), k
    for k, v in host.items():  # zarr-python (numcodecs' zstd) reads nvCOMP's frames
        assert np.array_equal(zarr.open_array(ckpt / k, mode="r")[...], cp.asnumpy(v)), k
    assert verify_checkpoint(ckpt).ok
