"""Fault injection and damage helpers for reliability tests.

Three families of tools:

* **I/O faults** — :func:`inject_os_faults` swaps the ``os`` module seen by
  the storage modules (:mod:`gpuckpt.storage.local.fileio`, :mod:`gpuckpt.storage.local.writer`,
  :mod:`gpuckpt.storage.local.direct`, :mod:`gpuckpt.storage.local.leftovers`,
  :mod:`gpuckpt.storage.local.fsutil`; the native small-file batches are off meanwhile) for a
  :class:`FaultyOS` proxy that raises a chosen ``OSError`` on the n-th call
  of a function (``write``, ``fsync``, ``mkdir``, ``rename``, ...), optionally
  after writing part of the data, as a full disk does. The publication
  primitives that go through libc (``syncfs``, ``renameat2``) are wrapped at
  the :mod:`gpuckpt.storage.local.fsutil` level. Nothing else in the process is
  touched, so pytest's own I/O keeps working.
* **libc faults** for native code (:func:`build_fault_shim`, :func:`fault_shim_env`):
  ``faultshim.c``, loaded with ``LD_PRELOAD`` into a subprocess, fails libc's file
  calls (``open``, ``mkdir``, ``write``, ``fsync``, ``posix_fallocate``, ``read``, ``close``) on files
  under one directory, so that C code (``batchio.c``) and the Python path it
  replaces meet the same faults.
* **Damage** — flip bits, truncate, extend, delete or replace the files of a
  published checkpoint, and rewrite its root metadata with a valid checksum
  (to play a hostile author rather than a failing disk).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Fault",
    "FaultyOS",
    "build_fault_shim",
    "checkpoint_files",
    "copy_checkpoint",
    "damage",
    "fault_shim_env",
    "inject_os_faults",
    "rewrite_root_metadata",
    "sparse_table_claim",
    "temporaries",
]

STORAGE_MODULES = (
    "gpuckpt.storage.local.fileio",
    "gpuckpt.storage.local.writer",
    "gpuckpt.storage.local.reader",
    "gpuckpt.storage.local.direct",
    "gpuckpt.storage.local.leftovers",
    "gpuckpt.storage.local.fsutil",
)


@dataclass
class Fault:
    """Raise ``OSError(err)`` on call number ``nth`` (1-based) of ``os.<call>`` and every later one.

    ``once=True`` fails only that call. For ``write``, ``partial`` bytes of
    the failing call's buffer are written first (a disk that fills mid-write).
    ``write`` faults count and fail vectored writes (``writev``) too.
    """

    call: str
    nth: int = 1
    err: int = errno.EIO
    once: bool = False
    partial: int = 0
    seen: int = field(default=0, init=False)
    fired: int = field(default=0, init=False)

    def should_fail(self) -> bool:
        self.seen += 1
        if self.seen < self.nth or (self.once and self.fired):
            return False
        self.fired += 1
        return True


class FaultyOS(types.ModuleType):
    """A stand-in for :mod:`os` that injects :class:`Fault` s and reports calls to ``hook``."""

    def __init__(self, faults: list[Fault], hook: Callable[[str], None] | None = None) -> None:
        super().__init__("os")
        self._faults = faults
        self._hook = hook

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        if not callable(real) or isinstance(real, type):
            return real
        # a "write" fault also stands for the vectored write (small chunks use writev)
        faults = [f for f in self._faults if f.call == name or (name == "writev" and f.call == "write")]
        hook = self._hook
        if not faults and hook is None:
            return real

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if hook is not None:
                hook(name)
            for f in faults:
                if f.should_fail():
                    if name == "write" and f.partial and len(args) >= 2:
                        real(args[0], memoryview(args[1]).cast("B")[: f.partial])
                    elif name == "writev" and f.partial and len(args) >= 2 and args[1]:
                        os.write(args[0], memoryview(args[1][0]).cast("B")[: f.partial])
                    raise OSError(f.err, os.strerror(f.err))
            return real(*args, **kwargs)

        return wrapper


@contextlib.contextmanager
def inject_os_faults(
    *faults: Fault,
    hook: Callable[[str], None] | None = None,
    libc: dict[str, int] | None = None,
) -> Iterator[FaultyOS]:
    """Inject ``faults`` into the storage modules' ``os`` for the duration of the block.

    ``libc`` maps ``"syncfs"``, ``"exchange"`` or ``"rename_noreplace"`` to an
    errno that the corresponding :mod:`gpuckpt.storage.local.fsutil` function raises;
    ``"exchange": 0`` makes ``exchange`` report "unsupported here" instead,
    forcing the two-rename fallback.
    """
    import importlib

    proxy = FaultyOS(list(faults), hook)
    mods = [importlib.import_module(m) for m in STORAGE_MODULES]
    saved: list[tuple[Any, str, Any]] = [(m, "os", m.os) for m in mods]
    # native batches call libc, not this proxy: inside the block the storage code goes
    # file by file through Python, where the faults land (the native path meets the same
    # faults one level lower, through build_fault_shim)
    batchio = importlib.import_module("gpuckpt.storage.local.batchio")
    saved.append((batchio, "instance", batchio.instance))
    batchio.instance = lambda: None  # type: ignore[attr-defined]
    fsutil = importlib.import_module("gpuckpt.storage.local.fsutil")
    for fn_name, err in (libc or {}).items():
        saved.append((fsutil, fn_name, getattr(fsutil, fn_name)))
        setattr(fsutil, fn_name, _failing(fn_name, err))
    try:
        for m in mods:
            m.os = proxy  # type: ignore[attr-defined]
        yield proxy
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _failing(fn_name: str, err: int) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        if fn_name == "exchange" and err == 0:
            return False
        raise OSError(err, f"{os.strerror(err)} (injected into {fn_name})")

    return fail


# libc faults --------------------------------------------------------------------

FAULT_SHIM_SOURCE = Path(__file__).with_name("faultshim.c")


def build_fault_shim(out_dir: Path) -> Path | None:
    """Compile ``faultshim.c`` into ``out_dir``; None where that cannot be done (not Linux,
    no C compiler: ``CC``, default ``cc``)."""
    cc = shlex.split(os.environ.get("CC", "cc"))
    if not sys.platform.startswith("linux") or not cc or shutil.which(cc[0]) is None:
        return None
    out = out_dir / "faultshim.so"
    cmd = [*cc, "-O1", "-std=gnu11", "-Wall", "-shared", "-fPIC", "-o", os.fspath(out)]
    subprocess.run([*cmd, os.fspath(FAULT_SHIM_SOURCE), "-ldl"], check=True, capture_output=True)
    return out


def fault_shim_env(
    shim: Path,
    directory: Path,
    call: str,
    *,
    nth: int = 1,
    err: int = errno.EIO,
    partial: int = 0,
    trace: Path | None = None,
) -> dict[str, str]:
    """Environment for a subprocess whose ``call`` (``open`` of a new file, ``mkdir``, ``write``,
    ``fsync``, ``fallocate``, ``read``, ``close``) fails with ``err`` on files under ``directory``,
    from its ``nth`` such call on; a ``write`` fault with ``partial`` first writes that many bytes (a short
    write), as a file system that fills up does. ``call="none"`` injects nothing.
    ``trace``: a file where every ``fsync``, ``fdatasync`` and ``sync_file_range`` of a
    file under ``directory`` is logged as ``"<call> <st_dev> <st_ino> <st_size>"``."""
    return {
        **os.environ,
        **({"GCK_TRACE_FILE": os.fspath(trace)} if trace is not None else {}),
        "LD_PRELOAD": os.fspath(shim),
        "GCK_FAULT_DIR": os.fspath(directory.resolve()),
        "GCK_FAULT_CALL": call,
        "GCK_FAULT_NTH": str(nth),
        "GCK_FAULT_ERRNO": str(err),
        "GCK_FAULT_PARTIAL": str(partial),
    }


# damage -----------------------------------------------------------------------


def checkpoint_files(path: Path) -> list[Path]:
    """Every regular file of a checkpoint, sorted (root ``zarr.json`` first)."""
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    root = path / "zarr.json"
    return [root, *[p for p in files if p != root]] if root in files else files


def temporaries(parent: Path) -> list[str]:
    """Names of the leftovers of saves in ``parent`` (hidden temporaries and set-aside copies)."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".") and ".gpuckpt-" in p.name)


