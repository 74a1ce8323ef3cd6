"""Saving into a directory that holds other files, and into an empty one (what programs written
for torch.distributed.checkpoint do): the checkpoint's own names are published beside the other
files, which are never touched; a name clash is refused; an earlier checkpoint there survives a
save killed at any step of the publication."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.storage.local.leftovers import cleanup_stale_temporaries
from gpuckpt.testing.faults import temporaries
from gpuckpt.verify import verify_checkpoint

CHILD = Path(__file__).with_name("into_crash_child.py")
sys.path.insert(0, str(CHILD.parent))
from into_crash_child import new_state, old_state  # noqa: E402


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, np.ndarray):
            assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k
        else:
            assert got[k] == v, k


def test_an_empty_directory_is_saved_into_without_overwrite(tmp_path: Path) -> None:
    d = tmp_path / "made-by-mkdtemp"
    d.mkdir()
    gpuckpt.save(old_state(), d)
    _same(gpuckpt.load_state_dict(d), old_state())
    (tmp_path / "empty2").mkdir()
    gpuckpt.async_save(old_state(), tmp_path / "empty2").result()
    _same(gpuckpt.load_state_dict(tmp_path / "empty2"), old_state())
    with pytest.raises(gpuckpt.CheckpointExistsError, match="Checkpoint already exists"):
        gpuckpt.save(new_state(), d)  # once it holds a checkpoint, overwrite is needed again
    assert temporaries(tmp_path) == []


def test_a_directory_with_other_files_takes_the_checkpoint_beside_them(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    (d / "model.pt").write_bytes(b"mine")
    (d / "logs").mkdir()
    (d / "logs" / "events").write_text("mine too")
    with pytest.raises(gpuckpt.CheckpointExistsError, match="pass overwrite=True to publish"):
        gpuckpt.save(old_state(), d)
    gpuckpt.save(old_state(), d, overwrite=True)
    _same(gpuckpt.load_state_dict(d), old_state())
    gpuckpt.save(new_state(), d, overwrite=True)  # replaces the earlier checkpoint, keeps the rest
    _same(gpuckpt.load_state_dict(d), new_state())
    assert sorted(os.listdir(d)) == [
        "a",
        "c",
        "logs",
        "model.pt",
        "zarr.json",
    ]  # 'b' went with its checkpoint
    assert (d / "model.pt").read_bytes() == b"mine" and (d / "logs" / "events").read_text() == "mine too"
    assert verify_checkpoint(d).ok
    assert temporaries(tmp_path) == []


def test_a_clash_with_a_file_that_is_not_a_checkpoints_is_refused_and_nothing_moves(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    (d / "a").write_text("a file of mine named like the array")
    before = sorted(os.listdir(d))
    with pytest.raises(gpuckpt.CheckpointExistsError, match=r"\['a'\].*refusing to touch them"):
        gpuckpt.save(old_state(), d, overwrite=True)
    assert sorted(os.listdir(d)) == before and (d / "a").read_text().startswith("a file of mine")
    assert temporaries(tmp_path) == []


RENAMES = 6  # the earlier root document, a and b aside; a and c in; the new root document


@pytest.mark.parametrize("kill_at", range(1, RENAMES + 2))
def test_a_save_into_a_shared_directory_killed_at_any_step_loses_nothing(
    tmp_path: Path, kill_at: int
) -> None:
    d = tmp_path / "run"
    d.mkdir()
    (d / "model.pt").write_bytes(b"mine")
    gpuckpt.save(old_state(), d, overwrite=True)
    proc = subprocess.run([sys.executable, str(CHILD), str(d), str(kill_at)], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    published = kill_at > RENAMES
    # what a reader sees right after the crash: the earlier checkpoint, the new one, or none (a typed error)
    try:
        got = gpuckpt.load_state_dict(d)
    except gpuckpt.CheckpointNotFoundError:
        assert 1 < kill_at <= RENAMES  # only while the publication was under way
    else:
        _same(got, new_state() if published else old_state())
    # the next save to the path (here: its cleanup) settles what the dead one left
    cleanup_stale_temporaries(d)
    _same(gpuckpt.load_state_dict(d), new_state() if published else old_state())
    assert (d / "model.pt").read_bytes() == b"mine"
    want = {"a", "c", "model.pt", "zarr.json"} if published else {"a", "b", "model.pt", "zarr.json"}
    assert set(os.listdir(d)) == want
    assert temporaries(tmp_path) == []
    gpuckpt.save(new_state(), d, overwrite=True)
    _same(gpuckpt.load_state_dict(d), new_state())


@pytest.mark.parametrize("first", [2, 4, 5])  # killed with a and b aside; and a in; and a and c in
@pytest.mark.parametrize("second", range(6))  # the undo killed at each of its renames, or mid-removal
def test_a_second_crash_while_undoing_a_dead_publication_loses_nothing(
    tmp_path: Path, first: int, second: int
) -> None:
    """Two crashes in a row: a publication killed half-way, then the cleanup that undoes it killed
    too (at each of its renames, or while it deletes an entry it took out). A reader never sees
    a checkpoint with arrays missing, the earlier checkpoint is never deleted, and the next
    cleanup makes the earlier checkpoint whole; then saves go on."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "model.pt").write_bytes(b"mine")
    gpuckpt.save(old_state(), d, overwrite=True)
    for args in ((str(first),), (str(second), "cleanup")):
        proc = subprocess.run([sys.executable, str(CHILD), str(d), *args], capture_output=True, text=True)
        if proc.returncode == 0:  # the cleanup needed fewer renames than this one's count
            assert "returned" in proc.stdout and args[-1] == "cleanup", proc.stdout + proc.stderr
        else:
            assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
        try:
            got = gpuckpt.load_state_dict(d)
        except gpuckpt.CheckpointNotFoundError:
            pass  # no checkpoint while it is being put back: a typed error, never half of one
        else:
            _same(got, old_state())
    cleanup_stale_temporaries(d)
    _same(gpuckpt.load_state_dict(d), old_state())
    assert (d / "model.pt").read_bytes() == b"mine"
    assert set(os.listdir(d)) == {"a", "b", "model.pt", "zarr.json"}
    assert temporaries(tmp_path) == []
    gpuckpt.save(new_state(), d, overwrite=True)
    _same(gpuckpt.load_state_dict(d), new_state())


