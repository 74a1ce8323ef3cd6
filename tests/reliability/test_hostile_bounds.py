"""Hostile checkpoints: every open is non-blocking and checked, every allocation bounded, every error typed.

Each hostile checkpoint is a real saved one, edited: files replaced by FIFOs
or sparse files, the root metadata rewritten with a matching checksum
(:func:`gpuckpt.testing.faults.rewrite_root_metadata`). Memory bounds are
checked in a subprocess under ``RLIMIT_AS``: an allocation the checkpoint
cannot honestly ask for ends in ``MemoryError`` there, and only a typed
``GpuckptError`` may come out.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.format import documents as layout
from gpuckpt.printable import printable
from gpuckpt.storage.local.reader import LocalReader
from gpuckpt.storage.local.writer import NotRegularFileError
from gpuckpt.testing.faults import copy_checkpoint, rewrite_root_metadata, sparse_table_claim, temporaries
from gpuckpt.verify import verify_checkpoint

from .hostile import make_state, time_limit

REPO = Path(gpuckpt.__file__).resolve().parents[1]
GiB = 1 << 30


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bounds") / "ckpt"
    gpuckpt.save(make_state(), path, chunk_bytes=64, sync="none")
    return path


@pytest.fixture
def ckpt(template: Path, tmp_path: Path) -> Path:
    return copy_checkpoint(template, tmp_path / "c")


def run_limited(code: str, *args: object, limit: int = GiB, timeout: float = 60) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter whose address space is capped at ``limit`` bytes.

    ``code`` sees ``sys.argv[1:]`` = ``args``, ``peak_kib()`` (the process's peak resident
    memory so far: ``VmHWM``, which unlike ``ru_maxrss`` does not start from the parent's)
    and ``report(**values)``; returns what it reported, or ``{"untyped": ...}`` for an exception that is not
    a ``GpuckptError`` (``{"typed": ...}`` for one that is).
    """
    prelude = f"""
        import json, resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
        def report(**values):
            print("REPORT " + json.dumps(values)); sys.exit(0)
        def peak_kib():
            with open("/proc/self/status") as f:
                return int(next(ln for ln in f if ln.startswith("VmHWM:")).split()[1])
        import gpuckpt
        try:
    """
    body = textwrap.indent(textwrap.dedent(code), " " * 4)
    tail = """
        except SystemExit:
            raise
        except gpuckpt.GpuckptError as e:
            report(typed=type(e).__name__, message=str(e))
        except BaseException as e:
            report(untyped=type(e).__name__, message=str(e))
    """
    source = textwrap.dedent(prelude) + body + textwrap.dedent(tail)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-c", source, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert lines, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    return json.loads(lines[-1][len("REPORT ") :])  # type: ignore[no-any-return]


def cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "gpuckpt.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def sparse(path: Path, size: int) -> None:
    """Replace ``path`` by a sparse file of ``size`` bytes (no blocks on disk)."""
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


# 5. no open blocks, everything opened is a regular file -------------------------------------------


