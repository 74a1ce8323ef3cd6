"""The keyword arguments of DCP's ``FileSystemWriter`` and ``FileSystemReader``, taken by
:class:`~gpuckpt.dcp.Writer` and :class:`~gpuckpt.dcp.Reader`, so that a DCP program that
builds its storage with them runs with the class name changed and nothing else.

Each one means what it means to DCP where gpuckpt has the same thing, or has no effect
where it names a choice of DCP's own file layout:

======================================  ===========================================
``FileSystemWriter``                    ``gpuckpt.dcp.Writer``
======================================  ===========================================
``thread_count=N``                      ``threads=N``
``sync_files=True`` / ``False``         ``sync="auto"`` (or another durable mode) /
                                        ``sync="none"``
``_extensions=[ZStandard()]``           ``compression="zstd"`` (Zarr's ``blosc``:
                                        byte shuffle, then zstd; other extensions
                                        are refused)
``single_file_per_rank``,               no effect: a gpuckpt checkpoint stores one
``per_thread_copy_ahead``               file per chunk, and reads ahead itself
``cache_staged_state_dict``             no effect: the Writer stages nothing
                                        (``gpuckpt.dcp.Stager`` does)
``serialization_format``                only DCP's default (``TORCH_SAVE``): the
                                        chunks are Zarr's either way; another
                                        format is refused
``FileSystemReader(_extension_registry``  no effect: gpuckpt's codecs are Zarr's
======================================  ===========================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuckpt.errors import InvalidOptionError

__all__ = ["writer_arguments"]


def writer_arguments(
    *,
    threads: int | None,
    sync: str,
    compression: str | dict[str, Any] | None,
    thread_count: int | None,
    sync_files: bool | None,
    extensions: Sequence[Any] | None,
    serialization_format: Any,
) -> tuple[int | None, str, str | dict[str, Any] | None]:
    """``(threads, sync, compression)`` of a Writer given both its own arguments and DCP's
    ``FileSystemWriter`` ones (None: not given). Raises :class:`InvalidOptionError` where the
    two disagree or DCP's names something gpuckpt does not do."""
    if thread_count is not None:
        if threads is not None and threads != thread_count:
            raise InvalidOptionError(
                f"thread_count={thread_count!r} and threads={threads!r} name the same thing "
                "(FileSystemWriter's and gpuckpt's names for the I/O threads): pass one"
            )
        threads = thread_count
    if sync_files is not None:
        if not isinstance(sync_files, bool):
            raise InvalidOptionError(f"sync_files must be True or False, got {sync_files!r}")
        if (sync_files and sync == "none") or (not sync_files and sync not in ("auto", "none")):
            raise InvalidOptionError(
                f"sync_files={sync_files!r} and sync={sync!r} disagree (sync_files=True is any "
                'durable mode, "auto" by default; False is sync="none"): pass one'
            )
        if not sync_files:
            sync = "none"
    if extensions is not None and not isinstance(extensions, (list, tuple)):
        raise InvalidOptionError(
            f"_extensions must be a list of DCP stream extensions (as FileSystemWriter takes), got "
            f"{type(extensions).__name__}; for zstd compression pass compression='zstd'"
        )
    if extensions:
        names = [type(e).__name__ for e in extensions]
        if not (len(extensions) == 1 and _is_zstandard(extensions[0])):
            raise InvalidOptionError(
                f"gpuckpt.dcp.Writer stores chunks with Zarr codecs, not DCP stream extensions "
                f"({', '.join(names)}): for zstd compression pass compression='zstd' (or "
                "_extensions=[ZStandard()] alone); see docs/compression.md"
            )
        if compression not in (None, "zstd"):
            raise InvalidOptionError(
                f"_extensions=[ZStandard()] asks for zstd and compression={compression!r} for another "
                "codec: pass one"
            )
        compression = "zstd"
    if serialization_format is not None and getattr(serialization_format, "name", None) != "TORCH_SAVE":
        raise InvalidOptionError(
            f"serialization_format={serialization_format!r}: a gpuckpt checkpoint stores Zarr arrays "
            "whatever DCP's format; leave it at its default, and export safetensors files with "
            "`gpuckpt convert --to safetensors` (or `--to hf`)"
        )
    return threads, sync, compression


def _is_zstandard(extension: Any) -> bool:
    """Whether ``extension`` is DCP's ``ZStandard`` stream extension (torch 2.6 and later)."""
    try:
        from torch.distributed.checkpoint._extension import ZStandard
    except ImportError:  # a torch without DCP's extensions: nothing is one
        return False
    return isinstance(extension, ZStandard)
