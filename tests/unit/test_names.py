from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuckpt.format.names import MAX_NAME_BYTES, decode_name, encode_name, is_safe_name


@pytest.mark.parametrize(
    ("fqn", "name"),
    [
        ("model.layers.0.weight", "model.layers.0.weight"),
        ("", "%"),
        (".", "%2E"),
        ("..", "%2E."),
        ("a/b", "a%2Fb"),
        ("__meta", "%5F_meta"),
        ("100%", "100%25"),
        ("zarr.json", "%7Aarr.json"),
        ("é", "%C3%A9"),
    ],
)
def test_examples(fqn: str, name: str) -> None:
    assert encode_name(fqn) == name
    assert decode_name(name) == fqn
    assert is_safe_name(name)


@given(st.text(max_size=60))
def test_reversible_and_safe(fqn: str) -> None:
    name = encode_name(fqn)
    if "~" not in name:  # names over 200 bytes are shortened and not decodable
        assert decode_name(name) == fqn
    assert is_safe_name(name)
    assert "/" not in name and name not in (".", "..") and not name.startswith(".")
    assert os.path.normpath(os.path.join("root", name)).startswith("root" + os.sep)


@given(st.text(max_size=30), st.text(max_size=30))
def test_injective(a: str, b: str) -> None:
    if a != b:
        assert encode_name(a) != encode_name(b)


def test_long_names_are_shortened_with_a_digest() -> None:
    a, b = "x" * 300 + "1", "x" * 300 + "2"
    na, nb = encode_name(a), encode_name(b)
    assert na != nb and len(na) <= MAX_NAME_BYTES and "~" in na and is_safe_name(na)
    with pytest.raises(ValueError, match="shortened"):
        decode_name(na)
    # an escape sequence is never cut in half
    assert is_safe_name(encode_name("é" * 150))


@pytest.mark.parametrize(
    "bad", ["..", ".", "a/b", "", "../x", "x\x00", "%zz", 5, None, "a" * 300, "_x", "zarr.json"]
)
def test_unsafe_names_rejected(bad: object) -> None:
    assert not is_safe_name(bad)


def _escaped(fqn: str) -> str:
    """The escaping rule written out byte by byte (names up to 200 bytes)."""
    raw = fqn.encode("utf-8", "surrogatepass")
    out = "".join(
        chr(b) if chr(b) in _SAFE_CHARS and (i > 0 or chr(b).isalnum()) else f"%{b:02X}"
        for i, b in enumerate(raw)
    )
    return {"": "%", "zarr.json": "%7Aarr.json"}.get(out, out)


_SAFE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.")


@given(st.text(alphabet=st.characters(max_codepoint=0x17F), max_size=40))
def test_encoding_follows_the_rule(fqn: str) -> None:
    # plain names take a shortcut; every name must still follow the rule
    assert encode_name(fqn) == _escaped(fqn)


@pytest.mark.parametrize(
    "fqn", ["model.layers.0.weight", "a", "A-b_c.d", "x" * 200, "zarr.json", "_x", ".x", "-x"]
)
def test_encoding_of_plain_looking_names(fqn: str) -> None:
    assert encode_name(fqn) == _escaped(fqn)
