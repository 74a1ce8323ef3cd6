"""The one save session: a single process, a joined rank and the DCP layer run the same steps,
and the metadata a save returns is made once, whole, and equals what a reader reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.options import SaveOptions
from gpuckpt.planning.plan import plan_save
from gpuckpt.saving.session import SaveSession
from gpuckpt.saving.sources import describe_state
from gpuckpt.saving.writing import bind_jobs
from gpuckpt.storage.stores import open_writer


def _plan(state: dict[str, object]) -> tuple[object, object]:
    local, sources = describe_state(state, allow_pickle=False)
    return plan_save([local], chunk_bytes=64), sources


def test_a_session_begun_written_and_committed_publishes_what_it_returns(tmp_path: Path) -> None:
    state = {"w": np.arange(40.0), "b": np.ones(3, np.float32), "step": 7}
    plan, sources = _plan(state)
    options = SaveOptions()
    writer = open_writer(tmp_path / "c", overwrite=False, sync="none")
    single = {t.name for t in plan.tensors if len(t.specs) == 1}
    session, deferred = SaveSession.begin(plan, writer, options, defer=single)
    assert set(deferred) == single
    (mine,) = plan.assignments
    jobs = bind_jobs(mine, sources)
    written = session.write(jobs, documents=deferred)
    md = session.commit([session.rows(jobs, written)], "id-1", planner_extra={"note": [1]})
    assert md.version is not None and md.planner_data["note"] == [1]  # whole when made
    assert gpuckpt.read_metadata(tmp_path / "c") == md
    back = gpuckpt.load_state_dict(tmp_path / "c")
    np.testing.assert_array_equal(back["w"], state["w"])
    assert back["step"] == 7


def test_a_joined_session_writes_but_never_commits(tmp_path: Path) -> None:
    writer = open_writer(tmp_path / "c", overwrite=False, sync="none")
    joined = SaveSession.joined(writer, SaveOptions())
    with pytest.raises(RuntimeError, match="only the process that began a save commits it"):
        joined.commit([], "id")


def test_save_returns_the_metadata_readers_read(tmp_path: Path) -> None:
    md = gpuckpt.save({"w": np.ones((3, 4)), "s": "x"}, tmp_path / "c")
    assert md == gpuckpt.read_metadata(tmp_path / "c")
    assert md.version == gpuckpt.read_metadata(tmp_path / "c").version
