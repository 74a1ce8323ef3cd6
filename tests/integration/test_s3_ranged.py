"""Ranged reads of s3:// checkpoints: a load of part of a tensor fetches only the segments it needs.

Against moto's S3-protocol server on loopback, through the counting proxy
(``gpuckpt.testing.faultproxy`` with no faults), whose count of answer bytes
says how much of each object was read. The tensor is 12 MiB in chunks of
4 MiB (1,024 rows of 4 KiB): 4 segments of 1 MiB per chunk.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import ChecksumError
from gpuckpt.format.documents import ROOT_KEY, root_document
from gpuckpt.format.reader import metadata_of_root
from gpuckpt.format.segments import SEGMENT_BYTES, SEGMENTS_KEY
from gpuckpt.testing.faultproxy import FaultProxy
from gpuckpt.testing.s3server import loopback_s3, s3_options

pytest.importorskip("obstore")
pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

BUCKET = "ranged"
STATE = np.arange(3 << 20, dtype=np.float32).reshape(3072, 1024)  # 12 MiB
CHUNK = 4 << 20
ROW = 1024 * 4


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with loopback_s3(BUCKET) as url:
        yield url


def _s3(endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def _saved(proxy: FaultProxy) -> tuple[str, dict[str, Any]]:
    prefix = f"run-{uuid.uuid4().hex[:8]}"
    opts = s3_options(proxy.endpoint)
    gpuckpt.save({"w": STATE}, f"s3://{BUCKET}/{prefix}", storage_options=opts, chunk_bytes=CHUNK)
    proxy.reset_counts()
    return prefix, opts


def _load_rows(prefix: str, opts: dict[str, Any], start: int, stop: int, progress: Any = None) -> np.ndarray:
    box = gpuckpt.ShardedArray(np.empty((stop - start, 1024), np.float32), (start, 0), STATE.shape)
    gpuckpt.load({"w": box}, f"s3://{BUCKET}/{prefix}", storage_options=opts, progress=progress)
    out: np.ndarray = box.local
    return out


def _object_bytes_read(proxy: FaultProxy, endpoint: str, prefix: str) -> int:
    """Bytes of GET answers but the root document's."""
    root = _s3(endpoint).head_object(Bucket=BUCKET, Key=f"{prefix}/{ROOT_KEY}")["ContentLength"]
    return proxy.body_bytes_out["get"] - int(root)


def _rewrite_root(endpoint: str, prefix: str, change: Any) -> None:
    """Re-publish the root document with ``change(storage_data)`` applied (a valid, checksummed
    document: what a writer that records that would have written)."""
    s3 = _s3(endpoint)
    key = f"{prefix}/{ROOT_KEY}"
    md = metadata_of_root(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read(), key)
    change(md.storage_data)
    s3.put_object(Bucket=BUCKET, Key=key, Body=root_document(md))


def test_save_records_segments_and_a_partial_load_reads_only_the_segments_it_needs(
    endpoint: str, proxy: FaultProxy
) -> None:
    prefix, opts = _saved(proxy)
    s3 = _s3(endpoint)
    md = metadata_of_root(s3.get_object(Bucket=BUCKET, Key=f"{prefix}/{ROOT_KEY}")["Body"].read(), "root")
    entry = md.storage_data["tensors"]["w"][SEGMENTS_KEY]
    assert entry["bytes"] == SEGMENT_BYTES and md.version == "1"  # readable by every release
    # rows 1500..1600 lie in chunk 1 (rows 1024..2048), bytes 476 * 4 KiB .. 576 * 4 KiB of it:
    # segments 1 and 2 of its 4
    calls: list[tuple[int, int]] = []
    got = _load_rows(prefix, opts, 1500, 1600, progress=lambda done, total: calls.append((done, total)))
    assert np.array_equal(got, STATE[1500:1600])
    assert _object_bytes_read(proxy, endpoint, prefix) == 2 * SEGMENT_BYTES
    assert proxy.counts["get"] == 2  # the root document and one ranged read
    assert calls[-1] == (100 * ROW, 100 * ROW)  # progress reaches the bytes of the box


def test_rows_across_two_chunks_read_one_range_of_each(endpoint: str, proxy: FaultProxy) -> None:
    prefix, opts = _saved(proxy)
    got = _load_rows(prefix, opts, 1000, 1050)  # the last 24 rows of chunk 0, the first 26 of chunk 1
    assert np.array_equal(got, STATE[1000:1050])
    assert _object_bytes_read(proxy, endpoint, prefix) == 2 * SEGMENT_BYTES
    # the whole tensor still reads whole chunks (every byte checked against the chunk's CRC32C)
    proxy.reset_counts()
    full = {"w": np.empty_like(STATE)}
    gpuckpt.load(full, f"s3://{BUCKET}/{prefix}", storage_options=opts)
    assert np.array_equal(full["w"], STATE)
    assert _object_bytes_read(proxy, endpoint, prefix) == 3 * (CHUNK + 4)


