"""The device compressor's grouping, batching and order (gpuckpt.device.compress) run on the host:
NumPy stands in for CuPy, and a stand-in for nvCOMP's Python module writes each buffer of a
batch as one zstd frame, as nvCOMP's ``Zstd`` in ``RAW`` mode does on a GPU. What only a GPU can
run (CuPy's copies, nvCOMP itself) is tested in tests/device/test_device_compression_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from numcodecs import zstd

from gpuckpt.device import compress
from gpuckpt.device.hashing import device_stored_groups, stored_block
from gpuckpt.format.grid import plan_regular_grid


class _Encoded:
    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames

    def cpu(self) -> list[np.ndarray]:
        return [np.frombuffer(f, np.uint8) for f in self.frames]


class _Codec:
    batches: list[list[tuple[int, int]]] = []

    def __init__(self, *, algorithm: str, bitstream_kind: str, uncomp_chunk_size: int) -> None:
        assert algorithm == "Zstd" and bitstream_kind == "raw"
        self.largest = uncomp_chunk_size

    def encode(self, batch: list[Any]) -> _Encoded:
        assert all(b.nbytes <= self.largest for b in batch)
        _Codec.batches.append([(b.ctypes.data % compress.INPUT_ALIGN, b.nbytes) for b in batch])
        return _Encoded([zstd.compress(np.ascontiguousarray(b).tobytes(), 1) for b in batch])


def _as_arrays(buffer: Any, offsets: list[int], sizes: list[int]) -> list[Any]:
    return [buffer[o : o + n] for o, n in zip(offsets, sizes, strict=True)]


FAKE_NVCOMP = SimpleNamespace(Codec=_Codec, BitstreamKind=SimpleNamespace(RAW="raw"), as_arrays=_as_arrays)


def _chunks(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> list[Any]:
    grid = plan_regular_grid(shape, itemsize, chunk_bytes)
    out = []
    for coords in np.ndindex(*grid.grid_shape):
        offsets = tuple(c * s for c, s in zip(coords, grid.chunk_shape, strict=True))
        sizes = tuple(min(s, n - o) for s, n, o in zip(grid.chunk_shape, shape, offsets, strict=True))
        out.append((offsets, sizes, tuple(grid.chunk_shape)))
    return out


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    return {
        # whole chunks in place (row-aligned), an edge chunk gathered with its padding
        "rows": rng.standard_normal((1000, 96)).astype(np.float32),
        # one-byte rows of 77: chunk starts that are not 16-byte aligned are gathered
        "narrow": rng.integers(0, 9, (900, 77), dtype=np.uint8),
        # channels-last memory: gathered in logical C order
        "nhwc": np.ascontiguousarray(rng.standard_normal((64, 9, 9, 32)).astype(np.float16)).transpose(
            0, 3, 1, 2
        ),
    }


@pytest.mark.parametrize("name", ["rows", "narrow", "nhwc"])
@pytest.mark.parametrize("batch_bytes", [1 << 30, 40 << 10])
def test_frames_are_each_chunks_stored_block_in_order(
    name: str, batch_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compress, "BATCH_BYTES", batch_bytes)
    _Codec.batches = []
    a = _arrays()[name]
    chunks = _chunks(a.shape, a.itemsize, 16 << 10)
    assert len(chunks) > 2
    frames = compress.encode_device_chunks(a, chunks, "zstd", nvcomp=FAKE_NVCOMP, xp=np)
    assert frames is not None and len(frames) == len(chunks)
    for c, f in zip(chunks, frames, strict=True):
        got = np.empty(stored_block(a, c).nbytes, np.uint8)
        zstd.decompress(f.tobytes(), got)
        assert got.tobytes() == stored_block(a, c).tobytes(), c
    # every buffer given to the codec starts aligned, and no batch passes the limit (one chunk
    # alone may)
    assert all(start == 0 for batch in _Codec.batches for start, _ in batch)
    assert all(len(b) == 1 or sum(n for _, n in b) <= batch_bytes for b in _Codec.batches)
    if batch_bytes < a.nbytes:
        assert len(_Codec.batches) > 1


def test_grouping_places_gathered_chunks_aligned_in_bounded_scratch() -> None:
    a = _arrays()["narrow"]
    chunks = _chunks(a.shape, a.itemsize, 4 << 10)
    seen: list[int] = []
    for indices, buffer, spans in device_stored_groups(a, chunks, 20 << 10, align=16, xp=np):
        seen += indices
        assert all(start % 16 == 0 for start, _ in spans)
        for i, (start, n) in zip(indices, spans, strict=True):
            assert buffer[start : start + n].tobytes() == stored_block(a, chunks[i]).tobytes()
        if buffer.base is None:  # scratch: about the limit at most (one chunk alone may pass it)
            assert len(indices) == 1 or buffer.nbytes <= (20 << 10)
    assert sorted(seen) == list(range(len(chunks)))


def test_no_device_codec_means_none() -> None:
    a = _arrays()["rows"]
    chunks = _chunks(a.shape, a.itemsize, 16 << 10)
    assert compress.encode_device_chunks(a, chunks, "blosc", nvcomp=FAKE_NVCOMP, xp=np) is None
    empty = np.zeros((0, 4), np.float32)
    assert (
        compress.encode_device_chunks(empty, [((0, 0), (0, 4), (0, 4))], "zstd", nvcomp=FAKE_NVCOMP, xp=np)
        is None
    )
