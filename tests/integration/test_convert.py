"""Conversion between gpuckpt, safetensors and PyTorch formats, bit-exact for every dtype."""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuckpt
from gpuckpt.convert import convert, detect_format, read_safetensors, write_safetensors
from gpuckpt.convert.safetensors_io import SAFETENSORS_DTYPES, read_safetensors_header
from gpuckpt.testing.states import random_array

HAS_TORCH = importlib.util.find_spec("torch") is not None
ST_DTYPES = list(SAFETENSORS_DTYPES.items())


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize(("code", "dtype"), ST_DTYPES, ids=[c for c, _ in ST_DTYPES])
def test_safetensors_roundtrip_every_dtype(tmp_path: Path, code: str, dtype: np.dtype) -> None:
    rng = np.random.default_rng(1)
    tensors = {
        "a": random_array(rng, (3, 5), dtype),
        "scalar": random_array(rng, (), dtype),
        "empty": np.zeros((0, 4), dtype),
    }
    p = tmp_path / "m.safetensors"
    write_safetensors(tensors, p, metadata={"format": "np"})
    header, meta, start = read_safetensors_header(p)
    assert meta == {"format": "np"} and start % 8 == 0
    assert {v["dtype"] for v in header.values()} == {code}
    back, _ = read_safetensors(p)
    assert all(same(tensors[k], back[k]) for k in tensors)


def test_layout_is_aligned(tmp_path: Path) -> None:
    tensors = {"b": np.ones(3, np.int8), "a": np.ones(3, np.float64), "c": np.ones(5, ml_dtypes.bfloat16)}
    p = tmp_path / "m.safetensors"
    write_safetensors(tensors, p)
    header, _, _ = read_safetensors_header(p)
    for v in header.values():
        assert v["data_offsets"][0] % np.dtype(SAFETENSORS_DTYPES[v["dtype"]]).itemsize == 0
    assert list(header) == ["a", "c", "b"]  # by element size, then name


