"""``fsutil.move_directory``: what a save or a replica takes over to overwrite is moved only when
it is a directory itself, never through a symbolic link to one elsewhere."""

from __future__ import annotations

import os
from pathlib import Path

from gpuckpt.storage.local.fsutil import move_directory


def test_a_directory_moves(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_bytes(b"x")
    assert move_directory(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b" / "f").read_bytes() == b"x" and not (tmp_path / "a").exists()


def test_a_link_to_a_directory_a_file_or_nothing_does_not(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "f").write_bytes(b"keep")
    (tmp_path / "link").symlink_to(elsewhere, target_is_directory=True)
    (tmp_path / "file").write_bytes(b"a file")
    for src in ("link", "file", "missing"):
        assert not move_directory(tmp_path / src, tmp_path / f"{src}-moved")
        assert not os.path.lexists(tmp_path / f"{src}-moved")
    assert (tmp_path / "link").is_symlink() and (elsewhere / "f").read_bytes() == b"keep"