@pytest.mark.parametrize("names", ["absolute", "traversal", "through-a-link", "other-target"])
def test_a_planted_journal_reaches_nothing_outside_its_directory(tmp_path: Path, names: str) -> None:
    """The journal of a dead publication names entries of the target and its set-aside
    directory; one whose names are paths (or that is another directory's) is left alone, and
    what they point at is neither moved nor deleted."""
    from gpuckpt.storage.local.fsutil import tmp_owner
    from gpuckpt.storage.local.shared_dir import JOURNAL

    outside = tmp_path / "outside"
    gpuckpt.save(old_state(), outside)  # a checkpoint elsewhere: its arrays are what a cleanup may remove
    (outside / "src").mkdir()
    (outside / "src" / "f").write_text("theirs")
    d = tmp_path / "run"
    d.mkdir()
    (d / "model.pt").write_bytes(b"mine")
    (d / "d").symlink_to(outside)
    aside = d.parent / f".{d.name}.gpuckpt-old-{tmp_owner().rsplit('-', 1)[0]}-999999999-deadbeef"
    aside.mkdir()
    (aside / "d").symlink_to(outside / "src")
    journal = {
        "absolute": {"target": "run", "new": [str(outside / "a")], "old": []},
        "traversal": {"target": "run", "new": ["../outside/a"], "old": ["../outside/src/f"]},
        "through-a-link": {"target": "run", "new": ["d/a"], "old": ["d/f"]},
        "other-target": {"target": "elsewhere", "new": ["a"], "old": []},
    }[names]
    (aside / JOURNAL).write_text(json.dumps(journal))
    shutil.copytree(
        outside / "a", d / "a"
    )  # an array of that name here: another directory's journal names it
    before = sorted(str(p.relative_to(outside)) for p in outside.rglob("*"))
    cleanup_stale_temporaries(d)
    assert (d / "a" / "zarr.json").is_file()
    assert sorted(str(p.relative_to(outside)) for p in outside.rglob("*")) == before
    assert (outside / "src" / "f").read_text() == "theirs"
    _same(gpuckpt.load_state_dict(outside), old_state())
    assert (d / "model.pt").read_bytes() == b"mine"
