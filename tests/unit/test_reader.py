"""The one reader of a root document (gpuckpt/format/reader.py) against the general path of before.

The general path parsed a root document's metadata entry by entry and then
cross-checked it with the storage entries; it survives as the test oracle
``metadata_oracle.py``. The reader must accept exactly the documents the
general path accepts and refuse the others (a :class:`MetadataError`), and give
the same metadata, tensors and objects. These tests hold it to that on real
checkpoints written by :func:`gpuckpt.save` (every format version), on those
documents damaged in known ways, and on random mutations of them
(Hypothesis), and check that loads through the public API give back the
saved arrays bit for bit.
"""

from __future__ import annotations

import copy
import pickle
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import metadata_oracle
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuckpt
from gpuckpt.device import _kernel_ref
from gpuckpt.errors import MetadataError
from gpuckpt.format.columns import COLUMNS_KEY, compact, expand
from gpuckpt.format.documents import metadata_json
from gpuckpt.format.entries import ChunkRead, TensorEntry
from gpuckpt.format.reader import read_index
from gpuckpt.format.records import TABLE_MIN_CHUNKS
from gpuckpt.loading.checks import load_chunk_records
from gpuckpt.loading.open import index_of_root
from gpuckpt.metadata import Metadata
from gpuckpt.saving import commit
from gpuckpt.storage.base import CheckpointReader
from gpuckpt.storage.stores import open_reader

REPO = Path(__file__).resolve().parents[2]

Result = tuple[Metadata, dict[str, TensorEntry], dict[str, Any]]

#: chunk tables from this many chunks on, so that small checkpoints keep their records in one
#: (gpuckpt does that from commit.TABLE_MIN_CHUNKS chunks on: the index handles only those)
_TABLE_FROM = 4


def _small_state() -> dict[str, Any]:
    """Many small tensors, each stored whole, values and nesting."""
    rng = np.random.default_rng(21)
    dtypes = [np.float32, np.float16, np.int8, np.uint64, np.bool_, np.int64, ml_dtypes.bfloat16]
    layers: dict[str, Any] = {}
    for i in range(24):
        dt = np.dtype(dtypes[i % len(dtypes)])
        shape = [(3,), (2, 5), (4, 1, 2), (7,)][i % 4]
        layers[f"l{i}"] = {"w": rng.standard_normal(shape).astype(np.float64).astype(dt)}
    return {
        "model": {"layers": layers, "norm": np.ones(8, np.float32), "unused": np.zeros((4, 0), np.float32)},
        "step": 1234,
        "name": "run-21",
        "schedule": [1, "warmup", 2.5, [3, 4]],
        "flags": {"ema": True, "none": None},
    }


def _mixed_state() -> dict[str, Any]:
    """Tensors split into several chunks (``chunk_bytes`` 64), 0-d and empty tensors, every
    kind of dtype, a channels-last 4-d array, values."""
    rng = np.random.default_rng(7)
    bf16 = rng.standard_normal((9, 7)).astype(ml_dtypes.bfloat16)
    bf16[0, 0] = np.nan  # bit patterns survive
    return {
        "split": rng.standard_normal((13, 5)).astype(np.float32),  # last chunk padded
        "split_u64": np.arange(40, dtype=np.uint64).reshape(8, 5) * np.uint64(2**61),
        "bf16": bf16,
        "f16": rng.standard_normal(100).astype(np.float16),
        "mask": rng.random((6, 11)) > 0.5,
        "i8": rng.integers(-128, 128, (3, 4, 5), dtype=np.int8),
        "scalar": np.array(2.5),
        "scalar_bool": np.array(True),
        "empty": np.zeros((0, 3), np.int16),
        "empty_1d": np.zeros(0, np.float32),
        "img": _kernel_ref.as_channels_last(rng.standard_normal((2, 3, 4, 5)).astype(np.float16)),
        "opt": {"state": {"0": {"exp_avg": rng.standard_normal(30).astype(np.float32), "step": 3}}},
        "odd/key é": np.arange(5, dtype=np.int32),  # its array name is not its FQN
        "epoch": 4,
        "tag": "x",
        "milestones": [10, 20, "end"],
    }


@dataclass(repr=False)
class _Checkpoint:
    path: Path
    state: dict[str, Any] | None
    data: Any  # the JSON value of the root document's metadata
    root: bytes

    def __repr__(self) -> str:
        return f"<checkpoint {self.path.name}>"


