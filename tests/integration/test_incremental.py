"""Incremental saves (``base=``): unchanged chunks are shared with the base, never written again.

Real checkpoints on ``tmp_path``; sharing is observed on the files themselves
(inode numbers and link counts), equality on the loaded bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import IncrementalBaseWarning, InvalidOptionError
from gpuckpt.format.checksum import crc32c
from gpuckpt.format.documents import root_document
from gpuckpt.format.reader import metadata_from_json
from gpuckpt.manager import CheckpointManager
from gpuckpt.verify import verify_checkpoint

pytestmark = pytest.mark.filterwarnings("error::gpuckpt.errors.IncrementalBaseWarning")

FIXTURE_V1 = Path(__file__).parent.parent / "fixtures" / "format-v1"
KB = 1 << 10


def make_state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "emb": rng.standard_normal((256, 64)).astype(np.float32),  # 64 KiB
            "a": rng.standard_normal(3000).astype(np.float32),
            "b": rng.integers(0, 100, 700, dtype=np.int64),
            # 1001 columns of float64: 5 chunks of 151 rows (1.2 MB, more than one 1 MiB
            # leaf), the last one padded
            "big": rng.standard_normal((751, 1001)),
        },
        "step": seed,
    }


CHUNK = 1200 * KB


def chunk_files(path: Path) -> dict[str, os.stat_result]:
    out = {}
    for root, _dirs, files in os.walk(path):
        for f in files:
            if f != "zarr.json":
                p = Path(root) / f
                out[str(p.relative_to(path))] = p.stat()
    return out


def assert_loads(path: Path, want: dict[str, Any]) -> None:
    got = gpuckpt.load_state_dict(path)
    assert got["step"] == want["step"]
    for k, v in want["model"].items():
        assert got["model"][k].dtype == v.dtype and got["model"][k].tobytes() == v.tobytes(), k
    report = verify_checkpoint(path)
    assert report.ok, report.damage


def changed(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with two small tensors and a few rows deep in one chunk of ``big`` changed."""
    new = {"model": {k: v.copy() for k, v in state["model"].items()}, "step": state["step"] + 1}
    new["model"]["a"] += 1
    new["model"]["b"][3] = -1
    new["model"]["big"][283:285] = 0.5  # chunk 1 (rows 151-301), past its first MiB
    return new


def test_unchanged_chunks_are_links(tmp_path: Path) -> None:
    s0 = make_state()
    gpuckpt.save(s0, tmp_path / "c0", chunk_bytes=CHUNK, content_hash=True)
    s1 = changed(s0)
    gpuckpt.save(s1, tmp_path / "c1", chunk_bytes=CHUNK, base=tmp_path / "c0")
    f0, f1 = chunk_files(tmp_path / "c0"), chunk_files(tmp_path / "c1")
    assert sorted(f0) == sorted(f1)
    new = {k for k in f1 if f1[k].st_ino != f0[k].st_ino}
    assert new == {"model.a/c.0", "model.b/c.0", "model.big/c.1.0"}
    for k, st in f1.items():
        assert st.st_nlink == (1 if k in new else 2), k
    assert len(f0) == 8
    grid = gpuckpt.read_metadata(tmp_path / "c0").storage_data["tensors"]["model.big"]["chunk_grid"]
    assert grid == {"configuration": {"chunk_shape": [151, 1001]}, "name": "regular"}
    assert_loads(tmp_path / "c0", s0)
    assert_loads(tmp_path / "c1", s1)
    # the hashes of reused chunks are recorded again (the next save compares with them)
    md = gpuckpt.read_metadata(tmp_path / "c1").storage_data
    assert md["content_hash"] == {"algorithm": "xxh3_128-tree-1MiB", "leaf": 1 << 20}
    big = md["tensors"]["model.big"]["chunks"]
    assert all(len(c["xxh3t"]) == 32 and len(c["head"]) == 32 for c in big)


