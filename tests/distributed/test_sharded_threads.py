"""Distributed save and resharded load with ThreadCoordinator ranks (in-process, fast)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import gpuckpt
from gpuckpt.distributed import run_ranks

pytestmark = pytest.mark.skipif(not hasattr(gpuckpt, "ShardedArray"), reason="distributed save not available")


@pytest.mark.parametrize(("n_save", "n_load"), [(1, 2), (2, 3), (3, 4), (4, 2), (5, 1), (3, 3)])
def test_save_with_n_ranks_load_with_m(load_script: Any, tmp_path: Path, n_save: int, n_load: int) -> None:
    module = load_script("sharded_save_load")
    path = str(tmp_path / "ckpt")
    assert run_ranks(n_save, lambda c: module.save_rank(c, path)) == [{"saved": True}] * n_save
    assert run_ranks(n_load, lambda c: module.load_rank(c, path)) == [module.expected_loaded()] * n_load


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_rank_failing_during_save_fails_every_rank(load_script: Any, tmp_path: Path, n: int) -> None:
    module = load_script("sharded_save_load")
    path = str(tmp_path / "ckpt")
    outcome = run_ranks(n, lambda c: module.save_fail_rank(c, path))
    assert all(o["raised"] == "DistributedError" and o["failing_ranks"] == [1] for o in outcome), outcome
    assert not any(o["published"] for o in outcome)
