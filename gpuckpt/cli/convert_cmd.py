"""``gpuckpt convert SRC DST``: between gpuckpt, safetensors and PyTorch formats."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from gpuckpt.cli.progressbar import format_bytes, progress_for
from gpuckpt.cli.usage import UsageError
from gpuckpt.convert.core import SOURCE_FORMATS, TARGET_FORMATS, convert, detect_format
from gpuckpt.convert.hf_layout import parse_size
from gpuckpt.errors import GpuckptError, InvalidOptionError
from gpuckpt.options import SaveOptions
from gpuckpt.printable import printable
from gpuckpt.storage.stores import scheme_of

HELP = (
    "convert a safetensors file, a Hugging Face directory, a torch.save state dict or a "
    "torch.distributed.checkpoint directory into gpuckpt, or a gpuckpt checkpoint into safetensors, "
    "(--to hf) a Hugging Face sharded directory or (--to torch) one torch.save file"
)


#: The largest ``--chunk-mb`` (1 TiB): a chunk is one file, read and checked whole.
MAX_CHUNK_MB = 1 << 20


def _chunk_mb(text: str) -> float:
    """``--chunk-mb``: a finite number of MiB in (0, MAX_CHUNK_MB] of at least one byte."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB, got {text!r}") from None
    # written so that NaN fails too; int() of inf or of 1e308 MiB in bytes would overflow
    if not (0 < value <= MAX_CHUNK_MB and value * 2**20 >= 1):
        raise argparse.ArgumentTypeError(
            f"must be a number of MiB of at least one byte and at most {MAX_CHUNK_MB}, got {text!r}"
        )
    return value


def _compression(text: str) -> Any:
    """``--compression``: none, a name the ``compression`` save option takes (zstd, lz4, auto), or
    its dict spec as a JSON object; checked as a save checks it."""
    value: Any = None if text == "none" else text
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object ({exc})") from None
    try:
        SaveOptions(compression=value)
    except InvalidOptionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


#: what each format ``convert`` reads besides gpuckpt is, in words, and what its command adds
_FOREIGN = {
    "hf": ("a Hugging Face model directory (safetensors weights and their index)", ""),
    "safetensors": ("a safetensors file", ""),
    "torch": ("a torch.save file", ""),
    "dcp": ("a torch.distributed.checkpoint directory", " --trust-pickle-metadata"),
}


