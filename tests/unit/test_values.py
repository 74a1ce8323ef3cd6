from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuckpt.errors import MetadataError, UnsafeCheckpointError, UnsupportedValueError
from gpuckpt.format.values import decode_object, encode_object

plain = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(), st.binary(),
        st.complex_numbers(allow_nan=False),
    ),
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), kids, max_size=4),
    ),
    max_leaves=20,
)  # fmt: skip


@given(plain)
def test_round_trip_keeps_types(value: object) -> None:
    enc = encode_object(value)
    back = decode_object(json.loads(json.dumps(enc)))
    assert back == value
    assert type(back) is type(value)


def test_special_floats_and_big_ints() -> None:
    v = [float("inf"), -0.0, 2**200, float("nan")]
    back = decode_object(json.loads(json.dumps(encode_object(v))))
    assert (
        back[0] == math.inf and math.copysign(1, back[1]) == -1 and back[2] == 2**200 and math.isnan(back[3])
    )


@pytest.mark.parametrize(
    "x", [np.float32(1.5), np.int64(-3), np.bool_(True), ml_dtypes.bfloat16(2.5), np.complex64(1j)]
)
def test_numpy_scalars(x: object) -> None:
    back = decode_object(encode_object(x))
    assert type(back) is type(x) and back == x


class Custom:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Custom)


def test_other_types_need_pickle_opt_in_both_ways() -> None:
    with pytest.raises(UnsupportedValueError, match="allow_pickle=True"):
        encode_object({"x": Custom()}, fqn="cfg")
    enc = encode_object({"x": Custom()}, allow_pickle=True)
    with pytest.raises(UnsafeCheckpointError, match="arbitrary code"):
        decode_object(enc, fqn="cfg")
    assert decode_object(enc, allow_pickle=True) == {"x": Custom()}


@pytest.mark.parametrize(
    "bad",
    [
        {"int": 5}, {"float": "zz"}, {"bytes": "!!"}, {"list": {}}, {"dict": [[{"list": []}, {"none": None}]]},
        {"numpy": {"dtype": "float32", "hex": "00"}}, {"numpy": {"dtype": "object", "hex": ""}}, {"what": 1},
        {"str": "a", "int": "1"}, [], {"dict": [[1]]},
    ],
)  # fmt: skip
def test_malformed_values(bad: object) -> None:
    with pytest.raises(MetadataError):
        decode_object(bad, fqn="v")


def test_deep_nesting_is_refused() -> None:
    node: dict = {"none": None}
    for _ in range(500):
        node = {"list": [node]}
    with pytest.raises(MetadataError, match="deeper"):
        decode_object(node)
