"""Where a checkpoint lives: a path or URL to a writer and a reader.

This module is the storage layer's one door: code outside :mod:`gpuckpt.storage`
opens stores here (:func:`open_writer`, :func:`attach_writer`,
:func:`open_reader`, and :func:`open_root` for a place holding several
checkpoints) and asks here about checkpoint directories
(:func:`is_committed`, :func:`cleanup_leftovers`), never a back end directly.

Back ends are registered alike, one :class:`~gpuckpt.storage.base.Backend` per
URL scheme in :data:`BACKENDS` (which may be extended): a plain path (or
``file://`` URL) is ``file``, a directory on a local or shared POSIX file system
(:mod:`gpuckpt.storage.local`); ``s3://`` URLs go to :mod:`gpuckpt.storage.s3`;
``mem://`` names a checkpoint this process holds in memory while it is read
(:func:`in_memory`, :mod:`gpuckpt.storage.memory`).
What a back end does differently the pipelines ask through its
:class:`~gpuckpt.storage.base.Capabilities`, never through its scheme. The
registry imports the back ends it knows, never the other way round.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpuckpt.errors import InvalidPathError, UnsupportedValueError
from gpuckpt.storage.base import Backend, CheckpointReader, CheckpointRoot, CheckpointWriter
from gpuckpt.storage.local import leftovers
from gpuckpt.storage.local.reader import LocalReader
from gpuckpt.storage.local.root import LocalRoot
from gpuckpt.storage.local.writer import LocalWriter
from gpuckpt.storage.memory import SCHEME as MEMORY_SCHEME
from gpuckpt.storage.memory import memory_reader, memory_writer, published
from gpuckpt.storage.s3.root import ObjectStoreRoot
from gpuckpt.storage.s3.writer import ObjectStoreReader, ObjectStoreWriter

__all__ = [
    "BACKENDS",
    "write_rate",
    "attach_writer",
    "cleanup_dead_writers",
    "refuse_inside_a_checkpoint",
    "cleanup_leftovers",
    "in_memory",
    "is_committed",
    "open_reader",
    "open_root",
    "open_writer",
    "path_text",
    "scheme_of",
]


def _local_location(text: str) -> str:
    return text[len("file://") :] if text.startswith("file://") else text


# Each factory takes the keywords of its kind (see Backend) and ignores, through ``**_``, those
# its store has no use for.


def _local_writer(
    location: str, *, overwrite: bool, sync: str, expected_files: int, direct_io: bool, **_: Any
) -> CheckpointWriter:
    return LocalWriter(
        location, overwrite=overwrite, sync=sync, expected_files=expected_files, direct_io=direct_io
    )


def _local_reader(location: str, *, direct_io: bool, **_: Any) -> CheckpointReader:
    return LocalReader(location, direct_io=direct_io)


def _local_attach(location: str, token: str, **_: Any) -> CheckpointWriter:
    return LocalWriter.attach(location, token)


def _local_root(location: str, **_: Any) -> CheckpointRoot:
    return LocalRoot(location)


def _s3_writer(
    location: str, *, overwrite: bool, storage_options: dict[str, Any], **_: Any
) -> CheckpointWriter:
    return ObjectStoreWriter(location, overwrite=overwrite, **storage_options)


def _s3_reader(location: str, *, storage_options: dict[str, Any], **_: Any) -> CheckpointReader:
    return ObjectStoreReader(location, **storage_options)


def _s3_attach(location: str, token: str, *, storage_options: dict[str, Any]) -> CheckpointWriter:
    return ObjectStoreWriter.attach(location, token, **storage_options)


def _s3_root(location: str, *, storage_options: dict[str, Any]) -> CheckpointRoot:
    return ObjectStoreRoot(location.rstrip("/"), **storage_options)


#: file systems whose reads cross a network: a read by each of several ranks costs the servers
#: a read each (FUSE mounts are mostly object stores and cluster file systems)
NETWORK_FILE_SYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "cifs",
        "smb3",
        "smbfs",
        "ceph",
        "beegfs",
        "9p",
        "glusterfs",
        "wekafs",
        "orangefs",
        "pvfs2",
        "afs",
        "davfs",
    }
)


def file_system_type(path: str | os.PathLike[str]) -> str:
    """The type of the file system mounted where ``path`` lies (``/proc/mounts``: ``"tmpfs"``,
    ``"ext4"``, ``"nfs4"``...), or ``""`` where that cannot be told."""
    best, kind = "", ""
    text = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = text == mount or text.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:  # not Linux: no way to tell, treated as local
        return ""
    return kind


def _local_shared_reads(location: str) -> bool:
    kind = file_system_type(location)
    return kind in NETWORK_FILE_SYSTEMS or kind.startswith("fuse.")


#: URL scheme (``file`` for plain paths) -> its back end
BACKENDS: dict[str, Backend] = {
    "file": Backend(
        _local_writer,
        _local_reader,
        _local_attach,
        _local_root,
        _local_location,
        shared_reads=_local_shared_reads,
    ),
    # an object store through one client: a few hundred MB/s (see docs/compression.md)
    "s3": Backend(
        _s3_writer, _s3_reader, _s3_attach, _s3_root, write_bytes_per_s=0.25e9, shared_reads=lambda _: True
    ),
    # read-only: a restore's received files (see in_memory)
    MEMORY_SCHEME: Backend(memory_writer, memory_reader, write_bytes_per_s=10e9),
}

#: ``with in_memory(files) as url``: the checkpoint whose files (relative name to buffer) are
#: ``files``, loadable at ``url`` while the block runs (:func:`gpuckpt.storage.memory.published`)
in_memory = published


def shares_reads(path: str | os.PathLike[str]) -> bool:
    """Whether ranks reading the same bytes of ``path`` each cost its store a read (an object
    store, a network file system), rather than sharing them through one page cache: where a
    distributed load reads each shared chunk once by default."""
    backend, location = _backend(path)
    return backend.shared_reads is not None and backend.shared_reads(location)


def write_rate(path: str | os.PathLike[str]) -> float:
    """Bytes per second a save to ``path`` is assumed to write (:attr:`Backend.write_bytes_per_s`)."""
    return _backend(path)[0].write_bytes_per_s


def path_text(path: Any) -> str:
    """``path`` (a ``str`` or ``os.PathLike``) as text; raises
    :class:`~gpuckpt.errors.InvalidPathError` for anything else or an empty path.

    Examples
    --------
    >>> path_text(Path("/tmp/ckpt"))
    '/tmp/ckpt'
    """
    text = os.fspath(path) if isinstance(path, os.PathLike) else path
    if isinstance(text, str):
        if "\0" in text:  # (every system call would refuse it with a bare ValueError)
            raise InvalidPathError(f"checkpoint path {text!r} holds a NUL character, which no path can")
        if text and text != "file://":
            return text
        raise InvalidPathError(f"checkpoint path is empty ({path!r}); give the directory or URL to use")
    if isinstance(text, bytes):
        hint = "; decode it first: os.fsdecode(path)"
    elif isinstance(path, dict):
        hint = "; the state dict comes first: save(state_dict, path), load(state_dict, path)"
    else:
        hint = ""
    raise InvalidPathError(
        f"checkpoint path must be a str or os.PathLike (a directory or an s3:// URL), "
        f"found {type(path).__name__}{hint}"
    )


def scheme_of(path: str | os.PathLike[str]) -> str:
    """``"file"`` for paths, else the URL scheme (``"s3"``).

    A path whose first component is a known scheme and a colon (``s3:/bucket/x``) is an
    :class:`~gpuckpt.errors.InvalidPathError`: it is a URL with a slash missing far more often
    than a local directory named ``s3:``, which an absolute path names.
    """
    text = path_text(path)
    if "://" in text:
        scheme = text.split("://", 1)[0].lower()
        return scheme
    first, _, rest = text.partition("/")
    if first.endswith(":") and first[:-1].lower() in BACKENDS:
        scheme = first[:-1]
        if scheme.lower() == "file":
            fixed = f"{scheme}:///{rest.lstrip('/') or 'PATH'}"
        else:
            fixed = f"{scheme}://{rest.lstrip('/') or 'BUCKET/PREFIX'}"
        raise InvalidPathError(
            f"checkpoint path {text!r} looks like a URL with a slash missing (it would be a local "
            f"directory named {first!r}): write {fixed!r}, or the absolute path {os.path.abspath(text)!r} to "
            "mean that local directory"
        )
    return "file"


def _backend(path: str | os.PathLike[str]) -> tuple[Backend, str]:
    """The back end of ``path``'s scheme and the location as it names it."""
    scheme = scheme_of(path)
    try:
        backend = BACKENDS[scheme]
    except KeyError:
        others = sorted(s for s in BACKENDS if s not in ("file", MEMORY_SCHEME))  # (mem://: internal)
        raise InvalidPathError(
            f"no storage back end for {scheme}:// URLs ({path_text(path)!r}); use a local path or one of "
            f"{', '.join(others) or 'file'}"
        ) from None
    return backend, backend.location(path_text(path))


