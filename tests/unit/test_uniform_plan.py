"""Planning per tensor (compact descriptions, NumPy over the ranks) makes the plan the general path makes."""

from __future__ import annotations

import itertools
import math
import pickle
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuckpt.errors import UnsupportedValueError
from gpuckpt.metadata import TensorProperties
from gpuckpt.planning.boxes import Box, LocalTensor
from gpuckpt.planning.plan import StateDescription, plan_save
from gpuckpt.planning.uniform import (
    CompactDescription,
    TensorGroups,
    box_fingerprints,
    compact_description,
    local_layout_digest,
    tensor_groups,
)

F32 = TensorProperties(np.dtype("float32"))


def lt(fqn: str, shape: tuple[int, ...], box: Box) -> LocalTensor:
    return LocalTensor(fqn, shape, "float32", 4, F32, (box,))


def split_boxes(shape: tuple[int, ...], steps: tuple[int, ...]) -> list[Box]:
    """The blocks of an even split of ``shape`` (edge blocks clipped), in C order."""
    starts = [range(0, n, s) for n, s in zip(shape, steps, strict=True)]
    return [
        (tuple(o), tuple(min(s, n - x) for s, n, x in zip(steps, shape, o, strict=True)))
        for o in itertools.product(*starts)
    ]


def grouped(descs: list[StateDescription]) -> list[CompactDescription]:
    """What rank 0 receives of grouped compact descriptions: the protocol of a distributed save
    (fingerprints XORed over the ranks, groups found and checked by every rank)."""
    compact = [compact_description(d.tensors, d.objects, d.skeleton) for d in descs]
    assert all(c is not None for c in compact)
    combined = np.zeros((len(descs[0].tensors), 2), np.uint64)
    for r, c in enumerate(compact):
        combined ^= box_fingerprints(c, r)  # type: ignore[arg-type]
    out = []
    for r, (c, d) in enumerate(zip(compact, descs, strict=True)):
        g = c.grouped(tensor_groups(combined, d.tensors))  # type: ignore[union-attr]
        out.append(g if r == 0 else g.without_tensors())
    return out


def both(descs: list[StateDescription], **kw: object) -> tuple[object, object]:
    compact = [compact_description(d.tensors, d.objects, d.skeleton) for d in descs]
    assert all(c is not None for c in compact)
    received = [c if r == 0 else c.without_tensors() for r, c in enumerate(compact)]  # type: ignore[union-attr]
    fast = plan_save(received, **kw)  # type: ignore[arg-type]
    # grouped descriptions (one box per group of alike tensors) make the same plan
    assert plan_save(grouped(descs), **kw) == fast  # type: ignore[arg-type]
    return fast, plan_save(descs, **kw)  # type: ignore[arg-type]


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[StateDescription], int]:
    """Tensors split evenly (or held whole, or split unevenly) over the same ranks, one box each."""
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=nd, max_size=nd)))
    steps = tuple(draw(st.integers(1, n)) for n in shape)
    blocks = split_boxes(shape, steps)
    replicas = draw(st.integers(1, 2))
    nranks = len(blocks) * replicas
    per_rank: list[list[LocalTensor]] = [[] for _ in range(nranks)]
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["split", "whole", "uneven"]))
        for r in range(nranks):
            if kind == "split":
                box = blocks[r % len(blocks)]
            elif kind == "whole":
                box = ((0,) * nd, shape)
            else:  # rank 0 holds one element less, rank 1 one more: not an even split
                b = blocks[r % len(blocks)]
                box = b
                if len(blocks) > 1 and replicas == 1 and b[1][0] > 1 and r == 0:
                    box = (b[0], (b[1][0] - 1, *b[1][1:]))
            per_rank[r].append(lt(f"t{i}", shape, box))
    descs = [StateDescription(tuple(ts), {"step": {"int": "0"}}, {"d": []}) for ts in per_rank]
    return descs, draw(st.sampled_from([4, 16, 64, 1 << 20]))


