"""``gpuckpt.dcp.Writer``: a torch.distributed.checkpoint StorageWriter that writes gpuckpt checkpoints."""

from __future__ import annotations

import dataclasses
import os
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata as DcpMetadata
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import SavePlan as DcpSavePlan
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

import gpuckpt.dcp.bridge as bridge
import gpuckpt.dcp.convert as convert
from gpuckpt.dcp.fs_arguments import writer_arguments
from gpuckpt.dcp.tensors import DCP_VERSION, torch
from gpuckpt.distributed.save import agreed_settings, check_agreement
from gpuckpt.errors import GpuckptError, UnsupportedValueError
from gpuckpt.format import memory_format as mf
from gpuckpt.options import DEFAULT_CHUNK_BYTES, DEFAULT_STAGING_BYTES, SaveOptions
from gpuckpt.progress import ProgressCallback
from gpuckpt.storage.stores import path_text

__all__ = ["Writer"]


@dataclass(frozen=True, slots=True)
class _RankPlan:
    """What the coordinator tells one rank (``SavePlan.storage_data``): where to write which chunks."""

    path: str
    token: str
    chunks: tuple[bridge.ChunkAssignment, ...]
    boxes: dict[str, tuple[tuple[int, ...], ...]]  # fqn -> offsets of each box, by box index
    reusable: tuple[str, ...] | None = None  # incremental saves: arrays the base can serve
    layout: bridge.TableLayout | None = None  # the chunk table in blocks: each rank stores its rows


@dataclass(frozen=True, slots=True)
class _Written:
    """A rank's report on one write item (``WriteResult.storage_data``).

    Where the save's chunk table is in blocks, the rank stored its own rows and reports them
    once, in its first tensor item's ``block`` (the checksums of what it stored, and its
    rows of the table's tail); its items then carry no ``chunks``."""

    chunks: tuple[tuple[tuple[str, tuple[int, ...]], bridge.Written], ...] = ()
    memory_format: str | None = None
    blob: bytes | None = None
    rows: tuple[int, ...] = ()  # of ``chunks`` in the save's chunk table
    block: bridge.BlockReport | None = None


