"""Checkpoints in S3 object storage, against a real S3-protocol server on loopback.

moto's server runs in a thread on 127.0.0.1 for this module; the AWS
environment is replaced with dummy credentials and no proxy, so nothing
leaves the machine.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import CheckpointExistsError, CheckpointNotFoundError, ChecksumError
from gpuckpt.format.checksum import crc32c
from gpuckpt.storage.local import fsutil
from gpuckpt.testing.s3server import loopback_s3, s3_options
from gpuckpt.verify import verify_checkpoint

pytest.importorskip("obstore")
pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

from gpuckpt.storage.s3.claim import machine_identity  # noqa: E402 - after the skips
from gpuckpt.storage.s3.writer import (  # noqa: E402 - after the skips
    CLAIM_KEY,
    ObjectStoreReader,
    ObjectStoreWriter,
    parse_s3_url,
    zarr_store,
)

BUCKET = "ckpts"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """A moto S3 server on a free loopback port, with the bucket created."""
    with pytest.MonkeyPatch.context() as mp, loopback_s3(BUCKET) as url:
        mp.setenv("AWS_ENDPOINT_URL", url)
        yield url


def _client(url: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


@pytest.fixture
def s3(endpoint: str) -> Any:
    return _client(endpoint)


@pytest.fixture
def opts(endpoint: str) -> dict[str, Any]:
    return s3_options(endpoint)


@pytest.fixture
def prefix() -> str:
    return f"run-{uuid.uuid4().hex[:8]}/ckpt"


def _objects(s3: Any, prefix: str) -> dict[str, str]:
    """Key -> ETag of every object under ``prefix/``."""
    out: dict[str, str] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        out.update({o["Key"]: o["ETag"] for o in page.get("Contents", [])})
    return out


def _state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "embed": rng.standard_normal((37, 16)).astype(np.float32),
            "proj": rng.standard_normal((24, 33)).astype(ml_dtypes.bfloat16),
            "norm": rng.standard_normal(33).astype(np.float16),
            # channels-last: N, C, H, W logically, N, H, W, C in memory
            "conv": rng.standard_normal((2, 5, 7, 3)).astype(np.float32).transpose(0, 3, 1, 2),
        },
        "optim": {"step": np.int64(1234 + seed), "mask": rng.random(19) > 0.5, "ids": np.arange(11)},
        "step": 7 + seed,
        "lr": 3e-4,
        "meta": {"name": "run", "milestones": [10, 20], "pair": (1, "two"), "none": None},
    }


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, dict):
            _assert_same(got[k], v)
        elif isinstance(v, np.ndarray | np.generic):
            assert np.asarray(got[k]).dtype == np.asarray(v).dtype, k
            assert np.array_equal(np.asarray(got[k]), np.asarray(v)), k
        else:
            assert got[k] == v, k


def _save(state: dict[str, Any], prefix: str, opts: dict[str, Any], **kw: Any) -> gpuckpt.Metadata:
    return gpuckpt.save(state, f"s3://{BUCKET}/{prefix}", storage_options=opts, chunk_bytes=1 << 10, **kw)


def test_round_trip(opts: dict[str, Any], prefix: str, s3: Any) -> None:
    state = _state()
    md = _save(state, prefix, opts)
    url = f"s3://{BUCKET}/{prefix}"
    assert len(md.state_dict_metadata["model.proj"].chunks) > 1
    got = gpuckpt.load_state_dict(url, storage_options=opts)
    _assert_same(got, state)
    assert got["model"]["conv"].strides == state["model"]["conv"].strides
    assert gpuckpt.read_metadata(url, storage_options=opts).storage_meta.checkpoint_id == (
        md.storage_meta.checkpoint_id
    )
    target = _state(seed=1)
    target["model"]["conv"] = np.zeros((2, 5, 7, 3), np.float32).transpose(0, 3, 1, 2)
    gpuckpt.load(target, url, storage_options=opts)
    _assert_same(target, state)
    # published: no claim left behind, and the commit object is there
    keys = _objects(s3, prefix)
    assert f"{prefix}/zarr.json" in keys and f"{prefix}/{CLAIM_KEY}" not in keys


def test_large_chunk_round_trip(opts: dict[str, Any], prefix: str) -> None:
    """A chunk above obstore's 5 MiB part size goes up as a multipart upload."""
    big = {"w": np.random.default_rng(0).standard_normal(6 << 18).astype(np.float32)}
    url = f"s3://{BUCKET}/{prefix}"
    md = gpuckpt.save(big, url, storage_options=opts)
    assert len(md.state_dict_metadata["w"].chunks) == 1
    assert np.array_equal(gpuckpt.load_state_dict(url, storage_options=opts)["w"], big["w"])


