from __future__ import annotations

import math
import pickle

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpuckpt
from gpuckpt.format.documents import chunk_file_key
from gpuckpt.format.metadata import (
    _MEM_FORMAT_ENCODING,
    FORMAT_VERSION,
    VERSION_COLUMNS,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from gpuckpt.format.reader import metadata_from_json

FORMATS = [
    gpuckpt.contiguous_format,
    gpuckpt.channels_last,
    gpuckpt.channels_last_3d,
    gpuckpt.preserve_format,
]


def test_public_names_from_both_modules() -> None:
    import gpuckpt.metadata as m

    for name in (
        "ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
        "StorageMeta", "Metadata", "MetadataIndex", "STORAGE_TYPES", "STATE_DICT_TYPE",
    ):  # fmt: skip
        assert getattr(gpuckpt, name) is getattr(m, name)


def test_every_error_and_warning_is_exported_from_the_package() -> None:
    import gpuckpt.errors as e

    for name in e.__all__:
        assert name in gpuckpt.__all__ and getattr(gpuckpt, name) is getattr(e, name), name


def test_defaults() -> None:
    p = TensorProperties()
    assert p.dtype == np.float32
    assert p.layout is gpuckpt.strided
    assert p.memory_format is gpuckpt.contiguous_format
    assert (p.requires_grad, p.pin_memory) == (False, False)
    gpuckpt.set_default_dtype(np.float64)
    try:
        assert TensorProperties().dtype == np.float64
    finally:
        gpuckpt.set_default_dtype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_properties_pickle_round_trip(fmt: object) -> None:
    p = TensorProperties(
        dtype=np.dtype(ml_dtypes.bfloat16), requires_grad=True, memory_format=fmt, pin_memory=True
    )
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q.memory_format is fmt


def test_getstate_encodes_memory_format_as_enum() -> None:
    state = TensorProperties(memory_format=gpuckpt.channels_last).__getstate__()
    assert state[3] is _MEM_FORMAT_ENCODING.CHANNELS_LAST
    assert TensorProperties(memory_format=None).__getstate__()[3] is _MEM_FORMAT_ENCODING.CONTIGUOUS


def test_unknown_memory_format_and_encoding_raise_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="invalid memory format"):
        pickle.dumps(TensorProperties(memory_format="sideways"))
    p = TensorProperties()
    with pytest.raises(RuntimeError, match="invalid memory format encoding"):
        p.__setstate__((np.float32, gpuckpt.strided, False, 7, False))


def test_create_from_numpy() -> None:
    x = np.zeros((2, 3, 4, 5), np.float16)
    p = TensorProperties.create_from_tensor(x)
    assert (p.dtype, p.layout, p.requires_grad, p.pin_memory) == (np.float16, gpuckpt.strided, False, False)
    assert p.memory_format is gpuckpt.contiguous_format
    assert (
        TensorProperties.create_from_tensor(
            x.transpose(0, 2, 3, 1).copy().transpose(0, 3, 1, 2)
        ).memory_format
        is gpuckpt.channels_last
    )
    y = np.zeros((2, 4, 5, 6, 3)).transpose(0, 4, 1, 2, 3)
    assert TensorProperties.create_from_tensor(y).memory_format is gpuckpt.channels_last_3d
    assert (
        TensorProperties.create_from_tensor(np.asfortranarray(np.zeros((3, 4)))).memory_format
        is gpuckpt.preserve_format
    )


def test_metadata_index_semantics() -> None:
    a = MetadataIndex("w", [1, 2], index=0)
    b = MetadataIndex("w", (1, 2), index=5)
    assert a.offset == (1, 2) and isinstance(a.offset, tuple)
    assert a == b and hash(a) == hash(b)
    assert MetadataIndex("w") != a and MetadataIndex("w").offset is None
    with pytest.raises(AttributeError):
        a.fqn = "x"  # type: ignore[misc]


def _md(entries: dict[str, object]) -> Metadata:
    """Metadata of ``entries`` with the storage entries a checkpoint would have for them: each
    tensor one array holding its one chunk (none when it is empty)."""
    tensors = {}
    for i, (fqn, e) in enumerate(entries.items()):
        if not isinstance(e, TensorStorageMetadata):
            continue
        size = tuple(e.size)
        itemsize = np.dtype(e.properties.dtype).itemsize
        tensors[fqn] = {
            "name": f"a{i}",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(n, 1) for n in size]}},
            "chunks": []
            if 0 in size
            else [
                {
                    "key": chunk_file_key((0,) * len(size)),
                    "nbytes": math.prod(size) * itemsize + 4,
                    "crc32c": 0,
                }
            ],
        }
    objects = {f: {"int": "1"} for f, e in entries.items() if isinstance(e, BytesStorageMetadata)}
    return Metadata(
        state_dict_metadata=entries,  # type: ignore[arg-type]
        planner_data={"structure": {"d": []}},
        storage_data={"tensors": tensors, "objects": objects},
        storage_meta=StorageMeta(checkpoint_id="abc", save_id="s", modules=["m"]),
    )


dims = st.lists(st.integers(0, 50), min_size=0, max_size=4)


