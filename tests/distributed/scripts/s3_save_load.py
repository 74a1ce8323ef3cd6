"""Distributed saves and resharded loads on ``s3://``, one rank per process.

``mpiexec -n N python s3_save_load.py MODE URL`` (or N processes of a gloo group
with ``torch`` as a third argument); the S3 endpoint is ``$GPUCKPT_TEST_S3``.
Modes:

``save`` / ``load`` / ``save_fail``
    as in ``sharded_save_load.py`` (uneven boxes on every rank; a resharded
    load; rank 1 failing), against the object store.
``kill``
    rank 1 SIGKILLs itself once it has uploaded its first chunk: the job dies
    mid-upload, with the claim of rank 0's save left behind.
``second_job``
    the prefix is claimed by a live save of another job: every rank gets
    DistributedError naming rank 0's CheckpointExistsError.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from _rank_io import finish, make_coordinator, process_rank, run_rank
from sharded_save_load import check_loaded, load_layout, save_layout

import gpuckpt
from gpuckpt.distributed import Coordinator, DistributedError


def options() -> dict[str, Any]:
    from gpuckpt.testing.s3server import s3_options

    extra: dict[str, Any] = {}
    if os.environ.get("GPUCKPT_TEST_LEASE"):
        extra["lease_seconds"] = float(os.environ["GPUCKPT_TEST_LEASE"])
    return s3_options(os.environ["GPUCKPT_TEST_S3"], **extra)


def published(url: str) -> bool:
    try:
        gpuckpt.read_metadata(url, storage_options=options())
    except gpuckpt.CheckpointNotFoundError:
        return False
    return True


def save_rank(c: Coordinator, url: str) -> dict[str, Any]:
    md = gpuckpt.save(save_layout(c.rank, c.world_size), url, coordinator=c, storage_options=options())
    return {"saved": True, "id": md.storage_meta.checkpoint_id}


def load_rank(c: Coordinator, url: str) -> dict[str, Any]:
    state = load_layout(c.rank, c.world_size)
    gpuckpt.load(state, url, coordinator=c, storage_options=options())
    return check_loaded(state)


def fail_rank(c: Coordinator, url: str, bad_rank: int | None) -> dict[str, Any]:
    state = save_layout(c.rank, c.world_size, bad_rank=bad_rank)
    outcome: dict[str, Any] = {"raised": None}
    try:
        gpuckpt.save(state, url, coordinator=c, storage_options=options())
    except DistributedError as exc:
        outcome = {
            "raised": type(exc).__name__,
            "failing_ranks": sorted(exc.failures),
            "reports": {r: f.split(":")[0] for r, f in exc.failures.items()},
        }
    c.barrier()
    outcome["published"] = published(url)
    return outcome


def kill_rank(c: Coordinator, url: str) -> dict[str, Any]:
    def progress(done: int, total: int) -> None:
        if c.rank == 1 and done > 0:
            os.kill(os.getpid(), signal.SIGKILL)

    state = save_layout(c.rank, c.world_size)
    gpuckpt.save(state, url, coordinator=c, storage_options=options(), progress=progress, chunk_bytes=64)
    return {"saved": True}


def main(mode: str, url: str, backend: str = "mpi") -> None:
    rank = process_rank(backend)

    def work() -> dict[str, Any]:
        c = make_coordinator(backend)
        if mode == "save":
            return save_rank(c, url)
        if mode == "load":
            return load_rank(c, url)
        if mode == "save_fail":
            return fail_rank(c, url, bad_rank=1)
        if mode == "second_job":
            return fail_rank(c, url, bad_rank=None)
        if mode == "kill":
            return kill_rank(c, url)
        raise ValueError(f"unknown mode {mode!r}")

    run_rank(rank, work, backend)
    finish(backend)


if __name__ == "__main__":
    main(*sys.argv[1:])
