"""The native small-file batches (gpuckpt/storage/local/batchio.c) against the one-file-at-a-time Python path.

The library is built here from its source. Its CRC32C code is checked against the
crc32c package on every code path (AVX-512, PCLMULQDQ, table); writes and reads of
the same batches by both paths must leave the same files and report the same
outcome, on intact and on damaged checkpoints (Hypothesis); system-call faults
(EIO, ENOSPC, short writes) are injected below both paths alike with an LD_PRELOAD
shim (gpuckpt/testing/faultshim.c), and nothing is published; the library runs
under AddressSanitizer + UndefinedBehaviorSanitizer; and gpuckpt works the same
without it (no compiler, GPUCKPT_BATCHIO=off).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import platform
import random
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c as crc32c_package
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hatch_build
from gpuckpt.errors import InvalidOptionError
from gpuckpt.storage.base import ChunkReads, ChunkWrites, ReadStop
from gpuckpt.storage.local import batchio
from gpuckpt.storage.local.batchio import BatchIO, load_library
from gpuckpt.storage.local.reader import LocalReader
from gpuckpt.storage.local.writer import LocalWriter
from gpuckpt.testing.faults import fault_shim_env

SOURCE = Path(batchio.__file__).with_name("batchio.c")
X86 = platform.machine() in ("x86_64", "AMD64")
REPO = Path(__file__).resolve().parents[2]
ROOT_DOC = b'{"zarr_format":3,"node_type":"group","attributes":{}}'


def _cc() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _compile(out: Path, *extra: str, source: Path = SOURCE) -> Path:
    cc = _cc()
    if cc is None:
        pytest.skip("no C compiler: batchio.c cannot be built here")
    flags = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", f"-I{SOURCE.parent}"]
    subprocess.run([cc, *flags, *extra, "-o", str(out), str(source)], check=True)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _compile(tmp_path_factory.mktemp("batchio") / "_batchio.so")


def _levels(built: Path) -> list[str]:
    best = BatchIO(built).isa
    return {"avx512": ["avx512", "pclmul", "table"], "pclmul": ["pclmul", "table"]}.get(best, ["table"])


@pytest.fixture(scope="module", params=["avx512", "pclmul", "table"])
def lib(request: pytest.FixtureRequest, built: Path, tmp_path_factory: pytest.TempPathFactory) -> BatchIO:
    if request.param not in _levels(built):
        pytest.skip(f"this CPU has no {request.param} path")
    # a copy under another name loads as a separate library with its own state
    path = tmp_path_factory.mktemp("levels") / f"_batchio_{request.param}.so"
    shutil.copy(built, path)
    loaded = BatchIO(path)
    assert loaded.limit(request.param) == request.param
    assert loaded.self_test()
    return loaded


@contextlib.contextmanager
def using(lib: BatchIO | None) -> Iterator[None]:
    """The local back end uses ``lib`` (None: the Python path) inside the block."""
    saved = batchio.instance
    batchio.instance = lambda: lib  # type: ignore[assignment]
    try:
        yield
    finally:
        batchio.instance = saved  # type: ignore[assignment]


# ---- CRC32C ----------------------------------------------------------------------------


LENGTHS = [*range(0, 70), 127, 128, 129, 255, 256, 257, 511, 512, 513, 1023, 4095, 65536, 65537, 1 << 20]


def test_crc_matches_the_reference_on_every_code_path(lib: BatchIO) -> None:
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, (1 << 20) + 64, dtype=np.uint8)
    for n in LENGTHS:
        for shift in (0, 1, 13, 63):
            piece = data[shift : shift + n]
            for start in (0, 0xFFFFFFFF, 0x1234ABCD):
                assert lib.crc32c(piece, start) == crc32c_package.crc32c(piece.tobytes(), start), (n, shift)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=3000), cut=st.integers(0, 3000), start=st.integers(0, 2**32 - 1))
def test_crc_continues_across_calls(lib: BatchIO, data: bytes, cut: int, start: int) -> None:
    cut = min(cut, len(data))
    assert lib.crc32c(data[cut:], lib.crc32c(data[:cut], start)) == crc32c_package.crc32c(data, start)


def test_the_source_builds_with_a_vector_path_on_x86(built: Path) -> None:
    assert BatchIO(built).isa in (("avx512", "pclmul") if X86 else ("table",))
    assert load_library(built) is not None


def test_a_library_from_another_source_version_is_refused(tmp_path: Path) -> None:
    source = SOURCE.read_text()
    assert f"#define GBIO_ABI {batchio._ABI}\n" in source
    (tmp_path / "old.c").write_text(
        source.replace(f"#define GBIO_ABI {batchio._ABI}\n", "#define GBIO_ABI 999\n")
    )
    out = _compile(tmp_path / "old.so", source=tmp_path / "old.c")
    with pytest.raises(ImportError, match="another version of batchio.c"):
        BatchIO(out)
    assert load_library(out) is None
    assert load_library(tmp_path / "missing.so") is None


def test_a_library_whose_item_layout_differs_is_refused(tmp_path: Path) -> None:
    original = SOURCE.read_text()
    assert "    uint32_t taken; " in original  # the struct's last field
    source = original.replace("    uint32_t taken; ", "    uint32_t taken, more[2]; ")
    (tmp_path / "wide.c").write_text(source)
    out = _compile(tmp_path / "wide.so", source=tmp_path / "wide.c")
    with pytest.raises(ImportError, match="struct gbio_item is 80 bytes, expected 72"):
        BatchIO(out)


def test_the_installed_package_has_the_library_where_it_can(built: Path) -> None:
    """The build hook compiled it at install time wherever this test can compile it."""
    if os.environ.get("GPUCKPT_BATCHIO", "auto") == "off":
        pytest.skip("GPUCKPT_BATCHIO=off in this environment")
    assert batchio.LIBRARY.exists(), (
        f"{batchio.LIBRARY} missing: reinstall (pip install -e .) with a C compiler"
    )
    assert batchio.available()
    assert batchio.instance().isa == BatchIO(built).isa  # type: ignore[union-attr]


# ---- the same batches through both paths --------------------------------------------------


@st.composite
def write_batches(draw: st.DrawFn) -> tuple[list[np.ndarray], list[int], list[bytes | None]]:
    n = draw(st.integers(0, 7))
    sizes = draw(st.lists(st.one_of(st.integers(0, 300), st.integers(301, 70_000)), min_size=n, max_size=n))
    shifts = draw(st.lists(st.integers(0, 63), min_size=n, max_size=n))
    pads = draw(st.lists(st.one_of(st.just(0), st.integers(1, 70_000)), min_size=n, max_size=n))
    docs = draw(st.lists(st.one_of(st.none(), st.binary(min_size=1, max_size=300)), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    # each buffer starts at a random alignment inside a larger one
    buffers = [
        rng.integers(0, 256, s + 64, dtype=np.uint8)[sh : sh + s] for s, sh in zip(sizes, shifts, strict=True)
    ]
    return buffers, pads, docs


def _tree(root: Path) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for p in sorted(root.rglob("*")):
        out[os.fspath(p.relative_to(root))] = p.read_bytes() if p.is_file() else None
    return out


def _write(
    where: Path, buffers: list[np.ndarray], pads: list[int], docs: list[bytes | None], *, sync: str = "none"
) -> tuple[LocalWriter, ChunkWrites]:
    """A begun writer with the directories of the document-less items made; and the batch."""
    w = LocalWriter(where, sync=sync)
    w.begin()
    names = [f"a{i}" for i in range(len(buffers))]
    for name, doc in zip(names, docs, strict=True):
        if doc is None:
            w.write_array_document(name, b"{}")
    return w, ChunkWrites(names, ["c.0"] * len(names), buffers, pads, docs)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=write_batches())
def test_native_and_python_writes_leave_the_same_files(
    lib: BatchIO, tmp_path_factory: pytest.TempPathFactory, batch: Any
) -> None:
    buffers, pads, docs = batch
    base = tmp_path_factory.mktemp("w")
    trees, crcs = [], []
    for tag, chosen in (("native", lib), ("python", None)):
        w, b = _write(base / tag, buffers, pads, docs)
        with using(chosen):
            crcs.append(w.write_chunks(b))
        w.commit(ROOT_DOC)
        trees.append(_tree(base / tag))
    assert crcs[0] == crcs[1]
    assert trees[0] == trees[1]
    for i, (buf, pad) in enumerate(zip(buffers, pads, strict=True)):
        stored = buf.tobytes() + bytes(pad)
        assert crcs[0][i] == crc32c_package.crc32c(stored)
        assert trees[0][f"a{i}/c.0"] == stored + crcs[0][i].to_bytes(4, "little")


DAMAGE = [
    "none",
    "missing",
    "truncate",
    "flip",
    "flip-trailer",
    "extend",
    "to-dir",
    "symlink",
    "fifo",
    "wrong-expected",
    "no-array-dir",
    "array-dir-is-a-file",
]


def _damage(root: Path, kind: str, name: str, rng: random.Random) -> None:
    path = root / name / "c.0"
    size = path.stat().st_size
    if kind == "missing":
        path.unlink()
    elif kind == "truncate":
        os.truncate(path, rng.randrange(size))
    elif kind in ("flip", "flip-trailer"):
        raw = bytearray(path.read_bytes())
        i = rng.randrange(size - 4) if kind == "flip" and size > 4 else rng.randrange(size - 4, size)
        raw[i] ^= rng.randint(1, 255)
        path.write_bytes(bytes(raw))
    elif kind == "extend":
        with open(path, "ab") as f:
            f.write(b"more")
    elif kind == "to-dir":
        path.unlink()
        path.mkdir()
    elif kind == "symlink":
        (root / name / "elsewhere").write_bytes(path.read_bytes())
        path.unlink()
        path.symlink_to("elsewhere")
    elif kind == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif kind == "no-array-dir":
        shutil.rmtree(root / name)
    elif kind == "array-dir-is-a-file":
        shutil.rmtree(root / name)
        (root / name).write_bytes(b"x")


def _stop_fields(stop: ReadStop | None) -> Any:
    if stop is None:
        return None
    e = stop.error
    error = (
        None if e is None else (type(e).__name__, e.errno, getattr(e, "mode", None) and stat.S_IFMT(e.mode))
    )
    return (stop.index, stop.got, stop.crc, stop.stored, error)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=write_batches(),
    damage=st.sampled_from(DAMAGE),
    victim=st.integers(0, 6),
    seed=st.integers(0, 2**32 - 1),
    shifts=st.lists(st.integers(0, 63), min_size=7, max_size=7),
)
def test_native_and_python_reads_agree_on_intact_and_damaged_chunks(
    lib: BatchIO,
    tmp_path_factory: pytest.TempPathFactory,
    batch: Any,
    damage: str,
    victim: int,
    seed: int,
    shifts: list[int],
) -> None:
    buffers, pads, docs = batch
    root = tmp_path_factory.mktemp("r") / "ckpt"
    w, b = _write(root, buffers, pads, docs)
    with using(lib):
        crcs = w.write_chunks(b)
    w.commit(ROOT_DOC)
    expected = list(crcs)
    if buffers and damage != "none":
        victim %= len(buffers)
        if damage == "wrong-expected":
            expected[victim] ^= 1 << (seed % 32)
        else:
            _damage(root, damage, f"a{victim}", random.Random(seed))
    outcomes = []
    # ranges of the batch for chunk_read_jobs, from the seed: the first stop of the jobs run
    # in order is the one read_chunks finds (the ranges before it were read whole)
    cuts = sorted(random.Random(seed).sample(range(1, len(buffers)), k=min(3, max(0, len(buffers) - 1))))
    spans = list(itertools.pairwise([0, *cuts, len(buffers)])) if buffers else []
    # checked: as after check_chunk_files (the native path opens each file without a look first)
    ways = [(c, h, k) for k in (False, True) for c in (lib, None) for h in ("batch", "jobs")]
    for chosen, how, checked in ways:
        dests = [
            np.full(x.nbytes + 64, 0xA5, np.uint8)[s : s + x.nbytes]
            for x, s in zip(buffers, shifts, strict=False)
        ]
        reads = ChunkReads(b.names, b.keys, dests, pads, expected, checked)
        with using(chosen):
            if how == "batch":
                stop = LocalReader(root).read_chunks(reads)
            else:
                stop = next(
                    (s for s in (job() for job in LocalReader(root).chunk_read_jobs(reads, spans)) if s),
                    None,
                )
        done = len(buffers) if stop is None else stop.index
        for i in range(done):
            np.testing.assert_array_equal(dests[i], buffers[i])
        outcomes.append(_stop_fields(stop))
    assert all(o == outcomes[0] for o in outcomes), list(zip(ways, outcomes, strict=True))
    if damage in ("none", "extend") or not buffers:
        assert outcomes[0] is None


@pytest.mark.parametrize("damage", ["none", "flip-large", "flip-small", "missing-small", "symlinked-dir"])
def test_read_jobs_prepare_small_ranges_once_and_read_the_rest_as_read_chunks(
    lib: BatchIO, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """LocalReader.chunk_read_jobs: the ranges of small chunks are read from items the library
    made once for the whole batch, a range holding a chunk of 1 MiB or more the way
    read_chunks reads it, and a batch naming an array directory that is not a real one
    entirely that way; the stops are read_chunks' own."""
    rng = np.random.default_rng(3)
    sizes = [100, 5000, 1_300_000, 40, 70_000, 7]
    buffers = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    root = tmp_path / "c"
    w, b = _write(root, buffers, [0] * len(sizes), [None] * len(sizes))
    with using(lib):
        crcs = w.write_chunks(b)
    w.commit(ROOT_DOC)
    if damage == "flip-large":
        _damage(root, "flip", "a2", random.Random(1))
    elif damage == "flip-small":
        _damage(root, "flip", "a4", random.Random(1))
    elif damage == "missing-small":
        _damage(root, "missing", "a5", random.Random(1))
    elif damage == "symlinked-dir":
        (root / "a3").rename(root / "real3")
        (root / "a3").symlink_to("real3")
    prepared: list[int] = []
    make = BatchIO.prepare_read

    def counted(self: BatchIO, paths: list[str], *args: Any, **kwargs: Any) -> Any:
        prepared.append(len(paths))
        return make(self, paths, *args, **kwargs)

    monkeypatch.setattr(BatchIO, "prepare_read", counted)
    spans = [(0, 2), (2, 3), (3, 6)]
    outcomes = []
    for how in ("batch", "jobs"):
        dests = [np.zeros(n, np.uint8) for n in sizes]
        reads = ChunkReads(b.names, b.keys, dests, [0] * len(sizes), list(crcs))
        with using(lib):
            reader = LocalReader(root)
            if how == "batch":
                stop = reader.read_chunks(reads)
            else:
                stop = next((s for s in (job() for job in reader.chunk_read_jobs(reads, spans)) if s), None)
        done = len(sizes) if stop is None else stop.index
        for i in range(done):
            np.testing.assert_array_equal(dests[i], buffers[i])
        outcomes.append(_stop_fields(stop))
    assert outcomes[0] == outcomes[1]
    assert (outcomes[0] is None) == (damage == "none")
    # one preparation of the whole batch, unless a name was not a real array directory
    assert prepared == ([] if damage == "symlinked-dir" else [len(sizes)])


