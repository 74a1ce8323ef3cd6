"""A coordinator over an MPI communicator (mpi4py, imported when one is created)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuckpt.distributed.coordinator import Coordinator, MissingDependencyError

__all__ = ["MPICoordinator"]


def _comm_world() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise MissingDependencyError(
            f"MPICoordinator needs mpi4py, which cannot be imported ({exc}); install it with an MPI "
            "library, e.g. `pip install mpich mpi4py`, and start the job with that MPI's mpiexec"
        ) from exc
    return MPI.COMM_WORLD


class MPICoordinator(Coordinator):
    """The ranks of an MPI communicator.

    Uses mpi4py's pickle-based collectives (``comm.gather``, ``comm.bcast``,
    ...), which suit the small objects a coordinator exchanges. The objects
    travel between the trusted ranks of one job and are never stored.

    Parameters
    ----------
    comm
        An ``mpi4py.MPI.Comm`` (or an object with the same lowercase
        collectives). Default: ``MPI.COMM_WORLD``; mpi4py is imported, and
        MPI initialised, only then.

    Examples
    --------
    Run with ``mpiexec -n 4 python train.py``::

        from gpuckpt.distributed import MPICoordinator
        coordinator = MPICoordinator()
        gpuckpt.save(state, "ckpt", coordinator=coordinator)
    """

    def __init__(self, comm: Any = None) -> None:
        self._comm = _comm_world() if comm is None else comm
        self._rank = int(self._comm.Get_rank())
        self._size = int(self._comm.Get_size())

    @property
    def comm(self) -> Any:
        """The underlying communicator."""
        return self._comm

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        self._check_root(root)
        out = self._comm.gather(obj, root=root)
        return list(out) if self._rank == root else None

    def scatter(self, objs: list[Any] | None, root: int = 0) -> Any:
        self._check_root(root)
        payload = self._scatter_payload(objs) if self._rank == root else None
        return self._scatter_result(self._comm.scatter(payload, root=root))

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        self._check_root(root)
        return self._comm.bcast(obj if self._rank == root else None, root=root)

    def all_gather(self, obj: Any) -> list[Any]:
        return list(self._comm.allgather(obj))

    def all_reduce_xor(self, values: np.ndarray) -> np.ndarray:
        from mpi4py import MPI

        send = np.ascontiguousarray(values, np.uint64)
        out = np.empty_like(send)
        self.comm.Allreduce(send, out, op=MPI.BXOR)
        return out

    def barrier(self) -> None:
        self._comm.Barrier()

    def __repr__(self) -> str:
        return f"MPICoordinator(rank={self._rank}, world_size={self._size})"