def damage(path: Path, kind: str, rng: random.Random) -> str:
    """Damage the file ``path`` in one of these ways; returns a description.

    ``flip-bit`` one random bit; ``flip-byte`` one byte XOR a random non-zero
    value; ``flip-many`` 2-8 random bytes; ``truncate`` to a random shorter
    size; ``extend`` by random bytes; ``zero-tail`` the last bytes zeroed (a
    torn write); ``delete``; ``to-dir`` replaced by an empty directory;
    ``empty`` truncated to 0 bytes.
    """
    size = path.stat().st_size
    if kind == "delete":
        path.unlink()
        return f"deleted {path.name}"
    if kind == "to-dir":
        path.unlink()
        path.mkdir()
        return f"replaced {path.name} by a directory"
    if kind == "empty":
        os.truncate(path, 0)
        return f"emptied {path.name}"
    if kind == "truncate":
        n = rng.randrange(0, max(size, 1))
        os.truncate(path, n)
        return f"truncated {path.name} from {size} to {n}"
    if kind == "extend":
        with open(path, "ab") as f:
            f.write(rng.randbytes(rng.randint(1, 64)))
        return f"extended {path.name}"
    raw = bytearray(path.read_bytes())
    if not raw:
        raise ValueError(f"{path} is empty; nothing to flip")
    if kind == "flip-bit":
        i, b = rng.randrange(len(raw)), rng.randrange(8)
        raw[i] ^= 1 << b
        what = f"flipped bit {b} of byte {i}"
    elif kind == "flip-byte":
        i = rng.randrange(len(raw))
        raw[i] ^= rng.randint(1, 255)
        what = f"flipped byte {i}"
    elif kind == "flip-many":
        idx = rng.sample(range(len(raw)), min(len(raw), rng.randint(2, 8)))
        for i in idx:
            raw[i] ^= rng.randint(1, 255)
        what = f"flipped bytes {sorted(idx)}"
    elif kind == "zero-tail":
        n = rng.randint(1, min(len(raw), 512))
        raw[-n:] = bytes(n)
        if raw == bytearray(path.read_bytes()):
            raw[-1] ^= 1  # the tail was zero already: still change something
        what = f"zeroed the last {n} bytes"
    else:
        raise ValueError(f"unknown damage kind {kind!r}")
    path.write_bytes(bytes(raw))
    return f"{what} of {path.name}"


