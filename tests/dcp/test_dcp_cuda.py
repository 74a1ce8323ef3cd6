"""gpuckpt.dcp with CUDA tensors (skipped without CuPy and a CUDA device, and without torch's CUDA)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

import torch.distributed.checkpoint as dcp  # noqa: E402 - after the skips

import gpuckpt  # noqa: E402
import gpuckpt.dcp  # noqa: E402

# a GPU test (not in the CPU torch suite, where no test may skip)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA and a device"),
]


def cuda_state() -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        "w": torch.randn(1000, 257, device="cuda", generator=g),
        "bf": torch.randn(64, 33, device="cuda", generator=g).bfloat16(),
        "conv": torch.randn(4, 8, 9, 7, device="cuda", generator=g).to(memory_format=torch.channels_last),
        "view": torch.randn(40, 30, device="cuda", generator=g)[5:25, ::3],
        "step": 3,
    }


def test_cuda_tensors_through_writer_and_reader(tmp_path: Path) -> None:
    sd = cuda_state()
    dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c", chunk_bytes=64 << 10))
    back = gpuckpt.load_state_dict(tmp_path / "c")
    for k in ("w", "conv", "view"):
        assert np.array_equal(back[k], sd[k].cpu().numpy()), k
    assert back["conv"].strides == tuple(s * 4 for s in sd["conv"].stride())
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}
    dcp.load(target, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c"))
    for k in ("w", "bf", "conv", "view"):
        assert target[k].is_cuda and torch.equal(target[k], sd[k]), k
    assert target["conv"].is_contiguous(memory_format=torch.channels_last) and target["step"] == 3


@pytest.mark.parametrize("staging", ["host", "device"])
def test_stager_snapshots_cuda_tensors(tmp_path: Path, staging: str) -> None:
    stager = gpuckpt.dcp.Stager(staging=staging)
    live = cuda_state()
    expected = {k: v.clone() for k, v in live.items() if isinstance(v, torch.Tensor)}
    fut = dcp.async_save(live, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c"), async_stager=stager)
    for k in expected:
        live[k].add_(1)
    fut.result()
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(target, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c"))
    assert all(torch.equal(target[k], expected[k]) for k in expected)
    stager.close()
