"""The public functions: save, load, load_state_dict, read_metadata."""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.device.arrays import (
    ArrayAdapter,
    DeviceArray,
    HostArray,
    HostMemory,
    adapt_leaf,
    is_array,
)
from gpuckpt.device.backend import DeviceBackend
from gpuckpt.device.sharded import is_sharded_leaf, sharded_boxes
from gpuckpt.distributed.cooperative import read_cooperative
from gpuckpt.distributed.coordinator import (
    Coordinator,
    SingleProcessCoordinator,
    check_coordinator,
    collectively,
)
from gpuckpt.distributed.load import box_bytes, read_boxes
from gpuckpt.distributed.save import distributed_save
from gpuckpt.errors import (
    CheckpointTooLargeError,
    DistributedError,
    DTypeMismatchError,
    InvalidOptionError,
    MissingKeyError,
    ShapeMismatchError,
    UnsupportedValueError,
)
from gpuckpt.format.metadata import STATE_DICT_TYPE, Metadata
from gpuckpt.format.values import decode_object
from gpuckpt.loading.checks import (
    TensorEntry,
    check_chunk_files,
    checking_chunk_files,
)
from gpuckpt.loading.chunk_reads import prepare_reads, read_tensors
from gpuckpt.loading.hf import is_hf_source, load_hf, load_hf_state_dict
from gpuckpt.loading.open import open_checkpoint
from gpuckpt.loading.targets import check_writable_target
from gpuckpt.options import DEFAULT_CHUNK_BYTES, DEFAULT_STAGING_BYTES, LoadOptions, SaveOptions
from gpuckpt.planning.boxes import Box
from gpuckpt.planning.plan import plan_save
from gpuckpt.progress import ProgressCallback, ProgressCounter
from gpuckpt.runtime.collector import paused_gc
from gpuckpt.saving.compression import resolve as resolve_compression
from gpuckpt.saving.incremental import check_base_target
from gpuckpt.saving.session import execute_save
from gpuckpt.saving.sources import contains_sharded, describe_state, is_leaf
from gpuckpt.saving.writing import open_save_writer
from gpuckpt.state import flatten_state_dict, key_names, select_fqns, unflatten_state_dict
from gpuckpt.storage.base import CheckpointReader
from gpuckpt.storage.stores import shares_reads

__all__ = ["load", "load_state_dict", "load_with_options", "read_metadata", "save", "save_with_options"]

PathLike = str | os.PathLike[str]


