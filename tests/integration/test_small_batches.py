"""Saves and loads of many small tensors through the native batches (gpuckpt/storage/local/batchio.c),
end to end: the same checkpoint, the same loaded values and the same typed errors as the
one-file-at-a-time path, and a save that meets a failing disk below the native code publishes
nothing."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.storage.local import batchio
from gpuckpt.testing.faults import fault_shim_env, temporaries

REPO = Path(__file__).resolve().parents[2]

needs_native = pytest.mark.skipif(
    not batchio.available(), reason="the native batch library is not built here"
)


@contextlib.contextmanager
def native(on: bool) -> Iterator[list[int]]:
    """Native batches on or off inside the block; yields the sizes of the native batches run."""
    lib = batchio.instance()
    calls: list[int] = []
    if on and lib is None:
        pytest.skip("the native batch library is not built here")

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(lib, name)

        def write(self, root: str, kinds: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(len(kinds))
            return lib.write(root, kinds, *args, **kwargs)  # type: ignore[union-attr]

        def read(self, root: str, paths: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(len(paths))
            return lib.read(root, paths, *args, **kwargs)  # type: ignore[union-attr]

        def prepare_read(self, paths: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(len(paths))  # a load's batch of whole chunks, read by range later
            return lib.prepare_read(paths, *args, **kwargs)  # type: ignore[union-attr]

    saved = batchio.instance
    batchio.instance = (lambda: Counting()) if on else (lambda: None)  # type: ignore[assignment]
    try:
        yield calls
    finally:
        batchio.instance = saved  # type: ignore[assignment]


def small_state(seed: int = 0) -> dict[str, Any]:
    """Small tensors of every layout the batches meet: prefix boxes with padding, strided,
    big-endian, channels-last, empty, 0-d, several chunks, plus plain values."""
    rng = np.random.default_rng(seed)
    sd: dict[str, Any] = {
        f"p{i}": rng.standard_normal(int(n)).astype(np.float32)
        for i, n in enumerate(rng.integers(1, 3000, 40))
    }
    sd["big_endian"] = np.arange(1000, dtype=">f8")
    sd["strided"] = np.arange(4000, dtype=np.int16)[::2]
    sd["channels_last"] = np.ascontiguousarray(
        rng.standard_normal((2, 5, 3, 4)).astype(np.float32).transpose(0, 2, 3, 1)
    ).transpose(0, 3, 1, 2)
    sd["empty"] = np.zeros((0, 3), np.float32)
    sd["scalar"] = np.array(7.5)
    sd["edge_chunks"] = rng.standard_normal((33, 17)).astype(
        np.float64
    )  # with chunk_bytes below: padded edges
    sd["twin_a"] = rng.standard_normal(300).astype(np.float32)
    sd["twin_b"] = rng.standard_normal(300).astype(np.float32)
    sd["step"] = 12
    return sd


def _files(root: Path) -> dict[str, bytes]:
    return {os.fspath(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _zeros(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: np.zeros_like(v) if isinstance(v, np.ndarray) else None for k, v in sd.items()}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.shape == b.shape
            and a.dtype.newbyteorder("=") == b.dtype.newbyteorder("=")
            and (a.astype(b.dtype) == b).all()
        )
    return bool(a == b)


def test_native_and_python_paths_write_the_same_checkpoint_and_load_the_same_values(tmp_path: Path) -> None:
    sd = small_state()
    outputs = {}
    for on in (True, False):
        path = tmp_path / f"native-{on}"
        with native(on) as calls:
            gpuckpt.save(sd, path, chunk_bytes=1024)
            loaded = gpuckpt.load_state_dict(path)
            targets = _zeros(sd)
            gpuckpt.load(targets, path)
        assert bool(calls) == on  # the native batches really ran, or really did not
        for k, v in sd.items():
            assert _same(v, loaded[k]), k
            assert _same(v, targets[k]), k
        outputs[on] = _files(path)
    # the same files, byte for byte, but for the ids of the save in the root document
    native_files, python_files = outputs[True], outputs[False]
    assert native_files.keys() == python_files.keys()
    for name in native_files:
        if name != "zarr.json":
            assert native_files[name] == python_files[name], name


DAMAGES: list[tuple[str, Callable[[Path], None], type[Exception]]] = [
    ("flipped byte", lambda p: _flip(p / "p3" / "c.0", 5), gpuckpt.ChecksumError),
    ("flipped trailer", lambda p: _flip(p / "p7" / "c.0", -1), gpuckpt.ChecksumError),
    ("missing chunk", lambda p: (p / "p11" / "c.0").unlink(), gpuckpt.MissingChunkError),
    ("truncated chunk", lambda p: os.truncate(p / "p2" / "c.0", 3), gpuckpt.CheckpointCorruptedError),
    ("chunk is a FIFO", lambda p: _replace(p / "p5" / "c.0", os.mkfifo), gpuckpt.MissingChunkError),
    (
        "chunks of the same size swapped",
        lambda p: _swap(p / "twin_a" / "c.0", p / "twin_b" / "c.0"),
        gpuckpt.ChecksumError,
    ),
    (
        "chunk of another size",
        lambda p: _swap(p / "p1" / "c.0", p / "p9" / "c.0"),
        gpuckpt.CheckpointCorruptedError,
    ),
]


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))


def _replace(path: Path, make: Callable[[Path], None]) -> None:
    path.unlink()
    make(path)


def _swap(a: Path, b: Path) -> None:
    ra, rb = a.read_bytes(), b.read_bytes()
    a.write_bytes(rb)
    b.write_bytes(ra)


@pytest.mark.parametrize(("what", "damage", "error"), DAMAGES, ids=[d[0] for d in DAMAGES])
def test_damage_raises_the_same_error_on_both_paths(
    tmp_path: Path, what: str, damage: Callable[[Path], None], error: type[Exception]
) -> None:
    sd = small_state()
    path = tmp_path / "c"
    gpuckpt.save(sd, path)
    damage(path)
    messages = []
    for on in (True, False):
        for load in (lambda: gpuckpt.load_state_dict(path), lambda: gpuckpt.load(_zeros(sd), path)):
            with native(on), pytest.raises(error) as info:
                load()
            messages.append((type(info.value), str(info.value)))
    assert len(set(messages[0::2])) == 1 and len(set(messages[1::2])) == 1, messages


_FAULTED = """
    import json, sys
    import numpy as np
    import gpuckpt
    from gpuckpt.storage.local import batchio
    base = sys.argv[1]
    rng = np.random.default_rng(0)
    sd = {f"t{i}": rng.standard_normal(int(n)).astype(np.float32) for i, n in enumerate(rng.integers(1, 16000, 200))}
    try:
        gpuckpt.save(sd, base + "/ckpt", overwrite=True, sync=sys.argv[2])
        out = None
    except OSError as exc:
        out = [type(exc).__name__, exc.errno, "nothing was published" in str(exc)]
    print(json.dumps({"error": out, "native": batchio.available()}))
