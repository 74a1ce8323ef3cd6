"""``convert --to torch``: a gpuckpt checkpoint becomes the file DCP's ``dcp_to_torch_save`` writes.

The reference is DCP itself: the same state saved with ``FileSystemWriter`` and
converted by ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``.
Both files are loaded and compared tensor by tensor, bit for bit (dtype, shape,
strides, bytes), plain values by equality. Checkpoints of several ranks are
compared in ``test_dcp_distributed.py``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

import torch.distributed.checkpoint as dcp  # noqa: E402 - after the skip
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

import gpuckpt  # noqa: E402
import gpuckpt.dcp  # noqa: E402
from gpuckpt.convert import convert  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]

ROOT = Path(__file__).resolve().parents[2]


def same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` equal: tensors bit for bit (dtype, shape, strides, bytes), containers of
    the same type and keys, BytesIO by bytes and position, other values by ``==``."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), where
        bits = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        assert torch.equal(*bits), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}.{i}")
    elif isinstance(a, io.BytesIO):
        assert (a.getvalue(), a.tell()) == (b.getvalue(), b.tell()), where
    else:
        assert a == b, (where, a, b)


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    model: dict[str, Any] = {
        "f32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(4, 6, generator=g).bfloat16(),
        "f16": torch.randn(3, generator=g).half(),
        "f8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.arange(-4, 8),
        "u8": torch.arange(10, dtype=torch.uint8),
        "bool": torch.rand(6, generator=g) > 0.5,
        "c64": torch.randn(3, dtype=torch.complex64, generator=g),
        "cl": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "view": torch.randn(6, 8, generator=g)[1:5, ::2],
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(-0.0),
        "nan": torch.tensor([float("nan"), float("inf"), -float("inf")]),
    }
    return {
        "model": model,
        "layers": [torch.ones(2), {"b": torch.full((3,), 2.0)}],  # a list DCP descends into
        "pair": (torch.zeros(2), 5),  # a tuple: one value for DCP
        "step": 12,
        "lr": 3e-4,
        "name": "run-1",
        "none": None,
        "milestones": [10, 20],
        "nested": {"deep": {"n": 5, "w": torch.eye(3)}},
    }


def reference(sd: dict[str, Any], d: str) -> dict[str, Any]:
    """What DCP's own tools write: FileSystemWriter, then dcp_to_torch_save."""
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(d, "fs")))
    dcp_to_torch_save(os.path.join(d, "fs"), os.path.join(d, "reference.pt"))
    return dict(torch.load(os.path.join(d, "reference.pt"), weights_only=True))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUCKPT_DEBUG": "", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "gpuckpt.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_dcp_saved_checkpoint_converts_as_dcp_to_torch_save_does() -> None:
    sd = state()
    with tempfile.TemporaryDirectory() as d:
        want = reference(sd, d)
        ckpt = os.path.join(d, "gpuckpt")
        dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(ckpt))
        res = convert(ckpt, os.path.join(d, "api.pt"), target_format="torch")
        assert (res.source_format, res.target_format) == ("gpuckpt", "torch")
        # tensors: the model's, 2 in layers, 1 in pair, nested.deep.w; plain values as a save
        # stores them: pair.1, step, lr, name, none, milestones (one list), nested.deep.n
        assert (res.tensors, res.objects) == (len(sd["model"]) + 4, 7)
        r = cli("convert", ckpt, os.path.join(d, "cli.pt"), "--to", "torch", "--quiet")
        assert r.returncode == 0, r.stderr
        assert "(gpuckpt) -> " in r.stdout and "(torch)" in r.stdout
        for name in ("api.pt", "cli.pt"):
            # loadable without pickle: the content is tensors and plain values
            same(dict(torch.load(os.path.join(d, name), weights_only=True)), want, name)
        # --to auto keeps its meaning: a .pt destination is a gpuckpt checkpoint
        assert convert(ckpt, os.path.join(d, "auto.pt")).target_format == "gpuckpt"
        assert (Path(d) / "auto.pt" / "zarr.json").is_file()


def test_native_gpuckpt_checkpoint_converts_as_dcp_would_have_saved_it() -> None:
    sd = state()
    with tempfile.TemporaryDirectory() as d:
        want = reference(sd, d)
        ckpt = os.path.join(d, "native")
        gpuckpt.save(sd, ckpt)
        convert(ckpt, os.path.join(d, "native.pt"), target_format="torch")
        same(dict(torch.load(os.path.join(d, "native.pt"), weights_only=True)), want)
        # NumPy arrays in a native state are tensors in the file, as DCP loads them
        gpuckpt.save({"a": np.arange(6, dtype=np.int32).reshape(2, 3), "k": "v"}, os.path.join(d, "np"))
        convert(os.path.join(d, "np"), os.path.join(d, "np.pt"), target_format="torch")
        back = torch.load(os.path.join(d, "np.pt"), weights_only=True)
        same(back, {"a": torch.arange(6, dtype=torch.int32).reshape(2, 3), "k": "v"})


