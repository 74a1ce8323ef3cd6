"""The fast paths of loads of many small tensors give what the general paths give.

The one reader (:func:`gpuckpt.format.reader.read_index`) parses what many
tensors share (their properties, their regular grids) once; these tests read
the same documents with the general path of before (``metadata_oracle.py``)
and compare the results, for intact documents and for damaged ones (refused
by both, each error naming the tensor). The other fast paths (a tensor's one
whole chunk, the chunk records of a small tensor, arrays allocated by a load,
the root document's checksum) are compared with what the general code makes.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import metadata_oracle
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuckpt
from gpuckpt.errors import MetadataError
from gpuckpt.format import metadata as metadata_module
from gpuckpt.format.chunks import stored_nbytes
from gpuckpt.format.documents import chunk_file_key
from gpuckpt.format.grid import ChunkGrid
from gpuckpt.format.reader import metadata_from_json, read_index
from gpuckpt.loading.checks import ChunkRead, TensorEntry, check_chunk_files
from gpuckpt.loading.open import index_of_root
from gpuckpt.metadata import GridTensorStorageMetadata, Metadata, TensorStorageMetadata
from gpuckpt.saving import commit
from gpuckpt.storage.local import batchio
from gpuckpt.storage.stores import open_reader

REPO = Path(__file__).resolve().parents[2]

_DTYPES = ["float32", "float16", "int64", "uint8", "bool", "bfloat16"]
_FORMATS = ["contiguous_format", "channels_last", "channels_last_3d", "preserve_format"]


@st.composite
def _documents(draw: st.DrawFn) -> dict[str, Any]:
    """A format version 2 metadata document of tensors on regular grids (some sizes and
    properties repeated, so that the shared parsing is exercised)."""
    n = draw(st.integers(1, 8))
    sizes = draw(st.lists(st.lists(st.integers(0, 9), max_size=4), min_size=1, max_size=3))
    entries: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    for i in range(n):
        size = draw(st.sampled_from(sizes))
        chunk = [draw(st.integers(1, max(s, 1))) for s in size]
        entries[f"t{i}"] = {
            "type": "tensor",
            "size": list(size),
            "properties": {
                "dtype": draw(st.sampled_from(_DTYPES)),
                "layout": "strided",
                "requires_grad": draw(st.booleans()),
                "memory_format": draw(st.sampled_from(_FORMATS)),
                "pin_memory": draw(st.booleans()),
            },
        }
        tensors[f"t{i}"] = {
            "name": f"t{i}",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
        }
    return {
        "version": "2",
        "state_dict_metadata": entries,
        "planner_data": {"structure": None},
        "storage_data": {"tensors": tensors, "objects": {}},
        "storage_meta": None,
    }


#: damage to one entry: (where, key, value); every value is one the general path refuses
#: or treats otherwise than the usual entry
_DAMAGE = [
    ("entry", "size", [1.0]),
    ("entry", "size", [True]),
    ("entry", "size", [-1]),
    ("entry", "size", "3"),
    ("entry", "size", [1] * 33),
    ("entry", "type", "tensors"),
    ("entry", "properties", None),
    ("properties", "requires_grad", 1),
    ("properties", "pin_memory", 0),
    ("properties", "layout", "sparse"),
    ("properties", "dtype", "float128"),
    ("properties", "dtype", 5),
    ("properties", "memory_format", "channels_first"),
    ("grid", "name", "rectilinear"),
    ("grid", "name", "irregular"),
    ("grid", "configuration", []),
    ("configuration", "chunk_shape", [0]),
    ("configuration", "chunk_shape", [True]),
    ("configuration", "chunk_shape", [1, 1, 1, 1, 1, 1]),
    ("configuration", "chunk_shape", "1"),
    ("info", "chunk_grid", None),
    ("storage", "t0", None),
]


def _damaged(doc: dict[str, Any], damage: tuple[str, str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    where, key, value = damage
    entry = out["state_dict_metadata"]["t0"]
    info = out["storage_data"]["tensors"]["t0"]
    target = {
        "entry": entry,
        "properties": entry["properties"],
        "grid": info["chunk_grid"],
        "configuration": info["chunk_grid"]["configuration"],
        "info": info,
        "storage": out["storage_data"]["tensors"],
    }[where]
    target[key] = value
    return out


def _with_records(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with the listed chunk records of every tensor whose entries are intact enough
    to have a grid (a checkpoint's document has them; their checksums do not matter here)."""
    out = copy.deepcopy(doc)
    for fqn, info in out["storage_data"]["tensors"].items():
        entry = out["state_dict_metadata"].get(fqn)
        try:
            size = tuple(entry["size"])
            grid = ChunkGrid.from_zarr_json(size, info["chunk_grid"])
            itemsize = np.dtype(metadata_module.dtype_from_name(entry["properties"]["dtype"])).itemsize
        except Exception:
            info["chunks"] = []
            continue
        specs = [] if 0 in size else grid.chunk_list() if grid.nchunks <= 4096 else []
        info["chunks"] = [
            {
                "key": chunk_file_key(sp.coords),
                "nbytes": stored_nbytes(grid.stored_chunk_shape(sp), itemsize),
                "crc32c": 0,
            }
            for sp in specs
        ]
    return out


