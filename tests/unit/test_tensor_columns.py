"""Format version 3 (gpuckpt/format/columns.py): tensor entries as columns, exactly
convertible to and from the entries of version 2, and chosen only where it pays."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuckpt
from gpuckpt.errors import MetadataError, UnsupportedVersionError
from gpuckpt.format.columns import COLUMN_NAMES, COLUMNS_KEY, compact, expand
from gpuckpt.format.documents import metadata_json
from gpuckpt.format.reader import metadata_from_json
from gpuckpt.metadata import FORMAT_VERSION, READABLE_VERSIONS
from gpuckpt.saving import commit

_names = st.text(st.characters(codec="utf-8"), max_size=6)
_sizes = st.lists(st.integers(0, 9), max_size=3)
_props = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["float32", "bfloat16", "int8"]),
        "layout": st.just("strided"),
        "memory_format": st.sampled_from(["contiguous_format", "channels_last"]),
        "pin_memory": st.booleans(),
        "requires_grad": st.sampled_from([True, False, 1, 0]),  # 1 is not True in the document
    }
)


@st.composite
def _tensor(draw: st.DrawFn, fqn: str) -> tuple[Any, Any]:
    """The two version 2 entries of a tensor: mostly the usual kind, sometimes another shape
    (listed chunks, segments, another grid, a stray key) that stays out of the columns."""
    size = draw(_sizes)
    shape = draw(st.sampled_from([size, [max(n, 1) for n in size], [1] * len(size)]))
    raw: dict[str, Any] = {"type": "tensor", "properties": draw(_props), "size": size}
    info: dict[str, Any] = {
        "name": draw(st.sampled_from([fqn, fqn + "%", "x"])),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": shape}},
        "rows": draw(st.integers(0, 99)),
    }
    odd = draw(st.sampled_from([None, None, None, "chunks", "segments", "grid", "rows", "extra"]))
    if odd == "chunks":
        raw["chunks"] = [{"offsets": [0] * len(size), "sizes": size}]
        del info["rows"]
    elif odd == "segments":
        info["segments"] = {"n": 1}
    elif odd == "grid":
        info["chunk_grid"]["name"] = "rectilinear"
    elif odd == "rows":
        info["rows"] = True  # a bool is no row: not the usual kind
    elif odd == "extra":
        raw["comment"] = "x"
    return raw, info


@st.composite
def _documents(draw: st.DrawFn) -> dict[str, Any]:
    """Metadata objects shaped as format version 2, labelled version 3 (what to_json_dict makes
    before it puts the tensors in columns)."""
    fqns = draw(st.lists(_names, unique=True, max_size=12))
    entries: dict[str, Any] = {}
    stored: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for fqn in fqns:
        if draw(st.integers(0, 4)) == 0:
            entries[fqn] = {"type": "bytes"}
            objects[fqn] = {"v": 1}
        else:
            entries[fqn], stored[fqn] = draw(_tensor(fqn))
    return {
        "version": "3",
        "state_dict_metadata": dict(sorted(entries.items())),
        "planner_data": {"structure": None},
        "storage_data": {
            "tensors": dict(sorted(stored.items())),
            "objects": objects,
            "chunk_table": {"rows": 1},
        },
        "storage_meta": None,
    }


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(doc=_documents())
def test_expand_undoes_compact(doc: dict[str, Any]) -> None:
    before = copy.deepcopy(doc)
    packed = compact(doc)
    assert doc == before, "compact changed its argument"
    back = expand(json.loads(json.dumps(packed)))  # as stored and read back
    assert back == doc
    assert _canonical(back) == _canonical(doc)  # the same document, byte for byte when encoded
    # and the columns hold exactly the usual tensors
    if COLUMNS_KEY in packed:
        cols = packed[COLUMNS_KEY]
        assert set(cols) == set(COLUMN_NAMES)
        assert cols["fqn"] == sorted(cols["fqn"]) and len(set(cols["fqn"])) == len(cols["fqn"])
        assert not set(cols["fqn"]) & set(packed["state_dict_metadata"])
        assert not set(cols["fqn"]) & set(packed["storage_data"]["tensors"])
        assert len(cols["properties"]) == len({_canonical(p) for p in cols["properties"]})
        for fqn, name in zip(cols["fqn"], cols["name"], strict=True):
            assert name != fqn  # an array name equal to its FQN is not repeated
    else:
        assert packed is doc


def test_the_metadata_of_version_3_round_trips_through_json(tmp_path: Path) -> None:
    state = {f"layer{i:02d}": {"w": np.full((3, 2), i, np.float32), "b": np.arange(i % 4)} for i in range(12)}
    state["step"] = 7  # type: ignore[assignment]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(commit, "TABLE_MIN_CHUNKS", 1)
        m.setattr(commit, "COLUMNS_MIN_TENSORS", 1)
        md = gpuckpt.save(state, tmp_path / "ck", sync="none")
    assert md.version == "3"
    data = metadata_json((tmp_path / "ck" / "zarr.json").read_bytes(), "ck")
    assert data["version"] == "3" and len(data[COLUMNS_KEY]["fqn"]) == 24
    assert set(data["state_dict_metadata"]) == {"step"}  # only the value keeps an entry of its own
    parsed = metadata_from_json(data)
    assert parsed == md
    assert parsed.to_json_dict() == data  # written again, it is the same document
    assert metadata_from_json(parsed.to_json()) == md
    assert parsed.storage_data["tensors"]["layer03.w"] == {
        "name": "layer03.w",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [3, 2]}},
        "rows": parsed.storage_data["tensors"]["layer03.w"]["rows"],
    }
    out = gpuckpt.load_state_dict(tmp_path / "ck")
    assert out["step"] == 7 and np.array_equal(out["layer05"]["w"], state["layer05"]["w"])
    # every tensor is still a Zarr v3 array of its own
    assert np.array_equal(zarr.open_array(tmp_path / "ck" / "layer05.b", mode="r")[...], np.arange(1))


def _many(n: int) -> dict[str, Any]:
    return {f"t{i:05d}": np.full(5, i, np.int32) for i in range(n)}


@pytest.mark.parametrize(
    ("tensors", "chunk_bytes", "version"),
    [
        (20, 1 << 20, "1"),  # few chunks: listed
        (1023, 4, "2"),  # a chunk table (5,115 chunks), below the columns' threshold
        (1024, 4, "3"),  # as many tensors as the threshold: columns
        (1024, 1 << 20, "1"),  # many tensors but few chunks (1,024): listed
    ],
)
def test_a_save_writes_the_oldest_version_that_pays(
    tmp_path: Path, tensors: int, chunk_bytes: int, version: str
) -> None:
    assert commit.COLUMNS_MIN_TENSORS == 1024 and commit.TABLE_MIN_CHUNKS == 4096
    state = _many(tensors)
    md = gpuckpt.save(state, tmp_path / "ck", chunk_bytes=chunk_bytes, sync="none")
    data = metadata_json((tmp_path / "ck" / "zarr.json").read_bytes(), "ck")
    assert md.version == data["version"] == version
    assert (COLUMNS_KEY in data) == (version == "3")
    assert gpuckpt.read_metadata(tmp_path / "ck") == md
    out = gpuckpt.load_state_dict(tmp_path / "ck")
    assert out.keys() == state.keys()
    assert all(np.array_equal(out[k], v) for k, v in state.items())


def test_the_versions_read_and_a_newer_one_refused() -> None:
    assert FORMAT_VERSION == "5" and READABLE_VERSIONS == ("1", "2", "3", "4", "5")
    doc = {"version": "6", "state_dict_metadata": {}, "storage_data": {"tensors": {}, "objects": {}}}
    with pytest.raises(UnsupportedVersionError, match="version 6 is newer"):
        metadata_from_json(doc)


def test_a_tensor_in_the_columns_and_in_an_entry_is_refused() -> None:
    doc = {
        "version": "3",
        "state_dict_metadata": {"a": {"type": "bytes"}},
        "planner_data": {"structure": None},
        "storage_data": {"tensors": {}, "objects": {"a": {"v": 1}}},
        "storage_meta": None,
        COLUMNS_KEY: {
            "fqn": ["a"],
            "name": [None],
            "size": [[2]],
            "properties": [{}],
            "property": [0],
            "chunk_shape": [None],
            "rows": [0],
        },
    }
    with pytest.raises(MetadataError, match="'a', which has an entry of its own too"):
        metadata_from_json(doc)
