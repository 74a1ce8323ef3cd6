"""``gpuckpt inspect PATH``: what a checkpoint holds, from its metadata and its files' sizes.

Sizes come in three kinds, because a hostile or damaged checkpoint may
claim far more than it holds: the bytes the metadata claims, the apparent
size of the chunk files found (``st_size``), and what they take on disk
(allocated blocks; a sparse file claims terabytes in a few kilobytes).
Only the file sizes are looked at; ``gpuckpt verify`` reads the bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Any

from gpuckpt.cli.convert_cmd import not_gpuckpt
from gpuckpt.cli.progressbar import format_bytes
from gpuckpt.cli.usage import EXIT_FAILURE
from gpuckpt.errors import CheckpointNotFoundError, GpuckptError
from gpuckpt.format.checksum import CRC_BYTES
from gpuckpt.format.codecs import auto_report
from gpuckpt.format.dtypes import dtype_name
from gpuckpt.format.parts import PartRecord, parse_part_name
from gpuckpt.format.values import decode_object
from gpuckpt.loading.checks import TensorEntry, load_chunk_records, overclaimed
from gpuckpt.loading.open import open_checkpoint
from gpuckpt.manager import step_of
from gpuckpt.printable import printable
from gpuckpt.runtime.collector import paused_gc
from gpuckpt.storage.base import CheckpointReader
from gpuckpt.storage.stores import open_root, scheme_of
from gpuckpt.tiers import tree_bytes
from gpuckpt.tiers.local import LOCK_NAME

HELP = (
    "list the tensors and values of a checkpoint (or the steps under a manager's root, or the parts "
    "in a local tier)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path",
        metavar="PATH",
        help="checkpoint directory or s3:// URL (endpoint and credentials from the AWS_* environment), "
        "or a CheckpointManager root",
    )
    p.add_argument("--json", action="store_true", help="print JSON for scripts")


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(s) for s in shape) if shape else "()"


def _stored_bytes(t: TensorEntry) -> int:
    """What the metadata claims the chunk files of ``t`` hold, without a record per chunk (a
    compressed tensor: the sizes its records give; the most its codec stores where they were
    not read)."""
    if t.codec is not None:
        return int(t.sizes.sum()) if t.sizes is not None else t.nchunks * t.max_stored()
    grid = t.grid
    if grid.kind == "regular":
        return t.nchunks * (math.prod(grid.chunk_shape) * t.dtype.itemsize + CRC_BYTES)
    return t.nbytes + t.nchunks * CRC_BYTES  # a rectilinear grid stores each chunk as it is


def _tensor_row(reader: CheckpointReader, t: TensorEntry, held: set[str] | None = None) -> dict[str, Any]:
    """``held``: the chunk files of a tensor that claims more chunks than its array holds
    (:func:`~gpuckpt.loading.checks.overclaimed`): only those are looked at."""
    grid = t.grid
    keys = sorted(held) if held is not None else [c.key for c in t.chunks]
    usage = [reader.chunk_usage(t.name, k) for k in keys]
    found = [u for u in usage if u is not None]
    # chunk files an incremental save shares with other checkpoints (hard links)
    shared = sum(u[0] for k, u in zip(keys, usage, strict=True) if u and reader.chunk_shared(t.name, k))
    return {
        "name": t.fqn,
        "shape": list(t.shape),
        "dtype": dtype_name(t.dtype),
        "memory_format": t.memory_format.name,
        "chunks": t.nchunks,
        "chunk_shape": list(grid.chunk_shape) if grid.kind == "regular" else None,
        "bytes": t.nbytes,
        "codec": _codec(t),
        "stored_bytes": _stored_bytes(t),  # what the metadata claims
        "file_bytes": sum(size for size, _ in found),  # apparent size of the chunk files found
        "disk_bytes": sum(used for _, used in found),  # what they take on disk
        "shared_bytes": shared,  # of file_bytes: in files shared with other checkpoints
        "own_bytes": sum(size for size, _ in found) - shared,  # of file_bytes: this checkpoint's own
        "missing_chunks": t.nchunks - len(found),
    }


def _codec(t: TensorEntry) -> str | None:
    """The compression of ``t``'s chunks in a few words (None: stored as they are)."""
    c = t.codec
    if c is None:
        return None
    return f"zstd-{c.level}" if c.name == "zstd" else f"blosc {c.cname}-{c.level} {c.shuffle}"


_JSON_VALUE_CHARS = 4096  # a plain value's exact JSON form is given up to this size


