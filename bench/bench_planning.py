"""Global planning and metadata at scale: what rank 0 does per save, and what a rank reads per load.

Simulates a job of ``--ranks`` ranks that each hold a row shard of every one
of ``--tensors`` tensors (4096 x 1024 float32, an even split: the FSDP/TP
layout), plus one tensor replicated on every rank, and times on rank 0:

- **save**: planning (:func:`gpuckpt.planning.plan.plan_save` from the
  descriptions as rank 0 receives them: compact ones, see
  :mod:`gpuckpt.planning.uniform`), merging every rank's chunk checksums,
  assembling the Metadata, encoding the chunk table and the root document;
- **cached**: the same save when every rank's layout digest is the previous
  save's (the plan is reused; values merged, checksums, metadata, encoding);
- **load**: what one rank reads to load its shard of every tensor: the root
  document (parsed and validated) and the chunk table rows of its chunks,
  from a real checkpoint directory.

The ``irregular`` row uses uneven row shards (rectilinear grids, planned
chunk by chunk). The per-rank work (describing the layout, listing the
chunks a rank writes) runs on every rank in parallel and is timed for one
rank. Each rank's checksums are simulated as a block of as many chunk table
rows as it writes. Targets at 1,024 ranks x 1,000 tensors: save <= 1 s,
cached <= 0.1 s, root document <= 5 MiB, load <= 0.2 s; each figure is also
printed as a ratio to its target.

Run against an older gpuckpt (``PYTHONPATH=/path/to/old``) it times the
same steps the old way (full descriptions, per-chunk results) for the
before-figures.

Tensors have 4,096 rows, or one per rank beyond 4,096 ranks (``rows_for``), so that every rank
holds rows: at 16,384 ranks each rank's shard of a 16,384 x 1,024 tensor is one row. The
simulation describes one rank at a time (rank 0's own work is what is timed).

Usage: ``python bench/bench_planning.py [--ranks 1024] [--tensors 1000] [--quick]``
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from typing import Any

import numpy as np

from gpuckpt.format.documents import metadata_json, root_document
from gpuckpt.metadata import TensorProperties
from gpuckpt.planning.boxes import LocalTensor, overlapping_chunks
from gpuckpt.planning.plan import StateDescription, plan_save
from gpuckpt.saving.commit import assemble_metadata

try:  # box fingerprints: ranks send one box per group of alike tensors
    from gpuckpt.planning.uniform import box_fingerprints, tensor_groups

    GROUPED = True
except ImportError:
    GROUPED = False

try:  # each rank stores its block of the chunk table (format version 5)
    import pickle

    from gpuckpt.format.records import TABLE_MIN_CHUNKS, encode_rows, table_documents
    from gpuckpt.planning.table import table_layout
    from gpuckpt.saving.table_blocks import BlockReport, encode_block, merge_blocks

    BLOCKS = True
except ImportError:
    BLOCKS = False

try:  # the code of issue 22
    from gpuckpt.format.records import encode_table
    from gpuckpt.planning.plan import merge_values
    from gpuckpt.planning.uniform import compact_description
    from gpuckpt.saving.commit import table_columns, uses_table

    NEW = True
except ImportError:  # an older gpuckpt: the before-figures
    NEW = False

ROWS, COLS = 4096, 1024
TARGETS = {"save": 1.0, "cached": 0.1, "root_mib": 5.0, "load": 0.2}


def rows_for(ranks: int) -> int:
    """Rows of each tensor: 4,096, or one per rank beyond 4,096 ranks (every rank holds rows)."""
    return max(ROWS, ranks)


def _cuts(ranks: int, irregular: bool) -> np.ndarray:
    rows = rows_for(ranks)
    if irregular:
        # uneven row shards: every rank's share differs a little from the next one's
        cuts = np.cumsum([0] + [rows // ranks + (1 if r % 2 else -1) for r in range(ranks)])
        cuts[-1] = rows
        return cuts
    return np.arange(ranks + 1) * (rows // ranks)


def describe_rank(
    rank: int, ranks: int, names: list[str], cuts: np.ndarray, props: TensorProperties
) -> StateDescription:
    """What rank ``rank`` describes: a row shard of every tensor named, and the replicated norm."""
    rows = rows_for(ranks)
    lo, hi = int(cuts[rank]), int(cuts[rank + 1])
    box = (((lo, 0), (hi - lo, COLS)),)
    mine = [LocalTensor(name, (rows, COLS), "float32", 4, props, box) for name in names]
    mine.append(LocalTensor("model.norm", (COLS,), "float32", 4, props, (((0,), (COLS,)),)))
    return StateDescription(tuple(mine), {"step": {"int": "1"}} if rank == 0 else {}, {"d": []})


def describe(ranks: int, tensors: int, irregular: bool) -> list[StateDescription]:
    props = TensorProperties(dtype=np.dtype("float32"))
    names = [f"model.layers.{i}.weight" for i in range(tensors)]
    cuts = _cuts(ranks, irregular)
    return [describe_rank(r, ranks, names, cuts, props) for r in range(ranks)]


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def _root_and_table(plan: Any, parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[bytes, list[Any], Any]:
    crcs = table_columns(plan, parts)["crc32c"]
    entry, documents, table = encode_table({"crc32c": crcs}) if uses_table(plan) else (None, [], [])
    md = assemble_metadata(plan, crcs, "bench", entry)
    return root_document(md), table, documents


def _blocks_root(plan: Any, layout: Any, reports: list[Any]) -> tuple[bytes, list[Any], Any]:
    """Rank 0's commit of a save whose ranks stored their blocks of the table: the reports
    checked and merged, the tail encoded, the Metadata and the root document."""
    entry, tail, columns = merge_blocks(plan, layout, reports)
    md = assemble_metadata(plan, columns, "bench", entry, layout=layout)
    return root_document(md), tail, table_documents(layout.columns, layout.rows, layout.chunk_rows)


def _block_reports(plan: Any, layout: Any, rng: Any) -> tuple[list[Any], list[Any], float, Any]:
    """Every rank's report of a save ordered in blocks (rank 0's made by the code a rank runs, timed;
    the others' blocks encoded alike from simulated checksums), every block's stored chunks, the
    time one rank takes, and rank 0's report."""
    rows0 = np.fromiter((a.row for a in plan.assignments_of(0)), np.int64)
    cols0 = {"crc32c": rng.integers(0, 2**32, len(rows0), dtype=np.uint32)}
    (parts0, report0), per_rank = _best(encode_block, layout, 0, rows0, cols0)
    tail_start = layout.blocks * layout.block_rows
    others = np.setdiff1d(np.arange(tail_start, layout.rows), report0.tail_rows)
    reports = [report0]
    if len(others):  # the tail chunks of other ranks (the replicated tensor where rank 0 does not write it)
        vals = {"crc32c": rng.integers(0, 2**32, len(others), dtype=np.uint32)}
        reports.append(BlockReport(None, {}, others, vals, np.zeros(0, np.int64), np.empty(0, object)))
    stored = list(parts0)
    for b in range(layout.blocks):
        if b == report0.block:
            continue
        block = np.zeros(layout.block_rows, np.uint32)
        block[: layout.used] = rng.integers(0, 2**32, layout.used, dtype=np.uint32)
        parts = encode_rows({"crc32c": block}, b * layout.block_rows, layout.chunk_rows)["crc32c"]
        stored.extend(parts)
        reports.append(
            BlockReport(
                b,
                {"crc32c": [p.crc for p in parts]},
                np.zeros(0, np.int64),
                {"crc32c": np.zeros(0, np.uint32)},
                np.zeros(0, np.int64),
                np.empty(0, object),
            )
        )
    return reports, stored, per_rank, report0


