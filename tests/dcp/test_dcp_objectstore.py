"""gpuckpt.dcp with s3:// paths, against moto's S3 server on loopback (nothing leaves the machine)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")
pytest.importorskip("obstore")
pytest.importorskip("moto.server")
pytest.importorskip("boto3")

import torch.distributed.checkpoint as dcp  # noqa: E402 - after the skips

import gpuckpt  # noqa: E402
import gpuckpt.dcp  # noqa: E402
from gpuckpt.testing.s3server import loopback_s3, s3_options  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]

BUCKET = "ckpts"


@pytest.fixture(scope="module")
def options() -> Iterator[dict[str, Any]]:
    # loopback only: no proxy, no instance metadata, no ambient credentials
    with loopback_s3(BUCKET) as url:
        yield s3_options(url)


def test_writer_and_reader_on_s3(options: dict[str, Any]) -> None:
    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/step-1"
    sd = {"model": {"w": torch.randn(6, 5), "bf": torch.randn(3, 4).bfloat16()}, "step": 1}
    dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(url, storage_options=options))
    target = {"model": {"w": torch.zeros(6, 5), "bf": torch.zeros(3, 4, dtype=torch.bfloat16)}, "step": 0}
    dcp.load(target, storage_reader=gpuckpt.dcp.Reader(url, storage_options=options))
    assert torch.equal(target["model"]["w"], sd["model"]["w"]) and torch.equal(
        target["model"]["bf"], sd["model"]["bf"]
    )
    assert target["step"] == 1
    back = gpuckpt.load_state_dict(url, storage_options=options)
    assert np.array_equal(back["model"]["w"], sd["model"]["w"].numpy())
    assert gpuckpt.dcp.Writer.validate_checkpoint_id(url) and gpuckpt.dcp.Reader.validate_checkpoint_id(url)


def test_dtensors_from_3_ranks_to_s3_each_rank_uploading_its_own_chunks(
    options: dict[str, Any], run_ranks: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/dcp"
    monkeypatch.setenv("GPUCKPT_TEST_S3", options["endpoint_url"])
    monkeypatch.setenv("GPUCKPT_TEST_S3_URL", url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    results = run_ranks(3, "s3", tmp_path)
    assert all(r == {"rows_resharded": True} for r in results.values()), results
    back = gpuckpt.load_state_dict(url, storage_options=options)
    assert back["rows"].shape == (10, 6) and back["plain"].tolist() == list(range(7))


def test_existing_checkpoint_on_s3_is_refused_in_dcps_words(options: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/step-1"
    dcp.save({"w": torch.ones(3)}, storage_writer=gpuckpt.dcp.Writer(url, storage_options=options))
    for overwrite in (False, True):
        writer = gpuckpt.dcp.Writer(url, overwrite=overwrite, storage_options=options)
        with pytest.raises(CheckpointException, match=".*Checkpoint already exists.*") as info:
            dcp.save({"w": torch.zeros(3)}, storage_writer=writer)
        assert f"Checkpoint already exists at {url}" in str(info.value)
        assert "prefix" in str(info.value)  # the store's remedy: save to a new prefix
    assert gpuckpt.load_state_dict(url, storage_options=options)["w"].tolist() == [1.0, 1.0, 1.0]
