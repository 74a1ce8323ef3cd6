"""Cooperative loads with 4 ThreadCoordinator ranks (in-process): each stored chunk read once for the
job, bit-exact against loads that are not cooperative, failures on every rank, the memory budget.

The same script runs under mpiexec and gloo in ``test_coop_load_processes.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.distributed import SingleProcessCoordinator, ThreadCoordinator, run_ranks
from gpuckpt.errors import CoordinatorError, DistributedError, InvalidOptionError
from gpuckpt.testing.reads import count_chunk_reads


@pytest.fixture
def coop(load_script: Any, tmp_path: Path) -> tuple[Any, str]:
    module = load_script("coop_load")
    path = str(tmp_path / "ckpt")
    module.make_checkpoint(path)
    return module, path


@pytest.mark.parametrize("kind", ["replicated", "hsdp", "uneven"])
def test_each_chunk_is_read_once_and_the_load_is_bit_exact(coop: tuple[Any, str], kind: str) -> None:
    module, path = coop
    stored = module.chunk_file_bytes(path)
    with count_chunk_reads() as counted:
        coop_results = run_ranks(4, lambda c: module.load_rank(c, path, kind))
    with count_chunk_reads() as solo_counted:
        solo_results = run_ranks(4, lambda c: module.load_rank(c, path, kind, cooperative=False))
    assert all(r["exact"] for r in coop_results), coop_results
    assert coop_results == solo_results
    # every layout needs every chunk at least once: read once in all, not once per rank
    assert counted.nbytes == stored
    assert solo_counted.nbytes > stored
    if kind == "replicated":
        assert solo_counted.nbytes == 4 * stored


def test_a_damaged_chunk_fails_every_rank_with_the_checksum_error_and_sends_nothing(
    coop: tuple[Any, str], tmp_path: Path
) -> None:
    """Every rank raises the reader's ChecksumError; no byte of the round crossed to another rank
    (the readers read straight into their own arrays, as any load does: those hold what they
    read)."""
    module, path = coop
    module.damaged_copy(path, str(tmp_path / "damaged"), "damaged")
    outcome = run_ranks(4, lambda c: module.fail_rank(c, str(tmp_path / "damaged"), "replicated"))
    for o in outcome:
        assert o["raised"] == "DistributedError" and o["cause"] == "ChecksumError", o
        assert (o["cause_fqn"], o["cause_key"]) == ("model.w", "c.1.0")
        assert "chunk c.1.0 of tensor 'model.w'" in o["message"]
        assert o["planned"] and o["received_nothing"], "one round: nothing of a failed load was sent"
    assert not all(o["untouched"] for o in outcome), "the readers read into their own arrays"


def test_a_missing_chunk_fails_every_rank_before_anything_is_read(
    coop: tuple[Any, str], tmp_path: Path
) -> None:
    module, path = coop
    module.damaged_copy(path, str(tmp_path / "missing"), "missing")
    outcome = run_ranks(4, lambda c: module.fail_rank(c, str(tmp_path / "missing"), "uneven"))
    for o in outcome:
        assert o["raised"] == "DistributedError" and "MissingChunkError" in o["message"], o
        assert "chunk c.1.0 of tensor 'model.w'" in o["message"] and o["untouched"]


def test_a_chunk_deleted_after_the_checks_fails_its_readers_round_on_every_rank(
    coop: tuple[Any, str], tmp_path: Path
) -> None:
    """The chunk file goes away between the checks and the read: the reader meets it, every
    rank raises the typed error, and nothing of the round reaches another rank."""
    module, path = coop
    gone = tmp_path / "gone"
    module.damaged_copy(path, str(gone), "damaged")  # a copy; the damage is replaced below
    module.damaged_copy(path, str(gone), "none")
    import gpuckpt.distributed.cooperative as cooperative

    real = cooperative._read_shared

    def vanish_then_read(reader: Any, t: Any, c: Any, *where: Any) -> None:
        if t.fqn == "model.w" and c.key == "c.1.0":
            (gone / t.name / c.key).unlink(missing_ok=True)
        real(reader, t, c, *where)

    cooperative._read_shared = vanish_then_read  # type: ignore[assignment]
    try:
        outcome = run_ranks(4, lambda c: module.fail_rank(c, str(gone), "replicated"))
    finally:
        cooperative._read_shared = real  # type: ignore[assignment]
    for o in outcome:
        assert o["cause"] == "MissingChunkError" and "'model.w'" in o["message"], o
        assert o["planned"] and o["received_nothing"]


def test_a_reader_that_dies_fails_the_others(coop: tuple[Any, str]) -> None:
    """Rank 1 leaves once it has read its chunks of the first round, before it sends them (its
    thread ends, as a process dies): every other rank's next collective fails; none of them
    received anything."""
    module, path = coop
    import gpuckpt.distributed.cooperative as cooperative

    real = cooperative._agree
    calls: dict[int, int] = {}
    states: dict[int, Any] = {}

    def agree_or_die(c: Any, error: Any) -> None:
        calls[c.rank] = calls.get(c.rank, 0) + 1
        if c.rank == 1 and calls[c.rank] == 2:  # the first round's agreement (the plan's is first)
            raise SystemExit("rank 1 dies")
        real(c, error)

    plans: dict[int, Any] = {}

    def rank_main(c: ThreadCoordinator) -> Any:
        from gpuckpt.testing.plans import record_plans

        states[c.rank] = module.layout("replicated", c.rank, 4)
        with record_plans() as made:
            try:
                gpuckpt.load(states[c.rank], path, coordinator=c, cooperative=True)
            finally:
                plans[c.rank] = made[0] if made else None

    cooperative._agree = agree_or_die  # type: ignore[assignment]
    try:
        with pytest.raises(BaseException) as info:
            run_ranks(4, rank_main, timeout=30)
    finally:
        cooperative._agree = real  # type: ignore[assignment]
    assert calls[1] == 2 and all(calls[r] >= 2 for r in (0, 2, 3)), calls
    assert isinstance(info.value, CoordinatorError | SystemExit), repr(info.value)
    for rank, state in states.items():
        assert plans[rank] is not None and module.received_nothing(state, path, rank, plans[rank]), rank


@pytest.mark.parametrize("order", ["F", "C"])
def test_the_budget_streams_a_state_larger_than_it_in_rounds(coop: tuple[Any, str], order: str) -> None:
    """Fortran-ordered targets: no chunk of the 2-D tensors is a run of whole rows of one, so
    each travels through memory of its round, within the budget, in several rounds. C-ordered
    targets take every chunk straight (read or received): one round, no memory held."""
    module, path = coop
    from gpuckpt.distributed.cooperative import read_cooperative  # the report of one rank's part
    from gpuckpt.loading.open import open_checkpoint
    from gpuckpt.options import LoadOptions

    budget = 80 << 10
    options = LoadOptions(staging_bytes=budget)

    def rank_main(c: ThreadCoordinator) -> Any:
        ck = open_checkpoint(path, None)
        tensors = ck.index.tensors
        from gpuckpt.device.arrays import HostArray
        from gpuckpt.loading.checks import check_chunk_files

        check_chunk_files(ck.reader, list(tensors.values()))
        arrays = {f: np.zeros(t.shape, t.dtype, order=order) for f, t in tensors.items()}
        requests = [(t, [(HostArray(arrays[f]), ((0,) * len(t.shape), t.shape))]) for f, t in tensors.items()]
        report = read_cooperative(ck.reader, tensors, requests, options, c)
        return report, arrays

    results = run_ranks(4, rank_main)
    full = module.global_tensors()
    for report, arrays in results:
        assert report.plan.needed_bytes > 3 * budget
        if order == "F":
            assert report.plan.nrounds > 1 and 0 < report.held_bytes <= budget
            assert all(max(held) <= budget for held in report.plan.round_bytes)
        else:
            assert report.plan.nrounds == 1 and report.held_bytes == 8  # the 0-d tensor, a scalar
        assert all(arrays[k].tobytes() == v.tobytes() for k, v in full.items())
    assert sum(r.read_bytes for r, _ in results) == results[0][0].plan.needed_bytes


def test_one_rank_and_the_option(coop: tuple[Any, str]) -> None:
    module, path = coop
    state = module.layout("replicated", 0, 1)
    gpuckpt.load(state, path, coordinator=SingleProcessCoordinator())  # one rank: the usual load
    assert module.check(state)["exact"]
    with pytest.raises(InvalidOptionError, match="cooperative"):
        gpuckpt.load(state, path, cooperative="yes")  # type: ignore[arg-type]


def test_ranks_that_load_different_checkpoints_fail_together(coop: tuple[Any, str], tmp_path: Path) -> None:
    module, path = coop
    other = str(tmp_path / "other")
    gpuckpt.save({"x": np.ones(3)}, other)

    def rank_main(c: ThreadCoordinator) -> Any:
        if c.rank == 3:
            state: dict[str, Any] = {"x": np.zeros(3)}
            target = other
        else:
            state, target = module.layout("replicated", c.rank, 4), path
        try:
            gpuckpt.load(state, target, coordinator=c, cooperative=True)
        except DistributedError as exc:
            return str(exc)
        return None

    out = run_ranks(4, rank_main)
    assert all(o is not None and "same checkpoint" in o for o in out), out


def test_ranks_that_load_different_checkpoints_are_named_readably(tmp_path: Path) -> None:
    """The error names which ranks opened which checkpoint (by its id, not a Python tuple) and
    what differs in the words of the checkpoint: a region of a tensor as index ranges, its
    shape as 4x1024."""
    same, other = str(tmp_path / "same"), str(tmp_path / "other")
    gpuckpt.save({"w": np.ones((4, 1024), np.float32)}, same)
    gpuckpt.save({"w": np.ones((8, 1024), np.float32)}, other)
    ids = {p: gpuckpt.read_metadata(p).storage_meta.checkpoint_id for p in (same, other)}

    def rank_main(c: ThreadCoordinator) -> str:
        path, rows = (other, 8) if c.rank == 3 else (same, 4)
        with pytest.raises(DistributedError, match="CoordinatorError: cooperative load") as info:
            gpuckpt.load({"w": np.zeros((rows, 1024), np.float32)}, path, coordinator=c, cooperative=True)
        return str(info.value)

    for message in run_ranks(4, rank_main):
        assert "('" not in message and "None)" not in message, message
        assert f"ranks 0, 1, 2: checkpoint {ids[same]}; rank 3: checkpoint {ids[other]}" in message
        assert (
            "rank 3 asks for [0:8, 0:1024] of tensor 'w', which is 4x1024 in the checkpoint rank 0" in message
        )
        assert "pass every rank the same path" in message


@pytest.mark.parametrize("compression", ["zstd", "lz4", {"codec": "zstd"}])
def test_compressed_chunks_travel_as_stored_and_load_bit_exact(tmp_path: Path, compression: Any) -> None:
    """A compressed checkpoint: each chunk read once, sent compressed, decompressed by each rank
    that needs it (bfloat16, float32 and int64 tensors, edge chunks included)."""
    import ml_dtypes

    rng = np.random.default_rng(3)
    state = {
        "w": rng.normal(0, 0.02, (1000, 96)).astype(ml_dtypes.bfloat16),
        "m": rng.normal(0, 1e-3, (300, 77)).astype(np.float32),
        "i": np.arange(10_000, dtype=np.int64),
    }
    path = str(tmp_path / "ckpt")
    gpuckpt.save(state, path, compression=compression, chunk_bytes=32 << 10)
    stored = sum(f.stat().st_size for f in Path(path).rglob("c.*") if f.is_file())

    def rank(c: ThreadCoordinator) -> bool:
        target = {k: np.zeros_like(v) for k, v in state.items()}
        gpuckpt.load(target, path, coordinator=c, cooperative=True)
        return all(np.array_equal(target[k].view(np.uint8), state[k].view(np.uint8)) for k in state)

    with count_chunk_reads() as counted:
        assert run_ranks(4, rank) == [True] * 4
    assert counted.nbytes == stored


def test_by_default_a_load_cooperates_where_the_store_serves_every_read(coop: tuple[Any, str]) -> None:
    """cooperative=None: a local file system (the page cache serves a node's ranks from one read)
    reads as before, every rank its own chunks; an object store or a network file system
    cooperates (``shares_reads``); rank 0 decides for every rank."""
    from gpuckpt.storage.stores import NETWORK_FILE_SYSTEMS, shares_reads

    module, path = coop
    assert not shares_reads(path) and shares_reads("s3://bucket/run1/step_1")
    assert {"nfs", "nfs4", "lustre", "gpfs"} <= NETWORK_FILE_SYSTEMS
    stored = module.chunk_file_bytes(path)
    with count_chunk_reads() as counted:
        results = run_ranks(4, lambda c: module.load_rank(c, path, "replicated", cooperative=None))
    assert all(r["exact"] for r in results), results
    assert counted.nbytes == 4 * stored  # each rank read everything itself
    with pytest.raises(InvalidOptionError, match="cooperative must be True or False"):
        gpuckpt.load({}, path, cooperative="yes")  # type: ignore[arg-type]