class Writer(StorageWriter):  # type: ignore[misc,unused-ignore]
    """Writes a gpuckpt checkpoint under ``torch.distributed.checkpoint.save``.

    The checkpoint is the one :func:`gpuckpt.save` writes: one Zarr v3 array
    per tensor, a CRC32C per chunk, JSON metadata (never a pickle), published
    by one atomic rename only in :meth:`finish`, on the coordinator, after
    every rank has written. If any rank fails, nothing is published (the
    temporary is removed when this Writer is reset, used for the next save,
    or garbage-collected).

    DCP's planner decides what each rank writes (a tensor, or each rank's box
    of a DTensor; replicated items once); each box is stored as Zarr chunks
    the way :class:`gpuckpt.ShardedArray` boxes are (a regular grid where the
    boxes allow, rectilinear or, with ``portable=True``, regular otherwise;
    large boxes split to ``chunk_bytes``). Tensors go through gpuckpt's
    pipeline as given (CPU or CUDA, views, non-contiguous): device tensors
    stream through bounded page-locked staging memory.

    DCP's non-tensor items (bytes DCP serialised with ``torch.save``) are stored
    as opaque ``bytes`` values: :func:`gpuckpt.load_state_dict` returns them as
    those bytes and never unpickles them; :class:`gpuckpt.dcp.Reader` hands
    them back to DCP.

    Parameters
    ----------
    path
        Checkpoint directory (or ``s3://`` URL: single-process saves only).
        DCP's ``checkpoint_id`` replaces it for one save.
    overwrite, chunk_bytes, sync, threads, progress, staging_bytes, storage_options, portable, base,
    content_hash, compression
        As for :func:`gpuckpt.save`: with ``base`` (an earlier checkpoint), chunks
        equal to the base's are shared with it instead of written (each rank
        decides for the chunks it writes); ``compression="auto"`` samples no tensor
        here: it compresses the large floating-point ones where the store is slow
        (see docs/compression.md).
    thread_count, sync_files, single_file_per_rank, per_thread_copy_ahead, cache_staged_state_dict,
    _extensions, serialization_format
        DCP's ``FileSystemWriter`` arguments, so that a program that builds one runs with
        the class name changed: ``thread_count`` is ``threads``, ``sync_files=False`` is
        ``sync="none"``, ``_extensions=[ZStandard()]`` is ``compression="zstd"``; the
        others name choices of DCP's own files and have no effect
        (:mod:`gpuckpt.dcp.fs_arguments`).

    ``overwrite`` is True by default, as for DCP's ``FileSystemWriter``, so that a
    DCP program runs unchanged: a checkpoint already at the path is replaced
    atomically (on object storage, where that cannot be atomic, it is refused);
    an empty directory (``tempfile.mkdtemp()``) is saved into; a directory that
    holds other files gets the checkpoint's own names beside them, a clash of
    names refused and nothing else touched (see :mod:`gpuckpt.storage.local.shared_dir`).
    With ``overwrite=False`` an existing checkpoint fails the save with
    :class:`~gpuckpt.errors.CheckpointExistsError` beginning ``Checkpoint already
    exists``, as DCP's own writers say it.

    A Writer serves one save at a time; with ``dcp.async_save``, make one per call.

    Examples
    --------
    ::

        import torch.distributed.checkpoint as dcp
        import gpuckpt.dcp

        dcp.save(state_dict, storage_writer=gpuckpt.dcp.Writer("ckpt/step-100"))
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        sync: str = "auto",
        threads: int | None = None,
        progress: ProgressCallback | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        storage_options: dict[str, Any] | None = None,
        portable: bool = False,
        base: str | os.PathLike[str] | None = None,
        content_hash: bool = False,
        compression: str | dict[str, Any] | None = None,
        thread_count: int | None = None,
        sync_files: bool | None = None,
        single_file_per_rank: bool = True,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        _extensions: Sequence[Any] | None = None,
        serialization_format: Any = None,
    ) -> None:
        super().__init__()
        del single_file_per_rank, per_thread_copy_ahead, cache_staged_state_dict  # no effect (fs_arguments)
        threads, sync, compression = writer_arguments(
            threads=threads,
            sync=sync,
            compression=compression,
            thread_count=thread_count,
            sync_files=sync_files,
            extensions=_extensions,
            serialization_format=serialization_format,
        )
        self.options = SaveOptions(
            overwrite=overwrite,
            chunk_bytes=chunk_bytes,
            sync=sync,
            threads=threads,
            progress=progress,
            staging_bytes=staging_bytes,
            storage_options=storage_options,
            portable=portable,
            base=base,
            content_hash=content_hash,
            compression=compression,
        )
        self._path = path_text(path)
        self._save_id = str(uuid.uuid4())  # the next save's, as DCP's FileSystemWriter makes one
        self._published = False  # the save of _save_id was published: the next save makes another
        self._coordinator = True
        self._rank = 0
        self._open: bridge.OpenSave | None = None
        self._cleanup: weakref.finalize[Any, Any] | None = None

    @property
    def checkpoint_id(self) -> str:
        """The path (or URL) of the checkpoint being written."""
        return self._path

    @property
    def save_id(self) -> str:
        """The id of the save being made, or of the last one published (as DCP's
        ``FileSystemWriter.save_id``): the ``storage_meta.save_id`` that ``dcp.save`` returns and
        the checkpoint records; a later save without :meth:`reset` makes a new one."""
        return self._save_id

    # the calls of a save, in DCP's order ----------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._discard()
        self._save_id, self._published = str(uuid.uuid4()), False
        if checkpoint_id is not None:
            self._path = path_text(checkpoint_id)

    def set_up_storage_writer(
        self, is_coordinator: bool, *args: Any, rank: int = 0, use_collectives: bool = True, **kwargs: Any
    ) -> None:
        if not use_collectives:
            raise UnsupportedValueError(
                "gpuckpt.dcp.Writer writes one checkpoint from all ranks and needs DCP's collectives; "
                "call dcp.save without use_collectives=False"
            )
        self._discard()  # a previous save of this Writer that failed on some rank
        self._next_save_id()
        self._coordinator = bool(is_coordinator)
        self._rank = int(rank)

    def storage_meta(self) -> StorageMeta | None:
        self._next_save_id()
        return StorageMeta(checkpoint_id=self._path, save_id=self._save_id)

    def _next_save_id(self) -> None:
        """A new save id once the save of the current one was published (a later save without
        :meth:`reset` is another save), at the first of the calls that begin a save."""
        if self._published:
            self._save_id, self._published = str(uuid.uuid4()), False

    def prepare_local_plan(self, plan: DcpSavePlan) -> DcpSavePlan:
        convert.local_boxes(plan.items)  # unsupported dtypes fail here, on the rank that has them
        # this rank's path and options, for the coordinator to compare (prepare_global_plan)
        return dataclasses.replace(plan, storage_data=agreed_settings(self._path, self.options))

    def prepare_global_plan(self, plans: list[DcpSavePlan]) -> list[DcpSavePlan]:
        if not all(getattr(p, "usable", True) for p in plans):
            raise UnsupportedValueError(
                "gpuckpt.dcp.Writer cannot reuse cached save plans (each save writes into its own "
                "temporary): make the DefaultSavePlanner without enable_plan_caching=True"
            )
        settings = [p.storage_data for p in plans]
        if all(isinstance(s, dict) for s in settings):  # (a planner may drop what a rank sent)
            check_agreement(settings)  # every Writer of the job got the same path and options
        per_rank = [convert.local_boxes(p.items) for p in plans]
        described = [
            [
                (
                    b.fqn,
                    b.global_shape,
                    b.dtype,
                    convert.stored_properties(b.properties, b.dtype, mf.contiguous_format),
                    b.boxes,
                )
                for b in rank
            ]
            for rank in per_rank
        ]
        save_plan = bridge.plan(described, self.options, self._path)
        assignments = save_plan.assignments
        nvalues = len({i.index.fqn for p in plans for i in p.items if i.type == WriteItemType.BYTE_IO})
        self._discard()
        # one-chunk arrays the coordinator writes itself: their documents go with their chunk
        one_chunk = {t.name for t in save_plan.tensors if t.nchunks == 1}
        mine = {a.name for a in assignments[self._rank] if a.name in one_chunk}
        reusable = bridge.reusable_arrays(self._path, save_plan, self.options)
        # a checkpoint already there is refused by the store in DCP's words ("Checkpoint already exists")
        opened = bridge.begin_save(self._path, save_plan, nvalues, self.options, mine)
        self._open = opened
        self._cleanup = weakref.finalize(self, bridge.abort_save, opened)
        return [
            dataclasses.replace(
                plan,
                storage_data=_RankPlan(
                    self._path,
                    opened.token,
                    tuple(assignments[r]),
                    {b.fqn: tuple(box[0] for box in b.boxes) for b in per_rank[r]},
                    reusable,
                    opened.layout,
                ),
            )
            for r, plan in enumerate(plans)
        ]

    def write_data(self, plan: DcpSavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        mine = plan.storage_data
        if not isinstance(mine, _RankPlan):
            raise UnsupportedValueError(
                "gpuckpt.dcp.Writer.write_data got a plan its prepare_global_plan did not make "
                f"(storage_data is {type(mine).__name__}); the save planner dropped it"
            )
        by_box: dict[tuple[str, tuple[int, ...]], WriteItem] = {}
        values: list[WriteItem] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                values.append(item)
            elif item.tensor_data is not None:
                by_box[(item.index.fqn, tuple(int(o) for o in item.tensor_data.chunk.offsets))] = item

        def source(fqn: str, box: int) -> tuple[Any, tuple[int, ...]]:
            offsets = mine.boxes[fqn][box]
            item = by_box[(fqn, offsets)]
            assert item.tensor_data is not None  # by_box holds tensor items only
            tensor = planner.resolve_data(item)
            expected = tuple(int(s) for s in item.tensor_data.chunk.sizes)
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != expected:
                raise UnsupportedValueError(
                    f"tensor {fqn!r}: the planner resolved the box at {offsets} to "
                    f"{type(tensor).__name__} of shape {tuple(getattr(tensor, 'shape', ()))}, "
                    f"its write item says a tensor of {expected}"
                )
            return tensor, offsets

        documents = None
        if self._coordinator and self._open is not None:
            writer = self._open.writer
            # handed over: written with their chunks, not kept (~1 KB per array) until finish
            documents, self._open.deferred = self._open.deferred, {}
        else:
            writer = bridge.attach(mine.path, mine.token, self.options)
        # the boxes of the tensors this rank writes chunks of (a replicated tensor another rank
        # writes is never resolved here)
        held = {
            fqn: [source(fqn, i) for i in range(len(mine.boxes[fqn]))]
            for fqn in dict.fromkeys(a.fqn for a in mine.chunks)
        }
        base = bridge.open_base(self.options, mine.reusable)
        written, formats = bridge.write_assigned(writer, mine.chunks, held, self.options, documents, base)
        block = None
        if mine.layout is not None:
            # this rank's rows of the chunk table: stored here, only their checksums reported (with
            # its first tensor item: a rank that wrote chunks holds the items they came from)
            block = bridge.write_block(writer, mine.layout, self._rank, [a.row for a in mine.chunks], written)
        per_box: dict[tuple[str, tuple[int, ...]], list[tuple[int, Any]]] = {}
        for a, result in zip(mine.chunks, written, strict=True):
            per_box.setdefault((a.fqn, mine.boxes[a.fqn][a.box]), []).append((a.row, result))
        results = []
        for key, item in by_box.items():
            chunks = per_box.get(key, [])
            fmt = formats.get(key[0])
            fmt_name = None if fmt is None else fmt.name
            if mine.layout is not None:
                reported = _Written(memory_format=fmt_name, block=block)
                block = None  # reported once
            else:
                reported = _Written(
                    tuple(r for _, r in chunks), fmt_name, rows=tuple(row for row, _ in chunks)
                )
            results.append(
                WriteResult(
                    index=item.index, size_in_bytes=sum(w[0] for _, (_, w) in chunks), storage_data=reported
                )
            )
        for item in values:
            data = planner.resolve_data(item)
            blob = data.getvalue() if hasattr(data, "getvalue") else bytes(data)
            results.append(
                WriteResult(index=item.index, size_in_bytes=len(blob), storage_data=_Written(blob=blob))
            )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: DcpMetadata, results: list[list[WriteResult]]) -> None:
        opened = self._open
        if opened is None:
            raise GpuckptError(
                "gpuckpt.dcp.Writer.finish without a save in progress: this Writer was reset or reused by "
                "another save before this one finished (use one Writer per save in flight)"
            )
        parts: list[tuple[np.ndarray, dict[str, np.ndarray]]] = []
        blocks: list[bridge.BlockReport] = []
        formats: dict[str, set[str]] = {}
        blobs: dict[str, bytes] = {}
        for rank_results in results:
            for r in rank_results:
                w = r.storage_data
                if not isinstance(w, _Written):
                    raise UnsupportedValueError(
                        f"write result of {r.index.fqn!r} was not made by gpuckpt.dcp.Writer"
                    )
                if w.rows:
                    parts.append(bridge.reported_rows(w.rows, w.chunks))
                if w.block is not None:
                    blocks.append(w.block)
                if w.memory_format is not None:
                    formats.setdefault(r.index.fqn, set()).add(w.memory_format)
                if w.blob is not None:
                    blobs[r.index.fqn] = w.blob
        # ranks that disagree (shards of one tensor in different layouts) get the canonical layout
        chosen = {
            f: mf.memory_format_from_name(n.pop()) if len(n) == 1 else mf.contiguous_format
            for f, n in formats.items()
        }
        fqns = list(metadata.state_dict_metadata)
        try:
            bridge.commit_save(
                opened,
                blocks if opened.layout is not None else bridge.table_columns(opened.plan, parts),
                chosen,
                blobs,
                convert.skeleton_from_paths(metadata.planner_data, fqns),
                {convert.DCP_KEY: convert.dcp_planner_data(blobs)},
                self._save_id,
            )
        except BaseException:
            self._discard()
            raise
        self._forget()
        # what DCP's FileSystemWriter.finish records, in the Metadata dcp.save returns (every rank
        # gets the coordinator's); gpuckpt.dcp.Reader reads the save id back as storage_meta.save_id
        metadata.version = DCP_VERSION
        metadata.storage_meta = StorageMeta(checkpoint_id=self._path, save_id=self._save_id)
        self._published = True

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return bridge.location_supported(checkpoint_id)

    # the temporary of an unfinished save -----------------------------------------

    def _forget(self) -> None:
        if self._cleanup is not None:
            self._cleanup.detach()
        self._cleanup = None
        self._open = None

    def _discard(self) -> None:
        """Remove the temporary of a save begun here and never finished (DCP calls no hook on failure)."""
        if self._cleanup is not None:
            self._cleanup()  # runs bridge.abort_save once
        self._forget()

    def __repr__(self) -> str:
        return f"gpuckpt.dcp.Writer({self._path!r})"