def test_fifo_array_document_does_not_hang_verify(ckpt: Path) -> None:
    doc = ckpt / "w" / "zarr.json"
    doc.unlink()
    os.mkfifo(doc)
    try:
        proc = cli("verify", str(ckpt), timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("gpuckpt verify hung on a FIFO planted as an array's zarr.json")
    assert proc.returncode == 1, proc.stderr
    assert "w/zarr.json: unreadable" in proc.stdout and "is a FIFO, not a regular file" in proc.stdout


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink-to-dev-zero"])
def test_array_document_that_is_not_a_regular_file_is_reported(ckpt: Path, kind: str) -> None:
    doc = ckpt / "w" / "zarr.json"
    doc.unlink()
    if kind == "fifo":
        os.mkfifo(doc)
    elif kind == "directory":
        doc.mkdir()
    else:
        os.symlink("/dev/zero", doc)
    with time_limit(10):
        report = verify_checkpoint(ckpt)
    (bad,) = [d for d in report.damage if d.where == "w/zarr.json"]
    assert "not a regular file" in bad.problem, bad.problem


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink-to-dev-zero"])
def test_chunk_replaced_after_its_size_check_is_never_opened_blocking(ckpt: Path, kind: str) -> None:
    # a chunk that passed the size check and was then replaced (a race a hostile
    # process can win): the read itself must refuse it, quickly
    reader = LocalReader(ckpt)
    size = reader.chunk_nbytes("nested.b", "c.0")
    assert size is not None
    chunk = ckpt / "nested.b" / "c.0"
    chunk.unlink()
    if kind == "fifo":
        os.mkfifo(chunk)
    elif kind == "directory":
        chunk.mkdir()
    else:
        os.symlink("/dev/zero", chunk)
    with time_limit(10):
        with pytest.raises(NotRegularFileError, match="not a regular file"):
            reader.read_chunk_crc("nested.b", "c.0", [bytearray(size - 4), bytearray(4)])
        with pytest.raises(NotRegularFileError):
            reader.read_chunk_into("nested.b", "c.0", [bytearray(size)])
        with pytest.raises(NotRegularFileError):
            reader.read_chunk_checksum("nested.b", "c.0", size, 4096)


@pytest.mark.parametrize(
    ("kind", "what"), [("fifo", "a FIFO"), ("socket", "a socket"), ("directory", "a directory")]
)
def test_fifo_chunk_is_a_typed_error_in_every_reader(ckpt: Path, kind: str, what: str) -> None:
    chunk = ckpt / "nested.b" / "c.0"
    chunk.unlink()
    if kind == "fifo":
        os.mkfifo(chunk)
    elif kind == "directory":
        chunk.mkdir()
    else:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(chunk))
        listener.close()  # (the socket file stays)
    with time_limit(10):
        # the error and the report say what is there, not that the chunk is missing
        with pytest.raises(gpuckpt.MissingChunkError, match=rf"nested.b.*is {what}, not a regular file"):
            gpuckpt.load_state_dict(ckpt, keys=["nested.b"])
        report = verify_checkpoint(ckpt)
    assert [(d.where, d.problem) for d in report.damage] == [
        ("nested.b/c.0", f"unreadable: it is {what}, not a regular file")
    ]


def test_a_missing_chunk_is_still_called_missing(ckpt: Path) -> None:
    (ckpt / "nested.b" / "c.0").unlink()
    with pytest.raises(gpuckpt.MissingChunkError, match=r"chunk c.0 of tensor 'nested.b' is missing"):
        gpuckpt.load_state_dict(ckpt, keys=["nested.b"])
    assert [(d.where, d.problem) for d in verify_checkpoint(ckpt).damage] == [("nested.b/c.0", "missing")]


# 7. a huge claim over tiny files: listed as damaged, nothing allocated -------------------------


def _claim_huge_w(md: dict[str, Any], rows: int) -> None:
    """``w`` (12x7 float32 in 6 chunks of 2 rows) claims 6 chunks of ``rows`` rows each."""
    e = md["state_dict_metadata"]["w"]
    e["size"] = [6 * rows, 7]
    e["chunks"] = [{"offsets": [i * rows, 0], "sizes": [rows, 7]} for i in range(6)]
    s = md["storage_data"]["tensors"]["w"]
    s["chunk_grid"]["configuration"]["chunk_shape"] = [rows, 7]
    for c in s["chunks"]:
        c["nbytes"] = rows * 7 * 4 + 4