def save(
    state_dict: STATE_DICT_TYPE,
    path: PathLike,
    *,
    overwrite: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    allow_pickle: bool = False,
    sync: str = "auto",
    threads: int | None = None,
    progress: ProgressCallback | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    storage_options: dict[str, Any] | None = None,
    coordinator: Coordinator | None = None,
    portable: bool = False,
    base: PathLike | None = None,
    content_hash: bool = False,
    compression: str | dict[str, Any] | None = None,
) -> Metadata:
    """Save ``state_dict`` as a checkpoint at ``path`` and return its metadata.

    The checkpoint is written under a temporary name, made durable, and
    published by one rename: readers see all of it or nothing, and a failed
    save leaves any earlier checkpoint untouched.

    The arrays are read while the call runs: leave them unchanged until it
    returns (or use :func:`async_save`, which copies them first). An array
    changed meanwhile by another thread is stored torn, but the checkpoint
    still matches its own checksums: every chunk is checksummed from the bytes
    written, never from a second read of the array.

    Parameters
    ----------
    state_dict
        A dict of arrays, plain values, and nested dicts/lists/tuples of those.
    path
        Directory to create (its parent is created if needed).
    overwrite
        Replace an existing checkpoint at ``path`` (atomically where the
        system supports it). Without it an existing path is an error.
    chunk_bytes
        Target size of one stored chunk; larger tensors are split.
    allow_pickle
        Store values of other types with pickle. Off by default: loading such
        a checkpoint then needs ``allow_pickle=True`` too.
    sync
        Durability: ``"auto"`` (default), ``"file"``, ``"fs"`` or ``"none"``
        (see :class:`gpuckpt.storage.local.writer.LocalWriter`).
    threads
        I/O threads (default: twice the CPU count, between 2 and 8).
    progress
        ``callback(done_bytes, total_bytes)``, called as chunks are written.
    staging_bytes
        Budget of (page-locked) host memory through which device arrays are
        streamed; host memory use stays within it whatever the state size.
    storage_options
        Options for URL back ends (e.g. endpoint and credentials for ``s3://``).
    coordinator
        For a distributed save: every rank calls ``save`` with its own state
        dict (``ShardedArray`` boxes, replicated arrays, plain values) and a
        :class:`gpuckpt.distributed.Coordinator`; the ranks write one shared
        checkpoint, published only after every rank has finished.
    portable
        Distributed saves: use a regular chunk grid even for uneven boxes
        (every box a union of whole chunks) instead of a rectilinear grid.
    base
        An earlier checkpoint (path or URL): an incremental save. Each chunk
        whose bytes equal the chunk at the same place in ``base`` (same array,
        shape, dtype and chunk grid) is not written again but shared: a hard
        link (else a reflink, else an ordinary write) on local file systems, a
        server-side copy on object stores. Equality is decided by size, CRC32C
        and a 128-bit content hash together (or by the bytes, where the base
        has no hashes). The new checkpoint is complete on its own: deleting the
        base leaves it intact. A base that cannot be used (missing, damaged,
        another format) is a :class:`~gpuckpt.errors.IncrementalBaseWarning`
        and every chunk is written. Needs ``pip install gpuckpt[incremental]``
        to hash (else bytes are compared).
    content_hash
        Record each chunk's content hash (implied by ``base``), so that this
        checkpoint can serve as the base of a later incremental save cheaply.
    compression
        Compress chunks losslessly, in Zarr v3 codecs every Zarr reader decodes: ``"zstd"``
        (byte-shuffled zstd in the ``blosc`` codec), ``"lz4"`` (bit-shuffled lz4), ``"auto"``
        (``"zstd"`` only for the tensors and stores where it makes the save faster), or a dict
        spec (``{"codec": "zstd", "level": 3}``: the core ``zstd`` codec); None (the default),
        or ``"none"``, stores chunks as they are. See docs/compression.md.

    Examples
    --------
    >>> import numpy as np, gpuckpt, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> md = gpuckpt.save({"w": np.ones((2, 3), np.float32), "step": 7}, os.path.join(d, "ckpt"))
    >>> sorted(md.state_dict_metadata)
    ['step', 'w']
    """
    options = SaveOptions(
        overwrite=overwrite,
        chunk_bytes=chunk_bytes,
        allow_pickle=allow_pickle,
        sync=sync,
        threads=threads,
        progress=progress,
        staging_bytes=staging_bytes,
        storage_options=storage_options,
        portable=portable,
        base=base,
        content_hash=content_hash,
        compression=compression,
    )
    return save_with_options(state_dict, path, options, coordinator)


@paused_gc()
def save_with_options(
    state_dict: STATE_DICT_TYPE, path: PathLike, options: SaveOptions, coordinator: Coordinator | None = None
) -> Metadata:
    """:func:`save` with its options made (what :class:`~gpuckpt.CheckpointManager` calls).

    The cyclic garbage collector is paused while it runs (as for a load): describing and
    planning a state of many tensors makes tens of thousands of objects, none of them
    garbage before the save returns, and each collection would walk them all again."""
    check_coordinator(coordinator)
    check_base_target(path, options)
    if coordinator is not None or contains_sharded(state_dict):
        return distributed_save(state_dict, path, coordinator or SingleProcessCoordinator(), options)
    local, sources = describe_state(state_dict, allow_pickle=options.allow_pickle)
    compression = resolve_compression(path, options, local, sources)
    plan = plan_save(
        [local], chunk_bytes=options.chunk_bytes, portable=options.portable, compression=compression
    )
    # what is just written stays cached for a reader (no O_DIRECT unless asked for)
    writer = open_save_writer(
        path, options, expected_files=plan.nfiles, direct_io=options.use_direct_io(False)
    )
    return execute_save(plan, sources, writer, options, checkpoint_id=str(uuid.uuid4()))


@paused_gc()
def read_metadata(path: PathLike, *, storage_options: dict[str, Any] | None = None) -> Metadata:
    """Metadata of the checkpoint at ``path`` (validated, nothing else read)."""
    options = LoadOptions(storage_options=storage_options)
    return open_checkpoint(path, options.storage_options, shared=False).index.metadata()


