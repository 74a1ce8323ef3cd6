"""Ctrl-C in a tiered CheckpointManager's save loop, in real MPI jobs (4 ranks as 2 nodes): every
rank's ``close()`` returns or raises a gpuckpt error within a few seconds, never hangs.

See ``scripts/interrupted_manager.py`` for where each mode interrupts which ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

SCRIPT = "interrupted_manager.py"


@pytest.mark.parametrize("mode", ["gathering", "snapshot"])
def test_an_interrupt_on_one_rank_in_a_save_fails_the_next_call_on_every_rank(
    run_mpi: Any, tmp_path: Path, mode: str
) -> None:
    # rank 0's save of step 3 had stopped after its collective, without handing the step to its
    # tier: the other ranks' tier threads waited for it in their replication, and every
    # close() (theirs in that wait, rank 0's in its collective) hung
    job = run_mpi(4, SCRIPT, mode, tmp_path, timeout=90)
    results = job.check(4)
    r0 = results[0]
    assert r0["raised"] == {"3": "KeyboardInterrupt"}, r0
    assert r0["close"].startswith("CoordinatorError: the ranks are in different calls"), r0
    for rank in (1, 2, 3):
        res = results[rank]
        assert res["raised"] == {"4": "CoordinatorError"}, (rank, res)
        assert res["close"] == "ok", (rank, res)  # out of step: closed without a collective
    assert all(res["close_s"] < 10 for res in results.values()), results


def test_ranks_interrupted_before_and_after_one_another_s_collective_stop_at_the_same_step(
    run_mpi: Any, tmp_path: Path
) -> None:
    # rank 0's interrupt, held in its save's collective, is raised once that save is over: the
    # ranks interrupted as their next save began stopped at the same point, and close together
    job = run_mpi(4, SCRIPT, "everyone", tmp_path, timeout=90)
    results = job.check(4)
    assert results[0]["raised"] == {"3": "KeyboardInterrupt"}, results
    for rank in (1, 2, 3):
        assert results[rank]["raised"] == {"4": "KeyboardInterrupt"}, (rank, results[rank])
    assert all(res["close"] == "ok" and res["close_s"] < 10 for res in results.values()), results


def test_a_close_after_an_interrupt_that_the_others_never_join_gives_up_at_the_grace(
    run_mpi: Any, tmp_path: Path
) -> None:
    # ranks 1-3 closed while handling the interrupt (without a collective); rank 0's close
    # waited in its collective for them for good
    job = run_mpi(4, SCRIPT, "alone", tmp_path, timeout=90)
    # the job ends without MPI_Finalize (rank 0's collective stays open): mpiexec may kill, with
    # SIGKILL, a rank still exiting once another has gone, so its exit status says nothing here
    results = job.results
    assert sorted(results) == [0, 1, 2, 3] and not any("error" in r for r in results.values()), job.describe()
    r0 = results[0]
    assert r0["raised"] == {"3": "KeyboardInterrupt"}, r0
    assert r0["close"].startswith("CoordinatorError: rank 0 joined, after an interrupt"), r0
    assert 1.0 < r0["close_s"] < 5, r0  # the grace (1 s here), then out of step
    for rank in (1, 2, 3):
        res = results[rank]
        assert res["raised"] == {"3": "KeyboardInterrupt"} and res["close"] == "ok", (rank, res)
