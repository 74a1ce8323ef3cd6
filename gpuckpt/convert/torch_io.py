"""Reading PyTorch checkpoints: ``torch.save`` files and torch.distributed.checkpoint directories.

torch is an optional dependency, imported only when one of these is read.
``torch.save`` files are loaded with ``weights_only=True`` (tensors and
plain containers only, no arbitrary code). A DCP directory's ``.metadata``
file is a pickle, and unpickling runs code: it is read only when the caller
says it trusts it (``trust_pickle_metadata=True``, ``--trust-pickle-metadata``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from gpuckpt.errors import (
    CheckpointCorruptedError,
    GpuckptError,
    MetadataError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from gpuckpt.format.shapes import check_shape

__all__ = ["VIEW_AS", "check_trusted", "import_torch", "load_dcp", "load_torch_save", "torch_to_numpy"]

VIEW_AS = {  # torch dtypes NumPy lacks: reinterpret their bits
    "bfloat16": ("int16", ml_dtypes.bfloat16),
    "float8_e4m3fn": ("uint8", ml_dtypes.float8_e4m3fn),
    "float8_e5m2": ("uint8", ml_dtypes.float8_e5m2),
    "float8_e4m3fnuz": ("uint8", ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2fnuz": ("uint8", ml_dtypes.float8_e5m2fnuz),
    "float8_e8m0fnu": ("uint8", ml_dtypes.float8_e8m0fnu),
}


def import_torch() -> Any:
    """torch, or an error that says how to install it."""
    try:
        import torch
    except ImportError:
        raise UnsupportedValueError(
            "reading or writing PyTorch checkpoints (torch.save files, torch.distributed.checkpoint "
            "directories) needs torch, which is not installed; install it (pip install "
            "'gpuckpt[torch]') or convert from or to safetensors"
        ) from None
    return torch


def torch_to_numpy(t: Any, fqn: str = "") -> np.ndarray:
    """A host NumPy array with the tensor's exact bits, dtype and memory format."""
    torch = import_torch()
    if t.is_meta or t.layout != torch.strided:
        what = "a meta tensor (no data)" if t.is_meta else f"of layout {t.layout}"
        raise UnsupportedValueError(
            f"tensor {fqn!r} is {what}, which gpuckpt cannot store: store its dense values "
            "(tensor.to_dense(), or materialize it) instead"
        )
    t = t.detach().cpu()
    name = str(t.dtype).removeprefix("torch.")
    perm: tuple[int, ...] | None = None
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        perm = (0, 2, 3, 1)
    elif t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
        perm = (0, 2, 3, 4, 1)
    physical = t.permute(*perm).contiguous() if perm else t.contiguous()
    if name in VIEW_AS:
        as_int, np_dtype = VIEW_AS[name]
        arr = physical.view(getattr(torch, as_int)).numpy().view(np_dtype)
    else:
        try:
            arr = physical.numpy()
        except (TypeError, RuntimeError) as exc:
            raise UnsupportedValueError(
                f"tensor {fqn!r} has dtype {t.dtype}, which gpuckpt cannot store: {exc}"
            ) from None
    if perm:
        arr = arr.transpose([perm.index(a) for a in range(len(perm))])
    return np.asarray(arr)


def _to_numpy_tree(value: Any, torch: Any, source: Path, fqn: str = "") -> Any:
    if isinstance(value, torch.Tensor):
        # torch holds empty tensors of any size (no storage); NumPy does not
        check_shape(tuple(value.shape), value.element_size(), f"{source}: tensor {fqn!r}")
        return torch_to_numpy(value, fqn)
    if isinstance(value, dict):
        return {
            k: _to_numpy_tree(v, torch, source, f"{fqn}.{k}" if fqn else str(k)) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        items = [_to_numpy_tree(v, torch, source, f"{fqn}.{i}") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, torch.Size):
        return tuple(int(s) for s in value)
    return value


def _numpy_scalar_globals() -> list[Any]:
    """What a pickled NumPy scalar of a numeric or bool dtype names (``np.int64(7)``: the scalar
    constructor, ``np.dtype`` and its dtype class), for ``torch.load(weights_only=True)``: it
    rebuilds the scalar from its raw bytes and runs nothing else. Object and string dtypes stay
    refused (their classes are not listed)."""
    kinds = "?bhilqBHILQefdgFDG"  # bool, the integers, the floats and the complex types
    core = getattr(np, "_core", None) or np.core  # (numpy._core from NumPy 2 on)
    return [core.multiarray.scalar, np.dtype, *{type(np.dtype(k)) for k in kinds}]


def _torch_load(torch: Any, path: str | os.PathLike[str]) -> Any:
    """``torch.load`` with ``weights_only=True`` on the CPU, NumPy scalars allowed (a gpuckpt
    checkpoint's plain values exported with ``--to torch`` hold them, as DCP's own export would)."""
    with torch.serialization.safe_globals(_numpy_scalar_globals()):
        return torch.load(os.fspath(path), weights_only=True, map_location="cpu")


def load_torch_save(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A ``torch.save`` state dict, loaded with ``weights_only=True`` (NumPy scalars allowed), as
    NumPy arrays."""
    torch = import_torch()
    try:
        obj = _torch_load(torch, path)
    except (OSError, GpuckptError):
        raise
    except Exception as exc:  # torch's own errors of a damaged or hostile file name neither
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MetadataError(
            f"{path} cannot be read as a torch.save state dict with weights_only=True "
            f"({type(exc).__name__}: {text[:300]}); the file is damaged, not a torch.save file, or "
            "holds objects other than tensors and plain values"
        ) from exc
    if not isinstance(obj, dict):
        raise UnsupportedValueError(f"{path} holds a {type(obj).__name__}, not a state dict (a dict)")
    return {str(k): _to_numpy_tree(v, torch, Path(path), str(k)) for k, v in obj.items()}


def load_dcp(path: str | os.PathLike[str], *, trust_pickle_metadata: bool = False) -> dict[str, Any]:
    """A torch.distributed.checkpoint directory as one state dict of NumPy arrays.

    Its ``.metadata`` is a pickle: refused unless ``trust_pickle_metadata``.
    """
    path = Path(path)
    check_trusted(path, trust_pickle_metadata)
    torch = import_torch()
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="gpuckpt-dcp-") as tmp:
        out = Path(tmp) / "state.pt"
        try:
            dcp_to_torch_save(os.fspath(path), os.fspath(out))
        except CheckpointException as exc:  # a BaseException, which ``except Exception`` misses
            causes = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
            what = "; ".join(f"{type(c).__name__}: {c}" for c in causes)[:500]
            raise CheckpointCorruptedError(
                f"{path}: torch.distributed.checkpoint cannot read this directory ({what}); it is "
                "damaged or incomplete: copy or save it again"
            ) from None
        obj = _torch_load(torch, out)
    if not isinstance(obj, dict):
        raise UnsupportedValueError(f"{path} holds a {type(obj).__name__}, not a state dict")
    return {str(k): _to_numpy_tree(v, torch, Path(path), str(k)) for k, v in obj.items()}


def check_trusted(path: str | os.PathLike[str], trust_pickle_metadata: bool) -> None:
    """Refuse to read the DCP directory ``path`` (its ``.metadata`` is a pickle) unless trusted."""
    if not trust_pickle_metadata:
        raise UnsafeCheckpointError(
            f"{Path(path) / '.metadata'} is a pickle, and reading it can run arbitrary code; "
            "pass trust_pickle_metadata=True (--trust-pickle-metadata) if you trust where it came from"
        )