@settings(max_examples=150, deadline=None)
@given(layouts(), st.booleans())
def test_compact_planning_makes_the_plan_of_the_general_path(
    case: tuple[list[StateDescription], int], portable: bool
) -> None:
    descs, chunk_bytes = case
    try:
        fast, general = both(descs, chunk_bytes=chunk_bytes, portable=portable)
    except UnsupportedValueError as exc:
        # a layout that does not tile its tensor is refused by both paths alike
        with pytest.raises(UnsupportedValueError, match=re.escape(str(exc))):
            plan_save(descs, chunk_bytes=chunk_bytes, portable=portable)
        return
    assert fast == general
    assert fast.assignments == general.assignments  # type: ignore[attr-defined]
    assert fast.objects == {"step": {"int": "0"}}  # type: ignore[attr-defined]


def test_layers_of_one_layout_share_their_writers_and_rows_follow_the_chunks() -> None:
    shape = (64, 8)
    blocks = split_boxes(shape, (16, 8))
    descs = [
        StateDescription(tuple(lt(f"layer{i}", shape, box) for i in range(5)), {}, {"d": []})
        for box in blocks
    ]
    fast, _ = both(descs, chunk_bytes=16 * 8 * 4)
    assert len({id(t.writes) for t in fast.tensors}) == 1  # type: ignore[attr-defined]
    # what a coordinator broadcasts stays small: the shared writers are pickled once
    one_layer = len(pickle.dumps(fast.tensors[0]))  # type: ignore[attr-defined]
    assert len(pickle.dumps(fast)) < 3 * one_layer
    rows = sorted(a.row for r in range(len(blocks)) for a in fast.assignments_of(r))  # type: ignore[attr-defined]
    assert rows == list(range(fast.nchunks))  # type: ignore[attr-defined]
    for t in fast.tensors:  # type: ignore[attr-defined]
        for a in fast.assignments_of(0):  # type: ignore[attr-defined]
            if a.fqn == t.fqn:
                flat = a.coords[0] * t.grid.grid_shape[1] + a.coords[1]
                assert a.row == t.row + flat


def test_a_compact_description_needs_one_box_per_tensor_and_one_layout() -> None:
    two = LocalTensor("w", (8,), "float32", 4, F32, (((0,), (4,)), ((4,), (4,))))
    assert compact_description([two], {}, None) is None
    a = compact_description([lt("w", (8,), ((0,), (8,)))], {}, None)
    b = compact_description([lt("v", (8,), ((0,), (8,)))], {}, None)
    assert a is not None and b is not None and a.digest != b.digest
    with pytest.raises(ValueError, match="different layouts"):
        plan_save([a, b], chunk_bytes=1 << 20)
    with pytest.raises(ValueError, match="carries no tensors"):
        plan_save([StateDescription((), {}, None), b.without_tensors()], chunk_bytes=1 << 20)


def test_the_local_layout_digest_changes_with_boxes_and_options() -> None:
    base = [lt("w", (8, 4), ((0, 0), (4, 4)))]
    d = local_layout_digest(base, chunk_bytes=64, portable=False)
    assert d == local_layout_digest(list(base), chunk_bytes=64, portable=False)
    assert d != local_layout_digest([lt("w", (8, 4), ((4, 0), (4, 4)))], chunk_bytes=64, portable=False)
    assert d != local_layout_digest(base, chunk_bytes=128, portable=False)
    assert d != local_layout_digest(base, chunk_bytes=64, portable=True)
    assert len(d) == 32 and math.prod((2, 16)) == len(d)


def test_tensors_alike_on_every_rank_are_grouped_and_sent_once() -> None:
    shape = (64, 8)
    blocks = split_boxes(shape, (16, 8))
    other = split_boxes((64, 8), (32, 8))  # a second layout of the same shape
    descs = [
        StateDescription(
            (
                *(lt(f"layer{i}", shape, box) for i in range(6)),
                lt("norm", (8,), ((0,), (8,))),
                lt("head", shape, other[r % 2]),
                lt("layer6", shape, box),
            ),
            {},
            {"d": []},
        )
        for r, box in enumerate(blocks)
    ]
    received = grouped(descs)
    groups = received[0].groups
    assert groups is not None
    assert groups.representatives == (0, 6, 7)
    assert groups.group_of == (0, 0, 0, 0, 0, 0, 1, 2, 0)
    # each rank sends three boxes, whatever the number of layers
    assert all(len(d.boxes) == 3 * 2 * 2 * 8 and d.tensors is None for d in received[1:])
    assert plan_save(received, chunk_bytes=16 * 8 * 4) == plan_save(descs, chunk_bytes=16 * 8 * 4)


