"""Locating the CUDA sources of the channels-last kernels and compiling them.

The source lives in the top-level ``kernels/`` folder of a source checkout and
in ``gpuckpt/_kernels/`` of an installed wheel. It is compiled at run time
through CuPy (NVRTC), lazily on first use, once per device and per part of
the source (the launches compile only the kernels they need); importing this
module never imports CuPy.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuckpt.device.kernel_checks import SUPPORTED_ITEMSIZES

__all__ = ["KERNEL_FILE", "kernel_source", "kernel_source_dir", "load_module", "module_part_options"]

#: Name of the CUDA source file inside :func:`kernel_source_dir`.
KERNEL_FILE = "channels_last.cu"


def kernel_source_dir() -> Path:
    """Return the folder that holds the CUDA kernel sources.

    Returns
    -------
    pathlib.Path
        ``gpuckpt/_kernels`` inside an installed package, else the top-level
        ``kernels/`` folder of a source checkout.

    Raises
    ------
    FileNotFoundError
        If neither location holds :data:`KERNEL_FILE`.
    """
    package_dir = Path(__file__).resolve().parent.parent
    candidates = (package_dir / "_kernels", package_dir.parent / "kernels")
    for folder in candidates:
        if (folder / KERNEL_FILE).is_file():
            return folder
    searched = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"{KERNEL_FILE} not found; searched {searched}")


def kernel_source() -> str:
    """Return the text of the CUDA kernel source.

    Returns
    -------
    str
        Contents of :data:`KERNEL_FILE`.
    """
    return (kernel_source_dir() / KERNEL_FILE).read_text(encoding="utf-8")


_modules: dict[tuple[int, tuple[str, ...], str | None], Any] = {}
_modules_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    global _modules_lock
    _modules_lock = threading.Lock()  # it may have been held by a thread that the child does not have


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_after_fork)


def module_part_options(part: str | None) -> tuple[str, ...]:
    """NVRTC options that make the source define only ``part``'s kernels.

    Parameters
    ----------
    part : str or None
        ``"tiled"`` or ``"micro"`` (those kernels for every element size),
        ``"px1"``, ``"px2"``, ``"px4"`` or ``"px8"`` (the pixel kernels of
        one element size), or None for everything.

    Returns
    -------
    tuple of str
        ``-D`` options (``GK_BUILD_TILED``, ``GK_BUILD_MICRO``,
        ``GK_BUILD_PX_SIZES``).

    Raises
    ------
    ValueError
        For an unknown part.
    """
    if part is None:
        return ()
    if part == "tiled":
        return ("-DGK_BUILD_TILED=1", "-DGK_BUILD_MICRO=0", "-DGK_BUILD_PX_SIZES=0")
    if part == "micro":
        return ("-DGK_BUILD_TILED=0", "-DGK_BUILD_MICRO=1", "-DGK_BUILD_PX_SIZES=0")
    if part.startswith("px") and part[2:] in {str(es) for es in SUPPORTED_ITEMSIZES}:
        return ("-DGK_BUILD_TILED=0", "-DGK_BUILD_MICRO=0", f"-DGK_BUILD_PX_SIZES={part[2:]}")
    raise ValueError(
        f"kernel module part {part!r} is not one of 'tiled', 'micro', 'px1', 'px2', 'px4', 'px8' or None"
    )


def load_module(device_id: int | None = None, *, options: Sequence[str] = (), part: str | None = None) -> Any:
    """Compile (once per device and part) and return kernels as a CuPy module.

    Parameters
    ----------
    device_id : int, optional
        CUDA device to compile for; the current device when omitted.
    options : sequence of str, optional
        Extra NVRTC options; normal callers pass nothing.
    part : str, optional
        Compile only these kernels (see :func:`module_part_options`): the
        launches compile the tiled kernels and each element size's pixel
        kernels separately, on first use.  Everything when omitted.

    Returns
    -------
    cupy.RawModule
        The compiled module, loaded on ``device_id``.
    """
    import cupy

    if device_id is None:
        device_id = cupy.cuda.Device().id
    key = (int(device_id), tuple(options), part)
    module = _modules.get(key)  # compiled already: no lock needed to read it
    if module is not None:
        return module
    part_options = module_part_options(part)
    with _modules_lock:
        module = _modules.get(key)
        if module is None:
            with cupy.cuda.Device(device_id):
                module = cupy.RawModule(code=kernel_source(), options=("-std=c++17", *part_options, *options))
                # Compile now, on this device: RawModule would otherwise
                # compile for whichever device is current at first use.
                module.compile()
            _modules[key] = module
    return module


# --------------------------------------------------------------------------
# Validation (pure Python; works for NumPy and CuPy arrays alike)
