from __future__ import annotations

import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import zarr

import gpuckpt
from gpuckpt.format.dtypes import dtype_from_name
from gpuckpt.testing.states import ALL_DTYPE_NAMES, random_array


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bits(a) == bits(b)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.mark.parametrize("name", ALL_DTYPE_NAMES)
def test_every_dtype_round_trips_bit_exact(tmp_path: Path, rng: np.random.Generator, name: str) -> None:
    dt = dtype_from_name(name)
    x = random_array(rng, (37, 5), dt)
    gpuckpt.save({"x": x}, tmp_path / "c", chunk_bytes=64)  # several chunks, padded edge
    y = gpuckpt.load_state_dict(tmp_path / "c")["x"]
    assert same(x, y)
    # plain zarr-python (with gpuckpt's data-type plug-in) reads the same bits
    z = zarr.open_array(tmp_path / "c" / "x", mode="r")
    assert str(z.metadata.data_type.to_json(zarr_format=3)) == name
    assert bits(z[...]) == bits(x)


@pytest.mark.parametrize(
    "make",
    [
        lambda r: np.zeros((0, 4), np.float32),
        lambda r: np.zeros((3, 0, 2), np.int16),
        lambda r: np.array(2.5, np.float64),
        lambda r: np.array(7, np.int8),
        lambda r: r.standard_normal((20, 30))[::3, 1::2],
        lambda r: np.asfortranarray(r.standard_normal((17, 9))),
        lambda r: r.standard_normal((40,)).astype(">f4"),
    ],
    ids=["empty", "empty3d", "0d-f8", "0d-i1", "strided-view", "fortran", "big-endian"],
)
def test_special_arrays(tmp_path: Path, rng: np.random.Generator, make: object) -> None:
    x = make(rng)  # type: ignore[operator]
    md = gpuckpt.save({"x": x}, tmp_path / "c", chunk_bytes=100)
    assert md == gpuckpt.read_metadata(tmp_path / "c")  # what save returns is what it stored
    y = gpuckpt.load_state_dict(tmp_path / "c")["x"]
    assert y.shape == x.shape and np.array_equal(y, x)
    assert y.dtype == x.dtype.newbyteorder("=")
    z = zarr.open_array(tmp_path / "c" / "x", mode="r")
    assert np.array_equal(z[...], x)


@pytest.mark.parametrize(
    ("physical", "perm", "fmt"),
    [
        ((2, 5, 7, 3), (0, 3, 1, 2), gpuckpt.channels_last),
        ((2, 4, 5, 6, 3), (0, 4, 1, 2, 3), gpuckpt.channels_last_3d),
    ],
)
def test_channels_last_round_trip_keeps_format(
    tmp_path: Path, rng: np.random.Generator, physical: tuple[int, ...], perm: tuple[int, ...], fmt: object
) -> None:
    x = rng.standard_normal(physical).astype(np.float32).transpose(perm)
    md = gpuckpt.save({"x": x}, tmp_path / "c", chunk_bytes=256)
    assert md.state_dict_metadata["x"].properties.memory_format is fmt
    assert len(md.state_dict_metadata["x"].chunks) > 1
    y = gpuckpt.load_state_dict(tmp_path / "c")["x"]
    assert np.array_equal(x, y) and y.strides == x.strides
    # stored in logical order: zarr-python sees NCHW values
    assert np.array_equal(zarr.open_array(tmp_path / "c" / "x", mode="r")[...], x)
    # in-place load into a channels-last target keeps the target's strides
    t = np.zeros(physical, np.float32).transpose(perm)
    gpuckpt.load({"x": t}, tmp_path / "c")
    assert np.array_equal(t, x) and t.strides == x.strides


def test_fortran_restored_contiguous_with_preserve_format(tmp_path: Path, rng: np.random.Generator) -> None:
    x = np.asfortranarray(rng.standard_normal((6, 4)))
    md = gpuckpt.save({"x": x}, tmp_path / "c")
    assert md.state_dict_metadata["x"].properties.memory_format is gpuckpt.preserve_format
    y = gpuckpt.load_state_dict(tmp_path / "c")["x"]
    assert np.array_equal(x, y) and y.flags.c_contiguous