def _read(doc: dict[str, Any]) -> Metadata | str:
    try:
        return metadata_from_json(copy.deepcopy(doc))
    except MetadataError as exc:
        return f"refused: {exc}"


def _read_general(doc: dict[str, Any]) -> Metadata | str:
    try:
        md = metadata_oracle.metadata_from_json_dict(copy.deepcopy(doc))
        metadata_oracle.validate_metadata(md)
    except MetadataError as exc:
        return f"refused: {exc}"
    return md


def _same(fast: Metadata | str, general: Metadata | str) -> None:
    if isinstance(general, str) or isinstance(fast, str):
        assert isinstance(fast, str) and isinstance(general, str), (fast, general)
        assert "'t0'" in fast, fast  # the damage is t0's: the error names it
        return
    assert fast == general
    assert list(fast.state_dict_metadata) == list(general.state_dict_metadata)
    for fqn, a in fast.state_dict_metadata.items():
        b = general.state_dict_metadata[fqn]
        assert type(a) is type(b)
        assert isinstance(a, GridTensorStorageMetadata) and isinstance(b, GridTensorStorageMetadata)
        assert a.properties == b.properties and a.size == b.size and a._listed == b._listed
        assert a.chunks == b.chunks


@settings(max_examples=150, deadline=None)
@given(doc=_documents(), damage=st.sampled_from([None, *_DAMAGE]))
def test_one_pass_parse_equals_the_general_path(
    doc: dict[str, Any], damage: tuple[str, str, Any] | None
) -> None:
    doc = _with_records(doc)
    if damage is not None:
        doc = _damaged(doc, damage)
    _same(_read(doc), _read_general(doc))


def test_equal_grids_are_one_object_and_properties_are_each_tensors_own() -> None:
    props = {
        "dtype": "float32",
        "layout": "strided",
        "requires_grad": False,
        "memory_format": "contiguous_format",
        "pin_memory": False,
    }
    doc = {
        "version": "2",
        "state_dict_metadata": {
            k: {"type": "tensor", "size": [6, 4], "properties": props} for k in ("a", "b")
        },
        "planner_data": {"structure": None},
        "storage_data": {
            "tensors": {
                k: {"name": k, "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [3, 4]}}}
                for k in ("a", "b")
            },
            "objects": {},
        },
    }
    doc = _with_records(doc)
    index = read_index(doc)
    assert index.tensors["a"].grid is index.tensors["b"].grid  # immutable: parsed once, shared
    md = index.metadata()
    a, b = md.state_dict_metadata["a"], md.state_dict_metadata["b"]
    assert isinstance(a, TensorStorageMetadata) and isinstance(b, TensorStorageMetadata)
    assert a.properties is not b.properties
    a.properties.requires_grad = True  # one entry's properties changed: not the other's
    assert b.properties.requires_grad is False
    assert [c.offsets for c in a.chunks] == [(0, 0), (3, 0)]


def _general_chunks(t: TensorEntry) -> list[ChunkRead]:
    """A tensor's chunk reads as the general path makes them."""
    crcs = t._crcs().tolist()
    out = []
    for spec, crc in zip(t.grid.chunk_list(), crcs, strict=True):
        stored = t.grid.stored_chunk_shape(spec)
        out.append(
            ChunkRead(spec, chunk_file_key(spec.coords), stored_nbytes(stored, t.dtype.itemsize), crc, stored)
        )
    return out


def _check_entries(path: Path) -> None:
    reader = open_reader(path)
    tensors = index_of_root(reader.read_root(), str(path)).tensors
    check_chunk_files(reader, tensors.values())
    for t in tensors.values():
        assert t.nchunks == (0 if 0 in t.shape else t.grid.nchunks)
        assert t.chunks == _general_chunks(t)
        if t.table is not None:
            assert np.array_equal(t.crcs, t.table.read(reader, "crc32c", t.row, t.nchunks))


@pytest.mark.parametrize("table", [False, True])
def test_chunk_reads_and_records_of_small_tensors_equal_the_general_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, table: bool
) -> None:
    if table:
        monkeypatch.setattr(commit, "TABLE_MIN_CHUNKS", 16)  # the records in a chunk table
    rng = np.random.default_rng(4)
    state: dict[str, Any] = {
        f"s{i}": rng.standard_normal(int(rng.integers(1, 50))).astype(np.float32) for i in range(40)
    }
    state["scalar"] = np.array(2.5)
    state["empty"] = np.zeros((0, 3), np.int16)
    state["split"] = rng.standard_normal((64, 8)).astype(np.float32)  # several chunks, one padded
    state["img"] = np.zeros((2, 3, 4, 5), np.float16)
    gpuckpt.save(state, tmp_path / "ck", chunk_bytes=300)
    _check_entries(tmp_path / "ck")
    assert ("_gpuckpt.table.crc32c" in os.listdir(tmp_path / "ck")) is table
    out = gpuckpt.load_state_dict(tmp_path / "ck")
    for k, v in state.items():
        np.testing.assert_array_equal(out[k], v)


