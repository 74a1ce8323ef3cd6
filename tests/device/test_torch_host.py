"""PyTorch CPU tensors through DLPack (skipped where torch is not installed).

The tests import torch themselves, so that a run with ``-m "not torch"`` deselects
them without importing this module's dependencies.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import gpuckpt

pytestmark = pytest.mark.torch


def test_torch_cpu_tensors_round_trip_in_place(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    w = torch.randn(64, 32, requires_grad=True)
    bf = torch.randn(40, 8).to(torch.bfloat16)
    f8 = torch.randn(16).to(torch.float8_e4m3fn)
    cl = torch.randn(4, 16, 5, 5).to(memory_format=torch.channels_last)
    props = gpuckpt.TensorProperties.create_from_tensor(w)
    assert props.requires_grad and props.dtype == np.float32
    assert gpuckpt.TensorProperties.create_from_tensor(bf).dtype == ml_dtypes.bfloat16
    assert gpuckpt.TensorProperties.create_from_tensor(cl).memory_format is gpuckpt.channels_last
    gpuckpt.save({"w": w, "bf": bf, "f8": f8, "cl": cl}, tmp_path / "c")
    back = gpuckpt.load_state_dict(tmp_path / "c")
    assert back["bf"].dtype == ml_dtypes.bfloat16
    assert np.array_equal(back["bf"].view(np.uint16), bf.view(torch.int16).numpy().view(np.uint16))
    assert back["cl"].strides == tuple(s * 4 for s in cl.stride())
    tgt = {
        "w": torch.zeros(64, 32),
        "bf": torch.zeros(40, 8, dtype=torch.bfloat16),
        "cl": torch.zeros(4, 16, 5, 5).to(memory_format=torch.channels_last),
        "f8": torch.zeros(16, dtype=torch.float8_e4m3fn),
    }
    gpuckpt.load(tgt, tmp_path / "c")
    assert torch.equal(tgt["w"], w.detach()) and torch.equal(tgt["bf"], bf) and torch.equal(tgt["cl"], cl)
    assert torch.equal(tgt["f8"].view(torch.uint8), f8.view(torch.uint8))


def test_lazily_negated_and_conjugated_tensors_are_saved_as_their_values(tmp_path: Path) -> None:
    """``z.conj()`` and ``z.conj().imag`` hold in memory the values before the negation: a save
    stores the values (the negation was lost, and a conjugate refused); a load into such a view
    is refused (it would fill the memory, not the values), and ``float8_e8m0fnu`` round-trips."""
    torch = pytest.importorskip("torch")
    z = torch.complex(torch.arange(4.0), torch.arange(4.0))
    neg, conj = z.conj().imag, z.conj()
    assert neg.is_neg() and conj.is_conj()
    e8 = torch.tensor([0.5, 1.0, 4.0, 256.0]).to(torch.float8_e8m0fnu)
    gpuckpt.save({"neg": neg, "conj": conj, "e8": e8}, tmp_path / "c")
    back = gpuckpt.load_state_dict(tmp_path / "c")
    assert back["neg"].tolist() == [-0.0, -1.0, -2.0, -3.0]
    assert back["conj"].tolist() == conj.resolve_conj().numpy().tolist()
    assert np.array_equal(back["e8"].view(np.uint8), e8.view(torch.uint8).numpy())
    target = {"neg": torch.zeros(4).neg()._neg_view(), "conj": torch.zeros(4, dtype=torch.complex64)}
    assert target["neg"].is_neg()
    with pytest.raises(gpuckpt.ReadOnlyTargetError, match="tensor 'neg'"):
        gpuckpt.load(target, tmp_path / "c", strict=False)


def test_tensors_that_are_not_dense_and_strided_are_refused_naming_their_key(tmp_path: Path) -> None:
    """Sparse, quantized and meta tensors cannot be stored (nor a meta tensor loaded into): each
    refusal names the entry and says what to pass instead; nothing is written; and a target
    made by expand() (elements sharing memory) is refused before anything is read."""
    torch = pytest.importorskip("torch")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors' deprecation
        kinds = {
            "sparse": torch.eye(3).to_sparse(),
            "quantized": torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
            "meta": torch.empty(3, device="meta"),
        }
    for name, t in kinds.items():
        with pytest.raises(
            gpuckpt.UnsupportedValueError, match=rf"tensor 'model\.l7\.{name}': .*to_dense\(\)"
        ):
            gpuckpt.save({"model": {"l7": {name: t}}}, tmp_path / name)
        assert not (tmp_path / name).exists()
    gpuckpt.save({"model": {"w": torch.arange(12.0).reshape(3, 4)}}, tmp_path / "ok")
    with pytest.raises(gpuckpt.UnsupportedValueError, match=r"tensor 'model\.w': .*meta"):
        gpuckpt.load({"model": {"w": torch.empty(3, 4, device="meta")}}, tmp_path / "ok")
    shared = torch.zeros(1).expand(3, 4)
    with pytest.raises(gpuckpt.ReadOnlyTargetError, match=r"'model\.w'.*share memory"):
        gpuckpt.load({"model": {"w": shared}}, tmp_path / "ok")
    assert not shared.any()


def test_empty_torch_tensors_load_in_place(tmp_path: Path) -> None:
    # torch.empty(0, 4) reaches NumPy through DLPack with strides (0, 0): it has no elements to
    # share, and was once refused as a broadcast view
    torch = pytest.importorskip("torch")
    gpuckpt.save({"e": np.empty((0, 4), np.float32), "f": np.empty((3, 0, 2), np.int64)}, tmp_path / "c")
    target = {"e": torch.empty(0, 4), "f": torch.empty(3, 0, 2, dtype=torch.int64)}
    gpuckpt.load(target, tmp_path / "c")
    assert tuple(target["e"].shape) == (0, 4) and tuple(target["f"].shape) == (3, 0, 2)