def nested_state(rng: np.random.Generator) -> dict:
    return {
        "model": {
            "embed": rng.standard_normal((50, 8)).astype(np.float32),
            "layers": [
                {"w": rng.standard_normal((8, 8)).astype(ml_dtypes.bfloat16), "b": np.zeros(8, np.float16)}
                for _ in range(3)
            ],
        },
        "optimizer": {
            "state": {0: {"step": np.array(5, np.int64), "exp_avg": rng.standard_normal(4)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "name": "main", "fused": None}],
        },
        "step": 1200,
        "rng": {"seed": 2**70, "bytes": b"\x00\x01", "np_scalar": np.float32(0.25)},
    }


def test_nested_structure_and_plain_values(tmp_path: Path, rng: np.random.Generator) -> None:
    sd = nested_state(rng)
    gpuckpt.save(sd, tmp_path / "c")
    back = gpuckpt.load_state_dict(tmp_path / "c")
    assert back.keys() == sd.keys()
    assert back["optimizer"]["param_groups"] == sd["optimizer"]["param_groups"]
    assert isinstance(back["optimizer"]["param_groups"][0]["betas"], tuple)
    assert list(back["optimizer"]["state"]) == [0]
    assert back["rng"] == sd["rng"] and type(back["rng"]["np_scalar"]) is np.float32
    assert back["step"] == 1200
    for i in range(3):
        assert same(back["model"]["layers"][i]["w"], sd["model"]["layers"][i]["w"])


def test_load_in_place(tmp_path: Path, rng: np.random.Generator) -> None:
    sd = nested_state(rng)
    gpuckpt.save(sd, tmp_path / "c")
    target = nested_state(np.random.default_rng(99))
    embed = target["model"]["embed"]
    target["step"] = 0
    gpuckpt.load(target, tmp_path / "c")
    assert target["model"]["embed"] is embed and np.array_equal(embed, sd["model"]["embed"])
    assert target["step"] == 1200
    assert target["rng"] == sd["rng"]


def test_partial_loads(tmp_path: Path, rng: np.random.Generator) -> None:
    sd = nested_state(rng)
    gpuckpt.save(sd, tmp_path / "c")
    # a state dict that names only some keys reads only those
    part = {"model": {"embed": np.zeros((50, 8), np.float32)}}
    gpuckpt.load(part, tmp_path / "c")
    assert np.array_equal(part["model"]["embed"], sd["model"]["embed"])
    sub = gpuckpt.load_state_dict(tmp_path / "c", keys=["model.layers", "step"])
    assert (
        set(sub) == {"model", "step"} and set(sub["model"]) == {"layers"} and len(sub["model"]["layers"]) == 3
    )


def test_strict_missing_keys(tmp_path: Path) -> None:
    gpuckpt.save({"a": np.ones(2)}, tmp_path / "c")
    sd = {"a": np.zeros(2), "new_head": np.zeros(3)}
    with pytest.raises(gpuckpt.MissingKeyError, match="'new_head'.*strict=False"):
        gpuckpt.load(sd, tmp_path / "c")
    assert not sd["a"].any()  # nothing was read before the error
    gpuckpt.load(sd, tmp_path / "c", strict=False)
    assert sd["a"].all() and not sd["new_head"].any()
    with pytest.raises(KeyError):  # the built-in still catches it
        gpuckpt.load_state_dict(tmp_path / "c", keys=["nope"])


def test_shape_and_dtype_mismatch_are_typed_and_change_nothing(tmp_path: Path) -> None:
    gpuckpt.save({"a": np.ones((2, 3), np.float32), "b": np.ones(2)}, tmp_path / "c")
    b = np.zeros(2)
    with pytest.raises(gpuckpt.ShapeMismatchError, match=r"'a'.*\(2, 3\).*\(3, 2\)"):
        gpuckpt.load({"b": b, "a": np.zeros((3, 2), np.float32)}, tmp_path / "c")
    with pytest.raises(gpuckpt.DTypeMismatchError, match="float32.*float64"):
        gpuckpt.load({"b": b, "a": np.zeros((2, 3), np.float64)}, tmp_path / "c")
    assert not b.any()


