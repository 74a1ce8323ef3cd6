"""CheckpointManager on an object-store prefix (``s3://bucket/run1``), against the S3 server on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
from gpuckpt.testing.faultproxy import FaultProxy  # noqa: E402
from gpuckpt.testing.s3server import list_keys, loopback_s3, s3_options  # noqa: E402

BUCKET = "managed"

#: run in a new process: open the manager on the root, restore the latest step, compare
_RESTART = """
import json, sys
import numpy as np
import gpuckpt
from gpuckpt.testing.s3server import s3_options
sys.path.insert(0, sys.argv[3])
from test_manager_s3 import state
mgr = gpuckpt.CheckpointManager(sys.argv[1], max_to_keep=3, storage_options=s3_options(sys.argv[2]))
latest = mgr.latest_step()
got = mgr.restore_state_dict()
want = state(latest)
exact = all(np.array_equal(got[k], v) and got[k].dtype == v.dtype for k, v in want.items() if k != "step")
print(json.dumps({"latest": latest, "steps": mgr.all_steps(), "exact": exact, "step": int(got["step"])}))
"""


def state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((16, 9)).astype(np.float32),
        "m": rng.integers(-5, 5, 40, dtype=np.int16),
        "step": step,
    }


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with loopback_s3(BUCKET) as url:
        yield url


@pytest.fixture
def root(endpoint: str) -> str:
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"


def _keys(endpoint: str, root: str) -> set[str]:
    return list_keys(endpoint, BUCKET, root.removeprefix(f"s3://{BUCKET}/"))


def test_twenty_steps_with_retention_then_a_new_process_restores_the_latest(endpoint: str, root: str) -> None:
    opts = s3_options(endpoint)
    with gpuckpt.CheckpointManager(
        root, max_to_keep=3, keep_period=5, storage_options=opts, chunk_bytes=256
    ) as mgr:
        for step in range(20):
            assert mgr.save(step, state(step))
        mgr.wait()
        assert mgr.all_steps() == [0, 5, 10, 15, 17, 18, 19]
    # the deleted steps left nothing behind: not a chunk, not a claim
    kept = {k.split("/")[0] for k in _keys(endpoint, root)}
    assert kept == {f"step_{s:08d}" for s in (0, 5, 10, 15, 17, 18, 19)}, kept
    assert not any(k.endswith(CLAIM_KEY) for k in _keys(endpoint, root))
    here = os.path.dirname(__file__)
    out = subprocess.run(
        [sys.executable, "-c", _RESTART, root, endpoint, here], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "latest": 19,
        "steps": [0, 5, 10, 15, 17, 18, 19],
        "exact": True,
        "step": 19,
    }


def test_latest_step_lists_the_root_once_not_every_object(endpoint: str, root: str) -> None:
    opts = s3_options(endpoint)
    with gpuckpt.CheckpointManager(root, async_save=False, storage_options=opts, chunk_bytes=64) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, state(step))
    with FaultProxy(endpoint) as proxy:
        mgr = gpuckpt.CheckpointManager(root, storage_options=s3_options(proxy.endpoint))
        proxy.reset_counts()
        assert mgr.latest_step() == 30
        counts = proxy.reset_counts()
    # one delimited listing of the root; no probe: the manager probed each step once, when it
    # opened the root, and the listing shows nothing new
    assert counts == {"list": 1}, counts


def test_retention_deletes_in_batches(endpoint: str, root: str) -> None:
    with FaultProxy(endpoint) as proxy:
        opts = s3_options(proxy.endpoint)
        mgr = gpuckpt.CheckpointManager(root, async_save=False, storage_options=opts, chunk_bytes=64)
        for step in (1, 2, 3):
            mgr.save(step, state(step))
        before = len(_keys(endpoint, root))
        mgr.max_to_keep = 1
        proxy.reset_counts()
        mgr.save(4, state(4))  # retention: steps 1, 2 and 3 go, dozens of objects
        counts = proxy.reset_counts()
    assert mgr.all_steps() == [4] and before > 3 * 20, before
    # the save's own claim, then bulk deletes: the root documents, the objects, the claims;
    # never one request per object
    assert counts["delete"] <= 4, counts


def _put(endpoint: str, key: str, body: bytes) -> None:
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").put_object(
        Bucket=BUCKET, Key=key, Body=body
    )


def test_opening_the_root_cleans_dead_saves_and_leaves_live_ones(endpoint: str, root: str) -> None:
    from gpuckpt.storage.local import fsutil
    from gpuckpt.storage.s3.claim import machine_identity
    from gpuckpt.storage.s3.writer import ObjectStoreWriter

    opts = s3_options(endpoint)
    base = root.removeprefix(f"s3://{BUCKET}/")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    owner = f"{fsutil.tmp_owner().rsplit('-', 1)[0]}-{int(dead.stdout)}"
    claim = {"owner": owner, "machine": machine_identity(), "token": "t", "lease_seconds": 60.0}
    _put(endpoint, f"{base}/step_00000007/{CLAIM_KEY}", json.dumps(claim).encode())
    _put(endpoint, f"{base}/step_00000007/a/c.0", b"partial")
    _put(endpoint, f"{base}/notes/readme.txt", b"not a checkpoint's")  # no claim: never touched
    live = ObjectStoreWriter(f"{root}/step_00000008", **opts)
    live.begin()
    try:
        live.write_array_document("a", b"{}")
        mgr = gpuckpt.CheckpointManager(root, storage_options=opts)
        keys = _keys(endpoint, root)
        assert not any(k.startswith("step_00000007/") for k in keys), keys  # the dead save's, gone
        assert {f"step_00000008/{CLAIM_KEY}", "step_00000008/a/zarr.json", "notes/readme.txt"} <= keys
        assert mgr.all_steps() == []
    finally:
        live.abort()
