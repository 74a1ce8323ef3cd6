from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuckpt
from gpuckpt.format.memory_format import detect_memory_format, physical_order


def fmt(a: np.ndarray) -> object:
    return detect_memory_format(a.shape, a.strides, a.itemsize)


def test_contiguous_and_channels_last() -> None:
    assert fmt(np.zeros((2, 3, 4, 5))) is gpuckpt.contiguous_format
    assert fmt(np.zeros((2, 4, 5, 3)).transpose(0, 3, 1, 2)) is gpuckpt.channels_last
    assert fmt(np.zeros((2, 4, 5, 6, 3)).transpose(0, 4, 1, 2, 3)) is gpuckpt.channels_last_3d


def test_other_layouts_are_preserve_format() -> None:
    assert fmt(np.asfortranarray(np.zeros((3, 4)))) is gpuckpt.preserve_format
    assert fmt(np.zeros((6, 8))[::2, 1:]) is gpuckpt.preserve_format
    assert fmt(np.zeros((2, 4, 5, 3)).transpose(0, 3, 2, 1)) is gpuckpt.preserve_format
    # NHWC strides mean nothing for a 3-D array
    assert fmt(np.zeros((4, 5, 3)).transpose(2, 0, 1)) is gpuckpt.preserve_format


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 1, 4, 5), (3, 4, 1, 1), (0, 3, 2, 2)])
def test_degenerate_shapes_prefer_contiguous(shape: tuple[int, ...]) -> None:
    # when both descriptions fit, C order wins, as in array libraries
    a = np.zeros(shape)
    assert fmt(a) is gpuckpt.contiguous_format


def test_size_one_channel_dims_ignore_stride() -> None:
    a = np.zeros((2, 4, 5, 1)).transpose(0, 3, 1, 2)  # C == 1: also C-contiguous
    assert fmt(a) is gpuckpt.contiguous_format


def test_physical_order() -> None:
    assert physical_order(4, gpuckpt.channels_last) == (0, 2, 3, 1)
    assert physical_order(5, gpuckpt.channels_last_3d) == (0, 2, 3, 4, 1)
    assert physical_order(3, gpuckpt.channels_last) == (0, 1, 2)
    assert physical_order(2, gpuckpt.preserve_format) == (0, 1)


@given(
    shape=st.lists(st.integers(0, 4), min_size=0, max_size=5),
    perm_seed=st.integers(0, 10**6),
    step=st.integers(1, 2),
    flip=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_a_host_arrays_memory_format_is_detect_memory_format_of_its_strides(
    shape: list[int], perm_seed: int, step: int, flip: bool
) -> None:
    """HostArray reads NumPy's C-contiguity flag before walking the strides: the same answer
    as :func:`detect_memory_format` for every view (axes of one element, empty arrays,
    transposes, steps, reversed axes)."""
    from gpuckpt.device.arrays import HostArray

    base = np.zeros([n * step for n in shape], np.float32)
    view = base[tuple(slice(None, None, step) for _ in shape)]
    if flip and view.ndim:
        view = view[::-1]
    order = np.random.default_rng(perm_seed).permutation(view.ndim)
    for a in (view, view.transpose(order), np.ascontiguousarray(view.transpose(order))):
        assert HostArray(a).memory_format is fmt(a)
