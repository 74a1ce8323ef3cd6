"""``gpuckpt.dcp.Reader``: a torch.distributed.checkpoint StorageReader of gpuckpt checkpoints."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import uuid
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata as DcpMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

import gpuckpt.dcp.bridge as bridge
import gpuckpt.dcp.convert as convert
from gpuckpt.dcp.saved_bytesio import saved_bytesio
from gpuckpt.dcp.tensors import as_torch, torch, torch_dtype
from gpuckpt.device.arrays import adapt_leaf
from gpuckpt.distributed.torch_dist import TorchCoordinator
from gpuckpt.errors import (
    MetadataError,
    MissingKeyError,
    ShapeMismatchError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from gpuckpt.loading.targets import check_writable_target
from gpuckpt.options import DEFAULT_STAGING_BYTES, LoadOptions
from gpuckpt.storage.stores import path_text, shares_reads

__all__ = ["Reader"]

#: the mark :meth:`Reader.prepare_global_plan` leaves in each rank's plan: the number of ranks
_COOPERATIVE = "gpuckpt_cooperative_ranks"


class Reader(StorageReader):  # type: ignore[misc,unused-ignore]
    """Reads any gpuckpt checkpoint under ``torch.distributed.checkpoint.load``.

    :meth:`read_metadata` gives DCP its own ``Metadata``, built from the
    checkpoint's JSON metadata (the chunks listed are the stored Zarr chunks).
    DCP's planner then asks for any box of any tensor (resharding); only the
    chunks that overlap it are read, each one checked against its CRC32C
    before its bytes reach the target (CPU or CUDA tensors; targets of
    another dtype get a converted copy, as with ``FileSystemReader``).

    Checkpoints written by :func:`gpuckpt.save` read as DCP would have
    flattened the same state dict: a list without tensors, or a tuple, is one
    value for DCP, and its plain values are handed over as ``torch.save``
    bytes, which DCP's default load planner expects.

    No pickle is run by default. Bytes that DCP wrote are unpickled with
    ``torch.load(weights_only=True)`` (tensors, containers and plain types) and
    serialised again before DCP sees them; an ``io.BytesIO`` value (DCP's
    opaque bytes: data loader or RNG state), which ``weights_only`` refuses, is
    recognised in its pickle without running it and handed over as a new
    BytesIO of the same bytes. Other objects, and gpuckpt values saved with
    ``allow_pickle=True``, need ``allow_pickle=True`` here (trusted
    checkpoints only).

    Parameters
    ----------
    path
        The checkpoint (a directory or ``s3://`` URL); DCP's ``checkpoint_id`` replaces it.
    allow_pickle
        Hand pickled entries to DCP unchecked.
    threads
        I/O threads (default as for :func:`gpuckpt.load`).
    storage_options
        Options of URL back ends (``s3://``), as for :func:`gpuckpt.load`.
    cooperative
        In a distributed ``dcp.load`` (its plans made over the default process group),
        each stored chunk that several ranks need is read once for the job: one rank reads
        and checks it and sends its bytes to the others over a gloo group of the same ranks
        (:mod:`gpuckpt.distributed.cooperative`). False: every rank reads what it needs;
        None (the default): cooperative where the store serves each rank's reads anew
        (``s3://``, network file systems), as for :func:`gpuckpt.load`.
    staging_bytes
        Bytes of shared chunks one rank holds at a time in a cooperative load (and the
        staging budget of device targets), as for :func:`gpuckpt.load`.
    _extension_registry
        DCP's ``FileSystemReader`` argument, taken so that a program that builds one runs
        with the class name changed; no effect (:mod:`gpuckpt.dcp.fs_arguments`).

    Examples
    --------
    ::

        dcp.load(state_dict, storage_reader=gpuckpt.dcp.Reader("ckpt/step-100"))
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        allow_pickle: bool = False,
        threads: int | None = None,
        storage_options: dict[str, Any] | None = None,
        cooperative: bool | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        _extension_registry: Any = None,
    ) -> None:
        super().__init__()
        del _extension_registry  # DCP's FileSystemReader argument: gpuckpt's codecs are Zarr's
        self.options = LoadOptions(
            allow_pickle=allow_pickle,
            threads=threads,
            storage_options=storage_options,
            cooperative=cooperative,
            staging_bytes=staging_bytes,
        )
        self._path = path_text(path)
        #: this reader's id, put into the metadata it reads (``storage_meta.load_id``), as DCP's
        #: ``FileSystemReader.load_id``; new at each :meth:`reset`
        self.load_id = str(uuid.uuid4())
        self._coordinator: TorchCoordinator | None = None
        self._checkpoint: bridge.OpenCheckpoint | None = None
        self._view: convert.View | None = None

    @property
    def checkpoint_id(self) -> str:
        """The path (or URL) of the checkpoint being read."""
        return self._path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._checkpoint = None
        self._view = None
        self.load_id = str(uuid.uuid4())
        if checkpoint_id is not None:
            self._path = path_text(checkpoint_id)

    def read_metadata(self, *args: Any) -> DcpMetadata:
        # no **kwargs: DCP then does not retry with per-rank metadata, which gpuckpt has none of
        ck = bridge.open_checkpoint(self._path, self.options)  # (a DCP directory is named as one)
        view = convert.dcp_view(ck.metadata, set(ck.tensors), set(ck.values), self._path)
        self._checkpoint, self._view = ck, view
        metadata: DcpMetadata = view.metadata
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: DcpMetadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._view is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # called on the coordinator rank of a distributed load only (and on the one rank of a
        # load without collectives, with one plan): the mark tells every rank's read_data
        # that all ranks call it, so that it may run collectives
        cooperative = self.options.cooperative
        if cooperative is None:  # decided here, on one rank: every rank follows the mark
            cooperative = shares_reads(self._path)
        if not cooperative or len(plans) < 2:
            return plans
        mark = {_COOPERATIVE: len(plans)}
        return [dataclasses.replace(p, storage_data=mark) for p in plans]

    def _cooperating(self, plan: LoadPlan) -> TorchCoordinator | None:
        """The coordinator of a cooperative ``read_data``, or None (every rank reads alone)."""
        data = plan.storage_data
        if not (isinstance(data, dict) and isinstance(data.get(_COOPERATIVE), int)):
            return None
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != data[_COOPERATIVE]:
            return None  # a load over a subgroup: not the default group's ranks
        if self._coordinator is None:
            # NCCL carries no CPU tensors: the chunks then travel over a gloo group of the same ranks
            self._coordinator = TorchCoordinator().host_transport()
        return self._coordinator

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._checkpoint is None or self._view is None:
            self.read_metadata()
        assert self._checkpoint is not None and self._view is not None
        ck = self._checkpoint
        coordinator = self._cooperating(plan)
        try:
            requests, done, values = self._targets(plan, planner)
        except Exception as exc:
            if coordinator is not None:
                # the same collective as the others' agreement on their checks: every rank raises
                coordinator.all_reduce_errors(exc)
            raise
        bridge.read_boxes_into(ck, requests, self.options, coordinator)
        for item, target, converted in done:
            if converted is not None:
                target.copy_(converted)
            planner.commit_tensor(item, target)
        for item, entry in values:
            planner.load_bytes(item, io.BytesIO(self._serialized(ck, entry)))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _targets(
        self, plan: LoadPlan, planner: LoadPlanner
    ) -> tuple[
        dict[str, list[tuple[Any, bridge.Box]]],
        list[tuple[ReadItem, Any, Any]],
        list[tuple[ReadItem, convert.Entry]],
    ]:
        """The boxes of ``plan``'s tensors with their targets, and its non-tensor values."""
        assert self._checkpoint is not None and self._view is not None
        ck, view = self._checkpoint, self._view
        requests: dict[str, list[tuple[Any, bridge.Box]]] = {}
        done: list[tuple[ReadItem, Any, Any]] = []  # (item, target, converted copy or None)
        values: list[tuple[ReadItem, convert.Entry]] = []
        for item in plan.items:
            entry = view.entries.get(item.storage_index.fqn)
            if entry is None:
                raise MissingKeyError(
                    f"{item.storage_index.fqn!r} is not in the checkpoint at {self._path}; list its keys "
                    "with gpuckpt.read_metadata(path).state_dict_metadata"
                )
            if entry.kind != "tensor":
                values.append((item, entry))
                continue
            if item.type != LoadItemType.TENSOR:
                raise UnsupportedValueError(
                    f"{entry.fqn!r} is a tensor in the checkpoint at {self._path}, but the load plan asks "
                    "for it as a non-tensor value; load it into a tensor"
                )
            t = ck.tensors[entry.fqn]
            chunk = tuple(int(o) for o in (item.storage_index.offset or ()))
            offsets = tuple(c + int(o) for c, o in zip(chunk, item.storage_offsets, strict=True))
            box = (offsets, tuple(int(n) for n in item.lengths))
            target = planner.resolve_tensor(item).detach()
            # a target that cannot take the values element by element is refused before any read
            check_writable_target(entry.fqn, adapt_leaf(target, entry.fqn), "the target")
            if tuple(target.shape) != box[1]:
                raise ShapeMismatchError(
                    f"tensor {entry.fqn!r}: the planner resolved a target of shape {tuple(target.shape)} "
                    f"for a read of {box[1]}"
                )
            stored = torch_dtype(t.dtype, entry.fqn)
            into = (
                target if target.dtype == stored else torch.empty(box[1], dtype=stored, device=target.device)
            )
            requests.setdefault(entry.fqn, []).append((into, box))
            done.append((item, target, None if into is target else into))
        return requests, done, values

    def _serialized(self, ck: bridge.OpenCheckpoint, entry: convert.Entry) -> bytes:
        """The ``torch.save`` bytes DCP's planner gets for a non-tensor entry."""
        if entry.kind == "torch_save":
            blob = bridge.read_value(ck, entry.fqn, False)
            if not isinstance(blob, bytes):
                raise MetadataError(
                    f"entry {entry.fqn!r} is listed as DCP's serialised bytes but holds a "
                    f"{type(blob).__name__}; the checkpoint is damaged"
                )
            if self.options.allow_pickle:
                return blob
            # DCP's opaque bytes (io.BytesIO), which weights_only refuses, read without unpickling
            try:
                value = saved_bytesio(blob)
                if value is None:
                    value = torch.load(io.BytesIO(blob), weights_only=True)
            except Exception as exc:
                raise UnsafeCheckpointError(
                    f"entry {entry.fqn!r} holds a value that DCP pickled and that gpuckpt.dcp.Reader "
                    f"does not unpickle by default ({_refusal(exc)}); unpickling it can run any code the "
                    "checkpoint holds: pass allow_pickle=True to gpuckpt.dcp.Reader only for a "
                    "checkpoint whose origin you trust"
                ) from None
        elif entry.kind == "value":
            value = bridge.read_value(ck, entry.fqn, self.options.allow_pickle)
        else:  # a list or tuple DCP takes as one value
            leaves = convert.leaves(entry.node)
            got = {
                f: as_torch(bridge.read_whole(ck, f, self.options))
                if f in ck.tensors
                else bridge.read_value(ck, f, self.options.allow_pickle)
                for f in leaves
            }
            value = bridge.rebuild(entry.node, got)
        out = io.BytesIO()
        torch.save(value, out)
        return out.getvalue()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return bridge.is_checkpoint(checkpoint_id)

    def __repr__(self) -> str:
        return f"gpuckpt.dcp.Reader({self._path!r})"


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _refusal(exc: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` refused, in one short line: torch's reason (the
    global it would not load), without its terminal colours and its advice, which is about
    ``torch.load`` (``weights_only=False``), not about this Reader."""
    text = _ANSI.sub("", str(exc))
    _, found, reason = text.partition("WeightsUnpickler error:")
    if not found:
        reason = next((line for line in reversed(text.splitlines()) if line.strip()), type(exc).__name__)
    reason = " ".join(reason.split())
    # torch's own suggestions follow its reason ("Please use `torch.serialization.add_safe_globals`")
    reason = reason.split(" Please use ", 1)[0].split(" Check the documentation ", 1)[0]
    reason = reason[:200] + (" ..." if len(reason) > 200 else "")
    return f"torch.load(weights_only=True) refuses it: {reason.rstrip('.')}"
