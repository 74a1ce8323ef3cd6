"""A part fetched by a restore is received straight into CPU tensors too (gpuckpt/tiers/placement.py):
the tensors the load fills through DLPack, when they are contiguous and writable; channels-last
ones and views sharing memory are received into a buffer. Loads from the bytes so received give
the saved tensors bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import gpuckpt  # noqa: E402 - after the skip
from gpuckpt.format.documents import ROOT_KEY  # noqa: E402
from gpuckpt.storage.stores import in_memory  # noqa: E402
from gpuckpt.tiers.placement import placement  # noqa: E402
from tests.received_parts import receive  # noqa: E402

pytestmark = pytest.mark.torch


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(4)
    return {
        "w": torch.randn(32, 16, generator=g),
        "p": torch.nn.Parameter(torch.randn(8, 3, generator=g)),
        "bf": torch.randn(64, generator=g).bfloat16(),
        "i": torch.arange(10, dtype=torch.int64),
        "cl": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "step": 9,
    }


def _targets() -> dict[str, Any]:
    return {
        "w": torch.zeros(32, 16),
        "p": torch.nn.Parameter(torch.zeros(8, 3)),
        "bf": torch.zeros(64, dtype=torch.bfloat16),
        "i": torch.zeros(10, dtype=torch.int64),
        "cl": torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "step": None,
    }


def test_contiguous_cpu_tensors_are_placed_and_loaded_bit_exact(tmp_path: Path) -> None:
    state = _state()
    path = tmp_path / "part"
    gpuckpt.save(state, path)
    target = _targets()
    targets = placement((path / ROOT_KEY).read_bytes(), "part", target)
    assert {rel.split("/")[0] for rel in targets} == {"w", "p", "bf", "i"}, targets.keys()
    files = receive(path, targets)
    assert torch.equal(target["w"], state["w"])  # the bytes arrived in the tensor itself
    with in_memory(files) as url:
        gpuckpt.load(target, url)
    for k in ("w", "p", "bf", "i", "cl"):
        assert torch.equal(target[k], state[k]), k
    assert target["step"] == 9


def test_cpu_tensors_sharing_memory_are_not_placed(tmp_path: Path) -> None:
    path = tmp_path / "part"
    gpuckpt.save({"a": torch.ones(8), "b": torch.ones(4)}, path)
    base = torch.zeros(8)
    target = {"a": base, "b": base[2:6]}  # b is a view into a
    assert placement((path / ROOT_KEY).read_bytes(), "part", target) == {}