def _checkpoint(path: Path, state: dict[str, Any] | None) -> _Checkpoint:
    root = bytes(open_reader(path).read_root())
    return _Checkpoint(path, state, metadata_json(root, str(path)), root)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, _Checkpoint]:
    base = tmp_path_factory.mktemp("load_index")
    out: dict[str, _Checkpoint] = {}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(commit, "TABLE_MIN_CHUNKS", _TABLE_FROM)  # the records in a chunk table
        for name, state, chunk_bytes in [
            ("small", _small_state(), 1 << 20),
            ("mixed", _mixed_state(), 64),
        ]:
            gpuckpt.save(state, base / name, chunk_bytes=chunk_bytes, sync="none")
            out[name] = _checkpoint(base / name, state)
        # format version 3: the same with the tensor entries in columns (gpuckpt writes them so
        # from commit.COLUMNS_MIN_TENSORS tensors on)
        m.setattr(commit, "COLUMNS_MIN_TENSORS", 1)
        for name, state, chunk_bytes in [
            ("small3", _small_state(), 1 << 20),
            ("mixed3", _mixed_state(), 64),
        ]:
            gpuckpt.save(state, base / name, chunk_bytes=chunk_bytes, sync="none")
            out[name] = _checkpoint(base / name, state)
            assert out[name].data["version"] == "3" and COLUMNS_KEY in out[name].data
    # as gpuckpt writes it without any patching: a chunk table from 4096 chunks on
    assert TABLE_MIN_CHUNKS < 4200
    big = {
        "w": np.arange(4200, dtype=np.int64),
        "b": np.ones(3, np.float32),
        "e": np.ones((0, 2)),
        "one": np.ones(1, np.int8),
        "step": 9,
    }
    gpuckpt.save(big, base / "default", chunk_bytes=8, sync="none")
    out["default"] = _checkpoint(base / "default", big)
    # the golden format version 2 checkpoint of the repository
    shutil.copytree(REPO / "tests" / "fixtures" / "format-v2", base / "golden")
    out["golden"] = _checkpoint(base / "golden", None)
    shutil.copytree(REPO / "tests" / "fixtures" / "format-v3", base / "golden3")
    out["golden3"] = _checkpoint(base / "golden3", None)
    # without a chunk table (a small checkpoint as saved by default): left to the general path
    gpuckpt.save(_mixed_state(), base / "listed", chunk_bytes=64, sync="none")
    out["listed"] = _checkpoint(base / "listed", None)
    return out


#: the checkpoints of every kind (chunk tables, columns, listed records)
_TABLED = ["small", "mixed", "default", "golden", "small3", "mixed3", "golden3", "listed"]


def _general(data: Any) -> Result:
    md = metadata_oracle.metadata_from_json_dict(copy.deepcopy(data))
    tensors, objects = metadata_oracle.validate_metadata(md)
    return md, tensors, objects


def _indexed(data: Any) -> Result:
    """The one reader's view of a copy of ``data``, checking that it leaves its argument unchanged."""
    mine = copy.deepcopy(data)
    try:
        index = read_index(mine)
    finally:
        assert mine == data, "the reader changed the document it was given"
    return index.metadata(), index.tensors, index.objects


def _chunk_fields(c: ChunkRead) -> tuple[Any, ...]:
    assert type(c) is ChunkRead and type(c.crc) is int and type(c.nbytes) is int
    return (c.spec, c.key, c.nbytes, c.crc, c.stored)


def _records(reader: CheckpointReader, tensors: dict[str, TensorEntry]) -> str | None:
    """Read the chunk records of ``tensors``; the error, as text, where that fails."""
    try:
        load_chunk_records(reader, tensors.values())
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _assert_same(indexed: Result, general: Result, reader: CheckpointReader | None) -> None:
    """``indexed`` (from the reader) is what the general path made: ``general``."""
    md, tensors, objects = indexed
    gmd, gtensors, gobjects = general
    assert type(md) is Metadata and type(gmd) is Metadata
    assert list(tensors) == list(gtensors)
    assert objects == gobjects and list(objects) == list(gobjects)
    for fqn, g in gtensors.items():
        t = tensors[fqn]
        assert type(t) is TensorEntry
        # before anything is made on demand
        assert t.memory_format is g.memory_format, fqn
        # records listed in the document, or read later from the table
        assert (t.crcs is None) == (g.crcs is None), fqn
        assert t.crcs is None or np.array_equal(t.crcs, g.crcs), fqn
        assert (t.fqn, t.name, t.shape, t.dtype, t.nbytes, t.nchunks, t.row, t.whole) == (
            g.fqn,
            g.name,
            g.shape,
            g.dtype,
            g.nbytes,
            g.nchunks,
            g.row,
            g.whole,
        ), fqn
        assert type(t.shape) is tuple and all(type(n) is int for n in t.shape), fqn
        assert type(t.nbytes) is int and type(t.nchunks) is int and type(t.row) is int, fqn
        assert t.table == g.table, fqn
        assert (t.listed is None) == (g.listed is None), fqn
        assert t.listed is None or {k: v.tolist() for k, v in t.listed.items()} == {
            k: v.tolist() for k, v in g.listed.items()
        }, fqn
        assert t.segments == g.segments, fqn
        assert t.grid == g.grid, fqn
        assert t.metadata == g.metadata and g.metadata == t.metadata, fqn
    # the metadata as a whole (its entries made on demand from the tensors')
    assert md == gmd and gmd == md
    assert (md != gmd) is False and (gmd != md) is False
    assert list(md.state_dict_metadata) == list(gmd.state_dict_metadata)
    for fqn, t in tensors.items():
        assert md.state_dict_metadata[fqn] is t.metadata, fqn
    assert (md.planner_data, md.storage_data, md.storage_meta, md.version) == (
        gmd.planner_data,
        gmd.storage_data,
        gmd.storage_meta,
        gmd.version,
    )
    back = pickle.loads(pickle.dumps(md))
    assert type(back) is Metadata
    assert back == gmd and gmd == back
    assert list(back.state_dict_metadata) == list(gmd.state_dict_metadata)
    if reader is None:
        return
    failed = _records(reader, gtensors)
    assert _records(reader, tensors) == failed
    if failed is not None:
        return
    for fqn, g in gtensors.items():
        t = tensors[fqn]
        assert t.crcs is not None and g.crcs is not None
        assert t.crcs.dtype == g.crcs.dtype and np.array_equal(t.crcs, g.crcs), fqn
        gchunks = [_chunk_fields(c) for c in g.chunks]
        # one chunk at a time (before the list is made), then the list
        assert [_chunk_fields(t.chunk(c[0].coords)) for c in gchunks] == gchunks, fqn
        assert [_chunk_fields(c) for c in t.chunks] == gchunks, fqn


