"""``gpuckpt.dcp.Stager``: the snapshot of ``dcp.async_save``, in gpuckpt's reusable staging memory."""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any

from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

import gpuckpt.dcp.bridge as bridge
from gpuckpt.dcp.tensors import as_torch, host_view, numpy_dtype, torch, torch_dtype
from gpuckpt.errors import InvalidOptionError, StagingTimeoutError

__all__ = ["Stager", "StagingTimeoutError"]

_MAX_DEPTH = 200


class Stager(AsyncStager):  # type: ignore[misc,unused-ignore]
    """DCP's ``AsyncStager`` backed by gpuckpt's staging memory.

    ``stage`` copies every tensor of the state dict once and returns the copy:
    ``dcp.async_save`` returns right after, and later changes to the tensors do
    not reach the checkpoint. With ``staging="host"`` (the default) the copies
    live in staging arenas that are allocated once and reused by later saves
    (page-locked when CUDA tensors are staged, copied the way
    :func:`gpuckpt.async_save` copies them); an arena returns to the pool when
    the save that used it has let go of its tensors. At most
    ``max_snapshots`` arenas exist: a further ``stage`` waits (up to ``timeout``
    seconds) for a save to finish. ``staging="device"`` copies CUDA tensors
    within device memory instead (about one device-to-device copy; needs free
    device memory the size of the state).

    DTensors stay DTensors (their local shard is copied); other values are
    deep-copied.

    Examples
    --------
    ::

        stager = gpuckpt.dcp.Stager()
        fut = dcp.async_save(state_dict, storage_writer=gpuckpt.dcp.Writer(path), async_stager=stager)
        ...  # training continues; the snapshot is already taken
        fut.result()
        stager.close()  # after the last save
    """

    _synchronize_after_execute: bool = False  # stage returns once the copy is complete

    def __init__(
        self, *, staging: str = "host", max_snapshots: int = 2, timeout: float | None = 300.0
    ) -> None:
        if staging not in ("host", "device"):
            raise InvalidOptionError(f"staging={staging!r}; expected 'host' or 'device'")
        if isinstance(max_snapshots, bool) or not isinstance(max_snapshots, int) or max_snapshots < 1:
            raise InvalidOptionError(f"max_snapshots must be a positive integer, got {max_snapshots!r}")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0
        ):
            raise InvalidOptionError(
                f"timeout must be a non-negative number of seconds or None, got {timeout!r}"
            )
        self.staging = staging
        self.max_snapshots = max_snapshots
        self.timeout = timeout
        self._pools: dict[int, Any] = {}
        self._lock = threading.Lock()
        # (dtypes, shapes and strides of the CPU tensors last staged, their layout in staging memory)
        self._layout: tuple[tuple[Any, ...], bridge.HostLayout] | None = None

    @property
    def reserved_bytes(self) -> int:
        """Bytes of staging memory this Stager holds (in use and free for the next snapshot)."""
        return bridge.staged_bytes(self._pools)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` whose tensors are snapshots in staging memory."""
        sources: list[Any] = []
        seen: dict[int, int] = {}  # tensor id -> index in sources: tied tensors are copied once

        def slot(t: Any, path: str) -> int:
            if id(t) not in seen:
                if t.dtype not in _STORABLE:
                    numpy_dtype(t.dtype, path)  # an unsupported dtype fails here, with its name
                    _STORABLE.add(t.dtype)
                seen[id(t)] = len(sources)
                sources.append(t)
            return seen[id(t)]

        def plan(v: Any, path: str, depth: int) -> Any:
            if depth > _MAX_DEPTH:
                raise ValueError(f"state dict nesting deeper than {_MAX_DEPTH} at {path!r}")
            if isinstance(v, DTensor):
                return _DTensorSlot(slot(v.to_local(), path), v)
            if isinstance(v, torch.Tensor):
                return _Slot(slot(v, path))
            if isinstance(v, dict):
                return {k: plan(x, f"{path}.{k}", depth + 1) for k, x in v.items()}  # noqa: F821 (see its finally)
            if isinstance(v, (list, tuple)):
                kids = [plan(x, f"{path}.{i}", depth + 1) for i, x in enumerate(v)]  # noqa: F821 (see its finally)
                return kids if isinstance(v, list) else tuple(kids)
            return copy.deepcopy(v)

        try:
            template = {k: plan(v, str(k), 1) for k, v in state_dict.items()}
        finally:
            del plan  # (a recursive closure is a cycle: it would keep the tensors until a collection)
        host = self.staging == "host" and bool(sources) and all(map(_plain_cpu, sources))
        with self._lock:  # the pools (and the layout) are shared by stage calls from several threads
            try:
                if host:
                    snap = self._snapshot_host(sources)
                else:
                    snap = bridge.snapshot(
                        sources,
                        self._pools,
                        device=self.staging == "device",
                        max_arenas=self.max_snapshots,
                        timeout=self.timeout,
                    )
            except StagingTimeoutError:
                raise StagingTimeoutError(
                    f"no staging memory became free within {self.timeout} s: {self.max_snapshots} earlier "
                    "snapshots are still held by saves in flight; wait for their futures before saving "
                    "again, or make the Stager with a larger max_snapshots"
                ) from None
        tensors = self._as_tensors(snap, [t.dtype for t in sources] if host else None)
        return _fill(template, tensors)  # type: ignore[no-any-return]

    def _snapshot_host(self, sources: list[Any]) -> bridge.Snapshot:
        """The snapshot of CPU tensors: their layout in staging memory is worked out once and
        kept while the tensors keep their dtypes, shapes and strides (a training loop saves
        the same tensors again and again); any change makes it anew."""
        key = tuple((t.dtype, t.shape, t.stride()) for t in sources)
        views = [host_view(t) for t in sources]
        if self._layout is None or self._layout[0] != key:
            self._layout = (key, bridge.host_layout(views))
        return bridge.snapshot_host(
            views, self._layout[1], self._pools, max_arenas=self.max_snapshots, timeout=self.timeout
        )

    def _as_tensors(self, snap: bridge.Snapshot, dtypes: list[Any] | None = None) -> list[Any]:
        """torch tensors over the snapshot's copies; its arena is released when torch frees them all.

        ``dtypes``: the torch dtypes of the copies of host views (:func:`host_view`), which
        hold dtypes NumPy lacks as integers of their size; None: the copies hold their
        dtypes as NumPy (ml_dtypes) sees them."""
        left = [sum(not on_device for _, _, on_device in snap.arrays)]
        lock = threading.Lock()

        def freed() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                snap.release()

        if left[0] == 0:
            snap.release()
        arrays, snap.arrays = snap.arrays, []  # from here on only the tensors hold the copies
        arrays.reverse()
        out = []
        while arrays:
            copy_, dtype, on_device = arrays.pop()
            if on_device:
                t = torch.utils.dlpack.from_dlpack(copy_)
                want = torch_dtype(dtype, "<snapshot>")
                out.append(t if t.dtype == want else t.view(want))
            elif dtypes is not None:
                weakref.finalize(copy_, freed)
                t = torch.from_numpy(copy_)
                want = dtypes[len(out)]
                out.append(t if t.dtype == want else t.view(want))
            else:
                out.append(as_torch(copy_, freed))
            del copy_
        return out

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is complete."""

    def close(self) -> None:
        """Free the staging memory not in use (arenas still held by saves are freed when those end)."""
        with self._lock:
            for pool in self._pools.values():
                pool.clear()

    def __repr__(self) -> str:
        return f"gpuckpt.dcp.Stager(staging={self.staging!r}, max_snapshots={self.max_snapshots})"


# torch dtypes found storable (numpy_dtype): checked once per dtype, not once per tensor
_STORABLE: set[Any] = set()
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain_cpu(t: Any) -> bool:
    """A dense CPU tensor whose memory NumPy can view as it is (no subclass, no lazy
    conjugate or negative bit)."""
    return type(t) in _PLAIN and t.is_cpu and t.layout is torch.strided and not t.is_conj() and not t.is_neg()


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _DTensorSlot(_Slot):
    __slots__ = ("spec",)

    def __init__(self, index: int, original: Any) -> None:
        super().__init__(index)
        self.spec = original._spec


def _fill(node: Any, tensors: list[Any]) -> Any:
    if isinstance(node, _DTensorSlot):
        # the original's sharding spec around the copied local shard (as DCP's own stagers do)
        return DTensor(tensors[node.index], node.spec, requires_grad=False)  # type: ignore[no-untyped-call,unused-ignore]
    if isinstance(node, _Slot):
        return tensors[node.index]
    if isinstance(node, dict):
        return {k: _fill(v, tensors) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, tensors) for v in node]
    if isinstance(node, tuple):
        return tuple(_fill(v, tensors) for v in node)
    return node
