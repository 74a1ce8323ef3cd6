"""How saves and loads on s3:// use their requests: small chunks in parallel, documents alongside chunks.

Against moto's S3-protocol server on loopback, through the counting proxy
(``gpuckpt.testing.faultproxy``, no faults), which logs every request and the
most it held at once.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.distributed import run_ranks
from gpuckpt.testing.faultproxy import FaultProxy
from gpuckpt.testing.s3server import loopback_env, loopback_s3, s3_options

pytest.importorskip("obstore")
pytest.importorskip("moto.server")

BUCKET = "requests"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with loopback_s3(BUCKET) as url:
        yield url


def _url() -> str:
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"


def test_small_chunks_are_put_and_got_in_parallel_not_one_after_the_other(proxy: FaultProxy) -> None:
    # 64 small tensors fit one batch of a file system's I/O job; on an object store each chunk is
    # a request of its own, and one job sending them in turn would leave the other threads idle
    state = {f"t{i}": np.full(100, i, np.int32) for i in range(64)}
    url, opts = _url(), s3_options(proxy.endpoint)
    gpuckpt.save(state, url, storage_options=opts, threads=8)
    assert proxy.counts["put"] >= 2 * 64 and proxy.max_active > 1
    proxy.reset_counts()
    out = {k: np.empty_like(v) for k, v in state.items()}
    gpuckpt.load(out, url, storage_options=opts, threads=8)
    assert all(np.array_equal(out[k], v) for k, v in state.items())
    assert proxy.counts["get"] >= 64 and proxy.max_active > 1


def test_distributed_save_starts_chunk_puts_before_rank_0_has_put_every_document(proxy: FaultProxy) -> None:
    # rank 0 broadcasts the plan once it holds the claim; every rank puts a share of the array
    # documents on its I/O threads next to its chunks
    full = {f"t{i}": np.arange(3 * 4096, dtype=np.float32).reshape(3, 4096) + i for i in range(48)}
    url, again, opts = _url(), _url(), s3_options(proxy.endpoint)

    def save(c: Any) -> None:
        mine = {
            k: gpuckpt.ShardedArray(v[c.rank : c.rank + 1].copy(), (c.rank, 0), v.shape)
            for k, v in full.items()
        }
        gpuckpt.save(mine, url, coordinator=c, storage_options=opts, threads=4)
        # the same layout again: the cached plan, and each rank's share of the documents with it
        gpuckpt.save(mine, again, coordinator=c, storage_options=opts, threads=4)

    run_ranks(3, save)
    for where in (url, again):
        prefix = where.removeprefix("s3:/")
        puts = [path for kind, path in proxy.requests if kind == "put" and path.startswith(prefix + "/")]
        documents = [i for i, p in enumerate(puts) if p.endswith("/zarr.json") and p != prefix + "/zarr.json"]
        chunks = [i for i, p in enumerate(puts) if "/c." in p]
        assert len(documents) == 48 and len(chunks) == 3 * 48
        assert min(chunks) < max(documents)
        assert puts[-1] == prefix + "/zarr.json"  # the root document, last of all
        out = gpuckpt.load_state_dict(where, storage_options=opts)
        assert all(np.array_equal(out[k], v) for k, v in full.items())


def test_a_save_and_a_load_on_s3_do_not_import_zarr(endpoint: str) -> None:
    # importing zarr costs a quarter of a second in every process (every rank's first save)
    code = (
        "import sys, numpy as np, gpuckpt\n"
        "from gpuckpt.testing.s3server import s3_options\n"
        f"o = s3_options({endpoint!r})\n"
        "gpuckpt.save({'w': np.arange(10)}, sys.argv[1], storage_options=o)\n"
        "out = {'w': np.empty(10, np.int64)}\n"
        "gpuckpt.load(out, sys.argv[1], storage_options=o)\n"
        "assert (out['w'] == np.arange(10)).all()\n"
        "print('zarr' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, _url()], env=loopback_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
