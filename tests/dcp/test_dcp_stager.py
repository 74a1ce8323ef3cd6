"""gpuckpt.dcp.Stager on CPU tensors: snapshots equal to their tensors, a layout kept while it holds,
staging memory the size of the state."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

import torch.distributed.checkpoint as dcp  # noqa: E402 - after the skip

import gpuckpt  # noqa: E402
import gpuckpt.dcp  # noqa: E402
from gpuckpt.device.staging import aligned_bytes  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]

PAGE = 4096


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 10, generator=g)
    return {
        "w": torch.randn(5, 7, generator=g),
        "p": torch.nn.Parameter(torch.randn(4, 3, generator=g)),  # requires grad
        "t": base.t(),  # a transposed view
        "strided": base[:, ::3],  # a gathered view
        "cl": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "bf": torch.randn(8, generator=g).bfloat16(),
        "b": torch.tensor([True, False, True]),
        "i": torch.arange(7, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(2.5),
        "nested": {"list": [torch.ones(3), 4], "tuple": (torch.full((2,), 7.0), "x")},
    }


def _tensors(node: Any) -> list[Any]:
    if isinstance(node, torch.Tensor):
        return [node]
    if isinstance(node, dict):
        return [t for v in node.values() for t in _tensors(v)]
    if isinstance(node, (list, tuple)):
        return [t for v in node for t in _tensors(v)]
    return []


def _assert_snapshot_of(snap: dict[str, Any], state: dict[str, Any]) -> None:
    got, want = _tensors(snap), _tensors(state)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.device.type == "cpu" and not g.requires_grad
        assert torch.equal(g, w.detach())
        assert g.numel() == 0 or g.data_ptr() != w.data_ptr()  # a copy, not the tensor


def test_stager_snapshots_views_parameters_and_dtypes_of_cpu_tensors() -> None:
    stager = gpuckpt.dcp.Stager()
    state = _state()
    snap = stager.stage(state)
    _assert_snapshot_of(snap, state)
    # the memory layout is kept: channels-last stays channels-last, views become dense copies
    assert snap["cl"].is_contiguous(memory_format=torch.channels_last)
    assert snap["t"].shape == (10, 6)
    assert snap["nested"]["list"][1] == 4 and snap["nested"]["tuple"][1] == "x"
    expected = {k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        for t in _tensors(state):
            if t.dtype.is_floating_point:
                t.add_(1.0)  # later changes do not reach the snapshot
    for k, v in expected.items():
        assert torch.equal(snap[k], v)
    del snap
    gc.collect()
    stager.close()


def test_stager_keeps_the_layout_while_dtypes_shapes_and_strides_hold() -> None:
    """The layout of a state in staging memory is worked out once; any change of a tensor's
    dtype, shape or strides (a replaced tensor, an in-place resize, a new ``.data``) makes it anew."""
    stager = gpuckpt.dcp.Stager()
    state = _state()
    stager.stage(state)
    layout = stager._layout
    assert layout is not None
    with torch.no_grad():
        state["w"].mul_(2.0)  # values change: the layout holds
    snap = stager.stage(state)
    assert stager._layout is layout
    _assert_snapshot_of(snap, state)
    del snap

    changes = [
        ("replaced by another shape", lambda s: s.__setitem__("w", torch.arange(12.0).reshape(3, 4))),
        ("another dtype", lambda s: s.__setitem__("i", s["i"].to(torch.int32))),
        ("resized in place", lambda s: s["nested"]["list"][0].resize_(5).fill_(3.0)),
        ("new .data with other strides", lambda s: setattr(s["p"], "data", torch.randn(3, 4).t())),
        ("channels-last made contiguous", lambda s: s.__setitem__("cl", s["cl"].contiguous())),
        ("a tensor more", lambda s: s.__setitem__("extra", torch.ones(2, 2))),
        ("a tensor less", lambda s: s.pop("extra")),
    ]
    for what, change in changes:
        change(state)
        snap = stager.stage(state)
        assert stager._layout is not layout, what
        layout = stager._layout
        _assert_snapshot_of(snap, state)
        del snap
    assert stager.stage(state)["cl"].is_contiguous()
    stager.close()


def test_stager_staging_memory_is_the_state_bytes_up_to_alignment(tmp_path: Path) -> None:
    """One arena, the size of the state's tensors (each rounded up to 4 KiB) and one page of
    alignment, reused by every later save of the same state."""
    state = {f"t{i}": torch.randn(1000 + 37 * i) for i in range(40)}
    state["big"] = torch.randn(300, 1001)
    want = sum(aligned_bytes(t.numel() * t.element_size()) for t in state.values()) + PAGE
    stager = gpuckpt.dcp.Stager()
    for i in range(3):
        dcp.async_save(
            state, storage_writer=gpuckpt.dcp.Writer(tmp_path / f"c{i}"), async_stager=stager
        ).result()
        assert stager.reserved_bytes == want
    got = gpuckpt.load_state_dict(tmp_path / "c2")
    assert all((got[k] == v.numpy()).all() for k, v in state.items())
    stager.close()
