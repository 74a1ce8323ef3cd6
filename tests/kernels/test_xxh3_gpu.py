"""The device hash on a real GPU: :func:`gpuckpt.device.hashing.hash_device_chunks` against the host's
:func:`gpuckpt.format.contenthash.chunk_hash`. Skipped without a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

from gpuckpt.device.hashing import hash_device_chunks
from gpuckpt.format.contenthash import LEAF, chunk_hash

pytestmark = pytest.mark.gpu
xxhash = pytest.importorskip("xxhash")


def test_device_hashes_equal_host_hashes() -> None:
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(11)
    sizes = [0, 1, 240, 241, LEAF, 3 * LEAF + 5, 17 * LEAF]
    host = rng.integers(0, 256, sum(sizes) + 7, dtype=np.uint8)
    chunks, pos = [], 7
    for n in sizes:
        chunks.append((pos, n))
        pos += n
    got = hash_device_chunks(cupy.asarray(host), chunks)
    for (start, n), (value, head) in zip(chunks, got, strict=True):
        data = host[start : start + n].tobytes()
        assert value == chunk_hash([data]), n
        assert head == xxhash.xxh3_128_digest(data[:LEAF]), n
