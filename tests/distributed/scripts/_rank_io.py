"""What every rank of a test job does around its work: find its rank, write its JSON result.

The harness (``tests/distributed/conftest.py``) sets ``GPUCKPT_TEST_OUT``;
rank R writes ``rank<R>.json`` there: the dict its work returned, or
``{"error": traceback}`` (and exits 1) if the work raised.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def jsonable(value: Any) -> Any:
    """``value`` with tuples as lists and NumPy scalars/arrays as Python values (JSON's types)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def write_result(rank: int, result: dict[str, Any]) -> None:
    out = Path(os.environ["GPUCKPT_TEST_OUT"])
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(jsonable(result), indent=1, sort_keys=True))
    os.replace(tmp, out / f"rank{rank}.json")


def run_rank(rank: int, work: Callable[[], dict[str, Any]], backend: str = "mpi") -> None:
    """Run ``work`` and write its result for ``rank``; on an exception write the traceback and abort the job.

    A plain ``sys.exit(1)`` is not enough under MPI: the exiting rank blocks
    in ``MPI_Finalize`` while the others wait for it, so the job would hang
    until the harness's timeout. ``MPI_Abort`` ends every rank at once.
    """
    try:
        result = work()
    except BaseException:
        write_result(rank, {"error": traceback.format_exc()})
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        if backend.startswith("mpi"):
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)
        os._exit(1)
    write_result(rank, result)


def mpi_rank() -> int:
    from mpi4py import MPI

    return int(MPI.COMM_WORLD.Get_rank())


def make_coordinator(backend: str) -> Any:
    """The coordinator of this process for ``backend`` ("mpi", "mpi-split", "torch" or "torch-split"; the splits group even and odd ranks)."""
    if backend == "mpi":
        from gpuckpt.distributed import MPICoordinator

        return MPICoordinator()
    if backend == "mpi-split":  # even and odd world ranks form two communicators
        from mpi4py import MPI

        from gpuckpt.distributed import MPICoordinator

        world = MPI.COMM_WORLD
        return MPICoordinator(world.Split(color=world.Get_rank() % 2, key=world.Get_rank()))
    if backend in ("torch", "torch-split"):
        import torch.distributed as dist

        from gpuckpt.distributed import TorchCoordinator

        rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo", init_method=os.environ["GPUCKPT_TORCH_INIT"], rank=rank, world_size=n
            )
        if backend == "torch":
            return TorchCoordinator()
        # even and odd ranks form two groups (every rank takes part in creating each group)
        groups = [dist.new_group(ranks=list(range(color, n, 2))) for color in (0, 1)]
        return TorchCoordinator(groups[rank % 2])
    raise ValueError(f"unknown backend {backend!r}; expected 'mpi', 'mpi-split', 'torch' or 'torch-split'")


def process_rank(backend: str) -> int:
    """This process's rank before any coordinator exists (so that a failed setup is reported too)."""
    return mpi_rank() if backend.startswith("mpi") else int(os.environ["RANK"])


def finish(backend: str) -> None:
    if backend.startswith("torch"):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
