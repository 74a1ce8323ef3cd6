"""Distributed save and resharded load with ThreadCoordinator ranks (in-process, fast)."""

from __future__ import annotations

import re
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


def _save_each(tmp_path: Path, states: list[dict[str, Any]], **per_rank: list[Any]) -> list[Any]:
    """Every rank saves its own state (and its own options) to ``tmp_path/c``; returns what each
    rank got: the metadata, or the exception it raised."""

    def rank(c: Any) -> Any:
        options = {name: values[c.rank] for name, values in per_rank.items()}
        path = options.pop("path", tmp_path / "c")
        try:
            return gpuckpt.save(states[c.rank], path, coordinator=c, **options)
        except BaseException as exc:
            return exc

    return run_ranks(len(states), rank, timeout=30)


def test_ranks_that_disagree_are_refused_on_every_rank_not_merged_silently(tmp_path: Path) -> None:
    """A tensor on one rank and a plain value on another under one key, or other containers at
    one place, lost one rank's entry; ranks that pass different paths or save options got rank 0's
    silently (or an error that did not say why). Now every rank raises the same typed error naming
    the entry or the setting and the ranks, and nothing is published. Plain values that differ
    are kept from the first rank, with a warning naming them."""
    import numpy as np

    w = np.arange(8.0)
    cases = [
        ([{"x": w}, {"x": 5}], {}, gpuckpt.DistributedError, r"tensor on some ranks and a plain value"),
        (
            [{"opt": [w, w]}, {"opt": {"a": w}}],
            {},
            gpuckpt.DistributedError,
            r"differ in structure at the state\['opt'\]: a list of 2 items on one rank, a dict",
        ),
        (
            [{"w": w}, {"w": w}],
            {"path": [tmp_path / "c", tmp_path / "d"]},
            gpuckpt.InvalidOptionError,
            r"path: '.*/c' on rank 0, '.*/d' on rank 1",
        ),
        (
            [{"w": w}, {"w": w}],
            {"compression": ["zstd", None]},
            gpuckpt.InvalidOptionError,
            r"compression: 'blosc zstd-1 auto 1048576' on rank 0, None on rank 1",
        ),
        (
            [{"w": w}, {"w": w}],
            {"chunk_bytes": [1 << 20, 1 << 10]},
            gpuckpt.InvalidOptionError,
            r"chunk_bytes: 1048576 on rank 0, 1024 on rank 1",
        ),
        (
            [{"w": w}, {"w": w}],
            {"overwrite": [True, False]},
            gpuckpt.InvalidOptionError,
            r"overwrite: True on rank 0, False on rank 1",
        ),
    ]
    for states, per_rank, kind, match in cases:
        got = _save_each(tmp_path, states, **per_rank)
        for r, result in enumerate(got):
            assert isinstance(result, kind), (match, r, result)
            assert re.search(match, str(result)), (match, str(result))
        assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()
    # threads and progress are each rank's own
    got = _save_each(tmp_path, [{"w": w}, {"w": w}], threads=[1, 4])
    assert all(isinstance(r, gpuckpt.Metadata) for r in got), got
    with pytest.warns(
        UserWarning, match=r"1 plain value\(s\) differ between the ranks.*'step' \(ranks \[1\]\)"
    ):
        _save_each(tmp_path, [{"w": w, "step": 100}, {"w": w, "step": 101}], overwrite=[True, True])
    assert gpuckpt.load_state_dict(tmp_path / "c")["step"] == 100


def test_an_interrupt_on_one_rank_fails_the_others_instead_of_leaving_them_waiting(tmp_path: Path) -> None:
    """A KeyboardInterrupt (or SystemExit) on one rank took it out of the save's collectives, and
    the other ranks waited for it forever under MPI; now it joins the error check: the others raise
    a DistributedError naming it, it goes on as a KeyboardInterrupt, nothing is published."""
    import numpy as np

    class Interrupted:
        """An array whose description is interrupted (Ctrl-C while the save reads the state)."""

        @property
        def __array_interface__(self) -> Any:
            raise KeyboardInterrupt

    def rank(c: Any) -> Any:
        value = Interrupted() if c.rank == 1 else np.arange(8.0)
        try:
            gpuckpt.save({"w": np.arange(8.0), f"r{c.rank}": value}, tmp_path / "c", coordinator=c)
        except BaseException as exc:
            return exc
        return None

    got = run_ranks(2, rank, timeout=30)
    assert isinstance(got[0], gpuckpt.DistributedError) and "KeyboardInterrupt" in str(got[0]), got
    assert isinstance(got[1], KeyboardInterrupt), got
    assert not (tmp_path / "c").exists()


def test_a_bad_target_on_one_rank_leaves_every_rank_s_targets_unwritten(tmp_path: Path) -> None:
    """A load with a coordinator (not cooperative: each rank reads its own) checks every rank's
    targets before any rank reads: rank 1's wrong dtype used to fail the load after rank 0 had
    filled its target."""
    import numpy as np

    full = np.arange(16.0, dtype=np.float32).reshape(4, 4)

    def save(c: Any) -> None:
        box = gpuckpt.ShardedArray(full[2 * c.rank : 2 * c.rank + 2], (2 * c.rank, 0), full.shape)
        gpuckpt.save({"w": box}, tmp_path / "c", coordinator=c)

    run_ranks(2, save)

    def load(c: Any) -> Any:
        local = np.zeros((2, 4), np.float64 if c.rank == 1 else np.float32)
        try:
            gpuckpt.load(
                {"w": gpuckpt.ShardedArray(local, (2 * c.rank, 0), full.shape)},
                tmp_path / "c",
                coordinator=c,
                cooperative=False,
            )
        except gpuckpt.DistributedError as exc:
            return exc, local
        return None, local

    got = run_ranks(2, load, timeout=30)
    for exc, local in got:
        assert exc is not None and "DTypeMismatchError" in str(exc) and "convert afterwards" in str(exc), exc
        assert not local.any()  # nothing read on any rank
