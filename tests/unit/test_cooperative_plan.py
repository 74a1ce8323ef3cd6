"""The plan of a cooperative load, as data: each needed chunk read once, by a rank that needs it,
readers balanced, every round within the budget, the same plan whatever order the inputs come in."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuckpt.planning.cooperative import ChunkId, plan_cooperative

CHUNKS: list[ChunkId] = [(f"t{i % 5}", (i // 5, 0)) for i in range(40)]


@st.composite
def jobs(draw: st.DrawFn) -> tuple[list[list[ChunkId]], dict[ChunkId, int], int, list[str]]:
    world = draw(st.integers(1, 9))
    n = draw(st.integers(1, len(CHUNKS)))
    chunks = CHUNKS[:n]
    sizes = {c: draw(st.integers(1, 1000)) for c in chunks}
    wants = [draw(st.lists(st.sampled_from(chunks), max_size=n)) for _ in range(world)]
    budget = draw(st.integers(1, 3000))
    nodes = [f"node{r // draw(st.integers(1, 4))}" for r in range(world)]
    return wants, sizes, budget, nodes


@given(jobs())
def test_every_needed_chunk_is_read_once_by_a_rank_that_needs_it(job) -> None:  # type: ignore[no-untyped-def]
    wants, sizes, budget, nodes = job
    plan = plan_cooperative(wants, sizes, budget=budget, nodes=nodes)
    needers: dict[ChunkId, set[int]] = {}
    for rank, ids in enumerate(wants):
        for cid in ids:
            needers.setdefault(cid, set()).add(rank)
    shared = {s.id: s for s in plan.shared}
    assert len(shared) == len(plan.shared)
    assert set(shared) == {cid for cid, ranks in needers.items() if len(ranks) > 1}
    for cid, s in shared.items():
        assert s.reader in needers[cid] and {s.reader, *s.receivers} == needers[cid]
        assert s.reader not in s.receivers and s.nbytes == sizes[cid]
    # every byte the job needs is read once: by its only needer, or by the chunk's reader
    assert sum(plan.read_bytes) == plan.needed_bytes == sum(sizes[c] for c in needers)
    assert plan.requested_bytes == sum(sizes[c] * len(r) for c, r in needers.items())
    # every round within the budget on every rank, unless it is one chunk larger than the budget
    assert plan.nrounds == len(plan.round_bytes)
    for k, held in enumerate(plan.round_bytes):
        chunks = plan.in_round(k)
        assert chunks, "no empty round"
        for rank in range(len(wants)):
            mine = [s for s in chunks if rank == s.reader or rank in s.receivers]
            assert held[rank] == sum(s.nbytes for s in mine)
            assert held[rank] <= budget or len(mine) == 1
    assert [s.round for s in plan.shared] == sorted(s.round for s in plan.shared)


@given(jobs(), st.randoms(use_true_random=False))
def test_the_plan_does_not_depend_on_the_order_of_the_inputs(job, rnd: random.Random) -> None:  # type: ignore[no-untyped-def]
    wants, sizes, budget, nodes = job
    plan = plan_cooperative(wants, sizes, budget=budget, nodes=nodes)
    shuffled = [rnd.sample(ids, len(ids)) for ids in wants]
    sizes2 = dict(rnd.sample(list(sizes.items()), len(sizes)))
    assert plan_cooperative(shuffled, sizes2, budget=budget, nodes=nodes) == plan


@given(st.integers(2, 16), st.lists(st.integers(1, 1 << 20), min_size=1, max_size=200))
def test_replicas_read_about_equal_bytes(world: int, chunk_sizes: list[int]) -> None:
    """Every rank needs every chunk (replicated state): no rank reads more than its share plus
    one chunk (the largest-first rule)."""
    chunks = [("w", (i,)) for i in range(len(chunk_sizes))]
    sizes = dict(zip(chunks, chunk_sizes, strict=True))
    plan = plan_cooperative([chunks] * world, sizes, budget=1 << 30)
    assert max(plan.read_bytes) <= sum(chunk_sizes) / world + max(chunk_sizes)
    assert plan.needed_bytes * world == plan.requested_bytes


def test_two_replicas_of_two_shards_read_half_each_and_spread_over_nodes() -> None:
    a = [("w", (i,)) for i in range(8)]
    b = [("w", (i,)) for i in range(8, 16)]
    sizes = dict.fromkeys(a + b, 100)
    # ranks 0, 1 on one node and 2, 3 on the other; ranks 0 and 2 hold shard a
    plan = plan_cooperative([a, b, a, b], sizes, budget=250, nodes=["n0", "n0", "n1", "n1"])
    assert plan.read_bytes == (400, 400, 400, 400)
    assert all(len(s.receivers) == 1 for s in plan.shared)
    assert plan.nrounds == 4  # 2 chunks of 100 bytes per rank and round within 250
    assert all(max(held) <= 250 for held in plan.round_bytes)


def test_a_chunk_one_rank_needs_is_not_shared() -> None:
    plan = plan_cooperative([[("a", (0,))], [("b", (0,))]], {("a", (0,)): 5, ("b", (0,)): 7}, budget=1)
    assert plan.shared == () and plan.nrounds == 0 and not plan.saves_reads
    assert plan.read_bytes == (5, 7)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="budget"):
        plan_cooperative([[]], {}, budget=0)
    with pytest.raises(ValueError, match="nodes"):
        plan_cooperative([[], []], {}, budget=1, nodes=["x"])


def test_a_chunk_whose_needers_need_other_rows_is_read_by_each_alone() -> None:
    """Ranks that need disjoint rows of one chunk each read their rows (ranged reads): no
    exchange, and the chunk counts for each reader in read_bytes (an upper bound)."""
    a, b = ("w", (0,)), ("w", (1,))
    plan = plan_cooperative([[a, b], [a, b]], {a: 10, b: 10}, budget=100, alone=[b])
    assert [s.id for s in plan.shared] == [a]
    assert sum(plan.read_bytes) == 10 + 2 * 10 and plan.needed_bytes == 20


@given(jobs(), st.data())
def test_receivers_into_their_targets_hold_nothing_and_rounds_keep_the_budget(
    job, data: st.DataObject
) -> None:  # type: ignore[no-untyped-def]
    """A chunk read or received straight into a rank's targets (``free``) takes none of that rank's
    budget; a rank that reads or receives it into memory of the round holds ``held`` bytes of it."""
    wants, sizes, budget, nodes = job
    held = {c: data.draw(st.integers(0, n)) for c, n in sizes.items()}
    free = [set(data.draw(st.lists(st.sampled_from(ids)))) if ids else set() for ids in wants]
    plan = plan_cooperative(wants, sizes, budget=budget, nodes=nodes, held=held, free=free)
    baseline = plan_cooperative(wants, sizes, budget=budget, nodes=nodes)
    # who reads what does not depend on the memory: only the rounds do
    assert sorted((s.id, s.reader, s.receivers) for s in plan.shared) == sorted(
        (s.id, s.reader, s.receivers) for s in baseline.shared
    )
    assert plan.read_bytes == baseline.read_bytes and plan.needed_bytes == baseline.needed_bytes
    for k, taken in enumerate(plan.round_bytes):
        chunks = plan.in_round(k)
        for rank in range(len(wants)):
            kept = [s for s in chunks if rank in (s.reader, *s.receivers) and s.id not in free[rank]]
            assert taken[rank] == sum(held[s.id] for s in kept)
            assert taken[rank] <= budget or len(kept) == 1


def test_replicas_received_into_their_targets_travel_in_one_round() -> None:
    """4 replicas of 16 chunks of 64 MiB (+ a 4-byte trailer each), a budget of 256 MiB a round:
    each rank reads 4 chunks and receives 12. Into its arrays, it holds nothing: one round.
    Reading into memory of the round (64 MiB a chunk) and receiving into its arrays: one round
    at the budget. Holding every chunk it reads or receives, trailers counted: six."""
    mib = 1 << 20
    chunks = [(f"w{i:02d}", (0, 0)) for i in range(16)]
    sizes = dict.fromkeys(chunks, 64 * mib + 4)
    wants = [chunks] * 4
    held = dict.fromkeys(chunks, 64 * mib)
    plan = plan_cooperative(wants, sizes, budget=256 * mib, held=held, free=[set(chunks)] * 4)
    assert plan.nrounds == 1 and plan.round_bytes == ((0,) * 4,)
    assert plan.read_bytes == ((64 * mib + 4) * 4,) * 4
    received_only = [{s.id for s in plan.shared if s.reader != r} for r in range(4)]
    plan = plan_cooperative(wants, sizes, budget=256 * mib, held=held, free=received_only)
    assert plan.nrounds == 1 and plan.round_bytes == ((256 * mib,) * 4,)
    assert plan_cooperative(wants, sizes, budget=256 * mib).nrounds == 6
    with pytest.raises(ValueError, match="free"):
        plan_cooperative(wants, sizes, budget=1, free=[set()])