def test_other_readers_read_the_incremental_checkpoint(tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
    s0 = make_state()
    gpuckpt.save(s0, tmp_path / "c0", chunk_bytes=CHUNK, content_hash=True)
    s1 = changed(s0)
    gpuckpt.save(s1, tmp_path / "c1", chunk_bytes=CHUNK, base=tmp_path / "c0")
    for name in ("big", "a", "emb"):
        z = zarr.open_array(tmp_path / "c1" / f"model.{name}", mode="r")
        assert np.array_equal(z[...], s1["model"][name])
    ts = pytest.importorskip("tensorstore")
    arr = ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "c1" / "model.big")}}
    ).result()
    assert np.array_equal(arr.read().result(), s1["model"]["big"])


def test_base_deleted_leaves_incremental_complete(tmp_path: Path) -> None:
    s0 = make_state()
    gpuckpt.save(s0, tmp_path / "c0", chunk_bytes=CHUNK, content_hash=True)
    s1 = changed(s0)
    gpuckpt.save(s1, tmp_path / "c1", chunk_bytes=CHUNK, base=tmp_path / "c0")
    shutil.rmtree(tmp_path / "c0")
    assert all(st.st_nlink == 1 for st in chunk_files(tmp_path / "c1").values())
    assert_loads(tmp_path / "c1", s1)


def test_overwriting_the_base_leaves_the_incremental_checkpoint_intact(tmp_path: Path) -> None:
    s0 = make_state()
    gpuckpt.save(s0, tmp_path / "c0", chunk_bytes=CHUNK, content_hash=True)
    s1 = changed(s0)
    gpuckpt.save(s1, tmp_path / "c1", chunk_bytes=CHUNK, base=tmp_path / "c0")
    other = make_state(7)
    gpuckpt.save(other, tmp_path / "c0", chunk_bytes=CHUNK, overwrite=True)
    assert_loads(tmp_path / "c0", other)
    assert_loads(tmp_path / "c1", s1)
    # and the other way round: overwriting the incremental one leaves a base that shares with it
    gpuckpt.save(s0, tmp_path / "c2", chunk_bytes=CHUNK, content_hash=True)
    gpuckpt.save(s1, tmp_path / "c3", chunk_bytes=CHUNK, base=tmp_path / "c2")
    gpuckpt.save(other, tmp_path / "c3", chunk_bytes=CHUNK, overwrite=True)
    assert_loads(tmp_path / "c2", s0)


def test_async_save_with_base(tmp_path: Path) -> None:
    s0 = make_state()
    gpuckpt.async_save(s0, tmp_path / "c0", chunk_bytes=CHUNK, content_hash=True).result()
    s1 = changed(s0)
    gpuckpt.async_save(s1, tmp_path / "c1", chunk_bytes=CHUNK, base=tmp_path / "c0").result()
    f0, f1 = chunk_files(tmp_path / "c0"), chunk_files(tmp_path / "c1")
    assert {k for k in f1 if f1[k].st_ino != f0[k].st_ino} == {
        "model.a/c.0",
        "model.b/c.0",
        "model.big/c.1.0",
    }
    assert_loads(tmp_path / "c1", s1)