"""


@pytest.mark.parametrize(
    ("call", "nth", "err", "partial", "sync"),
    [
        ("write", 150, errno.ENOSPC, 0, "fs"),
        ("write", 30, errno.ENOSPC, 700, "file"),  # a short write, then a full disk
        ("open", 100, errno.EIO, 0, "fs"),
        ("mkdir", 40, errno.ENOSPC, 0, "file"),
        ("fsync", 20, errno.EIO, 0, "file"),
    ],
)
@pytest.mark.parametrize("batches", ["on", "off"])
def test_a_failing_disk_below_the_native_batches_publishes_nothing(
    shim: Path, tmp_path: Path, call: str, nth: int, err: int, partial: int, sync: str, batches: str
) -> None:
    base = tmp_path / "data"
    old = {"w": np.arange(10.0)}
    gpuckpt.save(old, base / "ckpt")
    env = fault_shim_env(shim, base, call, nth=nth, err=err, partial=partial)
    env["GPUCKPT_BATCHIO"] = batches
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_FAULTED), str(base), sync],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["native"] == (batches == "on")
    assert out["error"] == ["CheckpointWriteError", err, True], out
    assert temporaries(base) == []
    # the earlier checkpoint is intact
    np.testing.assert_array_equal(gpuckpt.load_state_dict(base / "ckpt")["w"], old["w"])


@needs_native
def test_the_native_batches_are_what_saves_and_loads_use_by_default(tmp_path: Path) -> None:
    sd = {f"t{i}": np.full(100 + i, i, np.float32) for i in range(50)}
    with native(True) as calls:
        gpuckpt.save(sd, tmp_path / "c")
        written = sum(calls)
        calls.clear()
        gpuckpt.load_state_dict(tmp_path / "c")
        read = sum(calls)
    assert written == 150  # a directory, a document and a chunk per tensor
    assert read == 50


_TRACED = """
    import sys
    import numpy as np
    import gpuckpt
    from gpuckpt.storage.local import batchio
    assert batchio.available()
    state = {f"layer{i}": {"w": np.full((3, 5), i, np.float32), "b": np.arange(i + 1)} for i in range(40)}
    state["big"] = np.arange(100_000, dtype=np.float64)  # several chunks
    gpuckpt.save(state, sys.argv[1], sync="file", chunk_bytes=1 << 16)