@given(
    st.dictionaries(
        st.text(max_size=12),
        st.one_of(
            st.just(BytesStorageMetadata()),
            st.builds(
                lambda size, fmt, dt, rg: TensorStorageMetadata(
                    properties=TensorProperties(dtype=np.dtype(dt), requires_grad=rg, memory_format=fmt),
                    size=tuple(size),
                    chunks=[]
                    if 0 in size
                    else [ChunkStorageMetadata(offsets=(0,) * len(size), sizes=tuple(size))],
                ),
                dims,
                st.sampled_from(FORMATS),
                st.sampled_from(
                    ["float32", "int8", "bool", "complex128", ml_dtypes.bfloat16, ml_dtypes.float8_e5m2]
                ),
                st.booleans(),
            ),
        ),
        max_size=6,
    )
)
def test_metadata_json_round_trip(entries: dict[str, object]) -> None:
    md = _md(entries)
    back = metadata_from_json(md.to_json())
    assert back.state_dict_metadata == md.state_dict_metadata
    assert back.storage_meta == md.storage_meta
    assert back.planner_data == md.planner_data and back.storage_data == md.storage_data
    assert back.version == VERSION_COLUMNS  # unversioned metadata is written as version 3


def test_metadata_made_by_a_program_reads_back_through_from_json() -> None:
    # a Metadata built in code (no storage data: nothing placed) and one read from a checkpoint
    # both come back from Metadata.from_json, the one reader's entry point on the class
    md = Metadata(
        {
            "w": TensorStorageMetadata(
                TensorProperties(dtype=ml_dtypes.bfloat16, memory_format=gpuckpt.channels_last),
                (2, 3, 4, 5),
                [
                    ChunkStorageMetadata((0, 0, 0, 0), (1, 3, 4, 5)),
                    ChunkStorageMetadata((1, 0, 0, 0), (1, 3, 4, 5)),
                ],
            ),
            "step": BytesStorageMetadata(),
        },
        planner_data={"anything": [1, "two"]},
        storage_meta=StorageMeta(checkpoint_id="ck", save_id="s"),
    )
    for text in (md.to_json(), md.to_json_dict(), md.to_json().encode()):
        back = Metadata.from_json(text)
        assert back.state_dict_metadata == md.state_dict_metadata
        assert (back.planner_data, back.storage_data, back.storage_meta) == (
            md.planner_data,
            None,
            md.storage_meta,
        )
        assert back.version == VERSION_COLUMNS  # (written with the version it is written in)
    saved = _md({"t": TensorStorageMetadata(TensorProperties(), (4,), [ChunkStorageMetadata((0,), (4,))])})
    assert Metadata.from_json(saved.to_json()).state_dict_metadata == saved.state_dict_metadata
    bad = md.to_json_dict()
    bad["state_dict_metadata"]["w"]["chunks"] = [{"offsets": [2, 0, 0, 0], "sizes": [1, 3, 4, 5]}]
    with pytest.raises(gpuckpt.MetadataError, match="lies outside the tensor"):
        Metadata.from_json(bad)
    with pytest.raises(gpuckpt.MetadataError, match="not valid JSON"):
        Metadata.from_json("{nope")


@pytest.mark.parametrize("value", [[1, 2, 3], "abc", np.float32(1.5), 7, None])
def test_create_from_tensor_refuses_what_a_save_stores_as_a_plain_value(value: object) -> None:
    with pytest.raises(gpuckpt.UnsupportedValueError, match="plain value"):
        TensorProperties.create_from_tensor(value)


def test_set_default_dtype_refuses_what_is_no_dtype() -> None:
    for bad in ("notadtype", 3.5):
        with pytest.raises(gpuckpt.UnsupportedValueError, match="not a dtype"):
            gpuckpt.set_default_dtype(bad)
    with pytest.raises(gpuckpt.UnsupportedValueError, match="cannot be stored"):
        gpuckpt.set_default_dtype("U3")
    assert gpuckpt.get_default_dtype() == np.float32


def test_metadata_never_pickles() -> None:
    text = _md({"a": BytesStorageMetadata()}).to_json()
    assert text.startswith("{") and "version" in text


def test_newer_version_is_a_clear_error() -> None:
    d = _md({}).to_json_dict()
    d["version"] = str(int(FORMAT_VERSION) + 1)
    with pytest.raises(gpuckpt.UnsupportedVersionError, match="upgrade gpuckpt"):
        metadata_from_json(d)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("version"),
        lambda d: d.__setitem__("state_dict_metadata", []),
        lambda d: d["state_dict_metadata"].__setitem__("x", {"type": "tensor", "size": [-1], "chunks": []}),
        lambda d: d["state_dict_metadata"].__setitem__("x", {"type": "weird"}),
        lambda d: d["state_dict_metadata"].__setitem__(
            "x",
            {
                "type": "tensor",
                "size": [4],
                "chunks": [{"offsets": [3], "sizes": [2]}],
                "properties": TensorProperties().to_json(),
            },
        ),
        lambda d: d["state_dict_metadata"].__setitem__(
            "x",
            {
                "type": "tensor",
                "size": [4],
                "chunks": [],
                "properties": {**TensorProperties().to_json(), "dtype": "object"},
            },
        ),
        lambda d: d["state_dict_metadata"].__setitem__(
            "x", {"type": "tensor", "size": [True], "chunks": [], "properties": TensorProperties().to_json()}
        ),
    ],
)
def test_malformed_metadata_raises_metadata_error(mutate: object) -> None:
    d = _md({}).to_json_dict()
    mutate(d)  # type: ignore[operator]
    with pytest.raises(gpuckpt.MetadataError):
        metadata_from_json(d)


def test_invalid_json_text() -> None:
    with pytest.raises(gpuckpt.MetadataError, match="not valid JSON"):
        metadata_from_json("{nope")