def test_manager_chain_20_keep_3(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    frozen = rng.standard_normal((64, 1024)).astype(np.float32)  # 4 chunks, never changes
    states = {}
    with CheckpointManager(
        tmp_path / "run", max_to_keep=3, incremental=True, async_save=True, chunk_bytes=64 * KB, sync="none"
    ) as mgr:
        for step in range(20):
            state = {"frozen": frozen, "adapter": np.full(100, step, np.float32), "step": step}
            states[step] = state
            mgr.save(step, state)
    assert mgr.all_steps() == [17, 18, 19]
    first = None
    for step in (17, 18, 19):
        path = mgr.step_path(step)
        got = gpuckpt.load_state_dict(path)
        assert got["step"] == step
        assert got["frozen"].tobytes() == frozen.tobytes()
        assert got["adapter"].tobytes() == states[step]["adapter"].tobytes()
        assert verify_checkpoint(path).ok
        files = chunk_files(path)
        inodes = {k: st.st_ino for k, st in files.items() if k.startswith("frozen/")}
        assert len(inodes) == 4
        first = first or inodes
        assert inodes == first  # one copy of the frozen chunks, shared by every kept step
        assert files["adapter/c.0"].st_nlink == 1


def test_manager_incremental_option_is_checked(tmp_path: Path) -> None:
    with pytest.raises(InvalidOptionError, match="incremental must be True or False"):
        CheckpointManager(tmp_path, incremental="yes")  # type: ignore[arg-type]


def test_base_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(InvalidOptionError, match="base must be the path or URL"):
        gpuckpt.save({"x": np.ones(1)}, tmp_path / "c", base=3)  # type: ignore[arg-type]
    gpuckpt.save({"x": np.ones(1)}, tmp_path / "c")
    with pytest.raises(InvalidOptionError, match="is the checkpoint being saved"):
        gpuckpt.save({"x": np.ones(1)}, tmp_path / "c", base=tmp_path / "c", overwrite=True)
    with pytest.raises(InvalidOptionError, match="is the checkpoint being saved"):
        gpuckpt.async_save({"x": np.ones(1)}, tmp_path / "c", base=str(tmp_path / "c"), overwrite=True)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_reuse_refused_across_file_systems(tmp_path: Path) -> None:
    if os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("/dev/shm is on the same file system as tmp_path")
    shm = Path("/dev/shm") / f"gpuckpt-incr-{os.getpid()}-{tmp_path.name}"
    try:
        s0 = make_state()
        gpuckpt.save(s0, shm / "c0", chunk_bytes=CHUNK, content_hash=True)
        s1 = changed(s0)
        gpuckpt.save(s1, tmp_path / "c1", chunk_bytes=CHUNK, base=shm / "c0")
        assert all(st.st_nlink == 1 for st in chunk_files(tmp_path / "c1").values())
        assert_loads(tmp_path / "c1", s1)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


# bases that cannot be used, or chunks that must not be reused -------------------------------


def _rewrite_root(path: Path, change: Any, *, fix_crc: bool = True) -> None:
    doc = json.loads((path / "zarr.json").read_text())
    md = metadata_from_json(doc["attributes"]["gpuckpt"]["metadata"])
    change(md)
    if fix_crc:
        (path / "zarr.json").write_bytes(root_document(md))
    else:
        doc["attributes"]["gpuckpt"]["metadata"] = json.loads(md.to_json())
        (path / "zarr.json").write_text(json.dumps(doc))


def _break_root_crc(path: Path) -> None:
    doc = json.loads((path / "zarr.json").read_text())
    doc["attributes"]["gpuckpt"]["metadata"]["storage_meta"]["checkpoint_id"] = "tampered"
    (path / "zarr.json").write_text(json.dumps(doc))


def _other_version(path: Path) -> None:
    def bump(md: gpuckpt.Metadata) -> None:
        md.version = "99"

    _rewrite_root(path, bump)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: shutil.rmtree(p), "no checkpoint at"),
        (_break_root_crc, "checksum"),
        (_other_version, "version"),
    ],
    ids=["missing", "root-crc", "version-99"],
)
def test_unusable_base_warns_and_writes_everything(tmp_path: Path, damage: Any, message: str) -> None:
    s0 = make_state()
    gpuckpt.save(s0, tmp_path / "c0", chunk_bytes=CHUNK, content_hash=True)
    damage(tmp_path / "c0")
    s1 = changed(s0)
    with pytest.warns(IncrementalBaseWarning, match=message) as caught:
        gpuckpt.save(s1, tmp_path / "c1", chunk_bytes=CHUNK, base=tmp_path / "c0")
    assert str(tmp_path / "c0") in str(caught[0].message)
    assert "writes every chunk" in str(caught[0].message)
    assert all(st.st_nlink == 1 for st in chunk_files(tmp_path / "c1").values())
    assert_loads(tmp_path / "c1", s1)