def test_verify_lists_chunks_of_a_28_tib_claim_over_tiny_files(ckpt: Path) -> None:
    rows = (28 << 40) // (6 * 28)  # six chunks of 4.7 TiB each
    rewrite_root_metadata(ckpt, lambda md: _claim_huge_w(md, rows))
    got = run_limited(
        """
        from gpuckpt.verify import verify_checkpoint
        r = verify_checkpoint(sys.argv[1], threads=2)
        report(damage=[[d.where, d.problem] for d in r.damage])
        """,
        ckpt,
    )
    assert "damage" in got, got  # not "unexpected MemoryError"
    damage = {where: problem for where, problem in got["damage"] if "/c." in where}
    assert sorted(damage) == [f"w/c.{i}.0" for i in range(6)]
    assert all(f"expected {rows * 28 + 4}" in p for p in damage.values()), damage


def test_inspect_shows_claimed_apparent_and_allocated_sizes(ckpt: Path) -> None:
    rows = (28 << 40) // (6 * 28)
    rewrite_root_metadata(ckpt, lambda md: _claim_huge_w(md, rows))
    files = sorted((ckpt / "w").glob("c.*"))
    apparent = sum(p.stat().st_size for p in files)
    allocated = sum(p.stat().st_blocks * 512 for p in files)
    d = json.loads(cli("inspect", "--json", str(ckpt)).stdout)
    (w,) = [t for t in d["tensors"] if t["name"] == "w"]
    assert w["stored_bytes"] == 6 * (rows * 28 + 4)  # what the metadata claims
    assert (w["file_bytes"], w["disk_bytes"], w["missing_chunks"]) == (apparent, allocated, 0)
    done = cli("inspect", str(ckpt))
    text = done.stdout
    assert "28.0 TiB claimed by the metadata" in text, text
    assert "28.0 TiB on disk" not in text
    # what it saw of the claim is one line on stderr, and a failed exit
    assert done.returncode == 1 and "run gpuckpt verify" in done.stderr, done.stderr


def test_verify_streams_a_sparse_chunk_that_matches_a_huge_claim(ckpt: Path) -> None:
    # a size the file does back (sparse): verify reads it through a small buffer,
    # never a chunk- or tensor-sized one
    n = 576 << 20  # uint8 elements: more than the address-space limit below

    def edit(md: dict[str, Any]) -> None:
        md["state_dict_metadata"]["nested.b"]["size"] = [n]
        md["state_dict_metadata"]["nested.b"]["chunks"] = [{"offsets": [0], "sizes": [n]}]
        s = md["storage_data"]["tensors"]["nested.b"]
        s["chunk_grid"]["configuration"]["chunk_shape"] = [n]
        s["chunks"] = [{"key": "c.0", "nbytes": n + 4, "crc32c": 0}]

    rewrite_root_metadata(ckpt, edit)
    sparse(ckpt / "nested.b" / "c.0", n + 4)
    got = run_limited(
        """
        from gpuckpt.verify import verify_checkpoint
        r = verify_checkpoint(sys.argv[1], threads=2)
        report(damage=[[d.where, d.problem] for d in r.damage])
        """,
        ckpt,
        limit=512 << 20,
    )
    assert "damage" in got, got
    damage = {where: problem for where, problem in got["damage"] if "/c." in where}
    assert list(damage) == ["nested.b/c.0"] and "checksum mismatch" in damage["nested.b/c.0"], damage


# 8. padded-chunk bomb: a chunk shape larger than the tensor is refused ---------------------------


def _padded_bomb(ckpt: Path, chunk: int) -> None:
    """``nested.b`` (5 uint8) claims one chunk of ``chunk`` elements, backed by a sparse file."""

    def edit(md: dict[str, Any]) -> None:
        s = md["storage_data"]["tensors"]["nested.b"]
        s["chunk_grid"]["configuration"]["chunk_shape"] = [chunk]
        s["chunks"][0]["nbytes"] = chunk + 4

    rewrite_root_metadata(ckpt, edit)
    sparse(ckpt / "nested.b" / "c.0", chunk + 4)


