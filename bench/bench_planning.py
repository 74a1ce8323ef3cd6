"""Global planning and metadata assembly at scale (pure data, no I/O).

Simulates a job of ``--ranks`` ranks that each hold a row shard of every one of
``--tensors`` tensors, plus one replicated tensor per rank, and times:
planning (:func:`gpuckpt.planning.plan.plan_save`: the grids, every rank's
chunk assignments, the save plan), and assembling and serialising the global Metadata — everything rank 0
does between gathering the descriptions and committing. Prints seconds
(target: under 1 s for 64 ranks x 1,000 tensors) and the growth when the
rank count doubles (linear, not quadratic).

Usage: ``python bench/bench_planning.py [--ranks 64] [--tensors 1000]``
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from datetime import date

import numpy as np

from gpuckpt.metadata import TensorProperties
from gpuckpt.planning.boxes import LocalTensor
from gpuckpt.planning.plan import StateDescription, plan_save
from gpuckpt.storage.layout import root_document
from gpuckpt.writing import assemble_metadata


def simulate(ranks: int, tensors: int, rows: int = 4096, cols: int = 1024) -> float:
    props = TensorProperties(dtype=np.dtype("float32"))
    per = rows // ranks
    descs = []
    for r in range(ranks):
        mine = [
            LocalTensor(
                f"model.layers.{i}.weight", (rows, cols), "float32", 4, props, (((r * per, 0), (per, cols)),)
            )
            for i in range(tensors)
        ]
        mine.append(LocalTensor("model.norm", (cols,), "float32", 4, props, (((0,), (cols,)),)))
        descs.append(StateDescription(tuple(mine), {"step": {"int": "1"}} if r == 0 else {}, {"d": []}))
    t0 = time.perf_counter()
    plan = plan_save(descs, chunk_bytes=64 << 20)
    results = {(t.name, s.coords): (math.prod(s.sizes) * 4 + 4, 0) for t in plan.tensors for s in t.specs}
    md = assemble_metadata(plan, results, "bench")
    assembled = time.perf_counter() - t0
    doc = root_document(md)
    elapsed = time.perf_counter() - t0
    nchunks = sum(len(t.specs) for t in plan.tensors)
    print(
        f"{ranks:4d} ranks x {tensors:5d} tensors: planning + metadata assembly {assembled:6.3f} s; "
        f"with JSON encoding of the root document {elapsed:6.3f} s ({nchunks} chunks, {len(doc) / 2**20:.1f} MiB)"
    )
    return assembled


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--tensors", type=int, default=1000)
    args = ap.parse_args(argv)
    print(f"{platform.node()}, {date.today()}, python {platform.python_version()}")
    half = simulate(args.ranks // 2, args.tensors)
    full = simulate(args.ranks, args.tensors)
    print(f"doubling the ranks multiplied the time by {full / half:.2f} (2.0 = linear, 4.0 = quadratic)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