def test_damaged_base_chunk_files_are_written_fresh(tmp_path: Path) -> None:
    s0 = make_state()
    gpuckpt.save(s0, tmp_path / "c0", chunk_bytes=CHUNK, content_hash=True)
    # one truncated, one replaced by a symlink, one with a wrong trailer, one missing
    with open(tmp_path / "c0/model.big/c.0.0", "r+b") as f:
        f.truncate(1000)
    emb = tmp_path / "c0/model.emb/c.0.0"
    target = tmp_path / "elsewhere"
    target.write_bytes(emb.read_bytes())
    emb.unlink()
    emb.symlink_to(target)
    with open(tmp_path / "c0/model.big/c.2.0", "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\0\0\0")
    (tmp_path / "c0/model.big/c.3.0").unlink()
    # the save is complete and says the base is damaged, with the first chunk and why
    with pytest.warns(IncrementalBaseWarning, match=r"is damaged: 4 of the chunks") as caught:
        gpuckpt.save(s0, tmp_path / "c1", chunk_bytes=CHUNK, base=tmp_path / "c0")
    (w,) = caught
    assert str(tmp_path / "c0") in str(w.message) and "gpuckpt verify" in str(w.message)
    assert any(
        why in str(w.message)
        for why in (
            "1000 bytes, its record gives",
            "missing",
            "not readable",
            "checksum trailer",
            "written after the base was published",  # (where the clock saw the edits as later)
        )
    )
    f1 = chunk_files(tmp_path / "c1")
    fresh = {k for k, st in f1.items() if st.st_nlink == 1}
    assert fresh == {"model.big/c.0.0", "model.emb/c.0.0", "model.big/c.2.0", "model.big/c.3.0"}
    assert_loads(tmp_path / "c1", s0)


def test_base_chunk_written_into_after_publish_with_its_trailer_kept_is_written_fresh(tmp_path: Path) -> None:
    s0 = make_state()
    gpuckpt.save(s0, tmp_path / "c0", chunk_bytes=CHUNK, content_hash=True)
    victim = tmp_path / "c0/model.big/c.1.0"
    time.sleep(0.05)  # past the file system's timestamp granularity: the write comes later
    with open(victim, "r+b") as f:  # one byte of the body changed in place, the trailer kept
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 0x40]))
    assert not verify_checkpoint(tmp_path / "c0").ok
    with pytest.warns(
        IncrementalBaseWarning, match=r"1 of the chunks.*'c\.1\.0'.*written after the base was published"
    ):
        gpuckpt.save(s0, tmp_path / "c1", chunk_bytes=CHUNK, base=tmp_path / "c0")
    f1 = chunk_files(tmp_path / "c1")
    assert f1["model.big/c.1.0"].st_nlink == 1  # written from the state, not linked
    assert {k for k, st in f1.items() if st.st_nlink == 1} == {"model.big/c.1.0"}
    assert verify_checkpoint(tmp_path / "c1").ok
    assert_loads(tmp_path / "c1", s0)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_base_chunk_files_others_can_change_are_written_not_linked(tmp_path: Path) -> None:
    # a hard link shares the inode: its owner (or anyone allowed to write it) could later rewrite
    # it, a CRC32C made to match, under the new checkpoint; such files are written, silently
    s0 = make_state()
    gpuckpt.save(s0, tmp_path / "c0", chunk_bytes=CHUNK, content_hash=True)
    os.chown(tmp_path / "c0/model.big/c.1.0", 65534, 65534)  # another user's
    os.chmod(tmp_path / "c0/model.big/c.2.0", 0o664)  # the group may write it
    os.chmod(tmp_path / "c0/model.emb/c.0.0", 0o646)  # anyone may write it
    with warnings.catch_warnings():
        warnings.simplefilter("error", IncrementalBaseWarning)  # not damage: no warning
        gpuckpt.save(s0, tmp_path / "c1", chunk_bytes=CHUNK, base=tmp_path / "c0")
    f1 = chunk_files(tmp_path / "c1")
    written = {k for k, st in f1.items() if st.st_nlink == 1}
    assert written == {"model.big/c.1.0", "model.big/c.2.0", "model.emb/c.0.0"}, written
    assert all(st.st_uid == os.geteuid() for st in f1.values()) and len(f1) > len(written)
    assert_loads(tmp_path / "c1", s0)


