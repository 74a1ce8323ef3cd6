"""The Hugging Face sharded layout, both ways: gpuckpt checkpoints to and from
``model-0000i-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``.

Export (:func:`export_hf`) plans every shard first (names, sizes, header with the
offset of every tensor: :mod:`gpuckpt.convert.hf_layout`), creates each shard file
at its final size, then reads the checkpoint in groups of rows cut at chunk edges
(:func:`gpuckpt.load` into boxes of two page-aligned 64 MiB buffers that hold a
shard's bytes from an aligned offset on: every chunk read once, its checksum
checked, on the load's threads; a distributed checkpoint's boxes assembled there
too) while a writer thread writes the previous group with aligned ``O_DIRECT``
writes (:mod:`gpuckpt.convert.hf_layout` plans them), so the disk writes while the
next group is read. Memory use is the two buffers, whatever the size
of the state. The directory is written under a temporary name beside ``dst``,
every file and the directory fsync'd, and published by one rename: nothing
half-written looks complete.

Import (:func:`import_hf`) maps the shards read-only and saves the mapped
tensors as a gpuckpt checkpoint: the save reads each byte once from the page
cache and writes its chunk files with ``O_DIRECT``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import mmap
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpuckpt import api
from gpuckpt.convert.hf_layout import (
    BUFFER_ALIGN,
    DEFAULT_MAX_SHARD_BYTES,
    Group,
    ShardPlan,
    ShardTensor,
    parse_size,
    plan_groups,
    plan_shards,
)
from gpuckpt.convert.safetensors_io import check_tensor_name, open_source, output_errors, temporary_name
from gpuckpt.device.sharded import ShardedArray
from gpuckpt.errors import CheckpointExistsError, InvalidOptionError, UnsupportedValueError
from gpuckpt.format.grid import axis_starts
from gpuckpt.format.safetensors import INDEX_NAME, SINGLE_NAME, check_bool_bytes
from gpuckpt.loading.hf import open_hf
from gpuckpt.loading.open import open_checkpoint
from gpuckpt.options import DEFAULT_CHUNK_BYTES, LoadOptions, SaveOptions, direct_io_from_env
from gpuckpt.progress import ProgressCallback, ProgressCounter
from gpuckpt.runtime.runner import run_all
from gpuckpt.runtime.workers import Workers
from gpuckpt.state import select_fqns
from gpuckpt.storage.local import fsutil
from gpuckpt.storage.local.fileio import write_all
from gpuckpt.storage.stores import cleanup_dead_writers

__all__ = ["CONFIG_FILES", "DEFAULT_MAX_SHARD_BYTES", "HfExport", "export_hf", "import_hf", "parse_size"]

#: the files of a model directory besides its weights that ``config=DIR`` copies
CONFIG_FILES = ("config.json", "generation_config.json")


@dataclass(frozen=True, slots=True)
class HfExport:
    """What :func:`export_hf` wrote."""

    files: tuple[str, ...]
    tensors: int
    nbytes: int
    skipped_values: int


def _select(
    src: Any,
    keys: Sequence[str] | str | None,
    strip_prefix: str | None,
    dtype: Any,
    storage_options: Mapping[str, Any] | None,
) -> tuple[list[ShardTensor], int]:
    ck = open_checkpoint(src, storage_options)
    tensors, order = ck.index.tensors, ck.index.order
    chosen = select_fqns(order, keys)
    cast = _cast_dtype(dtype)
    out: list[ShardTensor] = []
    seen: dict[str, str] = {}
    for fqn in chosen:
        t = tensors.get(fqn)
        if t is None:
            continue
        name = fqn[len(strip_prefix) :] if strip_prefix and fqn.startswith(strip_prefix) else fqn
        if not name and fqn:
            raise UnsupportedValueError(
                f"tensor {fqn!r} has no name left once {strip_prefix!r} is stripped; strip a shorter prefix "
                "(e.g. one ending in '.')"
            )
        if not name:
            raise UnsupportedValueError(
                "a tensor of the checkpoint has an empty name (the state's key ''), which a Hugging Face "
                "layout cannot hold: load it, give that tensor a name and save it again, or leave it out "
                "with keys="
            )
        check_tensor_name(name)
        if name in seen:
            raise UnsupportedValueError(
                f"tensors {seen.get(name, '')!r} and {fqn!r} both become {name!r} once {strip_prefix!r} is "
                "stripped; select fewer keys or strip another prefix"
            )
        seen[name] = fqn
        out_dt = cast if cast is not None and _is_floating(t.dtype) else t.dtype
        # where the chunks start along the rows, from the grid alone (a chunk table's records
        # are read by the load that follows); an empty tensor has no chunk
        if not t.shape:
            edges: tuple[int, ...] = (0,)
        elif math.prod(t.shape) == 0:
            edges = ()
        else:
            edges = tuple(axis_starts(t.grid)[0])
        out.append(ShardTensor(fqn, name, tuple(t.shape), np.dtype(out_dt), np.dtype(t.dtype), edges))
    return out, len(chosen) - len(out)


def _cast_dtype(dtype: Any) -> np.dtype[Any] | None:
    """The dtype of ``dtype=``: None, or a floating dtype safetensors stores."""
    if dtype is None:
        return None
    fix = (
        f"dtype={dtype!r}: expected a floating dtype to cast floating tensors to (bfloat16, float16, "
        "float32, float64, float8_e4m3fn, float8_e5m2)"
    )
    try:
        dt: np.dtype[Any] = np.dtype(dtype)
    except TypeError:
        raise InvalidOptionError(fix) from None
    if not _is_floating(dt):
        raise InvalidOptionError(fix)
    return dt


def _is_floating(dt: np.dtype[Any]) -> bool:
    """Floating point, bfloat16 and float8 (ml_dtypes) included."""
    return dt.kind == "f" or dt.name.startswith(("bfloat", "float8"))


def export_hf(
    src: Any,
    dst: str | os.PathLike[str],
    *,
    keys: Sequence[str] | str | None = None,
    strip_prefix: str | None = None,
    dtype: Any = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_BYTES,
    single_file: bool = False,
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    overwrite: bool = False,
    threads: int | None = None,
    progress: ProgressCallback | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> HfExport:
    """Write the tensors of the gpuckpt checkpoint ``src`` as a Hugging Face directory ``dst``.

    Parameters
    ----------
    src
        A gpuckpt checkpoint (path or URL), written by one process or by many ranks.
    dst
        The directory to create: ``model-0000i-of-0000N.safetensors`` and
        ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``).
    keys
        Names or ``.``-prefixes of the tensors to export (default: every tensor); plain
        values are never exported.
    strip_prefix
        Removed from the start of each name that has it (``"model."`` turns
        ``model.lm_head.weight`` into ``lm_head.weight``).
    dtype
        Cast floating tensors to this dtype (``"bfloat16"``, ``np.float16``); others keep theirs.
    max_shard_size
        Most bytes of tensor data per file (``"5GB"``, the default, as transformers; or bytes).
    single_file
        Write one ``model.safetensors`` without an index; an error when the tensors exceed
        ``max_shard_size``.
    config
        A ``config.json`` to write beside the weights (so that
        ``AutoModelForCausalLM.from_pretrained(dst)`` works): a mapping (e.g.
        ``model.config.to_dict()``), a JSON file, or a model directory (its ``config.json`` and
        ``generation_config.json`` are copied). None writes weights only.

    Examples
    --------
    >>> import numpy as np, gpuckpt, tempfile, os
    >>> from gpuckpt.convert.hf import export_hf
    >>> d = tempfile.mkdtemp()
    >>> _ = gpuckpt.save({"model": {"w": np.ones(4, np.float32)}}, os.path.join(d, "ckpt"))
    >>> export_hf(os.path.join(d, "ckpt"), os.path.join(d, "hf"), strip_prefix="model.").files
    ('model-00001-of-00001.safetensors',)
    """
    dst = Path(dst)
    limit = parse_size(max_shard_size)
    config_files = _config_files(config)
    tensors, skipped = _select(src, keys, strip_prefix, dtype, storage_options)
    if not tensors:
        raise UnsupportedValueError(f"{src}: no tensors selected (keys={keys!r}); nothing to export")
    plans = plan_shards(tensors, limit, single_file)
    if (dst.exists() or dst.is_symlink()) and not overwrite and not empty_directory(dst):
        raise CheckpointExistsError(f"{dst} already exists; pass overwrite=True (--overwrite) to replace it")
    if dst.exists() or dst.is_symlink():
        _replaceable(dst)  # before anything is read or written
    with output_errors(dst):
        dst.parent.mkdir(parents=True, exist_ok=True)
        cleanup_dead_writers(dst)  # what killed exports to this path left
        tmp = temporary_name(dst)
        tmp.mkdir()
        try:
            _write_shards(src, tmp, plans, threads, progress, storage_options)
            if not single_file:
                index = {
                    "metadata": {
                        "total_parameters": sum(math.prod(t.shape) for t in tensors),
                        "total_size": sum(t.nbytes for t in tensors),
                    },
                    "weight_map": {t.name: p.file for p in plans for t, _ in p.tensors},
                }
                _write_small(tmp / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True).encode() + b"\n")
            for name, data in config_files.items():
                _write_small(tmp / name, data)
            fsutil.fsync_dir(tmp)
            _publish(tmp, dst, overwrite)
        except BaseException:
            fsutil.rmtree_quiet(tmp)
            raise
    files = tuple(p.file for p in plans)
    return HfExport(files, len(tensors), sum(t.nbytes for t in tensors), skipped)


def _config_files(config: str | os.PathLike[str] | Mapping[str, Any] | None) -> dict[str, bytes]:
    """The files ``config`` stands for, read before anything is written."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return {"config.json": json.dumps(dict(config), indent=2, sort_keys=True).encode() + b"\n"}
    p = Path(config)
    if p.is_dir():
        found = {name: _config_bytes(p / name) for name in CONFIG_FILES if (p / name).exists()}
        if "config.json" not in found:
            raise FileNotFoundError(2, "config=DIR holds no config.json", os.fspath(p / "config.json"))
        return found
    return {"config.json": _config_bytes(p)}