def rewrite_root_metadata(path: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Apply ``edit`` to the metadata in ``path/zarr.json`` and store it with a matching checksum.

    This is what a hostile author does: the root document stays
    self-consistent, so only validation can catch the edit.
    """
    from gpuckpt.format.checksum import crc32c
    from gpuckpt.format.documents import _canonical

    doc = json.loads((path / "zarr.json").read_bytes())
    md = doc["attributes"]["gpuckpt"]["metadata"]
    replaced = edit(md)
    if replaced is not None:
        md = doc["attributes"]["gpuckpt"]["metadata"] = replaced
    doc["attributes"]["gpuckpt"]["metadata_crc32c"] = crc32c(_canonical(md))
    (path / "zarr.json").write_bytes(json.dumps(doc).encode())


def sparse_table_claim(path: Path, rows: int) -> None:
    """``path`` becomes a format-2 checkpoint whose one tensor ``w`` claims ``rows`` chunks of 16
    float32 through a chunk table of ``rows`` rows kept in sparse files of zeros (with valid
    trailers), as a hostile author makes it for a few KiB; only the first 5,000 chunk files exist."""
    import numpy as np

    import gpuckpt
    from gpuckpt.format.checksum import crc32c

    gpuckpt.save({"w": np.zeros(5000 * 16, np.float32)}, path, chunk_bytes=64, sync="none")
    per_chunk = 1 << 20  # the most rows one table chunk may hold
    column = path / "_gpuckpt.table.crc32c"
    for f in column.glob("c.*"):
        f.unlink()
    crc = crc32c(bytes(per_chunk * 4))
    nchunks = -(-rows // per_chunk)
    for k in range(nchunks):
        with open(column / f"c.{k}", "wb") as out:
            out.truncate(per_chunk * 4)
            out.seek(per_chunk * 4)
            out.write(crc.to_bytes(4, "little"))
    document = json.loads((column / "zarr.json").read_bytes())
    document["shape"] = [rows]
    document["chunk_grid"]["configuration"]["chunk_shape"] = [per_chunk]
    (column / "zarr.json").write_text(json.dumps(document))

    def edit(md: dict[str, Any]) -> None:
        md["state_dict_metadata"]["w"]["size"] = [rows * 16]
        table = md["storage_data"]["chunk_table"]
        table["rows"], table["rows_per_chunk"] = rows, per_chunk
        table["columns"]["crc32c"]["chunk_crc32c"] = [crc] * nchunks

    rewrite_root_metadata(path, edit)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A private copy of a checkpoint to damage."""
    shutil.copytree(src, dst, symlinks=True)
    return dst
