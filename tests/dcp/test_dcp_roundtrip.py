"""gpuckpt.dcp in one process: round trips through dcp.save/dcp.load, and with gpuckpt's own API."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

import torch.distributed.checkpoint as dcp  # noqa: E402 - after the skip
from torch.distributed.checkpoint.filesystem import SerializationFormat  # noqa: E402

import gpuckpt  # noqa: E402
import gpuckpt.dcp  # noqa: E402
from gpuckpt.errors import UnsafeCheckpointError  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]

FLOAT8 = [
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
]


def tensors() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {
        "f32": torch.randn(33, 17, generator=g),
        "bf16": torch.randn(9, 40, generator=g).bfloat16(),
        "i64": torch.arange(-5, 50, dtype=torch.int64),
        "bool": torch.rand(13, generator=g) > 0.5,
        "cl4": torch.randn(2, 3, 5, 4, generator=g).to(memory_format=torch.channels_last),
        "cl5": torch.randn(2, 3, 2, 4, 5, generator=g).to(memory_format=torch.channels_last_3d),
        "empty": torch.zeros(0, 7),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "view": torch.randn(6, 8, generator=g)[1:5, ::2],  # non-contiguous
    }
    for dt in FLOAT8:
        out[f"f8_{str(dt).removeprefix('torch.')}"] = torch.randn(4, 6, generator=g).to(dt)
    return out


def state() -> dict[str, Any]:
    return {
        "model": tensors(),
        "nested": {"deep": {"w": torch.ones(3, 2), "n": 5}},
        "step": 12,
        "lr": 3e-4,
        "name": "run-1",
        "none": None,
        "milestones": [10, 20, 30],
        "pair": (1, "two"),
    }


def bits(t: Any) -> Any:
    """The exact bits of a tensor (NaN payloads and float8 included)."""
    t = t.detach().contiguous()
    return (
        t.view(torch.uint8)
        if t.dtype.itemsize == 1 and t.dtype != torch.uint8
        else t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])
        if t.dtype.is_floating_point
        else t
    )


def same_tensor(a: Any, b: Any) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def empty_like_state(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = empty_like_state(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)  # keeps the memory format
        else:
            out[k] = None
    return out


def test_dcp_save_then_dcp_load(tmp_path: Path) -> None:
    sd = state()
    dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c"))
    target = empty_like_state(sd)
    dcp.load(target, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c"))
    for k, v in sd["model"].items():
        assert same_tensor(target["model"][k], v), k
    assert target["model"]["cl4"].is_contiguous(memory_format=torch.channels_last)
    assert target["model"]["cl5"].is_contiguous(memory_format=torch.channels_last_3d)
    assert torch.equal(target["nested"]["deep"]["w"], sd["nested"]["deep"]["w"])
    for k in ("step", "lr", "name", "none", "milestones", "pair"):
        assert target[k] == sd[k], k
    assert target["nested"]["deep"]["n"] == 5


def test_dcp_written_checkpoint_read_by_gpuckpt(tmp_path: Path) -> None:
    """load_state_dict rebuilds the nesting; DCP's pickled values come back as bytes, never unpickled."""
    sd = state()
    dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c"))
    back = gpuckpt.load_state_dict(tmp_path / "c")
    assert set(back) == set(sd) and set(back["model"]) == set(sd["model"])
    for k, v in sd["model"].items():
        got = back["model"][k]
        assert got.shape == tuple(v.shape)
        assert same_tensor(gpuckpt_to_torch(got), v.contiguous()), k
    # the real memory format is recorded and restored
    assert back["model"]["cl4"].strides == tuple(s * 4 for s in sd["model"]["cl4"].stride())
    assert back["model"]["cl5"].strides == tuple(s * 4 for s in sd["model"]["cl5"].stride())
    assert isinstance(back["step"], bytes)
    assert torch.load(io.BytesIO(back["step"]), weights_only=True) == 12
    assert torch.load(io.BytesIO(back["milestones"]), weights_only=True) == [10, 20, 30]
    # gpuckpt.load in place: the same FQNs as DCP's
    targets = {"model": {"f32": np.zeros((33, 17), np.float32)}}
    gpuckpt.load(targets, tmp_path / "c", strict=False)
    assert np.array_equal(targets["model"]["f32"], sd["model"]["f32"].numpy())