def _crc_forge(prefix: bytes, target: int) -> bytes:
    """4 bytes ``t`` with ``crc32c(prefix + t) == target`` (CRC is affine in the message bits)."""
    zero = crc32c(prefix + b"\0\0\0\0")
    cols = []
    for bit in range(32):
        t = (1 << bit).to_bytes(4, "little")
        cols.append(crc32c(prefix + t) ^ zero)
    # solve sum(x_bit * cols[bit]) == target ^ zero over GF(2) by Gaussian elimination
    rows = [(cols[b], 1 << b) for b in range(32)]
    want = target ^ zero
    basis: dict[int, tuple[int, int]] = {}
    for value, combo in rows:
        for hi in sorted(basis, reverse=True):
            if value >> hi & 1:
                value ^= basis[hi][0]
                combo ^= basis[hi][1]
        if value:
            basis[value.bit_length() - 1] = (value, combo)
    assert len(basis) == 32
    combo = 0
    for hi in sorted(basis, reverse=True):
        if want >> hi & 1:
            want ^= basis[hi][0]
            combo ^= basis[hi][1]
    assert want == 0
    return combo.to_bytes(4, "little")


@pytest.mark.parametrize("hashed_base", [True, False], ids=["hash", "bytes"])
def test_same_crc32c_different_bytes_is_never_reused(tmp_path: Path, hashed_base: bool) -> None:
    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, 4096, dtype=np.uint8)
    b = a.copy()
    b[0] ^= 0xFF
    b[-4:] = np.frombuffer(_crc_forge(b[:-4].tobytes(), crc32c(a.tobytes())), np.uint8)
    assert crc32c(a.tobytes()) == crc32c(b.tobytes()) and a.tobytes() != b.tobytes()
    gpuckpt.save({"x": a, "y": a}, tmp_path / "c0", content_hash=hashed_base)
    gpuckpt.save({"x": b, "y": a}, tmp_path / "c1", base=tmp_path / "c0")
    f1 = chunk_files(tmp_path / "c1")
    assert f1["x/c.0"].st_nlink == 1  # equal CRC, different bytes: written
    assert f1["y/c.0"].st_nlink == 2  # equal bytes: shared
    got = gpuckpt.load_state_dict(tmp_path / "c1")
    assert got["x"].tobytes() == b.tobytes() and got["y"].tobytes() == a.tobytes()


def test_format_v1_fixture_as_base_compares_bytes(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE_V1, tmp_path / "v1")
    state = gpuckpt.load_state_dict(tmp_path / "v1")
    md = gpuckpt.read_metadata(tmp_path / "v1")
    assert "content_hash" not in md.storage_data
    # the fixture's grids: chunked 'layouts.chunked' as it was saved (17 row chunks)
    grid = md.storage_data["tensors"]["layouts.chunked"]["chunk_grid"]
    rows = grid["configuration"]["chunk_shape"][0]
    nbytes = rows * state["layouts"]["chunked"].shape[1] * state["layouts"]["chunked"].dtype.itemsize
    gpuckpt.save(
        {"layouts": {"chunked": state["layouts"]["chunked"]}},
        tmp_path / "c1",
        chunk_bytes=nbytes,
        base=tmp_path / "v1",
    )
    f1 = chunk_files(tmp_path / "c1")
    assert len(f1) == 17 and all(st.st_nlink == 2 for st in f1.values())
    assert gpuckpt.load_state_dict(tmp_path / "c1")["layouts"]["chunked"].tobytes() == (
        state["layouts"]["chunked"].tobytes()
    )


