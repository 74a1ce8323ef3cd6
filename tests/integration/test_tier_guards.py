"""A local tier's guards, in one process and across processes: one open manager per ``local_dir``
(a lock the process's death releases), the tier's arguments refused before anything is made,
and a tier kept apart from its root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import InvalidOptionError

REPO = Path(__file__).resolve().parents[2]


def _manager(tmp_path: Path, root: str = "root", **kw: object) -> gpuckpt.CheckpointManager:
    return gpuckpt.CheckpointManager(tmp_path / root, local_dir=tmp_path / "tier", replicas=0, **kw)  # type: ignore[arg-type]


def test_a_second_manager_on_an_open_tier_is_refused_and_the_first_goes_on(tmp_path: Path) -> None:
    first = _manager(tmp_path, "a")
    first.save(1, {"w": np.full(4, 1.0)})
    first.wait()
    with pytest.raises(InvalidOptionError, match=f"process {os.getpid()} holds it") as info:
        _manager(tmp_path, "b")
    assert "give each run (and each manager) its own local_dir" in str(info.value)
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())
    first.save(2, {"w": np.full(4, 2.0)})  # nothing of the refused manager touched the tier
    first.wait()
    assert first.local_steps() == [1, 2]
    first.close()
    second = _manager(tmp_path, "a")  # closed: the tier is free again
    target = {"w": np.zeros(4)}
    assert second.restore(target) == 2 and target["w"].tolist() == [2.0] * 4
    second.close()


_HOLDER = """
import sys, time, numpy as np, gpuckpt
mgr = gpuckpt.CheckpointManager(sys.argv[1] + "/root", local_dir=sys.argv[1] + "/tier", replicas=0)
mgr.save(1, {"w": np.ones(4)})
mgr.wait()
print("open", flush=True)
time.sleep(120)
"""


def test_the_lock_of_a_killed_process_is_gone_with_it(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
        with pytest.raises(InvalidOptionError, match=f"process {proc.pid} holds it"):
            _manager(tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while True:  # (the kernel drops the lock as it tears the process down)
        try:
            mgr = _manager(tmp_path)
            break
        except InvalidOptionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    target = {"w": np.zeros(4)}
    assert mgr.restore(target) == 1 and target["w"].tolist() == [1.0] * 4
    mgr.close()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"persist_interval_steps": 5}, "persist_interval_steps configure"),
        ({"replicas": 3}, "replicas configure"),
        ({"local_max_to_keep": 4, "node": "n0"}, "local_max_to_keep, node configure"),
    ],
)
def test_tier_arguments_without_a_tier_are_refused(tmp_path: Path, kw: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidOptionError, match=match):
        gpuckpt.CheckpointManager(tmp_path / "root", **kw)  # type: ignore[arg-type]
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"replicas": -1}, "replicas must be an integer >= 0"),
        ({"local_max_to_keep": 1}, "local_max_to_keep must be an integer >= 2"),
        ({"node": ""}, "node must be a non-empty string"),
    ],
)
def test_bad_tier_arguments_are_refused_before_anything_is_made(
    tmp_path: Path, kw: dict[str, object], match: str
) -> None:
    with pytest.raises(InvalidOptionError, match=match):
        gpuckpt.CheckpointManager(tmp_path / "root", local_dir=tmp_path / "tier", **kw)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_a_local_dir_that_is_a_file_or_overlaps_the_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(InvalidOptionError, match="is not a directory"):
        gpuckpt.CheckpointManager(tmp_path / "root", local_dir=tmp_path / "f", replicas=0)
    for root, tier in (("r", "r"), ("r", "r/tier"), ("t/root", "t")):
        with pytest.raises(InvalidOptionError, match="overlap: give the local tier a directory of its own"):
            gpuckpt.CheckpointManager(tmp_path / root, local_dir=tmp_path / tier, replicas=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_one_process_gets_its_own_typed_errors_through_the_tier(tmp_path: Path) -> None:
    """As a manager without a tier raises them: not wrapped in a DistributedError of one rank."""
    mgr = _manager(tmp_path)
    with pytest.raises(gpuckpt.UnsupportedValueError, match="key None"):
        mgr.save(1, {"w": np.ones(4), None: 1})  # type: ignore[dict-item]
    mgr.save(2, {"w": np.ones(4), "x": np.ones(3)})
    mgr.save(3, {"w": np.ones(4), "x": object()})  # refused by the part's save, in the background
    with pytest.raises(gpuckpt.UnsupportedValueError) as info:
        mgr.wait()
        mgr.save(4, {"w": np.ones(4), "x": np.ones(3)})
    assert any("writing the local tier step 3" in n for n in getattr(info.value, "__notes__", []))
    with pytest.raises(gpuckpt.DTypeMismatchError):
        mgr.restore({"w": np.ones(4, np.float32), "x": np.zeros(3)})
    target = {"w": np.zeros(4), "x": np.zeros(3)}
    assert mgr.restore(target) == 2 and target["x"].tolist() == [1.0] * 3
    mgr.close()


@pytest.mark.parametrize(
    ("local_dir", "match"),
    [
        ("", "an empty path"),
        ("tier\0x", "a NUL character"),
        ("t" * 5000, "cannot be used"),
        ("f/tier", "cannot be used"),  # a path through a file
    ],
)
def test_a_local_dir_that_cannot_be_a_directory_is_refused_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_dir: str, match: str
) -> None:
    (tmp_path / "f").write_text("x")
    monkeypatch.chdir(tmp_path)  # (an empty path would otherwise be this directory)
    with pytest.raises(InvalidOptionError, match=match):
        gpuckpt.CheckpointManager(tmp_path / "root", local_dir=local_dir, replicas=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.write_bytes(b"not the tier's")
    return victim


@pytest.mark.parametrize("plant", ["symlink", "dangling", "hardlink", "fifo", "folder"])
def test_a_lock_file_that_is_not_the_tiers_own_is_refused_and_never_written(
    tmp_path: Path, plant: str
) -> None:
    tier = tmp_path / "tier"
    tier.mkdir()
    victim = _victim(tmp_path)
    lock = tier / ".lock"
    if plant == "symlink":
        lock.symlink_to(victim)
    elif plant == "dangling":
        lock.symlink_to(tmp_path / "made-outside")
    elif plant == "hardlink":
        os.link(victim, lock)
    elif plant == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    with pytest.raises(InvalidOptionError, match=r"its lock file .*\.lock .*remove (what is there|it)"):
        _manager(tmp_path)
    assert victim.read_bytes() == b"not the tier's"
    assert not (tmp_path / "made-outside").exists()
    assert sorted(p.name for p in tier.iterdir()) == [".lock"]


def test_a_folder_of_another_programs_files_at_a_parts_name_is_never_written_into_nor_deleted(
    tmp_path: Path,
) -> None:
    """The tier replaces its own parts and deletes a retired part's folder whole: a folder
    that holds what it did not write fails that step (typed, naming it), and stays as it is."""
    tier = tmp_path / "tier"
    theirs = tier / "step_00000003.rank_00000"
    theirs.mkdir(parents=True)
    (theirs / "notes.txt").write_text("mine")
    mgr = _manager(tmp_path)
    for step in (1, 2):
        mgr.save(step, {"w": np.full(4, float(step))})
    mgr.wait()
    mgr.save(3, {"w": np.full(4, 3.0)})
    with pytest.raises(
        gpuckpt.CheckpointExistsError, match=r"step_00000003\.rank_00000.*notes\.txt.*move them out"
    ):
        mgr.wait()
    for step in range(4, 8):  # retention runs over step 3's name several times
        mgr.save(step, {"w": np.full(4, float(step))})
    mgr.wait()
    assert (
        sorted(p.name for p in theirs.iterdir()) == ["notes.txt"]
        and (theirs / "notes.txt").read_text() == "mine"
    )
    target = {"w": np.zeros(4)}
    assert mgr.restore(target) == 7 and target["w"].tolist() == [7.0] * 4
    mgr.close()


def test_a_key_that_is_not_utf8_reaches_the_root_through_the_drain(tmp_path: Path) -> None:
    key = "a\udcffb"  # a lone surrogate: what os.fsdecode makes of a file name that is not UTF-8
    mgr = _manager(tmp_path, persist_interval_steps=2)
    for step in (1, 2):
        mgr.save(step, {key: np.full(3, float(step))})
    mgr.wait()
    mgr.close()
    got = gpuckpt.CheckpointManager(tmp_path / "root")
    target = {key: np.zeros(3)}
    assert got.all_steps() == [2] and got.restore(target) == 2 and target[key].tolist() == [2.0] * 3
    got.close()


def test_a_restore_with_nothing_saved_says_so_as_a_manager_without_a_tier_does(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    with pytest.raises(gpuckpt.CheckpointNotFoundError) as info:
        mgr.restore({"w": np.zeros(4)})
    assert str(info.value) == (
        f"no step is complete in the local tiers nor committed under {tmp_path / 'root'}; save one first"
    )
    mgr.save(2, {"w": np.ones(4)})
    mgr.wait()
    with pytest.raises(gpuckpt.CheckpointNotFoundError) as info:
        mgr.restore({"w": np.zeros(4)}, step=7)
    assert str(info.value).startswith("step 7 is neither complete in the local tiers nor committed under "), (
        info
    )
    mgr.close()