def _check_contract(data: Any, reader: CheckpointReader | None) -> Result | None:
    """What the contract asks of the reader for the document ``data``; its result (None: refused)."""
    try:
        general: Result | None = _general(data)
    except MetadataError:
        general = None
    try:
        indexed: Result | None = _indexed(data)
    except MetadataError:
        indexed = None
    if general is None:
        assert indexed is None, "the reader took a document the general path refuses"
    else:
        assert indexed is not None, "the reader refused a document the general path takes"
        _assert_same(indexed, general, reader)
    return indexed


# --- the documents gpuckpt writes ------------------------------------------------------------


@pytest.mark.parametrize("name", _TABLED)
def test_the_reader_takes_the_documents_gpuckpt_writes_and_equals_the_general_path(
    checkpoints: dict[str, _Checkpoint], name: str
) -> None:
    ck = checkpoints[name]
    _assert_same(_indexed(ck.data), _general(ck.data), open_reader(ck.path))


def test_the_documents_cover_what_the_index_handles(checkpoints: dict[str, _Checkpoint]) -> None:
    """The checkpoints above hold the kinds of tensors they are meant to: whole and split
    tensors, 0-d and empty ones, the dtypes, channels-last, values."""
    indexed = _indexed(checkpoints["mixed"].data)
    assert indexed is not None
    _md, tensors, objects = indexed
    assert tensors["split"].nchunks > 1 and not tensors["split"].whole
    assert tensors["split"].grid.chunk_shape[0] * tensors["split"].grid.grid_shape[0] > 13  # padded
    assert tensors["scalar"].shape == () and tensors["scalar"].whole
    assert tensors["empty"].nchunks == 0 and tensors["empty_1d"].nchunks == 0
    assert {str(t.dtype) for t in tensors.values()} >= {"bfloat16", "bool", "int8", "float16", "uint64"}
    assert tensors["img"].memory_format is gpuckpt.channels_last
    assert {"epoch", "tag", "milestones", "opt.state.0.step"} <= set(objects)
    small = _indexed(checkpoints["small"].data)
    assert small is not None
    assert sum(t.whole for t in small[1].values()) == len(small[1]) - 1 >= 25  # and one empty
    assert tensors["odd/key é"].name != "odd/key é"
    # format version 3: the tensors in columns, of every kind above
    cols = checkpoints["mixed3"].data[COLUMNS_KEY]
    assert set(cols["fqn"]) == set(tensors) and len(cols["properties"]) >= 5
    assert any(n is not None for n in cols["name"]) and any(n is None for n in cols["name"])
    assert any(c is not None for c in cols["chunk_shape"]) and any(c is None for c in cols["chunk_shape"])


def test_a_checkpoint_without_a_chunk_table_has_its_records_listed(
    checkpoints: dict[str, _Checkpoint],
) -> None:
    """Records listed per chunk (a checkpoint of at most TABLE_MIN_CHUNKS chunks): read with the
    document, no table."""
    ck = checkpoints["listed"]
    assert "chunk_table" not in ck.data["storage_data"]
    _md, tensors, _objects = _indexed(ck.data)
    assert tensors["split"].crcs is not None and tensors["split"].table is None


def test_a_document_of_values_only(tmp_path: Path) -> None:
    """gpuckpt writes a checkpoint of values only in format version 1; the same document as
    version 2 has no chunk table; the reader takes both."""
    gpuckpt.save({"step": 3, "name": "x", "sched": [1, 2]}, tmp_path / "ck", sync="none")
    ck = _checkpoint(tmp_path / "ck", None)
    reader = open_reader(ck.path)
    assert ck.data["version"] == "1"
    one = _check_contract(ck.data, reader)
    assert one is not None and one[1] == {}
    doc = copy.deepcopy(ck.data)
    doc["version"] = "2"
    indexed = _check_contract(doc, reader)
    assert indexed is not None and indexed[1] == {} and indexed[2] == _general(doc)[2]


# --- damaged documents --------------------------------------------------------------------------


def _tensor_names(doc: dict[str, Any]) -> list[str]:
    return [f for f, e in doc["state_dict_metadata"].items() if e.get("type") == "tensor"]


def _value_names(doc: dict[str, Any]) -> list[str]:
    return [f for f, e in doc["state_dict_metadata"].items() if e.get("type") == "bytes"]


