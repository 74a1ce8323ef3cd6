"""gpuckpt.dcp.Writer with compression: DCP, gpuckpt and zarr-python read it back bit-exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

import torch.distributed.checkpoint as dcp  # noqa: E402 - after the skip
import zarr  # noqa: E402

import gpuckpt  # noqa: E402
import gpuckpt.dcp  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.mark.parametrize("compression", ["zstd", {"codec": "zstd", "level": 3}])
def test_the_dcp_writer_compresses_and_every_reader_decodes(tmp_path: Path, compression: object) -> None:
    g = torch.Generator().manual_seed(0)
    state = {
        "w": (torch.randn(256, 128, generator=g) * 0.02).bfloat16(),
        "m": torch.randn(64, 33, generator=g),
        "cl": torch.randn(2, 3, 5, 4, generator=g).to(memory_format=torch.channels_last),
        "step": 3,
    }
    dcp.save(state, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c", compression=compression))
    md = gpuckpt.read_metadata(tmp_path / "c")
    assert md.version == "4"
    assert all("codec" in e for e in md.storage_data["tensors"].values())
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    dcp.load(out, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c"))
    for k in ("w", "m", "cl"):
        assert torch.equal(out[k], state[k])
    z = zarr.open_array(str(tmp_path / "c" / "m"), mode="r")[...]
    assert np.array_equal(np.asarray(z), state["m"].numpy())
    doc = json.loads((tmp_path / "c" / "w" / "zarr.json").read_text())
    assert doc["codecs"][1]["name"] in ("blosc", "zstd")


def test_the_dcp_writers_auto_keeps_what_it_decided(tmp_path: Path) -> None:
    """The DCP Writer's "auto" plans from the shapes alone; the checkpoint says so, and what it
    decided (a local file system: nothing compressed on this machine's threads, or the
    floating-point tensors of 1 MiB or more where enough threads compress)."""
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(1024, 512, generator=g), "ids": torch.arange(1 << 19), "step": 3}
    dcp.save(state, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c", compression="auto"))
    why = gpuckpt.read_metadata(tmp_path / "c").planner_data["gpuckpt.why_compression"]
    assert why["sampled"] is False and why["store_bytes_per_s"] > 0
    assert why["decision"].startswith(("nothing compressed: planned from the shapes alone", "planned from"))
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    dcp.load(out, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c"))
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["ids"], state["ids"])


def test_the_dcp_writer_takes_compression_none_as_no_compression(tmp_path: Path) -> None:
    state = {"w": torch.randn(64, 32), "step": 3}
    dcp.save(state, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c", compression="none"))
    md = gpuckpt.read_metadata(tmp_path / "c")
    assert all("codec" not in e for e in md.storage_data["tensors"].values())
    out = {"w": torch.zeros(64, 32), "step": 0}
    dcp.load(out, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c"))
    assert torch.equal(out["w"], state["w"]) and out["step"] == 3
