"""Opening a checkpoint: the one way every reader of a checkpoint begins.

:func:`open_checkpoint` opens the store at a path or URL, reads the root
document (size-capped, its checksum checked), parses its metadata with the
one reader (:func:`gpuckpt.format.reader.read_index`) and checks the files
of its chunk table, if it has one, against what the document says of them.
Loads, :func:`gpuckpt.read_metadata`, verify, inspect, the base of an
incremental save and the DCP layer all open a checkpoint here, and say
where it is in their errors the same way (``PATH/zarr.json``).

Parsing and checking the metadata of 10,000 tensors takes longer than
reading their chunks, so the index of the last few root documents opened
with ``shared=True`` is kept, keyed by a 256-bit BLAKE2b digest of the
document's bytes: the same bytes always give the same index, and no one can
make other bytes with the same digest. A shared index is never changed by
anyone (loads only read it); a caller that hands metadata to a user opens
with ``shared=False`` and gets an index of its own.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuckpt.format.documents import ROOT_KEY, metadata_json
from gpuckpt.format.reader import CheckpointIndex, read_index
from gpuckpt.options import LoadOptions
from gpuckpt.storage.base import CheckpointReader
from gpuckpt.storage.stores import open_reader

__all__ = ["OpenCheckpoint", "index_of_root", "open_checkpoint"]


@dataclass(frozen=True, slots=True)
class OpenCheckpoint:
    """A published checkpoint: where it is, the reader of its store, and its checked index."""

    location: str
    reader: CheckpointReader
    index: CheckpointIndex

    @property
    def where(self) -> str:
        """The root document's path, as errors name it."""
        return f"{self.location.rstrip('/')}/{ROOT_KEY}"


def open_checkpoint(
    path: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    shared: bool = True,
    direct_io: bool | None = None,
) -> OpenCheckpoint:
    """Open the checkpoint at ``path`` (a directory or a URL, with ``storage_options`` for its
    store) and check its root document and chunk table; nothing else is read.

    ``shared``: the index may come from (and goes to) the per-process cache of recent root
    documents (see the module docstring); its objects must then not be changed.
    ``direct_io``: whether a file system reads large cold chunks around the page cache
    (:meth:`~gpuckpt.options.LoadOptions.reads_direct`; None: the default load options').

    Raises
    ------
    CheckpointNotFoundError
        When ``path`` holds no published checkpoint.
    MetadataError
        When its root document or chunk table is damaged or not gpuckpt's (a newer format:
        :class:`~gpuckpt.errors.UnsupportedVersionError`).
    """
    # the store first: it refuses a path of the wrong type or an unknown scheme, saying which
    direct = LoadOptions().reads_direct() if direct_io is None else direct_io
    reader = open_reader(
        path, storage_options=dict(storage_options) if storage_options is not None else None, direct_io=direct
    )
    location = os.fspath(path)
    root = reader.read_root()
    where = f"{location.rstrip('/')}/{ROOT_KEY}"
    index = index_of_root(root, where) if shared else read_index(metadata_json(root, where))
    table = next((t.table for t in index.tensors.values() if t.table is not None), None)
    if table is not None:
        # a chunk table's row count is believed only as far as its files hold them
        table.check_files(reader)
    return OpenCheckpoint(location, reader, index)


#: indexes of root documents kept per process (see the module docstring)
_KEEP = 2
_indexes: collections.OrderedDict[bytes, CheckpointIndex] = collections.OrderedDict()
_indexes_lock = threading.Lock()


def index_of_root(root: bytes | bytearray, where: str) -> CheckpointIndex:
    """The index of the root document ``root`` (named ``where`` in errors), parsed once per
    document and shared (see the module docstring)."""
    key = hashlib.blake2b(root, digest_size=32).digest()
    with _indexes_lock:
        hit = _indexes.get(key)
        if hit is not None:
            _indexes.move_to_end(key)
            return hit
    index = read_index(metadata_json(root, where))
    with _indexes_lock:
        _indexes[key] = index
        while len(_indexes) > _KEEP:
            _indexes.popitem(last=False)
    return index


def clear_shared_indexes() -> None:
    """Forget the shared indexes (tests that parse the same document again)."""
    with _indexes_lock:
        _indexes.clear()
