"""Loads from a Hugging Face safetensors directory (index plus shards, or one file).

``gpuckpt.load`` and ``gpuckpt.load_state_dict`` read a directory that holds
``model.safetensors.index.json`` (or ``model.safetensors``), or one
``.safetensors`` file, through this adapter instead of
:func:`~gpuckpt.loading.open.open_checkpoint`: such a directory has no gpuckpt
metadata and no checksums, so what can be checked is its structure
(:mod:`gpuckpt.format.safetensors`). Only the shards that hold the requested
keys are opened; each tensor is read with ``pread`` straight into its target,
in pieces spread over the load's threads.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpuckpt.device.arrays import adapt, is_array
from gpuckpt.errors import (
    DTypeMismatchError,
    MetadataError,
    MissingChunkError,
    MissingKeyError,
    ShapeMismatchError,
    UnsupportedValueError,
)
from gpuckpt.format.safetensors import (
    INDEX_NAME,
    MAX_HEADER,
    MAX_INDEX,
    SAFETENSORS_DTYPES,
    SINGLE_NAME,
    check_bool_bytes,
    parse_header,
    parse_index,
)
from gpuckpt.loading.targets import check_writable_target
from gpuckpt.options import LoadOptions
from gpuckpt.progress import ProgressCounter
from gpuckpt.runtime.runner import run_all
from gpuckpt.state import flatten_state_dict, select_fqns
from gpuckpt.storage.local.fileio import read_exact_at

__all__ = [
    "HfSource",
    "ShardHeader",
    "is_hf_source",
    "load_hf",
    "load_hf_state_dict",
    "open_hf",
    "read_header",
]

#: a tensor is read in pieces of at most this many bytes, so that large ones use every thread
PIECE_BYTES = 64 * 2**20


@dataclass(frozen=True, slots=True)
class ShardHeader:
    """One safetensors file, its header checked: ``entries`` by name, data from ``data_start``."""

    path: Path
    entries: dict[str, Any]
    metadata: dict[str, str]
    data_start: int
    size: int

    def place(self, name: str) -> tuple[np.dtype[Any], tuple[int, ...], int, int]:
        """``(dtype, shape, file offset, nbytes)`` of tensor ``name``."""
        e = self.entries[name]
        begin, end = e["data_offsets"]
        return SAFETENSORS_DTYPES[e["dtype"]], tuple(e["shape"]), self.data_start + begin, end - begin


def _open_regular(path: Path, what: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise MissingChunkError(
            f"{path}: the {what} is missing; the directory is incomplete: copy or export it again"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise MetadataError(f"{path}: the {what} is not a regular file")
    return fd


def read_header(path: str | os.PathLike[str]) -> ShardHeader:
    """Read and check the header of the safetensors file at ``path``.

    Raises
    ------
    MissingChunkError
        When the file does not exist.
    MetadataError
        When it is not a regular file, not safetensors, or its header does not match its size.
    """
    path = Path(path)
    fd = _open_regular(path, "safetensors file")
    try:
        size = os.fstat(fd).st_size
        head = bytearray(8)
        got = read_exact_at(fd, head, 0)
        if got < 8:
            raise MetadataError(f"{path} is not a safetensors file: {got} bytes, the header length needs 8")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or n > size - 8:
            raise MetadataError(
                f"{path} is not a safetensors file (or is truncated): header length {n}, "
                f"the file holds {size - 8} bytes after the length and the format allows {MAX_HEADER}"
            )
        raw = bytearray(n)
        read_exact_at(fd, raw, 8)
    finally:
        os.close(fd)
    entries, meta = parse_header(bytes(raw), size - 8 - n, os.fspath(path))
    return ShardHeader(path, entries, meta, 8 + n, size)


@dataclass(slots=True)
class HfSource:
    """A Hugging Face directory or safetensors file: which file holds each tensor.

    ``weight_map`` maps every tensor name to its file; headers are read when a file is
    first needed (:meth:`header`) and checked against the index.
    """

    location: Path
    weight_map: dict[str, Path]
    index_meta: dict[str, Any]
    _headers: dict[Path, ShardHeader] = field(default_factory=dict)
    #: the names the index puts in each file (made at the first header read: one pass, not one per file)
    _listed: dict[Path, list[str]] | None = None

    @property
    def names(self) -> list[str]:
        return list(self.weight_map)

    def header(self, name: str) -> ShardHeader:
        """The checked header of the file holding tensor ``name``."""
        path = self.weight_map[name]
        h = self._headers.get(path)
        if h is None:
            h = read_header(path)
            if self._listed is None:
                self._listed = {}
                for n, p in self.weight_map.items():
                    self._listed.setdefault(p, []).append(n)
            absent = [n for n in self._listed[path] if n not in h.entries]
            if absent:
                raise MetadataError(
                    f"{self.location / INDEX_NAME}: puts {len(absent)} tensor(s) in {path.name} that "
                    f"it does not hold ({', '.join(repr(a) for a in absent[:5])}); the index and the "
                    "shards are from different exports: export the directory again"
                )
            self._headers[path] = h
        return h


def is_hf_source(path: Any) -> bool:
    """Whether ``path`` is a local Hugging Face directory (an index or ``model.safetensors``, no
    gpuckpt ``zarr.json``) or a file named ``*.safetensors``."""
    if not isinstance(path, (str, os.PathLike)) or "://" in os.fspath(path):
        return False
    p = Path(path)
    try:
        if p.is_dir():
            return not (p / "zarr.json").exists() and (
                (p / INDEX_NAME).is_file() or (p / SINGLE_NAME).is_file()
            )
        return p.suffix == ".safetensors" and p.is_file()
    except (OSError, ValueError):  # a name too long, a NUL: not one; the checkpoint's open says why
        return False


def open_hf(path: str | os.PathLike[str]) -> HfSource:
    """Open a Hugging Face directory or safetensors file: its index (or its one header).

    Raises
    ------
    MetadataError
        For an index that is not JSON or names files outside its directory.
    MissingChunkError
        For a missing file.
    """
    p = Path(path)
    if not p.is_dir():
        h = read_header(p)
        src = HfSource(p, dict.fromkeys(h.entries, p), {})
        src._headers[p] = h
        return src
    index = p / INDEX_NAME
    if not index.is_file():
        return open_hf(p / SINGLE_NAME)
    fd = _open_regular(index, "index")
    try:
        size = os.fstat(fd).st_size
        if size > MAX_INDEX:
            raise MetadataError(f"{index}: {size} bytes is more than an index may hold ({MAX_INDEX})")
        raw = bytearray(size)
        read_exact_at(fd, raw, 0)
    finally:
        os.close(fd)
    wmap, meta = parse_index(raw, os.fspath(index))  # parsed where it was read: no copy
    return HfSource(p, {name: p / shard for name, shard in wmap.items()}, meta)


def _read_all(src: HfSource, items: list[tuple[str, np.ndarray]], options: LoadOptions) -> None:
    """Read every ``(name, C-contiguous destination)``, each in pieces of :data:`PIECE_BYTES`."""
    counter = ProgressCounter(options.progress, sum(d.nbytes for _, d in items))
    fds: dict[Path, int] = {}
    jobs: list[Callable[[], None]] = []

    def job(fd: int, piece: np.ndarray, at: int, name: str) -> None:
        got = read_exact_at(fd, piece, at)
        if got != piece.nbytes:
            raise MetadataError(
                f"{src.weight_map[name]}: tensor {name!r} is truncated ({got} of {piece.nbytes} bytes at "
                f"offset {at}); the file changed while it was read: export it again"
            )
        counter.add(got)

    try:
        for name, dest in items:
            h = src.header(name)
            _, _, offset, nbytes = h.place(name)
            fd = fds.get(h.path)
            if fd is None:
                fd = fds[h.path] = _open_regular(h.path, "safetensors file")
            flat = dest.reshape(-1).view(np.uint8)
            for start in range(0, nbytes, PIECE_BYTES):
                jobs.append(
                    functools.partial(job, fd, flat[start : start + PIECE_BYTES], offset + start, name)
                )
        run_all(jobs, threads=options.threads, name="gpuckpt-hf-read")
        for name, dest in items:
            check_bool_bytes(dest, f"{src.weight_map[name]}: tensor {name!r}")
    finally:
        for fd in fds.values():
            os.close(fd)


def _new_array(src: HfSource, name: str) -> np.ndarray:
    dt, shape, _, _ = src.header(name).place(name)
    return np.empty(shape, dtype=dt)


def load_hf_state_dict(
    path: str | os.PathLike[str], keys: list[str] | str | None, options: LoadOptions
) -> dict[str, Any]:
    """The tensors of ``path`` selected by ``keys`` (names or ``.``-prefixes) as a flat dict by
    name, new NumPy arrays; only the files that hold them are read."""
    src = open_hf(path)
    chosen = select_fqns(src.names, keys)
    out = {name: _new_array(src, name) for name in chosen}
    _read_all(src, list(out.items()), options)
    return out


def load_hf(state_dict: dict[str, Any], path: str | os.PathLike[str], options: LoadOptions) -> None:
    """Fill ``state_dict`` (nested dicts of arrays, keyed like the file's names once flattened) in
    place from ``path``; a leaf that is not an array gets a new NumPy array."""
    src = open_hf(path)
    leaves, _ = flatten_state_dict(state_dict, is_array)
    missing = [f for f in leaves if f not in src.weight_map]
    if missing and options.strict:
        raise MissingKeyError(
            f"{len(missing)} key(s) of the state dict are not in {path}: "
            f"{', '.join(repr(m) for m in missing[:10])}{' ...' if len(missing) > 10 else ''}; "
            "pass strict=False to load the others"
        )
    direct: list[tuple[str, np.ndarray]] = []
    copies: list[tuple[np.ndarray, np.ndarray]] = []
    fresh: list[tuple[Any, np.ndarray]] = []
    for fqn, leaf in leaves.items():
        if fqn not in src.weight_map:
            continue
        dt, shape, _, _ = src.header(fqn).place(fqn)
        if not is_array(leaf.value):
            arr = np.empty(shape, dtype=dt)
            direct.append((fqn, arr))
            fresh.append((leaf, arr))
            continue
        target = adapt(leaf.value)
        if target.shape != shape:
            raise ShapeMismatchError(
                f"tensor {fqn!r}: {path} has shape {shape}, the target has {target.shape}"
            )
        if target.dtype.newbyteorder("=") != dt:
            raise DTypeMismatchError(
                f"tensor {fqn!r}: {path} has dtype {dt}, the target has {target.dtype}; load into an "
                "array of the stored dtype and convert afterwards"
            )
        if target.backend is not None:
            raise UnsupportedValueError(
                f"tensor {fqn!r}: loads from a safetensors directory fill host arrays; load with "
                "gpuckpt.load_state_dict and copy to the device"
            )
        check_writable_target(fqn, target, "the target")  # (before anything is read into any target)
        host = target.host_array()
        if host.flags.c_contiguous and host.dtype == dt and dt != np.bool_:
            direct.append((fqn, host))
        else:  # another layout or byte order: read as stored, then copied (and swapped) in;
            # a bool read aside too, so that a target is never left holding bytes other than 0/1
            tmp = np.empty(shape, dtype=dt)
            direct.append((fqn, tmp))
            copies.append((host, tmp))
    _read_all(src, direct, options)
    for host, tmp in copies:
        host[...] = tmp
    for leaf, arr in fresh:
        leaf.replace(arr)