def test_a_read_stop_names_what_went_wrong(lib: BatchIO, tmp_path: Path) -> None:
    """The native path's stops, one kind at a time (the property test compares them with Python's)."""
    buffers = [np.arange(1000, dtype=np.uint8), np.arange(10, dtype=np.uint8)]
    w, b = _write(tmp_path / "c", buffers, [0, 6], [b"{}", None])
    with using(lib):
        crcs = w.write_chunks(b)
    w.commit(ROOT_DOC)
    root = tmp_path / "c"

    def read(expected: list[int]) -> ReadStop | None:
        with using(lib):
            return LocalReader(root).read_chunks(
                ChunkReads(
                    b.names, b.keys, [np.empty(1000, np.uint8), np.empty(10, np.uint8)], [0, 6], expected
                )
            )

    assert read(crcs) is None
    assert read([crcs[0], crcs[1] ^ 4]) == ReadStop(1, 10 + 6 + 4, crcs[1], crcs[1])
    os.truncate(root / "a1" / "c.0", 12)
    assert read(crcs) == ReadStop(1, 12)
    (root / "a0" / "c.0").unlink()
    stop = read(crcs)
    assert stop is not None and stop.index == 0 and isinstance(stop.error, FileNotFoundError)
    assert stop.error.filename == f"{root}/a0/c.0"


