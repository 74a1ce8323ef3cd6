"""A local tier holds the steps of one root: a manager never restores, counts or retires the
steps another root left in its ``local_dir`` (a reused tier). The tier records its root's
canonical name (``local_dir/.root``: the resolved path, or the URL), and a manager whose root
is another, or a tier whose steps name no root, is refused on every rank with an
``InvalidOptionError`` naming the local_dir, both roots and the fix. The root is never read
for it: a replaced node's restore with the root moved away is unchanged
(``test_tiers_processes.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt

SCRIPT = "tier_lifecycle.py"


@pytest.mark.parametrize("wiped", [None, "n0", "n1"])
def test_mpi_a_tier_holding_another_roots_steps_is_refused_on_every_rank(
    run_mpi: Any, tmp_path: Path, wiped: str | None
) -> None:
    """4 ranks on 2 nodes: run A saves and closes; a job on root B with the same local_dirs is
    refused on every rank, also where only one node's tier holds A's steps (the other one
    replaced), and nothing of A is restored; run A itself then restores from its tiers."""
    root_a, root_b = tmp_path / "runA", tmp_path / "runB"
    run_mpi(4, SCRIPT, "mpi", "train", tmp_path, root_a, 3, timeout=120).check(4)
    if wiped is not None:
        shutil.rmtree(tmp_path / wiped)
    holder = "n1" if wiped == "n0" else "n0"
    refused = run_mpi(4, SCRIPT, "mpi", "open", tmp_path, root_b, timeout=120).check(4)
    for rank, r in refused.items():
        assert r.get("refused") == "InvalidOptionError", (rank, r)
        message = r["message"]
        assert f"local_dir {tmp_path / holder} " in message, (rank, message)
        assert f"of another root, {root_a}" in message and f"root is {root_b}" in message, (rank, message)
        assert "its own local_dir" in message, (rank, message)
    assert not any(root_b.iterdir())
    again = run_mpi(4, SCRIPT, "mpi", "open", tmp_path, root_a, timeout=120).check(4)
    for rank, r in again.items():
        assert r["step"] == 3 and r["exact"] and r["source"] == "tiers", (rank, r)


def _saved(root: Path, tier: Path, steps: int = 3) -> None:
    with gpuckpt.CheckpointManager(root, local_dir=tier, replicas=0, persist_interval_steps=1000) as m:
        for s in range(steps):
            m.save(s, {"w": np.full(4, 100.0 + s), "run": str(root)})


def _restored(root: Path | str, tier: Path) -> tuple[int, dict[str, Any], str | None]:
    with gpuckpt.CheckpointManager(root, local_dir=tier, replicas=0, persist_interval_steps=1000) as m:
        target: dict[str, Any] = {"w": np.zeros(4), "run": None}
        step = m.restore(target)
        assert m.last_restore is not None
        return step, target, m.last_restore.source


def test_a_reused_local_dir_never_gives_another_roots_step(tmp_path: Path) -> None:
    """The outside tester's case: run B on a new, empty root with run A's local_dir is refused
    (it had restored A's step 5); once A's steps are deleted from the tier, B's own steps are
    the tier's, and A, given its root again, is refused in turn."""
    tier, root_a, root_b = tmp_path / "tier", tmp_path / "runA", tmp_path / "runB"
    _saved(root_a, tier, 6)
    with pytest.raises(gpuckpt.InvalidOptionError) as refused:
        _restored(root_b, tier)
    text = str(refused.value)
    assert f"local_dir {tier} " in text and f"another root, {root_a}" in text and f"root is {root_b}" in text
    for part in tier.glob("step_*"):
        shutil.rmtree(part)
    _saved(root_b, tier)
    step, target, source = _restored(root_b, tier)
    assert (step, target["run"], source) == (2, str(root_b), "tiers")
    assert np.array_equal(target["w"], np.full(4, 102.0))
    with pytest.raises(gpuckpt.InvalidOptionError, match="another root"):
        _restored(root_a, tier)


def test_the_same_root_by_another_spelling_keeps_its_tier(tmp_path: Path) -> None:
    """A root's name is its resolved absolute path: a link to it, or a path through ``..``, is
    the same root."""
    tier, root = tmp_path / "tier", tmp_path / "run"
    _saved(root, tier)
    (tmp_path / "link").symlink_to(root)
    (tmp_path / "x").mkdir()
    for spelling in (tmp_path / "link", tmp_path / "x" / ".." / "run"):
        step, target, source = _restored(spelling, tier)
        assert (step, target["run"], source) == (2, str(root), "tiers"), spelling


@pytest.mark.parametrize("record", ["missing", "damaged", "link"])
def test_steps_that_name_no_root_are_refused_until_deleted(tmp_path: Path, record: str) -> None:
    """Steps whose tier has no readable record of its root (saved by an earlier gpuckpt, or
    the record damaged) may be another run's: refused, even for the root that saved them,
    naming the fix; a tier with no steps left takes the manager's root."""
    tier, root = tmp_path / "tier", tmp_path / "run"
    _saved(root, tier)
    kept = tier / ".root"
    if record == "missing":
        kept.unlink()
    elif record == "damaged":
        kept.write_text('{"format": 1, "root": ')
    else:
        kept.unlink()
        (tmp_path / "elsewhere").write_text(json.dumps({"format": 1, "root": str(root)}))
        kept.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(
        gpuckpt.InvalidOptionError, match=r"whose root is unknown.*delete those steps"
    ) as refused:
        _restored(root, tier)
    assert f"local_dir {tier} " in str(refused.value)
    for part in tier.glob("step_*"):
        shutil.rmtree(part)
    mgr = gpuckpt.CheckpointManager(root, local_dir=tier, replicas=0, persist_interval_steps=1000)
    shutil.move(root, tmp_path / "moved")  # (so that nothing of the root is restored)
    with mgr, pytest.raises(gpuckpt.CheckpointNotFoundError):  # (the root's steps are not the tier's)
        mgr.restore({"w": np.zeros(4), "run": None})
    assert not kept.is_symlink() and '"root"' in kept.read_text()
    if record == "link":
        assert json.loads((tmp_path / "elsewhere").read_text()) == {"format": 1, "root": str(root)}