@pytest.mark.parametrize("strict", [True, False])
def test_an_array_target_where_the_checkpoint_holds_a_plain_value_is_refused(
    tmp_path: Path, strict: bool
) -> None:
    # replacing the array in the dict with the value left a model's parameter as it was
    gpuckpt.save({"b": np.ones(2), "weight": [[1, 2], [3, 4]]}, tmp_path / "c")
    weight, b = np.zeros((2, 2)), np.zeros(2)
    sd = {"b": b, "weight": weight}
    with pytest.raises(gpuckpt.DTypeMismatchError, match=r"'weight' is an array .* plain value \(list\)"):
        gpuckpt.load(sd, tmp_path / "c", strict=strict)
    assert sd["weight"] is weight and not weight.any() and not b.any()  # nothing loaded or replaced
    sd2: dict = {"b": b, "weight": None}  # a target that is not an array takes the value
    gpuckpt.load(sd2, tmp_path / "c", strict=strict)
    assert sd2["weight"] == [[1, 2], [3, 4]] and b.all()


def test_non_array_target_gets_a_new_array(tmp_path: Path) -> None:
    gpuckpt.save({"a": np.arange(3)}, tmp_path / "c")
    sd: dict = {"a": None}
    gpuckpt.load(sd, tmp_path / "c")
    assert np.array_equal(sd["a"], np.arange(3))