@pytest.fixture
def small_table(monkeypatch: pytest.MonkeyPatch) -> int:
    """Saves keep a chunk table from 16 chunks on (from 4,096 otherwise: as many objects put to
    the loopback server take half a minute); what is stored, and how, is what a large save does."""
    import gpuckpt.distributed.save as distributed_save
    import gpuckpt.saving.commit as commit

    monkeypatch.setattr(commit, "TABLE_MIN_CHUNKS", 16)
    monkeypatch.setattr(distributed_save, "TABLE_MIN_CHUNKS", 16)
    return 16


def test_a_checkpoint_with_a_chunk_table_round_trips_on_s3(
    opts: dict[str, Any], prefix: str, s3: Any, small_table: int
) -> None:
    state = {"w": np.arange(64 * 8, dtype=np.float32).reshape(64, 8), "step": 3}
    url = f"s3://{BUCKET}/{prefix}"
    gpuckpt.save(state, url, storage_options=opts, chunk_bytes=64)
    md = gpuckpt.read_metadata(url, storage_options=opts)
    assert md.storage_data["chunk_table"]["rows"] == 32 > small_table
    assert f"{prefix}/_gpuckpt.table.crc32c/c.0" in _objects(s3, prefix)
    _assert_same(gpuckpt.load_state_dict(url, storage_options=opts), state)
    assert verify_checkpoint(url, storage_options=opts).ok


def test_a_distributed_save_stores_its_table_in_blocks_on_s3(
    opts: dict[str, Any], prefix: str, small_table: int
) -> None:
    from gpuckpt.distributed import run_ranks

    full = {f"t{i}": np.arange(32 * 4, dtype=np.float32).reshape(32, 4) + i for i in range(3)}
    url = f"s3://{BUCKET}/{prefix}"

    def one(c: Any) -> None:
        mine = {
            n: gpuckpt.ShardedArray(v[c.rank * 8 : (c.rank + 1) * 8].copy(), (c.rank * 8, 0), (32, 4))
            for n, v in full.items()
        }
        gpuckpt.save(mine, url, coordinator=c, storage_options=opts, chunk_bytes=16)

    run_ranks(4, one)
    md = gpuckpt.read_metadata(url, storage_options=opts)
    assert md.version == "5" and "blocks" in md.storage_data["chunk_table"]
    _assert_same(gpuckpt.load_state_dict(url, storage_options=opts), full)
    assert verify_checkpoint(url, storage_options=opts).ok


def test_zarr_reads_arrays_straight_from_s3(opts: dict[str, Any], prefix: str, endpoint: str) -> None:
    import zarr
    from obstore.store import S3Store
    from zarr.storage import ObjectStore

    state = _state()
    md = _save(state, prefix, opts)
    names = {fqn: t["name"] for fqn, t in md.storage_data["tensors"].items()}
    # zarr's own store over obstore, built here without gpuckpt's help
    store = ObjectStore(
        S3Store(
            BUCKET,
            prefix=prefix,
            endpoint=endpoint,
            region="us-east-1",
            access_key_id="testing",
            secret_access_key="testing",
            client_options={"allow_http": True},
        ),
        read_only=True,
    )
    for fqn in ("model.embed", "model.proj", "model.conv"):
        want = state["model"][fqn.split(".")[1]]
        arr = zarr.open_array(store, path=names[fqn], mode="r")
        assert arr.shape == want.shape and np.array_equal(arr[...], want), fqn
    group = zarr.open_group(zarr_store(f"s3://{BUCKET}/{prefix}", **opts), mode="r")
    assert "gpuckpt" in group.attrs


def test_prefix_without_root_is_no_checkpoint(opts: dict[str, Any], prefix: str, s3: Any) -> None:
    url = f"s3://{BUCKET}/{prefix}"
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint"):
        gpuckpt.load_state_dict(url, storage_options=opts)
    _save(_state(), prefix, opts)
    s3.delete_object(Bucket=BUCKET, Key=f"{prefix}/zarr.json")  # everything but the commit object
    with pytest.raises(CheckpointNotFoundError, match="zarr.json"):
        gpuckpt.read_metadata(url, storage_options=opts)


