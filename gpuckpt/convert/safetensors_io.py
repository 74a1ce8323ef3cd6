"""Reading and writing safetensors files with NumPy alone.

What the bytes mean (the header, its validation) is :mod:`gpuckpt.format.safetensors`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from gpuckpt.errors import (
    CheckpointExistsError,
    CheckpointWriteError,
    GpuckptError,
    MetadataError,
    UnsupportedValueError,
)
from gpuckpt.format.dtypes import dtype_name
from gpuckpt.format.safetensors import (
    MAX_HEADER,
    METADATA_KEY,
    SAFETENSORS_DTYPES,
    check_bool_bytes,
    parse_header,
)
from gpuckpt.progress import ProgressCallback, ProgressCounter
from gpuckpt.storage.local import fsutil
from gpuckpt.storage.local.fileio import read_exact, write_all
from gpuckpt.storage.stores import cleanup_dead_writers

__all__ = [
    "METADATA_KEY",
    "SAFETENSORS_DTYPES",
    "is_safetensors",
    "open_source",
    "read_safetensors",
    "read_safetensors_header",
    "write_safetensors",
]

_CODE_OF = {dt: code for code, dt in SAFETENSORS_DTYPES.items()}
_MAX_HEADER = MAX_HEADER


def open_source(path: str | os.PathLike[str], what: str = "source") -> BinaryIO:
    """``path`` opened for reading, refused unless it is a regular file (a FIFO, a device such as
    ``/dev/zero`` behind a symlink, or a directory would block or never end):
    :class:`~gpuckpt.errors.UnsupportedValueError`. ``O_NONBLOCK``: opening a FIFO cannot block."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsupportedValueError(
                f"{os.fspath(path)}: the {what} is not a regular file ({_kind(mode)}); pass a file"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def is_safetensors(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` has the structure of a safetensors file.

    Its first 8 bytes (little-endian) give a header length ``N`` of at least
    2 that fits in the file and in the format's limit, and the ``N`` bytes
    after them, starting with ``{``, parse as a JSON object. The first byte
    alone says nothing: a header length of 128 mod 256 starts the file with
    0x80, as a pickle starts. Tensor entries are validated when the file is
    read (:func:`read_safetensors_header`).
    """
    with open_source(path) as f:
        head = f.read(8)
        if len(head) < 8:
            return False
        n = int.from_bytes(head, "little")
        if not 2 <= n <= min(_MAX_HEADER, os.fstat(f.fileno()).st_size - 8):
            return False
        if f.read(1) != b"{":
            return False
        f.seek(8)
        raw = f.read(n)  # one buffer: a header near the cap is not copied once more
    if len(raw) < n:
        return False
    try:
        return isinstance(json.loads(raw), dict)
    except (ValueError, RecursionError):
        return False


def read_safetensors_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, str], int]:
    """Parse and validate the header: ``(entries, metadata, data_start)``."""
    path = Path(path)
    with open_source(path) as f:
        head = f.read(8)
        if len(head) < 8:
            raise MetadataError(
                f"{path} is not a safetensors file: {len(head)} bytes, the header length needs 8"
            )
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER:
            raise MetadataError(f"{path} is not a safetensors file: header length {n} exceeds {_MAX_HEADER}")
        raw = f.read(n)
        size = os.fstat(f.fileno()).st_size
    if len(raw) < n:
        raise MetadataError(f"{path}: header of {n} bytes is truncated to {len(raw)}")
    header, meta = parse_header(raw, size - 8 - n, os.fspath(path))
    return header, meta, 8 + n


def read_safetensors(
    path: str | os.PathLike[str], *, progress: ProgressCallback | None = None
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors of a safetensors file (new arrays, in file order) and its ``__metadata__``.

    Examples
    --------
    >>> import numpy as np, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> write_safetensors({"w": np.arange(3, dtype=np.float32)}, p)
    >>> read_safetensors(p)[0]["w"]
    array([0., 1., 2.], dtype=float32)
    """
    header, meta, start = read_safetensors_header(path)
    order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    counter = ProgressCounter(
        progress, sum(header[k]["data_offsets"][1] - header[k]["data_offsets"][0] for k in order)
    )
    out: dict[str, np.ndarray] = {}
    source = open_source(path)
    fd = source.fileno()
    try:
        for name in order:
            e = header[name]
            dt = SAFETENSORS_DTYPES[e["dtype"]]
            arr = np.empty(e["shape"], dtype=dt.newbyteorder("<"))
            os.lseek(fd, start + e["data_offsets"][0], os.SEEK_SET)
            got = read_exact(fd, arr.reshape(-1).view(np.uint8))
            if got != arr.nbytes:
                raise MetadataError(f"{path}: tensor {name!r} is truncated ({got} of {arr.nbytes} bytes)")
            check_bool_bytes(arr, f"{path}: tensor {name!r}")
            out[name] = arr.astype(dt, copy=False)
            counter.add(arr.nbytes)
    finally:
        source.close()
    return out, meta


def check_tensor_name(name: str) -> None:
    """Refuse a tensor name the safetensors header cannot hold (``__metadata__``, or one that is
    not Unicode text: gpuckpt keeps a lone surrogate, as ``os.fsdecode`` makes of a file name's
    undecodable bytes, but a safetensors header is UTF-8 JSON, which cannot say it)."""
    if not name.isascii():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UnsupportedValueError(
                f"tensor {name!r} cannot be stored in safetensors: its name holds the lone surrogate "
                f"{name[exc.start]!r} at position {exc.start}, which the UTF-8 of a safetensors header "
                "cannot encode (the reference reader refuses such a file); rename the tensor or keep "
                "the gpuckpt format"
            ) from None
    if name == METADATA_KEY:
        raise UnsupportedValueError(
            f"tensor {name!r} cannot be stored in safetensors: the format reserves the header key "
            f"{METADATA_KEY!r} for string metadata, and a tensor of that name makes a file no reader "
            "accepts; rename the tensor (e.g. state['metadata'] = state.pop('__metadata__')) or keep "
            "the gpuckpt format"
        )


def safetensors_code(dtype: Any, name: str = "") -> str:
    """The safetensors dtype code of ``dtype``; raises for dtypes the format lacks."""
    dt = np.dtype(dtype)
    dt = dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt
    code = _CODE_OF.get(dt)
    if code is None:
        raise UnsupportedValueError(
            f"tensor {name!r} has dtype {dtype_name(dt)}, which safetensors cannot store "
            f"(it has {', '.join(SAFETENSORS_DTYPES)}); convert the tensor first or keep the gpuckpt format"
        )
    return code


@contextlib.contextmanager
def output_errors(dst: Path) -> Iterator[None]:
    """A system call that fails while a conversion writes ``dst`` (disk full, permissions, an I/O
    error) as the :class:`~gpuckpt.errors.CheckpointWriteError` a save raises: its errno, the
    output, that nothing was published, and what to do. gpuckpt's own errors pass as they are."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, GpuckptError):
            raise
        code, text = fsutil.failure_errno(exc)
        raise CheckpointWriteError(
            code,
            f"writing {dst} failed ({text}"
            f"{f': {exc.filename}' if exc.filename else ''}); nothing was published (an earlier "
            f"{dst.name}, if any, is intact): {fsutil.failure_hint(exc)}",
        ) from exc


def write_safetensors(
    tensors: Mapping[str, np.ndarray],
    path: str | os.PathLike[str],
    *,
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    progress: ProgressCallback | None = None,
) -> None:
    """Write ``tensors`` to a safetensors file atomically (temporary file, fsync, rename).

    Tensors are laid out by decreasing element size, then name, so every one
    is aligned to its element size; the header is padded with spaces to a
    multiple of 8 bytes, as the reference implementation does.
    """
    path = Path(path)
    for name in tensors:
        check_tensor_name(name)
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise CheckpointExistsError(f"{path} already exists; pass overwrite=True (--overwrite) to replace it")
    items = sorted(tensors.items(), key=lambda kv: (-np.dtype(kv[1].dtype).itemsize, kv[0]))
    header: dict[str, Any] = {}
    if metadata:
        header[METADATA_KEY] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, arr in items:
        n = arr.size * arr.dtype.itemsize
        header[name] = {
            "dtype": safetensors_code(arr.dtype, name),
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    counter = ProgressCounter(progress, offset)
    with published_file(path, overwrite) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_all(fd, len(raw).to_bytes(8, "little"))
            write_all(fd, raw)
            for _name, arr in items:
                data = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
                write_all(fd, data.reshape(-1).view(np.uint8))
                counter.add(data.nbytes)
            os.fsync(fd)
        finally:
            os.close(fd)


def temporary_name(path: Path) -> Path:
    """The temporary a conversion writes ``path`` as, beside it, named for this process (so that
    the next conversion to ``path`` removes it once this process is dead:
    :func:`~gpuckpt.storage.stores.cleanup_dead_writers`)."""
    return (
        path.parent
        / f"{fsutil.side_prefix(path.name, '.gpuckpt-tmp-')}{fsutil.tmp_owner()}-{secrets.token_hex(4)}"
    )


@contextlib.contextmanager
def published_file(path: Path, overwrite: bool) -> Iterator[Path]:
    """The temporary to write (and fsync) ``path`` as in the block, published at ``path`` once it
    ends (replacing a file there only with ``overwrite``) and removed if it raises; what dead
    conversions to ``path`` left is removed first, and the file system's errors are those of
    :func:`output_errors`."""
    with output_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        cleanup_dead_writers(path)
        tmp = temporary_name(path)
        try:
            yield tmp
            if overwrite:
                os.replace(tmp, path)
            else:
                fsutil.rename_noreplace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsutil.fsync_dir(path.parent)