@pytest.mark.parametrize("kind", ["fifo", "to-dir", "symlink", "missing"])
def test_a_checked_read_refuses_a_file_replaced_after_the_check_without_blocking(
    lib: BatchIO, tmp_path: Path, kind: str
) -> None:
    """After check_chunk_files the native read opens each file without looking first
    (ChunkReads.checked); a chunk replaced since then by a FIFO, a directory or a symlink is
    opened without blocking and refused by what it is (or not opened at all), with the
    stop of the look-first read."""
    buffers = [np.arange(3000, dtype=np.uint8), np.arange(70, dtype=np.uint8)]
    w, b = _write(tmp_path / "c", buffers, [0, 0], [None, None])
    with using(lib):
        crcs = w.write_chunks(b)
    w.commit(ROOT_DOC)
    root = tmp_path / "c"
    with using(lib):
        sizes = LocalReader(root).chunk_sizes(b.names, b.keys)
    assert sizes == [3004, 74]  # the check found both regular, of the right size
    _damage(root, kind, "a1", random.Random(0))
    stops = []
    for checked in (False, True):
        dests = [np.zeros(3000, np.uint8), np.zeros(70, np.uint8)]
        with using(lib):
            reader = LocalReader(root)
            jobs = reader.chunk_read_jobs(ChunkReads(b.names, b.keys, dests, [0, 0], crcs, checked), [(0, 2)])
            stop = jobs[0]()
        np.testing.assert_array_equal(dests[0], buffers[0])
        stops.append(_stop_fields(stop))
    assert stops[0] == stops[1]
    index, _got, _crc, _stored, error = stops[1]
    assert index == 1
    want = {"fifo": stat.S_IFIFO, "to-dir": stat.S_IFDIR, "symlink": stat.S_IFLNK, "missing": None}[kind]
    assert error == (
        ("FileNotFoundError", errno.ENOENT, None)
        if want is None
        else ("NotRegularFileError", errno.ENOENT, want)
    )


# ---- writes under faults: the same error on both paths, nothing published ------------------

