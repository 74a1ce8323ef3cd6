"""``DeviceBackend.hash_chunks``: the digests of chunks as stored (the box at the origin of a zero
block of the stored shape), against :func:`gpuckpt.format.contenthash.chunk_hash` of the bytes a
save stores (:func:`gpuckpt.format.chunks.chunk_bytes`). The host stand-in runs everywhere; the
CuPy back end (the kernels of ``kernels/xxh3_tree.cu``) needs a GPU."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpuckpt.device.host_backend import HostBackend
from gpuckpt.format import memory_format as mf
from gpuckpt.format.chunks import chunk_bytes
from gpuckpt.format.contenthash import LEAF, chunk_hash

xxhash = pytest.importorskip("xxhash")

Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def cases() -> list[tuple[np.ndarray, list[Box]]]:
    rng = np.random.default_rng(5)
    big = rng.standard_normal((300, 1001))  # 2.4 MB: chunks of several leaves, a padded edge
    grid = rng.integers(0, 1 << 30, (7, 9), dtype=np.int32)  # edges padded in both dimensions
    nchw = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    channels_last = np.ascontiguousarray(nchw.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    assert mf.detect_memory_format(channels_last.shape, channels_last.strides, 4) is mf.channels_last
    return [
        (big, [((0, 0), (151, 1001), (151, 1001)), ((151, 0), (149, 1001), (151, 1001))]),
        (grid, [((r, c), (min(3, 7 - r), min(4, 9 - c)), (3, 4)) for r in (0, 3, 6) for c in (0, 4, 8)]),
        (
            channels_last,
            [((0, 0, 0, 0), (1, 3, 5, 4), (1, 3, 5, 4)), ((1, 0, 3, 0), (1, 3, 2, 4), (1, 3, 3, 4))],
        ),
        (np.arange(5, dtype=">i8"), [((0,), (5,), (8,))]),  # stored little-endian
        (np.float64(2.5) * np.ones(()), [((), (), ())]),
    ]


def expected(array: np.ndarray, chunk: Box) -> tuple[bytes, bytes]:
    offsets, sizes, stored = chunk
    box = array[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] if sizes else array
    data, pad = chunk_bytes(box, stored)
    whole = data.tobytes() + bytes(pad)
    return chunk_hash([whole]), xxhash.xxh3_128_digest(whole[:LEAF])


@pytest.mark.parametrize("case", range(5))
def test_host_backend_hashes_chunks_as_a_save_stores_them(case: int) -> None:
    array, chunks = cases()[case]
    backend = HostBackend()
    got = backend.hash_chunks(array, chunks)
    assert got == [expected(array, c) for c in chunks]
    assert backend.hashed_chunks == len(chunks) and backend.copies == 0


def test_host_backend_refuses_a_box_larger_than_its_block() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        HostBackend().hash_chunks(np.zeros((4, 4)), [((0, 0), (4, 4), (2, 4))])


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(5))
def test_cupy_backend_hashes_chunks_as_a_save_stores_them(case: int) -> None:
    cupy = pytest.importorskip("cupy")
    from gpuckpt.device import cuda

    if not cuda.gpu_available():
        pytest.skip("no CUDA device")
    array, chunks = cases()[case]
    host: Any = array.astype(array.dtype.newbyteorder("<"))
    if array.ndim == 4:  # keep the channels-last strides on the device
        device = cupy.asarray(np.ascontiguousarray(host.transpose(0, 2, 3, 1))).transpose(0, 3, 1, 2)
    else:
        device = cupy.asarray(host)
    got = cuda.backend_for_device(0).hash_chunks(device, chunks)
    assert got == [expected(array, c) for c in chunks]