def load(
    state_dict: STATE_DICT_TYPE,
    path: PathLike,
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    threads: int | None = None,
    progress: ProgressCallback | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    storage_options: dict[str, Any] | None = None,
    coordinator: Coordinator | None = None,
    cooperative: bool | None = None,
) -> None:
    """Load the checkpoint at ``path`` into ``state_dict`` in place.

    ``path`` may also be a Hugging Face directory (``model.safetensors.index.json`` plus
    shards, or ``model.safetensors``) or a ``.safetensors`` file: host targets keyed like
    its tensor names once flattened; only the shards holding the state's keys are read.

    Every array in ``state_dict`` is filled with the stored values (shape and
    dtype must match); plain values are replaced (inside a tuple, by a new tuple
    of the same items in the tuple's place); an entry whose value is not
    an array but was stored as a tensor receives a new array. Keys missing
    from the checkpoint are an error unless ``strict=False``; checkpoint keys
    absent from ``state_dict`` are not read (partial load). All checks run
    before anything is read (shapes, dtypes, writability of every target, the
    size of every chunk file), so a mismatch changes nothing.

    With a ``coordinator`` (every rank calls ``load`` with its own state dict:
    ``ShardedArray`` boxes, replicated arrays, plain values), each stored chunk
    that several ranks need can be read once for the whole job: one rank reads
    and checks it and sends its bytes to the others over the coordinator's
    transport, straight into their arrays where a chunk is a run of whole rows of
    one, else through at most ``staging_bytes`` of memory per rank at a time. A
    failed read fails the load on every rank before any byte of its round is sent
    (see :mod:`gpuckpt.distributed.cooperative` for what the targets then hold).
    ``cooperative=None`` (the default) does so where the store serves every
    rank's reads anew (``s3://``, network file systems), not on a local file
    system, whose page cache serves a node's ranks from one read; True and
    False force it on and off.

    Examples
    --------
    >>> import numpy as np, gpuckpt, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = gpuckpt.save({"w": np.arange(4.0)}, p)
    >>> sd = {"w": np.zeros(4)}
    >>> gpuckpt.load(sd, p)
    >>> sd["w"]
    array([0., 1., 2., 3.])
    """
    options = LoadOptions(
        strict=strict,
        allow_pickle=allow_pickle,
        threads=threads,
        progress=progress,
        staging_bytes=staging_bytes,
        storage_options=storage_options,
        cooperative=cooperative,
    )
    load_with_options(state_dict, path, options, coordinator)


def load_with_options(
    state_dict: STATE_DICT_TYPE, path: PathLike, options: LoadOptions, coordinator: Coordinator | None = None
) -> None:
    """:func:`load` with its options made."""
    check_coordinator(coordinator)
    if coordinator is None:
        _load(state_dict, path, options)
        return
    if coordinator.world_size > 1 and not is_hf_source(path) and _cooperates(path, options, coordinator):
        _load_cooperative(state_dict, path, options, coordinator)
        return
    # every rank checks its targets before any rank reads: a rank's bad target fails every rank
    # with nothing written; then any rank's failure to read is raised on every rank
    read = collectively(coordinator, _prepared_load, state_dict, path, options)
    collectively(coordinator, read)


def _cooperates(path: PathLike, options: LoadOptions, coordinator: Coordinator) -> bool:
    """Whether a distributed load of ``path`` is cooperative: as asked, else as rank 0 finds
    the store (:func:`~gpuckpt.storage.stores.shares_reads`), so that every rank agrees."""
    if options.cooperative is not None:
        return options.cooperative
    shared = None
    if coordinator.rank == 0:
        try:
            shared = shares_reads(path)
        except Exception:  # an invalid path: the load itself says what is wrong with it
            shared = False
    return bool(coordinator.broadcast(shared))


@dataclass(slots=True)
class _PreparedLoad:
    """A load checked and ready to read: the arrays it fills and the values it replaces."""

    reader: CheckpointReader
    tensors: Mapping[str, TensorEntry]
    targets: list[tuple[TensorEntry, ArrayAdapter]]
    requests: list[tuple[TensorEntry, list[tuple[Any, Box]]]]
    placeholders: list[tuple[Any, TensorEntry]]
    decoded: list[tuple[Any, Any]]
    reads: Callable[..., None] | None
    #: what names the checkpoint (its recorded checkpoint and save ids), where it says
    identity: str | None = None