def test_three_ranks_saved_two_load_reading_only_the_rows_each_needs(
    endpoint: str, proxy: FaultProxy
) -> None:
    from gpuckpt.distributed import run_ranks

    prefix, opts = f"run-{uuid.uuid4().hex[:8]}", s3_options(proxy.endpoint)
    url = f"s3://{BUCKET}/{prefix}"

    def save(c: Any) -> None:  # rows [1024 r, 1024 (r + 1)): one chunk of 4 MiB per rank
        rows = slice(1024 * c.rank, 1024 * (c.rank + 1))
        box = gpuckpt.ShardedArray(STATE[rows].copy(), (rows.start, 0), STATE.shape)
        gpuckpt.save({"w": box}, url, coordinator=c, storage_options=opts, chunk_bytes=CHUNK)

    def load(c: Any) -> np.ndarray:  # rows [1536 r, 1536 (r + 1)): half of the middle chunk each
        box = gpuckpt.ShardedArray(np.empty((1536, 1024), np.float32), (1536 * c.rank, 0), STATE.shape)
        gpuckpt.load({"w": box}, url, coordinator=c, storage_options=opts)
        out: np.ndarray = box.local
        return out

    run_ranks(3, save)
    proxy.reset_counts()
    halves = run_ranks(2, load)
    assert np.array_equal(np.concatenate(halves), STATE)
    roots = sum(1 for kind, path in proxy.requests if kind == "get" and path.endswith(f"{prefix}/{ROOT_KEY}"))
    root = _s3(endpoint).head_object(Bucket=BUCKET, Key=f"{prefix}/{ROOT_KEY}")["ContentLength"]
    # chunks 0 and 2 whole (with their trailers), half of chunk 1 (2 segments) for each rank
    assert proxy.body_bytes_out["get"] - roots * root == 2 * (CHUNK + 4) + 2 * 2 * SEGMENT_BYTES


def test_a_flipped_byte_inside_a_fetched_segment_is_detected(endpoint: str, proxy: FaultProxy) -> None:
    prefix, opts = _saved(proxy)
    s3 = _s3(endpoint)
    key = f"{prefix}/w/c.1.0"
    data = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[SEGMENT_BYTES + 12345] ^= 0x10  # in segment 1, outside the rows asked for
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    with pytest.raises(ChecksumError, match=r"c\.1\.0.*segment 1") as info:
        _load_rows(prefix, opts, 1500, 1600)
    assert info.value.key == "c.1.0" and info.value.fqn == "w"
    # rows whose segments are intact still load, bit-exact
    assert np.array_equal(_load_rows(prefix, opts, 1024 + 800, 1024 + 900), STATE[1824:1924])


def test_a_checkpoint_without_segment_records_reads_whole_chunks(endpoint: str, proxy: FaultProxy) -> None:
    prefix, opts = _saved(proxy)
    _rewrite_root(endpoint, prefix, lambda sd: sd["tensors"]["w"].pop(SEGMENTS_KEY))  # as older saves
    proxy.reset_counts()
    assert np.array_equal(_load_rows(prefix, opts, 1500, 1600), STATE[1500:1600])
    assert _object_bytes_read(proxy, endpoint, prefix) == CHUNK + 4


def test_segment_records_that_do_not_add_up_to_the_chunk_crc_are_not_used(
    endpoint: str, proxy: FaultProxy
) -> None:
    import base64

    prefix, opts = _saved(proxy)

    def swap(sd: dict[str, Any]) -> None:
        entry = sd["tensors"]["w"][SEGMENTS_KEY]
        crcs = np.frombuffer(base64.b64decode(entry["crc32c"]), "<u4").copy()
        crcs[[5, 6]] = crcs[[6, 5]]  # segments 1 and 2 of chunk 1: each is some segment's CRC
        entry["crc32c"] = base64.b64encode(crcs.tobytes()).decode()

    _rewrite_root(endpoint, prefix, swap)
    proxy.reset_counts()
    # the records of chunk 1 do not combine to its CRC32C: it is read whole and checked whole
    assert np.array_equal(_load_rows(prefix, opts, 1500, 1600), STATE[1500:1600])
    assert _object_bytes_read(proxy, endpoint, prefix) == CHUNK + 4


def test_zarr_reads_a_checkpoint_with_segment_records(endpoint: str, proxy: FaultProxy) -> None:
    zarr = pytest.importorskip("zarr")
    from gpuckpt.storage.s3.writer import zarr_store

    prefix, _ = _saved(proxy)
    store = zarr_store(f"s3://{BUCKET}/{prefix}", **s3_options(endpoint))
    assert np.array_equal(zarr.open_array(store, path="w", mode="r")[:], STATE)
