"""PyTorch DTensor shards as ShardedArrays (skipped where torch is not installed).

The tests import torch themselves, so that a run with ``-m "not torch"`` deselects
them without importing this module's dependencies.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gpuckpt

pytestmark = pytest.mark.torch


def test_from_dtensor_single_rank(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from gpuckpt.device.sharded import from_dtensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
        shards = from_dtensor(distribute_tensor(full, mesh, [Shard(0)]))
        assert [s.offsets for s in shards] == [(0, 0)] and shards[0].global_shape == (6, 4)
        gpuckpt.save({"w": shards}, tmp_path / "c")
        assert np.array_equal(gpuckpt.load_state_dict(tmp_path / "c")["w"], full.numpy())
    finally:
        dist.destroy_process_group()
