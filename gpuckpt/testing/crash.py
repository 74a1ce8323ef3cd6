"""A child process for crash tests: saves on command so a test can SIGKILL it mid-way.

Run as ``python -m gpuckpt.testing.crash ROOT SEED MODE``. It saves a known
state to ``ROOT/good`` (printing ``good``), then starts the save named by
MODE (printing ``start``) and prints ``done`` when that save returned:

``new``        a different state to ``ROOT/next``;
``overwrite``  a different state over ``ROOT/good``;
``reoverwrite`` as ``overwrite``, but ``ROOT/good`` is never saved first
               (after a crash it may be missing, set aside by the one before);
``async``      ``async_save`` of a different state to ``ROOT/next``; once it
               returns the child scribbles over its arrays (what is saved
               must not change), then waits for the future;
``incremental`` ``ROOT/good`` is :func:`chain_state` step 0 (hashes recorded), then
               step 1 is saved to ``ROOT/next`` with ``base=ROOT/good``;
``incremental-manager`` as ``manager`` with ``incremental=True``, saving
               :func:`chain_state` of each step;
``manager``    a :class:`~gpuckpt.manager.CheckpointManager` under
               ``ROOT/mgr`` (``max_to_keep=2``, async) saving steps 1, 2, ...
               with ``make_state(SEED + step)``; after ``save(step)`` returns
               it prints ``committed STEP-1`` (the manager waited for it).

These environment variables serve the harness (read only here):

``GPUCKPT_TEST_TRACE=FILE``
    Append one line per event of the save to FILE with unbuffered writes
    (they survive SIGKILL): ``start``, ``begin``, ``tmp-created``,
    ``array-doc``, ``chunk``, ``mid-file`` (half of a buffer written),
    ``fsync``, ``root-write``, ``durable``, ``fsync-dir``, ``publish``,
    ``rename`` (a plain ``os.rename`` of the storage code, about to run),
    ``published``, ``retention``, ``returned``; ``snapshot`` (a background save's copy
    of the state) and ``transfer`` (a local tier's replication or fetch round) for the
    distributed tests. :func:`phase_of` maps the last line to a phase.
``GPUCKPT_TEST_KILL_AT=EVENT:N``
    SIGKILL this process at the N-th occurrence of EVENT (deterministic
    kill points, so every phase is hit, including the middle of a file).
``GPUCKPT_TEST_STOP_AT=EVENT:N``
    Hold the thread that reached the N-th EVENT there instead: it prints
    ``stopped`` and waits for a line on stdin (a live writer caught mid-save,
    resumed by that line or killed from outside, which also works for a
    child that is PID 1 of its own pid namespace and so ignores signals sent
    from inside).
``GPUCKPT_TEST_NO_EXCHANGE=1``
    Act as a file system without ``RENAME_EXCHANGE``: an overwrite takes the
    two-rename fallback (old aside: ``rename:1``; new in place: ``rename:2``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import gpuckpt

__all__ = ["PHASES", "chain_state", "make_state", "phase_of"]

#: Phases of a save, in order, and the trace events that belong to each.
PHASES: dict[str, tuple[str, ...]] = {
    "before-files": ("start", "snapshot", "begin"),
    "writing-chunks": ("tmp-created", "array-doc", "chunk", "mid-file", "reuse"),
    "fsync": ("fsync",),
    "root-and-durability": ("root-write", "durable", "fsync-dir"),
    "renaming": ("publish", "rename"),
    "after-rename": ("published", "fsync-dir-after-publish", "retention", "transfer"),
    "returned": ("returned",),
}


def phase_of(trace: list[str]) -> str:
    """Phase of a save whose trace (event lines) ends as given."""
    if "begin" in trace:  # a manager traces several saves: look at the last one
        trace = trace[len(trace) - 1 - trace[::-1].index("begin") :]
    if not trace:
        return "before-files"
    last = trace[-1]
    if last == "fsync" and "root-write" in trace:
        last = "fsync-dir"  # fsyncs after the root write are part of durability
    if last == "fsync-dir" and "published" in trace:
        last = "fsync-dir-after-publish"
    for phase, events in PHASES.items():
        if last in events:
            return phase
    raise ValueError(f"unknown trace event {last!r}")


def make_state(seed: int, ntensors: int = 24, elems: int = 64 * 1024) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {f"w{i}": rng.standard_normal(elems).astype(np.float32) for i in range(ntensors)},
        "seed": seed,
    }


def chain_state(seed: int, step: int) -> dict[str, Any]:
    """Step ``step`` of a training run where only three tensors change from step to step
    (the state of incremental saves): ``make_state(seed)`` with ``w0``-``w2`` plus ``step``."""
    state = make_state(seed)
    for i in range(3):
        state["model"][f"w{i}"] += np.float32(step)
    state["seed"] = seed + step
    return state


def _point(spec: str | None) -> tuple[str | None, int]:
    if not spec:
        return None, 0
    ev, _, n = spec.partition(":")
    return ev, int(n or 1)


class _Tracer:
    def __init__(self, trace_file: str | None, kill_at: str | None, stop_at: str | None = None) -> None:
        self.fd = os.open(trace_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if trace_file else None
        self.counts: dict[str, int] = {}
        self.kill_event, self.kill_n = _point(kill_at)
        self.stop_event, self.stop_n = _point(stop_at)

    def __call__(self, event: str) -> None:
        n = self.counts[event] = self.counts.get(event, 0) + 1
        if self.fd is not None:
            os.write(self.fd, f"{event}\n".encode())
        if event == self.kill_event and n == self.kill_n:
            os.kill(os.getpid(), signal.SIGKILL)
        if event == self.stop_event and n == self.stop_n:
            print("stopped", flush=True)
            sys.stdin.readline()


@contextlib.contextmanager
def _traced(emit: _Tracer) -> Iterator[None]:
    """Wrap the writer's steps so each one emits its event (and may be killed there)."""
    from gpuckpt.format.documents import ROOT_KEY
    from gpuckpt.storage.local import direct, fsutil
    from gpuckpt.storage.local import writer as local
    from gpuckpt.testing.faults import inject_os_faults

    W = local.LocalWriter
    patches: list[tuple[Any, str, Any]] = []

    def wrap(obj: Any, name: str, before: Callable[..., None], after: str | None = None) -> None:
        orig = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before(*args, **kwargs)
            out = orig(*args, **kwargs)
            if after:
                emit(after)
            return out

        patches.append((obj, name, orig))
        setattr(obj, name, wrapper)

    wrap(W, "begin", lambda *a, **k: emit("begin"), after="tmp-created")
    wrap(W, "write_array_document", lambda *a, **k: emit("array-doc"))
    wrap(W, "write_chunk", lambda *a, **k: emit("chunk"))
    wrap(W, "write_chunk_checked", lambda *a, **k: emit("chunk"))
    wrap(W, "reuse_chunk", lambda *a, **k: emit("reuse"))
    wrap(W, "_write_file", lambda self, rel, parts: emit("root-write") if rel == ROOT_KEY else None)
    wrap(W, "_make_durable", lambda *a, **k: emit("durable"))
    wrap(fsutil, "fsync_dir", lambda *a, **k: emit("fsync-dir"))
    wrap(fsutil, "exchange", lambda *a, **k: emit("publish"), after="published")
    wrap(fsutil, "rename_noreplace", lambda *a, **k: emit("publish"), after="published")
    if os.environ.get("GPUCKPT_TEST_NO_EXCHANGE") == "1":
        patches.append((fsutil, "exchange", fsutil.exchange))
        fsutil.exchange = lambda a, b: False
    from gpuckpt.storage.local import root as local_root

    wrap(local_root.LocalRoot, "_delete_one", lambda *a, **k: emit("retention"))
    # a retired step's part leaving a local tier into the save that reuses its files
    wrap(W, "_take_over", lambda *a, **k: emit("retention"))
    # a background snapshot being taken; a local tier's replication or fetch round beginning
    import gpuckpt.background as background
    from gpuckpt.tiers import LocalTier

    wrap(background, "snapshot", lambda *a, **k: emit("snapshot"))
    wrap(LocalTier, "_transfer", lambda *a, **k: emit("transfer"))

    real_write_all = local.write_all  # type: ignore[attr-defined]

    def write_all(fd: int, data: Any) -> None:
        view = memoryview(data).cast("B")
        half = view.nbytes // 2
        real_write_all(fd, view[:half])
        emit("mid-file")
        real_write_all(fd, view[half:])

    def writev_all(fd: int, buffers: Any) -> None:
        # the vectored write of small chunks: also stopped half-way
        data = b"".join(memoryview(b).cast("B").tobytes() for b in buffers)
        half = len(data) // 2
        real_write_all(fd, data[:half])
        emit("mid-file")
        real_write_all(fd, data[half:])

    for module in (local, direct):  # buffered files, and files written around the page cache
        patches.append((module, "write_all", module.write_all))
        patches.append((module, "writev_all", module.writev_all))
        module.write_all = write_all  # type: ignore[attr-defined]
        module.writev_all = writev_all  # type: ignore[attr-defined]

    def on_os_call(name: str) -> None:
        if name in ("fsync", "rename"):
            emit(name)

    try:
        with inject_os_faults(hook=on_os_call):
            yield
    finally:
        for obj, name, orig in reversed(patches):
            setattr(obj, name, orig)


