"""The cyclic garbage collector, paused while a save or load makes millions of objects that
live until it ends."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused_gc"]


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector for a load.

    Parsing the metadata of a checkpoint with many tensors creates millions of
    small objects (the JSON tree, then the metadata objects); each collection
    walks all of them again, for nothing, since none is garbage until the load
    ends (a quarter of the time of a 10,000-tensor load). Reference counting still
    frees everything as usual; the collector resumes, if it was on, when the
    load returns or fails.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
