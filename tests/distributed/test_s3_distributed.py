"""Distributed saves and resharded loads on ``s3://`` against the S3-protocol server on loopback.

Real jobs (``mpiexec -n N``, or N processes of a gloo group) save uneven
boxes straight to the prefix, each rank its own chunks; rank 0 publishes.
The server is moto's, in a thread of this process; the ranks reach it over
loopback HTTP.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import gpuckpt

pytest.importorskip("obstore")
pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

from gpuckpt.storage.s3.writer import CLAIM_KEY  # noqa: E402 - after the skips
from gpuckpt.testing.s3server import list_keys, loopback_s3, s3_options  # noqa: E402

BUCKET = "dist"
SCRIPT = "s3_save_load.py"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with pytest.MonkeyPatch.context() as mp, loopback_s3(BUCKET) as url:
        mp.setenv("GPUCKPT_TEST_S3", url)
        yield url


@pytest.fixture
def url(endpoint: str) -> str:
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/step-1"


def _keys(endpoint: str, url: str) -> set[str]:
    return list_keys(endpoint, BUCKET, url.removeprefix(f"s3://{BUCKET}/"))


def _check_full_view(module: Any, url: str, endpoint: str) -> None:
    sd = gpuckpt.load_state_dict(url, storage_options=s3_options(endpoint))
    for key, full in module.global_tensors().items():
        node: Any = sd
        for part in key.split("."):
            node = node[part]
        assert node.dtype == full.dtype and np.array_equal(node, full), key


def test_mpi_save_of_uneven_shards_then_load_on_2_and_on_1_rank(
    run_mpi: Any, load_script: Any, endpoint: str, url: str
) -> None:
    module = load_script("sharded_save_load")
    saved = run_mpi(3, SCRIPT, "save", url, timeout=90).check(3)
    assert len({r["id"] for r in saved.values()}) == 1  # one checkpoint, every rank returned it
    keys = _keys(endpoint, url)
    assert "zarr.json" in keys and CLAIM_KEY not in keys
    for n in (2, 1):
        loaded = run_mpi(n, SCRIPT, "load", url, timeout=90).check(n)
        assert all(r == module.expected_loaded() for r in loaded.values()), loaded
    _check_full_view(module, url, endpoint)


def test_mpi_a_failing_rank_publishes_nothing_on_s3(run_mpi: Any, endpoint: str, url: str) -> None:
    results = run_mpi(3, SCRIPT, "save_fail", url, timeout=90).check(3)
    for rank in range(3):
        assert results[rank] == {
            "raised": "DistributedError",
            "failing_ranks": [1],
            "reports": {"1": "UnsupportedValueError"},
            "published": False,
        }, f"rank {rank}"
    assert _keys(endpoint, url) == set()  # aborted: documents, every rank's chunks and the claim deleted


def test_mpi_rank_killed_mid_upload_publishes_nothing_and_the_next_save_succeeds(
    run_mpi: Any, load_script: Any, endpoint: str, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUCKPT_TEST_LEASE", "2")
    job = run_mpi(3, SCRIPT, "kill", url, timeout=90)
    assert job.returncode != 0 and 1 not in job.results, job.describe()
    left = _keys(endpoint, url)
    assert "zarr.json" not in left and CLAIM_KEY in left, left  # a dead save's claim, nothing published
    assert any("/c" in k for k in left), left  # chunks of the ranks were uploaded before the kill
    with pytest.raises(gpuckpt.CheckpointNotFoundError, match="claim"):
        gpuckpt.read_metadata(url, storage_options=s3_options(endpoint))
    # the next save takes the dead save's claim over (it expires 2 s after the kill) and removes
    # its objects; its own claim has the default lease, which a loaded machine cannot starve
    monkeypatch.delenv("GPUCKPT_TEST_LEASE")
    saved = run_mpi(3, SCRIPT, "save", url, timeout=90).check(3)
    assert len({r["id"] for r in saved.values()}) == 1
    _check_full_view(load_script("sharded_save_load"), url, endpoint)


def test_a_second_job_cannot_save_to_a_prefix_a_live_save_claims(
    run_mpi: Any, endpoint: str, url: str
) -> None:
    from gpuckpt.storage.s3.writer import ObjectStoreWriter

    live = ObjectStoreWriter(url, **s3_options(endpoint, lease_seconds=30.0))
    live.begin()
    try:
        results = run_mpi(3, SCRIPT, "second_job", url, timeout=90).check(3)
        for rank in range(3):
            assert results[rank] == {
                "raised": "DistributedError",
                "failing_ranks": [0],
                "reports": {"0": "CheckpointExistsError"},
                "published": False,
            }, f"rank {rank}"
        claim = json.loads(
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
            .get_object(Bucket=BUCKET, Key=url.removeprefix(f"s3://{BUCKET}/") + f"/{CLAIM_KEY}")["Body"]
            .read()
        )
        assert claim["token"] == live.token  # the live save's claim was not taken over
    finally:
        live.abort()


@pytest.mark.torch
def test_torch_gloo_save_and_resharded_load_on_s3(
    run_torch: Any, load_script: Any, endpoint: str, url: str
) -> None:
    module = load_script("sharded_save_load")
    run_torch(3, SCRIPT, "save", url, "torch", timeout=120).check(3)
    loaded = run_torch(2, SCRIPT, "load", url, "torch", timeout=120).check(2)
    assert all(r == module.expected_loaded() for r in loaded.values()), loaded
    _check_full_view(module, url, endpoint)


def test_joining_needs_the_token_of_the_save_that_holds_the_prefix(endpoint: str, url: str) -> None:
    from gpuckpt.storage.stores import attach_writer

    opts = s3_options(endpoint)
    with pytest.raises(gpuckpt.CheckpointExistsError, match="claim .* is missing"):
        attach_writer(url, "0123456789abcdef", storage_options=opts)
    from gpuckpt.storage.s3.writer import ObjectStoreWriter

    owner = ObjectStoreWriter(url, **opts)
    owner.begin()
    try:
        with pytest.raises(gpuckpt.CheckpointExistsError, match="belongs to another save"):
            attach_writer(url, "0123456789abcdef", storage_options=opts)
        joined = attach_writer(url, owner.token, storage_options=opts)
        joined.write_chunk("w", "c.0", [b"abc", b"de"])
        assert "w/c.0" in _keys(endpoint, url)
    finally:
        owner.abort()  # deletes the joined rank's chunk too
    assert _keys(endpoint, url) == set()
