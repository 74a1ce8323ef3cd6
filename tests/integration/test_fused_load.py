"""Loads through the native copy-with-CRC loop: same bytes, same checks as the pread path.

Chunks of 1 MiB and more that are in the page cache are read through a memory map,
copied and checksummed in one pass (gpuckpt/storage/local/crccopy.c). These tests save
real checkpoints, load them with the loop and without it, and damage chunk files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import ChecksumError
from gpuckpt.storage.local import crccopy
from tests.pagecache import evict

pytestmark = pytest.mark.skipif(
    not crccopy.available(), reason="the native copy-with-CRC loop is not built here"
)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every call of the loop's page-cache read: True when it copied, False when it declined."""
    seen: list[bool] = []
    real = crccopy.cached_copy_crc

    def spy(fd: int, offset: int, dst: memoryview, value: int = 0) -> int | None:
        got = real(fd, offset, dst, value)
        seen.append(got is not None)
        return got

    monkeypatch.setattr(crccopy, "cached_copy_crc", spy)
    return seen


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(5)
    return {
        "big": rng.standard_normal((1024, 700)).astype(np.float32),  # 2.7 MiB, one chunk
        "odd": rng.integers(0, 2**31, 333_333, dtype=np.int64),  # 2.5 MiB, 8 bytes short of a page multiple
        "chunked": rng.standard_normal((3000, 300)).astype(np.float32),  # several chunks, a padded edge
        "small": rng.standard_normal(100).astype(np.float32),
        "step": 7,
    }


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {k: np.zeros_like(v) if isinstance(v, np.ndarray) else v for k, v in state.items()}


def _chunk_files(ckpt: Path, min_bytes: int = 1 << 20) -> list[Path]:
    return sorted(
        p
        for p in ckpt.rglob("c*")
        if (p.name == "c" or p.name.startswith("c.")) and p.is_file() and p.stat().st_size >= min_bytes
    )


def _save(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    state = _state()
    path = tmp_path / "ckpt"
    gpuckpt.save(state, path, chunk_bytes=1 << 21)
    return state, path


def test_cached_chunks_load_bit_exact_through_the_loop(tmp_path: Path, calls: list[bool]) -> None:
    state, path = _save(tmp_path)
    target = _zeros_like(state)
    gpuckpt.load(target, path)
    assert calls and all(calls), (
        "chunks just written are in the page cache: every large one goes through the loop"
    )
    for k, v in state.items():
        np.testing.assert_array_equal(target[k], v)
    fresh = gpuckpt.load_state_dict(path)
    for k, v in state.items():
        np.testing.assert_array_equal(fresh[k], v)


def test_uncached_chunks_take_the_pread_path(tmp_path: Path, calls: list[bool]) -> None:
    state, path = _save(tmp_path)
    files = _chunk_files(path)
    kept = evict(files)
    if len(kept) == len(files):
        pytest.skip("this file system keeps files cached after POSIX_FADV_DONTNEED")
    cold = len(files) - len(kept)
    target = _zeros_like(state)
    gpuckpt.load(target, path)
    assert calls.count(False) >= cold, "every chunk file with no page cached is read with pread"
    for k, v in state.items():
        np.testing.assert_array_equal(target[k], v)


@pytest.mark.parametrize("where", ["first", "middle", "last data byte"])
def test_a_flipped_byte_in_a_cached_chunk_is_caught(tmp_path: Path, calls: list[bool], where: str) -> None:
    state, path = _save(tmp_path)
    victim = next(f for f in _chunk_files(path) if "big" in f.parts)
    size = victim.stat().st_size
    offset = {"first": 0, "middle": size // 2 + 3, "last data byte": size - 5}[where]
    with open(victim, "r+b") as f:  # through the page cache, as a bit flip on a cached file would be seen
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))
    target = _zeros_like(state)
    with pytest.raises(ChecksumError, match=r"tensor 'big' failed its CRC32C check"):
        gpuckpt.load(target, path)
    assert True in calls
    # the same damage found without the loop
    os.environ["GPUCKPT_CRCCOPY"] = "off"
    crccopy._instance.cache_clear()
    try:
        assert not crccopy.available()
        with pytest.raises(ChecksumError, match=r"tensor 'big' failed its CRC32C check"):
            gpuckpt.load(_zeros_like(state), path)
    finally:
        del os.environ["GPUCKPT_CRCCOPY"]
        crccopy._instance.cache_clear()


def test_loads_with_and_without_the_loop_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state, path = _save(tmp_path)
    with_loop = _zeros_like(state)
    gpuckpt.load(with_loop, path)
    monkeypatch.setenv("GPUCKPT_CRCCOPY", "off")
    crccopy._instance.cache_clear()
    try:
        without = _zeros_like(state)
        gpuckpt.load(without, path)
    finally:
        monkeypatch.delenv("GPUCKPT_CRCCOPY")
        crccopy._instance.cache_clear()
    for k in state:
        np.testing.assert_array_equal(with_loop[k], without[k])


def test_a_chunk_that_cannot_be_mapped_for_a_memory_limit_is_read_with_pread(tmp_path: Path) -> None:
    # under RLIMIT_AS the loop's map of a large cached chunk fails with ENOMEM: the load reads it
    # with pread instead (it was a bare OSError naming nothing)
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import resource, sys, numpy as np, gpuckpt
        path = sys.argv[1]
        want = np.random.default_rng(0).standard_normal((96 << 20) // 4).astype(np.float32)
        gpuckpt.save({"big": want}, path, chunk_bytes=96 << 20)
        target = {"big": np.zeros_like(want)}
        size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size + (48 << 20), size + (48 << 20)))
        gpuckpt.load(target, path)
        print(np.array_equal(target["big"], want))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "c")], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "True"
