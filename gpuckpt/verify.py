"""Check a whole checkpoint: metadata, array documents, every chunk's checksum, every value.

Unlike a load, which stops at the first problem, :func:`verify_checkpoint`
reads everything and lists every damaged part, so that one report tells
what is left to salvage. Chunks are read into scratch memory a group of
tensors at a time, so memory stays bounded by the largest tensor (or
``group_bytes``), not by the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpuckpt.dtypes import dtype_name
from gpuckpt.errors import CheckpointCorruptedError, ChecksumError, MetadataError, UnsafeCheckpointError
from gpuckpt.progress import ProgressCallback, ProgressCounter
from gpuckpt.reading import ChunkRead, TensorEntry, read_tensors, validate_metadata
from gpuckpt.storage.layout import metadata_from_root_document
from gpuckpt.storage.local import LocalReader
from gpuckpt.storage.objects import decode_object
from gpuckpt.writing import default_threads

__all__ = ["Damage", "VerifyReport", "verify_checkpoint"]


@dataclass(frozen=True, slots=True)
class Damage:
    """One damaged part: ``where`` is a path inside the checkpoint (``layer.weight/c.1.0``)."""

    where: str
    problem: str
    fqn: str | None = None


@dataclass(slots=True)
class VerifyReport:
    """What :func:`verify_checkpoint` found; ``ok`` is True when nothing is damaged."""

    path: str
    tensors: int = 0
    objects: int = 0
    chunks: int = 0
    bytes_checked: int = 0
    damage: list[Damage] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.damage

    def damaged_tensors(self) -> list[str]:
        return sorted({d.fqn for d in self.damage if d.fqn is not None})

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "tensors": self.tensors,
            "objects": self.objects,
            "chunks": self.chunks,
            "bytes_checked": self.bytes_checked,
            "damage": [dataclasses.asdict(d) for d in self.damage],
            "skipped": list(self.skipped),
        }

    def format(self) -> str:
        """A human-readable summary, one damaged part per line."""
        lines = []
        if self.ok:
            lines.append(
                f"OK: {self.path}: {self.tensors} tensors ({self.chunks} chunks, "
                f"{self.bytes_checked / 1e6:.1f} MB) and {self.objects} values verified"
            )
        else:
            lines.append(
                f"DAMAGED: {self.path}: {len(self.damage)} problem(s) in "
                f"{len(self.damaged_tensors())} tensor(s) of {self.tensors}"
            )
            lines.extend(f"  {d.where}: {d.problem}" for d in self.damage)
        lines.extend(f"  not checked: {s}" for s in self.skipped)
        return "\n".join(lines)


def _expected_array_doc(t: TensorEntry) -> dict[str, Any]:
    codecs: list[dict[str, Any]] = [{"name": "bytes"}, {"name": "crc32c"}]
    if t.dtype.itemsize > 1:
        codecs[0]["configuration"] = {"endian": "little"}
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(t.shape),
        "data_type": dtype_name(t.dtype),
        "chunk_grid": t.grid.to_zarr_json(),
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "codecs": codecs,
    }


def _check_array_doc(reader: LocalReader, t: TensorEntry) -> Damage | None:
    where = f"{t.name}/zarr.json"
    try:
        doc = json.loads(reader.read_array_document(t.name))
    except FileNotFoundError:
        return Damage(where, "missing", t.fqn)
    except (OSError, ValueError, RecursionError) as exc:
        return Damage(where, f"unreadable ({exc})", t.fqn)
    if not isinstance(doc, dict):
        return Damage(where, "is not a JSON object", t.fqn)
    for key, want in _expected_array_doc(t).items():
        if doc.get(key) != want:
            return Damage(where, f"{key} is {doc.get(key)!r}, the metadata says {want!r}", t.fqn)
    attrs = doc.get("attributes")
    mine = attrs.get("gpuckpt") if isinstance(attrs, dict) else None
    fmt = t.metadata.properties.memory_format.name
    if not isinstance(mine, dict) or mine.get("fqn") != t.fqn or mine.get("memory_format") != fmt:
        return Damage(
            where, f"attributes.gpuckpt is {mine!r}, expected fqn {t.fqn!r} and memory format {fmt}", t.fqn
        )
    return None


def _check_chunk(reader: LocalReader, t: TensorEntry, c: ChunkRead, scratch: np.ndarray) -> Damage | None:
    where = f"{t.name}/{c.key}"
    size = reader.chunk_nbytes(t.name, c.key)
    if size is None:
        return Damage(where, "missing", t.fqn)
    if size != c.nbytes:
        return Damage(where, f"is {size} bytes, expected {c.nbytes} (truncated or overwritten)", t.fqn)
    one = TensorEntry(t.fqn, t.name, t.metadata, t.grid, [c])
    try:
        read_tensors(reader, [(one, scratch)], threads=1)
    except CheckpointCorruptedError as exc:
        problem = str(exc)
        if isinstance(exc, ChecksumError):
            # keep the "computed / chunk file / metadata" detail, drop the advice meant for loads
            m = re.search(r"\((.*?)\)", problem)
            problem = f"checksum mismatch ({m.group(1)})" if m else problem
        return Damage(where, problem, t.fqn)
    except OSError as exc:
        return Damage(where, f"unreadable ({exc.strerror or exc})", t.fqn)
    return None


def _groups(tensors: list[TensorEntry], group_bytes: int) -> list[list[TensorEntry]]:
    groups: list[list[TensorEntry]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return [g for g in groups if g]


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    threads: int | None = None,
    progress: ProgressCallback | None = None,
    group_bytes: int = 256 << 20,
) -> VerifyReport:
    """Read every part of the checkpoint at ``path`` and report all damage.

    Checks the root metadata (and its checksum), each array's ``zarr.json``
    against the metadata, every chunk's size and CRC32C (against the chunk
    file and against the metadata), and decodes every plain value. Pickled
    values are decoded only with ``allow_pickle=True``; otherwise they are
    listed as not checked.

    Raises
    ------
    CheckpointNotFoundError
        When ``path`` is not a committed checkpoint at all.

    Examples
    --------
    >>> import numpy as np, gpuckpt, tempfile, os
    >>> from gpuckpt.verify import verify_checkpoint
    >>> p = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = gpuckpt.save({"w": np.arange(10.0), "step": 1}, p)
    >>> report = verify_checkpoint(p)
    >>> report.ok, report.tensors, report.objects
    (True, 1, 1)
    """
    reader = LocalReader(path)
    report = VerifyReport(path=os.fspath(path))
    raw = reader.read_root()  # not a checkpoint at all: raises CheckpointNotFoundError
    try:
        md = metadata_from_root_document(raw, f"{Path(path) / 'zarr.json'}")
        tensors, objects = validate_metadata(md)
    except MetadataError as exc:
        report.damage.append(Damage("zarr.json", str(exc)))
        return report
    report.tensors, report.objects = len(tensors), len(objects)
    report.chunks = sum(len(t.chunks) for t in tensors.values())

    for fqn, enc in objects.items():
        try:
            decode_object(enc, allow_pickle=allow_pickle, fqn=fqn)
        except UnsafeCheckpointError:
            report.skipped.append(
                f"value {fqn!r} is pickled; pass allow_pickle=True (--allow-pickle) to decode it"
            )
        except (MetadataError, ValueError, TypeError) as exc:
            report.damage.append(Damage(f"zarr.json (value {fqn!r})", str(exc), fqn))

    entries = list(tensors.values())
    for t in entries:
        bad = _check_array_doc(reader, t)
        if bad is not None:
            report.damage.append(bad)

    counter = ProgressCounter(progress, sum(t.nbytes for t in entries))
    found: list[Damage | None] = []
    with ThreadPoolExecutor(
        max_workers=threads or default_threads(), thread_name_prefix="gpuckpt-verify"
    ) as pool:
        for group in _groups(entries, group_bytes):
            scratch = {t.fqn: np.empty(t.shape, t.dtype) for t in group}
            jobs = [(t, c) for t in group for c in t.chunks]
            futures = [pool.submit(_check_chunk, reader, t, c, scratch[t.fqn]) for t, c in jobs]
            for (t, c), fut in zip(jobs, futures, strict=True):
                found.append(fut.result())
                nbytes = c.spec.nelem * t.dtype.itemsize
                report.bytes_checked += nbytes
                counter.add(nbytes)
            del scratch
    report.damage.extend(d for d in found if d is not None)
    return report
