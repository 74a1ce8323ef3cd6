"""A torch.distributed.checkpoint state dict (DTensors, plain values) through a tiered manager.

``python dtensor_tiers.py MODE BASE`` on each of 4 gloo processes (2 simulated nodes):
``train`` saves steps 1..3; ``restore`` restores into zeroed DTensors of the same
placements and reports whether every value is the step's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from _rank_io import finish, make_coordinator, process_rank, run_rank

import gpuckpt


def state(step: int, mesh: Any, zero: bool = False) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    w = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) + step
    b = torch.full((6,), float(step))
    if zero:
        w, b = torch.zeros_like(w), torch.zeros_like(b)
    return {
        "model": {
            "w": distribute_tensor(w, mesh, [Shard(0)]),
            "b": distribute_tensor(b, mesh, [Replicate()]),
        },
        "optim": {"lr": 0.1 * step, "betas": [0.9, 0.999]},
        "step": -1 if zero else step,
    }


def main(mode: str, base: str) -> None:
    rank = process_rank("torch")

    def work() -> dict[str, Any]:
        c = make_coordinator("torch")
        try:
            import torch
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (c.world_size,))
            node = f"n{c.rank // 2}"
            mgr = gpuckpt.CheckpointManager(
                Path(base) / "root", local_dir=Path(base) / node, node=node, coordinator=c
            )
            out: dict[str, Any] = {}
            if mode == "train":
                for step in (1, 2, 3):
                    mgr.save(step, state(step, mesh))
                mgr.wait()
            else:
                target = state(0, mesh, zero=True)
                out["step"] = mgr.restore(target)
                want = state(out["step"], mesh)
                out["w"] = bool(
                    torch.equal(target["model"]["w"].full_tensor(), want["model"]["w"].full_tensor())
                )
                out["b"] = bool(torch.equal(target["model"]["b"].to_local(), want["model"]["b"].to_local()))
                out["values"] = [target["optim"], target["step"]]
                assert mgr.last_restore is not None
                out["source"] = mgr.last_restore.source
            mgr.close()
            return out
        finally:
            finish("torch")

    run_rank(rank, work, "torch")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