def _json_form(value: Any, budget: list[int]) -> Any:
    """``value`` as exact JSON (tuples as lists), or raise ValueError where JSON cannot say it
    exactly (a non-finite float, a dict key that is not a str, bytes, sets, ...) or it is long."""
    budget[0] -= 1 + (len(value) if isinstance(value, str) else 0)
    budget[0] -= value.bit_length() // 3 if isinstance(value, int) else 0
    if budget[0] < 0:
        raise ValueError("too long")
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("not finite")
        return float(value)
    if isinstance(value, list | tuple):
        return [_json_form(v, budget) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_form(v, budget) for k, v in value.items()}
    raise ValueError("not JSON")


def _object_row(fqn: str, enc: Any) -> dict[str, Any]:
    """One plain value: its name, type tag, a short display ``value`` and, where JSON says it
    exactly and it is short, its ``json`` form (a tuple as a list)."""
    tag = next(iter(enc)) if isinstance(enc, dict) and len(enc) == 1 else "?"
    exact: list[Any] = []
    if tag == "pickle":
        value = f"<pickled, {len(str(enc['pickle'])) * 3 // 4} bytes; not decoded>"
    else:
        try:
            decoded = decode_object(enc, fqn=fqn)
        except GpuckptError as exc:
            value = f"<undecodable: {exc}>"
        else:
            with contextlib.suppress(ValueError):
                exact.append(_json_form(decoded, [_JSON_VALUE_CHARS]))
            try:
                value = repr(decoded)
            except ValueError:  # holds an int past Python's int-to-str digit limit
                value = f"<{type(decoded).__name__} holding an int too long to print>"
    if len(value) > 60:
        value = value[:57] + "..."
    row = {"name": fqn, "type": tag, "value": value}
    return row | {"json": exact[0]} if exact else row


def describe_checkpoint(path: Path | str) -> dict[str, Any]:
    """Everything ``inspect`` shows, as JSON values."""
    with paused_gc():
        ck = open_checkpoint(path, shared=False)
        reader, index, tensors, objects = ck.reader, ck.index, ck.index.tensors, ck.index.objects
        # a tensor claiming more chunks than its array holds: only the files there are looked at
        short = {
            bad.tensor.fqn: reader.chunk_keys(bad.tensor.name)
            for bad in overclaimed(reader, tensors.values())
        }
        load_chunk_records(reader, [t for t in tensors.values() if t.fqn not in short])
        rows = [_tensor_row(reader, t, short.get(t.fqn)) for t in tensors.values()]
    meta = index.storage_meta
    auto = auto_report(index.planner_data)
    return {
        "path": str(path),
        "version": index.version,
        "checkpoint_id": None if meta is None or meta.checkpoint_id is None else str(meta.checkpoint_id),
        # what compression="auto" decided, and why it left each large tensor uncompressed
        "auto_compression": None if auto is None else {"decision": auto[0], "tensors": auto[1]},
        "tensors": rows,
        "objects": [_object_row(f, e) for f, e in objects.items()],
        "totals": {
            "tensors": len(rows),
            "chunks": sum(r["chunks"] for r in rows),
            "bytes": sum(r["bytes"] for r in rows),
            "stored_bytes": sum(r["stored_bytes"] for r in rows),
            "file_bytes": sum(r["file_bytes"] for r in rows),
            "disk_bytes": sum(r["disk_bytes"] for r in rows),
            "shared_bytes": sum(r["shared_bytes"] for r in rows),
            "own_bytes": sum(r["own_bytes"] for r in rows),
            "missing_chunks": sum(r["missing_chunks"] for r in rows),
            "objects": len(objects),
        },
    }


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    rows = [[printable(c) for c in r] for r in rows]  # names and values are the checkpoint's
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


#: tensors whose "auto" reason the text output lists (all of them in --json)
_AUTO_LINES = 20