def test_gpuckpt_to_safetensors_and_back_keeps_the_state(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    sd = {
        "model": {
            "layers": [
                {"w": random_array(rng, (4, 4), ml_dtypes.bfloat16)},
                {"w": random_array(rng, (4, 4), "float32")},
            ]
        },
        "fp8": {
            "e4m3": random_array(rng, (8,), ml_dtypes.float8_e4m3fn),
            "e5m2": random_array(rng, (8,), ml_dtypes.float8_e5m2),
        },
        "conv": random_array(rng, (2, 5, 6, 3), "float16").transpose(0, 3, 1, 2),
        "step": 7,
        "betas": (0.9, 0.999),
    }
    gpuckpt.save(sd, tmp_path / "c", sync="none")
    res = convert(tmp_path / "c", tmp_path / "m.safetensors")
    assert (res.source_format, res.target_format, res.tensors, res.objects) == (
        "gpuckpt",
        "safetensors",
        5,
        2,
    )
    flat, meta = read_safetensors(tmp_path / "m.safetensors")
    assert same(flat["model.layers.0.w"], sd["model"]["layers"][0]["w"])
    assert same(flat["conv"], np.ascontiguousarray(sd["conv"]))
    assert "gpuckpt.state" in meta
    convert(tmp_path / "m.safetensors", tmp_path / "back")
    back = gpuckpt.load_state_dict(tmp_path / "back")
    assert back["step"] == 7 and back["betas"] == (0.9, 0.999)
    assert same(back["model"]["layers"][0]["w"], sd["model"]["layers"][0]["w"])
    assert same(back["fp8"]["e5m2"], sd["fp8"]["e5m2"])
    assert same(back["conv"], sd["conv"]) and back["conv"].strides == sd["conv"].strides


def test_flat_state_has_no_extra_metadata(tmp_path: Path) -> None:
    gpuckpt.save({"layer.weight": np.ones(3, np.float32)}, tmp_path / "c", sync="none")
    convert(tmp_path / "c", tmp_path / "m.safetensors")
    assert read_safetensors(tmp_path / "m.safetensors")[1] == {}
    convert(tmp_path / "m.safetensors", tmp_path / "back")
    assert list(gpuckpt.load_state_dict(tmp_path / "back")) == ["layer.weight"]


@pytest.mark.parametrize("dtype", ["complex128", ml_dtypes.float8_e4m3fnuz])
def test_dtype_safetensors_lacks_is_refused_before_writing(tmp_path: Path, dtype: object) -> None:
    gpuckpt.save({"x": np.zeros(2, dtype)}, tmp_path / "c", sync="none")
    with pytest.raises(gpuckpt.UnsupportedValueError, match="safetensors cannot store"):
        convert(tmp_path / "c", tmp_path / "m.safetensors")
    assert list(tmp_path.iterdir()) == [tmp_path / "c"]


def test_a_name_that_is_not_unicode_text_is_refused_by_exports_before_writing(tmp_path: Path) -> None:
    # gpuckpt keeps such a key (a lone surrogate, as os.fsdecode spells undecodable bytes);
    # a safetensors header is UTF-8 JSON, and the reference reader refused what was written
    key = "w\udcffx"
    gpuckpt.save({key: np.ones(2), "ok": np.zeros(1)}, tmp_path / "c")
    assert gpuckpt.load_state_dict(tmp_path / "c")[key].tolist() == [1.0, 1.0]
    for dst, to in ((tmp_path / "m.safetensors", "safetensors"), (tmp_path / "hf", "hf")):
        with pytest.raises(
            gpuckpt.UnsupportedValueError, match=r"holds the lone surrogate '\\udcff' at position 1"
        ):
            convert(tmp_path / "c", dst, target_format=to)
        assert not dst.exists()
    with pytest.raises(gpuckpt.UnsupportedValueError, match="lone surrogate"):
        write_safetensors({key: np.ones(2)}, tmp_path / "direct.safetensors")
    assert not (tmp_path / "direct.safetensors").exists()


def test_existing_destination_and_same_path(tmp_path: Path) -> None:
    write_safetensors({"x": np.ones(2)}, tmp_path / "m.safetensors")
    with pytest.raises(gpuckpt.CheckpointExistsError):
        write_safetensors({"x": np.ones(2)}, tmp_path / "m.safetensors")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "x").write_text("x")  # (an empty directory takes the conversion, as a save)
    with pytest.raises(FileExistsError):
        convert(tmp_path / "m.safetensors", tmp_path / "dst")
    with pytest.raises(ValueError, match="same path"):
        convert(tmp_path / "m.safetensors", tmp_path / "m.safetensors", overwrite=True)
    write_safetensors({"y": np.zeros(1)}, tmp_path / "m.safetensors", overwrite=True)
    assert list(read_safetensors(tmp_path / "m.safetensors")[0]) == ["y"]


def _file(tmp_path: Path, header: object, data: bytes = b"", raw: bytes | None = None) -> Path:
    h = raw if raw is not None else json.dumps(header).encode()
    p = tmp_path / "bad.safetensors"
    p.write_bytes(len(h).to_bytes(8, "little") + h + data)
    return p


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "truncated"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "needs 8"),
        ({"a": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "not supported"),
        ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"\0", "non-negative"),
        (
            {
                "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]},
            },
            b"\0" * 3,
            "overlap or hole",
        ),
        ({"__metadata__": {"k": 1}}, b"", "strings to strings"),
        ([1, 2], b"", "JSON object"),
    ],
)
def test_malformed_safetensors(tmp_path: Path, header: object, data: bytes, match: str) -> None:
    with pytest.raises(gpuckpt.MetadataError, match=match):
        read_safetensors(_file(tmp_path, header, data))


