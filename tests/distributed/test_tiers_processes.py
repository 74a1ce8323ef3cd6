"""The local tier across real processes: 4 ranks as 2 simulated nodes under mpiexec and gloo.

A node's ranks are killed with SIGKILL while their last step is being written, replicated
and drained; the node's tier is wiped (a replaced node) and the root moved away (tests run
as root: permissions prove nothing), and 4 new ranks restore bit-exact from the tiers,
the replaced node's parts coming from the ranks that hold their replicas.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

import pytest

from gpuckpt.distributed import run_ranks
from gpuckpt.format.parts import part_name
from gpuckpt.testing.faults import fault_shim_env

SCRIPT = "tier_ranks.py"
PEERS = {"0": ["local", None], "1": ["local", None], "2": ["peer", 0], "3": ["peer", 1]}


def _replace_node_and_hide_root(base: Path) -> None:
    shutil.rmtree(base / "n1", ignore_errors=True)
    shutil.move(base / "root", base / "root-moved-away")


@pytest.mark.parametrize("kill_at", [4, 5])
def test_mpi_ranks_killed_mid_save_resume_from_the_tiers(run_mpi: Any, tmp_path: Path, kill_at: int) -> None:
    killed = run_mpi(4, SCRIPT, "mpi", "train", tmp_path, 8, kill_at, timeout=120)
    assert killed.returncode != 0 and not killed.results, killed.describe()
    _replace_node_and_hide_root(tmp_path)
    restored = run_mpi(4, SCRIPT, "mpi", "restore", tmp_path, timeout=120).check(4)
    steps = {r["step"] for r in restored.values()}
    assert len(steps) == 1, restored  # every rank resumes from the same step
    (step,) = steps
    assert kill_at - 2 <= step <= kill_at, restored  # at least the step waited for
    for rank, r in restored.items():
        assert r["exact"] and r["source"] == "tiers" and r["parts"] == PEERS, (rank, r)
    assert not any((tmp_path / "root").iterdir())


@pytest.mark.parametrize(
    "event",
    [
        "snapshot:2",
        "chunk:3",
        "chunk:9",
        "array-doc:5",
        "root-write:2",
        "publish:4",
        "transfer:2",
        "retention:3",
    ],
)
def test_mpi_ranks_killed_at_a_kill_point_resume_from_the_tiers(
    run_mpi: Any, tmp_path: Path, event: str
) -> None:
    """Kill points in a part's snapshot, its write (chunks, documents, root document,
    publication), its replication round and retention, of later steps and of drains alike."""
    killed = run_mpi(4, SCRIPT, "mpi", "killed", tmp_path, 3, event, timeout=120)
    assert killed.returncode != 0 and not killed.results, killed.describe()
    _replace_node_and_hide_root(tmp_path)
    restored = run_mpi(4, SCRIPT, "mpi", "restore", tmp_path, timeout=120).check(4)
    (step,) = {r["step"] for r in restored.values()}
    assert step >= 3, restored
    for rank, r in restored.items():
        assert r["exact"] and r["source"] == "tiers" and r["parts"] == PEERS, (rank, r)


def test_mpi_ranks_restore_from_their_own_tiers(run_mpi: Any, tmp_path: Path) -> None:
    trained = run_mpi(4, SCRIPT, "mpi", "train", tmp_path, 5, 0, timeout=120).check(4)
    assert all(r["local"][-1] == 5 for r in trained.values()), trained
    restored = run_mpi(4, SCRIPT, "mpi", "restore", tmp_path, timeout=120).check(4)
    for rank, r in restored.items():
        assert r["step"] == 5 and r["exact"] and r["parts"] == {str(k): ["local", None] for k in range(4)}, (
            rank,
            r,
        )


def test_a_tier_that_refuses_space_for_a_replica_fails_the_step_not_the_process(
    run_mpi: Any, load_script: Any, shim: Path, tmp_path: Path
) -> None:
    """Replicas' large files are received straight into mapped files of the tier: there a full
    tmpfs would be a SIGBUS when the transport writes, so the files' pages are allocated
    first. With the tier of node n1 refusing space (posix_fallocate: ENOSPC) from step 2's
    replicas on, the step fails on every rank naming the full device, the processes live on,
    and step 1 restores bit-exact."""
    from gpuckpt.tiers.files import COPIED_MAX_BYTES

    tiers = load_script("tier_ranks")
    scratch = tmp_path / "layout"  # how many mapped files one part has (the nth allocation fails)
    run_ranks(4, lambda c: tiers.save_full(c, str(scratch)), timeout=120)
    sizes = [
        sum(
            1
            for f in (scratch / "n0" / part_name(1, r)).rglob("*")
            if f.is_file() and f.stat().st_size >= COPIED_MAX_BYTES
        )
        for r in (0, 1)
    ]
    assert sizes[0] == sizes[1] >= 1, sizes  # ranks 2 and 3 each receive one such part a step
    base = tmp_path / "job"
    (base / "n1").mkdir(parents=True)
    env = fault_shim_env(shim, base / "n1", "fallocate", nth=sizes[0] + 1, err=errno.ENOSPC)
    job = run_mpi(4, SCRIPT, "mpi", "full", base, timeout=120, env=env).check(4)
    for rank, r in job.items():
        assert sorted(r["failed"]) == ["2", "3"], (rank, r)
        assert all("No space left on device" in m and str(base / "n1") in m for m in r["failed"].values()), (
            rank,
            r,
        )
        assert r["restored"] == 1 and r["exact"] and r["local"] == [1], (rank, r)
    assert not [p for p in (base / "n1").iterdir() if p.name.startswith(".recv-")]


@pytest.mark.torch
@pytest.mark.parametrize("event", ["mid-save", "transfer:2"])
def test_gloo_ranks_killed_resume_from_the_tiers(run_torch: Any, tmp_path: Path, event: str) -> None:
    """The same failures over torch.distributed (gloo): node n1's ranks SIGKILLed right after a
    save returned (its part's write, replication or drain in flight) and at the start of a
    replication round over gloo; the other ranks are then killed as a launcher would; 4 new
    ranks restore from the tiers, the replaced node's parts from their holders. (The other
    kill points are the MPI tests': they do not depend on the transport.)"""
    if event == "mid-save":
        killed = run_torch(4, SCRIPT, "torch", "train", tmp_path, 8, 5, timeout=180, fail_fast=True)
    else:
        killed = run_torch(4, SCRIPT, "torch", "killed", tmp_path, 3, event, timeout=180, fail_fast=True)
    assert killed.returncode != 0 and not {2, 3} & set(killed.results), killed.describe()
    _replace_node_and_hide_root(tmp_path)
    restored = run_torch(4, SCRIPT, "torch", "restore", tmp_path, timeout=180).check(4)
    (step,) = {r["step"] for r in restored.values()}
    assert step >= 3, restored
    for rank, r in restored.items():
        assert r["exact"] and r["source"] == "tiers" and r["parts"] == PEERS, (rank, r)


@pytest.mark.torch
def test_gloo_ranks_of_a_replaced_node_get_their_parts_from_peers(run_torch: Any, tmp_path: Path) -> None:
    run_torch(4, SCRIPT, "torch", "train", tmp_path, 5, 0, timeout=180).check(4)
    _replace_node_and_hide_root(tmp_path)
    restored = run_torch(4, SCRIPT, "torch", "restore", tmp_path, timeout=180).check(4)
    for rank, r in restored.items():
        assert r["step"] == 5 and r["exact"] and r["source"] == "tiers" and r["parts"] == PEERS, (rank, r)


@pytest.mark.torch
def test_a_dcp_state_dict_of_dtensors_goes_through_the_tiers(run_torch: Any, tmp_path: Path) -> None:
    """DCP code reaches the tiers by handing its state dict (DTensors and plain values) to the
    manager: each rank's shards are its part; a replaced node's come from its peers."""
    run_torch(4, "dtensor_tiers.py", "train", tmp_path, timeout=180).check(4)
    _replace_node_and_hide_root(tmp_path)
    restored = run_torch(4, "dtensor_tiers.py", "restore", tmp_path, timeout=180).check(4)
    for rank, r in restored.items():
        assert r == {
            "step": 3,
            "w": True,
            "b": True,
            "values": [{"lr": 0.30000000000000004, "betas": [0.9, 0.999]}, 3],
            "source": "tiers",
        }, (rank, r)
    # the replaced node's shards went straight into the DTensors' local tensors (placement): its
    # tier holds no part until the next save
    assert not [p for p in (tmp_path / "n1").iterdir() if not p.name.startswith(".")]
