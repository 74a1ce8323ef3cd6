"""``convert``: between gpuckpt, safetensors, ``torch.save`` files and DCP directories."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import gpuckpt.convert.torch_save as torch_save
from gpuckpt import api
from gpuckpt.convert.hf import DEFAULT_MAX_SHARD_BYTES, empty_directory, export_hf, import_hf
from gpuckpt.convert.safetensors_io import (
    check_tensor_name,
    is_safetensors,
    open_source,
    read_safetensors,
    read_safetensors_header,
    safetensors_code,
    write_safetensors,
)
from gpuckpt.convert.torch_io import check_trusted, load_dcp, load_torch_save
from gpuckpt.device.arrays import is_array
from gpuckpt.errors import (
    CheckpointExistsError,
    GpuckptError,
    InvalidOptionError,
    InvalidPathError,
    MetadataError,
    UnsupportedValueError,
)
from gpuckpt.format.memory_format import (
    contiguous_format,
    detect_memory_format,
    memory_format_from_name,
    physical_order,
)
from gpuckpt.format.safetensors import INDEX_NAME, SINGLE_NAME
from gpuckpt.format.values import decode_object, encode_object
from gpuckpt.loading.hf import is_hf_source
from gpuckpt.options import DEFAULT_CHUNK_BYTES, LoadOptions, SaveOptions
from gpuckpt.progress import ProgressCallback
from gpuckpt.state import flatten_state_dict, key_names, unflatten_state_dict
from gpuckpt.storage.stores import scheme_of

__all__ = ["SOURCE_FORMATS", "TARGET_FORMATS", "ConvertResult", "convert", "detect_format"]

SOURCE_FORMATS = ("gpuckpt", "safetensors", "torch", "dcp", "hf")
TARGET_FORMATS = ("gpuckpt", "safetensors", "torch", "hf")
#: ``__metadata__`` key that carries a gpuckpt state's plain values and nesting.
STATE_KEY = "gpuckpt.state"


@dataclass(frozen=True, slots=True)
class ConvertResult:
    """What :func:`convert` wrote."""

    source_format: str
    target_format: str
    tensors: int
    objects: int
    nbytes: int


def detect_format(path: str | os.PathLike[str]) -> str:
    """``gpuckpt``, ``dcp``, ``safetensors`` or ``torch``, from the content at ``path``.

    A file is safetensors when its first 8 bytes give a header length that
    fits in the file and the header is a JSON object (see
    :func:`~gpuckpt.convert.safetensors_io.is_safetensors`); else a zip or
    pickle start means ``torch.save``.
    """
    if scheme_of(path) != "file":
        return "gpuckpt"  # a URL (s3://...) holds gpuckpt checkpoints only
    p = Path(path)
    if p.is_dir():
        if (p / "zarr.json").is_file():
            return "gpuckpt"
        if (p / ".metadata").is_file():
            return "dcp"
        if is_hf_source(p):
            return "hf"
        raise UnsupportedValueError(
            f"{p} is a directory but neither a gpuckpt checkpoint (no zarr.json), a "
            f"torch.distributed.checkpoint directory (no .metadata) nor a Hugging Face directory (no "
            f"{INDEX_NAME} or {SINGLE_NAME})"
        )
    if not p.exists():
        if p.is_symlink():
            raise InvalidPathError(
                f"{p} is a symbolic link that leads to no file (a loop, or its target is gone)"
            )
        raise FileNotFoundError(2, "No such file or directory", os.fspath(p))
    # by the header's structure first: a header length of 128 mod 256 makes a
    # safetensors file start with 0x80, the first byte of a pickle
    if is_safetensors(p):
        return "safetensors"
    with open_source(p) as f:
        head = f.read(4)
    # zip (torch >= 1.6), or a legacy pickle: PROTO (0x80) and a protocol torch.save writes (2-5)
    if head == b"PK\x03\x04" or (len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5):
        return "torch"
    raise UnsupportedValueError(
        f"cannot tell the format of {p}: not safetensors, not a torch.save file; "
        "pass the source format explicitly (--from)"
    )


def _flat(state: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any], Any]:
    leaves, skeleton = flatten_state_dict(state, is_array)
    tensors = {f: np.asarray(leaf.value) for f, leaf in leaves.items() if is_array(leaf.value)}
    objects = {f: leaf.value for f, leaf in leaves.items() if not is_array(leaf.value)}
    return tensors, objects, skeleton


def _from_safetensors(path: Path, allow_pickle: bool, progress: ProgressCallback | None) -> dict[str, Any]:
    tensors, meta = read_safetensors(path, progress=progress)
    if STATE_KEY not in meta:
        return dict(tensors)
    try:
        extra = json.loads(meta[STATE_KEY])
        structure, encoded = extra["structure"], dict(extra["objects"])
        formats = dict(extra.get("memory_formats", {}))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise MetadataError(
            f"{path}: __metadata__[{STATE_KEY!r}] is not a gpuckpt state description ({exc!r:.200})"
        ) from None
    values: dict[str, Any] = dict(tensors)
    for fqn, fmt in formats.items():
        if fqn in values:
            values[fqn] = _in_memory_format(values[fqn], fmt, path)
    for fqn, enc in encoded.items():
        values[fqn] = decode_object(enc, allow_pickle=allow_pickle, fqn=fqn)
    state = unflatten_state_dict(structure, values)  # (checks the structure)
    unlisted = sorted(set(tensors) - _leaf_names(structure))
    if unlisted:
        raise MetadataError(
            f"{path} holds tensors its __metadata__[{STATE_KEY!r}] does not list ({', '.join(unlisted[:5])}"
            f"{', ...' if len(unlisted) > 5 else ''}): the file was changed after gpuckpt wrote it, and "
            f"importing it by that description would drop them; remove the {STATE_KEY!r} entry from "
            "its metadata to import every tensor by its name"
        )
    return state


def _read(
    path: Any,
    fmt: str,
    *,
    allow_pickle: bool,
    trust_pickle_metadata: bool,
    threads: int | None,
    progress: ProgressCallback | None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    if fmt == "gpuckpt":
        return api.load_state_dict(
            path,
            allow_pickle=allow_pickle,
            threads=threads,
            progress=progress,
            storage_options=storage_options,
        )
    if scheme_of(path) != "file":
        raise UnsupportedValueError(f"{path}: only gpuckpt checkpoints are read from URLs, not {fmt} files")
    if fmt == "safetensors":
        read_safetensors_header(path)  # a clear error for a file that is not safetensors
        return _from_safetensors(path, allow_pickle, progress)
    if fmt == "torch":
        return load_torch_save(path)
    if fmt == "dcp":
        return load_dcp(path, trust_pickle_metadata=trust_pickle_metadata)
    raise ValueError(f"unknown source format {fmt!r}; expected one of {', '.join(SOURCE_FORMATS)}")


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    source_format: str = "auto",
    target_format: str = "auto",
    overwrite: bool = False,
    allow_pickle: bool = False,
    trust_pickle_metadata: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    threads: int | None = None,
    read_progress: ProgressCallback | None = None,
    write_progress: ProgressCallback | None = None,
    storage_options: dict[str, Any] | None = None,
    keys: list[str] | str | None = None,
    strip_prefix: str | None = None,
    dtype: Any = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_BYTES,
    single_file: bool = False,
    config: Any = None,
    compression: str | dict[str, Any] | None = None,
) -> ConvertResult:
    """Convert the checkpoint at ``src`` into ``dst``, keeping every tensor's exact bits.

    ``hf`` (a target only when asked for: ``target_format="hf"``; a source detected by its
    ``model.safetensors.index.json`` or ``model.safetensors``) is the Hugging Face sharded
    layout: see :func:`gpuckpt.convert.hf.export_hf` for ``keys``, ``strip_prefix``,
    ``dtype`` (a cast of floating tensors), ``max_shard_size``, ``single_file`` and
    ``config``, which apply to it alone (``keys`` also selects what an ``hf`` source imports).
    A gpuckpt source of any number of ranks is assembled straight into the output files.

    Sources: a gpuckpt checkpoint, a safetensors file, a ``torch.save`` state
    dict (loaded with ``weights_only=True``; needs torch) or a
    torch.distributed.checkpoint directory (needs torch and
    ``trust_pickle_metadata=True``: its ``.metadata`` is a pickle). Targets:
    gpuckpt, or safetensors (``auto`` picks it when ``dst`` ends in
    ``.safetensors``), or torch (only when asked for: ``target_format="torch"``).
    A gpuckpt state written to safetensors keeps its plain
    values and nesting in ``__metadata__["gpuckpt.state"]`` (tagged JSON,
    never pickle), so converting back restores the same state dict.

    ``torch`` writes one ``torch.save`` file of the whole state dict, the file
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` writes: a
    gpuckpt checkpoint (written by ``dcp.save`` through
    :class:`gpuckpt.dcp.Writer` on any number of ranks, or by
    :func:`gpuckpt.save`) is loaded as DCP loads it through
    :class:`gpuckpt.dcp.Reader`, so tensors are whole and DCP's values are
    the objects it saved (pickled ones beyond what ``weights_only`` takes, and
    ``io.BytesIO``, only with ``allow_pickle=True``).

    ``src`` or ``dst`` may be an object-store URL (``s3://bucket/prefix``) of a
    gpuckpt checkpoint, with ``storage_options`` for it (default: the
    endpoint and credentials of the ``AWS_*`` environment); safetensors, torch
    and DCP files are local.

    ``compression`` (a gpuckpt target only): the chunks' compression, as the ``compression``
    option of :func:`gpuckpt.save` takes it (None, ``"zstd"``, ``"lz4"``, ``"auto"`` or a dict;
    docs/compression.md). A bad value, or one given for another target (whose files store
    tensors as they are), is an :class:`~gpuckpt.errors.InvalidOptionError` before anything
    is read.

    Examples
    --------
    >>> import numpy as np, gpuckpt, tempfile, os
    >>> from gpuckpt.convert import convert
    >>> d = tempfile.mkdtemp()
    >>> _ = gpuckpt.save({"w": np.ones(4, np.float32), "step": 3}, os.path.join(d, "ckpt"))
    >>> convert(os.path.join(d, "ckpt"), os.path.join(d, "model.safetensors")).tensors
    1
    """
    # validated as a save and a load validate them, before anything is read
    codecs = SaveOptions(
        compression=compression,
        overwrite=overwrite,
        allow_pickle=allow_pickle,
        chunk_bytes=chunk_bytes,
        threads=threads,
        progress=write_progress,
        storage_options=storage_options,
    ).codecs
    LoadOptions(progress=read_progress)
    keys = key_names(keys)
    _check_convert_options(
        source_format, target_format, trust_pickle_metadata, single_file, strip_prefix, config
    )
    # URLs stay text (a Path would fold their "//"); local paths become Paths
    src_p: Any = Path(src) if scheme_of(src) == "file" else os.fspath(src)
    dst_p: Any = Path(dst) if scheme_of(dst) == "file" else os.fspath(dst)
    fmt_in = detect_format(src_p) if source_format == "auto" else _as_given(src_p, source_format)
    if fmt_in not in SOURCE_FORMATS:
        raise InvalidOptionError(
            f"unknown source format {fmt_in!r}; expected auto or one of {', '.join(SOURCE_FORMATS)}"
        )
    fmt_out = target_format
    if fmt_out == "auto":
        fmt_out = "safetensors" if os.fspath(dst_p).endswith(".safetensors") else "gpuckpt"
    if fmt_out not in TARGET_FORMATS:
        raise InvalidOptionError(
            f"unknown target format {fmt_out!r}; expected auto or one of {', '.join(TARGET_FORMATS)}"
        )
    _hf_options_apply(fmt_in, fmt_out, keys, strip_prefix, dtype, max_shard_size, single_file, config)
    if codecs is not None and fmt_out != "gpuckpt":
        raise InvalidOptionError(
            f"compression applies to a gpuckpt target; the {fmt_out} target stores tensors as they "
            f"are: leave compression out, or convert to gpuckpt (--to gpuckpt)"
        )
    if fmt_out != "gpuckpt" and isinstance(dst_p, str):
        raise UnsupportedValueError(
            f"{dst_p}: {fmt_out} files are written to local paths; only gpuckpt to URLs"
        )
    if _same(src_p, dst_p):
        raise InvalidOptionError(f"source and destination are the same path ({src_p}); write to a new path")
    if isinstance(src_p, Path) and isinstance(dst_p, Path):
        try:
            s, d = src_p.resolve(), dst_p.resolve()
        except (OSError, RuntimeError) as exc:  # (a link loop: RuntimeError before Python 3.13)
            raise InvalidPathError(f"{src_p} or {dst_p} cannot be resolved to a path ({exc})") from None
        if s in d.parents or d in s.parents:
            raise InvalidOptionError(
                f"the destination {dst_p} and the source {src_p} are one inside the other: writing one "
                "would replace or change the other; write to a path outside the source"
            )
    if fmt_out == "hf" or fmt_in == "hf":
        return _convert_hf(
            src_p,
            dst_p,
            fmt_in,
            fmt_out,
            overwrite=overwrite,
            chunk_bytes=chunk_bytes,
            threads=threads,
            progress=write_progress,
            storage_options=storage_options,
            keys=keys,
            strip_prefix=strip_prefix,
            dtype=dtype,
            max_shard_size=max_shard_size,
            single_file=single_file,
            config=config,
            compression=compression,
        )
    # a URL destination: the store refuses a published checkpoint itself
    if (
        isinstance(dst_p, Path)
        and (dst_p.exists() or dst_p.is_symlink())
        and not overwrite
        and not (fmt_out == "gpuckpt" and empty_directory(dst_p))  # (a save takes an empty one)
    ):
        raise CheckpointExistsError(
            f"destination exists: {dst_p} (pass overwrite=True / --overwrite to replace it)"
        )
    if fmt_out == "torch":
        return _to_torch_save(
            src_p,
            dst_p,
            fmt_in,
            overwrite=overwrite,
            allow_pickle=allow_pickle,
            trust_pickle_metadata=trust_pickle_metadata,
            threads=threads,
            read_progress=read_progress,
            write_progress=write_progress,
            storage_options=storage_options,
        )
    state = _read(
        src_p,
        fmt_in,
        allow_pickle=allow_pickle,
        trust_pickle_metadata=trust_pickle_metadata,
        threads=threads,
        progress=read_progress,
        storage_options=storage_options,
    )
    tensors, objects, skeleton = _flat(state)
    nbytes = sum(t.nbytes for t in tensors.values())
    if fmt_out == "gpuckpt":
        api.save(
            state,
            dst_p,
            overwrite=overwrite,
            chunk_bytes=chunk_bytes,
            allow_pickle=allow_pickle,
            threads=threads,
            progress=write_progress,
            storage_options=storage_options if isinstance(dst_p, str) else None,
            compression=compression,
        )
    else:
        for name, arr in tensors.items():  # refuse before writing anything
            check_tensor_name(name)
            safetensors_code(arr.dtype, name)
        meta = None
        formats = {
            f: fmt.name
            for f, a in tensors.items()
            if (fmt := detect_memory_format(a.shape, a.strides, a.itemsize)) != contiguous_format
        }
        if objects or formats or not _is_flat(skeleton):
            enc = {f: encode_object(v, allow_pickle=allow_pickle, fqn=f) for f, v in objects.items()}
            extra = {"structure": skeleton, "objects": enc, "memory_formats": formats}
            meta = {STATE_KEY: json.dumps(extra, separators=(",", ":"))}
        write_safetensors(tensors, dst_p, metadata=meta, overwrite=overwrite, progress=write_progress)
    return ConvertResult(fmt_in, fmt_out, len(tensors), len(objects), nbytes)


def _to_torch_save(
    src: Any,
    dst: Path,
    fmt_in: str,
    *,
    overwrite: bool,
    allow_pickle: bool,
    trust_pickle_metadata: bool,
    threads: int | None,
    read_progress: ProgressCallback | None,
    write_progress: ProgressCallback | None,
    storage_options: dict[str, Any] | None,
) -> ConvertResult:
    """One ``torch.save`` file of the whole state dict, as DCP's ``dcp_to_torch_save`` writes it:
    gpuckpt checkpoints and DCP directories are loaded the way it loads them (through
    :class:`gpuckpt.dcp.Reader` and ``FileSystemReader``), other sources as read by ``convert``."""
    if fmt_in == "gpuckpt":
        state = torch_save.gpuckpt_state(
            src, allow_pickle=allow_pickle, threads=threads, storage_options=storage_options
        )
    elif fmt_in == "dcp":
        check_trusted(src, trust_pickle_metadata)
        from torch.distributed.checkpoint import FileSystemReader

        state = torch_save.dcp_state(FileSystemReader(os.fspath(src)))
    else:
        read = _read(
            src,
            fmt_in,
            allow_pickle=allow_pickle,
            trust_pickle_metadata=trust_pickle_metadata,
            threads=threads,
            progress=read_progress,
        )
        state = torch_save.numpy_to_torch(read)
    tensors, objects, nbytes = torch_save.count(state)
    torch_save.write_torch_save(state, dst, overwrite=overwrite)
    if write_progress is not None:
        write_progress(nbytes, nbytes)
    return ConvertResult(fmt_in, "torch", tensors, objects, nbytes)


def _as_given(src: Any, source_format: str) -> str:
    """``source_format`` where ``src`` is of it, or where its format cannot be told from its
    content (what ``--from`` is for); an :class:`~gpuckpt.errors.InvalidOptionError` where the
    content says it is another (it was read as what it is, and reported as what was given)."""
    if source_format not in SOURCE_FORMATS:
        return source_format  # (refused with the list of formats below)
    try:
        found = detect_format(src)
    except (GpuckptError, OSError):
        return source_format  # its content does not say: as given
    if found != source_format and not (source_format == "hf" and found == "safetensors"):
        raise InvalidOptionError(
            f"source format {source_format!r} (--from) was given, but {src} is a {found} "
            f"{'directory' if isinstance(src, Path) and src.is_dir() else 'file'}: leave the "
            f"format out (auto) or pass --from {found}"
        )
    return source_format


def _check_convert_options(
    source_format: Any, target_format: Any, trust: Any, single_file: Any, strip_prefix: Any, config: Any
) -> None:
    """The options of :func:`convert` that no save or load checks, each an
    :class:`~gpuckpt.errors.InvalidOptionError` naming it."""
    for name, value in (("source_format", source_format), ("target_format", target_format)):
        if not isinstance(value, str):
            raise InvalidOptionError(f"{name} must be a format name (a str) or 'auto', got {value!r}")
    for name, value in (("trust_pickle_metadata", trust), ("single_file", single_file)):
        if not isinstance(value, bool):
            raise InvalidOptionError(f"{name} must be True or False, got {value!r}")
    if strip_prefix is not None and not isinstance(strip_prefix, str):
        raise InvalidOptionError(
            f"strip_prefix must be a str (such as 'model.') or None, got {strip_prefix!r}"
        )
    if config is not None and not isinstance(config, (str, os.PathLike)):
        if not isinstance(config, dict):
            raise InvalidOptionError(
                "config must be a config.json path, a dict of JSON values or None, got "
                f"{type(config).__name__}"
            )
        try:
            json.dumps(config, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidOptionError(f"config must hold JSON values only: {exc}") from None


def _hf_options_apply(
    fmt_in: str,
    fmt_out: str,
    keys: list[str] | None,
    strip_prefix: str | None,
    dtype: Any,
    max_shard_size: Any,
    single_file: bool,
    config: Any,
) -> None:
    """Refuse the options of the Hugging Face layout for a conversion they do nothing to (they
    were silently ignored): ``keys`` selects what an hf target exports or an hf source imports,
    the others shape an hf target."""
    options = {
        "keys": keys is not None and fmt_in != "hf",  # (keys also select what an hf source imports)
        "strip_prefix": strip_prefix is not None,
        "dtype": dtype is not None,
        "max_shard_size": max_shard_size != DEFAULT_MAX_SHARD_BYTES,
        "single_file": single_file,
        "config": config is not None,
    }
    given = [name for name, set_ in options.items() if set_]
    if given and fmt_out != "hf":
        raise InvalidOptionError(
            f"{', '.join(given)} {'is an option' if len(given) == 1 else 'are options'} of a Hugging Face "
            "target (target_format='hf', --to hf)"
            f"{' and keys to a Hugging Face source' if 'keys' in given else ''}; this converts "
            f"{fmt_in} to {fmt_out}: leave {'it' if len(given) == 1 else 'them'} out"
        )


def _convert_hf(src: Any, dst: Any, fmt_in: str, fmt_out: str, **kw: Any) -> ConvertResult:
    """The Hugging Face layout: from a gpuckpt checkpoint, or into one."""
    if fmt_out == "hf" and fmt_in == "gpuckpt":
        out = export_hf(
            src,
            dst,
            keys=kw["keys"],
            strip_prefix=kw["strip_prefix"],
            dtype=kw["dtype"],
            max_shard_size=kw["max_shard_size"],
            single_file=kw["single_file"],
            config=kw["config"],
            overwrite=kw["overwrite"],
            threads=kw["threads"],
            progress=kw["progress"],
            storage_options=kw["storage_options"],
        )
        return ConvertResult(fmt_in, "hf", out.tensors, 0, out.nbytes)
    if fmt_in == "hf" and fmt_out == "gpuckpt":
        n, nbytes = import_hf(
            src,
            dst,
            keys=kw["keys"],
            overwrite=kw["overwrite"],
            chunk_bytes=kw["chunk_bytes"],
            threads=kw["threads"],
            progress=kw["progress"],
            storage_options=kw["storage_options"] if isinstance(dst, str) else None,
            compression=kw["compression"],
        )
        return ConvertResult("hf", fmt_out, n, 0, nbytes)
    raise UnsupportedValueError(
        f"{fmt_in} -> {fmt_out}: the Hugging Face layout converts to and from gpuckpt only; convert "
        f"to gpuckpt first (gpuckpt convert SRC CKPT), then to {fmt_out}"
    )


def _leaf_names(structure: Any) -> set[str]:
    """The FQNs of the leaves a stored structure (:func:`gpuckpt.state.unflatten_state_dict`'s
    skeleton) rebuilds."""
    found: set[str] = set()
    stack = [structure]
    while stack:  # (a structure unflatten_state_dict has accepted: tagged nodes of one key)
        ((tag, body),) = stack.pop().items()
        if tag == "v":
            found.add(body)
        elif tag == "d":
            stack.extend(child for _, _, child in body)
        else:
            stack.extend(body)
    return found


def _same(a: Path | str, b: Path | str) -> bool:
    if isinstance(a, Path) and isinstance(b, Path):
        return a.absolute() == b.absolute()
    return os.fspath(a).rstrip("/") == os.fspath(b).rstrip("/")


def _in_memory_format(arr: np.ndarray, name: Any, path: Path) -> np.ndarray:
    """``arr`` (C order) copied into the strides of memory format ``name``."""
    try:
        fmt = memory_format_from_name(name)
    except (KeyError, TypeError):
        raise MetadataError(
            f"{path}: unknown memory format {name!r} in __metadata__[{STATE_KEY!r}]"
        ) from None
    order = physical_order(arr.ndim, fmt)
    physical = np.ascontiguousarray(arr.transpose(order))
    return physical.transpose([order.index(a) for a in range(arr.ndim)])


def _is_flat(skeleton: Any) -> bool:
    """True when the state is one dict of tensors keyed by their names (nothing to record)."""
    body = skeleton.get("d") if isinstance(skeleton, dict) else None
    return isinstance(body, list) and all(
        isinstance(item, list) and item[0] == "s" and item[2] == {"v": item[1]} for item in body
    )
