"""CheckpointManager: intervals, retention, restore, failures and interruptions, on real directories."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuckpt
from gpuckpt.manager import CheckpointManager, step_of
from gpuckpt.storage.local.root import LocalRoot


def state(v: float, n: int = 16) -> dict[str, object]:
    return {"w": np.full(n, v, np.float32), "meta": {"v": v}}


def test_interval_and_force(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, save_interval_steps=5, async_save=False, sync="none") as mgr:
        saved = [s for s in range(1, 13) if mgr.save(s, state(s))]
        assert saved == [5, 10]
        assert mgr.save(12, state(12), force=True)
        assert mgr.all_steps() == [5, 10, 12]
        assert mgr.latest_step() == 12


def test_async_saves_one_in_flight_and_snapshot(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    sd = state(1.0, 1 << 16)
    assert mgr.save(1, sd)
    sd["w"][:] = 2.0  # after save() returns, the state may change
    assert mgr.save(2, sd)
    # the second save waited for the first: it is committed now
    assert (mgr.step_path(1) / "zarr.json").is_file()
    mgr.wait()
    assert mgr.all_steps() == [1, 2]
    assert mgr.restore_state_dict(1)["w"][0] == 1.0
    assert mgr.restore_state_dict()["w"][0] == 2.0
    mgr.close()


def test_restore_in_place_and_errors(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, async_save=False)
    with pytest.raises(gpuckpt.CheckpointNotFoundError, match="no committed checkpoint"):
        mgr.restore(state(0))
    mgr.save(3, state(3.0))
    mgr.save(4, state(4.0))
    target = state(0.0)
    assert mgr.restore(target) == 4
    assert target["w"][0] == 4.0 and target["meta"] == {"v": 4.0}
    assert mgr.restore(target, step=3) == 3
    with pytest.raises(gpuckpt.CheckpointNotFoundError, match=r"step 7 .*available steps: \[3, 4\]"):
        mgr.restore(target, step=7)
    with pytest.raises(gpuckpt.CheckpointExistsError, match="step 4 is already saved"):
        mgr.save(4, state(5.0), force=True)
    assert mgr.restore_state_dict(keys=["meta"]) == {"meta": {"v": 4.0}}


def test_steps_sort_numerically_and_junk_is_ignored(tmp_path: Path) -> None:
    for s in (9, 10, 100):
        gpuckpt.save(state(s), tmp_path / f"step_{s:08d}", sync="none")
    gpuckpt.save(state(7), tmp_path / "7", sync="none")
    gpuckpt.save(state(1), tmp_path / "step_x", sync="none")  # not a step name
    (tmp_path / "step_00000200").mkdir()  # not committed
    (tmp_path / "300").write_text("a file")
    (tmp_path / ".step_00000400.gpuckpt-tmp-h-1-abc").mkdir()
    mgr = CheckpointManager(tmp_path)
    assert mgr.all_steps() == [7, 9, 10, 100]
    assert mgr.latest_step() == 100
    assert mgr.restore_state_dict(7)["w"][0] == 7
    assert [step_of(n) for n in ("step_00000042", "42", "step_", "x42", "step_-1")] == [
        42,
        42,
        None,
        None,
        None,
    ]


def test_retention_keeps_newest_and_periodic(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, max_to_keep=2, keep_period=4, async_save=False, sync="none") as mgr:
        for s in range(1, 11):
            mgr.save(s, state(s))
            assert mgr.latest_step() == s
    assert mgr.all_steps() == [4, 8, 9, 10]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_saves_do_not_probe_every_step_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 200 committed steps: the manager reads each root document once, at open; its saves and
    # retention passes read none of them again (one listing of the directory each)
    gpuckpt.save(state(0), tmp_path / "step_00000000", sync="none")
    for s in range(1, 200):
        shutil.copytree(tmp_path / "step_00000000", tmp_path / f"step_{s:08d}")
    probed: list[str] = []
    real = LocalRoot.is_committed

    def counted(self: LocalRoot, name: str) -> bool:
        probed.append(name)
        return real(self, name)

    monkeypatch.setattr(LocalRoot, "is_committed", counted)
    mgr = CheckpointManager(tmp_path, max_to_keep=199, keep_period=1000, sync="none")
    assert sorted(probed) == [f"step_{s:08d}" for s in range(200)]
    probed.clear()
    for s in range(200, 205):
        assert mgr.save(s, state(s))  # each retires one step: 1, 2, 3, 4, 5 (0 is kept for good)
    mgr.wait()
    assert probed == []
    assert mgr.all_steps() == [0, *range(6, 205)] and mgr.latest_step() == 204
    mgr.close()
    # a restarted manager finds the same steps
    assert CheckpointManager(tmp_path).all_steps() == [0, *range(6, 205)]


def test_retention_waits_for_commit_in_async_mode(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, max_to_keep=1, sync="none")
    mgr.save(1, state(1))
    mgr.wait()
    mgr.save(2, state(2))
    # step 2 may still be in flight: step 1 is the last good one and stays until 2 is committed
    assert 1 in mgr.all_steps() or mgr.all_steps() == [2]
    mgr.wait()
    assert mgr.all_steps() == [2]
    mgr.close()


def test_failed_background_save_is_reported_and_never_latest(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, max_to_keep=1, sync="none")
    mgr.save(1, state(1))
    mgr.wait()
    # a non-checkpoint directory where step 2 goes: the background save fails
    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "step_00000002" / "junk").write_text("x")
    mgr.save(2, state(2))
    assert mgr.latest_step() == 1
    with pytest.raises(gpuckpt.CheckpointExistsError) as info:
        mgr.save(3, state(3))
    # the call that raises an earlier save's failure says that its own step was not saved
    assert any("step 3 was not saved" in n for n in getattr(info.value, "__notes__", []))
    # the error is raised once; step 1 (the last good one) survived retention
    assert mgr.all_steps() == [1]
    assert mgr.save(3, state(3))
    mgr.wait()
    assert mgr.all_steps() == [3]
    mgr.close()


def test_failed_save_surfaces_from_wait_and_context_exit(tmp_path: Path) -> None:
    (tmp_path / "step_00000001").mkdir()
    (tmp_path / "step_00000001" / "junk").write_text("x")
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state(1))
    with pytest.raises(gpuckpt.CheckpointExistsError):
        mgr.wait()
    mgr.wait()  # reported once
    with pytest.raises(RuntimeError) as info, CheckpointManager(tmp_path) as m2:
        m2.save(1, state(1))
        raise RuntimeError("training crashed")
    assert any("background checkpoint save failed" in n for n in getattr(info.value, "__notes__", []))


def test_closed_and_bad_options(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.close()
    with pytest.raises(gpuckpt.GpuckptError, match="closed"):
        mgr.save(1, state(1))
    with pytest.raises(TypeError, match="never overwrites"):
        CheckpointManager(tmp_path, overwrite=True)
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointManager(tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="step must be"):
        CheckpointManager(tmp_path).save(-1, state(1))
    # every argument error is the typed InvalidOptionError (a ValueError and a TypeError)
    m = CheckpointManager(tmp_path / "m", async_save=False)
    m.save(10, state(1))
    for call in (
        lambda: m.save(10**19, state(1)),  # a name of 20 digits would never be listed again
        lambda: m.save(True, state(1)),
        lambda: m.restore(state(0), step="10"),
        lambda: m.restore_state_dict(step=-1),
        lambda: m.should_save("x"),
        lambda: m.step_path(-1),
        lambda: m.delete(1.5),
    ):
        with pytest.raises(
            gpuckpt.InvalidOptionError, match="step must be an integer from 0 to 9999999999999999999"
        ):
            call()
    assert m.all_steps() == [10] and sorted(p.name for p in (tmp_path / "m").iterdir()) == ["step_00000010"]
    m.save(10**19 - 1, state(2))
    assert m.all_steps() == [10, 10**19 - 1] and m.latest_step() == 10**19 - 1
    m.close()
    for bad in ({"async_save": "x"}, {"save_interval_steps": 0}, {"keep_period": "2"}):
        with pytest.raises(gpuckpt.InvalidOptionError, match=next(iter(bad))):
            CheckpointManager(tmp_path / "m2", **bad)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        CheckpointManager(tmp_path / "file")


_CHILD = textwrap.dedent(
    """
    import sys, time, numpy as np
    from gpuckpt.manager import CheckpointManager
    mgr = CheckpointManager(sys.argv[1])
    mgr.save(1, {"w": np.full(1 << 16, 1.0)})
    mgr.wait()
    big = {f"t{i}": np.full(1 << 20, 2.0) for i in range(48)}  # 384 MiB: a slow save
    mgr.save(2, big)
    print("saving", flush=True)
    time.sleep(60)
    """
)


def test_killed_mid_save_leaves_the_previous_step_latest(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "saving"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(
        p.name.startswith(".step_00000002") for p in tmp_path.iterdir()
    ):
        time.sleep(0.001)
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    mgr = CheckpointManager(tmp_path)
    steps = mgr.all_steps()
    assert steps in ([1], [1, 2])
    if steps == [1]:
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "dead temporary not cleaned"
    assert mgr.restore_state_dict(1)["w"][0] == 1.0


@settings(max_examples=25, deadline=None)
@given(
    steps=st.lists(st.integers(0, 60), min_size=1, max_size=12, unique=True).map(sorted),
    max_to_keep=st.none() | st.integers(1, 4),
    keep_period=st.none() | st.integers(1, 7),
)
def test_retention_model(steps: list[int], max_to_keep: int | None, keep_period: int | None) -> None:
    with tempfile.TemporaryDirectory() as d:
        mgr = CheckpointManager(
            d, max_to_keep=max_to_keep, keep_period=keep_period, async_save=False, sync="none"
        )
        kept: list[int] = []
        for s in steps:
            mgr.save(s, {"s": np.array(s)})
            kept.append(s)
            if max_to_keep is not None and len(kept) > max_to_keep:
                kept = [k for k in kept[:-max_to_keep] if keep_period and k % keep_period == 0] + kept[
                    -max_to_keep:
                ]
            assert mgr.all_steps() == kept
            assert mgr.latest_step() == s
        assert len(os.listdir(d)) == len(kept)


def test_a_root_that_can_no_longer_be_listed_is_a_store_error_that_names_it(tmp_path: Path) -> None:
    # a share that went away, or its path replaced by a file: the error says the manager was
    # listing its root, and what to do (it was a bare NotADirectoryError)
    root = tmp_path / "root"
    with gpuckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": np.arange(4.0)})
        root.rename(tmp_path / "away")
        root.write_text("not a directory")
        with pytest.raises(gpuckpt.StoreError, match=f"cannot list the checkpoint root {root} ") as info:
            mgr.save(2, {"w": np.arange(4.0)})
        assert info.value.errno == errno.ENOTDIR and "make it a readable directory again" in str(info.value)
