from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuckpt.errors import UnsupportedValueError
from gpuckpt.metadata import TensorProperties
from gpuckpt.planning.boxes import (
    LocalTensor,
    grid_for_boxes,
    intersect,
    overlapping_chunks,
    plan_global,
)


def lt(fqn: str, shape: tuple[int, ...], boxes: list, dtype: str = "float32") -> LocalTensor:
    return LocalTensor(fqn, shape, dtype, 4, TensorProperties(np.dtype(dtype)), tuple(boxes))


def rows(shape: tuple[int, int], splits: list[int]) -> list:
    edges = [0, *splits, shape[0]]
    return [((a, 0), (b - a, shape[1])) for a, b in itertools.pairwise(edges)]


def test_even_split_gives_regular_grid() -> None:
    g = grid_for_boxes(rows((10, 4), [4, 8]), (10, 4), 4, chunk_bytes=1 << 20)
    assert g.kind == "regular" and g.chunk_shape == (4, 4)


def test_uneven_split_gives_rectilinear_or_portable_regular() -> None:
    boxes = rows((10, 4), [3, 7])
    g = grid_for_boxes(boxes, (10, 4), 4, chunk_bytes=1 << 20)
    assert g.kind == "rectilinear" and g.edges == ((3, 4, 3), (4,))
    p = grid_for_boxes(boxes, (10, 4), 4, chunk_bytes=1 << 20, portable=True)
    assert p.kind == "regular" and p.chunk_shape == (1, 4)
    # every box is a union of whole chunks
    for box in boxes:
        covered = sum(
            math.prod(intersect(box, (s.offsets, s.sizes))[1])
            for s in p.chunks()
            if intersect(box, (s.offsets, s.sizes))
        )
        assert covered == math.prod(box[1])


def test_large_boxes_are_refined_to_chunk_size() -> None:
    g = grid_for_boxes([((0, 0), (1000, 256))], (1000, 256), 4, chunk_bytes=256 * 4 * 100)
    assert all(s.sizes[0] <= 100 for s in g.chunks())


def test_replicas_written_once_and_spread() -> None:
    whole = [((0,), (100,))]
    plans = plan_global([[lt(f"t{i}", (100,), whole)] for i in range(1)] * 4, chunk_bytes=1 << 20)
    assert len(plans) == 1 and len(plans[0].writers) == 1
    many = plan_global(
        [[lt(f"t{i}", (100,), whole) for i in range(8)] for _ in range(4)], chunk_bytes=1 << 20
    )
    writers = [next(iter(p.writers.values()))[0] for p in many]
    assert sorted(writers) == [0, 0, 1, 1, 2, 2, 3, 3]  # balanced over the holders


def test_gaps_overlaps_and_disagreements_are_errors() -> None:
    with pytest.raises(UnsupportedValueError, match=r"cover 6 elements of 10; no box holds \[6:10\]"):
        plan_global([[lt("w", (10,), [((0,), (6,))])]], chunk_bytes=1 << 20)
    # the grid of box edges is searched for the first region no box holds (C order)
    boxes = [((0, 0), (2, 3)), ((2, 1), (2, 2))]
    with pytest.raises(UnsupportedValueError, match=r"of shape 4x3: .* no box holds \[2:4, 0:1\]"):
        plan_global([[lt("w", (4, 3), boxes)]], chunk_bytes=1 << 20)
    with pytest.raises(UnsupportedValueError, match="overlap|uncovered"):
        plan_global([[lt("w", (10,), [((0,), (6,))])], [lt("w", (10,), [((2,), (4,))])]], chunk_bytes=1 << 20)
    with pytest.raises(UnsupportedValueError, match="every rank must agree"):
        plan_global(
            [[lt("w", (10,), [((0,), (10,))])], [lt("w", (12,), [((0,), (12,))])]], chunk_bytes=1 << 20
        )


def splits(n: int) -> st.SearchStrategy[list[int]]:
    return (
        st.lists(st.integers(1, max(1, n - 1)), max_size=3, unique=True).map(sorted) if n > 1 else st.just([])
    )


@st.composite
def tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], list]:
    shape = tuple(draw(st.lists(st.integers(1, 12), min_size=1, max_size=3)))
    cuts = [[0, *draw(splits(n)), n] for n in shape]
    boxes = []
    for cell in itertools.product(*[list(itertools.pairwise(c)) for c in cuts]):
        boxes.append((tuple(a for a, _ in cell), tuple(b - a for a, b in cell)))
    return shape, boxes


@given(tilings(), st.integers(1, 5), st.booleans(), st.integers(8, 4096))
def test_plan_assigns_every_chunk_to_one_containing_box(
    t: tuple, nranks: int, portable: bool, chunk: int
) -> None:
    shape, boxes = t
    per_rank = [[lt("w", shape, [b for i, b in enumerate(boxes) if i % nranks == r])] for r in range(nranks)]
    (plan,) = plan_global(per_rank, chunk_bytes=chunk, portable=portable)
    specs = list(plan.grid.chunks())
    assert len(plan.writers) == len(specs) == plan.grid.nchunks
    for s in specs:
        rank, idx = plan.writers[s.coords]
        box = per_rank[rank][0].boxes[idx]
        assert intersect(box, (s.offsets, s.sizes)) == (s.offsets, s.sizes)  # inside its box


@given(tilings(), st.lists(st.integers(0, 11), min_size=6, max_size=6))
def test_overlapping_chunks_matches_brute_force(t: tuple, q: list[int]) -> None:
    shape, boxes = t
    grid = grid_for_boxes(boxes, shape, 4, chunk_bytes=64)
    lo = [min(q[d], n - 1) for d, n in enumerate(shape)]
    hi = [min(n, lo[d] + 1 + q[d + 3]) for d, n in enumerate(shape)]
    query = (tuple(lo), tuple(h - a for a, h in zip(lo, hi, strict=True)))
    want = {s.coords for s in grid.chunks() if intersect(query, (s.offsets, s.sizes))}
    assert set(overlapping_chunks(grid, query)) == want


def test_refined_boxes_keep_a_regular_grid_where_possible() -> None:
    """A whole tensor is chunked as gpuckpt.save chunks it; equal boxes by a divisor of their extent."""
    from gpuckpt.planning import plan_regular_grid

    for n in (64, 1000, 50257, 7):
        whole = grid_for_boxes([((0, 0), (n, 10))], (n, 10), 4, chunk_bytes=512)
        assert whole.kind == "regular" and whole == plan_regular_grid((n, 10), 4, 512), n
    # four boxes of 24 rows, 12 rows fit: chunks of 12 rows (a divisor of 24)
    boxes = rows((96, 10), [24, 48, 72])
    g = grid_for_boxes(boxes, (96, 10), 4, chunk_bytes=12 * 40)
    assert g.kind == "regular" and g.chunk_shape == (12, 10)
    # boxes of 23 rows (prime), 12 fit: only 1-row chunks would be regular, so near-equal parts
    boxes = rows((92, 10), [23, 46, 69])
    g = grid_for_boxes(boxes, (92, 10), 4, chunk_bytes=12 * 40)
    assert g.kind == "rectilinear" and max(g.edges[0]) <= 12