def _prepare(
    state_dict: STATE_DICT_TYPE, path: PathLike, options: LoadOptions, *, whole: bool
) -> _PreparedLoad:
    """Open the checkpoint and check every target against it before anything is read;
    ``whole``: the reads of whole-array targets are prepared too (else the caller reads them)."""
    ck = open_checkpoint(path, options.storage_options, direct_io=options.reads_direct())
    reader, tensors, objects = ck.reader, ck.index.tensors, ck.index.objects
    leaves, _ = flatten_state_dict(state_dict, is_leaf)
    missing = [f for f in leaves if f not in tensors and f not in objects]
    if missing and options.strict:
        raise MissingKeyError(
            f"{len(missing)} key(s) of the state dict are not in the checkpoint at {path}: "
            f"{', '.join(repr(m) for m in missing[:10])}{' ...' if len(missing) > 10 else ''}; "
            "pass strict=False to load the others"
        )
    meta = ck.index.storage_meta
    identity = None if meta is None else repr((str(meta.checkpoint_id), meta.save_id))
    ready = _PreparedLoad(reader, tensors, [], [], [], [], None, identity)
    # the sizes of the chunk files are checked before anything is allocated or written; the
    # file system answers on another thread while the targets are checked and their reads made
    with checking_chunk_files(reader, [tensors[f] for f in leaves if f in tensors]) as check_files:
        for fqn, leaf in leaves.items():
            if fqn in objects:
                _refuse_value_into_array(fqn, leaf.value, objects[fqn])
                ready.decoded.append(
                    (leaf, decode_object(objects[fqn], allow_pickle=options.allow_pickle, fqn=fqn))
                )
            elif fqn in tensors:
                t = tensors[fqn]
                value = leaf.value
                if type(value) is np.ndarray or (not is_sharded_leaf(value) and is_array(value)):
                    ready.targets.append((t, _target(fqn, t, value)))
                elif is_sharded_leaf(value):
                    ready.requests.append((t, _shard_targets(t, value)))
                else:
                    ready.placeholders.append((leaf, t))
        # the arrays that exist have their reads made now; new ones once they are allocated
        if whole and not ready.placeholders:
            ready.reads = prepare_reads(reader, ready.targets, options)
        check_files()
    return ready


def _refuse_value_into_array(fqn: str, target: Any, stored: Any) -> None:
    """A :class:`DTypeMismatchError` where the state holds an array at ``fqn`` and the checkpoint
    a plain value: replacing the array with the value would leave a model's parameter (which
    the dict only points to) as it was, and the load would look done."""
    if not (is_sharded_leaf(target) or is_array(target)):
        return
    kind = next(iter(stored)) if isinstance(stored, dict) and len(stored) == 1 else "value"
    raise DTypeMismatchError(
        f"{fqn!r} is an array ({type(target).__module__}.{type(target).__qualname__}) in the state "
        f"dict but a plain value ({kind}) in the checkpoint: nothing was loaded; load this key into "
        "a dict entry that is not an array (load_state_dict(path, keys=...) gives it), or leave it out "
        "of the state dict"
    )


def _allocate_placeholders(ready: _PreparedLoad) -> list[tuple[Any, np.ndarray]]:
    """New host arrays for the entries that are not arrays but were stored as tensors."""
    fresh: list[tuple[Any, np.ndarray]] = []
    for leaf, t in ready.placeholders:
        dest = _allocate(None, t)
        ready.targets.append((t, HostArray(dest)))
        fresh.append((leaf, dest))
    return fresh


@paused_gc()
def _load(state_dict: STATE_DICT_TYPE, path: PathLike, options: LoadOptions) -> None:
    _prepared_load(state_dict, path, options)()


def _prepared_load(state_dict: STATE_DICT_TYPE, path: PathLike, options: LoadOptions) -> Callable[[], None]:
    """The load of ``path`` into ``state_dict``, checked and ready: every target is checked and new
    arrays allocated before it returns, and the call it returns reads (so that ranks can agree
    that all of them are ready before any target is written)."""
    if is_hf_source(path):  # a Hugging Face directory or safetensors file: no gpuckpt metadata
        return functools.partial(load_hf, state_dict, path, options)
    ready = _prepare(state_dict, path, options, whole=True)
    fresh = _allocate_placeholders(ready)

    def read() -> None:
        reads = ready.reads or prepare_reads(ready.reader, ready.targets, options)
        # one count of progress for the whole load: the tensors read whole, then the boxes
        total = sum(t.nbytes for t, _ in ready.targets) + box_bytes(ready.requests)
        counter = ProgressCounter(options.progress, total)
        reads(counter)
        read_boxes(ready.reader, ready.requests, options, counter)
        for leaf, value in (*fresh, *ready.decoded):
            leaf.replace(value)

    return read


