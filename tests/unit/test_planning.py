from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from gpuckpt.format.chunks import is_prefix_box
from gpuckpt.format.documents import chunk_file_key
from gpuckpt.planning import ChunkGrid, plan_regular_grid


def coverage(grid: ChunkGrid) -> np.ndarray:
    hits = np.zeros(grid.shape, np.int32)
    for spec in grid.chunks():
        spec.view(hits)[...] += 1
    return hits


@given(
    st.lists(st.integers(0, 40), min_size=0, max_size=4),
    st.sampled_from([1, 2, 4, 8, 16]),
    st.integers(1, 5000),
)
def test_regular_plan_covers_every_element_once(shape: list[int], itemsize: int, target: int) -> None:
    grid = plan_regular_grid(shape, itemsize, target)
    assume(grid.nchunks <= 500)  # keep the coverage walk fast; plans scale the same way
    hits = coverage(grid)
    if math.prod(shape) == 0:
        assert list(grid.chunks()) == []
    else:
        assert (hits == 1).all()
        assert grid.nchunks == len(list(grid.chunks()))
    for spec in grid.chunks():
        stored = grid.stored_chunk_shape(spec)
        # chunks stay near the target unless one element row already exceeds it
        assert math.prod(stored) * itemsize <= max(target, itemsize)
        # every default chunk is one contiguous byte run of a C-ordered tensor
        assert is_prefix_box(spec.sizes, stored)
        sub = np.zeros(shape)[tuple(slice(o, o + s) for o, s in zip(spec.offsets, spec.sizes, strict=True))]
        assert sub.flags.c_contiguous


@given(st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=4), min_size=1, max_size=3))
def test_rectilinear_grid_covers_every_element_once(edges: list[list[int]]) -> None:
    shape = [sum(e) for e in edges]
    grid = ChunkGrid.rectilinear(shape, edges)
    assert (coverage(grid) == 1).all()
    assert grid.nchunks == math.prod(len(e) for e in edges)
    assert ChunkGrid.from_zarr_json(shape, grid.to_zarr_json()) == grid


def test_small_tensor_is_one_chunk_and_large_is_split() -> None:
    assert plan_regular_grid((10, 10), 4, 1 << 20).nchunks == 1
    g = plan_regular_grid((1000, 1024), 4, 1 << 20)
    assert g.chunk_shape == (250, 1024) and g.nchunks == 4
    g = plan_regular_grid((3, 4096, 4096), 4, 1 << 20)
    assert g.chunk_shape == (1, 64, 4096)
    assert plan_regular_grid((), 4, 1).chunk_shape == ()
    assert plan_regular_grid((0, 5), 4, 100).chunk_shape == (1, 5)


def test_regular_grid_pads_edge_chunks() -> None:
    g = ChunkGrid.regular((10,), (4,))
    specs = list(g.chunks())
    assert [s.sizes for s in specs] == [(4,), (4,), (2,)]
    assert g.stored_chunk_shape(specs[-1]) == (4,)
    assert [chunk_file_key(s.coords) for s in specs] == ["c.0", "c.1", "c.2"]


def test_grid_shape_is_arithmetic_for_hostile_sizes() -> None:
    g = ChunkGrid.regular((10**15,), (1,))
    assert g.grid_shape == (10**15,)  # computed, not enumerated


@pytest.mark.parametrize(
    "bad",
    [
        lambda: ChunkGrid.regular((4,), (0,)),
        lambda: ChunkGrid.regular((4, 4), (4,)),
        lambda: ChunkGrid.rectilinear((4,), [(1, 2)]),
        lambda: ChunkGrid((4,), "hexagonal"),
        lambda: plan_regular_grid((4,), 0, 10),
    ],
)
def test_invalid_grids(bad: object) -> None:
    with pytest.raises(ValueError):
        bad()  # type: ignore[operator]


def test_prefix_box() -> None:
    assert is_prefix_box((3, 5), (4, 5))
    assert not is_prefix_box((3, 4), (4, 5))
    assert is_prefix_box((1, 1, 3), (1, 1, 8))
    assert is_prefix_box((), ())


@given(
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=4),
    chunk=st.lists(st.integers(1, 7), min_size=4, max_size=4),
)
def test_chunk_list_equals_chunks(shape, chunk):
    # the one-chunk shortcut of chunk_list gives what the general enumeration gives
    g = ChunkGrid.regular(shape, chunk[: len(shape)])
    assert g.chunk_list() == list(g.chunks())
