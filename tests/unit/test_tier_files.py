"""A received part's files in a local tier: received straight into mapped files
(``receiving_files``) or written from a buffer (``write_received``), over a recycled copy's
files or into new ones, never outside the part's directory."""

from __future__ import annotations

import mmap
import os
import shutil
from pathlib import Path

import pytest

from gpuckpt.errors import CheckpointCorruptedError
from gpuckpt.tiers.files import (
    COPIED_MAX_BYTES,
    FileMaps,
    mapped,
    part_files,
    receiving_files,
    tree_bytes,
    write_copies,
    write_received,
)
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


def _receive(
    tmp: Path, files: dict[str, bytes] | list[tuple[str, bytes]], kept: FileMaps | None = None
) -> list[mmap.mmap]:
    """What the transport does: each message's bytes into the views ``receiving_files`` gives
    (with ``kept``: its maps kept from round to round); returns the maps the round itself had
    to close."""
    maps: list[mmap.mmap] = []
    items = _items(files)
    listing = [(rel, len(data)) for rel, data in items]
    views = receiving_files(tmp, listing, maps, kept)
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
    return maps


def _receive_copying(tmp: Path, files: dict[str, bytes] | list[tuple[str, bytes]]) -> list[mmap.mmap]:
    """:func:`_receive` with the small files received into a buffer and written after the
    transfer (``copies``, then ``write_copies``: in one native call where it is built)."""
    maps: list[mmap.mmap] = []
    items = _items(files)
    listing = [(rel, len(data)) for rel, data in items]
    copies: list[tuple[str, memoryview]] = []
    views = receiving_files(tmp, listing, maps, None, copies)
    for (_rel, data), vs in zip(items, views, strict=True):
        at = 0
        for v in vs:
            v[:] = data[at : at + v.nbytes]
            at += v.nbytes
            v.release()
    assert sorted(os.path.relpath(p, tmp) for p, _ in copies) == sorted(
        rel for rel, data in items if 0 < len(data) < COPIED_MAX_BYTES
    )
    for m in maps:
        m.close()
    write_copies(tmp, copies)
    return maps


def _receive_copying_one_at_a_time(
    tmp: Path, files: dict[str, bytes] | list[tuple[str, bytes]]
) -> list[mmap.mmap]:
    """:func:`_receive_copying` where the native library is not used (written file by file)."""
    import gpuckpt.tiers.files as files_module

    native = files_module.batchio.instance_or_none
    files_module.batchio.instance_or_none = lambda: None  # type: ignore[assignment]
    try:
        return _receive_copying(tmp, files)
    finally:
        files_module.batchio.instance_or_none = native  # type: ignore[assignment]


def _write(tmp: Path, files: dict[str, bytes] | list[tuple[str, bytes]]) -> None:
    items = _items(files)
    listing = [(rel, len(data)) for rel, data in items]
    pieces = [[memoryview(data)] if data else [] for _, data in items]
    write_received(tmp, listing, pieces)


def _tree(tmp: Path) -> dict[str, bytes]:
    return {str(p.relative_to(tmp)): p.read_bytes() for p in tmp.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "put",
    [_receive, _receive_copying, _receive_copying_one_at_a_time, _write],
    ids=["received-into-files", "small-files-copied", "small-files-copied-one-at-a-time", "written"],
)
def test_a_part_lands_in_new_files(tmp_path: Path, put) -> None:  # type: ignore[no-untyped-def]
    put(tmp_path / "part", FILES)
    assert _tree(tmp_path / "part") == FILES


@pytest.mark.parametrize(
    "put",
    [_receive, _receive_copying, _receive_copying_one_at_a_time, _write],
    ids=["received-into-files", "small-files-copied", "small-files-copied-one-at-a-time", "written"],
)
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


@pytest.mark.parametrize(
    "put",
    [_receive, _receive_copying, _receive_copying_one_at_a_time, _write],
    ids=["received-into-files", "small-files-copied", "small-files-copied-one-at-a-time", "written"],
)
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


@pytest.mark.parametrize(
    "put",
    [_receive, _receive_copying, _receive_copying_one_at_a_time, _write],
    ids=["received-into-files", "small-files-copied", "small-files-copied-one-at-a-time", "written"],
)
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


@pytest.mark.parametrize(
    "put",
    [_receive, _receive_copying, _receive_copying_one_at_a_time, _write],
    ids=["received-into-files", "small-files-copied", "small-files-copied-one-at-a-time", "written"],
)
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


@pytest.mark.parametrize(
    "put",
    [_receive, _receive_copying, _receive_copying_one_at_a_time, _write],
    ids=["received-into-files", "small-files-copied", "small-files-copied-one-at-a-time", "written"],
)
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


# --- maps kept from round to round (FileMaps) ----------------------------------------------

BIG = FileMaps.MIN_BYTES + 4096  # a chunk file large enough for its map to be kept


def _big_part(seed: int, size: int = BIG) -> dict[str, bytes]:
    return {"zarr.json": b"{}", "t/c/0": bytes([seed]) * (size - 4) + b"CRC!"}


