"""Incremental saves under mpiexec: each rank reuses its own unchanged chunks; the result equals a
save of the same state without a base."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import gpuckpt
from gpuckpt.verify import verify_checkpoint

SCRIPT = "incremental_save.py"


def chunk_links(path: Path) -> dict[str, tuple[int, int]]:
    return {
        f"{d.name}/{f.name}": (f.stat().st_ino, f.stat().st_nlink)
        for d in path.iterdir()
        if d.is_dir()
        for f in d.iterdir()
        if f.name != "zarr.json"
    }


def test_incremental_save_from_3_ranks(run_mpi: Any, load_script: Any, tmp_path: Path) -> None:
    module = load_script("incremental_save")
    p0, p1, full = tmp_path / "step0", tmp_path / "step1", tmp_path / "full1"
    run_mpi(3, SCRIPT, "first", p0, timeout=60).check(3)
    run_mpi(3, SCRIPT, "next", p1, p0, timeout=60).check(3)
    run_mpi(3, SCRIPT, "full", full, timeout=60).check(3)
    l0, l1 = chunk_links(p0), chunk_links(p1)
    frozen = {k for k in l1 if k.startswith("frozen/")}
    adapter = {k for k in l1 if k.startswith("adapter/")}
    # the frozen tensor spans every rank's rows: each rank linked its own chunks
    assert len(frozen) >= 3 and all(l1[k] == (l0[k][0], 2) for k in frozen)
    assert adapter and all(l1[k][1] == 1 and l1[k][0] != l0[k][0] for k in adapter)
    # the same metadata as a save of the same state without a base (hashes included)
    sd1 = gpuckpt.read_metadata(p1).storage_data
    sdf = gpuckpt.read_metadata(full).storage_data
    assert sd1["tensors"] == sdf["tensors"] and sd1["content_hash"] == sdf["content_hash"]
    got = gpuckpt.load_state_dict(p1)
    for k, v in module.global_state(1).items():
        assert np.array_equal(got[k], v), k
    assert verify_checkpoint(p1).ok


def test_incremental_save_of_a_chunk_table_from_3_threads(tmp_path: Path) -> None:
    """3 ranks (threads), 4,200 chunks: the hashes every rank reports go to the chunk table, and
    the next save (the same layout: a plan cache hit) links each rank's unchanged chunks."""
    from gpuckpt.distributed import run_ranks
    from gpuckpt.distributed.save import plan_cache_info
    from gpuckpt.format.records import TABLE_KEY

    full = np.arange(4200 * 4, dtype=np.float32).reshape(4200, 4)

    def rank(c: Any) -> tuple[int, int]:
        rows = slice(c.rank * 1400, (c.rank + 1) * 1400)
        mine = full[rows].copy()
        gpuckpt.save(
            {"w": gpuckpt.ShardedArray(mine, (rows.start, 0), full.shape)},
            str(tmp_path / "c0"),
            coordinator=c,
            chunk_bytes=16,
            content_hash=True,
        )
        if c.rank == 1:
            mine[3] = -1  # global row 1403
        gpuckpt.save(
            {"w": gpuckpt.ShardedArray(mine, (rows.start, 0), full.shape)},
            str(tmp_path / "c1"),
            coordinator=c,
            chunk_bytes=16,
            base=str(tmp_path / "c0"),
        )
        info = plan_cache_info(c)
        return info.hits, info.misses

    assert run_ranks(3, rank) == [(1, 1)] * 3
    md = gpuckpt.read_metadata(tmp_path / "c1")
    assert md.version == "2" and set(md.storage_data[TABLE_KEY]["columns"]) == {"crc32c", "xxh3t", "head"}
    l0, l1 = chunk_links(tmp_path / "c0"), chunk_links(tmp_path / "c1")
    chunks = {k for k in l1 if k.startswith("w/")}
    assert len(chunks) == 4200
    assert {k for k in chunks if l1[k][0] != l0[k][0]} == {"w/c.1403.0"}
    want = full.copy()
    want[1403] = -1
    assert np.array_equal(gpuckpt.load_state_dict(tmp_path / "c1")["w"], want)
