"""Bounds on the shapes of tensors read from foreign files (safetensors, ``torch.save``): untrusted input.

A file may claim any shape: a safetensors header is JSON, a ``torch.save``
pickle rebuilds tensors of any size with an empty storage when one axis is
zero. NumPy refuses what it cannot hold with bare errors that name neither
the file nor the tensor ("Maximum allowed dimension exceeded", "array is too
big"), and gpuckpt's metadata holds at most :data:`MAX_DIMS` dimensions. Every
shape is checked here first, by the bounds gpuckpt's own readers apply.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gpuckpt.errors import MetadataError
from gpuckpt.format.reader import MAX_DIMS, MAX_EXTENT

__all__ = ["MAX_DIMS", "check_shape"]


def _brief(shape: Sequence[int]) -> str:
    """The shape for a message: a hostile one may have millions of axes of huge lengths."""
    text = str(list(shape[:8]))
    if len(shape) > 8:
        text = text[:-1] + f", ... ({len(shape)} axes)]"
    return text if len(text) <= 300 else text[:300] + "...]"


def check_shape(shape: Sequence[int], itemsize: int, where: str) -> None:
    """Refuse a ``shape`` (non-negative integers) no array of ``itemsize``-byte elements can have.

    At most :data:`MAX_DIMS` axes; each shorter than ``MAX_EXTENT`` (2**62), and
    the axes that are not empty together less than ``MAX_EXTENT`` bytes: an
    empty axis makes a tensor hold nothing, but NumPy still allocates by the
    others. ``where`` names the file and the tensor (``"m.safetensors: tensor 'w'"``).

    Raises
    ------
    MetadataError
        Naming ``where``, the shape and the bound it breaks.
    """
    fix = "the file is damaged or was not written for this tensor; export it again from its source"
    if len(shape) > MAX_DIMS:
        raise MetadataError(
            f"{where}: shape {_brief(shape)} has {len(shape)} dimensions, gpuckpt holds at most "
            f"{MAX_DIMS}; {fix} (or reshape the tensor to fewer dimensions first)"
        )
    for axis, n in enumerate(shape):
        if n >= MAX_EXTENT:
            raise MetadataError(
                f"{where}: shape {_brief(shape)} has axis {axis} of length {n}, longer than any array "
                f"can be (at most {MAX_EXTENT - 1}); {fix}"
            )
    # each factor < 2**62 and at most 32 of them: the product stays a small Python int
    span = math.prod(n for n in shape if n) * itemsize
    if span >= MAX_EXTENT:
        raise MetadataError(
            f"{where}: shape {_brief(shape)} spans {span} bytes of {itemsize}-byte elements along its "
            f"non-empty axes, more than any array can hold (at most {MAX_EXTENT - 1}); {fix}"
        )