def test_existing_checkpoint_is_kept(opts: dict[str, Any], prefix: str, s3: Any) -> None:
    state = _state()
    _save(state, prefix, opts)
    before = _objects(s3, prefix)
    with pytest.raises(CheckpointExistsError, match="Checkpoint already exists at"):
        _save(_state(seed=1), prefix, opts)
    with pytest.raises(CheckpointExistsError, match="cannot replace"):
        _save(_state(seed=1), prefix, opts, overwrite=True)
    assert _objects(s3, prefix) == before
    _assert_same(gpuckpt.load_state_dict(f"s3://{BUCKET}/{prefix}", storage_options=opts), state)


def test_failure_mid_save_publishes_nothing(
    opts: dict[str, Any], prefix: str, s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    _save(state, prefix, opts)
    before = _objects(s3, prefix)
    other = prefix + "-next"
    real = ObjectStoreWriter._write
    lock, count = threading.Lock(), [0]

    def failing(self: ObjectStoreWriter, rel: str, data: Any) -> None:
        with lock:
            if "/c" in rel:
                count[0] += 1
            if count[0] == 3:
                raise OSError(5, "injected: connection reset")
        real(self, rel, data)

    monkeypatch.setattr(ObjectStoreWriter, "_write", failing)
    with pytest.raises(OSError, match="injected"):
        _save(_state(seed=1), other, opts, threads=4)
    monkeypatch.undo()
    assert _objects(s3, other) == {}  # aborted: chunks, documents and claim deleted
    with pytest.raises(CheckpointNotFoundError):
        gpuckpt.read_metadata(f"s3://{BUCKET}/{other}", storage_options=opts)
    assert _objects(s3, prefix) == before
    _assert_same(gpuckpt.load_state_dict(f"s3://{BUCKET}/{prefix}", storage_options=opts), state)
    # the failed prefix is usable afterwards
    _save(_state(seed=2), other, opts)


def test_concurrent_writers_exactly_one_wins(opts: dict[str, Any], prefix: str) -> None:
    barrier = threading.Barrier(2)
    outcome: dict[int, BaseException | None] = {}

    def run(seed: int) -> None:
        barrier.wait()
        try:
            _save(_state(seed), prefix, opts)
            outcome[seed] = None
        except BaseException as exc:
            outcome[seed] = exc

    threads = [threading.Thread(target=run, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [s for s, e in outcome.items() if e is None]
    assert len(winners) == 1, outcome
    loser = next(e for e in outcome.values() if e is not None)
    assert isinstance(loser, CheckpointExistsError), loser
    _assert_same(gpuckpt.load_state_dict(f"s3://{BUCKET}/{prefix}", storage_options=opts), _state(winners[0]))


def test_commit_race_lost_keeps_the_winner(opts: dict[str, Any], prefix: str, s3: Any) -> None:
    """If another save publishes first, the conditional put of the root fails and abort deletes nothing."""
    url = f"s3://{BUCKET}/{prefix}"
    w = ObjectStoreWriter(url, **opts)
    w.begin()
    w.write_array_document("a", b'{"zarr_format":3}')
    w.write_chunk("a", "c.0", [b"abc", b"defg"])
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/zarr.json", Body=b"{}")  # someone else's commit
    with pytest.raises(CheckpointExistsError, match="another save published it while this one ran"):
        w.commit(b'{"id": "this save"}')  # a root document names its save: never equal to another's
    w.abort()
    assert f"{prefix}/a/c.0" in _objects(s3, prefix)
    r = ObjectStoreReader(url, **opts)
    buf = [bytearray(2), bytearray(5)]
    assert r.read_chunk_into("a", "c.0", buf) == 7 and bytes(buf[0] + buf[1]) == b"abcdefg"
    assert r.chunk_nbytes("a", "c.0") == 7 and r.chunk_nbytes("a", "c.9") is None


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _put_claim(s3: Any, prefix: str, owner: str, machine: str = "") -> None:
    body = json.dumps(
        {"owner": owner, "machine": machine, "token": "x", "started": "2020-01-01T00:00:00+00:00"}
    )
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{CLAIM_KEY}", Body=body.encode())


def test_leftovers_of_a_dead_save_are_cleaned(opts: dict[str, Any], prefix: str, s3: Any) -> None:
    machine = machine_identity()
    if not machine:
        pytest.skip("no /proc: a dead owner is recognised by its lease only")
    _put_claim(s3, prefix, f"{fsutil.tmp_owner().rsplit('-', 1)[0]}-{_dead_pid()}", machine)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/stale/zarr.json", Body=b"{}")
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/stale/c.0.1", Body=b"junk")
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/_gpuckpt.table.crc32c/c.0", Body=b"junk")  # its chunk table
    sibling = f"{prefix}2/stale/c.0"  # a different prefix that merely starts with the same text
    s3.put_object(Bucket=BUCKET, Key=sibling, Body=b"keep")
    state = _state()
    _save(state, prefix, opts)
    keys = _objects(s3, prefix)
    assert (
        not any("/stale/" in k or "_gpuckpt.table" in k for k in keys) and f"{prefix}/{CLAIM_KEY}" not in keys
    )
    assert s3.get_object(Bucket=BUCKET, Key=sibling)["Body"].read() == b"keep"
    _assert_same(gpuckpt.load_state_dict(f"s3://{BUCKET}/{prefix}", storage_options=opts), state)


def test_live_claim_blocks_until_its_lease_expires(opts: dict[str, Any], prefix: str, s3: Any) -> None:
    # the same host name and a dead pid, but another machine: only the lease can free it
    _put_claim(s3, prefix, f"{fsutil.tmp_owner().rsplit('-', 1)[0]}-{_dead_pid()}", "other-boot/pid:[1]")
    with pytest.raises(CheckpointExistsError, match="another save to it is running"):
        _save(_state(), prefix, opts)
    with pytest.raises(CheckpointNotFoundError, match="claim"):
        gpuckpt.read_metadata(f"s3://{BUCKET}/{prefix}", storage_options=opts)
    # past the lease by more than the one-second resolution of S3's times
    time.sleep(3.2)
    _save(_state(), prefix, {**opts, "lease_seconds": 1.0})
    assert f"{prefix}/{CLAIM_KEY}" not in _objects(s3, prefix)


def test_foreign_objects_are_never_deleted(opts: dict[str, Any], prefix: str, s3: Any) -> None:
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/notes.txt", Body=b"mine")
    with pytest.raises(CheckpointExistsError, match="refusing to delete"):
        _save(_state(), prefix, opts)
    assert set(_objects(s3, prefix)) == {f"{prefix}/notes.txt"}


def _foreign_zarr(url: str, opts: dict[str, Any], *, with_root: bool) -> None:
    """Another program's Zarr v3 data at ``url``: a group with an array, or only an array one level
    down whose keys (``x/zarr.json``, ``x/c.0``) are shaped exactly like a checkpoint's."""
    import zarr

    dots: Any = {"name": "default", "separator": "."}  # c.0, c.1: the chunk keys of a checkpoint
    if with_root:
        group = zarr.create_group(store=zarr_store(url, read_only=False, **opts))
        arr = group.create_array("x", shape=(8,), chunks=(4,), dtype="f4", chunk_key_encoding=dots)
    else:
        store = zarr_store(f"{url}/x", read_only=False, **opts)
        arr = zarr.create_array(store=store, shape=(8,), chunks=(4,), dtype="f4", chunk_key_encoding=dots)
    arr[:] = np.arange(8, dtype=np.float32)


@pytest.mark.parametrize("with_root", [True, False], ids=["group", "arrays-only"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_foreign_zarr_store_is_refused_and_never_deleted(
    opts: dict[str, Any], prefix: str, s3: Any, with_root: bool, overwrite: bool
) -> None:
    url = f"s3://{BUCKET}/{prefix}"
    _foreign_zarr(url, opts, with_root=with_root)
    before = _objects(s3, prefix)
    assert (f"{prefix}/zarr.json" in before) == with_root and f"{prefix}/x/c.1" in before, before
    why = "not a gpuckpt checkpoint" if with_root else "no claim of an unfinished gpuckpt save"
    with pytest.raises(CheckpointExistsError) as info:
        _save(_state(), prefix, opts, overwrite=overwrite)
    assert url in str(info.value) and why in str(info.value) and "nothing was deleted" in str(info.value)
    assert _objects(s3, prefix) == before  # every object kept, and no claim left behind


def test_corrupted_object_names_the_tensor(opts: dict[str, Any], prefix: str, s3: Any) -> None:
    md = _save(_state(), prefix, opts)
    info = md.storage_data["tensors"]["model.proj"]
    key = f"{prefix}/{info['name']}/{info['chunks'][1]['key']}"
    data = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[5] ^= 0x40
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    with pytest.raises(ChecksumError, match="model.proj"):
        gpuckpt.load_state_dict(f"s3://{BUCKET}/{prefix}", storage_options=opts)
    # tensors not read are unaffected
    got = gpuckpt.load_state_dict(f"s3://{BUCKET}/{prefix}", keys=["model.embed"], storage_options=opts)
    assert np.array_equal(got["model"]["embed"], _state()["model"]["embed"])


@pytest.mark.parametrize(
    "url",
    [
        "s3://ckpts",
        "s3://ckpts/",
        "s3://ckpts/a/../b",
        "s3://ckpts/a//b",
        "s3://ckpts//b",
        "s3:///x",
        "gs://b/x",
    ],
)
def test_bad_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="s3://"):
        parse_s3_url(url)


def test_keys_cannot_leave_the_prefix(opts: dict[str, Any], prefix: str) -> None:
    r = ObjectStoreReader(f"s3://{BUCKET}/{prefix}", **opts)
    for name, key in (("..", "c.0"), ("a", "../b"), ("a/b", "c.0"), ("a", "c.0/../../x")):
        with pytest.raises(ValueError, match="refusing"):
            r.read_chunk_into(name, key, [bytearray(1)])


def test_claim_is_refreshed_while_a_save_runs(opts: dict[str, Any], prefix: str, s3: Any) -> None:
    url = f"s3://{BUCKET}/{prefix}"
    short = {**opts, "lease_seconds": 2.0}
    a = ObjectStoreWriter(url, **short)
    a.begin()
    time.sleep(3.0)  # longer than the lease: only the refreshes keep the claim alive
    with pytest.raises(CheckpointExistsError, match="another save to it is running"):
        ObjectStoreWriter(url, **short).begin()
    a.write_array_document("a", b"{}")
    # a takeover (as if this save had stalled past its lease) makes the commit fail and abort keep out
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{CLAIM_KEY}", Body=b'{"owner": "otherhost-1"}')
    with pytest.raises(CheckpointExistsError, match="another save"):
        a.commit(b"{}")
    a.abort()
    assert set(_objects(s3, prefix)) == {f"{prefix}/a/zarr.json", f"{prefix}/{CLAIM_KEY}"}


def test_without_conditional_writes(opts: dict[str, Any], prefix: str) -> None:
    """For servers without If-None-Match: check-then-put, same results for one writer at a time."""
    plain = {**opts, "conditional_writes": False}
    state = _state()
    _save(state, prefix, plain)
    with pytest.raises(CheckpointExistsError):
        _save(state, prefix, plain)
    _assert_same(gpuckpt.load_state_dict(f"s3://{BUCKET}/{prefix}", storage_options=plain), state)


def _flip_byte(s3: Any, key: str, at: int) -> None:
    data = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[at] ^= 0x40
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))


def test_verify_reads_an_s3_checkpoint(opts: dict[str, Any], prefix: str, s3: Any) -> None:
    """verify_checkpoint takes what a load takes: an s3:// URL and its storage_options."""
    url = f"s3://{BUCKET}/{prefix}"
    md = _save(_state(), prefix, opts)
    report = verify_checkpoint(url, storage_options=opts)
    assert report.ok, report.format()
    tensors = md.storage_data["tensors"]
    assert report.tensors == len(tensors) and report.chunks == sum(len(t["chunks"]) for t in tensors.values())
    assert report.objects == len(md.storage_data["objects"]) and report.bytes_checked > 0
    proj = tensors["model.proj"]
    name, (c1, c2) = proj["name"], [c["key"] for c in proj["chunks"]]
    _flip_byte(s3, f"{prefix}/{name}/{c1}", 5)
    s3.delete_object(Bucket=BUCKET, Key=f"{prefix}/{name}/{c2}")
    doc = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{prefix}/{name}/zarr.json")["Body"].read())
    doc["shape"] = [1, 1]
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}/zarr.json", Body=json.dumps(doc).encode())
    report = verify_checkpoint(url, storage_options=opts)
    by = {d.where: d.problem for d in report.damage}
    assert set(by) == {f"{name}/{c1}", f"{name}/{c2}", f"{name}/zarr.json"}, by
    assert by[f"{name}/{c1}"].startswith(
        "checksum mismatch (its bytes do not match their checksum: computed 0x"
    )
    assert by[f"{name}/{c2}"] == "missing"
    assert by[f"{name}/zarr.json"].startswith("shape is [1, 1]")
    assert report.damaged_tensors() == ["model.proj"]


def test_verify_streams_large_s3_chunks(opts: dict[str, Any], prefix: str, s3: Any) -> None:
    """A chunk many times the verify buffer: read in pieces, the checksum trailer found across them."""
    url = f"s3://{BUCKET}/{prefix}"
    w = np.random.default_rng(3).standard_normal(300_001).astype(np.float32)  # one chunk of 1.2 MB
    gpuckpt.save({"w": w}, url, storage_options=opts)
    key = f"{prefix}/w/c.0"
    small = {"storage_options": opts, "group_bytes": 1, "threads": 1}  # 64 KiB pieces
    assert verify_checkpoint(url, **small).ok
    good = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    for at in (700_001, len(good) - 1):  # in the data, in the trailer
        _flip_byte(s3, key, at)
        (d,) = verify_checkpoint(url, **small).damage
        assert d.where == "w/c.0" and "its bytes do not match their checksum" in d.problem, d
        s3.put_object(Bucket=BUCKET, Key=key, Body=good)
    # a valid chunk (bytes and trailer agree) that is not the one the metadata lists
    other = np.frombuffer(good[:-4], np.float32).copy()
    other[0] += 1
    body = other.tobytes() + crc32c(other.tobytes()).to_bytes(4, "little")
    s3.put_object(Bucket=BUCKET, Key=key, Body=body)
    (d,) = verify_checkpoint(url, **small).damage
    assert "it is a valid chunk but not the one the metadata lists" in d.problem, d
    assert f"computed {crc32c(other.tobytes()):#010x}" in d.problem


def test_verify_command_on_s3(endpoint: str, opts: dict[str, Any], prefix: str, s3: Any) -> None:
    """``gpuckpt verify s3://...``: the endpoint and credentials from the AWS_* environment."""
    url = f"s3://{BUCKET}/{prefix}"
    md = _save(_state(), prefix, opts)
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}  # plain HTTP: allowed for an http:// endpoint

    def verify() -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "gpuckpt.cli", "verify", "--quiet", url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)

    r = verify()
    assert r.returncode == 0 and r.stdout.startswith(f"OK: {url}: "), (r.stdout, r.stderr)
    info = md.storage_data["tensors"]["model.embed"]
    where = f"{info['name']}/{info['chunks'][0]['key']}"
    _flip_byte(s3, f"{prefix}/{where}", 0)
    r = verify()
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"{where}: checksum mismatch" in r.stdout and "is damaged" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_bad_urls_and_storage_options_are_typed(opts: dict[str, Any]) -> None:
    for url in ("s3://ckpts/a//b", "s3://ckpts/a/../b"):
        with pytest.raises(gpuckpt.InvalidPathError, match="plain segments"):
            gpuckpt.save({"w": np.ones(2)}, url, storage_options=opts)
    with pytest.raises(gpuckpt.InvalidOptionError, match="not valid S3 settings"):
        gpuckpt.save({"w": np.ones(2)}, f"s3://{BUCKET}/x", storage_options={**opts, "endpointurl": "x"})