def _splits(doc: dict[str, Any]) -> Iterator[str]:
    """The tensors of ``doc`` stored in several chunks."""
    for f in _tensor_names(doc):
        size = doc["state_dict_metadata"][f]["size"]
        shape = doc["storage_data"]["tensors"][f]["chunk_grid"]["configuration"]["chunk_shape"]
        if size != shape and 0 not in size:
            yield f


def _split(doc: dict[str, Any]) -> str:
    """A tensor of ``doc`` stored in several chunks."""
    return next(_splits(doc))


def _info(doc: dict[str, Any], fqn: str) -> dict[str, Any]:
    info: dict[str, Any] = doc["storage_data"]["tensors"][fqn]
    return info


def _props(doc: dict[str, Any], fqn: str) -> dict[str, Any]:
    props: dict[str, Any] = doc["state_dict_metadata"][fqn]["properties"]
    return props


def _rename(target: str) -> Callable[[dict[str, Any]], None]:
    def damage(doc: dict[str, Any]) -> None:
        a, b = _tensor_names(doc)[:2]
        _info(doc, b)["name"] = _info(doc, a)["name"] if target == "duplicate" else target

    return damage


def _rows_overlap(doc: dict[str, Any]) -> None:
    f = _split(doc)
    _info(doc, f)["rows"] += 1


def _rows_gap(doc: dict[str, Any]) -> None:
    f = _split(doc)
    # a gap before it and a row past the end of the table: each row must be one chunk's
    _info(doc, f)["rows"] = doc["storage_data"]["chunk_table"]["rows"] - 1


def _rows_swapped(doc: dict[str, Any]) -> None:
    big = _split(doc)
    other = next(f for f in _tensor_names(doc) if f != big and 0 not in doc["state_dict_metadata"][f]["size"])
    a, b = _info(doc, big), _info(doc, other)
    a["rows"], b["rows"] = b["rows"], a["rows"]


def _table_rows(delta: int) -> Callable[[dict[str, Any]], None]:
    def damage(doc: dict[str, Any]) -> None:
        table = doc["storage_data"]["chunk_table"]
        if table["rows_per_chunk"] == table["rows"]:
            table["rows_per_chunk"] += delta  # the table itself stays well-formed
        table["rows"] += delta

    return damage


def _swap_size_and_chunk_shape(doc: dict[str, Any]) -> None:
    f = _split(doc)
    conf = _info(doc, f)["chunk_grid"]["configuration"]
    entry = doc["state_dict_metadata"][f]
    entry["size"], conf["chunk_shape"] = conf["chunk_shape"], entry["size"]


def _whole(doc: dict[str, Any]) -> str:
    """A tensor of ``doc`` stored whole, with at least one axis and no empty one."""
    for f in _tensor_names(doc):
        size = doc["state_dict_metadata"][f]["size"]
        if size == _info(doc, f)["chunk_grid"]["configuration"]["chunk_shape"] and size and 0 not in size:
            return f
    raise AssertionError("no tensor stored whole")


def _empty(doc: dict[str, Any]) -> str:
    return next(f for f in _tensor_names(doc) if 0 in doc["state_dict_metadata"][f]["size"])


def _chunk_larger_than_size(pick: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], None]:
    def damage(doc: dict[str, Any]) -> None:
        f = pick(doc)
        size = doc["state_dict_metadata"][f]["size"]
        _info(doc, f)["chunk_grid"]["configuration"]["chunk_shape"] = [n + 1 for n in size]

    return damage


def _size_of_whole(size: list[int]) -> Callable[[dict[str, Any]], None]:
    """A tensor stored whole claims ``size`` (its chunk shape too): one chunk still."""

    def damage(doc: dict[str, Any]) -> None:
        f = _whole(doc)
        doc["state_dict_metadata"][f]["size"] = list(size)
        _info(doc, f)["chunk_grid"]["configuration"]["chunk_shape"] = list(size)

    return damage


def _empty_rows(value: Any) -> Callable[[dict[str, Any]], None]:
    def damage(doc: dict[str, Any]) -> None:
        f = _empty(doc)
        _info(doc, f)["rows"] = doc["storage_data"]["chunk_table"]["rows"] + 1 if value == "past" else value

    return damage


def _set(where: Callable[[dict[str, Any]], dict[str, Any]], key: str, value: Any) -> Callable[[Any], None]:
    def damage(doc: dict[str, Any]) -> None:
        where(doc)[key] = value

    return damage


