"""Array documents are built from parts kept per dtype: the very bytes of json.dumps of the document."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuckpt.format.documents import array_document, expected_array_document
from gpuckpt.format.dtypes import dtype_from_name
from gpuckpt.format.grid import ChunkGrid, plan_regular_grid

DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
]


def _reference(**kw: object) -> bytes:
    return json.dumps(expected_array_document(**kw), separators=(",", ":")).encode()  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 40), max_size=4),
    st.integers(1, 1 << 12),
    st.text(min_size=1, max_size=12),
    st.sampled_from(["contiguous", "channels_last", "channels_last_3d", "preserve", 'weird "format"']),
    st.booleans(),
)
def test_the_document_is_the_json_of_its_object(
    dtype: str, shape: list[int], target: int, fqn: str, memory_format: str, rectilinear: bool
) -> None:
    dt = dtype_from_name(dtype)
    s = tuple(shape)
    grid = plan_regular_grid(s, dt.itemsize, target)
    if rectilinear and s and all(n > 0 for n in s):
        grid = ChunkGrid.rectilinear(s, [[n] if n < 2 else [1, n - 1] for n in s])
    kw = {"shape": s, "dtype": dt, "grid": grid, "fqn": fqn, "memory_format": memory_format}
    out = array_document(**kw)  # type: ignore[arg-type]
    assert out == _reference(**kw)
    assert json.loads(out)["attributes"]["gpuckpt"]["fqn"] == fqn


def test_a_zero_dimensional_document() -> None:
    dt = np.dtype("float32")
    kw = {
        "shape": (),
        "dtype": dt,
        "grid": ChunkGrid.regular((), ()),
        "fqn": "step",
        "memory_format": "contiguous",
    }
    assert array_document(**kw) == _reference(**kw)  # type: ignore[arg-type]
