"""A save that reuses the files of a directory given up to it (``reuse_files_of``): the files of
the same names are overwritten in place (same inodes) and cut to their new sizes, whatever else
was there is gone at the commit, and what is published reads bit-exactly; a save that fails
leaves no trace of either."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.background import async_save_with_options
from gpuckpt.options import SaveOptions
from gpuckpt.storage.local.writer import REUSED_NAME
from gpuckpt.verify import verify_checkpoint


def _inodes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_ino for p in root.rglob("*") if p.is_file()}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _save(state: dict[str, object], path: Path, reuse: Path | None) -> None:
    options = SaveOptions(sync="none", chunk_bytes=4 << 20)  # chunks over 1 MiB: written one by one
    async_save_with_options(state, path, options, reuse_files_of=reuse).result()


def test_a_save_overwrites_the_files_it_is_given_and_drops_the_rest(tmp_path: Path) -> None:
    old = tmp_path / "old"
    _save({"w": np.full(3 << 20, 7, np.float32), "gone": np.ones(1 << 20, np.float32)}, old, None)
    before = _inodes(old)
    big = [rel for rel in before if rel.startswith("w/") and not rel.endswith("zarr.json")]
    assert len(big) == 3  # three chunk files of 4 MiB
    state = {"w": np.arange(5 << 19, dtype=np.float32), "step": 4}  # smaller: 10 MiB
    new = tmp_path / "new"
    _save(state, new, old)
    assert not old.exists()  # given up: moved into the save, then gone
    after = _inodes(new)
    reused = [rel for rel in big if after.get(rel) == before[rel]]
    assert reused, (before, after)  # the large chunk files are the old ones, overwritten
    assert not any("gone" in rel for rel in _files(new)) and REUSED_NAME not in "".join(_files(new))
    got = gpuckpt.load_state_dict(new)
    np.testing.assert_array_equal(got["w"], state["w"])
    assert got["step"] == 4
    assert verify_checkpoint(new).ok  # every chunk cut to its size, checksums right


def test_a_file_that_a_hard_link_shares_is_never_written_into(tmp_path: Path) -> None:
    """A copy kept with ``cp -al`` (or any other name of a file) keeps its bytes: that file is
    replaced by a new one; the files of one name are still overwritten in place."""
    old = tmp_path / "old"
    _save({"w": np.full(3 << 20, 7, np.float32)}, old, None)
    chunks = sorted(p for p in (old / "w").iterdir() if p.name != "zarr.json")
    kept = tmp_path / "kept"
    os.link(chunks[0], kept)
    expected = kept.read_bytes()
    alone = chunks[1].stat().st_ino
    state = {"w": np.arange(3 << 20, dtype=np.float32)}
    _save(state, tmp_path / "new", old)
    assert kept.read_bytes() == expected and kept.stat().st_nlink == 1
    assert (tmp_path / "new" / "w" / chunks[1].name).stat().st_ino == alone
    np.testing.assert_array_equal(gpuckpt.load_state_dict(tmp_path / "new")["w"], state["w"])
    assert verify_checkpoint(tmp_path / "new").ok


def test_a_link_to_a_directory_elsewhere_is_not_taken(tmp_path: Path) -> None:
    """A part moved to another disk and left as a symbolic link: its files stay where they are,
    with their bytes; the save writes new files."""
    elsewhere = tmp_path / "elsewhere"
    _save({"w": np.full(3 << 20, 7, np.float32)}, elsewhere, None)
    before = {rel: (elsewhere / rel).read_bytes() for rel in _files(elsewhere) if (elsewhere / rel).is_file()}
    link = tmp_path / "old"
    link.symlink_to(elsewhere, target_is_directory=True)
    state = {"w": np.arange(3 << 20, dtype=np.float32)}
    _save(state, tmp_path / "new", link)
    assert link.is_symlink()
    assert {
        rel: (elsewhere / rel).read_bytes() for rel in _files(elsewhere) if (elsewhere / rel).is_file()
    } == before
    np.testing.assert_array_equal(gpuckpt.load_state_dict(tmp_path / "new")["w"], state["w"])


def test_a_folder_inside_them_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    """An array's folder in the given directory replaced by a link to a folder elsewhere: the
    files there stay where they are, with their bytes."""
    old = tmp_path / "old"
    _save({"w": np.full(3 << 20, 7, np.float32)}, old, None)
    elsewhere = tmp_path / "elsewhere"
    (old / "w").rename(elsewhere)
    (old / "w").symlink_to(elsewhere, target_is_directory=True)
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir()}
    state = {"w": np.arange(3 << 20, dtype=np.float32)}
    _save(state, tmp_path / "new", old)
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == before
    np.testing.assert_array_equal(gpuckpt.load_state_dict(tmp_path / "new")["w"], state["w"])
    assert verify_checkpoint(tmp_path / "new").ok


def test_what_is_no_regular_file_among_them_is_not_written_through(tmp_path: Path) -> None:
    old = tmp_path / "old"
    _save({"w": np.full(2 << 20, 1, np.float32)}, old, None)
    chunks = sorted(p for p in (old / "w").iterdir() if p.name != "zarr.json")
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep me")
    chunks[0].unlink()
    chunks[0].symlink_to(outside)  # a link where a chunk was
    chunks[1].unlink()
    os.mkfifo(chunks[1])  # a FIFO where another was
    state = {"w": np.full(2 << 20, 2, np.float32)}
    _save(state, tmp_path / "new", old)
    assert outside.read_bytes() == b"keep me"
    np.testing.assert_array_equal(gpuckpt.load_state_dict(tmp_path / "new")["w"], state["w"])
    assert all(p.is_file() and not p.is_symlink() for p in (tmp_path / "new" / "w").iterdir())


def test_a_save_refused_before_it_begins_leaves_the_given_directory_as_it_was(tmp_path: Path) -> None:
    old = tmp_path / "old"
    _save({"w": np.ones(1 << 20, np.float32)}, old, None)
    files = _inodes(old)
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "stray").write_text("x")  # not a checkpoint, not empty: the save refuses it
    with pytest.raises(gpuckpt.GpuckptError):
        _save({"w": np.zeros(1 << 20, np.float32)}, tmp_path / "new", old)
    assert _files(tmp_path / "new") == ["stray"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "old"]  # no temporary left behind
    assert _inodes(old) == files
    np.testing.assert_array_equal(gpuckpt.load_state_dict(old)["w"], np.ones(1 << 20, np.float32))


def test_a_directory_that_is_not_there_is_no_error(tmp_path: Path) -> None:
    _save({"w": np.ones(4, np.float32)}, tmp_path / "new", tmp_path / "missing")
    np.testing.assert_array_equal(gpuckpt.load_state_dict(tmp_path / "new")["w"], np.ones(4, np.float32))
