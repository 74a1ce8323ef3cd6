"""Where a checkpoint lives: a path or URL to a writer and a reader.

A plain path (or ``file://`` URL) is a directory on a local or shared POSIX
file system (:mod:`gpuckpt.storage.local`). Other URL schemes are looked up
in :data:`SCHEMES`, which object-storage back ends extend (``s3://`` in
:mod:`gpuckpt.storage.s3`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from gpuckpt.storage.base import CheckpointReader, CheckpointWriter
from gpuckpt.storage.local import LocalReader, LocalWriter

__all__ = ["SCHEMES", "open_reader", "open_writer", "scheme_of"]

#: scheme -> (writer factory, reader factory); factories take (url, **options).
SCHEMES: dict[str, tuple[Callable[..., CheckpointWriter], Callable[..., CheckpointReader]]] = {}


def scheme_of(path: str | os.PathLike[str]) -> str:
    """``"file"`` for paths, else the URL scheme (``"s3"``)."""
    text = os.fspath(path)
    if "://" in text:
        scheme = text.split("://", 1)[0].lower()
        return scheme
    return "file"


def _local_path(path: str | os.PathLike[str]) -> str:
    text = os.fspath(path)
    return text[len("file://") :] if text.startswith("file://") else text


_Factories = tuple[Callable[..., CheckpointWriter], Callable[..., CheckpointReader]]


def _lookup(path: str | os.PathLike[str]) -> _Factories:
    scheme = scheme_of(path)
    if scheme not in SCHEMES and scheme == "s3":
        import gpuckpt.storage.s3  # noqa: F401 - registers "s3"
    try:
        return SCHEMES[scheme]
    except KeyError:
        raise ValueError(
            f"no storage back end for {scheme}:// URLs ({os.fspath(path)!r}); use a local path or one of "
            f"{', '.join(sorted(SCHEMES)) or 'file'}"
        ) from None


def open_writer(
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    sync: str = "auto",
    expected_files: int = 0,
    storage_options: dict[str, Any] | None = None,
    direct_io: bool = False,
) -> CheckpointWriter:
    """A writer for a new checkpoint at ``path`` (``direct_io``: see :mod:`gpuckpt.storage.local`)."""
    if scheme_of(path) == "file":
        return LocalWriter(
            _local_path(path),
            overwrite=overwrite,
            sync=sync,
            expected_files=expected_files,
            direct_io=direct_io,
        )
    writer, _ = _lookup(path)
    return writer(os.fspath(path), overwrite=overwrite, **(storage_options or {}))


def open_reader(
    path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> CheckpointReader:
    """A reader of the published checkpoint at ``path``."""
    if scheme_of(path) == "file":
        return LocalReader(_local_path(path))
    _, reader = _lookup(path)
    return reader(os.fspath(path), **(storage_options or {}))