def _mapped_here(path: Path) -> list[str]:
    """This process's maps of files under ``path`` (deleted ones marked so)."""
    marker = str(path) + "/"
    return [
        line[line.find(marker) :]
        for line in Path("/proc/self/maps").read_text().splitlines()
        if marker in line
    ]


def test_a_large_files_map_is_kept_and_serves_the_next_rounds_of_the_same_file(tmp_path: Path) -> None:
    kept = FileMaps()
    part = tmp_path / "part"
    closed = _receive(part, _big_part(1), kept)
    assert len(closed) == 1 and len(kept) == 1  # the small document's map is the round's own
    assert _tree(part) == _big_part(1)
    # the copy recycled (moved, same inode) and received into again: the kept map takes it
    os.rename(part, tmp_path / "again")
    closed = _receive(tmp_path / "again", _big_part(2), kept)
    assert len(closed) == 1 and len(kept) == 1
    assert _tree(tmp_path / "again") == _big_part(2)
    # and sends from it: a reader is served by the kept (writable) map
    maps: list[mmap.mmap] = []
    views = mapped(tmp_path / "again", [("t/c/0", BIG), ("zarr.json", 2)], maps, kept)
    assert maps == [] and len(kept) == 1  # (the document is sent from a copy of its bytes)
    assert b"".join(bytes(v) for v in views) == _big_part(2)["t/c/0"] + b"{}"
    for v in views:
        v.release()
    for m in maps:
        m.close()
    kept.close()
    assert len(kept) == 0 and _mapped_here(tmp_path) == []


def test_a_kept_map_of_a_file_whose_size_changed_is_made_anew(tmp_path: Path) -> None:
    kept = FileMaps()
    part = tmp_path / "part"
    _receive(part, _big_part(1), kept)
    _receive(part, _big_part(3, BIG + 8192), kept)  # grown: a map of the old size would be short
    assert _tree(part) == _big_part(3, BIG + 8192) and len(kept) == 1
    _receive(part, _big_part(4), kept)  # shrunk: a longer map would fault past the end
    assert _tree(part) == _big_part(4) and len(kept) == 1
    maps: list[mmap.mmap] = []
    views = mapped(part, [("t/c/0", BIG)], maps, kept)
    assert b"".join(bytes(v) for v in views) == _big_part(4)["t/c/0"]
    for v in views:
        v.release()
    kept.close()


def test_maps_of_deleted_or_leaving_files_are_dropped_and_their_memory_with_them(tmp_path: Path) -> None:
    kept = FileMaps()
    tier = tmp_path / "tier"
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        tier.mkdir(exist_ok=True)
        _receive(tier / name, _big_part(seed), kept)
    assert len(kept) == 3
    shutil.rmtree(tier / "a")  # deleted: its pages stay while a map holds them
    assert any("(deleted)" in line for line in _mapped_here(tier))
    kept.forget_deleted([tier / "b"])  # "b" is about to be deleted: its map goes too
    assert len(kept) == 1
    left = _mapped_here(tier)
    assert left and all(line.endswith(str(tier / "c" / "t" / "c" / "0")) for line in left), left
    kept.close()
    assert _mapped_here(tier) == []


def test_a_kept_map_follows_its_file_wherever_it_is_moved_and_goes_once_it_is_deleted(tmp_path: Path) -> None:
    """A kept map is dropped for its file's deletion, not for its place: a file moved into
    another folder (a part's file reused by the next step's part) keeps its map, and no walk
    of the tier's own files is needed to tell; a folder named ``leaving`` that is not there
    is no error."""
    kept = FileMaps()
    tier = tmp_path / "tier"
    tier.mkdir()
    _receive(tier / "old", _big_part(1), kept)
    (tier / "new" / "t" / "c").mkdir(parents=True)
    os.rename(tier / "old" / "t" / "c" / "0", tier / "new" / "t" / "c" / "0")
    kept.forget_deleted([tier / "old", tmp_path / "never"])  # (the moved file is no longer there)
    assert len(kept) == 1
    shutil.rmtree(tier / "old")
    kept.forget_deleted()
    assert len(kept) == 1 and not any("(deleted)" in line for line in _mapped_here(tier))
    (tier / "new" / "t" / "c" / "0").unlink()
    kept.forget_deleted()
    assert len(kept) == 0 and _mapped_here(tier) == []


def test_no_more_maps_than_the_limit_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FileMaps, "MAX_MAPS", 2)
    kept = FileMaps()
    closed = [len(_receive(tmp_path / f"p{i}", _big_part(i), kept)) for i in range(3)]
    assert closed == [1, 1, 2] and len(kept) == 2  # the third large map is the round's own
    assert _tree(tmp_path / "p2") == _big_part(2)
    kept.close()


def test_a_document_is_sent_from_a_copy_and_one_shorter_than_listed_is_refused(tmp_path: Path) -> None:
    """Files under COPIED_MAX_BYTES go from a copy of their bytes (no map holding a descriptor
    through the round); one shorter than the part's listing says is an error, never a short
    message."""
    part = tmp_path / "part"
    part.mkdir()
    (part / "zarr.json").write_bytes(b'{"a": 1}')
    maps: list[mmap.mmap] = []
    views = mapped(part, [("zarr.json", 8)], maps)
    assert maps == [] and [bytes(v) for v in views] == [b'{"a": 1}']
    with pytest.raises(OSError, match="8 bytes where the part's listing says 9"):
        mapped(part, [("zarr.json", 9)], maps)