def test_a_missing_bucket_is_named_as_such(opts: dict[str, Any]) -> None:
    with pytest.raises(gpuckpt.CheckpointWriteError, match="the bucket does not exist") as info:
        gpuckpt.save({"w": np.ones(2)}, "s3://no-such-bucket/x", storage_options=opts)
    assert info.value.errno == errno.ENOENT
    with pytest.raises(gpuckpt.StoreError, match="the bucket does not exist") as found:
        gpuckpt.CheckpointManager("s3://no-such-bucket/run", storage_options=opts).all_steps()
    assert found.value.errno == errno.ENOENT
    # reads too: a missing bucket is not "no checkpoint at" the URL
    for read in (gpuckpt.load_state_dict, gpuckpt.read_metadata):
        with pytest.raises(gpuckpt.StoreError, match="no-such-bucket/x: the bucket does not exist") as found:
            read("s3://no-such-bucket/x", storage_options=opts)
        assert found.value.errno == errno.ENOENT
    with pytest.raises(gpuckpt.CheckpointNotFoundError, match="no checkpoint at"):
        gpuckpt.load_state_dict(f"s3://{BUCKET}/never-saved", storage_options=opts)


_WRONG_KEYS = """
import errno, os, sys
os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "1"  # the server checks signatures once the bucket is made
import numpy as np, gpuckpt
from gpuckpt.testing.s3server import loopback_s3, s3_options
with loopback_s3("ckpts") as endpoint:
    bad = s3_options(endpoint, aws_access_key_id="WRONGKEY", aws_secret_access_key="nope")
    for label, fn in (
        ("load", lambda: gpuckpt.load_state_dict("s3://ckpts/x", storage_options=bad)),
        ("listing", lambda: gpuckpt.CheckpointManager("s3://ckpts/run", storage_options=bad).all_steps()),
    ):
        try:
            fn()
            print(label, "no error")
        except gpuckpt.StoreError as exc:
            print(label, exc.errno == errno.EACCES, "check the credentials" in str(exc))
"""