def test_without_xxhash_bytes_are_compared_with_one_warning(tmp_path: Path) -> None:
    s0 = make_state()
    gpuckpt.save(s0, tmp_path / "c0", chunk_bytes=CHUNK, content_hash=True)
    script = f"""
import sys, warnings
sys.modules["xxhash"] = None  # as if not installed
import numpy as np, gpuckpt
from tests.integration.test_incremental import make_state, changed, CHUNK
s1 = changed(make_state())
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    gpuckpt.save(s1, {str(tmp_path / "c1")!r}, chunk_bytes=CHUNK, base={str(tmp_path / "c0")!r})
    gpuckpt.save(s1, {str(tmp_path / "c2")!r}, chunk_bytes=CHUNK, base={str(tmp_path / "c1")!r})
print(len(w), w[0].category.__name__, str(w[0].message)[:80])
"""
    root = Path(__file__).parent.parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=root
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("1 IncrementalBaseWarning incremental save without the xxhash package"), (
        out.stdout
    )
    f0, f1, f2 = (chunk_files(tmp_path / c) for c in ("c0", "c1", "c2"))
    assert {k for k in f1 if f1[k].st_ino != f0[k].st_ino} == {
        "model.a/c.0",
        "model.b/c.0",
        "model.big/c.1.0",
    }
    assert all(f2[k].st_ino == f1[k].st_ino for k in f2)  # c1 has no hashes: compared by bytes
    assert "content_hash" not in gpuckpt.read_metadata(tmp_path / "c1").storage_data
    assert_loads(tmp_path / "c2", changed(make_state()))


def test_content_hash_without_xxhash_warns_once_and_records_no_hash(tmp_path: Path) -> None:
    """Asked for hashes this process cannot compute: said at the save, not at a later incremental
    save; the checkpoint is complete and says it has no hashes."""
    script = f"""
import sys, warnings
sys.modules["xxhash"] = None  # as if not installed
import gpuckpt
from tests.integration.test_incremental import make_state, CHUNK
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    for name in ("h0", "h1"):
        gpuckpt.save(make_state(), {str(tmp_path)!r} + "/" + name, chunk_bytes=CHUNK, content_hash=True)
print(len(w), w[0].category.__name__)
print(str(w[0].message))
"""
    root = Path(__file__).parent.parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=root
    )
    assert out.returncode == 0, out.stderr
    count, message = out.stdout.splitlines()[:2]
    assert count.startswith("1 IncrementalBaseWarning"), out.stdout
    assert (
        message.startswith("content_hash=True without the xxhash package")
        and "gpuckpt[incremental]" in message
    )
    for name in ("h0", "h1"):
        assert "content_hash" not in gpuckpt.read_metadata(tmp_path / name).storage_data
        assert_loads(tmp_path / name, make_state())


# sharing and verification ----------------------------------------------------------------


def test_verify_reads_shared_chunks_of_both_checkpoints(tmp_path: Path) -> None:
    s0 = make_state()
    gpuckpt.save(s0, tmp_path / "c0", chunk_bytes=CHUNK, content_hash=True)
    gpuckpt.save(changed(s0), tmp_path / "c1", chunk_bytes=CHUNK, base=tmp_path / "c0")
    shared = tmp_path / "c1/model.emb/c.0.0"
    assert shared.stat().st_nlink == 2
    with open(shared, "r+b") as f:  # damage the one inode both checkpoints name
        f.seek(100)
        f.write(b"\xff\xfe")
    for c in ("c0", "c1"):
        report = verify_checkpoint(tmp_path / c)
        assert not report.ok and any("model.emb" in d.where for d in report.damage), report.damage


