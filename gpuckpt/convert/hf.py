"""The Hugging Face sharded layout, both ways: gpuckpt checkpoints to and from
``model-0000i-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``.

Export (:func:`export_hf`) plans every shard first (names, sizes, header with the
offset of every tensor), creates each shard file at its final size, maps it, and
loads the checkpoint straight into the mapped places with :func:`gpuckpt.load`:
every chunk is read once, its checksum checked, into its place in the output
file, on the load's threads; a distributed checkpoint's boxes are assembled there
too. No copy of the state is held in memory (only the tensors cast to another
dtype pass through a bounded buffer). The directory is written under a
temporary name beside ``dst``, every file and the directory fsync'd, and
published by one rename: nothing half-written looks complete.

Import (:func:`import_hf`) maps the shards read-only and saves the mapped
tensors as a gpuckpt checkpoint: the save reads each byte once from the page
cache.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpuckpt import api
from gpuckpt.convert.safetensors_io import safetensors_code
from gpuckpt.errors import CheckpointExistsError, InvalidOptionError, UnsupportedValueError
from gpuckpt.format.safetensors import INDEX_NAME, METADATA_KEY, SINGLE_NAME, shard_name
from gpuckpt.loading.hf import open_hf
from gpuckpt.loading.open import open_checkpoint
from gpuckpt.options import DEFAULT_CHUNK_BYTES, LoadOptions
from gpuckpt.progress import ProgressCallback, ProgressCounter
from gpuckpt.runtime.runner import run_all
from gpuckpt.state import select_fqns
from gpuckpt.storage.local import fsutil
from gpuckpt.storage.local.fileio import write_all

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "HfExport",
    "ShardPlan",
    "export_hf",
    "import_hf",
    "parse_size",
    "plan_shards",
]

#: transformers' default ``max_shard_size`` ("5GB": decimal gigabytes)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
#: floating tensors cast to another dtype pass through buffers of about this many bytes
CAST_BATCH_BYTES = 256 * 2**20
#: the files of a model directory besides its weights that ``config=DIR`` copies
CONFIG_FILES = ("config.json", "generation_config.json")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5,000,000,000 (decimal units as transformers reads them; ``MiB`` and such binary)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        s = str(text).strip().upper()
        digits = s.rstrip("KMGTIB")
        try:
            value = int(float(digits) * _UNITS[s[len(digits) :]])
        except (KeyError, ValueError):
            raise InvalidOptionError(
                f"max shard size {text!r} is not a size; write e.g. 5GB, 500MB, 64MiB or a number of bytes"
            ) from None
    if value < 1:
        raise InvalidOptionError(f"max shard size must be at least one byte, got {text!r}")
    return value


@dataclass(frozen=True, slots=True)
class ShardTensor:
    """A tensor of the export: its name in the checkpoint and in the output, its output dtype."""

    fqn: str
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    source_dtype: np.dtype[Any]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """One output file: its name, header bytes (padded) and each tensor's offset in the file."""

    file: str
    header: bytes
    tensors: tuple[tuple[ShardTensor, int], ...]
    size: int