def test_refuses_to_overwrite_unless_asked(tmp_path: Path) -> None:
    gpuckpt.save({"a": np.ones(2)}, tmp_path / "c")
    with pytest.raises(gpuckpt.CheckpointExistsError, match="overwrite=True"):
        gpuckpt.save({"a": np.zeros(2)}, tmp_path / "c")
    assert gpuckpt.load_state_dict(tmp_path / "c")["a"].all()
    gpuckpt.save({"a": np.zeros(2), "b": 1}, tmp_path / "c", overwrite=True)
    assert gpuckpt.load_state_dict(tmp_path / "c") == {"a": pytest.approx(np.zeros(2)), "b": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no temporaries left


def test_overwrite_publishes_beside_foreign_files_and_keeps_them(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("keep me")
    with pytest.raises(gpuckpt.CheckpointExistsError, match="holds 1 entries"):
        gpuckpt.save({"a": np.ones(1)}, tmp_path / "data")  # without overwrite: refused
    gpuckpt.save({"a": np.ones(1)}, tmp_path / "data", overwrite=True)  # beside it (shared_dir.py)
    assert (tmp_path / "data" / "precious.txt").read_text() == "keep me"
    assert gpuckpt.load_state_dict(tmp_path / "data")["a"].tolist() == [1.0]


def test_unsupported_values_fail_before_writing(tmp_path: Path) -> None:
    with pytest.raises(gpuckpt.UnsupportedValueError, match="'cfg.fn'.*allow_pickle=True"):
        gpuckpt.save({"w": np.ones(2), "cfg": {"fn": print}}, tmp_path / "c")
    with pytest.raises(gpuckpt.UnsupportedValueError, match="cannot be stored as a tensor"):
        gpuckpt.save({"s": np.array(["a", "b"])}, tmp_path / "c")
    assert list(tmp_path.iterdir()) == []


class Opaque:
    def __init__(self, v: int) -> None:
        self.v = v


def test_pickle_needs_opt_in_on_both_sides(tmp_path: Path) -> None:
    gpuckpt.save({"o": Opaque(3)}, tmp_path / "c", allow_pickle=True)
    with pytest.raises(gpuckpt.UnsafeCheckpointError, match="allow_pickle=True"):
        gpuckpt.load_state_dict(tmp_path / "c")
    assert gpuckpt.load_state_dict(tmp_path / "c", allow_pickle=True)["o"].v == 3


def test_hostile_keys_stay_inside(tmp_path: Path) -> None:
    keys = ["../escape", "/abs", "..", ".", "", "a/b/../../c", "ünï", "zarr.json", "c.0", "%41", "A"]
    sd = {k: np.full(2, i) for i, k in enumerate(keys)}
    gpuckpt.save(sd, tmp_path / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    back = gpuckpt.load_state_dict(tmp_path / "ck")
    assert back.keys() == sd.keys()
    for k in keys:
        assert np.array_equal(back[k], sd[k])


def test_read_metadata_and_format(tmp_path: Path) -> None:
    md = gpuckpt.save({"w": np.ones((300, 4), np.float32), "n": 1}, tmp_path / "c", chunk_bytes=1024)
    md2 = gpuckpt.read_metadata(tmp_path / "c")
    assert md2.state_dict_metadata == md.state_dict_metadata
    assert isinstance(md2.state_dict_metadata["n"], gpuckpt.BytesStorageMetadata)
    chunks = md2.state_dict_metadata["w"].chunks
    # the Zarr chunk grid mirrors the metadata: one file per ChunkStorageMetadata
    z = json.loads((tmp_path / "c" / "w" / "zarr.json").read_text())
    cs = z["chunk_grid"]["configuration"]["chunk_shape"]
    assert [c.offsets for c in chunks] == [(i * cs[0], 0) for i in range(len(chunks))]
    assert len(list((tmp_path / "c" / "w").glob("c.*"))) == len(chunks)
    assert z["codecs"][-1] == {"name": "crc32c"}
    root = json.loads((tmp_path / "c" / "zarr.json").read_text())
    assert root["node_type"] == "group" and root["attributes"]["gpuckpt"]["metadata"]["version"] == "1"


def test_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(gpuckpt.CheckpointNotFoundError, match="no checkpoint"):
        gpuckpt.load_state_dict(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError):
        gpuckpt.read_metadata(tmp_path / "nothing")
    (tmp_path / "half").mkdir()
    with pytest.raises(gpuckpt.CheckpointNotFoundError, match="not a committed checkpoint"):
        gpuckpt.read_metadata(tmp_path / "half")


def test_non_checkpoint_zarr_group(tmp_path: Path) -> None:
    zarr.open_group(tmp_path / "g", mode="w")
    with pytest.raises(gpuckpt.MetadataError, match=r"not a gpuckpt checkpoint \(no attributes.gpuckpt\)"):
        gpuckpt.read_metadata(tmp_path / "g")
    # an attribute of that name that is not gpuckpt's record is named as what it is
    for value in ({}, "x", None):
        zarr.open_group(tmp_path / "h", mode="w", attributes={"gpuckpt": value})
        with pytest.raises(
            gpuckpt.MetadataError, match=rf"its attributes.gpuckpt is {re.escape(repr(value))}, where"
        ):
            gpuckpt.read_metadata(tmp_path / "h")


@pytest.mark.parametrize("sync", ["file", "fs", "none"])
def test_sync_modes(tmp_path: Path, sync: str) -> None:
    sd = {f"t{i}": np.full(3, i) for i in range(70)}
    gpuckpt.save(sd, tmp_path / "c", sync=sync)
    assert gpuckpt.load_state_dict(tmp_path / "c")["t69"][0] == 69


def test_tensorstore_reads_checkpoint_if_installed(tmp_path: Path, rng: np.random.Generator) -> None:
    ts = pytest.importorskip("tensorstore")
    x = rng.standard_normal((33, 7)).astype(ml_dtypes.bfloat16)
    y = rng.standard_normal((2, 5, 6, 3)).astype(np.float32).transpose(0, 3, 1, 2)
    gpuckpt.save({"x": x, "y": y}, tmp_path / "c", chunk_bytes=128)
    for name, ref in (("x", x), ("y", y)):
        arr = ts.open(
            {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "c" / name)}}
        ).result()
        assert bits(arr.read().result()) == bits(ref)


def test_a_checkpoint_is_never_saved_inside_another(tmp_path: Path) -> None:
    """Replacing or deleting the outer checkpoint would delete the inner one with it: refused on
    every save path before anything is written, at any depth; beside it is fine."""
    gpuckpt.save({"w": np.ones(3)}, tmp_path / "outer")
    for inner in (tmp_path / "outer" / "inner", tmp_path / "outer" / "w" / "deeper" / "x"):
        with pytest.raises(gpuckpt.InvalidPathError, match="is inside the gpuckpt checkpoint"):
            gpuckpt.save({"w": np.zeros(3)}, inner)
        with pytest.raises(gpuckpt.InvalidPathError, match="is inside the gpuckpt checkpoint"):
            gpuckpt.async_save({"w": np.zeros(3)}, inner).result(timeout=60)
    with pytest.raises(gpuckpt.InvalidPathError, match="is inside the gpuckpt checkpoint"):
        gpuckpt.CheckpointManager(tmp_path / "outer" / "steps", async_save=False).save(1, {"w": np.ones(2)})
    with pytest.raises(gpuckpt.InvalidPathError, match="is inside the gpuckpt checkpoint"):
        gpuckpt.CheckpointManager(tmp_path / "root", local_dir=tmp_path / "outer" / "tier")
    assert sorted(p.name for p in (tmp_path / "outer").iterdir()) == ["w", "zarr.json"]
    assert gpuckpt.read_metadata(tmp_path / "outer")
    gpuckpt.save({"w": np.zeros(3)}, tmp_path / "beside")
