"""Every collective of a Coordinator, as run by each rank; ``expected`` says what each rank must see.

Run under a launcher (``mpiexec -n N python coordinator_checks.py mpi``, or N
processes with ``torch``), or in-process through ``run_checks`` with
``ThreadCoordinator`` ranks. The results are JSON-ready, so the three runs are
checked against the same ``expected(rank, n)``.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _rank_io import finish, jsonable, make_coordinator, process_rank, run_rank

from gpuckpt.distributed import Coordinator, CoordinatorError, DistributedError
from gpuckpt.errors import GpuckptError

#: how long the last rank arrives after the others at the idle barrier
IDLE_WAIT_S = 0.4
#: a pickle larger than the one round of TorchCoordinator.all_gather's fixed slots takes
_BIG = 100_000


def _error_report(exc: DistributedError, own: BaseException | None) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "is_runtime_error": isinstance(exc, RuntimeError),
        "is_gpuckpt_error": isinstance(exc, GpuckptError),
        "failures": {str(r): m for r, m in exc.failures.items()},
        "message_names_each": all(f"rank {r}" in str(exc) and m in str(exc) for r, m in exc.failures.items()),
        "cause_is_own": exc.__cause__ is own if own is not None else exc.__cause__ is None,
    }


def _reduce(c: Coordinator, own: BaseException | None) -> dict[str, Any] | str:
    try:
        c.all_reduce_errors(own)
    except DistributedError as exc:
        return _error_report(exc, own)
    return "no error"


def run_checks(c: Coordinator, workdir: Path) -> dict[str, Any]:
    """Run each collective on rank ``c.rank``; return what it saw (JSON-ready)."""
    r, n = c.rank, c.world_size
    last = n - 1
    seen: dict[str, Any] = {"rank": r, "world_size": n}
    seen["gather_root0"] = c.gather({"rank": r, "square": r * r}, root=0)
    seen["gather_root_last"] = c.gather(("t", r), root=last)
    seen["scatter_from_last"] = c.scatter(
        [{"to": i, "pad": "x" * i} for i in range(n)] if r == last else None, root=last
    )
    sent = {"from": r, "array": np.arange(4) * (r + 1)}
    got = c.broadcast(sent, root=1 % n)
    seen["broadcast_from_1"] = {
        "from": got["from"],
        "array": got["array"],
        "array_type": type(got["array"]).__name__,
        "copied": r == 1 % n or got is not sent,
    }
    seen["all_gather"] = c.all_gather(r * 10)
    xor = c.all_reduce_xor(_xor_input(r))
    seen["all_reduce_xor"] = {"values": xor.tolist(), "dtype": str(xor.dtype), "shape": list(xor.shape)}
    seen["rounds"] = [c.all_gather((i, r))[(i + 1) % n] for i in range(20)]
    # objects of every size, one larger than a gather's first round takes (TorchCoordinator)
    mixed = c.all_gather({"r": r, "pad": bytes([r + 1]) * (_BIG if r == 1 % n else 10 * r)})
    seen["all_gather_mixed_sizes"] = [[g["r"], len(g["pad"]), g["pad"][-1:].hex()] for g in mixed]
    large = c.broadcast({"from": r, "pad": b"\x07" * _BIG} if r == last else None, root=last)
    seen["broadcast_large"] = [large["from"], len(large["pad"]), large["pad"] == b"\x07" * _BIG]

    # every rank leaves its mark before the barrier; after it, each must see all marks
    marks = workdir / "barrier-marks"
    marks.mkdir(exist_ok=True)
    time.sleep(0.02 * (n - r))
    (marks / str(r)).touch()
    c.barrier()
    seen["marks_after_barrier"] = sorted(int(p.name) for p in marks.iterdir())

    # the same of idle_barrier; the ranks that wait for the last one spend little CPU doing so
    idle = workdir / "idle-barrier-marks"
    idle.mkdir(exist_ok=True)
    if r == last:
        time.sleep(IDLE_WAIT_S)
    (idle / str(r)).touch()
    wall, cpu = time.perf_counter(), time.thread_time()
    c.idle_barrier()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    seen["marks_after_idle_barrier"] = sorted(int(p.name) for p in idle.iterdir())
    # a spinning wait burns about its whole wall time (two thirds of it with 3 spinners on 2 cores)
    # (a rank the scheduler let in late waited less: it must still have burnt next to nothing)
    seen["idle_wait_is_idle"] = r == last or cpu < 0.2 * max(wall, 0.5 * IDLE_WAIT_S)

    # so do the collectives of objects, where the coordinator's waits are idle ones (an
    # MPICoordinator whose ranks share cores; MPI's own blocking waits spin)
    idle_waits = getattr(c, "_waits_idle", True)
    late_root = functools.partial(c.broadcast, root=last)  # (every rank waits for the root)
    for name, collective in (("all_gather", c.all_gather), ("broadcast", late_root)):
        if r == last:
            time.sleep(IDLE_WAIT_S)
        wall, cpu = time.perf_counter(), time.thread_time()
        got = collective(r)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        seen[f"{name}_after_a_late_rank"] = got
        seen[f"{name}_wait_is_idle"] = r == last or not idle_waits or cpu < 0.2 * max(wall, 0.5 * IDLE_WAIT_S)

    seen["no_failure"] = _reduce(c, None)
    one = ValueError(f"boom on rank {1 % n}") if r == 1 % n else None
    seen["one_failure"] = _reduce(c, one)
    even = KeyError(f"key-{r}") if r % 2 == 0 else None
    seen["even_failures"] = _reduce(c, even)
    seen["after_failures"] = c.all_gather(r)  # the group is still usable

    try:
        c.scatter(list(range(n + 1)) if r == 0 else None, root=0)
        seen["scatter_misuse"] = "no error"
    except CoordinatorError as exc:
        seen["scatter_misuse"] = "world_size" in str(exc)
    seen["after_misuse"] = c.broadcast(f"still aligned {r}", root=last)
    return jsonable(seen)


def _xor_input(rank: int) -> np.ndarray:
    """What ``rank`` passes to all_reduce_xor: values with the top bit set, and a signed view's -1."""
    return np.array([[1 << (rank % 64), 2**64 - 1 - rank], [rank * 0x0101, 1 << 63]], np.uint64)