def not_gpuckpt(text: str, command: str) -> str | None:
    """Where the local ``text`` is a file or directory of a format ``convert`` reads (a Hugging
    Face directory, a safetensors, torch.save or DCP checkpoint), what it is and the command
    lines that convert it and then run ``command`` on the result; else None."""
    if scheme_of(text) != "file":
        return None
    try:
        fmt = detect_format(Path(text))
    except (GpuckptError, OSError, ValueError):  # (what it is not: the caller's error says)
        return None
    if fmt not in _FOREIGN:
        return None
    what, extra = _FOREIGN[fmt]
    src = shlex.quote(text.rstrip("/") or text)
    return (
        f"{printable(text)} is {what}, not a gpuckpt checkpoint (a directory holding zarr.json): "
        f"convert it first, then {command} the result: gpuckpt convert {printable(src)} CKPT{extra} "
        f"&& gpuckpt {command} CKPT"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="source file or directory")
    p.add_argument("dst", metavar="DST", help="destination (a .safetensors name writes safetensors)")
    p.add_argument(
        "--from",
        dest="source_format",
        choices=("auto", *SOURCE_FORMATS),
        default="auto",
        help="source format (default: detected)",
    )
    p.add_argument(
        "--to",
        dest="target_format",
        choices=("auto", *TARGET_FORMATS),
        default="auto",
        help="target format (default: safetensors for a .safetensors DST, else gpuckpt); torch: "
        "one torch.save file of the whole state dict, as DCP's dcp_to_torch_save writes; hf: a "
        "Hugging Face directory (model-0000i-of-0000N.safetensors and model.safetensors.index.json)",
    )
    hf = p.add_argument_group("the Hugging Face layout (--to hf; --keys also for an hf source)")
    hf.add_argument(
        "--keys",
        action="append",
        metavar="KEY",
        help="export only these tensors: names or .-prefixes (repeat for several; default: all)",
    )
    hf.add_argument("--strip-prefix", metavar="PREFIX", help="remove PREFIX from names (e.g. 'model.')")
    hf.add_argument("--dtype", help="cast floating tensors to this dtype (e.g. bfloat16, float16)")
    hf.add_argument(
        "--max-shard-size",
        default="5GB",
        help="most bytes of tensor data per shard (5GB, as transformers; units KB MB GB, KiB MiB GiB)",
    )
    hf.add_argument(
        "--single-file", action="store_true", help="write one model.safetensors (no index) if it fits"
    )
    hf.add_argument(
        "--config",
        metavar="PATH",
        help="a config.json, or a model directory whose config.json and generation_config.json are "
        "copied beside the weights (from_pretrained needs config.json)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help=(
            "replace DST if it is a checkpoint or file; into a directory of other files a gpuckpt"
            " DST is published beside them (a clash of names is refused), an hf DST is refused"
        ),
    )
    p.add_argument(
        "--chunk-mb",
        type=_chunk_mb,
        default=64.0,
        help=f"target chunk size of a gpuckpt DST in MiB (64; more than 0, at most {MAX_CHUNK_MB})",
    )
    p.add_argument(
        "--compression",
        type=_compression,
        default=None,
        metavar="CHOICE",
        help="compress the chunks of a gpuckpt DST: zstd, lz4, auto (only where it pays) or none "
        '(default), or a JSON spec such as \'{"codec": "zstd", "level": 3}\' '
        "(docs/compression.md); not for the other targets",
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="store or load plain values that need pickle (loading runs their code)",
    )
    p.add_argument(
        "--trust-pickle-metadata",
        action="store_true",
        help="read a torch.distributed.checkpoint .metadata file, which is a pickle "
        "(reading it can run arbitrary code)",
    )


def run(args: argparse.Namespace) -> int:
    if not 0 < args.chunk_mb <= MAX_CHUNK_MB:  # when called without the parser
        raise UsageError(f"--chunk-mb must be in (0, {MAX_CHUNK_MB}], got {args.chunk_mb}")
    read_bar = progress_for("read ", quiet=args.quiet)
    write_bar = progress_for("write", quiet=args.quiet)

    def on_write(done: int, total: int) -> None:
        if read_bar is not None:
            read_bar.close()
        if write_bar is not None:
            write_bar(done, total)

    try:
        res = convert(
            args.src,
            args.dst,
            source_format=args.source_format,
            target_format=args.target_format,
            overwrite=args.overwrite,
            allow_pickle=args.allow_pickle,
            trust_pickle_metadata=args.trust_pickle_metadata,
            chunk_bytes=int(args.chunk_mb * 2**20),
            threads=args.threads,
            read_progress=read_bar,
            write_progress=on_write,
            keys=getattr(args, "keys", None),
            strip_prefix=getattr(args, "strip_prefix", None),
            dtype=getattr(args, "dtype", None),
            max_shard_size=parse_size(getattr(args, "max_shard_size", "5GB")),
            single_file=getattr(args, "single_file", False),
            config=getattr(args, "config", None),
            compression=getattr(args, "compression", None),
        )
    finally:
        for bar in (read_bar, write_bar):
            if bar is not None:
                bar.close()
    print(
        f"converted {printable(args.src)} ({res.source_format}) -> {printable(args.dst)} "
        f"({res.target_format}): {res.tensors} tensors, {format_bytes(res.nbytes)}, "
        f"{res.objects} plain values"
    )
    return 0