def _load_figure(plan: Any, doc: bytes, documents: list[Any], table: list[Any], rank_box: Any) -> float:
    """Seconds to read what one rank needs of the metadata, from files in a temporary directory."""
    from gpuckpt.format.checksum import crc32c
    from gpuckpt.format.reader import read_index
    from gpuckpt.loading.checks import load_chunk_records
    from gpuckpt.storage.stores import open_reader

    where = tempfile.mkdtemp(prefix="bench-planning-")
    try:
        for name, body in documents:
            os.makedirs(os.path.join(where, name), exist_ok=True)
            with open(os.path.join(where, name, "zarr.json"), "wb") as f:
                f.write(body)
        for p in table:
            with open(os.path.join(where, p.name, p.key), "wb") as f:
                f.write(p.data)
                f.write(crc32c(p.data).to_bytes(4, "little"))
        with open(os.path.join(where, "zarr.json"), "wb") as f:
            f.write(doc)
        t0 = time.perf_counter()
        reader = open_reader(where)
        tensors = read_index(metadata_json(reader.read_root(), "zarr.json")).tensors
        entries = list(tensors.values())
        load_chunk_records(reader, entries)
        n = 0
        for t in entries:
            box = rank_box if len(t.shape) == 2 else ((0,), t.shape)
            for coords in overlapping_chunks(t.grid, box):
                n += t.chunk(coords).crc >= 0
        elapsed = time.perf_counter() - t0
        assert n >= len(entries)
        return elapsed
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _best(fn: Any, *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and its time: the least of seven runs when one takes under a second (the
    machine is shared: the least is the one least disturbed), else of the one run."""
    out, best = _timed(fn, *args)
    if best < 1.0:
        for _ in range(6):
            best = min(best, _timed(fn, *args)[1])
    return out, best


def simulate_new(ranks: int, tensors: int, irregular: bool) -> dict[str, float]:
    """One save and one load of ``ranks`` simulated ranks. The ranks are described one at a time
    (twice where grouped: once for the fingerprints, once for the groups) so that no more than
    one rank's description is held at once: 16,384 ranks x 1,000 tensors fit in memory."""
    props = TensorProperties(dtype=np.dtype("float32"))
    names = [f"model.layers.{i}.weight" for i in range(tensors)]
    cuts = _cuts(ranks, irregular)
    values: list[tuple[Any, Any]] = []  # every rank's (objects, skeleton)
    per_rank_describe = 0.0
    received: list[Any] = []
    reduce_share = 0.0
    if GROUPED:
        # every rank fingerprints its boxes; the XOR over the ranks is one reduction in the
        # transport (a tree: rank 0 XORs log2(ranks) arrays of tensors x 16 bytes, timed below);
        # then every rank finds the groups, checks them and sends one box per group
        combined: np.ndarray | None = None
        first: np.ndarray | None = None
        for r in range(ranks):
            d = describe_rank(r, ranks, names, cuts, props)
            values.append((d.objects, d.skeleton))
            t0 = time.perf_counter()
            prints = box_fingerprints(compact_description(d.tensors, d.objects, d.skeleton), r)
            per_rank_describe += time.perf_counter() - t0
            combined = prints.copy() if combined is None else np.bitwise_xor(combined, prints, out=combined)
            first = prints if first is None else first
        assert combined is not None and first is not None
        one_xor = _best(lambda: np.bitwise_xor(combined, first))[1]
        reduce_share = one_xor * math.ceil(math.log2(max(2, ranks)))
        for r in range(ranks):
            d = describe_rank(r, ranks, names, cuts, props)
            c = compact_description(d.tensors, d.objects, d.skeleton)  # timed in the first pass
            t0 = time.perf_counter()
            g = c.grouped(tensor_groups(combined, d.tensors))
            per_rank_describe += time.perf_counter() - t0
            received.append(g if r == 0 else g.without_tensors())
    else:
        for r in range(ranks):
            d = describe_rank(r, ranks, names, cuts, props)
            values.append((d.objects, d.skeleton))
            t0 = time.perf_counter()
            c = compact_description(d.tensors, d.objects, d.skeleton)
            per_rank_describe += time.perf_counter() - t0
            received.append(c if r == 0 else c.without_tensors())
    sent_bytes = max(len(g.boxes) for g in received[1:]) if ranks > 1 else 0
    plan, planned = _best(lambda: plan_save(received, chunk_bytes=64 << 20))
    planned += reduce_share
    # each rank's checksums: a block of as many rows as it writes (rank 0 gets the replicated tensor too)
    mine0, per_rank_list = _best(plan.assignments_of, 0)
    sizes = [len(mine0)] + [(plan.nchunks - len(mine0)) // max(1, ranks - 1)] * (ranks - 1)
    sizes[-1] += plan.nchunks - sum(sizes)
    rng = np.random.default_rng(0)
    crcs = rng.integers(0, 2**32, plan.nchunks, dtype=np.uint32)
    starts = np.cumsum([0, *sizes])
    parts = [(np.arange(a, b, dtype=np.int64), crcs[a:b]) for a, b in itertools.pairwise(starts.tolist())]
    layout = table_layout(plan, min_chunks=TABLE_MIN_CHUNKS) if BLOCKS else None
    rank_block = 0.0
    if layout is None:
        (doc, table, documents), commit = _best(_root_and_table, plan, parts)
        # what rank 0 receives of the table: every chunk's row and checksum (12 bytes a chunk)
        received = (plan.nchunks - len(mine0)) * 12

        def commit_cached(p: Any) -> None:
            _root_and_table(p, parts)
    else:
        reports, blocks, rank_block, report0 = _block_reports(plan, layout, rng)
        (doc, tail, documents), commit = _best(_blocks_root, plan, layout, reports)
        table = blocks + tail
        received = sum(len(pickle.dumps(r)) for r in reports if r is not report0)

        def commit_cached(p: Any) -> None:
            _blocks_root(p, layout, reports)

    def cache_hit() -> None:
        # the previous plan with this save's values and skeleton, then the same commit work
        objects, skeleton = merge_values(values)
        commit_cached(dataclasses.replace(plan, objects=objects, skeleton=skeleton))

    _, cached = _best(cache_hit)
    rank = ranks // 2
    per = rows_for(ranks) // ranks
    load = min(_load_figure(plan, doc, documents, table, ((rank * per, 0), (per, COLS))) for _ in range(3))
    table_bytes = sum(len(p.data) + 4 for p in table)
    return {
        "chunks": plan.nchunks,
        "planning": planned,
        "save": planned + commit,
        "cached": cached,
        "root_mib": len(doc) / 2**20,
        "table_mib": table_bytes / 2**20,
        "load": load,
        "rank_describe": per_rank_describe / ranks,
        "sent_kib": sent_bytes / 1024,
        "received_mib": received / 2**20,
        "rank_block": rank_block,
        "blocks": 0 if layout is None else layout.blocks,
        "rank_list": per_rank_list,
    }


def simulate_old(ranks: int, tensors: int, irregular: bool) -> dict[str, float]:
    descs = describe(ranks, tensors, irregular)
    t0 = time.perf_counter()
    plan = plan_save(descs, chunk_bytes=64 << 20)
    planned = time.perf_counter() - t0
    results = {(t.name, s.coords): (math.prod(s.sizes) * 4 + 4, 0) for t in plan.tensors for s in t.specs}
    t1 = time.perf_counter()
    md = assemble_metadata(plan, results, "bench")
    doc = root_document(md)
    save = planned + time.perf_counter() - t1
    t2 = time.perf_counter()
    from gpuckpt.format.reader import read_index

    read_index(metadata_json(doc, "zarr.json"))
    load = time.perf_counter() - t2
    nchunks = sum(len(t.specs) for t in plan.tensors)
    return {"chunks": nchunks, "planning": planned, "save": save, "root_mib": len(doc) / 2**20, "load": load}


def report(label: str, ranks: int, tensors: int, irregular: bool = False) -> dict[str, float]:
    r = (simulate_new if NEW else simulate_old)(ranks, tensors, irregular)
    line = (
        f"{label:10s} {ranks:5d} x {tensors:5d} ({int(r['chunks']):8d} chunks): planning {r['planning']:6.3f} s, "
        f"save {r['save']:6.3f} s ({r['save'] / TARGETS['save']:.2f} of target)"
    )
    if NEW:
        line += f", cached {r['cached']:6.3f} s ({r['cached'] / TARGETS['cached']:.2f})"
    line += f", root {r['root_mib']:6.2f} MiB ({r['root_mib'] / TARGETS['root_mib']:.2f})"
    if NEW:
        line += f" + table {r['table_mib']:.2f} MiB"
    line += f", load {r['load']:6.3f} s ({r['load'] / TARGETS['load']:.2f})"
    if NEW:
        line += (
            f"; per rank: describe {r['rank_describe'] * 1e3:.1f} ms, list chunks {r['rank_list'] * 1e3:.1f} ms, "
            f"sends {r['sent_kib']:.1f} KiB of boxes"
        )
        if "received_mib" in r:
            form = f"{int(r['blocks'])} blocks, each rank's stored by it" if r["blocks"] else "gathered"
            line += (
                f"; chunk table {form}: rank 0 receives {r['received_mib']:.2f} MiB of records, "
                f"a rank's block {r['rank_block'] * 1e3:.1f} ms"
            )
    print(line, flush=True)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="only the full size, no growth rows")
    ap.add_argument("--irregular", action="store_true", help="add the irregular (uneven boxes) row")
    args = ap.parse_args(argv)
    # gpuckpt.save runs with the cyclic collector paused (gpuckpt.api.save_with_options): so does this
    gc.disable()
    print(
        f"{platform.node()}, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, python {platform.python_version()}, "
        f"{'grouped planning' if NEW else 'planning before grouped boxes'}"
    )
    full = report("regular", args.ranks, args.tensors)
    if not args.quick:
        half_r = report("regular", args.ranks // 2, args.tensors)
        quarter_r = report("regular", args.ranks // 4, args.tensors)
        half_t = report("regular", args.ranks, args.tensors // 2)
        print(
            f"doubling the ranks multiplied the save time by {half_r['save'] / quarter_r['save']:.2f} "
            f"({args.ranks // 4} -> {args.ranks // 2}) and {full['save'] / half_r['save']:.2f} "
            f"({args.ranks // 2} -> {args.ranks}), doubling the tensors by {full['save'] / half_t['save']:.2f} "
            "(2.0 = linear)"
        )
    if args.irregular:
        report("irregular", args.ranks, args.tensors, irregular=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