def test_the_counts_it_reports_are_those_inspect_reports(tmp_path: Path) -> None:
    """A list or tuple of plain values is one plain value, as a save stores it and ``inspect``
    lists it, not one per element; a list holding a tensor is entered."""
    sd = {
        "model": {"w": torch.ones(2, 3), "b": torch.zeros(3)},
        "optim": {
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}],
            "state": {0: {"step": 3, "exp_avg": torch.ones(3)}},
        },
        "layers": [torch.ones(2), "x", 5],
        "names": ["a", "b", "c"],
        "empty": [],
        "epoch": 4,
    }
    gpuckpt.save(sd, tmp_path / "c")
    r = cli("inspect", "--json", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    totals = json.loads(r.stdout)["totals"]
    assert (totals["tensors"], totals["objects"]) == (4, 9)
    res = convert(tmp_path / "c", tmp_path / "api.pt", target_format="torch")
    assert (res.tensors, res.objects) == (4, 9)
    r = cli("convert", str(tmp_path / "c"), str(tmp_path / "cli.pt"), "--to", "torch", "--quiet")
    assert r.returncode == 0, r.stderr
    assert ": 4 tensors, " in r.stdout and ", 9 plain values" in r.stdout, r.stdout
    # the same counts as a conversion to safetensors, which counts the stored entries
    st = convert(tmp_path / "c", tmp_path / "m.safetensors")
    assert (st.tensors, st.objects) == (res.tensors, res.objects)


def test_bytesio_and_pickled_values_follow_the_readers_rules() -> None:
    """BytesIO values need no allow_pickle (the file then needs weights_only=False, as DCP's
    does); other pickled objects need allow_pickle, with a typed error (not DCP's
    CheckpointException) and nothing written."""
    blob = io.BytesIO(b"loader state\x00")
    blob.seek(3)
    sd = {"w": torch.ones(2), "loader": blob}
    with tempfile.TemporaryDirectory() as d:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(d, "fs")))
        dcp_to_torch_save(os.path.join(d, "fs"), os.path.join(d, "reference.pt"))
        dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(os.path.join(d, "c")))
        convert(os.path.join(d, "c"), os.path.join(d, "c.pt"), target_format="torch")
        same(
            torch.load(os.path.join(d, "c.pt"), weights_only=False),
            torch.load(os.path.join(d, "reference.pt"), weights_only=False),
        )
        dcp.save({"frac": Fraction(1, 3)}, storage_writer=gpuckpt.dcp.Writer(os.path.join(d, "f")))
        with pytest.raises(gpuckpt.UnsafeCheckpointError, match="allow_pickle"):
            convert(os.path.join(d, "f"), os.path.join(d, "f.pt"), target_format="torch")
        assert not os.path.exists(os.path.join(d, "f.pt"))
        r = cli("convert", os.path.join(d, "f"), os.path.join(d, "f.pt"), "--to", "torch", "--quiet")
        assert r.returncode == 1 and r.stderr.startswith("gpuckpt: error: ") and "allow" in r.stderr
        convert(os.path.join(d, "f"), os.path.join(d, "f.pt"), target_format="torch", allow_pickle=True)
        assert torch.load(os.path.join(d, "f.pt"), weights_only=False) == {"frac": Fraction(1, 3)}


def test_destination_rules_and_other_sources(tmp_path: Path) -> None:
    sd = {"w": torch.arange(4.0), "bf": torch.ones(3).bfloat16(), "n": 2}
    dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c"))
    (tmp_path / "m.pt").write_bytes(b"there")
    with pytest.raises(FileExistsError):
        convert(tmp_path / "c", tmp_path / "m.pt", target_format="torch")
    assert (tmp_path / "m.pt").read_bytes() == b"there"
    convert(tmp_path / "c", tmp_path / "m.pt", target_format="torch", overwrite=True)
    same(torch.load(tmp_path / "m.pt", weights_only=True), sd)
    assert [p.name for p in tmp_path.iterdir() if "gpuckpt-tmp" in p.name] == []
    with pytest.raises(gpuckpt.UnsupportedValueError, match="local paths"):
        convert(tmp_path / "c", "s3://bucket/m.pt", target_format="torch")
    # a DCP directory: DCP's own conversion, behind the same trust flag as every read of it
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "fs"))
    with pytest.raises(gpuckpt.UnsafeCheckpointError, match="trust_pickle_metadata"):
        convert(tmp_path / "fs", tmp_path / "fs.pt", target_format="torch")
    convert(tmp_path / "fs", tmp_path / "fs.pt", target_format="torch", trust_pickle_metadata=True)
    same(torch.load(tmp_path / "fs.pt", weights_only=True), sd)
    # safetensors (and torch.save) sources: their tensors, bit for bit
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    torch.save(tensors, tmp_path / "t.pt")
    convert(tmp_path / "t.pt", tmp_path / "m.safetensors")
    convert(tmp_path / "m.safetensors", tmp_path / "st.pt", target_format="torch")
    same(torch.load(tmp_path / "st.pt", weights_only=True), tensors)