def test_tree_bytes_counts_the_regular_files_below_and_follows_no_link(tmp_path: Path) -> None:
    part = tmp_path / "part"
    (part / "w" / "c").mkdir(parents=True)
    (part / "zarr.json").write_bytes(b"x" * 10)
    (part / "w" / "zarr.json").write_bytes(b"y" * 20)
    (part / "w" / "c" / "0").write_bytes(b"z" * 300)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(bytes(5000))
    (part / "link").symlink_to(outside / "big")
    (part / "dirlink").symlink_to(outside, target_is_directory=True)
    assert tree_bytes(part) == 330
    assert tree_bytes(tmp_path / "gone") == 0


def test_part_files_lists_the_regular_files_sorted_and_follows_no_link(tmp_path: Path) -> None:
    part = tmp_path / "part"
    (part / "b" / "c").mkdir(parents=True)
    (part / "a").mkdir()
    for rel, n in (("zarr.json", 3), ("b/zarr.json", 5), ("b/c/0", 7), ("a/c.0", 11)):
        (part / rel).write_bytes(bytes(n))
    (tmp_path / "secret").write_bytes(b"s" * 99)
    (part / "link").symlink_to(tmp_path / "secret")
    (part / "dirlink").symlink_to(tmp_path, target_is_directory=True)
    os.mkfifo(part / "fifo")
    assert part_files(part) == [("a/c.0", 11), ("b/c/0", 7), ("b/zarr.json", 5), ("zarr.json", 3)]


@pytest.mark.parametrize("native", [True, False], ids=["one-native-call", "one-at-a-time"])
def test_small_files_are_sent_from_copies_read_together_and_refused_at_another_size_or_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """A part's small files (documents, small chunks) are read into one buffer, in one native
    call where the library is built, else one at a time: the same messages either way, and
    the same errors for a file shorter or longer than the listing says, or a link where a
    file is listed (never followed)."""
    import gpuckpt.tiers.files as files_module
    from gpuckpt.storage.local import batchio

    if native and batchio.instance() is None:
        pytest.skip("the native library is not built here")
    if not native:
        monkeypatch.setattr(files_module.batchio, "instance_or_none", lambda: None)
    part = tmp_path / "part"
    contents = {**FILES, "t/c/1": bytes(range(200)) + b"CRC?"}
    for rel, data in contents.items():
        (part / rel).parent.mkdir(parents=True, exist_ok=True)
        (part / rel).write_bytes(data)
    listing = part_files(part)
    maps: list[mmap.mmap] = []
    views = mapped(part, listing, maps)
    expected = [
        contents[rel][at : at + n]
        for rel, size in listing
        for at, n in zip(
            [sum(message_sizes(rel, size)[:k]) for k in range(len(message_sizes(rel, size)))],
            message_sizes(rel, size),
            strict=True,
        )
    ]
    assert [bytes(v) for v in views] == expected and maps == []
    sizes = dict(listing)
    longer = [(rel, size - 1 if rel == "t/zarr.json" else size) for rel, size in listing]
    with pytest.raises(OSError, match="more bytes where the part's listing says 1") as info:
        mapped(part, longer, maps)
    assert info.value.filename == str(part / "t/zarr.json")
    shorter = [(rel, size + 3 if rel == "t/c/1" else size) for rel, size in listing]
    with pytest.raises(
        OSError, match=f"{sizes['t/c/1']} bytes where the part's listing says {sizes['t/c/1'] + 3}"
    ):
        mapped(part, shorter, maps)
    (tmp_path / "elsewhere.json").write_bytes(b"{}")
    (part / "t/zarr.json").unlink()
    (part / "t/zarr.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(OSError, match="not a regular file where the part's listing has one") as info:
        mapped(part, listing, maps)
    assert info.value.filename == str(part / "t/zarr.json")


@pytest.mark.parametrize("native", [True, False], ids=["one-native-call", "one-at-a-time"])
def test_small_files_that_cannot_be_written_name_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """``write_copies`` raises the system's error for the file it could not write, named."""
    import gpuckpt.tiers.files as files_module
    from gpuckpt.storage.local import batchio

    if native and batchio.instance() is None:
        pytest.skip("the native library is not built here")
    if not native:
        monkeypatch.setattr(files_module.batchio, "instance_or_none", lambda: None)
    tmp = tmp_path / "part"
    tmp.mkdir()
    copies = [(f"{tmp}/a.json", memoryview(b"{}")), (f"{tmp}/gone/b.json", memoryview(b"[]"))]
    with pytest.raises(FileNotFoundError) as info:
        write_copies(tmp, copies)
    assert info.value.filename == f"{tmp}/gone/b.json"
    assert (tmp / "a.json").read_bytes() == b"{}"
