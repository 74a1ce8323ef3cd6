"""Coordinators: how the ranks of a distributed save or load agree on a plan."""

from gpuckpt.distributed.coordinator import (
    Coordinator,
    CoordinatorError,
    DistributedError,
    MissingDependencyError,
    SingleProcessCoordinator,
)
from gpuckpt.distributed.mpi import MPICoordinator
from gpuckpt.distributed.threads import ThreadCoordinator, ThreadGroup, run_ranks
from gpuckpt.distributed.torch_dist import TorchCoordinator

__all__ = [
    "Coordinator",
    "CoordinatorError",
    "DistributedError",
    "MPICoordinator",
    "MissingDependencyError",
    "SingleProcessCoordinator",
    "ThreadCoordinator",
    "ThreadGroup",
    "TorchCoordinator",
    "run_ranks",
]
