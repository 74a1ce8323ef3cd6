"""Incremental saves to S3: unchanged chunks arrive as server-side copies (counted in the
server's request log), changed ones as puts; both checkpoints complete on their own."""

from __future__ import annotations

import base64
import json
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import IncrementalBaseWarning
from gpuckpt.verify import verify_checkpoint

pytest.importorskip("obstore")
pytest.importorskip("moto.server")
pytest.importorskip("boto3")

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run by the pytest script, not python -m pytest
    sys.path.insert(0, str(REPO_ROOT))

# one moto server for this module, as tests/integration/test_objectstore.py starts it
from tests.integration.test_objectstore import BUCKET, endpoint, opts, s3  # noqa: E402, F401

pytestmark = pytest.mark.filterwarnings("error::gpuckpt.errors.IncrementalBaseWarning")


def _recorder(url: str, action: str) -> bytes:
    method = "GET" if action == "download-recording" else "POST"
    req = urllib.request.Request(f"{url}/moto-api/recorder/{action}", method=method)
    with urllib.request.urlopen(req, timeout=30) as r:  # loopback only
        return bytes(r.read())


def _requests(url: str) -> list[dict[str, Any]]:
    """Every request the server recorded: method, path, headers."""
    lines = _recorder(url, "download-recording").decode().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def _state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "frozen": rng.standard_normal((64, 1024)).astype(np.float32),  # 4 chunks of 64 KiB
        "adapter": np.full((16, 64), step, np.float32),
        "step": step,
    }


def test_unchanged_chunks_are_server_side_copies(
    endpoint: str,  # noqa: F811
    opts: dict[str, Any],  # noqa: F811
    s3: Any,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # the in-process server writes its recording to the working directory
    run = f"incr-{uuid.uuid4().hex[:8]}"
    p0, p1 = f"s3://{BUCKET}/{run}/step0", f"s3://{BUCKET}/{run}/step1"
    kw: dict[str, Any] = {"chunk_bytes": 64 << 10, "storage_options": opts}
    gpuckpt.save(_state(0), p0, content_hash=True, **kw)
    _recorder(endpoint, "reset-recording")
    _recorder(endpoint, "start-recording")
    try:
        gpuckpt.save(_state(1), p1, base=p0, **kw)
    finally:
        _recorder(endpoint, "stop-recording")
    log = _requests(endpoint)
    copies = [
        r for r in log if r["method"] == "PUT" and "x-amz-copy-source" in {k.lower() for k in r["headers"]}
    ]
    puts = [
        r["url"].split(f"/{run}/step1/", 1)[1].split("?")[0]
        for r in log
        if r["method"] == "PUT" and r not in copies and f"/{run}/step1/" in r["url"]
    ]
    copied = sorted(r["url"].split(f"/{run}/step1/", 1)[1].split("?")[0] for r in copies)
    assert copied == [f"frozen/c.{i}.0" for i in range(4)]
    for r in copies:
        source = {k.lower(): v for k, v in r["headers"].items()}["x-amz-copy-source"]
        assert f"{run}/step0/frozen/" in source
    assert "adapter/c.0.0" in puts and not any(p.startswith("frozen/c.") for p in puts)
    # no chunk bytes of the frozen tensor went through the client: no body of its size was put
    bodies = [
        len(base64.b64decode(r["body"])) if r.get("body_encoded") else len(r.get("body") or "") for r in log
    ]
    assert max(bodies) < 64 << 10
    for path, step in ((p0, 0), (p1, 1)):
        got = gpuckpt.load_state_dict(path, storage_options=opts)
        want = _state(step)
        assert got["frozen"].tobytes() == want["frozen"].tobytes()
        assert got["adapter"].tobytes() == want["adapter"].tobytes()
        assert verify_checkpoint(path, storage_options=opts).ok
    # copies are objects of their own: deleting the base leaves the incremental one whole
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{run}/step0/"):
        for o in page.get("Contents", []):
            s3.delete_object(Bucket=BUCKET, Key=o["Key"])
    assert verify_checkpoint(p1, storage_options=opts).ok


def test_base_in_another_bucket_is_written(
    endpoint: str,  # noqa: F811
    opts: dict[str, Any],  # noqa: F811
    s3: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    other = f"other-{uuid.uuid4().hex[:6]}"
    s3.create_bucket(Bucket=other)
    run = uuid.uuid4().hex[:8]
    kw: dict[str, Any] = {"chunk_bytes": 64 << 10, "storage_options": opts}
    gpuckpt.save(_state(0), f"s3://{other}/{run}/step0", content_hash=True, **kw)
    gpuckpt.save(_state(1), f"s3://{BUCKET}/{run}/step1", base=f"s3://{other}/{run}/step0", **kw)
    got = gpuckpt.load_state_dict(f"s3://{BUCKET}/{run}/step1", storage_options=opts)
    assert got["frozen"].tobytes() == _state(1)["frozen"].tobytes()
    # and a local base for an s3 target: no sharing possible, written
    gpuckpt.save(_state(0), tmp_path / "local0", chunk_bytes=64 << 10, content_hash=True)
    gpuckpt.save(_state(1), f"s3://{BUCKET}/{run}/step2", base=tmp_path / "local0", **kw)
    assert verify_checkpoint(f"s3://{BUCKET}/{run}/step2", storage_options=opts).ok


def test_base_object_put_again_after_publish_is_not_copied(
    endpoint: str,  # noqa: F811
    opts: dict[str, Any],  # noqa: F811
    s3: Any,  # noqa: F811
) -> None:
    run = f"incr-{uuid.uuid4().hex[:8]}"
    p0, p1 = f"s3://{BUCKET}/{run}/step0", f"s3://{BUCKET}/{run}/step1"
    kw: dict[str, Any] = {"chunk_bytes": 64 << 10, "storage_options": opts}
    gpuckpt.save(_state(0), p0, content_hash=True, **kw)
    time.sleep(1.1)  # S3 times are whole seconds: the put below is then later than the root's
    key = f"{run}/step0/frozen/c.2.0"
    body = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[100] ^= 0x40  # the body changed, its CRC32C trailer kept
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
    s3.delete_object(Bucket=BUCKET, Key=f"{run}/step0/frozen/c.1.0")  # and one gone
    assert not verify_checkpoint(p0, storage_options=opts).ok
    with pytest.warns(IncrementalBaseWarning, match=r"is damaged: 2 of the chunks") as caught:
        gpuckpt.save(_state(1), p1, base=p0, **kw)
    (w,) = caught
    assert "written after the base was published" in str(w.message) or "missing" in str(w.message)
    assert verify_checkpoint(p1, storage_options=opts).ok  # the chunk was put from the state
    got = gpuckpt.load_state_dict(p1, storage_options=opts)
    assert got["frozen"].tobytes() == _state(1)["frozen"].tobytes()