#: the largest config file copied beside an export (a model's config.json is a few KiB)
MAX_CONFIG_BYTES = 16 << 20


def _config_bytes(path: Path) -> bytes:
    """A config file's bytes: a regular file of at most :data:`MAX_CONFIG_BYTES`, a JSON object."""
    with open_source(path, "config") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise InvalidOptionError(
            f"config {path} is larger than {MAX_CONFIG_BYTES} bytes; pass a model's config.json"
        )
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise InvalidOptionError(f"config {path} is not JSON ({exc}); pass a model's config.json") from None
    if not isinstance(doc, dict):
        raise InvalidOptionError(f"config {path} is not a JSON object; pass a model's config.json")
    return data


def _write_small(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _replaceable(dst: Path) -> None:
    """Refuse to replace ``dst`` unless it is a directory of files an export writes (shards, their
    index, the config files): ``overwrite`` replaces an export, never a directory of other things
    (a checkpoint, a project, a model directory with its tokenizer)."""
    if dst.is_symlink() or not dst.is_dir():
        raise CheckpointExistsError(
            f"{dst} exists and is not a Hugging Face export directory; refusing to replace it even with "
            "overwrite=True (nothing was deleted): write the export to a new directory"
        )
    others = sorted(
        p.name
        for p in dst.iterdir()
        if p.is_symlink()
        or not p.is_file()
        or not (p.name in (INDEX_NAME, SINGLE_NAME, *CONFIG_FILES) or _SHARD_NAME.fullmatch(p.name))
    )
    if others:
        raise CheckpointExistsError(
            f"{dst} holds entries an export does not write ({', '.join(others[:5])}"
            f"{', ...' if len(others) > 5 else ''}); refusing to replace it even with overwrite=True "
            "(nothing was deleted): write the export to a new directory, or remove them"
        )


#: the names of the shards an export writes (transformers' names)
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def empty_directory(path: Path) -> bool:
    """Whether ``path`` is a directory (not a link to one) with nothing in it: it holds no output,
    so a conversion takes its place without ``overwrite``, as a save does."""
    try:
        return path.is_dir() and not path.is_symlink() and not any(path.iterdir())
    except OSError:
        return False


def _publish(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Rename the finished directory ``tmp`` to ``dst`` (replacing it whole when ``overwrite``)."""
    if not overwrite and empty_directory(dst):
        with contextlib.suppress(OSError):  # (something appeared in it: the rename below says so)
            dst.rmdir()
    if not (overwrite and (dst.exists() or dst.is_symlink())):
        fsutil.rename_noreplace(tmp, dst)
    elif dst.is_dir() and not dst.is_symlink() and fsutil.exchange(tmp, dst):
        fsutil.rmtree_quiet(tmp)  # now the old directory
    else:
        aside = dst.parent / f"{fsutil.side_prefix(dst.name, '.gpuckpt-old-')}{secrets.token_hex(4)}"
        os.rename(dst, aside)
        os.rename(tmp, dst)
        if aside.is_dir() and not aside.is_symlink():
            fsutil.rmtree_quiet(aside)
        else:
            aside.unlink()
    fsutil.fsync_dir(dst.parent)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class _ShardFile:
    """A shard file created at its final size: a buffered descriptor, and an ``O_DIRECT`` one where
    the file system takes it (the aligned writes go around the page cache)."""

    def __init__(self, directory: Path, plan: ShardPlan) -> None:
        path = directory / plan.file
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.direct: int | None = None
        try:
            os.ftruncate(self.fd, plan.size)
            flag = getattr(os, "O_DIRECT", 0)
            if flag:
                with contextlib.suppress(OSError):  # tmpfs and others refuse it: buffered writes
                    self.direct = os.open(path, os.O_WRONLY | flag)
        except BaseException:
            self.close()
            raise

    def write(self, data: memoryview, offset: int) -> None:
        """``data`` at ``offset``: the aligned head around the page cache where possible."""
        aligned = data.nbytes - data.nbytes % BUFFER_ALIGN
        if self.direct is not None and aligned and offset % BUFFER_ALIGN == 0:
            try:
                _pwrite_all(self.direct, data[:aligned], offset)
                data, offset = data[aligned:], offset + aligned
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(self.direct)  # refused after all: buffered from now on
                self.direct = None
        if data.nbytes:
            _pwrite_all(self.fd, data, offset)
            fsutil.start_writeback(self.fd)

    def close(self) -> None:
        for fd in (self.direct, self.fd):
            if fd is not None:
                os.close(fd)


def _targets(group: Group, buffer: np.ndarray) -> tuple[dict[str, Any], list[tuple[np.ndarray, np.ndarray]]]:
    """The load targets of a group (each piece's rows as a box of its tensor, in its place in
    ``buffer``) and the ``(place, source)`` pairs of the pieces to cast once loaded."""
    state: dict[str, Any] = {}
    casts: list[tuple[np.ndarray, np.ndarray]] = []
    for p in group.pieces:
        t = p.tensor
        shape = (p.stop - p.start, *t.shape[1:]) if t.shape else ()
        place = buffer[p.buffer_offset : p.buffer_offset + p.nbytes].view(t.dtype).reshape(shape)
        local = place
        if t.dtype != t.source_dtype:
            local = np.empty(shape, t.source_dtype)
            casts.append((place, local))
        if not t.shape or (p.start, p.stop) == (0, t.shape[0]):
            state[t.fqn] = local  # the whole tensor
        else:
            box = ShardedArray(local, (p.start,) + (0,) * (len(t.shape) - 1), t.shape)
            state.setdefault(t.fqn, []).append(box)
    return state, casts


def _write_group(group: Group, buffer: np.ndarray, shard: _ShardFile, counter: ProgressCounter) -> None:
    shard.write(memoryview(buffer[: group.write_end - group.start]), group.start)
    counter.add(sum(p.nbytes for p in group.pieces))


def _write_shards(
    src: Any,
    tmp: Path,
    plans: list[ShardPlan],
    threads: int | None,
    progress: ProgressCallback | None,
    storage_options: Mapping[str, Any] | None,
) -> None:
    """Read the checkpoint group by group into two buffers taken in turn, each group written by
    a writer thread while the next is read; then fsync every shard."""
    groups = plan_groups(plans)
    counter = ProgressCounter(progress, sum(t.nbytes for p in plans for t, _ in p.tensors))
    size = max(g.end - g.start for g in groups)
    # page-aligned memory of its own (anonymous maps): what O_DIRECT writes need
    maps = [mmap.mmap(-1, max(size, 1)) for _ in range(2)]
    buffers = [np.frombuffer(m, np.uint8) for m in maps]
    options = LoadOptions(threads=threads, storage_options=storage_options)
    shards: list[_ShardFile] = []
    writes: list[Future[None] | None] = [None, None]
    writer = Workers(1, "gpuckpt-hf-write")
    try:
        for plan in plans:
            shards.append(_ShardFile(tmp, plan))
        head = b""
        for i, group in enumerate(groups):
            pending = writes[i % 2]
            if pending is not None:
                pending.result()  # its buffer is free again
            buffer = buffers[i % 2]
            if i == 0 or groups[i - 1].shard != group.shard:  # a shard's first group starts with its header
                head = plans[group.shard].header
            buffer[: len(head)] = np.frombuffer(head, np.uint8)
            state, casts = _targets(group, buffer)
            api.load_with_options(state, src, options)
            for place, loaded in casts:
                place[...] = loaded.astype(place.dtype)
            del state, casts
            head = buffer[group.write_end - group.start : group.end - group.start].tobytes()
            writes[i % 2] = writer.submit(_write_group, group, buffer, shards[group.shard], counter)
        for pending in writes:
            if pending is not None:
                pending.result()
        run_all([functools.partial(os.fsync, s.fd) for s in shards], threads=threads, name="gpuckpt-hf-sync")
    finally:
        writer.shutdown(wait=True)
        for shard in shards:
            shard.close()
        del buffers
        for m in maps:
            with contextlib.suppress(BufferError):  # a view kept by a failed load's traceback
                m.close()


def import_hf(
    src: str | os.PathLike[str],
    dst: Any,
    *,
    keys: Sequence[str] | str | None = None,
    overwrite: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    threads: int | None = None,
    progress: ProgressCallback | None = None,
    storage_options: dict[str, Any] | None = None,
    compression: str | dict[str, Any] | None = None,
) -> tuple[int, int]:
    """Save the tensors of the Hugging Face directory (or safetensors file) ``src`` as the gpuckpt
    checkpoint ``dst``, keyed by their names, its chunks compressed as ``compression`` says (the
    save option); ``(tensors, bytes)``.

    The shards that hold the selected tensors are mapped read-only and their tensors saved as
    they lie in the page cache: no copy of the state in memory.
    """
    source = open_hf(src)
    chosen = select_fqns(source.names, keys)
    maps: dict[Path, mmap.mmap] = {}
    state: dict[str, np.ndarray] = {}
    try:
        for name in chosen:
            h = source.header(name)
            dt, shape, at, nbytes = h.place(name)
            if nbytes == 0:
                state[name] = np.empty(shape, dt)
                continue
            mm = maps.get(h.path)
            if mm is None:
                with open(h.path, "rb") as f:
                    mm = maps[h.path] = mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ)
                if hasattr(mm, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
                    mm.madvise(mmap.MADV_SEQUENTIAL)
            if mm.size() < at + nbytes:  # the file shrank since its header was read
                raise UnsupportedValueError(f"{h.path}: changed while it was read; export it again")
            state[name] = np.frombuffer(mm, dtype=dt, count=math.prod(shape), offset=at).reshape(shape)
            check_bool_bytes(state[name], f"{h.path}: tensor {name!r}")
        # the chunk files go around the page cache (which holds the shards being read) unless
        # GPUCKPT_DIRECT_IO=0 says otherwise: writing them through it measured 3x slower here
        options = SaveOptions(
            overwrite=overwrite,
            chunk_bytes=chunk_bytes,
            threads=threads,
            progress=progress,
            storage_options=storage_options,
            direct_io="off" if direct_io_from_env() == "off" else "on",
            compression=compression,
        )
        api.save_with_options(state, dst, options)
        return len(state), sum(a.nbytes for a in state.values())
    finally:
        state.clear()
        for mm in maps.values():
            with contextlib.suppress(BufferError):
                mm.close()