_FAULTED_SAVE = """
    import ctypes, json, os, sys
    import numpy as np
    from gpuckpt.storage.local import batchio
    from gpuckpt.storage.base import CheckpointWriter, ChunkWrites, ChunkReads, CheckpointReader
    from gpuckpt.storage.local.writer import LocalWriter
    from gpuckpt.storage.local.reader import LocalReader
    base, sync, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    rng = np.random.default_rng(0)
    buffers = [rng.integers(0, 256, n, dtype=np.uint8) for n in (5000, 70000, 300, 9000, 40000, 1)]
    names = [f"a{i}" for i in range(len(buffers))]
    batch = ChunkWrites(names, ["c.0"] * len(names), buffers, [0, 0, 100, 0, 70000, 3], [b"{}"] * len(names))
    shim = ctypes.CDLL(None)
    out = {}
    for path in ("native", "python"):
        shim.gck_fault_reset()
        target = os.path.join(base, path)
        if mode == "write":
            w = LocalWriter(target, sync=sync)
            try:
                w.begin()
                w.write_chunks(batch) if path == "native" else CheckpointWriter.write_chunks(w, batch)
                w.commit(b"{}")
                out[path] = None
            except OSError as exc:
                w.abort()
                out[path] = [type(exc).__name__, exc.errno]
        else:
            dests = [np.empty_like(b) for b in buffers]
            crcs = [int(x) for x in json.loads(open(os.path.join(base, "crcs.json")).read())]
            reads = ChunkReads(names, ["c.0"] * len(names), dests, batch.pads, crcs)
            r = LocalReader(os.path.join(base, "intact"))
            stop = r.read_chunks(reads) if path == "native" else CheckpointReader.read_chunks(r, reads)
            e = stop and stop.error
            out[path] = stop and [stop.index, e and type(e).__name__, e and e.errno]
    out["left"] = sorted(os.listdir(base))
    out["native_available"] = batchio.available()
    print(json.dumps(out))
"""


@pytest.mark.parametrize(
    ("call", "nth", "err", "partial", "sync"),
    [
        ("write", 1, errno.EIO, 0, "none"),
        ("write", 4, errno.ENOSPC, 0, "fs"),
        ("write", 2, errno.ENOSPC, 1000, "file"),  # a short write, then a full disk
        ("open", 3, errno.EIO, 0, "none"),
        ("open", 1, errno.ENOSPC, 0, "file"),
        ("mkdir", 2, errno.ENOSPC, 0, "none"),
        ("fsync", 1, errno.EIO, 0, "file"),
        ("fsync", 5, errno.EIO, 0, "file"),
        ("close", 2, errno.EIO, 0, "none"),
    ],
)
def test_write_faults_fail_both_paths_alike_and_publish_nothing(
    shim: Path, tmp_path: Path, built: Path, call: str, nth: int, err: int, partial: int, sync: str
) -> None:
    base = tmp_path / "data"
    base.mkdir()
    env = fault_shim_env(shim, base, call, nth=nth, err=err, partial=partial)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_FAULTED_SAVE), str(base), sync, "write"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["native_available"]
    assert out["native"] == ["OSError", err], out
    assert out["python"] == out["native"], out
    assert out["left"] == [], out  # nothing published, no temporary left behind


def test_read_faults_stop_both_paths_alike(shim: Path, tmp_path: Path, lib: BatchIO) -> None:
    base = tmp_path / "data"
    base.mkdir()
    rng = np.random.default_rng(0)
    buffers = [rng.integers(0, 256, n, dtype=np.uint8) for n in (5000, 70000, 300, 9000, 40000, 1)]
    w, b = _write(base / "intact", buffers, [0, 0, 100, 0, 70000, 3], [b"{}"] * 6)
    with using(lib):
        crcs = w.write_chunks(b)
    w.commit(ROOT_DOC)
    (base / "crcs.json").write_text(json.dumps(crcs))
    for nth in (1, 3):
        env = fault_shim_env(shim, base / "intact", "read", nth=nth, err=errno.EIO)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        p = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_FAULTED_SAVE), str(base), "none", "read"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        out = json.loads(p.stdout)
        assert out["native"] is not None and out["native"][1:] == ["OSError", errno.EIO], out
        assert out["python"] == out["native"], out


# ---- without the library ------------------------------------------------------------------


def test_without_a_compiler_the_build_goes_on_and_saves_go_file_by_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", "no-such-cc")
    why = hatch_build.compile_library(REPO / "gpuckpt/storage/local/batchio.c", tmp_path / "_batchio.so")
    assert why is not None and "no C compiler (no-such-cc not found" in why
    assert not (tmp_path / "_batchio.so").exists()
    # an installation without the library: the same files, written one by one
    monkeypatch.setattr(batchio, "LIBRARY", tmp_path / "_batchio.so")
    batchio.instance.cache_clear()
    try:
        assert not batchio.available()
        buffers = [np.arange(100, dtype=np.uint8), np.arange(7, dtype=np.uint8)]
        w, b = _write(tmp_path / "c", buffers, [0, 5], [b"{}", None])
        crcs = w.write_chunks(b)
        w.commit(ROOT_DOC)
        assert crcs == [
            crc32c_package.crc32c(bytes(range(100))),
            crc32c_package.crc32c(bytes(range(7)) + bytes(5)),
        ]
        dests = [np.empty(100, np.uint8), np.empty(7, np.uint8)]
        assert (
            LocalReader(tmp_path / "c").read_chunks(ChunkReads(b.names, b.keys, dests, [0, 5], crcs)) is None
        )
        np.testing.assert_array_equal(dests[0], buffers[0])
    finally:
        batchio.instance.cache_clear()


def test_the_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setenv("GPUCKPT_BATCHIO", "off")
        batchio.instance.cache_clear()
        assert not batchio.available()
        monkeypatch.setenv("GPUCKPT_BATCHIO", "fast")
        batchio.instance.cache_clear()
        with pytest.raises(
            InvalidOptionError,
            match="GPUCKPT_BATCHIO='fast' is not understood; set it to auto, 1/on or 0/off",
        ):
            batchio.available()
        monkeypatch.setattr(batchio, "LIBRARY", Path("/nonexistent/_batchio.so"))
        monkeypatch.setenv("GPUCKPT_BATCHIO", "on")
        batchio.instance.cache_clear()
        with pytest.raises(ImportError, match="GPUCKPT_BATCHIO=on but"):
            batchio.available()
    finally:
        monkeypatch.undo()
        batchio.instance.cache_clear()


def test_the_build_hook_builds_both_native_libraries() -> None:
    targets = [t for _, _, t in hatch_build.LIBRARIES]
    assert targets == ["gpuckpt/storage/local/_crccopy.so", "gpuckpt/storage/local/_batchio.so"]
    assert all((REPO / source).exists() for source, _, _ in hatch_build.LIBRARIES)


# ---- under sanitizers ------------------------------------------------------------------------

