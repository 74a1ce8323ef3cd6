"""A distributed save of tensors alike on every rank: each rank sends one box per group of them.

The layers of a model have the same boxes on every rank; after one XOR
reduction of box fingerprints, ranks send rank 0 only one box per group of
such tensors (gpuckpt.planning.uniform), and the checkpoint is the one the
full descriptions would give.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import gpuckpt
from gpuckpt.distributed import Coordinator, run_ranks
from gpuckpt.planning.uniform import CompactDescription

LAYERS = 8


class Recording(Coordinator):
    """A coordinator that passes every collective to another one and keeps what rank 0 gathered."""

    def __init__(self, inner: Coordinator) -> None:
        self.inner = inner
        self.gathered: list[list[Any]] = []

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        out = self.inner.gather(obj, root)
        if out is not None:
            self.gathered.append(out)
        return out

    def scatter(self, objs: list[Any] | None, root: int = 0) -> Any:
        return self.inner.scatter(objs, root)

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        return self.inner.broadcast(obj, root)

    def all_gather(self, obj: Any) -> list[Any]:
        return self.inner.all_gather(obj)

    def barrier(self) -> None:
        self.inner.barrier()


def full_state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    state = {f"layer{i}": rng.standard_normal((16, 8)).astype(np.float32) for i in range(LAYERS)}
    state["norm"] = rng.standard_normal(8).astype(np.float32)
    state["head"] = rng.standard_normal((16, 8)).astype(np.float32)
    return state


def rank_state(rank: int) -> dict[str, Any]:
    full = full_state()
    out: dict[str, Any] = {
        name: gpuckpt.ShardedArray(full[name][rank * 4 : rank * 4 + 4].copy(), (rank * 4, 0), (16, 8))
        for name in full
        if name.startswith("layer")
    }
    out["norm"] = full["norm"].copy()  # held whole by every rank
    out["head"] = gpuckpt.ShardedArray(
        full["head"][:, rank * 2 : rank * 2 + 2].copy(), (0, rank * 2), (16, 8)
    )
    out["step"] = 3
    return out


def test_ranks_send_one_box_per_group_and_the_checkpoint_is_whole(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    recorders: dict[int, Recording] = {}

    def save(c: Coordinator) -> None:
        rec = recorders[c.rank] = Recording(c)
        gpuckpt.save(rank_state(c.rank), path, coordinator=rec, chunk_bytes=4 * 8 * 4)

    run_ranks(4, save)
    descriptions = [
        batch for batch in recorders[0].gathered if batch and isinstance(batch[0], CompactDescription)
    ]
    assert len(descriptions) == 1
    (received,) = descriptions
    groups = received[0].groups
    assert groups is not None
    assert groups.representatives == (0, LAYERS, LAYERS + 1)  # the layers, the norm, the head
    # three boxes of 2 axes from each rank, however many layers there are
    assert all(d.tensors is None and len(d.boxes) == 3 * 2 * 2 * 8 for d in received[1:])
    loaded = gpuckpt.load_state_dict(path)
    for name, want in full_state().items():
        np.testing.assert_array_equal(loaded[name], want)
    assert loaded["step"] == 3