def test_wrong_credentials_on_a_load_or_a_listing_are_a_store_error_naming_the_fix(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-c", _WRONG_KEYS],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["load True True", "listing True True"], out.stdout


_HINT = "http:// or https:// URL with a host"


@pytest.mark.parametrize(
    ("options", "named"),
    [
        # the client panics on these at the first request (a BaseException, a Rust backtrace)
        ({"endpoint_url": "not a url"}, f"endpoint_url must be an {_HINT}"),
        ({"endpoint_url": "http://exa mple:9000"}, f"endpoint_url must be an {_HINT}"),
        ({"endpoint_url": "ftp://127.0.0.1:9000"}, f"endpoint_url must be an {_HINT}"),
        ({"endpoint_url": "http://127.0.0.1:99999"}, f"endpoint_url must be an {_HINT}"),
        ({"max_requests": 0}, "max_requests must be an integer >= 1"),
        ({"part_bytes": 1024}, "part_bytes must be an integer >= 5242880"),
        ({"lease_seconds": 0}, "lease_seconds must be a number of seconds > 0"),
        ({"lease_seconds": float("nan")}, "lease_seconds must be a number of seconds > 0"),
        # an infinite lease killed the claim's heartbeat thread (OverflowError) and was taken
        ({"lease_seconds": float("inf")}, "lease_seconds must be a number of seconds > 0"),
        ({"lease_seconds": "60"}, "lease_seconds must be a number of seconds > 0"),
        ({"retry_config": [1]}, "retry_config must be a dict with some of the keys max_retries"),
        ({"retry_config": {"max_retry": 3}}, "unknown key.* max_retry; the known keys are max_retries"),
        ({"retry_config": {"backoff": {"bse": 3}}}, "unknown key.* bse; the known keys are init_backoff"),
        ({"retry_config": {"max_retries": -1}}, "max_retries must be an integer >= 0"),
        ({"retry_config": {"retry_timeout": 30}}, "retry_timeout must be a datetime.timedelta"),
        ({"retry_config": {"backoff": {"base": 1}}}, "base must be a finite number > 1"),
        ({"client_options": "x"}, "client_options must be a dict"),
        ({"client_options": {"timeot": "5s"}}, "not valid S3 settings"),
        # a string from a config file: "false" was taken as true
        ({"conditional_writes": "false"}, "conditional_writes must be True or False, got 'false'"),
    ],
    ids=lambda v: repr(v)[:40] if isinstance(v, dict) else "",
)
def test_storage_options_out_of_range_are_invalid_option_errors_naming_them(
    opts: dict[str, Any], prefix: str, s3: Any, options: dict[str, Any], named: str
) -> None:
    url, bad = f"s3://{BUCKET}/{prefix}", {**opts, **options}
    with pytest.raises(gpuckpt.InvalidOptionError, match=named):
        gpuckpt.save({"w": np.ones(2)}, url, storage_options=bad)
    with pytest.raises(gpuckpt.InvalidOptionError, match=named):
        gpuckpt.async_save({"w": np.ones(2)}, url, storage_options=bad).result(timeout=60)
    assert _objects(s3, prefix) == {}  # refused before anything was written
    _save({"w": np.ones(2)}, prefix, opts)
    with pytest.raises(gpuckpt.InvalidOptionError, match=named):
        gpuckpt.load_state_dict(url, storage_options=bad)


def test_an_endpoint_from_the_environment_that_is_no_url_is_named(
    opts: dict[str, Any], prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "not a url")
    given = {k: v for k, v in opts.items() if k != "endpoint_url"}
    with pytest.raises(gpuckpt.InvalidOptionError, match="the environment variable AWS_ENDPOINT_URL must be"):
        gpuckpt.save({"w": np.ones(2)}, f"s3://{BUCKET}/{prefix}", storage_options=given)
    _save({"w": np.ones(2)}, prefix, opts)  # an endpoint given wins over the environment's


@pytest.mark.parametrize("control", ["\n", "\t", "\x7f", "\x1b"], ids=["newline", "tab", "del", "escape"])
def test_a_url_with_a_control_character_is_an_invalid_path_error(
    opts: dict[str, Any], prefix: str, control: str
) -> None:
    for url in (f"s3://{BUCKET}/{prefix}{control}/x", f"s3://{BUCKET}{control}/{prefix}"):
        with pytest.raises(gpuckpt.InvalidPathError, match="control character"):
            gpuckpt.save({"w": np.ones(2)}, url, storage_options=opts)
        with pytest.raises(gpuckpt.InvalidPathError, match="control character"):
            gpuckpt.load_state_dict(url, storage_options=opts)


def test_a_checkpoint_is_never_saved_inside_another_on_s3(opts: dict[str, Any], prefix: str, s3: Any) -> None:
    """As on a local path: deleting the outer checkpoint (a manager's retention) deletes every
    object under its prefix, so a save inside it, at any depth, is refused before anything is
    written; beside it, or inside another program's Zarr store, is fine."""
    outer = f"s3://{BUCKET}/{prefix}"
    _save({"w": np.ones(3)}, prefix, opts)
    before = _objects(s3, prefix)
    for inner in (f"{outer}/best", f"{outer}/w/deeper/x"):
        with pytest.raises(gpuckpt.InvalidPathError, match=f"is inside the gpuckpt checkpoint {outer}:"):
            gpuckpt.save({"w": np.zeros(3)}, inner, storage_options=opts)
        with pytest.raises(gpuckpt.InvalidPathError, match="is inside the gpuckpt checkpoint"):
            gpuckpt.async_save({"w": np.zeros(3)}, inner, storage_options=opts).result(timeout=60)
    # a manager's root there is refused when it is opened, as a local one is
    with pytest.raises(
        gpuckpt.InvalidPathError, match=f"{outer}/steps is inside the gpuckpt checkpoint {outer}:"
    ):
        gpuckpt.CheckpointManager(f"{outer}/steps", async_save=False, storage_options=opts)
    assert _objects(s3, prefix) == before  # nothing written inside, no claim left
    _assert_same(gpuckpt.load_state_dict(outer, storage_options=opts), {"w": np.ones(3)})
    _save({"w": np.zeros(3)}, f"{prefix}-beside/best", opts)
    foreign = f"{prefix}-zarr"
    _foreign_zarr(f"s3://{BUCKET}/{foreign}", opts, with_root=True)
    _save({"w": np.zeros(3)}, f"{foreign}/inner", opts)


def test_a_manager_step_keeps_no_checkpoint_saved_inside_it(endpoint: str, opts: dict[str, Any]) -> None:
    """The audit's case: a save inside a manager's step was accepted, and the retention of the
    step deleted it without a word. It is refused; retention then deletes only the step."""
    root = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"
    with gpuckpt.CheckpointManager(root, storage_options=opts, async_save=False, max_to_keep=1) as mgr:
        mgr.save(1, {"w": np.arange(5.0)})
        with pytest.raises(gpuckpt.InvalidPathError, match="is inside the gpuckpt checkpoint"):
            gpuckpt.save({"best": np.ones(3)}, f"{mgr.step_path(1)}/best", storage_options=opts)
        mgr.save(2, {"w": np.arange(5.0)})
        assert mgr.all_steps() == [2]


def test_a_root_takes_lightning_s_checkpoint_names_and_refuses_what_is_no_name(
    opts: dict[str, Any], prefix: str
) -> None:
    """``epoch=3-step=400.ckpt`` is a checkpoint's name under an s3:// root (listed, deleted
    whole); what is hidden, a path, the document's name or holds a space is refused."""
    from gpuckpt.storage.stores import open_root

    root = open_root(f"s3://{BUCKET}/{prefix}", storage_options=opts)
    names = ["epoch=0-step=3.ckpt", "val_loss=0.12,best@1+x.ckpt", "last.ckpt"]
    for i, name in enumerate(names):
        gpuckpt.save({"w": np.full(3, i)}, root.child(name), storage_options=opts)
    assert root.children() == sorted(names)
    root.delete([names[0]])
    assert root.children() == sorted(names[1:])
    assert gpuckpt.load_state_dict(root.child(names[1]), storage_options=opts)["w"].tolist() == [1, 1, 1]
    for bad in ("", ".", "..", ".hidden", "a/b", "zarr.json", "a b", "-x", "a%", "x" * 256):
        with pytest.raises(ValueError, match="not a plain name"):
            root.child(bad)