def format_description(d: dict[str, Any], *, warn: bool = True) -> str:
    out = [
        f"checkpoint {printable(d['path'])} (format version {printable(d['version'])}, "
        f"id {printable(d['checkpoint_id'])})",
        "",
    ]
    rows = []
    for r in d["tensors"]:
        chunks = str(r["chunks"])
        if r["chunk_shape"] is not None and r["chunks"] > 1:
            chunks += f" of {_shape(tuple(r['chunk_shape']))}"
        rows.append(
            [
                r["name"],
                _shape(tuple(r["shape"])),
                r["dtype"],
                r["memory_format"],
                chunks,
                format_bytes(r["bytes"]),
                format_bytes(r["stored_bytes"]),
                r.get("codec") or "-",
            ]
        )
    out.append(f"tensors ({len(rows)}):")
    header = ["name", "shape", "dtype", "memory format", "chunks", "bytes", "stored", "codec"]
    out += ["  " + line for line in _table(header, rows, {4, 5, 6})]
    if d["objects"]:
        out += ["", f"objects ({len(d['objects'])}):"]
        orows = [[o["name"], o["type"], o["value"]] for o in d["objects"]]
        out += ["  " + line for line in _table(["name", "type", "value"], orows, set())]
    auto = d.get("auto_compression")
    if auto is not None:
        out += ["", f'compression "auto": {printable(auto["decision"])}']
        why = list(auto["tensors"].items())
        out += [f"  {printable(name)}: {printable(reason)}" for name, reason in why[:_AUTO_LINES]]
        if len(why) > _AUTO_LINES:
            out.append(
                f"  ... and {len(why) - _AUTO_LINES} more tensors left uncompressed (--json lists them)"
            )
    t = d["totals"]
    remote = "://" in str(d["path"]) and not str(d["path"]).startswith("file://")
    found = (
        f"{format_bytes(t['file_bytes'])} found"
        if remote  # an object store says nothing of blocks or links
        else f"{format_bytes(t['file_bytes'])} found ({format_bytes(t['disk_bytes'])} allocated on disk)"
    )
    out += [
        "",
        f"total: {t['tensors']} tensors, {t['chunks']} chunks, {format_bytes(t['bytes'])}; "
        f"chunk {'objects' if remote else 'files'}: {format_bytes(t['stored_bytes'])} claimed by the "
        f"metadata, {found}; {t['objects']} objects",
        f"stored: {format_bytes(t['stored_bytes'])} for {format_bytes(t['bytes'])} of tensors"
        + _ratio(t["bytes"], t["stored_bytes"]),
        f"sharing: {format_bytes(t['own_bytes'])} in chunk files of its own, "
        f"{format_bytes(t['shared_bytes'])} in chunk files shared with other checkpoints "
        "(hard links of incremental saves)"
        if not remote
        else "sharing: none on an object store (server-side copies are objects of their own)",
    ]
    if warn and _damaged(t):
        out.append(f"warning: {_damage_line(t)}")
    return "\n".join(out)


def _sharing(path: Path | str) -> dict[str, int | None]:
    """Own and shared chunk bytes of one step (None where its metadata cannot be read)."""
    try:
        totals = describe_checkpoint(path)["totals"]
    except (GpuckptError, OSError):
        return {"own_bytes": None, "shared_bytes": None}
    return {"own_bytes": totals["own_bytes"], "shared_bytes": totals["shared_bytes"]}


def describe_root(path: Path | str) -> dict[str, Any] | None:
    """The committed steps under a CheckpointManager root, or None if there are none."""
    steps: list[dict[str, Any]] = []
    if isinstance(path, Path) and not path.is_dir():
        return None
    root = open_root(path)
    for name in root.children():
        step = step_of(name)
        if step is not None and root.is_committed(name):
            child = root.child(name)
            steps.append({"step": step, "path": str(child), **_sharing(child)})
    if not steps:
        return None
    steps.sort(key=lambda s: s["step"])
    return {"root": str(path), "steps": steps, "latest_step": steps[-1]["step"]}


def describe_tier(path: Path) -> dict[str, Any] | None:
    """The parts in a manager's local tier (``local_dir``) by step, or None if it holds none.

    Each step lists the parts held here by rank, with the node that wrote each one (a part
    written elsewhere is a replica) and its save; ``complete_here``: this directory alone
    holds every rank's part of one save. What the other nodes hold is in their tiers."""
    if not path.is_dir():
        return None
    root = open_root(path)
    steps: dict[int, dict[str, Any]] = {}
    for name in root.children():
        parsed = parse_part_name(name)
        if parsed is None or not root.is_committed(name):
            continue
        step, rank = parsed
        entry = steps.setdefault(step, {"step": step, "parts": {}})
        try:
            record = PartRecord.from_planner_data(open_checkpoint(path / name).index.metadata().planner_data)
        except (GpuckptError, OSError) as exc:
            entry["parts"][rank] = {"error": str(exc)}
            continue
        if record is None:
            entry["parts"][rank] = {"error": "not a part (no record of what it is a part of)"}
            continue
        if (record.step, record.rank) != (step, rank):  # (a restore passes it over too)
            entry["parts"][rank] = {
                "error": f"its record is of step {record.step}, rank {record.rank}: "
                "not the part its name says"
            }
            continue
        entry["parts"][rank] = {
            "node": record.node,
            "save_id": record.save_id,
            "world_size": record.world_size,
            "bytes": tree_bytes(path / name),
        }
    if not steps:
        return None
    for entry in steps.values():
        parts = entry["parts"]
        saves = {(p.get("save_id"), p.get("world_size")) for p in parts.values()}
        world = next(iter(saves))[1] if len(saves) == 1 else None
        entry["complete_here"] = world is not None and sorted(parts) == list(range(world))
        # parts of one step number written by different saves (jobs of other ranks, say): told apart
        entry["saves"] = len({(p["save_id"], p["world_size"]) for p in parts.values() if "error" not in p})
    ordered = [steps[s] for s in sorted(steps)]
    return {"local_dir": str(path), "steps": ordered}