def test_a_rank_whose_boxes_contradict_its_groups_refuses_them() -> None:
    """Fingerprints that collided would group tensors whose boxes differ on some rank: that rank's
    check fails (the save fails everywhere) instead of a plan made from the wrong box."""
    a = lt("a", (8,), ((0,), (4,)))
    b = lt("b", (8,), ((4,), (4,)))
    c = compact_description([a, b], {}, None)
    assert c is not None
    with pytest.raises(ValueError, match="tensor 1 was grouped with tensor 0.*collided"):
        c.grouped(TensorGroups((0,), (0, 0)))
    assert c.grouped(TensorGroups((0, 1), (0, 1))).boxes == c.boxes


def test_ranks_that_grouped_differently_are_not_planned() -> None:
    shape = (8,)
    descs = [
        StateDescription((lt("a", shape, box), lt("b", shape, box)), {}, {"d": []})
        for box in split_boxes(shape, (4,))
    ]
    received = grouped(descs)
    c1 = compact_description(descs[1].tensors, {}, {"d": []})
    assert c1 is not None
    received[1] = c1.grouped(TensorGroups((0, 1), (0, 1))).without_tensors()
    with pytest.raises(ValueError, match="rank 1"):
        plan_save(received, chunk_bytes=1 << 20)


def test_box_fingerprints_depend_on_the_rank_and_the_box_not_the_tensor() -> None:
    c = compact_description(
        [
            lt("a", (8, 4), ((0, 0), (4, 4))),
            lt("b", (8, 4), ((0, 0), (4, 4))),
            lt("c", (8, 4), ((4, 0), (4, 4))),
        ],
        {},
        None,
    )
    assert c is not None
    f0, f1 = box_fingerprints(c, 0), box_fingerprints(c, 1)
    assert f0.shape == (3, 2) and f0.dtype == np.uint64
    assert (f0[0] == f0[1]).all() and (f0[0] != f0[2]).any()
    assert (f0 != f1).all()
    empty = compact_description([], {}, None)
    assert empty is not None and box_fingerprints(empty, 3).shape == (0, 2)


def test_merging_the_ranks_rows_needs_each_chunk_exactly_once() -> None:
    from gpuckpt.errors import GpuckptError
    from gpuckpt.saving.commit import table_columns

    shape = (64, 8)
    descs = [StateDescription((lt("w", shape, box),), {}, {"d": []}) for box in split_boxes(shape, (16, 8))]
    plan = plan_save(descs, chunk_bytes=16 * 8 * 4)
    assert plan.nchunks == 4

    def part(rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
        return np.array(rows, np.int64), np.array([10 + r for r in rows], np.uint32)

    assert table_columns(plan, [part([2, 0]), part([1]), part([3])])["crc32c"].tolist() == [10, 11, 12, 13]
    with pytest.raises(GpuckptError, match="chunk 1 of the save's chunk table was written 2 times"):
        table_columns(plan, [part([0, 1]), part([1, 2]), part([3])])
    with pytest.raises(GpuckptError, match="chunk 2 of the save's chunk table was written 0 times"):
        table_columns(plan, [part([0, 1]), part([3])])
    with pytest.raises(GpuckptError, match="chunk 1 of the save's chunk table was written 2 times"):
        table_columns(plan, [part([0, 1]), part([2, 1])])  # as many rows as chunks, one twice
    with pytest.raises(GpuckptError, match="outside the plan"):
        table_columns(plan, [part([0, 1, 2, 4])])


def test_a_one_chunk_tensor_is_written_by_the_rank_holding_it_not_by_an_empty_box() -> None:
    full = lt("late", (3,), ((0,), (3,)))
    empty = lt("late", (3,), ((0,), (0,)))
    for held in ([empty, full], [full, empty], [empty, empty, full]):
        descs = [StateDescription((t,), {}, {"d": []}) for t in held]
        plan = plan_save(descs, chunk_bytes=1 << 20)
        writers = [r for r in range(len(held)) for _ in plan.assignments_of(r)]
        assert writers == [held.index(full)]
        (a,) = plan.assignments_of(held.index(full))
        assert (a.coords, a.offsets, a.sizes, a.stored) == ((0,), (0,), (3,), (3,))
