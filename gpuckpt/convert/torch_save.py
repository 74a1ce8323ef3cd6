"""Writing ``torch.save`` files: the whole state dict, as DCP's ``dcp_to_torch_save`` writes it.

``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` loads a DCP
directory through ``FileSystemReader`` with its ``_EmptyStateDictLoadPlanner``
(which rebuilds the state dict, nesting included, from the checkpoint's
metadata) and ``torch.save``-s the result. :func:`dcp_state` does the same
load through any DCP ``StorageReader``; for a gpuckpt checkpoint that is
:class:`gpuckpt.dcp.Reader`, so a checkpoint written by ``dcp.save`` through
:class:`gpuckpt.dcp.Writer` (on any number of ranks: its tensors are whole),
or by :func:`gpuckpt.save`, becomes the file DCP would have written, with
DCP's values unpickled only as the Reader allows. The file is written
atomically (temporary file, fsync, rename).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from gpuckpt.convert.safetensors_io import published_file
from gpuckpt.convert.torch_io import VIEW_AS, import_torch
from gpuckpt.errors import CheckpointExistsError, UnsafeCheckpointError, UnsupportedValueError

__all__ = ["count", "dcp_state", "gpuckpt_state", "numpy_to_torch", "write_torch_save"]

_TORCH_OF = {np.dtype(np_dtype): name for name, (_, np_dtype) in VIEW_AS.items()}


def dcp_state(reader: Any) -> dict[str, Any]:
    """The whole state dict behind the DCP ``StorageReader`` ``reader``, in one process, loaded
    as ``dcp_to_torch_save`` loads it (torch tensors, DCP's nesting, its values)."""
    import_torch()
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except CheckpointException as exc:
        # one process: the one failure, as itself (CheckpointException is a BaseException,
        # which ``except Exception`` misses, and names no type callers can handle)
        causes = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        if len(causes) == 1 and isinstance(causes[0], Exception):
            raise causes[0] from None
        raise
    return state


def gpuckpt_state(
    path: Any,
    *,
    allow_pickle: bool,
    threads: int | None,
    storage_options: dict[str, Any] | None,
) -> dict[str, Any]:
    """The state dict of the gpuckpt checkpoint at ``path`` (a directory or URL) as DCP loads
    it through :class:`gpuckpt.dcp.Reader` (see :func:`dcp_state`)."""
    import_torch()
    import gpuckpt.dcp

    reader = gpuckpt.dcp.Reader(
        path, allow_pickle=allow_pickle, threads=threads, storage_options=storage_options
    )
    try:
        return dcp_state(reader)
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(
            f"{path}: {exc}; to convert it, pass allow_pickle=True (--allow-pickle)"
        ) from None


def numpy_to_torch(value: Any, fqn: str = "") -> Any:
    """``value`` with every NumPy array in it (dicts, lists, tuples) a CPU tensor of the same
    bits, dtype and strides (bfloat16 and float8 through integers of their size)."""
    torch = import_torch()
    if isinstance(value, np.ndarray):
        name = _TORCH_OF.get(value.dtype)
        if name is not None:
            as_int, _ = VIEW_AS[name]
            return torch.from_numpy(value.view(as_int)).view(getattr(torch, name))
        try:
            return torch.from_numpy(value)
        except (TypeError, ValueError) as exc:
            raise UnsupportedValueError(
                f"tensor {fqn!r} has dtype {value.dtype}, which torch cannot hold ({exc}); "
                "convert it in the source or keep the gpuckpt format"
            ) from None
    if isinstance(value, dict):
        return {k: numpy_to_torch(v, f"{fqn}.{k}" if fqn else str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [numpy_to_torch(v, f"{fqn}.{i}") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value


def count(state: Any) -> tuple[int, int, int]:
    """``(tensors, plain values, tensor bytes)`` of a state dict of torch tensors, counted as a
    save stores them and ``gpuckpt inspect`` lists them (:mod:`gpuckpt.state`): dicts are
    entered, a list or tuple is entered where it holds a tensor or a dict somewhere and is
    otherwise one plain value (``"betas": (0.9, 0.999)`` is one, not two)."""
    torch = import_torch()
    tensors = values = nbytes = 0
    todo = [state]
    while todo:
        value = todo.pop()
        if isinstance(value, torch.Tensor):
            tensors += 1
            nbytes += value.numel() * value.element_size()
        elif isinstance(value, dict):
            todo.extend(value.values())
        elif isinstance(value, (list, tuple)) and _holds_entries(value, torch.Tensor):
            todo.extend(value)
        else:
            values += 1
    return tensors, values, nbytes


def _holds_entries(seq: list[Any] | tuple[Any, ...], tensor: type) -> bool:
    """Whether a save enters ``seq``: it holds a tensor or a dict, at any depth."""
    todo: list[Any] = list(seq)
    while todo:
        value = todo.pop()
        if isinstance(value, (tensor, dict)):
            return True
        if isinstance(value, (list, tuple)):
            todo.extend(value)
    return False


def write_torch_save(state: Any, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
    """``torch.save(state)`` into ``path`` atomically (temporary file, fsync, rename)."""
    torch = import_torch()
    path = Path(path)
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise CheckpointExistsError(f"{path} already exists; pass overwrite=True (--overwrite) to replace it")
    with published_file(path, overwrite) as tmp, open(tmp, "xb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