def _header(tensors: Sequence[ShardTensor]) -> tuple[bytes, list[tuple[ShardTensor, int]]]:
    """The header of a file holding ``tensors`` (laid out by decreasing element size, then name,
    as the reference writer does, so every tensor is aligned) and their data offsets."""
    ordered = sorted(tensors, key=lambda t: (-t.dtype.itemsize, t.name))
    doc: dict[str, Any] = {METADATA_KEY: {"format": "pt"}}
    offset = 0
    placed = []
    for t in ordered:
        doc[t.name] = {
            "dtype": safetensors_code(t.dtype, t.name),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        placed.append((t, offset))
        offset += t.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the reference writer pads the header to 8 bytes with spaces
    start = 8 + len(raw)
    return len(raw).to_bytes(8, "little") + raw, [(t, start + off) for t, off in placed]


def plan_shards(tensors: Sequence[ShardTensor], max_shard_bytes: int, single_file: bool) -> list[ShardPlan]:
    """Split ``tensors`` (in order) into files of at most ``max_shard_bytes`` of data, as
    transformers does: a tensor that does not fit in the current file starts the next one, a
    tensor larger than the limit has a file of its own."""
    groups: list[list[ShardTensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    total = sum(t.nbytes for t in tensors)
    if single_file and len(groups) > 1:
        raise InvalidOptionError(
            f"single_file: the tensors hold {total} bytes, more than the maximum shard size "
            f"{max_shard_bytes}; raise max_shard_size or write shards"
        )
    plans = []
    for i, group in enumerate(groups, 1):
        header, placed = _header(group)
        name = SINGLE_NAME if single_file else shard_name(i, len(groups))
        plans.append(ShardPlan(name, header, tuple(placed), len(header) + sum(t.nbytes for t in group)))
    return plans


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
    cast = np.dtype(dtype) if dtype is not None else None
    out: list[ShardTensor] = []
    seen: dict[str, str] = {}
    for fqn in chosen:
        t = tensors.get(fqn)
        if t is None:
            continue
        name = fqn[len(strip_prefix) :] if strip_prefix and fqn.startswith(strip_prefix) else fqn
        if not name or name in seen:
            raise UnsupportedValueError(
                f"tensors {seen.get(name, '')!r} and {fqn!r} both become {name!r} once {strip_prefix!r} is "
                "stripped; select fewer keys or strip another prefix"
            )
        seen[name] = fqn
        out_dt = cast if cast is not None and _is_floating(t.dtype) else t.dtype
        out.append(ShardTensor(fqn, name, tuple(t.shape), np.dtype(out_dt), np.dtype(t.dtype)))
    return out, len(chosen) - len(out)


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
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        raise CheckpointExistsError(f"{dst} already exists; pass overwrite=True (--overwrite) to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = (
        dst.parent
        / f"{fsutil.side_prefix(dst.name, '.gpuckpt-tmp-')}{fsutil.tmp_owner()}-{secrets.token_hex(4)}"
    )
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
        found = {name: (p / name).read_bytes() for name in CONFIG_FILES if (p / name).is_file()}
        if "config.json" not in found:
            raise FileNotFoundError(2, "config=DIR holds no config.json", os.fspath(p / "config.json"))
        return found
    data = p.read_bytes()
    try:
        json.loads(data)
    except ValueError as exc:
        raise InvalidOptionError(f"config {p} is not JSON ({exc}); pass a model's config.json") from None
    return {"config.json": data}


def _write_small(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Rename the finished directory ``tmp`` to ``dst`` (replacing it whole when ``overwrite``)."""
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


class _Shard:
    """An output file created at its final size, its header written, mapped for the tensors."""

    def __init__(self, directory: Path, plan: ShardPlan) -> None:
        self.plan = plan
        self.fd = os.open(directory / plan.file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self.map: mmap.mmap | None = None
        fsutil.preallocate(self.fd, plan.size)
        write_all(self.fd, plan.header)
        os.ftruncate(self.fd, plan.size)
        if plan.size > len(plan.header):
            self.map = mmap.mmap(self.fd, plan.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def views(self) -> list[tuple[ShardTensor, np.ndarray]]:
        out = []
        for t, at in self.plan.tensors:
            if t.nbytes == 0 or self.map is None:
                out.append((t, np.empty(t.shape, t.dtype)))
                continue
            arr = np.frombuffer(self.map, dtype=t.dtype, count=math.prod(t.shape), offset=at)
            out.append((t, arr.reshape(t.shape)))
        return out

    def finish(self) -> None:
        """Write the mapped pages back and make the file durable."""
        if self.map is not None:
            self.map.flush()
        os.fsync(self.fd)

    def close(self) -> None:
        if self.map is not None:
            # a view still referring to it keeps the mapping until the view goes
            with contextlib.suppress(BufferError):
                self.map.close()
        os.close(self.fd)


def _write_shards(
    src: Any,
    tmp: Path,
    plans: list[ShardPlan],
    threads: int | None,
    progress: ProgressCallback | None,
    storage_options: Mapping[str, Any] | None,
) -> None:
    shards: list[_Shard] = []
    try:
        for plan in plans:
            shards.append(_Shard(tmp, plan))
        direct: dict[str, np.ndarray] = {}
        cast: list[tuple[ShardTensor, np.ndarray]] = []
        for shard in shards:
            for t, view in shard.views():
                if t.dtype == t.source_dtype:
                    direct[t.fqn] = view
                else:
                    cast.append((t, view))
        total = sum(t.nbytes for p in plans for t, _ in p.tensors)
        counter = ProgressCounter(progress, total)
        options = LoadOptions(
            threads=threads,
            progress=_offset(counter, sum(v.nbytes for v in direct.values())),
            storage_options=storage_options,
        )
        if direct:
            api.load_with_options(direct, src, options)
        for batch in _cast_batches(cast):
            buffers = {t.fqn: np.empty(t.shape, t.source_dtype) for t, _ in batch}
            api.load_with_options(buffers, src, LoadOptions(threads=threads, storage_options=storage_options))
            for t, view in batch:
                view[...] = buffers[t.fqn].astype(t.dtype)
                counter.add(t.nbytes)
        direct.clear()
        cast.clear()
        run_all([shard.finish for shard in shards], threads=threads, name="gpuckpt-hf-sync")
    finally:
        for shard in shards:
            shard.close()


def _offset(counter: ProgressCounter, part: int) -> Callable[[int, int], None]:
    """A load's progress callback that reports into ``counter`` (the load is ``part`` of it)."""
    seen = [0]

    def report(done: int, _total: int) -> None:
        counter.add(done - seen[0])
        seen[0] = done

    return report


def _cast_batches(cast: list[tuple[ShardTensor, np.ndarray]]) -> list[list[tuple[ShardTensor, np.ndarray]]]:
    out: list[list[tuple[ShardTensor, np.ndarray]]] = []
    size = CAST_BATCH_BYTES
    for t, view in cast:
        nbytes = math.prod(t.shape) * t.source_dtype.itemsize
        if size + nbytes > CAST_BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append((t, view))
        size += nbytes
    return out


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
) -> tuple[int, int]:
    """Save the tensors of the Hugging Face directory (or safetensors file) ``src`` as the gpuckpt
    checkpoint ``dst``, keyed by their names; ``(tensors, bytes)``.

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
        api.save(
            state,
            dst,
            overwrite=overwrite,
            chunk_bytes=chunk_bytes,
            threads=threads,
            progress=progress,
            storage_options=storage_options,
        )
        return len(state), sum(a.nbytes for a in state.values())
    finally:
        state.clear()
        for mm in maps.values():
            with contextlib.suppress(BufferError):
                mm.close()
