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


# ---- arrays stored as one small chunk: their folders taken whole (batchio's TAKEDIR) ------------


def _small(values: dict[str, int], scale: int = 1) -> dict[str, object]:
    """Arrays under 1 MiB (each one chunk, written in native batches) of the given lengths."""
    return {k: np.arange(n * scale, dtype=np.float32) + len(k) for k, n in values.items()}


def _native() -> bool:
    from gpuckpt.storage.local import batchio

    return batchio.instance() is not None


def test_small_arrays_folders_are_taken_whole_and_written_over(tmp_path: Path) -> None:
    """Each array stored as one chunk of under 1 MiB takes its folder of the given directory
    whole (where the native library is built): its document and chunk file are the old files
    (same inodes), overwritten and cut to their new sizes; what else the folder held (a chunk
    of an older grid, a stray file, a nested folder) is gone; an array no longer saved is gone
    with the rest; what is published reads bit-exactly and verifies."""
    old = tmp_path / "old"
    _save(_small({"a": 5000, "b": 300, "c": 70000, "gone": 100}), old, None)
    (old / "a" / "c.7").write_bytes(b"stale chunk of an older grid")
    (old / "b" / "stray").write_text("x")
    (old / "c" / "nested" / "deeper").mkdir(parents=True)
    before = _inodes(old)
    state = {**_small({"a": 4000, "b": 900, "c": 70000, "new": 10}), "step": 3}  # a shrinks, b grows
    new = tmp_path / "new"
    _save(state, new, old)
    assert not old.exists()
    files = _files(new)
    assert not any(rel.startswith(("gone", "a/c.7", "b/stray", "c/nested")) for rel in files), files
    assert REUSED_NAME not in "".join(files)
    if _native():
        after = _inodes(new)
        for rel in ("a/zarr.json", "a/c.0", "b/zarr.json", "b/c.0", "c/c.0"):
            assert after[rel] == before[rel], rel  # written over, not made anew
    got = gpuckpt.load_state_dict(new)
    for k in ("a", "b", "c", "new"):
        np.testing.assert_array_equal(got[k], state[k])
    assert got["step"] == 3
    assert verify_checkpoint(new).ok  # every file cut to its size, checksums right
    zarr = pytest.importorskip("zarr")
    np.testing.assert_array_equal(zarr.open_array(str(new / "a"), mode="r")[:], state["a"])


def test_a_small_arrays_folder_or_file_that_is_a_link_or_shared_is_not_written_through(
    tmp_path: Path,
) -> None:
    """In a small array's folder taken whole, as for large files: a folder that is a link to one
    elsewhere, a chunk file that another name shares (``cp -al``), a link to a file outside, a
    FIFO and a folder where a file was: none is written through or followed; new files are made
    and the bytes elsewhere stay."""
    old = tmp_path / "old"
    _save(_small({"a": 100, "b": 100, "c": 100, "d": 100, "e": 100}), old, None)
    elsewhere = tmp_path / "elsewhere"
    (old / "a").rename(elsewhere)
    (old / "a").symlink_to(elsewhere, target_is_directory=True)
    kept_a = {p.name: p.read_bytes() for p in elsewhere.iterdir()}
    kept = tmp_path / "kept"
    os.link(old / "b" / "c.0", kept)
    kept_b = kept.read_bytes()
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep me")
    (old / "c" / "c.0").unlink()
    (old / "c" / "c.0").symlink_to(outside)
    (old / "d" / "zarr.json").unlink()
    os.mkfifo(old / "d" / "zarr.json")
    (old / "e" / "c.0").unlink()
    (old / "e" / "c.0").mkdir()
    (old / "e" / "c.0" / "inside").write_text("x")
    state = _small({"a": 200, "b": 200, "c": 200, "d": 200, "e": 200})
    new = tmp_path / "new"
    _save(state, new, old)
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == kept_a
    assert kept.read_bytes() == kept_b and kept.stat().st_nlink == 1
    assert outside.read_bytes() == b"keep me"
    for p in new.rglob("*"):
        assert not p.is_symlink() and (p.is_dir() or p.is_file()), p
    got = gpuckpt.load_state_dict(new)
    for k, v in state.items():
        np.testing.assert_array_equal(got[k], v)
    assert verify_checkpoint(new).ok