def test_not_json_and_huge_header(tmp_path: Path) -> None:
    with pytest.raises(gpuckpt.MetadataError, match="not JSON"):
        read_safetensors(_file(tmp_path, None, raw=b"{nope"))
    p = tmp_path / "huge.safetensors"
    p.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(gpuckpt.MetadataError, match="exceeds"):
        read_safetensors(p)


def test_detect_format(tmp_path: Path) -> None:
    gpuckpt.save({"x": np.ones(1)}, tmp_path / "c", sync="none")
    write_safetensors({"x": np.ones(1)}, tmp_path / "m.safetensors")
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"\x80\x04pickle")
    (tmp_path / "t.pt").write_bytes(b"PK\x03\x04rest")
    (tmp_path / "junk").write_bytes(b"hello world")
    assert [detect_format(tmp_path / n) for n in ("c", "m.safetensors", "dcp", "t.pt")] == [
        "gpuckpt", "safetensors", "dcp", "torch",
    ]  # fmt: skip
    with pytest.raises(gpuckpt.UnsupportedValueError, match="cannot tell"):
        detect_format(tmp_path / "junk")


def test_dcp_metadata_pickle_needs_explicit_trust(tmp_path: Path) -> None:
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"\x80\x04not read")
    with pytest.raises(gpuckpt.UnsafeCheckpointError, match="trust_pickle_metadata"):
        convert(tmp_path / "dcp", tmp_path / "out")


@pytest.mark.skipif(HAS_TORCH, reason="checks the message shown without torch")
def test_torch_file_without_torch_says_how_to_install(tmp_path: Path) -> None:
    (tmp_path / "t.pt").write_bytes(b"PK\x03\x04rest")
    with pytest.raises(gpuckpt.UnsupportedValueError, match=r"gpuckpt\[torch\]"):
        convert(tmp_path / "t.pt", tmp_path / "out")


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from([dt for _, dt in ST_DTYPES]),
    shape=st.lists(st.integers(0, 5), max_size=3).map(tuple),
    seed=st.integers(0, 2**32 - 1),
)
def test_roundtrip_property(dtype: np.dtype, shape: tuple[int, ...], seed: int) -> None:
    arr = random_array(np.random.default_rng(seed), shape, dtype)
    with tempfile.TemporaryDirectory() as d:
        write_safetensors({"t": arr}, Path(d) / "m.safetensors")
        assert same(read_safetensors(Path(d) / "m.safetensors")[0]["t"], arr)


# cross-checks with the reference implementation, where installed ----------------------------------

NUMPY_CODES = ["BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "F32", "F64"]


def test_reference_safetensors_reads_ours_and_we_read_theirs(tmp_path: Path) -> None:
    st_numpy = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(3)
    tensors = {code.lower(): random_array(rng, (3, 2), SAFETENSORS_DTYPES[code]) for code in NUMPY_CODES}
    write_safetensors(tensors, tmp_path / "ours.safetensors", metadata={"k": "v"})
    theirs = st_numpy.load_file(str(tmp_path / "ours.safetensors"))
    assert all(same(tensors[k], theirs[k]) for k in tensors)
    st_numpy.save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"k": "v"})
    back, meta = read_safetensors(tmp_path / "theirs.safetensors")
    assert meta == {"k": "v"} and all(same(tensors[k], back[k]) for k in tensors)


