"""Disk full and I/O errors during a save: a clear error, nothing published, the old checkpoint intact.

Faults are injected into the ``os`` module the storage code sees
(:func:`gpuckpt.testing.faults.inject_os_faults`), so they run everywhere;
a real full file system (a small tmpfs) is used where mounting is allowed.
"""

from __future__ import annotations

import copy
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.testing.faults import Fault, inject_os_faults, temporaries


def state(seed: int, mib: float = 1.0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    n = int(mib * (1 << 20)) // 4 // 8
    return {"model": {f"w{i}": rng.standard_normal(n).astype(np.float32) for i in range(8)}, "seed": seed}


def assert_holds(path: Path, seed: int, mib: float = 1.0) -> None:
    want, got = state(seed, mib), gpuckpt.load_state_dict(path)
    assert got["seed"] == seed
    for k, v in want["model"].items():
        assert got["model"][k].tobytes() == v.tobytes()


def assert_clean_failure(exc: BaseException, err: int, parent: Path) -> None:
    assert isinstance(exc, gpuckpt.CheckpointWriteError), (
        f"expected CheckpointWriteError, got {type(exc).__name__}: {exc}"
    )
    assert isinstance(exc, OSError) and exc.errno == err, exc
    assert "nothing was published" in str(exc) and str(parent) in str(exc), exc
    assert os.strerror(err) in str(exc), f"the message does not say what failed: {exc}"
    assert temporaries(parent) == [], "a failed save left temporaries behind"


FAULTS: list[tuple[str, list[Fault], dict[str, int], str]] = [
    ("first-write-enospc", [Fault("write", 1, errno.ENOSPC)], {}, "file"),
    ("partial-write-enospc", [Fault("write", 9, errno.ENOSPC, partial=100)], {}, "file"),
    ("file-fsync-eio", [Fault("fsync", 3, errno.EIO)], {}, "file"),
    ("dir-fsync-eio", [Fault("fsync", 30, errno.EIO)], {}, "file"),
    ("tmp-mkdir-enospc", [Fault("mkdir", 1, errno.ENOSPC)], {}, "file"),
    ("array-mkdir-enospc", [Fault("mkdir", 3, errno.ENOSPC)], {}, "file"),
    ("create-enospc", [Fault("open", 5, errno.ENOSPC)], {}, "file"),
    ("close-eio", [Fault("close", 4, errno.EIO, once=True)], {}, "file"),
    ("write-eio-fs-mode", [Fault("write", 20, errno.EIO)], {}, "fs"),
    ("syncfs-eio", [], {"syncfs": errno.EIO}, "fs"),
    ("publish-eio", [], {"exchange": errno.EIO, "rename_noreplace": errno.EIO}, "file"),
]


@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "new-path"])
@pytest.mark.parametrize(("faults", "libc", "sync"), [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS])
def test_injected_io_error_publishes_nothing_and_keeps_old_checkpoint(
    tmp_path: Path, faults: list[Fault], libc: dict[str, int], sync: str, overwrite: bool
) -> None:
    old = tmp_path / "ckpt"
    gpuckpt.save(state(1), old)
    target = old if overwrite else tmp_path / "other"
    faults = copy.deepcopy(faults)  # fresh call counters for each run
    err = faults[0].err if faults else next(iter(libc.values()))
    with inject_os_faults(*faults, libc=libc), pytest.raises(OSError) as info:
        gpuckpt.save(state(2), target, overwrite=overwrite, sync=sync, chunk_bytes=64 << 10)
    assert_clean_failure(info.value, err, tmp_path)
    assert_holds(old, 1)
    if not overwrite:
        assert not target.exists()
    # nothing sticks: the same save succeeds once the fault is gone
    gpuckpt.save(state(2), target, overwrite=True, sync=sync, chunk_bytes=64 << 10)
    assert_holds(target, 2)


def test_injected_io_error_fails_async_save_future(tmp_path: Path) -> None:
    old = tmp_path / "ckpt"
    gpuckpt.save(state(1), old)
    with inject_os_faults(Fault("write", 7, errno.ENOSPC, partial=10)):
        fut = gpuckpt.async_save(state(2), old, overwrite=True, sync="file", chunk_bytes=64 << 10)
        exc = fut.exception(timeout=60)
    assert exc is not None
    assert_clean_failure(exc, errno.ENOSPC, tmp_path)
    assert_holds(old, 1)


def test_error_after_publication_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    """The rename happened, then fsync of the parent directory fails: the save raises.

    The new checkpoint is then visible (it cannot be un-published) and
    complete; what the error says is that its durability is not known.
    """
    old = tmp_path / "ckpt"
    gpuckpt.save(state(1), old)
    from gpuckpt.storage.local import fsutil

    real = fsutil.fsync_dir

    def failing_for_parent(path: Path) -> None:
        if Path(path) == tmp_path:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        real(path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fsutil, "fsync_dir", failing_for_parent)
        with pytest.raises(OSError) as info:
            gpuckpt.save(state(2), old, overwrite=True, sync="file")
    assert info.value.errno == errno.EIO
    assert_holds(old, gpuckpt.load_state_dict(old, keys=["seed"])["seed"])
    assert temporaries(tmp_path) == []