def test_inspect_shows_own_and_shared_bytes(tmp_path: Path) -> None:
    s0 = make_state()
    gpuckpt.save(s0, tmp_path / "run" / "step_00000001", chunk_bytes=CHUNK, content_hash=True)
    s1 = changed(s0)
    gpuckpt.save(
        s1, tmp_path / "run" / "step_00000002", chunk_bytes=CHUNK, base=tmp_path / "run" / "step_00000001"
    )
    files = chunk_files(tmp_path / "run" / "step_00000002")
    own = sum(st.st_size for st in files.values() if st.st_nlink == 1)
    shared = sum(st.st_size for st in files.values() if st.st_nlink > 1)
    assert own > 0 and shared > own
    cli = [sys.executable, "-m", "gpuckpt.cli", "inspect"]
    out = subprocess.run(
        [*cli, "--json", str(tmp_path / "run" / "step_00000002")], capture_output=True, text=True, timeout=60
    )
    totals = json.loads(out.stdout)["totals"]
    assert (totals["own_bytes"], totals["shared_bytes"]) == (own, shared)
    text = subprocess.run(
        [*cli, str(tmp_path / "run" / "step_00000002")], capture_output=True, text=True, timeout=60
    )
    assert "in chunk files of its own" in text.stdout and "shared with other checkpoints" in text.stdout
    root = subprocess.run([*cli, "--json", str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    steps = json.loads(root.stdout)["steps"]
    assert [(s["own_bytes"], s["shared_bytes"]) for s in steps][1] == (own, shared)
    assert steps[0]["shared_bytes"] == shared  # the base shares the same files


def test_saves_without_base_record_no_hashes(tmp_path: Path) -> None:
    gpuckpt.save(make_state(), tmp_path / "c0", chunk_bytes=CHUNK)
    sd = gpuckpt.read_metadata(tmp_path / "c0").storage_data
    assert "content_hash" not in sd
    assert all(set(c) == {"key", "nbytes", "crc32c"} for t in sd["tensors"].values() for c in t["chunks"])


def test_warning_filter_is_strict_here() -> None:
    # the module's filter turns a stray IncrementalBaseWarning into a failure of the test
    with pytest.raises(IncrementalBaseWarning):
        warnings.warn("x", IncrementalBaseWarning, stacklevel=1)


def _fingerprints(path: Path) -> dict[str, tuple[int, int, bytes]]:
    """``(inode, mtime in ns, bytes)`` of every chunk file of a checkpoint."""
    return {k: (st.st_ino, st.st_mtime_ns, (path / k).read_bytes()) for k, st in chunk_files(path).items()}


def test_published_chunk_files_are_never_modified(tmp_path: Path) -> None:
    s0 = make_state()
    gpuckpt.save(s0, tmp_path / "c0", chunk_bytes=CHUNK, content_hash=True)
    s1 = changed(s0)
    gpuckpt.save(s1, tmp_path / "c1", chunk_bytes=CHUNK, base=tmp_path / "c0")
    before = _fingerprints(tmp_path / "c1")
    # everything that touches shared inodes: more incremental saves from either checkpoint,
    # overwrites of both, loads, verification, a manager's retention over linked steps
    gpuckpt.save(changed(s1), tmp_path / "c2", chunk_bytes=CHUNK, base=tmp_path / "c1")
    gpuckpt.save(s1, tmp_path / "c3", chunk_bytes=CHUNK, base=tmp_path / "c0")
    gpuckpt.save(make_state(9), tmp_path / "c0", chunk_bytes=CHUNK, overwrite=True, base=tmp_path / "c1")
    gpuckpt.save(make_state(8), tmp_path / "c3", chunk_bytes=CHUNK, overwrite=True)
    with CheckpointManager(
        tmp_path / "run", max_to_keep=1, incremental=True, async_save=False, chunk_bytes=CHUNK
    ) as m:
        m.save(1, s1)  # no base yet: writes
        m.save(2, s1)  # links to step 1, then deletes step 1
        m.save(3, changed(s1))
    gpuckpt.load_state_dict(tmp_path / "c1")
    assert verify_checkpoint(tmp_path / "c1").ok
    assert _fingerprints(tmp_path / "c1") == before
    assert_loads(tmp_path / "c1", s1)
    assert_loads(tmp_path / "c2", changed(s1))
    assert_loads(tmp_path / "c0", make_state(9))


def _many_chunks(seed: int) -> dict[str, Any]:
    """More chunks than a checkpoint lists (4,200 of 16 bytes: the chunk table, format version 2)."""
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((4200, 4)).astype(np.float32), "b": np.arange(7, dtype=np.int64)}


def test_a_chunk_table_base_serves_its_hashes_and_its_unchanged_chunks(tmp_path: Path) -> None:
    from gpuckpt.format.contenthash import chunk_hash
    from gpuckpt.format.records import TABLE_MIN_CHUNKS
    from gpuckpt.saving.incremental import open_base

    s0 = _many_chunks(0)
    gpuckpt.save(s0, tmp_path / "c0", chunk_bytes=16, content_hash=True)
    md0 = gpuckpt.read_metadata(tmp_path / "c0")
    assert md0.version == "2" and "chunks" not in md0.storage_data["tensors"]["w"]
    # the base's hashes come from its chunk table, one per chunk, each that of the chunk's bytes
    index = open_base(str(tmp_path / "c0"))
    assert index is not None
    for row in (0, 7, 4199):
        found = index.lookup("w", f"c.{row}.0", 16 + 4)
        assert found is not None and found.xxh3t == found.head == chunk_hash([s0["w"][row].tobytes()])
    s1 = {"w": s0["w"].copy(), "b": s0["b"]}
    s1["w"][7] += 1
    s1["w"][4100] = 0
    gpuckpt.save(s1, tmp_path / "c1", chunk_bytes=16, base=tmp_path / "c0")
    f0, f1 = chunk_files(tmp_path / "c0"), chunk_files(tmp_path / "c1")
    shared = {k for k in f1 if k in f0 and f1[k].st_ino == f0[k].st_ino}
    tensor_chunks = {k for k in f1 if k.startswith(("w/", "b/"))}
    assert len(tensor_chunks) == 4200 + 4 > TABLE_MIN_CHUNKS  # b: 4 chunks of 2 elements
    assert tensor_chunks - shared == {"w/c.7.0", "w/c.4100.0"}
    assert gpuckpt.read_metadata(tmp_path / "c1").version == "2"
    got = gpuckpt.load_state_dict(tmp_path / "c1")
    assert got["w"].tobytes() == s1["w"].tobytes() and got["b"].tobytes() == s1["b"].tobytes()
    assert verify_checkpoint(tmp_path / "c1").ok


def test_a_hashed_save_with_a_chunk_table_records_hash_columns(tmp_path: Path) -> None:
    from gpuckpt.format.contenthash import LEAF, chunk_hash
    from gpuckpt.format.records import TABLE_KEY, ChunkTable
    from gpuckpt.options import SaveOptions
    from gpuckpt.planning.plan import plan_save
    from gpuckpt.saving.session import execute_save
    from gpuckpt.saving.sources import describe_state
    from gpuckpt.saving.writing import open_save_writer
    from gpuckpt.storage.stores import open_reader

    state = make_state()
    # the table whatever the size (the fixtures' switch), so that chunks of several leaves are in it
    options = SaveOptions(chunk_bytes=CHUNK, content_hash=True)
    local, sources = describe_state(state, allow_pickle=False)
    plan = plan_save([local], chunk_bytes=CHUNK)
    writer = open_save_writer(tmp_path / "c0", options, expected_files=plan.nfiles, direct_io=False)
    md = execute_save(plan, sources, writer, options, checkpoint_id="t", table=True)
    sd = md.storage_data
    assert md.version == "2" and sd["content_hash"] == {"algorithm": "xxh3_128-tree-1MiB", "leaf": LEAF}
    assert set(sd[TABLE_KEY]["columns"]) == {"crc32c", "xxh3t", "head"}
    table = ChunkTable.parse(sd[TABLE_KEY])
    reader = open_reader(tmp_path / "c0")
    for t in plan.tensors:
        values = table.read(reader, "xxh3t", t.row, t.nchunks)
        heads = table.read(reader, "head", t.row, t.nchunks)
        for i, s in enumerate(t.specs):
            data = (tmp_path / "c0" / t.name / f"c.{'.'.join(map(str, s.coords))}").read_bytes()[:-4]
            assert values[i].tobytes() == chunk_hash([data]), (t.name, s.coords)
            assert heads[i].tobytes() == chunk_hash([data[:LEAF]]), (t.name, s.coords)
    big = next(t for t in plan.tensors if t.fqn == "model.big")
    assert big.nchunks == 5 and not np.array_equal(
        table.read(reader, "xxh3t", big.row, 5), table.read(reader, "head", big.row, 5)
    )
    # and it serves as a base: the changed state shares every unchanged chunk with it
    gpuckpt.save(changed(state), tmp_path / "c1", chunk_bytes=CHUNK, base=tmp_path / "c0")
    f0, f1 = chunk_files(tmp_path / "c0"), chunk_files(tmp_path / "c1")
    new = {k for k in f1 if k in f0 and f1[k].st_ino != f0[k].st_ino}
    assert new == {"model.a/c.0", "model.b/c.0", "model.big/c.1.0"}
    assert_loads(tmp_path / "c1", changed(state))
