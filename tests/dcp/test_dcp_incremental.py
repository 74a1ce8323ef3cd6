"""gpuckpt.dcp.Writer(path, base=...): an incremental save under torch.distributed.checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

import torch.distributed.checkpoint as dcp  # noqa: E402 - after the skip

import gpuckpt  # noqa: E402
import gpuckpt.dcp  # noqa: E402
from gpuckpt.errors import IncrementalBaseWarning  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "frozen": torch.randn(256, 64, generator=g),  # 64 KiB: 4 chunks of 16 KiB
        "adapter": torch.randn(8, 64, generator=g),
        "step": 1,
    }


def chunk_links(path: Path) -> dict[str, int]:
    return {
        f"{d.name}/{f.name}": f.stat().st_nlink
        for d in path.iterdir()
        if d.is_dir()
        for f in d.iterdir()
        if f.name != "zarr.json"
    }


def test_writer_with_base_links_unchanged_chunks(tmp_path: Path) -> None:
    sd = state()
    dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c0", chunk_bytes=16 << 10, content_hash=True))
    sd["adapter"] += 1
    sd["step"] = 2
    dcp.save(
        sd, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c1", chunk_bytes=16 << 10, base=tmp_path / "c0")
    )
    links = chunk_links(tmp_path / "c1")
    assert {k for k, n in links.items() if n == 2} == {f"frozen/c.{i}.0" for i in range(4)}
    assert links["adapter/c.0.0"] == 1
    target = {"frozen": torch.zeros(256, 64), "adapter": torch.zeros(8, 64), "step": 0}
    dcp.load(target, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c1"))
    assert torch.equal(target["frozen"], sd["frozen"]) and torch.equal(target["adapter"], sd["adapter"])
    assert target["step"] == 2
    got = gpuckpt.load_state_dict(tmp_path / "c1")
    assert got["frozen"].tobytes() == sd["frozen"].numpy().tobytes()


def test_writer_with_missing_base_warns_and_writes(tmp_path: Path) -> None:
    sd = state()
    with pytest.warns(IncrementalBaseWarning, match="cannot be used"):
        dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c1", base=tmp_path / "nothing"))
    assert all(n == 1 for n in chunk_links(tmp_path / "c1").values())
    assert os.path.exists(tmp_path / "c1" / "zarr.json")


def test_writer_hashes_go_to_the_chunk_table_and_serve_the_next_save(tmp_path: Path) -> None:
    from gpuckpt.format.records import TABLE_KEY

    w = torch.arange(4200 * 4, dtype=torch.float32).reshape(4200, 4)  # 4,200 chunks of 16 bytes
    sd = {"w": w, "step": 1}
    dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c0", chunk_bytes=16, content_hash=True))
    md = gpuckpt.read_metadata(tmp_path / "c0")
    assert md.version == "2" and set(md.storage_data[TABLE_KEY]["columns"]) == {"crc32c", "xxh3t", "head"}
    sd["w"] = w.clone()
    sd["w"][17] = -1
    dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c1", chunk_bytes=16, base=tmp_path / "c0"))
    links = chunk_links(tmp_path / "c1")
    assert {k for k, n in links.items() if k.startswith("w/") and n == 1} == {"w/c.17.0"}
    assert sum(1 for k in links if k.startswith("w/")) == 4200
    assert gpuckpt.load_state_dict(tmp_path / "c1")["w"].tobytes() == sd["w"].numpy().tobytes()