def _empty(path: Path) -> str:
    """What a directory that holds no checkpoint, no committed step and no part is."""
    what = (
        "a local tier with no part in it (a new one, or one whose steps were all deleted)"
        if (path / LOCK_NAME).is_file()
        else "not a committed checkpoint, nor a CheckpointManager root or local tier with anything in it"
    )
    return f"{path} is {what}: no checkpoint, committed step or tier part to show"


def _print_tier(tier: dict[str, Any]) -> None:
    print(f"{printable(tier['local_dir'])} is a local tier with {len(tier['steps'])} step(s):")
    for entry in tier["steps"]:
        shown = []
        several = entry.get("saves", 1) > 1
        labels: dict[tuple[Any, Any], str] = {}
        for rank, p in sorted(entry["parts"].items()):
            if "error" in p:
                shown.append(f"rank {rank} damaged ({printable(p['error'])})")
                continue
            save = labels.setdefault(
                (p["save_id"], p["world_size"]), "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[len(labels) % 26]
            )
            of = f" (save {save}, a job of {p['world_size']} ranks)" if several else ""
            shown.append(f"rank {rank} from {printable(p['node'])}{of}")
        whole = "every rank's part here" if entry["complete_here"] else "not every rank's part here"
        if several:
            whole = f"parts of {entry['saves']} different saves of this step number, never restored together"
        print(f"  {entry['step']:>10}  {whole}: {', '.join(shown)}")


def run(args: argparse.Namespace) -> int:
    # a URL stays text (a Path would fold its "//")
    path: Path | str = Path(args.path) if scheme_of(args.path) == "file" else args.path
    try:
        d = describe_checkpoint(path)
    except CheckpointNotFoundError:
        foreign = not_gpuckpt(args.path, "inspect")
        if foreign is not None:
            raise CheckpointNotFoundError(foreign) from None
        root = describe_root(path)
        if root is None:
            tier = describe_tier(path) if isinstance(path, Path) else None
            if tier is None:
                if isinstance(path, Path) and path.is_dir():
                    raise CheckpointNotFoundError(_empty(path)) from None
                raise
            if args.json:
                print(json.dumps(tier, indent=2))
            else:
                _print_tier(tier)
            return 0
        if args.json:
            print(json.dumps(root, indent=2))
        else:
            print(f"{printable(path)} is a checkpoint root with {len(root['steps'])} committed step(s):")
            for s in root["steps"]:
                sharing = (
                    ""
                    if s["own_bytes"] is None
                    else f"  own {format_bytes(s['own_bytes'])}, shared {format_bytes(s['shared_bytes'])}"
                )
                print(f"  {s['step']:>10}  {printable(s['path'])}{sharing}")
            print(
                f"latest step: {root['latest_step']} "
                f"(inspect it with: gpuckpt inspect {printable(root['steps'][-1]['path'])})"
            )
        return 0
    print(json.dumps(d, indent=2) if args.json else format_description(d, warn=False))
    t = d["totals"]
    if _damaged(t):
        # what inspect saw of damage: one line on stderr and a failed exit, as verify gives
        print(f"gpuckpt: error: {_damage_line(t)}", file=sys.stderr)
        return EXIT_FAILURE
    return 0


def _damaged(t: dict[str, Any]) -> bool:
    """Whether a checkpoint's totals show chunk files missing or of other sizes than claimed."""
    return bool(t["missing_chunks"]) or t["file_bytes"] != t["stored_bytes"]


def _damage_line(t: dict[str, Any]) -> str:
    return (
        f"{t['missing_chunks']} chunk file(s) missing, and the chunk files found hold "
        f"{t['file_bytes']} bytes where the metadata claims {t['stored_bytes']}: the checkpoint "
        "is damaged or not what it claims; run gpuckpt verify"
    )


def _ratio(logical: int, stored: int) -> str:
    """`` (1.46x smaller)`` or `` (1.08x larger)`` (small chunks carry their checksums), or nothing."""
    if not stored or not logical:
        return ""
    if stored <= logical:
        return f" ({logical / stored:.2f}x smaller)"
    return f" ({stored / logical:.2f}x larger: each chunk also stores its 4-byte CRC32C)"