_SANITIZED = """
    import ctypes, os, shutil, sys
    import numpy as np
    from gpuckpt.storage.local.batchio import BatchIO, CHUNK, FILE, MKDIR, ITEM, TAKEDIR
    lib = BatchIO(sys.argv[1]); base = sys.argv[2]
    rng = np.random.default_rng(3)
    for level in ("avx512", "pclmul", "table"):
        if lib.limit(level) != level:
            continue
        for n in (0, 1, 63, 64, 65, 255, 256, 257, 511, 512, 513, 4097, 70000):
            for shift in (0, 1, 31):
                a = rng.integers(0, 256, n + 64, dtype=np.uint8)[shift : shift + n].copy()
                lib.crc32c(a)
        root = os.path.join(base, level); os.mkdir(root)
        sizes = [0, 1, 100, 4096, 70000, 300000]
        pads = [0, 3, 70001, 0, 5, 0]
        bufs = [rng.integers(0, 256, s, dtype=np.uint8) for s in sizes]
        kinds, paths, data, pp = [], [], [], []
        for i, (b, p) in enumerate(zip(bufs, pads)):
            kinds += [MKDIR, FILE, CHUNK]; paths += [f"a{i}", f"a{i}/zarr.json", f"a{i}/c.0"]
            data += [b"", b"{}", b]; pp += [0, 0, p]
        items, stop = lib.write(root, kinds, paths, data, pp, fsync="group", writeback_min=None)
        assert stop is None, stop
        crcs = [int(c) for c in items["crc"][items["kind"] == CHUNK]]
        dests = [np.empty_like(b) for b in bufs]
        cpaths = [f"a{i}/c.0" for i in range(len(bufs))]
        assert lib.read(root, cpaths, dests, pads, crcs)[1] is None
        assert all((d == b).all() for d, b in zip(dests, bufs))
        os.truncate(os.path.join(root, "a2/c.0"), 50)
        assert lib.read(root, cpaths, dests, pads, crcs)[1].step == "short"
        os.truncate(os.path.join(root, "a4/c.0"), 70000 + 3)
        assert lib.read(root, cpaths[3:], dests[3:], pads[3:], crcs[3:])[1].step == "short"
        assert lib.read(root, cpaths[:2], dests[:2], pads[:2], [crcs[0], 1])[1].step == "mismatch"
        assert lib.read(root, ["nope/c.0"], dests[:1], [0], [0])[1].step == "stat"
        assert lib.read(root, cpaths[:2], dests[:2], pads[:2], crcs[:2], checked=True)[1] is None
        assert lib.read(root, ["nope/c.0"], dests[:1], [0], [0], checked=True)[1].step == "open"
        sizes, stops = lib.sizes(root, [*cpaths, "nope/c.0", "a0"])
        assert [s.step for s in stops] == ["stat", "not-regular"] and sizes[2] == 50
        assert lib.write(root, [CHUNK], ["a0/c.0"], [bufs[0]], [0], fsync=None, writeback_min=0)[1].step == "open"
        files, nbytes = lib.tree_bytes(root)
        assert files == 12 and nbytes == sum(os.path.getsize(os.path.join(root, p)) for p in paths if "/" in p)
        taken = os.path.join(base, level + "-taken"); os.mkdir(taken)
        items, stop = lib.write(taken, [TAKEDIR, FILE, CHUNK], ["a0", "a0/zarr.json", "a0/c.0"], [b"", b"{}", bufs[2]],
                                [2, 0, 0], fsync=None, writeback_min=None, reuse=root)
        assert stop is None and items["taken"].tolist() == [1, 1, 1], items["taken"]
        os.rename(os.path.join(taken, "a0"), os.path.join(root, "a0"))
        scratch = os.path.join(base, level + "-copy")
        shutil.copytree(root, scratch)
        assert lib.remove_tree(scratch) == 19 and not os.path.exists(scratch)
    if len(sys.argv) > 3:  # the control: a destination one byte shorter than the item says
        items = np.zeros(1, ITEM)
        short = np.empty(4099, np.uint8)  # over numpy's small-block cache: its own malloc block
        path = b"a3/c.0\\0"
        keep = ctypes.create_string_buffer(path)
        items["path"] = ctypes.addressof(keep); items["data"] = short.ctypes.data; items["nbytes"] = 4100
        items["kind"] = CHUNK
        lib._lib.gbio_read(os.path.join(base, "table" if lib.isa == "table" else lib.isa).encode(), items.ctypes.data, 1, 0)
    print("ok")
"""


def _sanitizer_runtimes() -> list[str] | None:
    cc = _cc()
    if cc is None:
        return None
    libs = []
    for name in ("libasan.so", "libubsan.so"):
        path = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if not os.path.isabs(path) or not os.path.exists(path):
            return None
        libs.append(path)
    return libs


def _run_sanitized(tmp_path: Path, control: bool) -> subprocess.CompletedProcess[str]:
    runtimes = _sanitizer_runtimes()
    if runtimes is None:
        pytest.skip("no AddressSanitizer/UBSan runtime for this compiler")
    out = _compile(
        tmp_path / "_batchio_asan.so",
        "-g",
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=all",
        "-fno-omit-frame-pointer",
    )
    base = tmp_path / "files"
    base.mkdir()
    env = {
        **os.environ,
        "LD_PRELOAD": " ".join(runtimes),
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "PYTHONMALLOC": "malloc",
    }
    args = [sys.executable, "-c", textwrap.dedent(_SANITIZED), str(out), str(base)] + (
        ["control"] if control else []
    )
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    if "Shadow memory range interleaves" in p.stderr or "does not come first" in p.stderr:
        pytest.skip("AddressSanitizer cannot start in this process layout")
    return p


def test_batches_are_clean_under_address_and_undefined_behaviour_sanitizers(tmp_path: Path) -> None:
    p = _run_sanitized(tmp_path, control=False)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-5000:]
    assert "runtime error" not in p.stderr and "AddressSanitizer" not in p.stderr, p.stderr[-5000:]


def test_the_sanitizer_run_catches_an_overrun(tmp_path: Path) -> None:
    """The control: a read into a buffer one byte too short is reported, so the clean run means something."""
    p = _run_sanitized(tmp_path, control=True)
    assert p.returncode != 0
    assert "heap-buffer-overflow" in p.stderr, p.stderr[-5000:]


