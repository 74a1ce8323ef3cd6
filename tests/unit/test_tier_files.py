"""A received part's files in a local tier: received straight into mapped files
(``receiving_files``) or written from a buffer (``write_received``), over a recycled copy's
files or into new ones, never outside the part's directory."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from gpuckpt.errors import CheckpointCorruptedError
from gpuckpt.tiers.files import receiving_files, write_received
from gpuckpt.tiers.placement import message_sizes

# a part's files: a chunk file travels as its bytes and its 4-byte checksum trailer
FILES = {
    "zarr.json": b'{"a": 1}',
    "t/c/0": bytes(range(256)) * 40 + b"CRC!",
    "t/zarr.json": b"{}",
    "empty": b"",
}


def _items(files: dict[str, bytes] | list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """A part's files as (name, bytes) in name order; a list may name a file twice."""
    return sorted(files.items() if isinstance(files, dict) else files, key=lambda kv: kv[0])


def _receive(tmp: Path, files: dict[str, bytes] | list[tuple[str, bytes]]) -> None:
    """What the transport does: each message's bytes into the views ``receiving_files`` gives."""
    maps: list[mmap.mmap] = []
    items = _items(files)
    listing = [(rel, len(data)) for rel, data in items]
    views = receiving_files(tmp, listing, maps)
    assert len(views) == len(listing)
    for (rel, data), vs in zip(items, views, strict=True):
        assert [v.nbytes for v in vs] == message_sizes(rel, len(data))
        at = 0
        for v in vs:
            v[:] = data[at : at + v.nbytes]
            at += v.nbytes
            v.release()
    for m in maps:
        m.close()


def _write(tmp: Path, files: dict[str, bytes] | list[tuple[str, bytes]]) -> None:
    items = _items(files)
    listing = [(rel, len(data)) for rel, data in items]
    pieces = [[memoryview(data)] if data else [] for _, data in items]
    write_received(tmp, listing, pieces)


def _tree(tmp: Path) -> dict[str, bytes]:
    return {str(p.relative_to(tmp)): p.read_bytes() for p in tmp.rglob("*") if p.is_file()}


@pytest.mark.parametrize("put", [_receive, _write], ids=["received-into-files", "written"])
def test_a_part_lands_in_new_files(tmp_path: Path, put) -> None:  # type: ignore[no-untyped-def]
    put(tmp_path / "part", FILES)
    assert _tree(tmp_path / "part") == FILES


@pytest.mark.parametrize("put", [_receive, _write], ids=["received-into-files", "written"])
def test_a_recycled_copys_files_are_reused_and_whatever_else_it_holds_removed(tmp_path: Path, put) -> None:  # type: ignore[no-untyped-def]
    part, outside = tmp_path / "part", tmp_path / "outside"
    outside.write_bytes(b"not the tier's")
    (part / "t" / "c").mkdir(parents=True)
    (part / "t" / "c" / "0").write_bytes(b"x" * 50_000)  # larger than what arrives: shrunk
    (part / "zarr.json").write_bytes(b"")  # smaller: grown
    inode = (part / "t" / "c" / "0").stat().st_ino
    (part / "t" / "zarr.json").symlink_to(outside)  # a link: replaced, its target untouched
    os.mkfifo(part / "empty")  # a special file: replaced, never opened blocking
    (part / "old" / "deep").mkdir(parents=True)
    (part / "old" / "deep" / "x").write_bytes(b"old")  # a file the new part lacks: removed
    put(part, FILES)
    assert _tree(part) == FILES
    assert (part / "t" / "c" / "0").stat().st_ino == inode
    assert not (part / "t" / "zarr.json").is_symlink()
    assert outside.read_bytes() == b"not the tier's"
    assert not (part / "old").exists()


@pytest.mark.parametrize("put", [_receive, _write], ids=["received-into-files", "written"])
def test_a_recycled_file_that_a_hard_link_shares_keeps_its_bytes(tmp_path: Path, put) -> None:  # type: ignore[no-untyped-def]
    """A copy someone kept of a part with ``cp -al`` shares its files' inodes: the part's
    file is replaced by a new one, never written into, and the kept copy reads as before."""
    part, kept = tmp_path / "part", tmp_path / "kept"
    (part / "t" / "c").mkdir(parents=True)
    (part / "t" / "c" / "0").write_bytes(b"the kept copy's bytes")
    os.link(part / "t" / "c" / "0", kept)
    put(part, FILES)
    assert _tree(part) == FILES
    assert kept.read_bytes() == b"the kept copy's bytes"
    assert not os.path.samefile(kept, part / "t" / "c" / "0")


@pytest.mark.parametrize("put", [_receive, _write], ids=["received-into-files", "written"])
def test_a_recycled_copys_file_or_link_where_a_folder_must_be_is_replaced(tmp_path: Path, put) -> None:  # type: ignore[no-untyped-def]
    """A layout that changed (an array's chunk file ``t/c/0`` now a folder of chunks), and a
    link where a folder must be: the files land under the part, never through the link."""
    part, outside = tmp_path / "part", tmp_path / "outside"
    outside.mkdir()
    (part / "t" / "c").mkdir(parents=True)
    (part / "t" / "c" / "0").write_bytes(b"a chunk file of the old layout")
    (part / "u").symlink_to(outside, target_is_directory=True)
    new = {"t/c/0/0": b"x" * 100 + b"CRC!", "u/c/0": b"y" * 100 + b"CRC!", "zarr.json": b"{}"}
    put(part, new)
    assert _tree(part) == new
    assert not (part / "u").is_symlink() and not any(outside.iterdir())


@pytest.mark.parametrize("put", [_receive, _write], ids=["received-into-files", "written"])
@pytest.mark.parametrize("name", ["../escape", "/abs/escape", "t/../../escape"])
def test_a_file_name_that_leaves_the_part_is_refused(tmp_path: Path, put, name: str) -> None:  # type: ignore[no-untyped-def]
    part = tmp_path / "in" / "part"
    part.parent.mkdir()
    with pytest.raises(CheckpointCorruptedError, match="names the file"):
        put(part, {**FILES, name: b"evil"})
    assert not (tmp_path / "in" / "escape").exists() and not (tmp_path / "escape").exists()
    assert not Path("/abs/escape").exists()


def test_a_size_that_is_not_one_is_refused(tmp_path: Path) -> None:
    for size in (-1, 2.5, "10", None):
        with pytest.raises(CheckpointCorruptedError, match="names the file"):
            receiving_files(tmp_path / "part", [("zarr.json", size)], [])  # type: ignore[list-item]


@pytest.mark.parametrize("put", [_receive, _write], ids=["received-into-files", "written"])
@pytest.mark.parametrize(
    "names",
    [
        ["t/c/0", "t/c/0"],
        ["t/c/0", "./t/c/0"],
        ["t//c/0", "t/c/0"],
        ["t", "t/c/0"],  # a file where another's name needs a folder
        ["t/c/0", "t/c"],
        ["", "zarr.json"],
    ],
)
def test_a_file_named_twice_or_as_a_folder_is_refused_before_anything_is_made(
    tmp_path: Path,
    put,  # type: ignore[no-untyped-def]
    names: list[str],
) -> None:
    part = tmp_path / "part"
    with pytest.raises(CheckpointCorruptedError, match="twice|both as a file and as a folder"):
        put(part, [(n, b"x" * (10 + i)) for i, n in enumerate(names)])
    assert not part.exists()