def _first_tensor(part: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def where(doc: dict[str, Any]) -> dict[str, Any]:
        f = _tensor_names(doc)[0]
        if part == "entry":
            out: dict[str, Any] = doc["state_dict_metadata"][f]
        elif part == "properties":
            out = _props(doc, f)
        else:
            out = _info(doc, f)
        return out

    return where


def _root(doc: dict[str, Any]) -> dict[str, Any]:
    return doc


def _table(doc: dict[str, Any]) -> dict[str, Any]:
    table: dict[str, Any] = doc["storage_data"]["chunk_table"]
    return table


def _drop_value(doc: dict[str, Any]) -> None:
    del doc["storage_data"]["objects"][_value_names(doc)[0]]


def _drop_storage_entry(doc: dict[str, Any]) -> None:
    del doc["storage_data"]["tensors"][_tensor_names(doc)[0]]


def _tensor_as_value(doc: dict[str, Any]) -> None:
    doc["state_dict_metadata"][_tensor_names(doc)[0]] = {"type": "bytes"}


#: damage the general path refuses (a MetadataError): the index must refuse it too
_DEFECTS: dict[str, Callable[[dict[str, Any]], None]] = {
    "name duplicate": _rename("duplicate"),
    "name zarr.json": _rename("zarr.json"),
    "name ../x": _rename("../x"),
    "name a/b": _rename("a/b"),
    "name empty": _rename(""),
    "name dot": _rename("."),
    "name too long": _rename("x" * 1000),
    "name of the chunk table's array": _rename("_gpuckpt.table.crc32c"),
    "name not a string": _set(_first_tensor("info"), "name", 5),
    "rows overlap": _rows_overlap,
    "rows gap": _rows_gap,
    "rows swapped": _rows_swapped,
    "rows negative": _set(_first_tensor("info"), "rows", -1),
    "rows huge": _set(_first_tensor("info"), "rows", 2**70),
    "rows a string": _set(_first_tensor("info"), "rows", "0"),
    "rows a bool": _set(_first_tensor("info"), "rows", False),
    "rows a float": _set(_first_tensor("info"), "rows", 0.0),
    "table one row more": _table_rows(1),
    "table one row less": _table_rows(-1),
    "table rows a string": _set(_table, "rows", "17"),
    "no table": lambda doc: doc["storage_data"].pop("chunk_table"),
    "size and chunk shape swapped": _swap_size_and_chunk_shape,
    "chunk shape larger than size": _chunk_larger_than_size(_split),
    "chunk shape larger than size, stored whole": _chunk_larger_than_size(_whole),
    "size too large, stored whole": _size_of_whole([2**61, 2]),
    "size too large for the dtype, stored whole": _size_of_whole([2**31, 2**31]),
    "size too long an axis, stored whole": _size_of_whole([2**62]),
    "empty tensor rows negative": _empty_rows(-1),
    "empty tensor rows past the table": _empty_rows("past"),
    "empty tensor rows a bool": _empty_rows(True),
    "empty tensor rows a float": _empty_rows(0.0),
    "empty tensor rows null": _empty_rows(None),
    "requires_grad 1": _set(_first_tensor("properties"), "requires_grad", 1),
    "requires_grad 0": _set(_first_tensor("properties"), "requires_grad", 0),
    "pin_memory 0": _set(_first_tensor("properties"), "pin_memory", 0),
    "dtype unknown": _set(_first_tensor("properties"), "dtype", "float128"),
    "dtype numpy string": _set(_first_tensor("properties"), "dtype", "<f4"),
    "memory format unknown": _set(_first_tensor("properties"), "memory_format", "channels_first"),
    "layout sparse": _set(_first_tensor("properties"), "layout", "sparse_coo"),
    "size huge": _set(_first_tensor("entry"), "size", [2**62]),
    "size too large for the dtype": _set(_first_tensor("entry"), "size", [2**40, 2**40]),
    "size negative": _set(_first_tensor("entry"), "size", [-1]),
    "type unknown": _set(_first_tensor("entry"), "type", "array"),
    "version 1 without chunk lists": _set(_root, "version", "1"),
    "version 6": _set(_root, "version", "6"),
    "version an int": _set(_root, "version", 2),
    "no planner structure": _set(_root, "planner_data", {}),
    "storage_meta a list": _set(_root, "storage_meta", []),
    "objects a list": lambda doc: doc["storage_data"].update(objects=[]),
    "value not stored": _drop_value,
    "tensor not stored": _drop_storage_entry,
    "tensor as a value": _tensor_as_value,
}


#: the defects made on a tensor stored in several chunks ("small" has none)
_NEEDS_SPLIT = {
    "rows overlap",
    "rows gap",
    "rows swapped",
    "size and chunk shape swapped",
    "chunk shape larger than size",
}


def _damaged(data: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """A copy of ``data`` changed by ``change``, which works on documents shaped as format
    version 2: a version 3 document is expanded, changed, and its tensors put back in columns
    (those the change left in the columns' shape)."""
    if data.get("version") != "3":
        doc = copy.deepcopy(data)
        change(doc)
        return doc
    doc = expand(copy.deepcopy(data))
    change(doc)
    return compact(doc) if doc.get("version") == "3" else doc


@pytest.mark.parametrize(
    ("name", "defect"),
    [
        (n, d)
        for n in ("small", "mixed", "default", "small3", "mixed3")
        for d in sorted(_DEFECTS)
        if n not in ("small", "small3") or d not in _NEEDS_SPLIT
    ],
)
def test_damage_the_general_path_refuses_is_refused_by_the_reader(
    checkpoints: dict[str, _Checkpoint], name: str, defect: str
) -> None:
    doc = _damaged(checkpoints[name].data, _DEFECTS[defect])
    with pytest.raises(MetadataError):
        _general(doc)
    with pytest.raises(MetadataError):
        _indexed(doc)


def _cols(doc: dict[str, Any]) -> dict[str, Any]:
    cols: dict[str, Any] = doc[COLUMNS_KEY]
    return cols


def _column_item(column: str, i: int, value: Any) -> Callable[[dict[str, Any]], None]:
    def damage(doc: dict[str, Any]) -> None:
        _cols(doc)[column][i] = value(doc) if callable(value) else value

    return damage


def _swap_first_fqns(doc: dict[str, Any]) -> None:
    fqns = _cols(doc)["fqn"]
    fqns[0], fqns[1] = fqns[1], fqns[0]


def _column_split(doc: dict[str, Any]) -> int:
    """The place in the columns of a tensor stored in several chunks."""
    cols = _cols(doc)
    for i, shape in enumerate(cols["chunk_shape"]):
        if shape is not None and 0 not in cols["size"][i]:
            return i
    raise AssertionError("no split tensor in the columns")


def _column_rows_overlap(doc: dict[str, Any]) -> None:
    _cols(doc)["rows"][_column_split(doc)] += 1


def _also_entry(part: str) -> Callable[[dict[str, Any]], None]:
    def damage(doc: dict[str, Any]) -> None:
        fqn = _cols(doc)["fqn"][0]
        if part == "value":
            doc["state_dict_metadata"][fqn] = {"type": "bytes"}
            doc["storage_data"]["objects"][fqn] = {"v": 1}
        else:
            doc["storage_data"]["tensors"][fqn] = {
                "name": fqn + "x",
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": _cols(doc)["size"][0]}},
                "rows": _cols(doc)["rows"][0],
            }

    return damage


#: damage of the columns themselves (format version 3): both paths refuse it
_COLUMN_DEFECTS: dict[str, Callable[[dict[str, Any]], None]] = {
    "columns a list": _set(_root, COLUMNS_KEY, []),
    "columns null": _set(_root, COLUMNS_KEY, None),
    "columns without rows": lambda doc: _cols(doc).pop("rows"),
    "columns with a list more": _set(_cols, "extra", []),
    "a column an object": _set(_cols, "size", {}),
    "a column one item short": lambda doc: _cols(doc)["size"].pop(),
    "a column one item long": lambda doc: _cols(doc)["rows"].append(0),
    "fqns out of order": _swap_first_fqns,
    "an fqn twice": _column_item("fqn", 1, lambda doc: _cols(doc)["fqn"][0]),
    "an fqn a number": _column_item("fqn", 0, 5),
    "an fqn also a value": _also_entry("value"),
    "an fqn also a storage entry": _also_entry("storage"),
    "a name a number": _column_item("name", 0, 5),
    "a name a list": _column_item("name", 0, ["x"]),
    "a name unsafe": _column_item("name", 0, "../x"),
    "a name another tensor's": _column_item("name", 1, lambda doc: _cols(doc)["fqn"][0]),
    "a property index out of range": _column_item("property", 0, lambda doc: len(_cols(doc)["properties"])),
    "a property index negative": _column_item("property", 0, -1),
    "a property index a bool": _column_item("property", 0, False),
    "a property index a float": _column_item("property", 0, 0.0),
    "properties not objects": lambda doc: _cols(doc)["properties"].__setitem__(0, []),
    "properties empty": lambda doc: _cols(doc)["properties"].clear(),
    "a size a number": _column_item("size", 0, 3),
    "a size null": _column_item("size", 0, None),
    "a size negative": _column_item("size", 0, [-1]),
    "a size huge": _column_item("size", 0, [2**62]),
    "a chunk shape a number": _column_item("chunk_shape", 0, 3),
    "a chunk shape of zeros": _column_item("chunk_shape", 0, lambda doc: [0] * len(_cols(doc)["size"][0])),
    "a chunk shape with an axis more": _column_item(
        "chunk_shape", 0, lambda doc: [*_cols(doc)["size"][0], 1]
    ),
    "rows a string": _column_item("rows", 0, "0"),
    "rows null": _column_item("rows", 0, None),
    "rows negative": _column_item("rows", 0, -1),
    "rows overlap": _column_rows_overlap,
}


@pytest.mark.parametrize(
    ("name", "defect"),
    [
        (n, d)
        for n in ("small3", "mixed3")
        for d in sorted(_COLUMN_DEFECTS)
        if (n, d) != ("small3", "rows overlap")
    ],
)
def test_damaged_columns_are_refused_by_both(
    checkpoints: dict[str, _Checkpoint], name: str, defect: str
) -> None:
    doc = copy.deepcopy(checkpoints[name].data)
    _COLUMN_DEFECTS[defect](doc)
    with pytest.raises(MetadataError):
        _general(doc)
    with pytest.raises(MetadataError):
        _indexed(doc)


def _move_out_of_columns(doc: dict[str, Any]) -> None:
    """The first tensor of the columns as entries of its own (as version 2 writes them)."""
    full = expand(doc)
    fqn = _cols(doc)["fqn"][0]
    for k in ("fqn", "name", "size", "property", "chunk_shape", "rows"):
        del _cols(doc)[k][0]
    doc["state_dict_metadata"][fqn] = full["state_dict_metadata"][fqn]
    doc["storage_data"]["tensors"][fqn] = full["storage_data"]["tensors"][fqn]


def _properties_twice(doc: dict[str, Any]) -> None:
    cols = _cols(doc)
    cols["properties"].append(copy.deepcopy(cols["properties"][cols["property"][0]]))
    cols["property"][0] = len(cols["properties"]) - 1


def _columns_emptied(doc: dict[str, Any]) -> None:
    full = expand(doc)
    doc.clear()
    doc.update(full)
    doc[COLUMNS_KEY] = {
        k: [] for k in ("fqn", "name", "size", "properties", "property", "chunk_shape", "rows")
    }


def _whole_chunk_shape_given(doc: dict[str, Any]) -> None:
    cols = _cols(doc)
    i = cols["chunk_shape"].index(None)
    cols["chunk_shape"][i] = list(cols["size"][i])


def _columns_dropped(doc: dict[str, Any]) -> None:
    full = expand(doc)
    doc.clear()
    doc.update(full)


#: changes of the columns both paths accept: the index equals the general path on them
_COLUMN_ACCEPTED: dict[str, Callable[[dict[str, Any]], None]] = {
    "a tensor out of the columns": _move_out_of_columns,
    "a properties object twice": _properties_twice,
    "a name equal to its fqn given": _column_item("name", 0, lambda doc: _cols(doc)["fqn"][0]),
    "a chunk shape equal to its size given": _whole_chunk_shape_given,
    "columns without tensors": _columns_emptied,
    "an unused properties object": lambda doc: _cols(doc)["properties"].append({"dtype": "nonsense"}),
    "no columns": _columns_dropped,
}


@pytest.mark.parametrize(
    ("name", "change"), [(n, c) for n in ("small3", "mixed3") for c in sorted(_COLUMN_ACCEPTED)]
)
def test_changes_of_the_columns_both_accept(
    checkpoints: dict[str, _Checkpoint], name: str, change: str
) -> None:
    ck = checkpoints[name]
    doc = copy.deepcopy(ck.data)
    _COLUMN_ACCEPTED[change](doc)
    general = _general(doc)
    assert general[0] == _general(ck.data)[0]  # the same checkpoint, another spelling
    _check_contract(doc, open_reader(ck.path))


def test_columns_in_a_version_2_document_are_not_read(checkpoints: dict[str, _Checkpoint]) -> None:
    """Version 2 has no columns (an unknown key, ignored as before): both paths read the
    document without the tensors in them, alike."""
    doc = copy.deepcopy(checkpoints["small3"].data)
    doc["version"] = "2"
    try:
        general: Result | None = _general(doc)
    except MetadataError:
        general = None
    if general is not None:
        assert not set(general[1]) & set(_cols(doc)["fqn"])
    _check_contract(doc, open_reader(checkpoints["small3"].path))


#: changes the general path accepts: the index takes them (or leaves them to it) and equals it
_ACCEPTED: dict[str, Callable[[dict[str, Any]], None]] = {
    "another valid dtype": _set(_first_tensor("properties"), "dtype", "float64"),
    "requires_grad true": _set(_first_tensor("properties"), "requires_grad", True),
    "another safe name": _rename("renamed-array.x~1%2F"),
    "an unknown key in an entry": _set(_first_tensor("entry"), "comment", [1, {"x": None}]),
    "an unknown key in the storage entry": _set(_first_tensor("info"), "comment", "x"),
    "segments recorded": _set(_first_tensor("info"), "segments", {"anything": [1, 2]}),
    "no storage_meta": _set(_root, "storage_meta", None),
    "an unknown table column": lambda doc: _table(doc)["columns"].update(future={"name": "x"}),
}


@pytest.mark.parametrize(("name", "change"), [(n, c) for n in ("mixed", "mixed3") for c in sorted(_ACCEPTED)])
def test_changes_the_general_path_accepts(
    checkpoints: dict[str, _Checkpoint], name: str, change: str
) -> None:
    ck = checkpoints[name]
    doc = _damaged(ck.data, _ACCEPTED[change])
    _general(doc)  # accepted
    assert _check_contract(doc, open_reader(ck.path)) is not None


# --- random mutations ---------------------------------------------------------------------------

_POOL: list[Any] = [None, True, False, 0, 1, -1, 2**31, 2**62, 2**70, -(2**62), 0.5, 1.0, "", "x", "2"]
_POOL += [[], [0], [1, 2], [2**62], ["x"], {}, {"a": 1}, {"type": "bytes"}]
_KEYS = [
    "chunks",
    "rows",
    "type",
    "name",
    "size",
    "version",
    "segments",
    "chunk_table",
    COLUMNS_KEY,
    "fqn",
    "x",
]


def _paths(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*at, i))


def _at(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _near(value: Any) -> list[Any]:
    """Values of another type or just out of range, made from ``value``."""
    if isinstance(value, bool):
        return [not value, int(value), str(value).lower(), None]
    if isinstance(value, int):
        return [value + 1, value - 1, -value - 1, str(value), float(value), value == 1, 2**62, 2**70]
    if isinstance(value, float):
        return [int(value) if value == value and abs(value) < 2**63 else 0, str(value), float("nan"), -value]
    if isinstance(value, str):
        return [value + "x", value.upper(), value[:-1], [value], 1, ""]
    if isinstance(value, list):
        return [value[:-1], [*value, value[-1] if value else 1], value[::-1], tuple(value), {}, None]
    if isinstance(value, dict):
        return [{}, [], list(value), None]
    return [0, "", []]


@st.composite
def _random_mutation(draw: st.DrawFn, doc: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A copy of ``doc`` with one change at a random place."""
    out = copy.deepcopy(doc)
    path = draw(st.sampled_from(list(_paths(out))))
    value = _at(out, path)
    ops = ["replace", "near"]
    if path:
        ops.append("drop")
    if isinstance(value, dict):
        ops.append("add")
    op = draw(st.sampled_from(ops))
    if op == "add":
        key = draw(st.sampled_from(_KEYS))
        value[key] = draw(st.sampled_from(_POOL))
        return out, f"add {key}={value[key]!r} at {path}"
    if op == "drop":
        parent = _at(out, path[:-1])
        del parent[path[-1]]
        return out, f"drop {path}"
    new = draw(st.sampled_from(_POOL if op == "replace" else _near(value)))
    if not path:
        return new, f"root = {new!r}"
    _at(out, path[:-1])[path[-1]] = new
    return out, f"{path} = {new!r}"


@st.composite
def _mutation(draw: st.DrawFn, doc: dict[str, Any]) -> tuple[Any, str]:
    """One targeted change from the lists above, or a random one."""
    named = {**_DEFECTS, **_ACCEPTED}
    if not any(_splits(expand(doc))):
        named = {k: v for k, v in named.items() if k not in _NEEDS_SPLIT}
    choice = draw(st.sampled_from(["random", "random", "named"]))
    if choice == "named":
        label = draw(st.sampled_from(sorted(named)))
        return _damaged(doc, named[label]), label
    return draw(_random_mutation(doc))


#: the documents mutated ("default" is of the same kind as "mixed", only its 4200 chunks slower)
_MUTATED = ["small", "mixed", "golden", "small3", "mixed3", "golden3"]


@settings(max_examples=900, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_mutated_documents_are_refused_by_both_or_read_alike(
    checkpoints: dict[str, _Checkpoint], data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(_MUTATED))
    ck = checkpoints[name]
    doc, label = data.draw(_mutation(ck.data), label="mutation")
    try:
        _general(doc)
    except MetadataError:
        pass
    except Exception as exc:  # the general path reported every defect as a MetadataError
        pytest.fail(f"{label}: the general path raised {type(exc).__name__}: {exc}")
    _check_contract(doc, open_reader(ck.path))


# --- the public API -----------------------------------------------------------------------------


def _leaves(value: Any, at: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{at}.{k}" if at else str(k))
    else:
        yield at, value


def _clear(state: dict[str, Any]) -> None:
    """Zero the arrays of ``state`` in place and put a placeholder for each value."""
    for k, v in state.items():
        if isinstance(v, dict):
            _clear(v)
        elif isinstance(v, np.ndarray):
            v[...] = 0
        else:
            state[k] = "placeholder"


def _assert_bits(got: Any, saved: Any, key: str) -> None:
    if isinstance(saved, np.ndarray):
        assert isinstance(got, np.ndarray), key
        assert got.dtype == saved.dtype and got.shape == saved.shape, key
        assert got.tobytes() == saved.tobytes(), key  # bit for bit (NaNs, bfloat16)
    else:
        assert got == saved and type(got) is type(saved), key


@pytest.mark.parametrize("name", ["small", "mixed", "default", "small3", "mixed3"])
def test_loads_through_the_reader_give_the_saved_arrays(
    checkpoints: dict[str, _Checkpoint], name: str
) -> None:
    ck = checkpoints[name]
    assert ck.state is not None
    out = gpuckpt.load_state_dict(ck.path)
    saved = dict(_leaves(ck.state))
    loaded = dict(_leaves(out))
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        _assert_bits(loaded[key], value, key)
    # into arrays of the caller's (zeros of the same shapes, dtypes and layout); values replaced
    target = copy.deepcopy(ck.state)
    _clear(target)
    assert all(not isinstance(v, np.ndarray) or not v.any() for _k, v in _leaves(target))
    gpuckpt.load(target, ck.path)
    filled = dict(_leaves(target))
    for key, value in saved.items():
        _assert_bits(filled[key], value, key)
    if name == "mixed":
        assert loaded["img"].strides == ck.state["img"].strides  # channels-last comes back so


@pytest.mark.parametrize("name", _TABLED)
def test_read_metadata_equals_what_loads_validate(checkpoints: dict[str, _Checkpoint], name: str) -> None:
    ck = checkpoints[name]
    general = gpuckpt.read_metadata(ck.path)
    md = index_of_root(ck.root, str(ck.path)).metadata()
    assert type(general) is Metadata and type(md) is Metadata
    assert general == md and md == general
    assert general is not md  # read_metadata hands out metadata of its own
    assert list(general.state_dict_metadata) == list(md.state_dict_metadata)