def test_batches_mixing_small_and_large_chunks_keep_their_order(lib: BatchIO, tmp_path: Path) -> None:
    """Chunks of 1 MiB and more go one by one (piecewise checksums, O_DIRECT, fused reads),
    the others natively; results and the first stop keep the batch's order."""
    rng = np.random.default_rng(11)
    sizes = [100, (1 << 20) + 3, 5000, 2 << 20, 7, (1 << 20) - 10]
    pads = [0, 0, 9, 0, 0, 20]
    buffers = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    trees, crcs = [], []
    for tag, chosen in (("native", lib), ("python", None)):
        w, b = _write(tmp_path / tag, buffers, pads, [b"{}", None, b"{}", b"{}", None, b"{}"])
        with using(chosen):
            crcs.append(w.write_chunks(b))
        w.commit(ROOT_DOC)
        trees.append(_tree(tmp_path / tag))
    assert (
        crcs[0]
        == crcs[1]
        == [crc32c_package.crc32c(x.tobytes() + bytes(p)) for x, p in zip(buffers, pads, strict=True)]
    )
    assert trees[0] == trees[1]
    root = tmp_path / "native"
    for victim in (3, 4):  # a large chunk, then a small one after it
        _damage(root, "flip", f"a{victim}", random.Random(victim))
        stops = []
        for chosen in (lib, None):
            dests = [np.empty_like(x) for x in buffers]
            reads = ChunkReads([f"a{i}" for i in range(6)], ["c.0"] * 6, dests, pads, crcs[0])
            with using(chosen):
                stops.append(_stop_fields(LocalReader(root).read_chunks(reads)))
        assert stops[0] == stops[1] and stops[0][0] == 3


