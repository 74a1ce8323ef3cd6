"""Cooperative loads by 4 processes: one mpiexec job and gloo jobs (torch suite) run every layout of
``scripts/coop_load.py`` cooperatively and not, count the chunk bytes each process read, and load
damaged, incomplete and budget-bound checkpoints; a gloo job loses a reader mid-load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

SCRIPT = "coop_load.py"
LAYOUTS = ("replicated", "hsdp", "uneven")


def _check_all(results: dict[int, dict[str, Any]]) -> None:
    stored = results[0]["stored"]
    for rank, r in results.items():
        for kind in LAYOUTS:
            coop, solo = r[f"{kind}-coop"], r[f"{kind}-solo"]
            assert coop["exact"] and solo["exact"], (rank, kind)
            assert coop["digests"] == solo["digests"], (rank, kind)
            # the bytes all ranks together read from the store: each chunk once
            assert r[f"{kind}-coop-bytes"] == stored, (rank, kind)
            assert r[f"{kind}-solo-bytes"] > stored, (rank, kind)
        assert r["replicated-solo-bytes"] == 4 * stored
        budget = r["budget"]
        assert budget["exact"] and budget["state"] > 3 * (80 << 10)
        # beyond what a load that reads in place allocates, at most the budget
        assert budget["peak"] - budget["solo_peak"] <= 80 << 10, budget
        damaged = r["damaged"]
        assert (damaged["raised"], damaged["cause"]) == ("DistributedError", "ChecksumError"), damaged
        assert (damaged["cause_fqn"], damaged["cause_key"]) == ("model.w", "c.1.0")
        assert damaged["planned"] and damaged["received_nothing"], damaged  # nothing of the round was sent
        missing = r["missing"]
        assert missing["raised"] == "DistributedError" and "MissingChunkError" in missing["message"]
        assert "chunk c.1.0 of tensor 'model.w'" in missing["message"] and missing["untouched"]


def test_mpi_job(run_mpi: Any, tmp_path: Path) -> None:
    results = run_mpi(4, SCRIPT, "all", tmp_path / "ckpt", "mpi", timeout=120).check(4)
    _check_all(results)


@pytest.mark.torch
def test_gloo_job(run_torch: Any, tmp_path: Path) -> None:
    results = run_torch(4, SCRIPT, "all", tmp_path / "ckpt", "torch", timeout=120).check(4)
    _check_all(results)
    for rank, r in results.items():
        # a group that carries no CPU tensors (NCCL): the load sends its chunks over a gloo duplicate
        nccl = r["nccl"]
        assert nccl["refused"] and "call it on a duplicate()" in nccl["refused"], (rank, nccl)
        assert nccl["duplicate"] and nccl["again_same"] and nccl["exact"], (rank, nccl)
        assert nccl["digests"] == r["hsdp-solo"]["digests"], rank


@pytest.mark.torch
def test_gloo_job_whose_reader_dies(run_torch: Any, tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed as it starts reading its first shared chunk: every other rank raises
    the coordinator's error naming the broken step, and none of them received anything."""
    job = run_torch(4, SCRIPT, "dead", tmp_path / "ckpt", "torch", timeout=120)
    assert sorted(job.results) == [0, 2, 3], job.describe()
    for rank in (0, 2, 3):
        r = job.results[rank]
        assert r["raised"] == "CoordinatorError" and "another rank of the job died" in r["message"], r
        assert r["planned"] and r["received_nothing"], rank