@paused_gc()
def _load_cooperative(
    state_dict: STATE_DICT_TYPE, path: PathLike, options: LoadOptions, coordinator: Coordinator
) -> None:
    """A load in which every stored chunk that several ranks need is read once for the job
    (:mod:`gpuckpt.distributed.cooperative`): every rank checks its targets first, and the
    ranks agree on that before any reads; entries replaced by new values (plain values, new
    arrays) are replaced only once every rank has read everything."""
    coordinator = coordinator.host_transport()  # NCCL carries no host buffers: a gloo group does
    error: Exception | None = None
    ready = None
    try:
        ready = _prepare(state_dict, path, options, whole=False)
        fresh = _allocate_placeholders(ready)
    except Exception as exc:
        error = exc
    coordinator.all_reduce_errors(error)
    assert ready is not None
    whole = [(t, [(dest, ((0,) * len(t.shape), t.shape))]) for t, dest in ready.targets]
    try:
        read_cooperative(
            ready.reader, ready.tensors, [*whole, *ready.requests], options, coordinator, ready.identity
        )
    except Exception as exc:  # every rank learns of any rank's failure
        error = exc
    try:
        coordinator.all_reduce_errors(error)
    except DistributedError:
        raise
    except Exception:
        if error is None:
            raise
        raise error from None  # the transport is broken (a rank died): this rank's own error says so
    for leaf, value in (*fresh, *ready.decoded):
        leaf.replace(value)


def _target(fqn: str, t: TensorEntry, value: Any) -> ArrayAdapter:
    """Array ``value`` as the target of tensor ``t`` in a load in place, checked against it."""
    # a NumPy target is viewed as is: whether it is pinned does not matter to a read
    if type(value) is np.ndarray:
        flags = value.flags
        if value.shape == t.shape and value.dtype == t.dtype and flags.writeable and flags.c_contiguous:
            return HostArray(value)  # the usual target, checked without the adapter's steps
        arr: ArrayAdapter = HostArray(value)
    else:
        arr = adapt_leaf(value, fqn)
    if arr.shape != t.shape:
        raise ShapeMismatchError(
            f"tensor {fqn!r}: the checkpoint has shape {t.shape}, the target has {arr.shape}; "
            "resize the target or load with load_state_dict to get the stored shape"
        )
    if arr.dtype != t.dtype and arr.dtype.newbyteorder("=") != t.dtype:
        raise DTypeMismatchError(
            f"tensor {fqn!r}: the checkpoint has dtype {t.dtype}, the target has {arr.dtype}; "
            "load into an array of the stored dtype and convert afterwards"
        )
    check_writable_target(fqn, arr, "the target")
    return arr


def _shard_targets(t: TensorEntry, value: Any) -> list[tuple[Any, Box]]:
    """The ``(adapter, box)`` pairs of a ShardedArray target, checked against tensor ``t``."""
    out = []
    for b in sharded_boxes(value):
        if b.global_shape != t.shape:
            raise ShapeMismatchError(
                f"tensor {t.fqn!r}: the checkpoint has shape {t.shape}, the ShardedArray says "
                f"{b.global_shape}; fix global_shape"
            )
        arr = adapt_leaf(b.local, t.fqn)
        if arr.dtype.newbyteorder("=") != t.dtype:
            raise DTypeMismatchError(
                f"tensor {t.fqn!r}: the checkpoint has dtype {t.dtype}, the ShardedArray holds {arr.dtype}; "
                "load into local arrays of the stored dtype and convert afterwards"
            )
        check_writable_target(t.fqn, arr, f"the local shard at offsets {b.offsets}")
        out.append((arr, (b.offsets, b.sizes)))
    return out


def _allocate(backend: DeviceBackend | None, t: TensorEntry) -> Any:
    """A new array for tensor ``t`` (host memory when ``backend`` is None)."""
    fmt = t.memory_format
    try:
        if backend is None:
            return HostMemory().allocate(t.shape, t.dtype, fmt)
        return backend.allocate(t.shape, t.dtype, fmt)
    except MemoryError as exc:
        raise CheckpointTooLargeError(
            f"tensor {t.fqn!r} of shape {t.shape} needs {t.nbytes} bytes, which cannot be allocated ({exc}); "
            "the checkpoint is larger than the available memory, or its chunk files are sparse (hostile)"
        ) from None