def _file_sizes_in_python(root: Path, paths: list[str]) -> list[int | None]:
    out: list[int | None] = []
    for p in paths:
        try:
            st = os.lstat(root / p)
        except (FileNotFoundError, NotADirectoryError):
            out.append(None)
            continue
        out.append(st.st_size if stat.S_ISREG(st.st_mode) else None)
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_sizes_of_many_files_in_one_call_agree_with_lstat(
    lib: BatchIO, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """``gbio_stat``: regular files give their size; missing files, missing directories, a file
    where a directory should be, symlinks, FIFOs and directories are reported, never followed or
    opened (a FIFO would block an open), and the call goes on past them. Run on two threads
    (each half of the files on one), the odd files straddle the halves: the same answers."""
    monkeypatch.setattr(batchio, "PARALLEL_STAT_MIN", 2 if threads == 2 else 1 << 30)
    root = tmp_path / "c"
    (root / "a").mkdir(parents=True)
    rng = random.Random(5)
    paths = []
    for i in range(300):
        n = rng.choice([0, 1, 4, 4099, 70000])
        (root / "a" / f"c.{i}").write_bytes(b"x" * n)
        paths.append(f"a/c.{i}")
    os.symlink(root / "a" / "c.1", root / "a" / "link")
    os.mkfifo(root / "a" / "fifo")
    (root / "a" / "dir").mkdir()
    (root / "file").write_bytes(b"12")
    odd = ["a/link", "a/fifo", "a/dir", "a/missing", "nope/c.0", "file/c.0", "file"]
    at = 150  # of 307 paths: the odd ones lie on both sides of the middle (153)
    mixed = [*paths[:at], *odd, *paths[at:]]
    sizes, stops = lib.sizes(str(root), mixed)
    expected = _file_sizes_in_python(root, mixed)
    assert [None if s < 0 else int(s) for s in sizes] == expected
    by_index = {s.index: s for s in stops}
    assert sorted(by_index) == [at + k for k in range(len(odd) - 1)]  # "file" itself is regular
    assert by_index[at].step == "not-regular" and stat.S_ISLNK(by_index[at].mode)
    assert by_index[at + 1].step == "not-regular" and stat.S_ISFIFO(by_index[at + 1].mode)
    assert by_index[at + 2].step == "not-regular" and stat.S_ISDIR(by_index[at + 2].mode)
    assert by_index[at + 3].err == errno.ENOENT and by_index[at + 4].err == errno.ENOENT
    assert by_index[at + 5].err == errno.ENOTDIR
    with pytest.raises(FileNotFoundError):
        lib.sizes(str(tmp_path / "absent"), ["a/c.0"])


def test_the_reader_checks_many_chunk_sizes_as_one_at_a_time(lib: BatchIO, tmp_path: Path) -> None:
    """LocalReader.chunk_sizes with and without the library: the same answers, including for a
    chunk inside a symlinked array directory (refused like a missing one)."""
    buffers = [np.arange(n, dtype=np.uint8) for n in (0, 5, 300, 70000)]
    w, b = _write(tmp_path / "c", buffers, [0, 0, 3, 0], [None] * 4)
    w.write_chunks(b)
    w.commit(ROOT_DOC)
    root = tmp_path / "c"
    shutil.copytree(root / "a3", tmp_path / "elsewhere")
    shutil.rmtree(root / "a3")
    os.symlink(tmp_path / "elsewhere", root / "a3")
    os.truncate(root / "a1" / "c.0", 2)
    names, keys = ["a0", "a1", "a2", "a3", "a9", "a2"], ["c.0", "c.0", "c.0", "c.0", "c.0", "c.9"]
    answers = []
    for chosen in (lib, None):
        with using(chosen):
            answers.append(LocalReader(root).chunk_sizes(names, keys))
    assert answers[0] == answers[1] == [4, 2, 307, None, None, None]


@pytest.mark.parametrize("sync", ["none", "file"])
def test_documents_in_one_batch_leave_the_files_one_by_one_leaves(
    lib: BatchIO, tmp_path: Path, sync: str
) -> None:
    names = [f"arr{i}" for i in range(5)]
    docs = [json.dumps({"i": i}).encode() for i in range(5)]
    trees = []
    for tag, chosen in (("native", lib), ("python", None)):
        w = LocalWriter(tmp_path / tag, sync=sync)
        w.begin()
        with using(chosen):
            w.write_array_documents(names, docs)
        w.commit(ROOT_DOC)
        trees.append(_tree(tmp_path / tag))
    assert trees[0] == trees[1]
    assert all(trees[0][f"arr{i}/zarr.json"] == docs[i] for i in range(5))


def test_a_document_batch_stops_at_the_first_error_and_names_it(lib: BatchIO, tmp_path: Path) -> None:
    w = LocalWriter(tmp_path / "c", sync="none")
    w.begin()
    w.write_array_document("b", b"{}")
    with using(lib), pytest.raises(FileExistsError, match=r"/b"):
        w.write_array_documents(["a", "b", "c"], [b"{}", b"{}", b"{}"])
    w.abort()


# ---- removing a tree ---------------------------------------------------------------------


def _doomed_tree(root: Path, outside: Path) -> None:
    """Files, empty and nested directories, and links (to a file and to a directory outside)."""
    for i in range(30):
        d = root / f"a{i}" / "c" / "0"
        d.mkdir(parents=True)
        (d / "chunk").write_bytes(b"x" * i)
        (root / f"a{i}" / "zarr.json").write_text("{}")
    (root / "empty").mkdir()
    deep = root.joinpath(*[f"d{i}" for i in range(20)])
    deep.mkdir(parents=True)
    (deep / "leaf").write_text("deep")
    (root / "to-dir").symlink_to(outside, target_is_directory=True)
    (root / "a3" / "to-file").symlink_to(outside / "keep.txt")
    (root / "dangling").symlink_to(root / "nowhere")


@pytest.mark.parametrize("native", [True, False])
def test_a_tree_is_removed_without_following_links(tmp_path: Path, native: bool) -> None:
    """remove_tree (and rmtree_quiet, natively or through shutil) removes a directory and all it
    holds, but never what a link inside points to; a link given as the tree is refused and
    left, as is what it points to."""
    from gpuckpt.storage.local import fsutil

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (outside / "sub").mkdir()
    root = tmp_path / "tree"
    root.mkdir()
    _doomed_tree(root, outside)
    lib = load_library()
    if native and lib is None:
        pytest.skip("the library is not built here")
    if native:
        assert lib is not None
        # the tree itself, 30 arrays of 5 entries, an empty folder, 20 nested ones and a file, 3 links
        assert lib.remove_tree(root) == 1 + 30 * 5 + 1 + 21 + 3
    else:
        with using(None):
            fsutil.rmtree_quiet(root)
    assert not root.exists() and not root.is_symlink()
    assert (outside / "keep.txt").read_text() == "keep" and (outside / "sub").is_dir()
    # a link to a directory is not a tree to remove: refused, nothing behind it touched
    link = tmp_path / "link"
    link.symlink_to(outside, target_is_directory=True)
    if native:
        assert lib is not None
        with pytest.raises(OSError) as info:
            lib.remove_tree(link)
        assert info.value.errno in (errno.ELOOP, errno.ENOTDIR)
    else:
        with using(None):
            fsutil.rmtree_quiet(link)
    assert link.is_symlink() and (outside / "keep.txt").exists()
    with using(lib):
        fsutil.rmtree_quiet(tmp_path / "missing")  # quiet: nothing there is no error
        fsutil.rmtree_quiet(link)
    assert link.is_symlink() and (outside / "keep.txt").exists()


def test_rmtree_quiet_goes_native_where_it_can(tmp_path: Path) -> None:
    """rmtree_quiet calls the library when it is loaded, and shutil when it is not."""
    from gpuckpt.storage.local import fsutil

    lib = load_library()
    if lib is None:
        pytest.skip("the library is not built here")
    calls: list[str] = []

    class Counting:
        def remove_tree(self, path: Path) -> int:
            calls.append(str(path))
            return lib.remove_tree(path)  # type: ignore[union-attr]

    root = tmp_path / "tree"
    root.mkdir()
    (root / "f").write_text("x")
    with using(Counting()):  # type: ignore[arg-type]
        fsutil.rmtree_quiet(root)
    assert calls == [str(root)] and not root.exists()


# ---- directories taken from a reused tree ---------------------------------------------------


def test_a_taken_directory_is_written_over_and_holds_nothing_else(tmp_path: Path) -> None:
    """TAKEDIR: the directory of the reused tree moves into the batch's root in one rename, its
    files are written over (same inodes) and cut to their new sizes, and whatever else it held
    (a file, a nested folder) is removed; where the reused tree has no such directory one is
    made. The ``taken`` field says which directories and files were taken."""
    lib = load_library()
    if lib is None:
        pytest.skip("the library is not built here")
    reuse, root = tmp_path / "reuse", tmp_path / "root"
    (reuse / "a" / "sub" / "deep").mkdir(parents=True)
    (reuse / "a" / "zarr.json").write_bytes(b"x" * 1000)
    (reuse / "a" / "c.0").write_bytes(b"y" * 5000)
    (reuse / "a" / "c.1").write_text("stale")
    root.mkdir()
    inodes = {n: (reuse / "a" / n).stat().st_ino for n in ("zarr.json", "c.0")}
    data = np.arange(100, dtype=np.uint8)
    kinds = [batchio.TAKEDIR, batchio.FILE, batchio.CHUNK] * 2
    paths = ["a", "a/zarr.json", "a/c.0", "b", "b/zarr.json", "b/c.0"]
    buffers = [b"", b"{}", data] * 2
    items, stop = lib.write(
        str(root), kinds, paths, buffers, [2, 0, 3, 2, 0, 0], fsync=None, writeback_min=None, reuse=str(reuse)
    )
    assert stop is None
    assert items["taken"].tolist() == [1, 1, 1, 0, 0, 0]
    assert sorted(os.listdir(root / "a")) == ["c.0", "zarr.json"] and not (reuse / "a").exists()
    assert {n: (root / "a" / n).stat().st_ino for n in ("zarr.json", "c.0")} == inodes
    stored = data.tobytes() + bytes(3)
    crc = crc32c_package.crc32c(stored)
    assert int(items["crc"][2]) == crc
    assert (root / "a" / "c.0").read_bytes() == stored + crc.to_bytes(4, "little")
    assert (root / "a" / "zarr.json").read_bytes() == b"{}" == (root / "b" / "zarr.json").read_bytes()
    assert (root / "b" / "c.0").read_bytes() == data.tobytes() + crc32c_package.crc32c(
        data.tobytes()
    ).to_bytes(4, "little")
    # without a reused tree, TAKEDIR makes its directory; an existing one is an error, as for MKDIR
    items, stop = lib.write(
        str(root),
        [batchio.TAKEDIR, batchio.FILE],
        ["c", "c/f"],
        [b"", b"1"],
        [1, 0],
        fsync=None,
        writeback_min=None,
    )
    assert stop is None and (root / "c" / "f").read_bytes() == b"1" and items["taken"].tolist() == [0, 0]
    _items, stop = lib.write(str(root), [batchio.TAKEDIR], ["c"], [b""], [0], fsync=None, writeback_min=None)
    assert stop is not None and stop.err == errno.EEXIST


@pytest.mark.parametrize(
    ("kinds", "paths", "pads"),
    [
        ([batchio.TAKEDIR, batchio.FILE], ["c", "d/zarr.json"], [1, 0]),  # a file outside it
        ([batchio.TAKEDIR, batchio.FILE], ["c", "c/x/y"], [1, 0]),  # not directly in it
        ([batchio.TAKEDIR, batchio.FILE], ["c", "c/"], [1, 0]),  # no file name
        ([batchio.TAKEDIR], ["c"], [1]),  # more files than items
        ([batchio.TAKEDIR, batchio.MKDIR], ["c", "c/d"], [1, 0]),  # a directory among its files
        ([batchio.TAKEDIR, batchio.FILE], ["c/d", "c/d/f"], [1, 0]),  # nested
    ],
)
def test_a_taken_directory_whose_files_are_not_its_own_is_refused(
    tmp_path: Path, kinds: list[int], paths: list[str], pads: list[int]
) -> None:
    """The items a TAKEDIR counts as its files must be files directly in it: else nothing is
    taken or written (EINVAL at that item)."""
    lib = load_library()
    if lib is None:
        pytest.skip("the library is not built here")
    reuse, root = tmp_path / "reuse", tmp_path / "root"
    (reuse / "c").mkdir(parents=True)
    root.mkdir()
    _items, stop = lib.write(
        str(root), kinds, paths, [b""] * len(kinds), pads, fsync=None, writeback_min=None, reuse=str(reuse)
    )
    assert stop is not None and (stop.index, stop.err) == (0, errno.EINVAL)
    assert os.listdir(root) == [] and (reuse / "c").is_dir()


# ---- the bytes of a tree ------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False])
def test_tree_bytes_counts_regular_files_and_follows_no_link(tmp_path: Path, native: bool) -> None:
    """The bytes below a tree (a restore reports its part's bytes): regular files at every
    depth, natively (BatchIO.tree_bytes, tiers.files.tree_bytes's first choice) or by scandir,
    the same answer; links (to a file or a folder outside, dangling) and FIFOs are not counted;
    a link given as the tree is refused natively (OSError) and counts nothing either way."""
    from gpuckpt.tiers.files import tree_bytes

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (outside / "big").write_bytes(b"y" * 100_000)
    root = tmp_path / "tree"
    root.mkdir()
    _doomed_tree(root, outside)
    (root / "a4" / "to-big").symlink_to(outside / "big")
    os.mkfifo(root / "a5" / "fifo")
    expected = sum(range(30)) + 30 * 2 + 4  # chunks of 0..29 bytes, 30 documents "{}", "deep"
    lib = load_library()
    if native and lib is None:
        pytest.skip("the library is not built here")
    with using(lib if native else None):
        assert tree_bytes(root) == expected
    link = tmp_path / "link"
    link.symlink_to(outside, target_is_directory=True)
    if native:
        assert lib is not None
        assert lib.tree_bytes(root) == (30 * 2 + 1, expected)
        with pytest.raises(OSError) as info:
            lib.tree_bytes(link)
        assert info.value.errno in (errno.ELOOP, errno.ENOTDIR)
        with pytest.raises(OSError):
            lib.tree_bytes(tmp_path / "missing")
    with using(lib if native else None):
        assert tree_bytes(link) == 0 and tree_bytes(tmp_path / "missing") == 0


def test_read_files_reads_whole_files_of_their_listed_size_and_stops_at_any_other(
    lib: BatchIO, tmp_path: Path
) -> None:
    """``read_files`` (a part's small files, sent to a peer): each whole file into a buffer of
    its size; a shorter or longer file, a link, a FIFO (not opened: never blocks) or a missing
    file stops the batch there, naming the step."""
    root = tmp_path / "part"
    (root / "a").mkdir(parents=True)
    data = {"zarr.json": b'{"k": 1}', "a/zarr.json": b"{}", "a/c.0": bytes(range(256)) * 3}
    for rel, b in data.items():
        (root / rel).write_bytes(b)
    names = list(data)

    def read(sizes: list[int]) -> tuple[list[bytes], batchio.Stop | None]:
        bufs = [bytearray(n) for n in sizes]
        stop = lib.read_files(str(root), names, bufs)
        return [bytes(b) for b in bufs], stop

    got, stop = read([len(b) for b in data.values()])
    assert stop is None and got == list(data.values())
    _, stop = read([8, 3, 768])
    assert stop is not None and (stop.index, stop.step, stop.done) == (1, "short", 2)
    _, stop = read([8, 2, 767])
    assert stop is not None and (stop.index, stop.step, stop.done) == (2, "long", 768)
    (root / "a/zarr.json").unlink()
    (root / "a/zarr.json").symlink_to(root / "zarr.json")
    _, stop = read([8, 8, 768])
    assert stop is not None and (stop.index, stop.step) == (1, "not-regular")
    (root / "a/zarr.json").unlink()
    os.mkfifo(root / "a/zarr.json")
    _, stop = read([8, 2, 768])
    assert stop is not None and (stop.index, stop.step) == (1, "not-regular")
    assert stat.S_ISFIFO(stop.mode)
    (root / "a/zarr.json").unlink()
    _, stop = read([8, 2, 768])
    assert stop is not None and (stop.index, stop.step, stop.err) == (1, "stat", errno.ENOENT)


def test_write_over_replaces_each_file_in_place_or_anew_and_never_writes_through_a_link(
    lib: BatchIO, tmp_path: Path
) -> None:
    """``write(..., over=True)`` (a replica's small files written into a recycled part): a
    regular file of one name is written over (the same inode, cut to its new size); one that
    a hard link shares, a symbolic link, a directory in the way or no file at all gets a new
    file, the other name and the link's target keeping their bytes."""
    root = tmp_path / "part"
    (root / "a").mkdir(parents=True)
    (root / "same").write_bytes(b"x" * 100)
    inode = (root / "same").stat().st_ino
    (root / "shared").write_bytes(b"kept")
    os.link(root / "shared", tmp_path / "other-name")
    (tmp_path / "target").write_bytes(b"target")
    (root / "link").symlink_to(tmp_path / "target")
    (root / "a" / "dir").mkdir()
    (root / "a" / "dir" / "inside").write_bytes(b"1")
    names = ["same", "shared", "link", "a/dir", "a/new"]
    data = [b"new", b"fresh", b"not through", b"file now", b"made"]
    _, stop = lib.write(
        str(root), [batchio.FILE] * 5, names, data, [0] * 5, fsync=None, writeback_min=None, over=True
    )
    assert stop is None
    assert {n: (root / n).read_bytes() for n in names} == dict(zip(names, data, strict=True))
    assert (root / "same").stat().st_ino == inode
    assert (tmp_path / "other-name").read_bytes() == b"kept" and (
        tmp_path / "target"
    ).read_bytes() == b"target"
    assert not (root / "link").is_symlink() and (root / "a" / "dir").is_file()
