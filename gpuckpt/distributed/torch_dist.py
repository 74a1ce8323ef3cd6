"""A coordinator over a ``torch.distributed`` process group (torch imported when one is created)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuckpt.distributed.coordinator import Coordinator, CoordinatorError, MissingDependencyError

__all__ = ["TorchCoordinator"]


def _torch_distributed() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise MissingDependencyError(
            f"TorchCoordinator needs torch, which cannot be imported ({exc}); install it with "
            "`pip install gpuckpt[torch]`"
        ) from exc
    if not dist.is_available():
        raise MissingDependencyError(
            "TorchCoordinator needs torch.distributed, which this torch build lacks "
            "(torch.distributed.is_available() is False); install a torch build with distributed support"
        )
    return dist


class TorchCoordinator(Coordinator):
    """The ranks of a ``torch.distributed`` process group.

    Uses the object collectives (``gather_object``, ``scatter_object_list``,
    ``broadcast_object_list``, ``all_gather_object``) and ``barrier``. Ranks
    and roots are ranks *within* ``group``. With the NCCL backend, the object
    collectives stage through the current CUDA device: call
    ``torch.cuda.set_device`` first (as for any NCCL object collective).

    Parameters
    ----------
    group
        A process group; default: the default (world) group. The process
        group must be initialised (``torch.distributed.init_process_group``).

    Examples
    --------
    Run with ``torchrun --nproc-per-node 4 train.py``::

        import torch.distributed as dist
        from gpuckpt.distributed import TorchCoordinator
        dist.init_process_group("gloo")
        gpuckpt.save(state, "ckpt", coordinator=TorchCoordinator())
    """

    def __init__(self, group: Any = None) -> None:
        dist = _torch_distributed()
        if not dist.is_initialized():
            raise CoordinatorError(
                "TorchCoordinator: the default process group is not initialised; call "
                "torch.distributed.init_process_group(...) on every rank first"
            )
        self._dist = dist
        self._group = group
        self._rank = int(dist.get_rank(group))
        self._size = int(dist.get_world_size(group))
        if self._rank < 0:
            raise CoordinatorError(
                f"TorchCoordinator: this process (global rank {dist.get_rank()}) is not a member of {group!r}"
            )

    @property
    def group(self) -> Any:
        """The process group (``None``: the default group)."""
        return self._group

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    def _global(self, root: int) -> int:
        """The global rank of group rank ``root`` (torch's ``dst``/``src`` are global ranks)."""
        self._check_root(root)
        if self._group is None:
            return root
        return int(self._dist.get_global_rank(self._group, root))

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        dst = self._global(root)
        out: list[Any] | None = [None] * self._size if self._rank == root else None
        self._dist.gather_object(obj, out, dst=dst, group=self._group)
        return out

    def scatter(self, objs: list[Any] | None, root: int = 0) -> Any:
        src = self._global(root)
        payload = self._scatter_payload(objs) if self._rank == root else None
        out: list[Any] = [None]
        self._dist.scatter_object_list(out, payload, src=src, group=self._group)
        return self._scatter_result(out[0])

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        src = self._global(root)
        box = [obj if self._rank == root else None]
        self._dist.broadcast_object_list(box, src=src, group=self._group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._size
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def all_reduce_xor(self, values: np.ndarray) -> np.ndarray:
        # gloo reduces integers bitwise on the CPU; NCCL has no bitwise reduction: the default
        if self._dist.get_backend(self._group) != "gloo":
            return super().all_reduce_xor(values)
        import torch

        send = np.ascontiguousarray(values, np.uint64)
        t = torch.from_numpy(send.view(np.int64).copy())
        self._dist.all_reduce(t, op=self._dist.ReduceOp.BXOR, group=self._group)
        return np.asarray(t.numpy()).view(np.uint64).reshape(send.shape)

    def barrier(self) -> None:
        self._dist.barrier(group=self._group)

    def __repr__(self) -> str:
        return f"TorchCoordinator(rank={self._rank}, world_size={self._size})"
