"""Loads of many small chunks that are not in the page cache use more I/O threads.

Each I/O thread waits for one small file at a time, so on a cold cache the number of threads
is the number of reads queued at the device. A load asks whether the first page of a few of its chunk
files is in the page cache (``mincore``, which reads nothing) and, when one is not, reads with :data:`~gpuckpt.loading.chunk_reads.COLD_SMALL_THREADS` threads; warm loads, and
loads of few or large chunks, keep the default.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.loading.chunk_reads import COLD_SMALL_THREADS, MANY_CHUNKS, cold_small_threads
from gpuckpt.loading.open import open_checkpoint
from gpuckpt.storage.stores import open_reader
from tests.pagecache import evict, files_under


def _targets(path: Path) -> list[tuple[object, object]]:
    tensors = open_checkpoint(path).index.tensors
    return [(t, None) for t in tensors.values()]


def _state(n: int, size: int) -> dict[str, np.ndarray]:
    return {f"t{i:04d}": np.full(size, i, np.float32) for i in range(n)}


def test_a_cold_load_of_many_small_chunks_uses_more_threads_and_a_warm_one_does_not(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    state = _state(MANY_CHUNKS + 8, 1024)
    gpuckpt.save(state, path)
    reader = open_reader(path)
    first = _targets(path)[0][0]
    if evict(files_under(path)):
        pytest.skip("this file system keeps the pages of a file after POSIX_FADV_DONTNEED")
    # asking warms nothing: the same answer twice
    assert reader.chunk_cached(first.name, "c.0") is False  # type: ignore[attr-defined]
    assert reader.chunk_cached(first.name, "c.0") is False  # type: ignore[attr-defined]
    assert cold_small_threads(reader, _targets(path)) == COLD_SMALL_THREADS  # type: ignore[arg-type]
    dest = {k: np.zeros_like(v) for k, v in state.items()}
    gpuckpt.load(dest, path)  # cold, on more threads: bit-exact
    assert all(np.array_equal(dest[k], v) for k, v in state.items())
    assert cold_small_threads(reader, _targets(path)) is None  # type: ignore[arg-type]


def test_few_or_large_chunks_keep_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    few, many = tmp_path / "few", tmp_path / "many"
    gpuckpt.save(_state(MANY_CHUNKS - 1, 1024), few)
    gpuckpt.save(_state(MANY_CHUNKS, 1024), many)
    evict(files_under(tmp_path))
    assert cold_small_threads(open_reader(few), _targets(few)) is None  # type: ignore[arg-type]
    # chunks above the small-chunk size (4 KiB + trailer here, against a 4 KiB limit) are not "small"
    monkeypatch.setattr("gpuckpt.loading.chunk_reads.SMALL_CHUNK_BYTES", 4096)
    assert cold_small_threads(open_reader(many), _targets(many)) is None  # type: ignore[arg-type]