def open_writer(
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    sync: str = "auto",
    expected_files: int = 0,
    storage_options: dict[str, Any] | None = None,
    direct_io: bool = False,
) -> CheckpointWriter:
    """A writer for a new checkpoint at ``path``.

    ``direct_io``: write large chunk files around the page cache where the file
    system allows it (see :mod:`gpuckpt.storage.local.direct`); the caller decides
    (:meth:`gpuckpt.options.SaveOptions.use_direct_io`). Object stores ignore it.
    """
    backend, location = _backend(path)
    return backend.writer(
        location,
        overwrite=overwrite,
        sync=sync,
        expected_files=expected_files,
        direct_io=direct_io,
        storage_options=dict(storage_options or {}),
    )


def attach_writer(
    path: str | os.PathLike[str], token: str | None, *, storage_options: dict[str, Any] | None = None
) -> CheckpointWriter:
    """A writer of chunks into the save to ``path`` that another process began.

    ``token`` is that process's :attr:`CheckpointWriter.token`. The returned
    writer only writes chunks (:meth:`~CheckpointWriter.write_chunk` and
    :meth:`~CheckpointWriter.write_chunk_checked`); the process that began the
    save commits or aborts it.

    Raises
    ------
    UnsupportedValueError
        For a store whose writer cannot be joined by other processes (its back end has no
        ``attach``), or without a token.
    """
    if not token:
        raise UnsupportedValueError(
            f"{path_text(path)!r}: no save to join: another process's save is joined with its writer's "
            f"token (CheckpointWriter.token, after begin), got {token!r}"
        )
    backend, location = _backend(path)
    if backend.attach is None:
        raise UnsupportedValueError(
            f"{path_text(path)!r}: a save to a {scheme_of(path)}:// store is written by the one process that "
            "began it, other processes cannot join it; save from several processes to a shared file "
            "system path"
        )
    return backend.attach(location, token, storage_options=dict(storage_options or {}))