def test_padded_chunk_bomb_is_refused_at_validation(ckpt: Path) -> None:
    _padded_bomb(ckpt, 3 * GiB)
    for code in (
        'gpuckpt.load_state_dict(sys.argv[1], keys=["nested.b"])',
        'import numpy as np; gpuckpt.load({"nested": {"b": np.zeros(5, np.uint8)}}, sys.argv[1], strict=False)',
    ):
        got = run_limited(code, ckpt)
        assert got.get("typed") == "MetadataError", got
        message = got["message"]
        assert "'nested.b'" in message and "[3221225472]" in message and "[5]" in message, message
    report = verify_checkpoint(ckpt)
    assert [d.where for d in report.damage] == ["zarr.json"]
    assert "chunk shape [3221225472] is larger than the tensor's shape [5]" in report.damage[0].problem


@pytest.mark.parametrize("chunk_shape", [[13, 7], [12, 8], [2, 700]])
def test_chunk_shape_larger_than_the_tensor_on_any_axis_is_a_metadata_error(
    ckpt: Path, chunk_shape: list[int]
) -> None:
    def edit(md: dict[str, Any]) -> None:
        s = md["storage_data"]["tensors"]["w"]
        s["chunk_grid"]["configuration"]["chunk_shape"] = chunk_shape
        grid = [-(-n // c) for n, c in zip((12, 7), chunk_shape, strict=True)]
        md["state_dict_metadata"]["w"]["chunks"] = [
            {"offsets": [i * chunk_shape[0], j * chunk_shape[1]],
             "sizes": [min(chunk_shape[0], 12 - i * chunk_shape[0]), min(chunk_shape[1], 7 - j * chunk_shape[1])]}
            for i in range(grid[0]) for j in range(grid[1])
        ]  # fmt: skip
        s["chunks"] = [
            {"key": f"c.{i}.{j}", "nbytes": chunk_shape[0] * chunk_shape[1] * 4 + 4, "crc32c": 0}
            for i in range(grid[0])
            for j in range(grid[1])
        ]

    rewrite_root_metadata(ckpt, edit)
    with pytest.raises(
        gpuckpt.MetadataError, match=r"'w'.*chunk shape .* larger than the tensor's shape \[12, 7\]"
    ):
        gpuckpt.read_metadata(ckpt)


def test_every_chunk_grid_gpuckpt_writes_stays_within_the_tensor(tmp_path: Path) -> None:
    # the validation above must never refuse what gpuckpt itself writes: empty axes,
    # one-element rows larger than the target, uneven splits
    state = {
        "empty": np.zeros((0, 3), np.int16),
        "e2": np.zeros((4, 0, 2), np.float32),
        "row": np.arange(40, dtype=np.float64).reshape(1, 40),
        "uneven": np.arange(1001, dtype=np.float32).reshape(7, 11, 13)[:, :, :7].copy(),
        "scalar": np.float64(2.0) * np.ones(()),
    }
    for chunk_bytes in (1, 8, 64, 1000, 1 << 20):
        path = tmp_path / f"c{chunk_bytes}"
        gpuckpt.save(state, path, chunk_bytes=chunk_bytes, sync="none")
        out = gpuckpt.load_state_dict(path)
        for k, v in state.items():
            np.testing.assert_array_equal(out[k], v)


# 9. documents are size-capped before they are read ---------------------------------------------


def test_sparse_gib_root_document_is_refused_unread(ckpt: Path) -> None:
    os.truncate(ckpt / "zarr.json", GiB)  # sparse: the tail has no blocks
    got = run_limited(
        """
        before = peak_kib()
        try:
            gpuckpt.read_metadata(sys.argv[1])
        except gpuckpt.MetadataError as e:
            report(typed="MetadataError", message=str(e), grown_kib=peak_kib() - before)
        """,
        ckpt,
        limit=GiB,
    )
    assert got.get("typed") == "MetadataError", got
    assert "MAX_ROOT_DOCUMENT_BYTES" in got["message"] and str(GiB) in got["message"], got
    assert got["grown_kib"] < 64 << 10, got  # nothing of the gigabyte was read
    report = verify_checkpoint(ckpt)
    assert [d.where for d in report.damage] == ["zarr.json"]
    assert "MAX_ROOT_DOCUMENT_BYTES" in report.damage[0].problem


def test_oversized_array_document_is_reported_unread(ckpt: Path) -> None:
    doc = ckpt / "w" / "zarr.json"
    os.truncate(doc, layout.MAX_ARRAY_DOCUMENT_BYTES + 1)
    report = verify_checkpoint(ckpt)
    (bad,) = [d for d in report.damage if d.where == "w/zarr.json"]
    assert "MAX_ARRAY_DOCUMENT_BYTES" in bad.problem, bad.problem


def test_a_save_whose_root_document_would_exceed_the_cap_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the writer keeps to what the readers accept (the cap lowered so that the test is small)
    monkeypatch.setattr(layout, "MAX_ROOT_DOCUMENT_BYTES", 2000)
    target = tmp_path / "big"
    with pytest.raises(gpuckpt.MetadataError, match="MAX_ROOT_DOCUMENT_BYTES.*larger chunk_bytes"):
        gpuckpt.save({"w": np.zeros(64, np.float32)}, target, chunk_bytes=4, sync="none")
    assert not target.exists() and temporaries(tmp_path) == []
    # where a plain value is what makes it large, the error names it and says to store an array
    with pytest.raises(gpuckpt.MetadataError, match=r"the plain value 'notes' takes \d+ bytes.*as an array"):
        gpuckpt.save({"notes": "x" * 3000, "w": np.zeros(4)}, target, sync="none")
    assert not target.exists() and temporaries(tmp_path) == []


def test_root_document_is_read_into_one_buffer(tmp_path: Path) -> None:
    # a 96 MiB root document (one large plain value) is read into one buffer of its
    # size, which the parser then reads in place: never a second copy of the bytes
    path = tmp_path / "c"
    gpuckpt.save({"note": "x" * (96 << 20), "w": np.ones(3)}, path, sync="none")
    size = (path / "zarr.json").stat().st_size
    got = run_limited(
        """
        from gpuckpt.storage.local.reader import LocalReader
        from gpuckpt.format.reader import metadata_of_root
        before = peak_kib()
        raw = LocalReader(sys.argv[1]).read_root()
        grown = peak_kib() - before
        md = metadata_of_root(raw, "zarr.json")
        report(grown_kib=grown, values=sorted(md.state_dict_metadata))
        """,
        path,
        limit=4 * GiB,
    )
    assert got.get("values") == ["note", "w"], got
    assert got["grown_kib"] * 1024 < 1.5 * size, (got, size)


# 10. read-only targets are refused before anything is read -------------------------------------


class _ReadOnlyExport:
    """A host array exported through DLPack, read-only."""

    def __init__(self, array: np.ndarray) -> None:
        self._a = array
        self._a.flags.writeable = False

    def __dlpack__(self, **kw: Any) -> Any:
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._a.__dlpack_device__()


def _read_only(kind: str, like: np.ndarray, tmp_path: Path) -> Any:
    if kind == "ndarray":
        a = np.zeros_like(like)
        a.flags.writeable = False
        return a
    if kind == "memmap":
        np.zeros_like(like).tofile(tmp_path / "mm")
        return np.memmap(tmp_path / "mm", dtype=like.dtype, mode="r", shape=like.shape)
    return _ReadOnlyExport(np.zeros_like(like))


@pytest.mark.parametrize("kind", ["ndarray", "memmap", "dlpack"])
def test_load_into_a_read_only_target_changes_nothing(ckpt: Path, tmp_path: Path, kind: str) -> None:
    state = make_state()
    first = np.zeros_like(state["w"])
    target = {"w": first, "nested": {"b": _read_only(kind, state["nested"]["b"], tmp_path)}}
    with pytest.raises(gpuckpt.ReadOnlyTargetError, match=r"'nested\.b'.*read-only.*writable"):
        gpuckpt.load(target, ckpt, strict=False)
    assert not first.any()  # checked before anything was read
    assert isinstance(gpuckpt.ReadOnlyTargetError("x"), ValueError)


def test_a_target_whose_elements_share_memory_is_refused_before_anything_is_read(ckpt: Path) -> None:
    """A writable broadcast view (``as_strided`` with a stride of 0, torch's ``expand``) would keep
    one value per address: refused like a read-only target, as a shard too; views whose elements
    are distinct (transposed, sliced with steps) load as before."""
    from gpuckpt.device.arrays import overlaps_itself

    state = make_state()
    first = np.zeros_like(state["w"])
    b = state["nested"]["b"]
    shared = np.lib.stride_tricks.as_strided(np.zeros(1, b.dtype), shape=b.shape, strides=(0,) * b.ndim)
    assert shared.flags.writeable
    with pytest.raises(gpuckpt.ReadOnlyTargetError, match=r"'nested\.b'.*share memory.*strides \(0"):
        gpuckpt.load({"w": first, "nested": {"b": shared}}, ckpt, strict=False)
    assert not first.any()
    local = np.lib.stride_tricks.as_strided(np.zeros(7, np.float32), shape=(6, 7), strides=(0, 4))
    with pytest.raises(gpuckpt.ReadOnlyTargetError, match="'w'.*share memory"):
        gpuckpt.load(
            {"w": gpuckpt.ShardedArray(local, offsets=(6, 0), global_shape=(12, 7))}, ckpt, strict=False
        )
    w = state["w"]
    spaced = np.zeros((w.shape[0], 2 * w.shape[1]), w.dtype)[:, ::2]  # distinct elements, strided
    gpuckpt.load({"w": spaced}, ckpt, strict=False)
    assert np.array_equal(spaced, w)
    # the test: any axis stepping inside what the inner ones span
    assert not overlaps_itself((3, 4), (16, 4), 4) and not overlaps_itself((3, 4), (4, 12), 4)
    assert overlaps_itself((3, 4), (0, 4), 4) and overlaps_itself((3, 4), (8, 4), 4)
    assert not overlaps_itself((1, 4), (0, 4), 4) and not overlaps_itself((5,), (-4,), 4)
    # no elements, nothing shared, whatever the strides (torch's empty tensors have strides of 0)
    assert not overlaps_itself((0, 4), (0, 0), 4) and not overlaps_itself((4, 0, 3), (0, 0, 0), 2)


def test_read_only_shard_of_a_sharded_target_is_refused(ckpt: Path) -> None:
    local = np.zeros((6, 7), np.float32)
    local.flags.writeable = False
    target = {"w": gpuckpt.ShardedArray(local, offsets=(6, 0), global_shape=(12, 7))}
    with pytest.raises(gpuckpt.ReadOnlyTargetError, match="'w'"):
        gpuckpt.load(target, ckpt, strict=False)


# 15. text from a checkpoint is escaped in every human-readable output ---------------------------

EVIL = "evil\x1b[2J\n  forged.row  1x1  float32\u202e"


def test_printable_escapes_control_and_format_characters() -> None:
    assert printable(EVIL) == "evil\\x1b[2J\\n  forged.row  1x1  float32\\u202e"
    assert printable("layer.weight é 日本") == "layer.weight é 日本"
    assert printable("\udcff\x00\t") == "\\udcff\\x00\\t"


def test_inspect_escapes_names_and_values(tmp_path: Path) -> None:
    path = tmp_path / "c"
    gpuckpt.save({EVIL: np.ones(1, np.float32), "ok": np.ones(2), "v\x07": "bell\x1b"}, path, sync="none")
    out = cli("inspect", str(path)).stdout
    assert "\x1b" not in out and "\u202e" not in out and "\x07" not in out
    assert "evil\\x1b[2J\\n  forged.row" in out
    assert not any(line.lstrip().startswith("forged.row") for line in out.splitlines())
    d = json.loads(cli("inspect", "--json", str(path)).stdout)  # still proper JSON, exact names
    assert EVIL in {t["name"] for t in d["tensors"]}


def test_verify_and_error_lines_escape_paths(template: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(template, tmp_path / "ck\x1b[2J\npt")
    out = cli("verify", str(path))
    assert out.returncode == 0 and "\x1b" not in out.stdout and "ck\\x1b[2J\\npt" in out.stdout
    (path / "nested.b" / "c.0").unlink()
    out = cli("verify", str(path))
    assert out.returncode == 1
    assert "\x1b" not in out.stdout + out.stderr and "ck\\x1b[2J\\npt" in out.stderr
    missing = cli("inspect", str(tmp_path / "no\x1b]0;title\x07such"))
    assert missing.returncode == 1 and "\x1b" not in missing.stderr and "\x07" not in missing.stderr
    assert "no\\x1b]0;title\\x07such" in missing.stderr


# 9. a chunk table claiming millions of rows over sparse files: what was written bounds the work --


@pytest.fixture(scope="module")
def sparse_claim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("claim") / "ckpt"
    sparse_table_claim(path, 1 << 25)  # 33.5 million chunks claimed, 5,000 written
    assert disk_bytes_allocated(path / "_gpuckpt.table.crc32c") < 1 << 20  # 128 MiB of rows, sparse
    return path


def disk_bytes_allocated(path: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("reader", ["load_state_dict", "verify", "inspect", "convert", "base"])
def test_a_table_claiming_millions_of_chunks_over_sparse_files_costs_what_was_written(
    sparse_claim: Path, reader: str, tmp_path: Path
) -> None:
    code = {
        "load_state_dict": "gpuckpt.load_state_dict(sys.argv[1]); report(loaded=True)",
        "verify": (
            "from gpuckpt.verify import verify_checkpoint\n"
            "r = verify_checkpoint(sys.argv[1], threads=2)\n"
            "report(damage=[[d.where, d.problem] for d in r.damage])"
        ),
        "inspect": (
            "from gpuckpt.cli.inspect_cmd import describe_checkpoint\n"
            "(w,) = describe_checkpoint(sys.argv[1])['tensors']\n"
            "report(chunks=w['chunks'], missing=w['missing_chunks'], file_bytes=w['file_bytes'])"
        ),
        "convert": "from gpuckpt.convert import convert\nconvert(sys.argv[1], sys.argv[2]); report(converted=True)",
        "base": (
            "import warnings\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    from gpuckpt.saving.incremental import open_base\n"
            "    index = open_base(sys.argv[1])\n"
            "report(index=index is not None, warnings=[str(x.message) for x in w])"
        ),
    }[reader]
    import time

    start = time.monotonic()
    got = run_limited(code, sparse_claim, tmp_path / "out", limit=GiB, timeout=120)
    took = time.monotonic() - start
    assert "untyped" not in got, got
    assert took < 30, took
    missing = "claims 33554432 chunks but its array w holds 5000 chunk files: 33549432 are missing (the first: c.5000)"
    if reader in ("load_state_dict", "convert"):
        assert got["typed"] == "MissingChunkError" and missing in got["message"], got
    elif reader == "verify":
        assert got["damage"][0] == ["w/", f"tensor 'w' {missing}; its chunks were not read"], got
        assert [d[0] for d in got["damage"]] == ["w/", "w/zarr.json"], got  # its document's shape too
    elif reader == "inspect":
        assert got == {"chunks": 1 << 25, "missing": (1 << 25) - 5000, "file_bytes": 5000 * 68}, got
    else:
        assert not got["index"] and any(missing in w for w in got["warnings"]), got