def _backend_for(device: Any) -> DeviceBackend | None:
    """None for host memory, else the backend that allocates on ``device``."""
    if device is None or device == "cpu":
        return None
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        if kind == "cuda" and (index == "" or index.isdigit()):
            from gpuckpt.device.cuda import backend_for_device

            return backend_for_device(int(index or 0))
        raise InvalidOptionError(f"device={device!r}; expected 'cpu', 'cuda' or 'cuda:N'")
    if isinstance(device, DeviceBackend):
        return device
    raise InvalidOptionError(
        f"device must be a string like 'cuda:0' or a DeviceBackend, got {type(device).__name__}"
    )


@paused_gc()
def load_state_dict(
    path: PathLike,
    *,
    keys: list[str] | str | None = None,
    device: Any = "cpu",
    allow_pickle: bool = False,
    threads: int | None = None,
    progress: ProgressCallback | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into a new nested dict.

    ``path`` may also be a Hugging Face directory (``model.safetensors.index.json`` plus
    shards, or ``model.safetensors``) or a ``.safetensors`` file: its tensors (those ``keys``
    selects) come back as NumPy arrays in a flat dict by name, as ``model.load_state_dict``
    takes them; only the shards that hold them are read.

    Arrays are allocated with the stored shape, dtype and memory format, as
    NumPy arrays (``device="cpu"``, the default) or as CuPy arrays on a GPU
    (``device="cuda"`` or ``"cuda:N"``; CuPy has no bfloat16/float8, so such
    tensors come back as unsigned integers of the same size, to be viewed
    with the right dtype by the framework, e.g. ``torch.from_dlpack(x).view(torch.bfloat16)``).
    ``keys`` selects entries by FQN or by ``.``-prefix (``"model"`` selects
    everything under it); an unknown key is an error, raised before anything
    is read. The result keeps the nesting of the selected entries; a list or
    tuple of which only some positions are selected comes back as a dict from
    position to entry (``keys=["layers.1"]`` gives ``{"layers": {1: ...}}``),
    so that indexing by position works as on the full list and no
    placeholder stands for what was not loaded.

    Examples
    --------
    >>> import numpy as np, gpuckpt, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = gpuckpt.save({"model": {"w": np.eye(2)}, "step": 3}, p)
    >>> gpuckpt.load_state_dict(p, keys=["step"])
    {'step': 3}
    >>> _ = gpuckpt.save({"layers": [{"w": np.ones(1)}, {"w": np.zeros(1)}]}, p, overwrite=True)
    >>> gpuckpt.load_state_dict(p, keys=["layers.1"])
    {'layers': {1: {'w': array([0.])}}}
    """
    options = LoadOptions(
        allow_pickle=allow_pickle,
        threads=threads,
        progress=progress,
        staging_bytes=staging_bytes,
        storage_options=storage_options,
    )
    keys = key_names(keys)  # (InvalidOptionError for what is not a name; an int key's FQN)
    if is_hf_source(path):  # a Hugging Face directory or safetensors file: host arrays by name
        if _backend_for(device) is not None:
            raise UnsupportedValueError(
                f"{path}: loads from a Hugging Face directory make host arrays; load with "
                "device='cpu' and copy them to the device"
            )
        return load_hf_state_dict(path, keys, options)
    ck = open_checkpoint(path, options.storage_options, direct_io=options.reads_direct())
    reader, tensors, objects = ck.reader, ck.index.tensors, ck.index.objects
    chosen = select_fqns(ck.index.order, keys)
    entries = [tensors[f] for f in chosen if f in tensors]
    check_chunk_files(reader, entries)
    backend = _backend_for(device)
    values: dict[str, Any] = {}
    targets: list[tuple[TensorEntry, ArrayAdapter]] = []
    for t in entries:
        dest = _allocate(backend, t)
        targets.append((t, HostArray(dest) if backend is None else DeviceArray(dest, backend, t.dtype)))
        values[t.fqn] = dest
    for f in chosen:
        if f in objects:
            values[f] = decode_object(objects[f], allow_pickle=options.allow_pickle, fqn=f)
    read_tensors(reader, targets, options)
    return unflatten_state_dict(ck.index.planner_data["structure"], values, keys, entries=ck.index.order)
