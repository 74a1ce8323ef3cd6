"""Tests for the zarr-python data-type plug-in of the ``ml_dtypes`` types."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import google_crc32c
import hypothesis.strategies as st
import ml_dtypes
import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from zarr.codecs import BytesCodec
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.wrapper import ZDType
from zarr.core.metadata import ArrayV3Metadata
from zarr.storage import LocalStore

from gpuckpt.format._zarr_compat import ZARR_BEFORE_3_4, DataTypeValidationError
from gpuckpt.format.dtypes import ML_DTYPE_NAMES
from gpuckpt.format.zarr_dtypes import (
    ZARR_DTYPE_CLASSES,
    BFloat16,
    register_zarr_dtypes,
)

_REPO_ROOT = Path(__file__).resolve().parents[2]

# zarr-python compares chunks with the fill value to skip writing empty ones;
# for NaNs in these dtypes NumPy warns while doing so. Harmless here.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# Types that can hold infinities; the others ("fn", "fnuz", "fnu") cannot.
_HAS_INF = {"bfloat16", "float8_e3m4", "float8_e4m3", "float8_e5m2"}
# Bit pattern of the NaN each type produces for float("nan").
_CANONICAL_NAN = {
    "bfloat16": 0x7FC0,
    "float8_e3m4": 0x78,
    "float8_e4m3": 0x7C,
    "float8_e4m3b11fnuz": 0x80,
    "float8_e4m3fn": 0x7F,
    "float8_e4m3fnuz": 0x80,
    "float8_e5m2": 0x7E,
    "float8_e5m2fnuz": 0x80,
    "float8_e8m0fnu": 0xFF,
}


@pytest.fixture(autouse=True)
def _registered() -> None:
    register_zarr_dtypes()


def _np_dtype(name: str) -> np.dtype[Any]:
    scalar_type: type[np.generic] = getattr(ml_dtypes, name)
    return np.dtype(scalar_type)


def _bits_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(np.uint16 if _np_dtype(name).itemsize == 2 else np.uint8)


def _bits(value: Any, name: str) -> int:
    return int(np.asarray(value, dtype=_np_dtype(name)).view(_bits_dtype(name)))


def _from_bits(bits: int, name: str) -> Any:
    return np.array(bits, dtype=_bits_dtype(name)).view(_np_dtype(name))[()]


def _random_values(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray[Any, Any]:
    """Random bit patterns of the type, with every NaN pattern it has included."""
    bits_dtype = _bits_dtype(name)
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, np.iinfo(bits_dtype).max + 1, size=shape, dtype=bits_dtype)
    values = bits.view(_np_dtype(name))
    nan_bits = np.flatnonzero(np.isnan(np.arange(256, dtype=np.uint8).view(_np_dtype(name))))
    if bits_dtype.itemsize == 1:
        # Every one-byte pattern is likely drawn already; put the NaNs in for sure.
        bits.reshape(-1)[: len(nan_bits)] = nan_bits
    else:
        # A quiet NaN, a negative one, and one with a payload.
        bits.reshape(-1)[:3] = [0x7FC0, 0xFFC0, 0x7F81]
    assert np.isnan(values).any()
    return np.asarray(values)


def _read_all(array: zarr.Array[Any]) -> np.ndarray[Any, Any]:
    return np.asarray(array[...])


def _data_type(array: zarr.Array[Any]) -> ZDType[Any, Any]:
    assert isinstance(array.metadata, ArrayV3Metadata)
    return array.metadata.data_type


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def test_names_match_gpuckpt_dtypes() -> None:
    assert tuple(ZARR_DTYPE_CLASSES) == ML_DTYPE_NAMES
    for name, cls in ZARR_DTYPE_CLASSES.items():
        assert cls._zarr_v3_name == name
        assert cls.dtype_cls is type(_np_dtype(name))
        assert cls().to_native_dtype() == _np_dtype(name)
        assert cls().item_size == _np_dtype(name).itemsize


@pytest.mark.parametrize("name", ML_DTYPE_NAMES)
def test_array_round_trip_is_bit_exact(tmp_path: Path, name: str) -> None:
    values = _random_values(name, (37, 23))
    array = zarr.create_array(
        LocalStore(tmp_path), shape=values.shape, chunks=(16, 16), dtype=_np_dtype(name)
    )
    array[...] = values

    assert _read_json(tmp_path / "zarr.json")["data_type"] == name
    reopened = zarr.open_array(LocalStore(tmp_path, read_only=True))
    assert reopened.dtype == _np_dtype(name)
    out = _read_all(reopened)
    assert out.dtype == _np_dtype(name)
    np.testing.assert_array_equal(out.view(_bits_dtype(name)), values.view(_bits_dtype(name)))


@pytest.mark.parametrize("name", ML_DTYPE_NAMES)
def test_match_dtype_picks_the_plugin_class(name: str) -> None:
    zdtype = data_type_registry.match_dtype(_np_dtype(name))
    assert type(zdtype) is ZARR_DTYPE_CLASSES[name]
    # The name on its own, as zarr.create_array(dtype="bfloat16") passes it.
    array = zarr.create_array(zarr.storage.MemoryStore(), shape=(3,), dtype=name)
    assert type(_data_type(array)) is ZARR_DTYPE_CLASSES[name]


@pytest.mark.parametrize("name", ML_DTYPE_NAMES)
def test_unwritten_chunks_read_as_the_zero_bits_fill_value(tmp_path: Path, name: str) -> None:
    array = zarr.create_array(LocalStore(tmp_path), shape=(5,), dtype=_np_dtype(name))
    assert _read_json(tmp_path / "zarr.json")["fill_value"] == (0 if name != "float8_e8m0fnu" else 2.0**-127)
    assert not _read_all(array).view(_bits_dtype(name)).any()


@pytest.mark.parametrize("name", ML_DTYPE_NAMES)
@pytest.mark.parametrize(
    ("fill_value", "expected_json"),
    [(0.0, 0), (float("nan"), "NaN"), (-1.5, -1.5), (4, 4)],
)
def test_fill_value_round_trips_through_zarr_json(
    tmp_path: Path, name: str, fill_value: float, expected_json: Any
) -> None:
    if name == "float8_e8m0fnu" and fill_value in (0.0, -1.5):
        pytest.skip("float8_e8m0fnu holds neither zero nor negative numbers")
    array = zarr.create_array(
        LocalStore(tmp_path), shape=(4,), chunks=(2,), dtype=_np_dtype(name), fill_value=fill_value
    )
    array[:2] = np.array([1, 2]).astype(_np_dtype(name))
    assert _read_json(tmp_path / "zarr.json")["fill_value"] == expected_json

    out = _read_all(zarr.open_array(LocalStore(tmp_path, read_only=True)))
    expected_bits = _bits(np.asarray(fill_value).astype(_np_dtype(name)), name)
    assert out[2:].view(_bits_dtype(name)).tolist() == [expected_bits] * 2


@pytest.mark.parametrize("name", ML_DTYPE_NAMES)
def test_hex_fill_value_round_trips_through_zarr_json(tmp_path: Path, name: str) -> None:
    # A NaN other than the canonical one: only the hex form can carry it.
    if name == "bfloat16":
        hex_fill, bits = "0xffc1", 0xFFC1
    elif name in ("float8_e4m3fn",):
        hex_fill, bits = "0xff", 0xFF
    else:
        # Types with a single NaN: any non-special value, written by its bits.
        hex_fill, bits = "0x3c", 0x3C
    path = tmp_path / "a"
    zarr.create_array(LocalStore(path), shape=(3,), dtype=_np_dtype(name), fill_value=0)
    metadata = _read_json(path / "zarr.json")
    metadata["fill_value"] = hex_fill
    (path / "zarr.json").write_text(json.dumps(metadata))

    array = zarr.open_array(LocalStore(path))
    assert _read_all(array).view(_bits_dtype(name)).tolist() == [bits] * 3
    # Rewriting the metadata keeps the bits, as hex only when nothing else would.
    copy = zarr.create_array(
        LocalStore(tmp_path / "b"), shape=(3,), dtype=_np_dtype(name), fill_value=array.fill_value
    )
    written = _read_json(tmp_path / "b" / "zarr.json")["fill_value"]
    value = _from_bits(bits, name)
    if math.isnan(float(value)):
        assert written == hex_fill
    else:
        assert written == float(value)
    assert _bits(copy.fill_value, name) == bits


@pytest.mark.parametrize("name", sorted(_HAS_INF))
@pytest.mark.parametrize(("special", "value"), [("Infinity", math.inf), ("-Infinity", -math.inf)])
def test_infinite_fill_values(name: str, special: str, value: float) -> None:
    zdtype = ZARR_DTYPE_CLASSES[name]()
    assert zdtype.to_json_scalar(value, zarr_format=3) == special
    assert float(zdtype.from_json_scalar(special, zarr_format=3)) == value


@pytest.mark.parametrize("name", sorted(set(ML_DTYPE_NAMES) - _HAS_INF))
def test_infinity_is_refused_by_types_without_it(name: str) -> None:
    zdtype = ZARR_DTYPE_CLASSES[name]()
    with pytest.raises(ValueError, match="no infinity"):
        zdtype.from_json_scalar("Infinity", zarr_format=3)


@pytest.mark.parametrize("name", ML_DTYPE_NAMES)
def test_fill_value_json_encodings(name: str) -> None:
    zdtype = ZARR_DTYPE_CLASSES[name]()
    nan_bits = _CANONICAL_NAN[name]
    assert _bits(zdtype.from_json_scalar("NaN", zarr_format=3), name) == nan_bits
    assert zdtype.to_json_scalar(_from_bits(nan_bits, name), zarr_format=3) == "NaN"
    assert zdtype.to_json_scalar(2, zarr_format=3) == 2
    assert zdtype.to_json_scalar(0.5, zarr_format=3) == 0.5
    assert _bits(zdtype.from_json_scalar(2.0, zarr_format=3), name) == _bits(2.0, name)
    width = 2 * _np_dtype(name).itemsize
    assert _bits(zdtype.from_json_scalar("0x" + "0" * (width - 1) + "1", zarr_format=3), name) == 1
    assert _bits(zdtype.default_scalar(), name) == 0


def test_zero_and_negative_zero_are_written_as_numbers() -> None:
    zdtype = BFloat16()
    assert zdtype.to_json_scalar(0.0, zarr_format=3) == 0
    assert isinstance(zdtype.to_json_scalar(0.0, zarr_format=3), int)
    negative_zero = zdtype.to_json_scalar(-0.0, zarr_format=3)
    assert negative_zero == 0 and math.copysign(1.0, negative_zero) < 0
    assert _bits(zdtype.from_json_scalar(negative_zero, zarr_format=3), "bfloat16") == 0x8000


@pytest.mark.parametrize("bad", ["nan", "inf", "0x", "0xg0", "0x10000", "1.5", "Inf"], ids=repr)
def test_malformed_fill_value_strings_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        BFloat16().from_json_scalar(bad, zarr_format=3)


@pytest.mark.parametrize("bad", [None, True, [1], {"a": 1}], ids=repr)
def test_non_number_fill_values_are_refused(bad: Any) -> None:
    with pytest.raises(TypeError):
        BFloat16().from_json_scalar(bad, zarr_format=3)
    if bad is not True:  # True is a number to NumPy, only not in JSON
        with pytest.raises(TypeError):
            BFloat16().cast_scalar(bad)


@settings(max_examples=300, deadline=None, database=None)
@given(name=st.sampled_from(ML_DTYPE_NAMES), data=st.data())
def test_every_bit_pattern_survives_json(name: str, data: st.DataObject) -> None:
    width = 8 * _np_dtype(name).itemsize
    bits = data.draw(st.integers(0, (1 << width) - 1), label="bits")
    zdtype = ZARR_DTYPE_CLASSES[name]()
    encoded = json.loads(json.dumps(zdtype.to_json_scalar(_from_bits(bits, name), zarr_format=3)))
    decoded = zdtype.from_json_scalar(encoded, zarr_format=3)
    assert _bits(decoded, name) == bits
    if isinstance(encoded, str) and encoded.startswith("0x"):
        # Hex only for NaNs that "NaN" does not name.
        assert math.isnan(float(decoded)) and bits != _CANONICAL_NAN[name]


@settings(max_examples=200, deadline=None, database=None)
@given(
    name=st.sampled_from(ML_DTYPE_NAMES),
    value=st.floats(allow_nan=True, allow_infinity=True, width=32),
)
def test_json_numbers_round_like_numpy(name: str, value: float) -> None:
    zdtype = ZARR_DTYPE_CLASSES[name]()
    expected = np.asarray(value, dtype=np.float32).astype(_np_dtype(name))
    if math.isinf(value) and name not in _HAS_INF:
        return  # no JSON form: "Infinity" is refused, and a number cannot say inf
    json_value: Any = value
    if math.isnan(value):
        json_value = "NaN"
    elif math.isinf(value):
        json_value = "Infinity" if value > 0 else "-Infinity"
    decoded = zdtype.from_json_scalar(json_value, zarr_format=3)
    if math.isnan(float(expected)):
        assert math.isnan(float(decoded))
    else:
        assert _bits(decoded, name) == _bits(expected, name)


def test_hand_written_bfloat16_array_with_crc32c(tmp_path: Path) -> None:
    # The layout TensorStore writes: little-endian bytes, then CRC32C.
    values = np.array([[1.0, -2.5, 3.0e38], [np.nan, -0.0, 1.0e-40]], dtype=ml_dtypes.bfloat16)
    metadata = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [2, 3],
        "data_type": "bfloat16",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2, 3]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
    }
    (tmp_path / "zarr.json").write_text(json.dumps(metadata))
    raw = values.astype(values.dtype.newbyteorder("<")).tobytes()
    checksum = google_crc32c.value(raw).to_bytes(4, "little")
    chunk = tmp_path / "c" / "0" / "0"
    chunk.parent.mkdir(parents=True)
    chunk.write_bytes(raw + checksum)

    array = zarr.open_array(LocalStore(tmp_path, read_only=True))
    assert type(_data_type(array)) is BFloat16
    out = _read_all(array)
    np.testing.assert_array_equal(out.view(np.uint16), values.view(np.uint16))


def test_big_endian_bfloat16(tmp_path: Path) -> None:
    values = _random_values("bfloat16", (40,))
    big = np.dtype(ml_dtypes.bfloat16).newbyteorder(">")

    # A big-endian source array is stored as the bytes codec says (little).
    array = zarr.create_array(
        LocalStore(tmp_path / "a"), shape=(40,), chunks=(16,), dtype=big, compressors=None
    )
    assert _data_type(array) == BFloat16(endianness="big")
    array[...] = values.astype(big)
    codecs = _read_json(tmp_path / "a" / "zarr.json")["codecs"]
    assert codecs[0] == {"name": "bytes", "configuration": {"endian": "little"}}
    stored = (tmp_path / "a" / "c" / "0").read_bytes()
    assert stored[:32] == values[:16].tobytes()
    np.testing.assert_array_equal(
        _read_all(array).astype(values.dtype).view(np.uint16), values.view(np.uint16)
    )

    # Big-endian stored bytes, as a bytes codec with endian "big" writes them.
    path = tmp_path / "b"
    zarr.create_array(
        LocalStore(path),
        shape=(40,),
        chunks=(40,),
        dtype=ml_dtypes.bfloat16,
        serializer=BytesCodec(endian="big"),
        compressors=None,
    )
    (path / "c").mkdir()
    (path / "c" / "0").write_bytes(values.astype(big).tobytes())
    out = _read_all(zarr.open_array(LocalStore(path, read_only=True)))
    np.testing.assert_array_equal(out.astype(values.dtype).view(np.uint16), values.view(np.uint16))


def test_bfloat16_without_endian_is_refused(tmp_path: Path) -> None:
    # bfloat16 is multi-byte: like float16, the bytes codec must say its order.
    with pytest.raises(ValueError, match="endian"):
        zarr.create_array(
            LocalStore(tmp_path),
            shape=(2,),
            dtype=ml_dtypes.bfloat16,
            serializer=BytesCodec(endian=None),
        )


def test_float8_bytes_codec_has_no_endian(tmp_path: Path) -> None:
    zarr.create_array(LocalStore(tmp_path), shape=(2,), dtype=ml_dtypes.float8_e4m3fn)
    assert _read_json(tmp_path / "zarr.json")["codecs"][0] == {"name": "bytes"}


def test_zarr_v2_is_read_only(tmp_path: Path) -> None:
    with pytest.raises(DataTypeValidationError, match="zarr_format=3"):
        zarr.create_array(LocalStore(tmp_path / "new"), shape=(2,), dtype="bfloat16", zarr_format=2)

    # An array as TensorStore's zarr (v2) driver writes it opens.
    values = np.array([1.0, -0.5, np.inf, np.nan], dtype=ml_dtypes.bfloat16)
    path = tmp_path / "ts"
    path.mkdir()
    zarray = {
        "zarr_format": 2,
        "shape": [4],
        "chunks": [4],
        "dtype": "bfloat16",
        "compressor": None,
        "fill_value": "NaN",
        "order": "C",
        "filters": None,
    }
    (path / ".zarray").write_text(json.dumps(zarray))
    (path / "0").write_bytes(values.tobytes())
    array = zarr.open_array(LocalStore(path, read_only=True), zarr_format=2)
    assert array.metadata.dtype == BFloat16(endianness="little")
    np.testing.assert_array_equal(_read_all(array).view(np.uint16), values.view(np.uint16))


def test_negative_zero_chunks_survive_with_write_empty_chunks(tmp_path: Path) -> None:
    # zarr-python skips chunks equal to the fill value, comparing by value for
    # these dtypes, so a chunk of -0.0 with fill value 0 needs write_empty_chunks.
    values = np.full(4, -0.0, dtype=ml_dtypes.bfloat16)
    array = zarr.create_array(
        LocalStore(tmp_path),
        shape=(4,),
        dtype=ml_dtypes.bfloat16,
        config={"write_empty_chunks": True},
    )
    array[...] = values
    assert _read_all(array).view(np.uint16).tolist() == [0x8000] * 4


@pytest.mark.xfail(strict=True, reason="zarr-python elides -0.0 chunks when fill value is 0")
def test_negative_zero_chunks_are_elided_by_default(tmp_path: Path) -> None:
    values = np.full(4, -0.0, dtype=ml_dtypes.bfloat16)
    array = zarr.create_array(LocalStore(tmp_path), shape=(4,), dtype=ml_dtypes.bfloat16)
    array[...] = values
    assert _read_all(array).view(np.uint16).tolist() == [0x8000] * 4


def test_register_is_idempotent() -> None:
    before = dict(data_type_registry.contents)
    register_zarr_dtypes()
    register_zarr_dtypes()
    assert data_type_registry.contents == before
    for name, cls in ZARR_DTYPE_CLASSES.items():
        assert data_type_registry.get(name) is cls
    # Still exactly one match: registering twice adds no duplicate.
    assert type(data_type_registry.match_dtype(np.dtype(ml_dtypes.bfloat16))) is BFloat16


def test_classes_are_loadable_as_zarr_data_type_entry_points() -> None:
    # zarr's registry loads each "zarr.data_type" entry point as a class and
    # registers it under cls._zarr_v3_name.
    for name, cls in ZARR_DTYPE_CLASSES.items():
        entry_point = EntryPoint(
            name=name,
            value=f"gpuckpt.format.zarr_dtypes:{cls.__name__}",
            group="zarr.data_type",
        )
        loaded = entry_point.load()
        assert loaded is cls
        assert loaded._zarr_v3_name == name


# zarr 3.1.x, the line that Python 3.11 gets, collects the "zarr.data_type" entry
# points but never loads them (its registry never calls its _lazy_load); from 3.4
# on, the registry loads them on first use. With zarr 3.1 only an explicit
# register_zarr_dtypes() teaches zarr these types.
@pytest.mark.xfail(
    ZARR_BEFORE_3_4,
    strict=True,
    reason=f"zarr {zarr.__version__} does not load zarr.data_type entry points",
)
def test_installed_entry_points_register_without_calling_register(tmp_path: Path) -> None:
    # A fresh interpreter with an installed distribution whose entry points
    # are exactly the lines pyproject.toml declares, and no explicit register.
    dist_info = tmp_path / "gpuckpt_entry_point_probe-0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: gpuckpt-entry-point-probe\nVersion: 0\n"
    )
    lines = [
        f"{name} = gpuckpt.format.zarr_dtypes:{cls.__name__}" for name, cls in ZARR_DTYPE_CLASSES.items()
    ]
    (dist_info / "entry_points.txt").write_text("[zarr.data_type]\n" + "\n".join(lines) + "\n")
    script = (
        "import sys, ml_dtypes, zarr\n"
        "a = zarr.create_array(zarr.storage.MemoryStore(), shape=(2,), dtype=ml_dtypes.bfloat16)\n"
        "assert type(a.metadata.data_type).__name__ == 'BFloat16', a.metadata.data_type\n"
        "assert a.metadata.to_dict()['data_type'] == 'bfloat16'\n"
        "assert 'gpuckpt.format.zarr_dtypes' in sys.modules\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(_REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_data_types_are_hashable_and_compare_by_type() -> None:
    assert BFloat16() == BFloat16()
    assert BFloat16(endianness="little") != BFloat16(endianness="big")
    assert len({cls() for cls in ZARR_DTYPE_CLASSES.values()}) == len(ZARR_DTYPE_CLASSES)