def test_overwrite_fallback_rename_failure_keeps_old_checkpoint(tmp_path: Path) -> None:
    old = tmp_path / "ckpt"
    gpuckpt.save(state(1), old)
    # the first rename (old -> aside) succeeds, the second (tmp -> path) fails
    with (
        inject_os_faults(Fault("rename", 2, errno.EIO, once=True), libc={"exchange": 0}),
        pytest.raises(OSError),
    ):
        gpuckpt.save(state(2), old, overwrite=True, sync="file")
    assert_holds(old, 1)


# a real full file system -------------------------------------------------------------------


def _tmpfs(tmp_path: Path, options: str) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here: the tmpfs variant needs it")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs ({options}) here ({proc.stderr.strip()}); the injected variants cover it"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    yield from _tmpfs(tmp_path, "size=8m")


@pytest.fixture
def few_inodes_fs(tmp_path: Path) -> Iterator[Path]:
    yield from _tmpfs(tmp_path, "size=64m,nr_inodes=40")


def test_a_file_system_out_of_inodes_is_told_as_such(few_inodes_fs: Path) -> None:
    # space is left: the remedy is about inodes, not about freeing space
    gpuckpt.save(state(1, 0.1), few_inodes_fs / "small")
    many = {"t": {f"x{i}": np.full(4, i) for i in range(200)}}
    with pytest.raises(gpuckpt.CheckpointWriteError) as info:
        gpuckpt.save(many, few_inodes_fs / "many", sync="file")
    assert info.value.errno == errno.ENOSPC and "no free inodes" in str(info.value), info.value
    assert_holds(few_inodes_fs / "small", 1, 0.1)


def test_a_manager_root_that_cannot_be_made_is_a_write_error(small_fs: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(gpuckpt.CheckpointWriteError, match="cannot create the checkpoint root .* is a file"):
        gpuckpt.CheckpointManager(tmp_path / "file" / "run")
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    with pytest.raises(
        gpuckpt.CheckpointWriteError, match="cannot create the checkpoint root .* read-only"
    ) as info:
        gpuckpt.CheckpointManager(small_fs / "run")
    assert info.value.errno == errno.EROFS


def _used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.mark.parametrize("sync", ["file", "fs"])
@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "new-path"])
def test_full_tmpfs_publishes_nothing_and_frees_space(small_fs: Path, sync: str, overwrite: bool) -> None:
    old = small_fs / "ckpt"
    gpuckpt.save(state(1, 2.0), old, sync=sync)
    used = _used(small_fs)
    target = old if overwrite else small_fs / "other"
    with pytest.raises(OSError) as info:
        gpuckpt.save(state(2, 7.0), target, overwrite=overwrite, sync=sync)
    assert_clean_failure(info.value, errno.ENOSPC, small_fs)
    assert_holds(old, 1, 2.0)
    assert (not overwrite and not target.exists()) or overwrite
    assert _used(small_fs) <= used + (64 << 10), "a failed save did not give its space back"
    # a save that fits still works on the same file system
    gpuckpt.save(state(3, 1.0), target, overwrite=True, sync=sync)
    assert_holds(target, 3, 1.0)


@pytest.mark.parametrize(
    "fault",
    [Fault("write", 3, errno.ENOSPC), Fault("open", 4, errno.ENOSPC), Fault("fsync", 2, errno.EIO)],
    ids=["write-enospc", "create-enospc", "fsync-eio"],
)
def test_injected_io_error_in_async_save_of_large_chunks(tmp_path: Path, fault: Fault) -> None:
    # 2 MiB chunk files: async_save writes them with O_DIRECT where the file system allows
    old = tmp_path / "ckpt"
    gpuckpt.save(state(1, mib=16), old)
    with inject_os_faults(fault):
        fut = gpuckpt.async_save(state(2, mib=16), old, overwrite=True, sync="file")
        exc = fut.exception(timeout=60)
    assert exc is not None
    assert_clean_failure(exc, fault.err, tmp_path)
    assert_holds(old, 1, mib=16)
    gpuckpt.async_save(state(2, mib=16), old, overwrite=True, sync="file").result()
    assert_holds(old, 2, mib=16)


@pytest.mark.parametrize("target", ["safetensors", "hf"])
def test_a_conversion_that_fills_the_disk_is_a_write_error_and_keeps_the_earlier_output(
    small_fs: Path, tmp_path: Path, target: str
) -> None:
    """As a save: CheckpointWriteError with the errno, the output, "nothing was published" and
    the remedy (it was a bare OSError); the earlier output is intact and nothing is left."""
    from gpuckpt.convert import convert

    src = tmp_path / "src"
    gpuckpt.save(state(1, 6.0), src)  # 6 MiB: more than the 8 MiB tmpfs has left once 2 are used
    dst = small_fs / ("out.safetensors" if target == "safetensors" else "hf")
    small = tmp_path / "small"
    gpuckpt.save(state(2, 2.0), small)
    convert(small, dst, target_format=target)
    before = gpuckpt.load_state_dict(dst)
    gpuckpt.save(state(3, 1.0), small_fs / "filler")
    with pytest.raises(OSError) as info:
        convert(src, dst, target_format=target, overwrite=True)
    assert_clean_failure(info.value, errno.ENOSPC, small_fs)
    assert "free space on the device" in str(info.value)
    after = gpuckpt.load_state_dict(dst)
    assert after.keys() == before.keys() and all(np.array_equal(after[k], before[k]) for k in before)
