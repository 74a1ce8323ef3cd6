"""``gpuckpt inspect`` and ``gpuckpt convert`` on ``s3://`` URLs; progress of uploads and downloads.

The command finds the endpoint and credentials in the ``AWS_*`` environment,
as ``gpuckpt verify s3://...`` does (tests/integration/test_objectstore.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt

pytest.importorskip("obstore")
pytest.importorskip("moto.server")

from gpuckpt.testing.s3server import loopback_s3, s3_options

BUCKET = "cli"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with loopback_s3(BUCKET) as url:
        yield url


def _cli(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
    cmd = [sys.executable, "-m", "gpuckpt.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(4)
    return {"w": rng.standard_normal((20, 7)).astype(np.float32), "ids": np.arange(9), "step": 12}


def test_inspect_a_checkpoint_and_a_manager_root_on_s3(endpoint: str) -> None:
    root = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"
    opts = s3_options(endpoint)
    with gpuckpt.CheckpointManager(root, async_save=False, storage_options=opts, chunk_bytes=128) as mgr:
        for step in (3, 6):
            mgr.save(step, _state())
    r = _cli(endpoint, "inspect", "--json", f"{root}/step_00000006")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["path"] == f"{root}/step_00000006" and d["totals"]["tensors"] == 2
    assert d["totals"]["missing_chunks"] == 0 and d["totals"]["file_bytes"] == d["totals"]["stored_bytes"]
    text = _cli(endpoint, "inspect", f"{root}/step_00000006").stdout
    assert "chunk objects:" in text and "none on an object store" in text  # not disk blocks, links
    assert "allocated on disk" not in text and "hard links" not in text
    r = _cli(endpoint, "inspect", "--json", root)
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)
    assert listed["latest_step"] == 6 and [s["step"] for s in listed["steps"]] == [3, 6]
    assert listed["steps"][1]["path"] == f"{root}/step_00000006"


def test_convert_to_and_from_s3(endpoint: str, tmp_path: Path) -> None:
    src = tmp_path / "local"
    gpuckpt.save(_state(), src)
    url = f"s3://{BUCKET}/conv-{uuid.uuid4().hex[:8]}/ck"
    r = _cli(endpoint, "convert", "--quiet", str(src), url)
    assert r.returncode == 0, r.stderr
    got = gpuckpt.load_state_dict(url, storage_options=s3_options(endpoint))
    assert np.array_equal(got["w"], _state()["w"]) and got["step"] == 12
    out = tmp_path / "model.safetensors"
    r = _cli(endpoint, "convert", "--quiet", url, str(out))
    assert r.returncode == 0, r.stderr
    back = tmp_path / "back"
    r = _cli(endpoint, "convert", "--quiet", str(out), str(back))
    assert r.returncode == 0, r.stderr
    again = gpuckpt.load_state_dict(back)
    assert np.array_equal(again["w"], _state()["w"]) and np.array_equal(again["ids"], np.arange(9))
    # a published checkpoint is never replaced on an object store
    r = _cli(endpoint, "convert", "--quiet", str(src), url)
    assert r.returncode == 1 and "Checkpoint already exists at" in r.stderr, r.stderr


def test_progress_of_uploads_and_downloads_reaches_the_total(endpoint: str) -> None:
    url = f"s3://{BUCKET}/prog-{uuid.uuid4().hex[:8]}/ck"
    opts = s3_options(endpoint)
    state = {"a": np.ones((64, 64), np.float32), "b": np.zeros(1000, np.int8)}
    up: list[tuple[int, int]] = []
    down: list[tuple[int, int]] = []
    gpuckpt.save(state, url, storage_options=opts, chunk_bytes=4096, progress=lambda d, t: up.append((d, t)))
    gpuckpt.load_state_dict(url, storage_options=opts, progress=lambda d, t: down.append((d, t)))
    total = 64 * 64 * 4 + 1000
    for seen in (up, down):
        assert len(seen) > 1 and seen[-1] == (total, total), seen[-3:]
        assert [d for d, _ in seen] == sorted(d for d, _ in seen)
