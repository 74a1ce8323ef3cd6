"""What a CheckpointManager on ``s3://`` costs per save and per retention pass, whatever the steps kept.

Against moto's S3-protocol server on loopback, through the counting proxy
(``gpuckpt.testing.faultproxy``, no faults). The committed steps a root
already holds are made cheaply: one checkpoint saved, then copied server-side
to every other step's prefix (:func:`gpuckpt.testing.s3server.copy_prefix`).
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import gpuckpt

pytest.importorskip("obstore")
pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

from gpuckpt.testing.faultproxy import FaultProxy  # noqa: E402 - after the skips
from gpuckpt.testing.s3server import copy_prefix, list_keys, loopback_s3, s3_options  # noqa: E402

BUCKET = "many-steps"


def state(step: int) -> dict[str, Any]:
    return {"w": np.full(16, step, np.float32), "step": step}


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with loopback_s3(BUCKET) as url:
        yield url


def _new_root(endpoint: str, steps: range) -> str:
    """A new root holding the committed steps ``steps``: the first saved, the others copies of it
    (its root document only: one object each)."""
    base = f"run-{uuid.uuid4().hex[:8]}"
    first = f"{base}/step_{steps[0]:08d}"
    gpuckpt.save({"step": steps[0]}, f"s3://{BUCKET}/{first}", storage_options=s3_options(endpoint))
    copy_prefix(endpoint, BUCKET, first, [f"{base}/step_{s:08d}" for s in steps[1:]])
    return f"s3://{BUCKET}/{base}"


def _cycles(proxy: FaultProxy, root: str, kept: int, **manager: Any) -> list[Counter[str]]:
    """The requests of each of three saves (each waited for, with the retention pass after it)
    by a manager opened on a root holding ``kept`` committed steps."""
    mgr = gpuckpt.CheckpointManager(root, storage_options=s3_options(proxy.endpoint), **manager)
    counts = []
    for step in range(kept, kept + 3):
        proxy.reset_counts()
        assert mgr.save(step, state(step))
        mgr.wait()
        counts.append(Counter(proxy.reset_counts()))
    mgr.close()
    return counts


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_save_costs_the_same_requests_with_20_or_200_steps_kept(
    endpoint: str, proxy: FaultProxy, async_save: bool
) -> None:
    # max_to_keep=None keeps every step: a long run holds thousands; each save still lists the
    # root once and probes nothing it already knows
    per_save = {
        kept: _cycles(proxy, _new_root(endpoint, range(kept)), kept, async_save=async_save)
        for kept in (20, 200)
    }
    assert per_save[20] == per_save[200], per_save
    for counts in per_save[200]:
        # the save's own requests (claim, documents, chunk, publication) and one listing of the root
        assert counts["get"] + counts["head"] <= 6 and counts["list"] <= 2, counts


def test_a_retention_pass_costs_the_same_requests_with_20_or_200_steps_kept(
    endpoint: str, proxy: FaultProxy
) -> None:
    # each save retires one step, the oldest but step 0 (keep_period keeps the multiples of 1,000)
    per_save, roots = {}, {}
    for kept in (20, 200):
        roots[kept] = _new_root(endpoint, range(kept))
        per_save[kept] = _cycles(proxy, roots[kept], kept, max_to_keep=kept - 1, keep_period=1000)
    assert per_save[20] == per_save[200], per_save
    for counts in per_save[200]:
        # the deletion of one step: its claim, then bulk deletes of its root document, its
        # objects and its claim; never a probe per step kept
        assert counts["delete"] <= 4 and counts["get"] + counts["head"] <= 6, counts
    for kept, root in roots.items():
        # step 0 (a multiple of keep_period) stays; steps 1, 2, 3 went, leaving no object behind
        left = {k.split("/")[0] for k in list_keys(endpoint, BUCKET, root.removeprefix(f"s3://{BUCKET}/"))}
        assert left == {f"step_{s:08d}" for s in [0, *range(4, kept + 3)]}


def test_opening_a_root_probes_each_step_once_in_parallel(endpoint: str, proxy: FaultProxy) -> None:
    root = _new_root(endpoint, range(200))
    proxy.reset_counts()
    mgr = gpuckpt.CheckpointManager(root, storage_options=s3_options(proxy.endpoint))
    at_once = proxy.max_active
    counts = proxy.reset_counts()
    # one listing; one ranged GET of each root document, several at once; no HEAD per step
    assert counts == {"list": 1, "get": 200} and at_once > 1, (counts, at_once)
    assert mgr.all_steps() == list(range(200))
    assert proxy.reset_counts() == {"list": 1}


def _put(endpoint: str, key: str, body: bytes) -> None:
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").put_object(
        Bucket=BUCKET, Key=key, Body=body
    )


def _delete_prefix(endpoint: str, prefix: str) -> None:
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for key in sorted(list_keys(endpoint, BUCKET, prefix), key=lambda k: k != "zarr.json"):
        client.delete_object(Bucket=BUCKET, Key=f"{prefix}/{key}")


def test_steps_added_or_deleted_behind_the_managers_back_are_seen(endpoint: str) -> None:
    opts = s3_options(endpoint)
    evens = list(range(0, 400, 2))
    root = _new_root(endpoint, range(0, 400, 2))
    base = root.removeprefix(f"s3://{BUCKET}/")
    mgr = gpuckpt.CheckpointManager(root, async_save=False, storage_options=opts)
    assert mgr.all_steps() == evens and mgr.latest_step() == 398
    with pytest.raises(gpuckpt.StepOrderError, match=r"step 151 is older than the committed step\(s\) \[152"):
        mgr.save(151, state(151))
    with pytest.raises(gpuckpt.CheckpointExistsError, match="step 398 is already saved"):
        mgr.save(398, state(398))
    # another process deletes step 398 and saves step 500; a foreign Zarr store and a dead
    # save's object appear under step names
    _delete_prefix(endpoint, f"{base}/step_00000398")
    copy_prefix(endpoint, BUCKET, f"{base}/step_00000000", [f"{base}/step_00000500"])
    foreign = json.dumps({"zarr_format": 3, "node_type": "group"}).encode()
    _put(endpoint, f"{base}/step_00000600/zarr.json", foreign)
    _put(endpoint, f"{base}/step_00000700/a/c.0", b"partial")
    assert mgr.latest_step() == 500
    assert mgr.all_steps() == [*evens[:-1], 500]
    with pytest.raises(gpuckpt.StepOrderError, match=r"committed step\(s\) \[500\]"):
        mgr.save(450, state(450))
    assert mgr.save(501, state(501))
    # a manager opened afresh (a restarted job) sees the same steps, and loads the newest
    again = gpuckpt.CheckpointManager(root, storage_options=opts)
    assert again.all_steps() == [*evens[:-1], 500, 501] and again.latest_step() == 501
    assert again.restore_state_dict()["step"] == 501
    # a newer step committed elsewhere stops an older save here, at its next listing
    gpuckpt.save(state(800), f"{root}/step_00000800", storage_options=opts)
    with pytest.raises(gpuckpt.StepOrderError, match=r"committed step\(s\) \[800\]"):
        mgr.save(750, state(750))
    assert mgr.latest_step() == 800