def open_reader(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None, direct_io: bool = True
) -> CheckpointReader:
    """A reader of the published checkpoint at ``path``.

    ``direct_io``: a file system may read large chunks that are not in the page cache around it
    (:meth:`gpuckpt.options.LoadOptions.reads_direct` decides); object stores ignore it."""
    backend, location = _backend(path)
    return backend.reader(location, direct_io=direct_io, storage_options=dict(storage_options or {}))


def open_root(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> CheckpointRoot:
    """The root of several checkpoints at ``path`` (a directory, created if needed, or a URL prefix)."""
    backend, location = _backend(path)
    if backend.root is None:
        roots = sorted(s for s, b in BACKENDS.items() if b.root is not None and s != "file")
        raise UnsupportedValueError(
            f"{path_text(path)!r}: {scheme_of(path)}:// stores cannot hold a root of several checkpoints "
            f"yet; use a local directory or one of {', '.join(roots)}"
        )
    return backend.root(location, storage_options=dict(storage_options or {}))


def is_committed(path: str | os.PathLike[str]) -> bool:
    """True when the directory ``path`` holds a published gpuckpt checkpoint (damaged or not).

    The identity test of :func:`gpuckpt.read_metadata`: another program's Zarr
    store is not one, nor a save's temporary, nor a symbolic link.
    """
    return leftovers.is_committed(Path(_local_location(path_text(path))))


def refuse_inside_a_checkpoint(path: str | os.PathLike[str]) -> None:
    """An :class:`~gpuckpt.errors.InvalidPathError` where the local ``path`` lies inside a published
    checkpoint (see :func:`gpuckpt.storage.local.leftovers.refuse_inside_a_checkpoint`); URLs pass."""
    if scheme_of(path) == "file":
        leftovers.refuse_inside_a_checkpoint(Path(_local_location(path_text(path))))


def cleanup_dead_writers(path: str | os.PathLike[str]) -> list[Path]:
    """Remove what dead writers to the local ``path`` left beside it (the cleanup a save to it
    runs first: a conversion's temporary files and directories too); returns what was removed."""
    return leftovers.cleanup_stale_temporaries(Path(_local_location(path_text(path))))


def cleanup_leftovers(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove what dead saves left in ``directory`` beside its checkpoints; returns what was removed.

    For every checkpoint name with a save's temporary or set-aside copy there,
    the cleanup a new save to it runs first (a checkpoint an interrupted
    overwrite set aside is put back, never lost; live saves' temporaries are
    never touched): see :mod:`gpuckpt.storage.local.leftovers`.
    """
    return leftovers.cleanup_directory(Path(_local_location(path_text(directory))))