@pytest.mark.parametrize("version", ["format-v1", "format-v2", "format-v3"])
def test_chunk_reads_of_the_golden_checkpoints_equal_the_general_ones(tmp_path: Path, version: str) -> None:
    shutil.copytree(REPO / "tests" / "fixtures" / version, tmp_path / "ck")
    _check_entries(tmp_path / "ck")


def test_chunk_table_rows_of_equals_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commit, "TABLE_MIN_CHUNKS", 16)  # a chunk table for a small checkpoint
    state = {f"s{i}": np.full(i % 7 + 1, i, np.int32) for i in range(300)}
    gpuckpt.save(state, tmp_path / "ck", chunk_bytes=8)
    reader = open_reader(tmp_path / "ck")
    tensors = index_of_root(reader.read_root(), "ck").tensors
    table = next(t.table for t in tensors.values() if t.table is not None)
    assert table is not None
    for start, count in [(0, 1), (0, 0), (5, 3), (table.rows - 1, 1), (0, table.rows), (table.rows, 0)]:
        np.testing.assert_array_equal(
            table.rows_of(reader, "crc32c", start, count), table.read(reader, "crc32c", start, count)
        )
    for start, count in [(table.rows, 1), (-1, 1), (table.rows - 1, 2)]:
        with pytest.raises(MetadataError) as general:
            table.read(reader, "crc32c", start, count)
        with pytest.raises(MetadataError) as fast:
            table.rows_of(reader, "crc32c", start, count)
        assert str(fast.value) == str(general.value)


def test_arrays_of_load_state_dict_own_their_memory(tmp_path: Path) -> None:
    """Each array a load allocates is its own: not a view of another array (it can be
    resized, and nothing else keeps its memory alive)."""
    state = {
        "v": np.arange(10, dtype=np.float32),
        "m": np.arange(12, dtype=np.int64).reshape(3, 4),
        "s": np.array(3, np.float32),
        "img": np.ascontiguousarray(np.zeros((2, 4, 5, 3), np.float16)).transpose(0, 3, 1, 2),
    }
    gpuckpt.save(state, tmp_path / "ck")
    out = gpuckpt.load_state_dict(tmp_path / "ck")
    for k in ("v", "m", "s"):
        arr = out[k]
        assert arr.base is None and arr.flags.owndata and arr.flags.writeable and arr.flags.c_contiguous, k
        np.testing.assert_array_equal(arr, state[k])
    out["v"].resize(20, refcheck=False)  # an owner can be resized in place
    assert out["v"].shape == (20,)
    assert out["img"].strides == state["img"].strides  # channels-last: a view of its own block
    np.testing.assert_array_equal(out["img"], state["img"])


@pytest.mark.skipif(not batchio.available(), reason="the native batch library is not built here")
def test_a_load_checks_the_root_document_without_loading_awscrt(tmp_path: Path) -> None:
    """The root document of a load of many small tensors (over awscrt's 256 KiB threshold) is
    checksummed by the native batch library, which the load uses anyway; a damaged one is
    still refused."""
    state = {f"layer{i}.weight": np.full(4, i, np.float32) for i in range(3000)}
    gpuckpt.save(state, tmp_path / "ck")
    assert (tmp_path / "ck" / "zarr.json").stat().st_size > 256 << 10
    code = (
        "import sys, gpuckpt\n"
        f"sd = gpuckpt.load_state_dict({str(tmp_path / 'ck')!r})\n"
        "assert float(sd['layer2999.weight'][0]) == 2999.0\n"
        "print('awscrt' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("GPUCKPT_CRC32C", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    root = tmp_path / "ck" / "zarr.json"
    raw = bytearray(root.read_bytes())
    at = raw.index(b'"layer1500.weight"')
    raw[at + 1 : at + 2] = b"L"  # same length, different bytes: the stored checksum no longer matches
    root.write_bytes(bytes(raw))
    with pytest.raises(MetadataError, match="checksum mismatch"):
        gpuckpt.load_state_dict(tmp_path / "ck")


@pytest.mark.skipif(not batchio.available(), reason="the native batch library is not built here")
def test_batch_paths_of_any_encoding_reach_their_files(tmp_path: Path) -> None:
    """Paths are encoded for the native library at once; names whose encoded length differs
    from their length in characters (non-ASCII, undecodable bytes) still name their files."""
    lib = batchio.instance()
    assert lib is not None
    names = ["plain", "caf\u00e9", os.fsdecode(b"raw\xff"), "x" * 40, "\u00e9t\u00e9"]
    for i, name in enumerate(names):
        (tmp_path / os.fsencode(name).decode("utf-8", "surrogateescape")).write_bytes(b"z" * (i + 1))
    sizes, stops = lib.sizes(str(tmp_path), names)
    assert not stops
    assert sizes.tolist() == [1, 2, 3, 4, 5]
