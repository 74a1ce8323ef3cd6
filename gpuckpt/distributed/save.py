"""Distributed saves: every rank writes its own chunks into one shared checkpoint.

The protocol, with a collective error check after every step so that a
failure on any rank fails the save on every rank and publishes nothing:

1. every rank describes its tensors (boxes, no data) and plain values
   (:func:`gpuckpt.saving.sources.describe_state`);
2. every rank sends the digest of its layout (one small collective); when
   every digest is the previous save's through this coordinator, the previous
   plan is reused (only the plain values are gathered); otherwise rank 0
   gathers the descriptions (compact ones when every rank holds one box of the
   same tensors) and plans the save (:func:`gpuckpt.planning.plan.plan_save`);
   rank 0 begins the save, writes the array documents (on a file system: they
   make the arrays' directories) and broadcasts the plan, from which each rank
   lists its own chunks;
3. every rank writes its chunks into the shared save: fsynced files in the
   shared temporary on a file system, objects at their final keys under the
   claimed prefix of an object store (:func:`gpuckpt.storage.stores.attach_writer`),
   where every rank writes a share of the array documents on its I/O threads
   alongside its own chunks (so no rank waits for hundreds of document puts,
   and rank 0 sends no more requests than the others; the root document is
   still published only after every rank finished, and an error anywhere
   aborts every object);
   in an incremental save (``base=``) rank 0 finds the arrays the base can
   serve and broadcasts their names, and each rank opens the base itself and
   decides reuse for its own chunks;
4. rank 0 gathers each rank's chunk table rows and per-chunk columns
   (checksums, and the content hashes of a hashing save: a few arrays per
   rank), writes the chunk table of a large save, assembles the global
   Metadata and commits atomically; every rank returns that Metadata.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.distributed.coordinator import Coordinator, collectively, disagreement
from gpuckpt.errors import InvalidOptionError
from gpuckpt.format.metadata import Metadata
from gpuckpt.format.reader import read_index
from gpuckpt.format.records import TABLE_MIN_CHUNKS
from gpuckpt.options import SaveOptions
from gpuckpt.planning.plan import ChunkAssignment, SavePlan, StateDescription, merge_values, plan_save
from gpuckpt.planning.table import TableLayout, table_layout
from gpuckpt.planning.uniform import (
    CompactDescription,
    box_fingerprints,
    compact_description,
    local_layout_digest,
    tensor_groups,
)
from gpuckpt.saving.compression import resolve as resolve_compression
from gpuckpt.saving.incremental import BaseIndex, open_base, open_base_for
from gpuckpt.saving.session import SaveSession
from gpuckpt.saving.sources import Source, describe_state
from gpuckpt.saving.table_blocks import BlockReport, write_block, write_table_documents
from gpuckpt.saving.writing import (
    array_document_of,
    bind_jobs,
    open_save_writer,
)
from gpuckpt.storage.stores import attach_writer, path_text

__all__ = [
    "PlanCacheInfo",
    "agreed_settings",
    "check_agreement",
    "distributed_save",
    "plan_cache_info",
    "save_described",
]

#: what a rank saves: its state's description and the arrays behind it (see :mod:`gpuckpt.saving.sources`)
Described = tuple[StateDescription, dict[str, tuple[Source, ...]]]


def _run(coord: Coordinator, fn: Any, *args: Any) -> Any:
    """Run ``fn`` on this rank; collectively raise if it failed (or was interrupted) on any rank."""
    return collectively(coord, fn, *args)


def distributed_save(
    state_dict: dict[str, Any], path: str | os.PathLike[str], coordinator: Coordinator, options: SaveOptions
) -> Metadata:
    """Save one checkpoint from every rank of ``coordinator``; see the module docstring."""
    return save_described(
        lambda: describe_state(state_dict, allow_pickle=options.allow_pickle), path, coordinator, options
    )


@dataclass
class PlanCacheInfo:
    """How often saves through one coordinator reused the previous plan (``hits``) or planned (``misses``)."""

    hits: int = 0
    misses: int = 0


@dataclass
class _Cached:
    token: bytes  # digest of every rank's layout digests (:func:`_token`)
    plan: SavePlan | None  # rank 0's plan (without values); None on the other ranks
    mine: tuple[ChunkAssignment, ...]  # the chunks this rank writes
    documents: tuple[tuple[str, bytes], ...]  # the array documents this rank writes (see _my_documents)
    layout: TableLayout | None  # the chunk table's blocks (see gpuckpt.saving.table_blocks)


def _my_documents(plan: SavePlan, rank: int, world_size: int) -> tuple[tuple[str, bytes], ...]:
    """``(array name, zarr.json)`` of every ``world_size``-th array of ``plan`` from ``rank`` on: the
    documents this rank writes into a store that takes chunks before documents (an object store),
    so that each rank sends as many requests as the others and rank 0 is not the last to finish."""
    return tuple((t.name, array_document_of(t)) for t in plan.tensors[rank::world_size])


def _token(keys: list[tuple[bytes, bytes | None]]) -> bytes:
    h = hashlib.blake2b(digest_size=32)
    for d, c in keys:
        h.update(d)
        h.update(c or b"-")
    return h.digest()


_cache: weakref.WeakKeyDictionary[Coordinator, _Cached] = weakref.WeakKeyDictionary()
_info: weakref.WeakKeyDictionary[Coordinator, PlanCacheInfo] = weakref.WeakKeyDictionary()


def plan_cache_info(coordinator: Coordinator) -> PlanCacheInfo:
    """The plan cache counters of saves through ``coordinator`` on this rank."""
    return _info.setdefault(coordinator, PlanCacheInfo())


def _layout_keys(local: StateDescription, options: SaveOptions) -> tuple[bytes, CompactDescription | None]:
    compact = compact_description(local.tensors, local.objects, local.skeleton)
    digest = local_layout_digest(local.tensors, chunk_bytes=options.chunk_bytes, portable=options.portable)
    # a plan holds each tensor's codec: another compression is another plan
    return digest + repr(options.codecs).encode(), compact


#: the save options every rank must give alike (the others, such as threads, progress or staging
#: memory, are each rank's own): rank 0's decide the plan and the checkpoint
_AGREED = ("chunk_bytes", "portable", "sync", "overwrite", "allow_pickle", "content_hash", "base")


def agreed_settings(path: str | os.PathLike[str], options: SaveOptions) -> dict[str, Any]:
    """What every rank of a distributed save must give alike: the path and the save options that
    decide the checkpoint (:func:`check_agreement` compares them)."""
    text = path_text(path)
    where = text if "://" in text else os.path.abspath(text)
    c = options.codecs
    codec = (
        None
        if c is None
        else f"{c.codec}"
        + (f" {c.cname}-{c.level} {c.shuffle} {c.blocksize}" if c.codec == "blosc" else f"-{c.level}")
        + (" auto" if c.auto else "")
        + (" on the device" if c.device else "")
    )
    agreed: dict[str, Any] = {"path": where, "compression": codec}
    for name in _AGREED:
        value = getattr(options, name)
        if name == "base" and value is not None:
            base = os.fspath(value)
            value = base if "://" in base else os.path.abspath(base)
        agreed[name] = value
    return agreed


def check_agreement(settings: list[dict[str, Any]]) -> None:
    """A :class:`~gpuckpt.errors.InvalidOptionError` naming each setting the ranks gave differently,
    with the ranks that gave each value (every rank raises it: they all see every setting)."""
    differ = [
        f"{name}: {found}"
        for name in settings[0]
        if (found := disagreement([s[name] for s in settings])) is not None
    ]
    if differ:
        raise InvalidOptionError(
            f"the ranks of a distributed save gave different settings ({'; '.join(differ)}); every rank "
            "must pass the same path and the same save options (threads, progress and staging may "
            "differ). Nothing was written"
        )


def save_described(
    describe: Callable[[], Described],
    path: str | os.PathLike[str],
    coordinator: Coordinator,
    options: SaveOptions,
) -> Metadata:
    """:func:`distributed_save` of the state ``describe()`` gives (called once, its error
    reported to every rank): a background save describes and snapshots its state first.

    Planning costs one small collective when the layout did not change: every rank
    sends the digest of its layout (:func:`~gpuckpt.planning.uniform.local_layout_digest`);
    when every digest equals the previous save's through this coordinator, the previous
    plan is used again and only the plain values are gathered. Otherwise ranks that all
    hold one box of the same tensors send compact descriptions (planned per tensor, see
    :mod:`gpuckpt.planning.uniform`), others their full descriptions.
    """
    coord = coordinator
    local, sources = _run(coord, describe)
    digest, compact = _run(coord, _layout_keys, local, options)
    cached = _cache.get(coord)
    # each rank also says which layouts its cached plan is for: every rank sees the same
    # list, so every rank decides alike (a rank without the cache makes it a miss for all)
    sent = coord.all_gather(
        (
            digest,
            None if compact is None else compact.digest,
            None if cached is None else cached.token,
            agreed_settings(path, options),
        )
    )
    # every rank sees every rank's settings: where they differ, all raise the same error here
    check_agreement([s[3] for s in sent])
    keys: list[tuple[bytes, bytes | None]] = [(d, c) for d, c, _, _ in sent]
    layout_token = _token(keys)
    values: list[Any] | None = None
    gathered: list[Any] | None = None
    hit = all(t == layout_token for _, _, t, _ in sent)
    info = plan_cache_info(coord)
    writer: Any = None
    if hit:
        assert cached is not None
        info.hits += 1
        values = coord.gather((local.objects, local.skeleton))
        mine_cached, documents = cached.mine, cached.documents
    else:
        info.misses += 1
        uniform = all(k[1] is not None and k[1] == keys[0][1] for k in keys)
        send: StateDescription | CompactDescription = local
        if uniform:
            assert compact is not None
            # one reduction finds the tensors whose boxes are alike on every rank; each rank
            # then sends one box per group of them (see gpuckpt.planning.uniform)
            combined = coord.all_reduce_xor(box_fingerprints(compact, coord.rank))
            grouped = _run(coord, lambda: compact.grouped(tensor_groups(combined, local.tensors)))
            send = grouped if coord.rank == 0 else grouped.without_tensors()
        gathered = coord.gather(send)

    base: BaseIndex | None = None
    session: SaveSession | None = None

    def plan_on_root() -> tuple[SavePlan, str, list[str] | None, TableLayout | None]:
        nonlocal writer, base
        if hit:
            assert cached is not None and cached.plan is not None and values is not None
            objects, skeleton = merge_values(values)
            plan = dataclasses.replace(cached.plan, objects=objects, skeleton=skeleton)
        else:
            assert gathered is not None
            # "auto" samples the tensors this rank holds (the others follow their dtype's)
            plan = plan_save(
                gathered,
                chunk_bytes=options.chunk_bytes,
                portable=options.portable,
                compression=resolve_compression(path, options, local, sources),
            )
        # an incremental save: the arrays whose chunks the base may serve (each rank then reads
        # the base's records of those only)
        base = open_base_for(options, plan.tensors)
        reusable = None if base is None else base.arrays()
        # the other ranks' writers attach without O_DIRECT: the root's writes alike
        writer = open_save_writer(path, options, expected_files=plan.nfiles, direct_io=False)
        # a store that takes chunks before documents gets them from every rank, with its chunks
        nonlocal session
        first = writer.capabilities.documents_first
        session, _ = SaveSession.begin(plan, writer, options, documents=first)
        # rank 0 gathers every chunk's records, or each rank stores its block of the table
        layout = (
            cached.layout
            if hit and cached is not None
            else table_layout(plan, min_chunks=TABLE_MIN_CHUNKS, hashing=options.hashing)
        )
        if layout is not None and first:
            write_table_documents(writer, layout)
        return plan, writer.token, reusable, layout

    root = _run(coord, plan_on_root) if coord.rank == 0 else _run(coord, lambda: None)
    plan, token, reusable, layout = root if root is not None else (None, None, None, None)
    if hit:
        assert cached is not None
        token, reusable = coord.broadcast((token, reusable), root=0)
        mine, layout = mine_cached, cached.layout
    else:
        # one plan for every rank (no values: they stay on rank 0); each lists its own chunks
        shared = None if plan is None else dataclasses.replace(plan, objects={}, skeleton=None)
        shared, token, reusable, layout = coord.broadcast((shared, token, reusable, layout), root=0)
        mine = _run(coord, shared.assignments_of, coord.rank)
        documents = _my_documents(shared, coord.rank, coord.world_size)
        _cache[coord] = _Cached(layout_token, shared if coord.rank == 0 else None, mine, documents, layout)

    def write_mine() -> tuple[np.ndarray, Mapping[str, np.ndarray]] | BlockReport:
        if coord.rank == 0:
            assert session is not None
            mine_session = session
        else:
            w = attach_writer(path, token, storage_options=options.store_options())
            mine_session = SaveSession.joined(w, options)
        w = mine_session.writer
        mine_base = base
        if coord.rank != 0 and reusable is not None and options.base_location is not None:
            mine_base = open_base(options.base_location, options.storage_options, reusable)
        jobs = bind_jobs(mine, sources)
        # an object store takes chunks before documents: every rank started on the plan at once,
        # and puts its share of the documents on its I/O threads, within its request budget
        first = (
            []
            if w.capabilities.documents_first
            else [functools.partial(w.write_array_document, *d) for d in documents]
        )
        rows = mine_session.rows(jobs, mine_session.write(jobs, base=mine_base, first=first))
        if layout is None:
            return rows
        return write_block(w, layout, coord.rank, *rows)

    try:
        results = _run(coord, write_mine)
        all_results = coord.gather(results)

        def commit_on_root() -> str:
            assert session is not None and all_results is not None
            if layout is None:
                return session.commit(all_results, str(uuid.uuid4())).to_json()
            return session.commit_blocks(all_results, str(uuid.uuid4()), layout).to_json()

        text = _run(coord, commit_on_root) if coord.rank == 0 else _run(coord, lambda: None)
    except BaseException:
        if coord.rank == 0 and writer is not None:
            writer.abort()
        raise
    text = coord.broadcast(text, root=0)
    return read_index(json.loads(text)).metadata()