def gpuckpt_to_torch(a: np.ndarray) -> Any:
    from gpuckpt.dcp.tensors import as_torch

    return as_torch(a.copy(order="C"))


def test_gpuckpt_save_read_by_dcp_load(tmp_path: Path) -> None:
    """Plain values arrive as DCP's default planner expects them, lists without tensors as one value."""
    rng = np.random.default_rng(1)
    conv = rng.standard_normal((2, 5, 4, 3)).astype(np.float32).transpose(0, 3, 1, 2)  # channels-last
    native = {
        "w": rng.standard_normal((6, 5)).astype(np.float32),
        "bf": rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16),
        "conv": conv,
        "count": np.int64(9),
        "opt": {"param_groups": [{"lr": 0.1, "params": [0, 1]}], "state": {0: {"m": np.ones(5)}}},
        "betas": (0.9, 0.99),
        "ids": [3, 4, 5],
        "mixed": [{"a": 1}, {"a": 2}],
    }
    gpuckpt.save(native, tmp_path / "c")
    target: dict[str, Any] = {
        "w": torch.zeros(6, 5),
        "bf": torch.zeros(3, 4, dtype=torch.bfloat16),
        "conv": torch.zeros(2, 3, 5, 4).to(memory_format=torch.channels_last),
        "count": None,
        "opt": {
            "param_groups": [{"lr": None, "params": None}],
            "state": {0: {"m": torch.zeros(5, dtype=torch.float64)}},
        },
        "betas": None,
        "ids": None,
        "mixed": [{"a": None}, {"a": None}],
    }
    dcp.load(target, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c"))
    assert np.array_equal(target["w"].numpy(), native["w"])
    assert np.array_equal(target["bf"].view(torch.int16).numpy(), native["bf"].view(np.int16))
    assert np.array_equal(target["conv"].numpy(), conv)
    assert target["count"] == 9 and target["betas"] == (0.9, 0.99) and target["ids"] == [3, 4, 5]
    assert target["opt"]["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]
    assert torch.equal(target["opt"]["state"][0]["m"], torch.ones(5, dtype=torch.float64))
    assert target["mixed"] == [{"a": 1}, {"a": 2}]


def test_state_dict_rebuilt_from_metadata_alone(tmp_path: Path) -> None:
    """DCP building the state dict from the metadata alone (its planner_data paths)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    gpuckpt.save({"a": {"w": np.arange(6.0).reshape(2, 3)}, "tags": ["x", "y"], "n": 4}, tmp_path / "g")
    sd = {"m": {"w": torch.arange(4.0), "k": [torch.ones(2), 7]}, "step": 3}
    dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(tmp_path / "d"))
    for path, expect in (
        (
            tmp_path / "g",
            {"a": {"w": torch.arange(6.0, dtype=torch.float64).reshape(2, 3)}, "tags": ["x", "y"], "n": 4},
        ),
        (tmp_path / "d", sd),
    ):
        built = _load_state_dict_from_keys(storage_reader=gpuckpt.dcp.Reader(path))
        assert _same(built, expect), (built, expect)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_targets_of_another_dtype_are_converted(tmp_path: Path) -> None:
    """As with FileSystemReader: a float32 checkpoint loads into bfloat16 and float64 targets."""
    w = torch.randn(5, 4)
    dcp.save({"w": w, "v": w.clone()}, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c"))
    target = {"w": torch.zeros(5, 4, dtype=torch.bfloat16), "v": torch.zeros(5, 4, dtype=torch.float64)}
    dcp.load(target, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c"))
    assert torch.equal(target["w"], w.bfloat16()) and torch.equal(target["v"], w.double())


def test_large_tensors_split_into_chunks_and_other_stores_read_them(tmp_path: Path) -> None:
    """A DCP-written checkpoint is plain Zarr v3: zarr-python and TensorStore read it."""
    import zarr

    sd = {"w": torch.randn(64, 10), "bf": torch.randn(8, 8).bfloat16(), "step": 3}
    dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c", chunk_bytes=512))
    md = gpuckpt.read_metadata(tmp_path / "c")
    # 64 rows of 40 bytes, 12 rows to a chunk: the regular grid gpuckpt.save would choose
    grid = json.loads((tmp_path / "c" / "w" / "zarr.json").read_text())["chunk_grid"]
    assert grid == {"name": "regular", "configuration": {"chunk_shape": [11, 10]}}
    assert len(md.state_dict_metadata["w"].chunks) == 6  # type: ignore[union-attr]
    group = zarr.open_group(tmp_path / "c", mode="r")
    assert np.array_equal(group["w"][...], sd["w"].numpy())
    assert np.array_equal(np.asarray(group["bf"][...]).view(np.int16), sd["bf"].view(torch.int16).numpy())
    ts = pytest.importorskip("tensorstore")
    arr = ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "c" / "w")}}
    ).result()
    assert np.array_equal(arr.read().result(), sd["w"].numpy())


def test_a_large_dcp_save_keeps_its_chunk_records_in_the_chunk_table(tmp_path: Path) -> None:
    """More chunks than a root document lists: DCP's finish writes format version 2's chunk table."""
    w = torch.arange(4200 * 4, dtype=torch.float32).reshape(4200, 4)
    dcp.save({"w": w, "step": 3}, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c", chunk_bytes=16))
    md = gpuckpt.read_metadata(tmp_path / "c")
    assert md.version == "2" and md.storage_data["chunk_table"]["rows"] == 4200
    assert len(md.state_dict_metadata["w"].chunks) == 4200  # type: ignore[union-attr]
    target = {"w": torch.zeros(4200, 4), "step": 0}
    dcp.load(target, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c"))
    assert torch.equal(target["w"], w) and target["step"] == 3
    assert np.array_equal(gpuckpt.load_state_dict(tmp_path / "c")["w"], w.numpy())


def test_a_dcp_save_of_many_tensors_keeps_their_entries_as_columns(tmp_path: Path) -> None:
    """1,100 tensors in 5,500 chunks: DCP's finish writes format version 3 (tensor entries as
    columns), which dcp.load and gpuckpt read back."""
    sd: dict[str, Any] = {f"layer{i:04d}.b": torch.full((5,), float(i)) for i in range(1100)}
    sd["step"] = 7
    dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c", chunk_bytes=4))
    root = json.loads((tmp_path / "c" / "zarr.json").read_bytes())["attributes"]["gpuckpt"]["metadata"]
    assert root["version"] == "3" and len(root["tensor_columns"]["fqn"]) == 1100
    md = gpuckpt.read_metadata(tmp_path / "c")
    assert md.version == "3" and md.storage_data["chunk_table"]["rows"] == 5500
    target: dict[str, Any] = {k: torch.zeros(5) for k in sd if k != "step"}
    target["step"] = 0
    dcp.load(target, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c"))
    assert target["step"] == 7
    assert all(torch.equal(target[k], v) for k, v in sd.items() if k != "step")
    assert np.array_equal(
        gpuckpt.load_state_dict(tmp_path / "c")["layer0042.b"], np.full(5, 42.0, np.float32)
    )


def test_foreign_objects_need_allow_pickle_to_load(tmp_path: Path) -> None:
    """DCP's pickled values are loaded with weights_only unless the Reader is told to trust them."""
    from torch.distributed.checkpoint.api import CheckpointException

    dcp.save(
        {"w": torch.ones(2), "frac": Fraction(1, 3), "ok": {"a": [1, 2]}},
        storage_writer=gpuckpt.dcp.Writer(tmp_path / "c"),
    )
    target: dict[str, Any] = {"w": torch.zeros(2), "frac": None, "ok": {"a": None}}
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c"))
    assert "UnsafeCheckpointError" in str(info.value) and "'frac'" in str(info.value)
    dcp.load(target, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c", allow_pickle=True))
    assert target["frac"] == Fraction(1, 3) and target["ok"] == {"a": [1, 2]}
    # gpuckpt's own pickled values: the same opt-in
    gpuckpt.save({"frac": Fraction(2, 3)}, tmp_path / "g", allow_pickle=True)
    with pytest.raises(CheckpointException) as info:
        dcp.load({"frac": None}, storage_reader=gpuckpt.dcp.Reader(tmp_path / "g"))
    assert "UnsafeCheckpointError" in str(info.value)
    got: dict[str, Any] = {"frac": None}
    dcp.load(got, storage_reader=gpuckpt.dcp.Reader(tmp_path / "g", allow_pickle=True))
    assert got["frac"] == Fraction(2, 3)
    with pytest.raises(UnsafeCheckpointError):
        gpuckpt.load_state_dict(tmp_path / "g")


def test_async_save_with_stager_snapshot_and_reuse(tmp_path: Path) -> None:
    """Changes right after async_save returns stay out; back-to-back saves commit; staging is reused."""
    stager = gpuckpt.dcp.Stager()
    live = {"w": torch.arange(12.0).reshape(3, 4), "bf": torch.ones(5, dtype=torch.bfloat16), "n": 1}
    first = dcp.async_save(live, storage_writer=gpuckpt.dcp.Writer(tmp_path / "a0"), async_stager=stager)
    live["w"].add_(100.0)
    live["bf"].mul_(3)
    second = dcp.async_save(live, storage_writer=gpuckpt.dcp.Writer(tmp_path / "a1"), async_stager=stager)
    live["w"].add_(100.0)
    first.result()
    second.result()
    a0, a1 = gpuckpt.load_state_dict(tmp_path / "a0"), gpuckpt.load_state_dict(tmp_path / "a1")
    assert np.array_equal(a0["w"], np.arange(12.0).reshape(3, 4))
    assert np.array_equal(a1["w"], np.arange(12.0).reshape(3, 4) + 100)
    assert np.array_equal(a1["bf"].astype(np.float32), np.full(5, 3.0))
    held = stager.reserved_bytes
    assert held > 0
    for i in range(10):
        live["w"].add_(1.0)
        dcp.async_save(
            live, storage_writer=gpuckpt.dcp.Writer(tmp_path / f"b{i}"), async_stager=stager
        ).result()
    assert stager.reserved_bytes == held  # no growth over 10 saves
    assert np.array_equal(gpuckpt.load_state_dict(tmp_path / "b9")["w"], live["w"].numpy())
    stager.close()
    # one save at a time: one snapshot's memory, reused (the previous save's arena comes back
    # as its thread lets go of the state dict, a moment after its future is done)
    single = gpuckpt.dcp.Stager()
    for i in range(5):
        dcp.async_save(
            live, storage_writer=gpuckpt.dcp.Writer(tmp_path / f"s{i}"), async_stager=single
        ).result()
        if i == 0:
            one = single.reserved_bytes
    assert single.reserved_bytes == one
    single.close()


def test_stager_device_option_copies_host_tensors(tmp_path: Path) -> None:
    """staging="device" on a machine without CUDA: host tensors are copied, the snapshot holds."""
    stager = gpuckpt.dcp.Stager(staging="device")
    live = {"w": torch.ones(4), "nested": {"t": (torch.zeros(2), 3)}}
    fut = dcp.async_save(live, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c"), async_stager=stager)
    live["w"].add_(1.0)
    fut.result()
    assert np.array_equal(gpuckpt.load_state_dict(tmp_path / "c")["w"], np.ones(4))
    assert stager.reserved_bytes == 0


def test_import_gpuckpt_never_imports_torch() -> None:
    code = "import sys, gpuckpt; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    # without torch, gpuckpt.dcp says how to get it
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import gpuckpt.dcp\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "pip install 'gpuckpt[torch]'" in out.stdout


def test_writer_options_are_checked_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sync="):
        gpuckpt.dcp.Writer(tmp_path / "c", sync="fsync")
    with pytest.raises(ValueError, match="chunk_bytes"):
        gpuckpt.dcp.Writer(tmp_path / "c", chunk_bytes=0)
    with pytest.raises(ValueError, match="staging"):
        gpuckpt.dcp.Stager(staging="gpu")
    for timeout in (-1, "5", float("nan")):  # (NaN was taken, and waited without a limit)
        with pytest.raises(gpuckpt.InvalidOptionError, match="timeout must be a non-negative number"):
            gpuckpt.dcp.Stager(timeout=timeout)  # type: ignore[arg-type]
    assert not (tmp_path / "c").exists()
    assert gpuckpt.dcp.Writer.validate_checkpoint_id(tmp_path / "c")
    assert gpuckpt.dcp.Writer.validate_checkpoint_id("s3://bucket/ckpt")
    assert not gpuckpt.dcp.Writer.validate_checkpoint_id("hf://org/model")
    assert not gpuckpt.dcp.Reader.validate_checkpoint_id(tmp_path / "c")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"w": torch.ones(1)},
            checkpoint_id=tmp_path / "c",
            storage_writer=gpuckpt.dcp.Writer(tmp_path / "x"),
        )
    assert gpuckpt.dcp.Reader.validate_checkpoint_id(tmp_path / "c") and not (tmp_path / "x").exists()


def test_filesystem_writer_and_reader_arguments_run_unchanged(tmp_path: Path) -> None:
    """A program that builds DCP's FileSystemWriter/Reader runs with the class names changed:
    the arguments gpuckpt has mean the same, the ones of DCP's own file layout do nothing."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry, ZStandard

    w = gpuckpt.dcp.Writer(
        tmp_path / "c",
        single_file_per_rank=False,
        sync_files=False,
        thread_count=3,
        per_thread_copy_ahead=1,
        cache_staged_state_dict=True,
        overwrite=True,
        _extensions=[ZStandard()],
        serialization_format=SerializationFormat.TORCH_SAVE,
    )
    zstd = gpuckpt.dcp.Writer(tmp_path / "e", compression="zstd").options.compression
    assert (w.options.threads, w.options.sync, w.options.compression) == (3, "none", zstd)
    sd = state()
    dcp.save(sd, storage_writer=w)
    target = empty_like_state(sd)
    dcp.load(
        target, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c", _extension_registry=ExtensionRegistry())
    )
    for k, v in sd["model"].items():
        assert same_tensor(target["model"][k], v), k
    stored = gpuckpt.read_metadata(tmp_path / "c").storage_data["tensors"].values()
    assert {t["codec"]["name"] for t in stored if "codec" in t} == {"blosc"}  # "zstd": byte shuffle + zstd
    assert gpuckpt.dcp.Writer(tmp_path / "d", sync_files=True, sync="file").options.sync == "file"


class _Rot13:
    """A stream extension of a DCP program's own (as DCP's tests have)."""


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"thread_count": 2, "threads": 4}, "thread_count=2 and threads=4 name the same thing"),
        ({"sync_files": True, "sync": "none"}, "sync_files=True and sync='none' disagree"),
        ({"sync_files": False, "sync": "file"}, "sync_files=False and sync='file' disagree"),
        ({"sync_files": "yes"}, "sync_files must be True or False"),
        ({"_extensions": [_Rot13()]}, r"not DCP stream extensions \(_Rot13\): for zstd compression"),
        ({"serialization_format": SerializationFormat.SAFETENSORS}, "gpuckpt convert --to safetensors"),
        # once a bare "'bool' object is not iterable" and a KeyError
        ({"_extensions": True}, "_extensions must be a list of DCP stream extensions .* got bool"),
        ({"_extensions": {"a": 1}}, "_extensions must be a list of DCP stream extensions .* got dict"),
    ],
)
def test_filesystem_writer_arguments_gpuckpt_cannot_honour_are_refused(
    tmp_path: Path, arguments: dict[str, Any], message: str
) -> None:
    with pytest.raises(gpuckpt.InvalidOptionError, match=message):
        gpuckpt.dcp.Writer(tmp_path / "c", **arguments)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("path", [None, True, 3, b"/tmp/x", "", {"w": 1}])
def test_a_path_that_is_not_one_is_an_invalid_path_error_when_made(tmp_path: Path, path: Any) -> None:
    # os.fspath's "expected str, bytes or os.PathLike object" named no argument, and an empty
    # Reader path surfaced from dcp.load as an AssertionError of DCP's
    for cls in (gpuckpt.dcp.Writer, gpuckpt.dcp.Reader):
        with pytest.raises(gpuckpt.InvalidPathError, match="checkpoint path"):
            cls(path)
        made = cls(tmp_path / "c")
        with pytest.raises(gpuckpt.InvalidPathError, match="checkpoint path"):
            made.reset(path if path is not None else "")


def test_dcp_written_channels_last_tensors_verify_and_record_their_format(tmp_path: Path) -> None:
    # DCP's planner reports every tensor as contiguous; the array documents must still say
    # what the root metadata says, or `gpuckpt verify` finds the checkpoint damaged
    from gpuckpt.verify import verify_checkpoint

    g = torch.Generator().manual_seed(1)
    state = {
        "cl4": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "cl5": torch.randn(2, 3, 2, 4, 5, generator=g).to(memory_format=torch.channels_last_3d),
        "plain": torch.randn(4, 4, generator=g),
    }
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=gpuckpt.dcp.Writer(path))
    report = verify_checkpoint(path)
    assert report.ok, report.format()
    expected = {"cl4": "channels_last", "cl5": "channels_last_3d", "plain": "contiguous_format"}
    md = gpuckpt.read_metadata(path)
    for fqn, fmt in expected.items():
        assert md.state_dict_metadata[fqn].properties.memory_format.name == fmt
        name = md.storage_data["tensors"][fqn]["name"]
        doc = json.loads((path / name / "zarr.json").read_text())
        assert doc["attributes"]["gpuckpt"]["memory_format"] == fmt


def test_the_metadata_of_a_save_carries_dcp_s_version_and_the_save_s_id(tmp_path: Path) -> None:
    """As FileSystemWriter's: the Metadata dcp.save returns has DCP's version and a storage_meta
    naming the checkpoint and the save; Reader.read_metadata gives the same version and save id;
    the next save of the same Writer has an id of its own."""
    from torch.distributed.checkpoint import FileSystemWriter

    src = {"w": torch.ones(3), "step": 1}
    writer = gpuckpt.dcp.Writer(tmp_path / "g")
    ours = dcp.save(src, storage_writer=writer)
    theirs = dcp.save(src, storage_writer=FileSystemWriter(tmp_path / "fs"))
    assert theirs.version is not None and ours.version == theirs.version
    assert ours.storage_meta is not None and theirs.storage_meta is not None
    assert ours.storage_meta.checkpoint_id == str(tmp_path / "g")
    assert isinstance(ours.storage_meta.save_id, str) and ours.storage_meta.save_id
    assert writer.save_id == ours.storage_meta.save_id  # FileSystemWriter.save_id, after its save
    reader = gpuckpt.dcp.Reader(tmp_path / "g")
    read = reader.read_metadata()
    assert read.version == theirs.version
    assert read.storage_meta is not None and read.storage_meta.save_id == ours.storage_meta.save_id
    assert read.storage_meta.load_id == reader.load_id  # as FileSystemReader's (load_id)
    again = dcp.save(src, storage_writer=writer)
    assert again.storage_meta is not None and again.storage_meta.save_id != ours.storage_meta.save_id
    assert writer.save_id == again.storage_meta.save_id
    reader.reset()
    read = reader.read_metadata()
    assert read.storage_meta is not None and read.storage_meta.save_id == again.storage_meta.save_id
    assert read.storage_meta.load_id == reader.load_id and isinstance(reader.load_id, str)
    # a checkpoint gpuckpt.save wrote is shown to DCP in the same version
    gpuckpt.save({"w": np.ones(2)}, tmp_path / "native")
    assert gpuckpt.dcp.Reader(tmp_path / "native").read_metadata().version == theirs.version


def test_a_torch_bool_view_of_other_bytes_is_stored_as_0_and_1(tmp_path: Path) -> None:
    """``u8.view(torch.bool)`` holds bytes 0-4: gpuckpt.save and the DCP writer store 0 and 1 (what
    TensorStore accepts), the tensor itself keeps its bytes, and its truth values come back."""
    raw = (torch.arange(60, dtype=torch.uint8) * 37 % 5).reshape(6, 10)
    mask = raw.view(torch.bool)
    truth = raw.numpy() != 0
    gpuckpt.save({"m": mask}, tmp_path / "g", chunk_bytes=16)
    dcp.save({"m": mask, "step": 1}, storage_writer=gpuckpt.dcp.Writer(tmp_path / "d", chunk_bytes=16))
    assert int(raw.max()) == 4  # the caller's tensor is not rewritten
    ts = pytest.importorskip("tensorstore")
    for c in ("g", "d"):
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / c / "m")}}
        stored = np.asarray(ts.open(spec).result().read().result())  # refuses a stored byte of 2
        assert stored.view(np.uint8).max() == 1 and np.array_equal(stored, truth)
    target = {"m": torch.zeros(6, 10, dtype=torch.bool), "step": 0}
    dcp.load(target, storage_reader=gpuckpt.dcp.Reader(tmp_path / "d"))
    assert target["m"].view(torch.uint8).max() == 1 and np.array_equal(target["m"].numpy(), truth)
