"""A save into a shared directory killed at its K-th rename (for test_shared_dir.py).

``python into_crash_child.py DIR K``: saves ``new_state()`` over the checkpoint in DIR
(which holds other files too) with ``overwrite=True``; just before the K-th rename of
the publication (moving the earlier checkpoint aside, moving the new names in, the new
root document last) the process SIGKILLs itself. K past the last rename: killed right
after the publication, before the set-aside copy is removed.

``python into_crash_child.py DIR K cleanup``: runs only the cleanup a save to DIR does first
(which undoes a dead publication), killed just before its K-th rename; K = 0: killed while
it deletes the first entry it took out of DIR, after that entry's ``zarr.json`` went.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np

import gpuckpt
from gpuckpt.storage.local import fsutil, shared_dir
from gpuckpt.storage.local.leftovers import cleanup_stale_temporaries


def old_state() -> dict[str, Any]:
    return {"a": np.arange(6.0), "b": np.full(3, 7, np.int32), "step": 1}


def new_state() -> dict[str, Any]:
    return {"a": np.arange(6.0) * 2, "c": np.ones((2, 2), np.float32), "step": 2}


def main(directory: str, kill_at: str, mode: str = "save") -> None:
    k, calls = int(kill_at), 0

    def counted(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == k:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return call

    shared_dir.os.rename = counted(os.rename)  # type: ignore[attr-defined]
    shared_dir.fsutil.rename_noreplace = counted(fsutil.rename_noreplace)  # type: ignore[attr-defined]
    real_rmtree = fsutil.rmtree_quiet

    def after_publication(path: Any) -> None:
        if ".gpuckpt-old-" in str(path):
            os.kill(os.getpid(), signal.SIGKILL)  # published, the set-aside copy not yet removed
        real_rmtree(path)

    def inside_a_removal(path: Any) -> None:
        if ".gpuckpt-undone-" in str(path):
            os.unlink(os.path.join(path, "zarr.json"))
            os.kill(os.getpid(), signal.SIGKILL)  # half of an entry taken out is deleted
        real_rmtree(path)

    if mode == "cleanup":
        if k == 0:
            shared_dir.fsutil.rmtree_quiet = inside_a_removal  # type: ignore[attr-defined]
        cleanup_stale_temporaries(Path(directory))
        print("returned", flush=True)
        return
    if k > 6:
        fsutil.rmtree_quiet = after_publication  # type: ignore[assignment]
    gpuckpt.save(new_state(), directory, overwrite=True)
    print("returned", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