def test_reference_safetensors_header_for_ml_dtypes(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors")
    write_safetensors(
        {"bf": np.ones(3, ml_dtypes.bfloat16), "f8": np.ones(2, ml_dtypes.float8_e4m3fn)},
        tmp_path / "m.safetensors",
    )
    with safetensors.safe_open(str(tmp_path / "m.safetensors"), "np") as f:
        assert sorted(f.keys()) == ["bf", "f8"]


# PyTorch sources (skipped without torch) ----------------------------------------------------------


@pytest.mark.torch
def test_torch_save_roundtrip(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    sd = {
        "w": torch.randn(4, 3),
        "bf": torch.randn(5).to(torch.bfloat16),
        "f8": torch.randn(6).to(torch.float8_e4m3fn),
        "conv": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "nested": {"i": torch.arange(4), "step": 3},
    }
    torch.save(sd, tmp_path / "m.pt")
    convert(tmp_path / "m.pt", tmp_path / "c")
    back = gpuckpt.load_state_dict(tmp_path / "c")
    assert back["bf"].dtype == ml_dtypes.bfloat16
    assert back["bf"].tobytes() == sd["bf"].view(torch.int16).numpy().tobytes()
    assert back["f8"].tobytes() == sd["f8"].view(torch.uint8).numpy().tobytes()
    assert back["w"].tobytes() == sd["w"].numpy().tobytes()
    assert np.array_equal(back["conv"], sd["conv"].numpy())
    assert (
        gpuckpt.read_metadata(tmp_path / "c").state_dict_metadata["conv"].properties.memory_format
        == gpuckpt.channels_last
    )
    assert back["nested"]["step"] == 3


@pytest.mark.torch
def test_numpy_scalar_values_go_to_torch_and_back(tmp_path: Path) -> None:
    # a checkpoint's NumPy scalars (plain values) exported --to torch come back through the
    # weights-only import, typed as they were; object and string scalars stay refused
    torch = pytest.importorskip("torch")
    values = {"step": np.int64(7), "lr": np.float32(0.5), "ok": np.bool_(True), "z": np.complex64(1 + 2j)}
    gpuckpt.save({"w": np.ones(3, np.float32), **values}, tmp_path / "c")
    convert(tmp_path / "c", tmp_path / "m.pt", target_format="torch")
    convert(tmp_path / "m.pt", tmp_path / "back")
    back = gpuckpt.load_state_dict(tmp_path / "back")
    for k, v in values.items():
        assert type(back[k]) is type(v) and back[k] == v
    torch.save({"s": np.str_("text")}, tmp_path / "s.pt")
    with pytest.raises(gpuckpt.MetadataError, match="weights_only"):
        convert(tmp_path / "s.pt", tmp_path / "s")


@pytest.mark.torch
# DCP warns on every save without a process group, asked for or not
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_directory_roundtrip(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    sd = {"w": torch.randn(4, 3), "bf": torch.randn(5).to(torch.bfloat16)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # a single-process save
    with pytest.raises(gpuckpt.UnsafeCheckpointError):
        convert(tmp_path / "dcp", tmp_path / "c")
    convert(tmp_path / "dcp", tmp_path / "c", trust_pickle_metadata=True)
    back = gpuckpt.load_state_dict(tmp_path / "c")
    assert back["w"].tobytes() == sd["w"].numpy().tobytes()
    assert back["bf"].tobytes() == sd["bf"].view(torch.int16).numpy().tobytes()


@pytest.mark.torch
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_damaged_dcp_and_dataless_torch_tensors_are_typed_errors(tmp_path: Path) -> None:
    """A truncated DCP data file is a CheckpointCorruptedError (DCP's own CheckpointException is a
    BaseException, which ``except Exception`` misses); meta and sparse tensors are refused by
    name, not by a torch error."""
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    dcp.save({"w": torch.randn(64, 64)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    (data,) = (tmp_path / "dcp").glob("*.distcp")
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(gpuckpt.CheckpointCorruptedError, match="damaged or incomplete"):
        convert(tmp_path / "dcp", tmp_path / "c", trust_pickle_metadata=True)
    assert not (tmp_path / "c").exists()
    for name, tensor, what in (
        ("meta", torch.empty(3, device="meta"), "a meta tensor"),
        ("sparse", torch.eye(3).to_sparse(), "of layout torch.sparse_coo"),
    ):
        torch.save({"w": tensor}, tmp_path / f"{name}.pt")
        with pytest.raises(gpuckpt.UnsupportedValueError, match=what):
            convert(tmp_path / f"{name}.pt", tmp_path / f"out-{name}")
        assert not (tmp_path / f"out-{name}").exists()
