"""Plan caching across saves, and resharded loads of both format versions, with threads and under mpiexec."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.distributed import run_ranks
from gpuckpt.distributed.save import plan_cache_info

SCRIPT = "plan_cache.py"
FIXTURE_V1 = Path(__file__).resolve().parents[1] / "fixtures" / "format-v1"

# a, c and big are planned (c and big: their layout changed), b and d reuse the plan before them
CACHE = {
    "hits_after_same_layout": 1,
    "after_changed_layout": [1, 2],
    "hits": 2,
    "misses": 3,
    "big_has_chunk_table": True,
    "big_version": "5",  # one run of rows per rank: the chunk table in blocks
}


def test_same_layout_reuses_the_plan_with_threads(load_script: Any, tmp_path: Path) -> None:
    module = load_script("plan_cache")
    path = str(tmp_path)
    assert run_ranks(4, lambda c: module.cache_rank(c, path)) == [CACHE] * 4
    assert run_ranks(3, lambda c: module.load_rank(c, path)) == [module.expected_loaded()] * 3


def test_plan_cache_and_both_format_versions_under_mpiexec(
    run_mpi: Any, load_script: Any, tmp_path: Path
) -> None:
    module = load_script("plan_cache")
    saved = run_mpi(4, SCRIPT, "cache", tmp_path, timeout=90).check(4)
    assert all(r == CACHE for r in saved.values()), saved
    loaded = run_mpi(3, SCRIPT, "load", tmp_path, timeout=90).check(3)
    assert all(r == module.expected_loaded() for r in loaded.values()), loaded
    v1 = run_mpi(4, SCRIPT, "load_v1", FIXTURE_V1, timeout=60).check(4)
    assert all(r == {"rows_match": True, "version": "1"} for r in v1.values()), v1


@pytest.mark.parametrize("n", [2, 3])
def test_a_layout_changed_on_one_rank_only_is_planned_again(load_script: Any, tmp_path: Path, n: int) -> None:
    module = load_script("sharded_save_load")

    def rank(c: Any) -> tuple[int, int, bool]:
        gpuckpt.save(module.save_layout(c.rank, c.world_size), str(tmp_path / "a"), coordinator=c)
        state = module.save_layout(c.rank, c.world_size)
        # the last rank now holds the whole of a new tensor, the others an empty box of it
        mine = np.arange(3.0) if c.rank == n - 1 else np.zeros(0)
        state["late"] = gpuckpt.ShardedArray(mine, (0,), (3,))
        gpuckpt.save(state, str(tmp_path / "b"), coordinator=c)
        info = plan_cache_info(c)
        return (
            info.hits,
            info.misses,
            bool(np.array_equal(gpuckpt.load_state_dict(tmp_path / "b")["late"], mine)),
        )

    outcome = run_ranks(n, rank)
    assert [o[:2] for o in outcome] == [(0, 2)] * n
    assert outcome[-1][2]


def test_a_rank_without_the_cached_plan_makes_every_rank_plan_again(load_script: Any, tmp_path: Path) -> None:
    from gpuckpt.distributed.threads import ThreadCoordinator

    module = load_script("sharded_save_load")

    def rank(c: Any) -> tuple[int, int, bool]:
        gpuckpt.save(module.save_layout(c.rank, 3), str(tmp_path / "a"), coordinator=c)
        # rank 1 goes on through a new coordinator of the same group: it holds no cached plan
        mine = ThreadCoordinator(c.group, c.rank) if c.rank == 1 else c
        state = module.save_layout(c.rank, 3)
        state["step"] = 9
        gpuckpt.save(state, str(tmp_path / "b"), coordinator=mine)
        info = plan_cache_info(c)
        return info.hits, info.misses, gpuckpt.load_state_dict(tmp_path / "b")["step"] == 9

    assert run_ranks(3, rank, timeout=30) == [(0, 2, True), (0, 1, True), (0, 2, True)]
