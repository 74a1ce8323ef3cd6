"""The save plan as data: what :func:`plan_save` decides, checked without I/O.

A plan is made from descriptions of what each process holds (no arrays), is
frozen, names no array, and is bound to arrays only when it runs; a
background snapshot binds the same plan to its copies. Single-process,
background and distributed saves use the same function, so the same array
gets the same chunk grid on every path.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuckpt import ShardedArray
from gpuckpt.background import snapshot
from gpuckpt.device.arrays import HostArray
from gpuckpt.device.staging import HostAllocator, StagingArena
from gpuckpt.errors import UnsupportedValueError
from gpuckpt.format.grid import plan_regular_grid
from gpuckpt.format.names import encode_name
from gpuckpt.metadata import TensorProperties
from gpuckpt.planning.boxes import Box, LocalTensor, intersect
from gpuckpt.planning.plan import StateDescription, plan_save
from gpuckpt.saving.sources import describe_state
from gpuckpt.saving.writing import bind_jobs

F32 = TensorProperties(np.dtype("float32"))


def lt(fqn: str, shape: tuple[int, ...], boxes: list[Box] | None = None) -> LocalTensor:
    whole = [((0,) * len(shape), shape)]
    return LocalTensor(fqn, shape, "float32", 4, F32, tuple(whole if boxes is None else boxes))


def one(
    *tensors: LocalTensor, objects: dict[str, Any] | None = None, skeleton: Any = None
) -> StateDescription:
    return StateDescription(tuple(tensors), objects or {}, skeleton if skeleton is not None else {"d": []})


def test_single_process_plan() -> None:
    skeleton = {"d": [["s", "w", {"v": "w"}], ["s", "b", {"v": "b"}], ["s", "step", {"v": "step"}]]}
    plan = plan_save(
        [one(lt("w", (1000, 256)), lt("b", (7,)), objects={"step": {"int": "3"}}, skeleton=skeleton)],
        chunk_bytes=256 << 10,
    )
    w, b = plan.tensors
    assert w.grid == plan_regular_grid((1000, 256), 4, 256 << 10) and w.grid.chunk_shape == (250, 256)
    assert w.specs == tuple(w.grid.chunk_list()) and len(b.specs) == 1
    assert (w.name, b.name) == (encode_name("w"), encode_name("b"))
    assert w.dtype == np.float32 and w.properties == F32 and w.nbytes == 1000 * 256 * 4
    (mine,) = plan.assignments  # one process writes every chunk, in the order of the metadata
    assert [(a.fqn, a.coords, a.box) for a in mine] == [("w", (i, 0), 0) for i in range(4)] + [("b", (0,), 0)]
    assert [(a.offsets, a.sizes, a.stored) for a in mine[:4]] == [
        ((250 * i, 0), (250, 256), (250, 256)) for i in range(4)
    ]
    assert plan.objects == {"step": {"int": "3"}} and plan.skeleton == skeleton
    assert plan.nfiles == (4 + 1) + (1 + 1) + 1  # chunks and array documents, and the root's


def test_edge_chunks_are_stored_padded_on_regular_grids() -> None:
    plan = plan_save([one(lt("w", (10, 4)))], chunk_bytes=48)
    assert plan.tensors[0].grid.chunk_shape == (3, 4)
    last = plan.assignments[0][-1]
    assert (last.offsets, last.sizes, last.stored) == ((9, 0), (1, 4), (3, 4))


def _walk(value: Any) -> Any:
    """Every value reachable from ``value`` through dataclass fields, tuples, lists and dicts."""
    yield value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _walk(getattr(value, f.name))
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _walk(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(k)
            yield from _walk(v)


def test_a_plan_is_frozen_data_without_arrays() -> None:
    g = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    state = {
        "w": g,
        "parts": [ShardedArray(g[:3], (0, 0), (8, 8)), ShardedArray(g[3:], (3, 0), (8, 8))],
        "k": 1,
    }
    local, _ = describe_state(state, allow_pickle=False)
    plan = plan_save([local], chunk_bytes=64)
    for v in _walk(plan):
        assert not isinstance(v, (np.ndarray, HostArray, ShardedArray)), f"the plan holds {type(v).__name__}"
    assert pickle.loads(pickle.dumps(plan)) == plan  # what a coordinator sends is what it planned
    for record in (plan, plan.tensors[0], plan.assignments[0][0], local, local.tensors[0]):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, dataclasses.fields(record)[0].name, None)


def test_binding_puts_each_chunk_in_its_box() -> None:
    g = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    parts = [ShardedArray(g[:20].copy(), (0, 0), g.shape), ShardedArray(g[20:].copy(), (20, 0), g.shape)]
    local, sources = describe_state({"w": parts}, allow_pickle=False)
    plan = plan_save([local], chunk_bytes=64)  # 4 rows per chunk
    jobs = bind_jobs(plan.assignments[0], sources)
    assert len(jobs) == plan.tensors[0].grid.nchunks == 16
    for a, j in zip(plan.assignments[0], jobs, strict=True):
        assert j.source is sources["w"][a.box].array
        box = j.source.host_array()[tuple(slice(o, o + s) for o, s in zip(j.offsets, j.sizes, strict=True))]
        assert np.array_equal(box, g[a.offsets[0] : a.offsets[0] + a.sizes[0]])


def test_a_snapshot_binds_the_same_plan_to_its_copies() -> None:
    g = np.arange(4096, dtype=np.float32).reshape(64, 64)
    state = {"w": g.copy(), "x": np.ones(5)}
    local, sources = describe_state(state, allow_pickle=False)
    plan = plan_save([local], chunk_bytes=4096)
    frozen = pickle.dumps(plan)
    snap = snapshot(local, sources, StagingArena(HostAllocator()))
    state["w"][:] = -1  # the caller goes on training
    assert pickle.dumps(plan) == frozen  # the snapshot left the plan alone
    jobs = bind_jobs(plan.assignments[0], snap)
    copies = {id(s.array) for held in snap.values() for s in held}
    assert all(id(j.source) in copies for j in jobs)
    w = [j for j in jobs if j.name == encode_name("w")]
    got = np.concatenate([j.source.host_array()[j.offsets[0] : j.offsets[0] + j.sizes[0]] for j in w])
    assert np.array_equal(got, g)
    assert [(j.name, j.coords) for j in jobs] == [
        (j.name, j.coords) for j in bind_jobs(plan.assignments[0], sources)
    ]


@pytest.mark.parametrize(
    ("shape", "chunk_bytes"),
    [((4, 100_000), 256 << 10), ((10, 256), 3 << 10), ((1000, 300), 256 << 10)],
)
def test_an_array_held_whole_gets_the_same_grid_on_every_path(
    shape: tuple[int, int], chunk_bytes: int
) -> None:
    # a plain save, the same array replicated on two ranks, one rank holding it as one box
    single = plan_save([one(lt("w", shape))], chunk_bytes=chunk_bytes)
    replicated = plan_save([one(lt("w", shape)), one(lt("w", shape))], chunk_bytes=chunk_bytes)
    boxed = plan_save([one(lt("w", shape)), one()], chunk_bytes=chunk_bytes)
    grids = {p.tensors[0].grid for p in (single, replicated, boxed)}
    assert grids == {plan_regular_grid(shape, 4, chunk_bytes)}
    assert max(math.prod(s.sizes) * 4 for s in single.tensors[0].specs) <= chunk_bytes
    # a replica is written once, by one rank
    assert sorted(len(a) for a in replicated.assignments) == [0, len(single.tensors[0].specs)]


def test_values_and_structure_of_every_rank_are_kept() -> None:
    a = one(
        objects={"lr": {"float": "0x1p-10"}, "step": {"int": "3"}}, skeleton={"d": [["s", "lr", {"v": "lr"}]]}
    )
    b = one(
        objects={"step": {"int": "4"}, "rank1": {"none": None}},
        skeleton={"d": [["s", "rank1", {"v": "rank1"}]]},
    )
    with pytest.warns(
        UserWarning, match=r"1 plain value\(s\) differ between the ranks.*'step' \(ranks \[1\]\)"
    ):
        plan = plan_save([a, b], chunk_bytes=1 << 20)  # the first rank's step is kept, with a warning
    assert plan.objects == {"lr": {"float": "0x1p-10"}, "step": {"int": "3"}, "rank1": {"none": None}}
    assert plan.skeleton == {"d": [["s", "lr", {"v": "lr"}], ["s", "rank1", {"v": "rank1"}]]}
    assert plan.tensors == () and plan.assignments == ((), ())


def test_disagreeing_ranks_are_an_error() -> None:
    with pytest.raises(UnsupportedValueError, match="every rank must agree"):
        plan_save([one(lt("w", (10,))), one(lt("w", (12,)))], chunk_bytes=1 << 20)
    with pytest.raises(ValueError, match="at least one process"):
        plan_save([], chunk_bytes=1 << 20)


@st.composite
def dealt_tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], list[list[Box]]]:
    """A random tiling of a random shape, its boxes dealt to 1..4 ranks, some to two (replicas)."""
    shape = tuple(draw(st.lists(st.integers(1, 12), min_size=1, max_size=3)))
    cuts = []
    for n in shape:
        inner = draw(st.lists(st.integers(1, n - 1), max_size=2, unique=True)) if n > 1 else []
        cuts.append([0, *sorted(inner), n])
    boxes = [
        (tuple(a for a, _ in cell), tuple(b - a for a, b in cell))
        for cell in itertools.product(*[list(itertools.pairwise(c)) for c in cuts])
    ]
    nranks = draw(st.integers(1, 4))
    dealt: list[list[Box]] = [[] for _ in range(nranks)]
    for box in boxes:
        owners = draw(st.sets(st.integers(0, nranks - 1), min_size=1, max_size=2))
        for r in owners:
            dealt[r].append(box)
    return shape, dealt


@given(dealt_tilings(), st.booleans(), st.integers(4, 256))
def test_every_chunk_is_written_once_from_a_box_that_holds_it(
    t: tuple[tuple[int, ...], list[list[Box]]], portable: bool, chunk_bytes: int
) -> None:
    shape, dealt = t
    ranks = [one(lt("w", shape, boxes)) if boxes else one() for boxes in dealt]
    plan = plan_save(ranks, chunk_bytes=chunk_bytes, portable=portable)
    (tensor,) = plan.tensors
    assert len(plan.assignments) == len(ranks)
    written = [(r, a) for r, mine in enumerate(plan.assignments) for a in mine]
    assert sorted(a.coords for _, a in written) == sorted(s.coords for s in tensor.specs)  # each once
    for r, a in written:
        box = dealt[r][a.box]
        assert intersect(box, (a.offsets, a.sizes)) == (a.offsets, a.sizes)  # inside the writer's box
        assert a.stored == tensor.grid.stored_chunk_shape(
            next(s for s in tensor.specs if s.coords == a.coords)
        )
    if portable:
        assert tensor.grid.kind == "regular"


def test_describing_a_state_that_contains_itself_is_a_typed_error() -> None:
    state: dict[str, Any] = {"w": np.ones(3)}
    state["self"] = state
    with pytest.raises(UnsupportedValueError, match="reference cycle at 'self'"):
        describe_state(state, allow_pickle=False)


def test_a_plan_memo_plans_as_plan_save_and_reuses_only_the_same_tensors() -> None:
    """PlanMemo (a tier's parts, step after step) gives plan_save's plan for every description:
    the last tensors' plans when the tensors are the same objects and the options the same,
    the values always planned anew; a new plan when a tensor, its order or an option changes."""
    from gpuckpt.format.codecs import Compression
    from gpuckpt.planning.plan import PlanMemo, plan_save
    from gpuckpt.saving.sources import TensorMemo, describe_state

    tensors, plans = TensorMemo(), PlanMemo()
    w, b = np.zeros((64, 8), np.float32), np.ones(3, np.float16)

    def check(state: dict[str, Any], chunk_bytes: int = 1024, compression: Compression | None = None) -> Any:
        local, _ = describe_state(state, allow_pickle=False, memo=tensors)
        got = plans.plan_save(local, chunk_bytes=chunk_bytes, compression=compression)
        assert got == plan_save([local], chunk_bytes=chunk_bytes, compression=compression)
        return got

    first = check({"w": w, "b": b, "step": 1})
    again = check({"w": w, "b": b, "step": 2})
    assert again.tensors is first.tensors  # (taken from the last call)
    assert again.objects != first.objects  # the values planned anew
    assert check({"b": b, "w": w, "step": 2}).tensors is not first.tensors  # another order
    check({"w": w, "b": b})
    assert check({"w": w, "b": b}, chunk_bytes=512).tensors[0].grid != first.tensors[0].grid
    zstd = check({"w": w, "b": b}, compression=Compression(codec="zstd"))
    skipped = check({"w": w, "b": b}, compression=Compression(codec="zstd", auto=True, skip=frozenset({"w"})))
    assert zstd.tensors[0].codec is not None and skipped.tensors[0].codec is None
    check({"w": w.reshape(32, 16), "b": b})
    check({"w": [ShardedArray(w, (64, 0), (128, 8)), ShardedArray(w, (0, 0), (128, 8))], "b": b})
    check({"w": w, "b": b, "c": np.zeros(2)})
