"""chunk_bytes (gpuckpt/format/chunks.py): the stored bytes of a chunk as (buffer, zero tail),
equal to the padded block the per-chunk path writes, for any box, byte order and layout."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gpuckpt.format.chunks import chunk_bytes, is_prefix_box, padded_chunk


@st.composite
def boxes(draw: st.DrawFn) -> tuple[np.ndarray, tuple[int, ...]]:
    ndim = draw(st.integers(0, 3))
    stored = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    sizes = tuple(draw(st.integers(1, s)) for s in stored)
    dtype = np.dtype(draw(st.sampled_from(["<f4", ">f4", "<i2", ">f8", "u1"])))
    base = np.arange(int(np.prod(sizes)) * 2, dtype=dtype)
    box = base[::2].reshape(sizes) if draw(st.booleans()) else base[: int(np.prod(sizes))].reshape(sizes)
    if ndim >= 2 and draw(st.booleans()):
        box = np.swapaxes(np.ascontiguousarray(np.swapaxes(box, 0, 1)), 0, 1)  # a transposed layout
    return box, stored


@given(case=boxes())
def test_chunk_bytes_are_the_padded_block(case: tuple[np.ndarray, tuple[int, ...]]) -> None:
    box, stored = case
    data, pad = chunk_bytes(box, stored)
    assert data.dtype == np.uint8 and data.ndim == 1 and data.flags.c_contiguous
    little = box.astype(box.dtype.newbyteorder("<"))
    assert data.tobytes() + bytes(pad) == padded_chunk(little, stored).tobytes()
    if not is_prefix_box(box.shape, stored):
        assert pad == 0