def _expected_report(failures: dict[int, str], rank: int) -> dict[str, Any]:
    return {
        "type": "DistributedError",
        "is_runtime_error": True,
        "is_gpuckpt_error": True,
        "failures": {str(k): v for k, v in failures.items()},
        "message_names_each": True,
        "cause_is_own": True,
    }


def expected(rank: int, n: int) -> dict[str, Any]:
    """What ``run_checks`` must return on ``rank`` of ``n``."""
    last = n - 1
    root_b = 1 % n
    return {
        "rank": rank,
        "world_size": n,
        "gather_root0": [{"rank": i, "square": i * i} for i in range(n)] if rank == 0 else None,
        "gather_root_last": [["t", i] for i in range(n)] if rank == last else None,
        "scatter_from_last": {"to": rank, "pad": "x" * rank},
        "broadcast_from_1": {
            "from": root_b,
            "array": [x * (root_b + 1) for x in range(4)],
            "array_type": "ndarray",
            "copied": True,
        },
        "all_gather": [i * 10 for i in range(n)],
        "all_reduce_xor": {
            "values": functools.reduce(np.bitwise_xor, [_xor_input(i) for i in range(n)]).tolist(),
            "dtype": "uint64",
            "shape": [2, 2],
        },
        "rounds": [[i, (i + 1) % n] for i in range(20)],
        "broadcast_large": [last, _BIG, True],
        "all_gather_mixed_sizes": [
            [i, size, bytes([i + 1]).hex() if size else ""]
            for i, size in ((i, _BIG if i == 1 % n else 10 * i) for i in range(n))
        ],
        "marks_after_barrier": list(range(n)),
        "marks_after_idle_barrier": list(range(n)),
        "idle_wait_is_idle": True,
        "all_gather_after_a_late_rank": list(range(n)),
        "all_gather_wait_is_idle": True,
        "broadcast_after_a_late_rank": last,
        "broadcast_wait_is_idle": True,
        "no_failure": "no error",
        "one_failure": _expected_report({root_b: f"ValueError: boom on rank {root_b}"}, rank),
        "even_failures": _expected_report({i: f"KeyError: 'key-{i}'" for i in range(0, n, 2)}, rank),
        "after_failures": list(range(n)),
        "scatter_misuse": True,
        "after_misuse": f"still aligned {last}",
    }


def main(backend: str) -> None:
    rank = process_rank(backend)

    def work() -> dict[str, Any]:
        c = make_coordinator(backend)
        workdir = Path(os.environ["GPUCKPT_TEST_OUT"])
        if backend.endswith("-split"):  # one barrier folder per sub-group
            workdir = workdir / f"group-{rank % 2}"
            workdir.mkdir(exist_ok=True)
        else:
            assert c.rank == rank, (c.rank, rank)
        seen = run_checks(c, workdir)
        finish(backend)
        return seen

    run_rank(rank, work, backend)


if __name__ == "__main__":
    main(sys.argv[1])