@contextlib.contextmanager
def kill_points(kill_at: str | None, trace_file: str | None = None) -> Iterator[None]:
    """Within the block, SIGKILL this process at the ``EVENT:N`` of ``kill_at`` (the events of
    ``GPUCKPT_TEST_KILL_AT``, see the module docstring), tracing to ``trace_file``; for test
    scripts of their own (the distributed ones), as ``main`` does here."""
    with _traced(_Tracer(trace_file, kill_at)):
        yield


def _scribble(state: dict[str, Any]) -> None:
    for arr in state["model"].values():
        arr[:] = np.float32(-12345.0)
    state["seed"] = -1


def main(argv: list[str]) -> None:
    root, seed, mode = Path(argv[0]), int(argv[1]), argv[2]
    emit = _Tracer(
        os.environ.get("GPUCKPT_TEST_TRACE"),
        os.environ.get("GPUCKPT_TEST_KILL_AT"),
        os.environ.get("GPUCKPT_TEST_STOP_AT"),
    )
    if mode == "incremental" and not (root / "good").exists():
        gpuckpt.save(
            chain_state(seed, 0), root / "good", sync="file", chunk_bytes=16 * 1024, content_hash=True
        )
    elif mode not in ("manager", "incremental-manager", "reoverwrite") and not (root / "good").exists():
        gpuckpt.save(make_state(seed), root / "good", sync="file")
    print("good", flush=True)
    opts: dict[str, Any] = {"sync": "file", "chunk_bytes": 16 * 1024}
    with _traced(emit):
        if mode in ("manager", "incremental-manager"):
            from gpuckpt.manager import CheckpointManager

            chain = mode == "incremental-manager"
            mgr = CheckpointManager(root / "mgr", max_to_keep=2, async_save=True, incremental=chain, **opts)
            print("start", flush=True)
            emit("start")
            for step in range(1, 10_000):
                mgr.save(step, chain_state(seed, step) if chain else make_state(seed + step))
                if step > 1:
                    print(f"committed {step - 1}", flush=True)
            return
        state = chain_state(seed, 1) if mode == "incremental" else make_state(seed + 1)
        print("start", flush=True)
        emit("start")
        if mode == "incremental":
            gpuckpt.save(state, root / "next", base=root / "good", **opts)
        elif mode == "new":
            gpuckpt.save(state, root / "next", **opts)
        elif mode in ("overwrite", "reoverwrite"):
            gpuckpt.save(state, root / "good", overwrite=True, **opts)
        elif mode == "async":
            fut = gpuckpt.async_save(state, root / "next", **opts)
            _scribble(state)
            fut.result()
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        emit("returned")
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