"""


@needs_native
def test_with_native_batches_every_file_and_directory_is_fsynced(shim: Path, tmp_path: Path) -> None:
    """sync="file": the fsyncs the native code makes (seen in libc) and Python's cover every
    file and directory of the checkpoint."""
    base = tmp_path / "data"
    base.mkdir()
    log = tmp_path / "fsyncs.log"
    env = fault_shim_env(shim, base, "none", trace=log)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_TRACED), str(base / "ck")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    synced = {
        (int(d), int(i))
        for call, d, i, _ in (line.split() for line in log.read_text().splitlines())
        if call == "fsync"
    }
    inodes = set()
    for dirpath, _dirs, files in os.walk(base / "ck"):
        for q in [dirpath, *(os.path.join(dirpath, f) for f in files)]:
            st = os.stat(q)
            inodes.add((st.st_dev, st.st_ino))
    assert len(inodes) > 120
    missing = inodes - synced
    assert not missing, f"{len(missing)} files or directories of the checkpoint were never fsynced"


@needs_native
def test_async_saves_write_small_chunks_through_the_native_batches(tmp_path: Path) -> None:
    sd = {f"t{i}": np.full(100 + i, i, np.float32) for i in range(50)}
    with native(True) as calls:
        gpuckpt.async_save(sd, tmp_path / "c").result()
    assert sum(calls) == 150  # a directory, a document and a chunk per tensor
    back = gpuckpt.load_state_dict(tmp_path / "c")
    for k, v in sd.items():
        np.testing.assert_array_equal(back[k], v)


@needs_native
def test_small_tensors_between_large_ones_are_read_in_native_batches_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state that alternates large tensors (1 MiB and more) and small ones, as a GPT-like model
    does (a matrix, then its bias and norms), reads its small tensors in batches of their own,
    through the native library, and each large one as a job of its own: in the state's order a
    batch closed at each large tensor, and a range holding one is read file by file, so no small
    tensor went native. Every value loads; a damaged small or large tensor is the one named."""
    from gpuckpt.storage.local.reader import LocalReader

    rng = np.random.default_rng(3)
    sd: dict[str, Any] = {}
    for i in range(12):
        sd[f"l{i:02d}.w"] = rng.standard_normal((512, 600)).astype(np.float32)  # 1.2 MiB
        for j in range(3):
            sd[f"l{i:02d}.b{j}"] = rng.standard_normal(100 + j).astype(np.float32)
    path = tmp_path / "c"
    gpuckpt.save(sd, path)
    seen: list[list[list[str]]] = []
    original = LocalReader.chunk_read_jobs

    def listing(self: LocalReader, batch: Any, spans: Any) -> Any:
        seen.append([list(batch.names[a:b]) for a, b in spans])
        return original(self, batch, spans)

    monkeypatch.setattr(LocalReader, "chunk_read_jobs", listing)
    got = _zeros(sd)
    with native(True) as calls:
        gpuckpt.load(got, path)
    assert all(_same(sd[k], got[k]) for k in sd)
    (ranges,) = seen  # one batch of the whole tensors, its ranges: the small ones', then each large one
    assert sorted(ranges[0]) == sorted(k for k in sd if ".b" in k)
    assert ranges[1:] == [[f"l{i:02d}.w"] for i in range(12)]
    assert calls == [48]  # the batch prepared once, its small range read by the library
    for name in ("l05.b1", "l07.w"):
        damaged = tmp_path / f"d-{name}"
        gpuckpt.save(sd, damaged)
        chunk = next((damaged / name).glob("c*"))
        data = bytearray(chunk.read_bytes())
        data[10] ^= 0xFF
        chunk.write_bytes(bytes(data))
        with pytest.raises(gpuckpt.ChecksumError, match=rf"'{name}'|{name}"):
            gpuckpt.load(_zeros(sd), damaged)
