"""Check a whole checkpoint: metadata, array documents, every chunk's checksum, every value.

Unlike a load, which stops at the first problem, :func:`verify_checkpoint`
reads everything and lists every damaged part, so that one report tells
what is left to salvage. Each chunk file's size is checked against the
metadata before it is read, and a chunk is then streamed through one small
buffer per thread (its checksum needs its bytes, not a copy of them), so for
chunks stored as they are memory stays bounded by ``group_bytes`` whatever the
metadata claims.

A compressed chunk cannot be streamed (its codecs decompress whole): it is read
and decompressed into memory of its stored and its logical size, and the chunks
being decompressed at once hold at most ``group_bytes`` more (a larger chunk is
decompressed alone). Its logical size is its chunk shape's, which the frame must
announce before anything is decompressed; a few KiB of zstd frame can honestly
announce a chunk thousands of times larger (a chunk of zeros), so for a
compressed tensor the bound is the metadata's chunk shape, not the file's size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuckpt.errors import (
    CheckpointCorruptedError,
    ChecksumError,
    InvalidOptionError,
    MetadataError,
    UnsafeCheckpointError,
)
from gpuckpt.format import jsontext
from gpuckpt.format.documents import ATTRIBUTE, expected_array_document
from gpuckpt.format.values import decode_object
from gpuckpt.loading.checks import (
    ChunkRead,
    TensorEntry,
    load_chunk_records,
    overclaimed,
)
from gpuckpt.loading.chunk_reads import checksum_verified, decode_verified, stored_chunk
from gpuckpt.loading.open import open_checkpoint
from gpuckpt.loading.ranged import segments_of
from gpuckpt.options import LoadOptions
from gpuckpt.printable import printable
from gpuckpt.progress import ProgressCallback, ProgressCounter
from gpuckpt.runtime.runner import default_threads, run_ordered
from gpuckpt.state import unflatten_state_dict
from gpuckpt.storage.base import CheckpointReader, NotRegularFileError

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
        """A human-readable summary, one damaged part per line.

        Text from the checkpoint (names, problems) has its non-printable
        characters escaped: a hostile name cannot forge lines or drive the terminal.
        """
        lines = []
        path = printable(self.path)
        if self.ok:
            lines.append(
                f"OK: {path}: {self.tensors} tensors ({self.chunks} chunks, "
                f"{_size(self.bytes_checked)}) and {self.objects} values verified"
            )
        else:
            lines.append(
                f"DAMAGED: {path}: {len(self.damage)} problem(s) in "
                f"{len(self.damaged_tensors())} tensor(s) of {self.tensors}"
            )
            lines.extend(f"  {printable(d.where)}: {printable(d.problem)}" for d in self.damage)
        lines.extend(f"  not checked: {printable(s)}" for s in self.skipped)
        return "\n".join(lines)


def _check_array_doc(reader: CheckpointReader, t: TensorEntry) -> Damage | None:
    where = f"{t.name}/zarr.json"
    try:
        doc = jsontext.loads(reader.read_array_document(t.name))
    except NotRegularFileError as exc:
        return Damage(where, f"unreadable: it {exc.strerror}", t.fqn)
    except FileNotFoundError:
        return Damage(where, "missing", t.fqn)
    except (OSError, ValueError, RecursionError) as exc:
        return Damage(where, f"unreadable ({exc})", t.fqn)
    if not isinstance(doc, dict):
        return Damage(where, "is not a JSON object", t.fqn)
    fmt = t.memory_format.name
    expected = expected_array_document(
        shape=t.shape, dtype=t.dtype, grid=t.grid, fqn=t.fqn, memory_format=fmt, codec=t.codec
    )
    # other attributes (added by another tool) are allowed; gpuckpt's own must be as written
    want_attrs = expected.pop("attributes")[ATTRIBUTE]
    for key, want in expected.items():
        if not _same_json(doc.get(key), want):
            return Damage(where, f"{key} is {doc.get(key)!r:.200}, the metadata says {want!r:.200}", t.fqn)
    attrs = doc.get("attributes")
    mine = attrs.get(ATTRIBUTE) if isinstance(attrs, dict) else None
    if not isinstance(mine, dict) or any(not _same_json(mine.get(k), v) for k, v in want_attrs.items()):
        return Damage(
            where,
            f"attributes.{ATTRIBUTE} is {mine!r:.200}, expected fqn {t.fqn!r} and memory format {fmt}",
            t.fqn,
        )
    return None


def _same_json(got: Any, want: Any) -> bool:
    """Whether ``got`` is the JSON value ``want``, types included: Python's ``==`` holds for
    ``true`` and ``1``, or ``9.0`` and ``9``, which other Zarr readers tell apart (TensorStore
    refuses a chunk shape of ``[true, 10]``)."""
    try:
        return json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        return False


class _ByteGate:
    """Lets holders of at most ``budget`` bytes in all through at once; a holder of more than the
    budget goes through alone."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.held = 0
        self.most = 0  # the most held at once (for tests)
        self._cv = threading.Condition()

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        with self._cv:
            self._cv.wait_for(lambda: self.held == 0 or self.held + nbytes <= self.budget)
            self.held += nbytes
            self.most = max(self.most, self.held)
        try:
            yield
        finally:
            with self._cv:
                self.held -= nbytes
                self._cv.notify_all()


def _check_chunk(
    reader: CheckpointReader, t: TensorEntry, c: ChunkRead, piece: int, gate: _ByteGate
) -> Damage | None:
    where = f"{t.name}/{c.key}"
    # the size first: a claim the file cannot back is damage, never an allocation
    size = reader.chunk_nbytes(t.name, c.key)
    if size is None:
        absence = reader.chunk_absence(t.name, c.key)
        return Damage(where, "missing" if absence == "missing" else f"unreadable: it {absence}", t.fqn)
    if size != c.nbytes:
        return Damage(where, f"is {size} bytes, expected {c.nbytes} (truncated or overwritten)", t.fqn)
    try:
        if t.dtype == np.bool_:  # and that it holds 0 and 1 only (a bool tensor is small)
            with gate.hold(c.nbytes + math.prod(c.stored)):
                odd = int(np.count_nonzero(stored_chunk(reader, t, c).view(np.uint8) > 1))
            if odd:
                return Damage(
                    where,
                    f"{odd} bool element(s) hold a byte other than 0 and 1 (gpuckpt writes 0 and 1; "
                    "TensorStore refuses the chunk, and a gpuckpt load reads such a byte as True)",
                    t.fqn,
                )
        elif t.codec is None:
            checksum_verified(reader, t, c, piece)
        else:  # and that it decompresses to the chunk's bytes
            with gate.hold(c.nbytes + math.prod(c.stored) * t.dtype.itemsize):
                decode_verified(reader, t, c)
    except ChecksumError as exc:
        # the "computed / chunk file / metadata" detail, without the advice meant for loads
        return Damage(where, f"checksum mismatch ({exc.mismatch})" if exc.mismatch else str(exc), t.fqn)
    except CheckpointCorruptedError as exc:
        return Damage(where, str(exc), t.fqn)
    except OSError as exc:
        return Damage(where, f"unreadable ({exc.strerror or exc})", t.fqn)
    return None


def _check_segments(t: TensorEntry) -> Damage | None:
    """Whether ``t``'s segment records (``storage_data``, for ranged reads) are usable and add
    up to every chunk's CRC32C, as gpuckpt writes them; loads are unaffected by bad ones (they
    read whole chunks then), which is why only a verify finds them."""
    if t.segments is None:
        return None
    seg = segments_of(t)
    where = f"zarr.json (segment records of {t.name})"
    if seg is None:
        return Damage(where, "malformed: ranged reads of this tensor fall back to whole chunks", t.fqn)
    crcs = [] if t.crcs is None else t.crcs.tolist()
    bad = [i for i, crc in enumerate(crcs) if seg.of_chunk(i, crc) is None]
    if bad:
        return Damage(
            where,
            f"{len(bad)} chunk(s) (first: chunk {bad[0]} in C order) have segment CRC32Cs that do not "
            "combine to the chunk's CRC32C: ranged reads of them fall back to whole chunks",
            t.fqn,
        )
    return None


_MIN_PIECE = 64 << 10
_MAX_PIECE = 4 << 20


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    threads: int | None = None,
    progress: ProgressCallback | None = None,
    group_bytes: int = 256 << 20,
    storage_options: dict[str, Any] | None = None,
) -> VerifyReport:
    """Read every part of the checkpoint at ``path`` and report all damage.

    ``path`` is anything :func:`gpuckpt.load` reads: a directory, or an
    ``s3://bucket/prefix`` URL (with ``storage_options`` as for a load).

    Checks the root metadata (and its checksum), each array's ``zarr.json``
    against the metadata, every chunk's size and CRC32C (against the chunk
    file and against the metadata), and decodes every plain value. Pickled
    values are decoded only with ``allow_pickle=True``; otherwise they are
    listed as not checked. A chunk file whose size differs from the metadata's
    is listed as damaged unread; the others are streamed through one buffer per
    thread, all of them together within ``group_bytes`` (at least 64 KiB each).
    Compressed chunks are decompressed whole, as many at once as fit in
    ``group_bytes`` more (one at a time where a chunk is larger).

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
    # the options as a load takes them (InvalidOptionError naming a bad one; a truthy string is
    # not allow_pickle=True), and group_bytes as a count of bytes
    checked_options = LoadOptions(
        allow_pickle=allow_pickle, threads=threads, progress=progress, storage_options=storage_options
    )
    if not isinstance(group_bytes, int) or isinstance(group_bytes, bool) or group_bytes < 1:
        raise InvalidOptionError(
            f"group_bytes must be a positive integer (bytes read at once), got {group_bytes!r}"
        )
    storage_options = checked_options.store_options()
    try:
        # not a checkpoint at all (or a path of the wrong type): CheckpointNotFoundError, raised
        ck = open_checkpoint(path, storage_options, shared=False)
    except (MetadataError, CheckpointCorruptedError) as exc:
        report = VerifyReport(path=os.fspath(path))
        # the root document, or its chunk table's files (as the index found them)
        where = "chunk table" if isinstance(exc, CheckpointCorruptedError) else "zarr.json"
        report.damage.append(Damage(where, str(exc)))
        return report
    reader, tensors, objects = ck.reader, ck.index.tensors, ck.index.objects
    report = VerifyReport(path=ck.location)
    report.tensors, report.objects = len(tensors), len(objects)
    report.chunks = sum(t.nchunks for t in tensors.values())
    try:
        # a tensor claiming more chunks than its array holds files: one line, and its chunks
        # are not checked one by one (their number is the claim's, not what was written)
        short = overclaimed(reader, tensors.values())
        for bad in short:
            t = bad.tensor
            report.damage.append(Damage(f"{t.name}/", f"{bad.problem}; its chunks were not read", t.fqn))
        skipped = {bad.tensor.fqn for bad in short}
        checked = [t for t in tensors.values() if t.fqn not in skipped]
        load_chunk_records(reader, checked)
    except (MetadataError, CheckpointCorruptedError) as exc:
        report.damage.append(Damage("chunk table", str(exc)))
        return report

    for fqn, enc in objects.items():
        try:
            decode_object(enc, allow_pickle=allow_pickle, fqn=fqn)
        except UnsafeCheckpointError:
            report.skipped.append(
                f"value {fqn!r} is pickled; pass allow_pickle=True (--allow-pickle) to decode it"
            )
        except (MetadataError, ValueError, TypeError) as exc:
            report.damage.append(Damage(f"zarr.json (value {fqn!r})", str(exc), fqn))

    try:  # the structure a load rebuilds the state from (its leaves not read here)
        unflatten_state_dict(ck.index.planner_data["structure"], {}, entries=ck.index.order)
    except MetadataError as exc:
        report.damage.append(Damage("zarr.json (structure)", str(exc)))

    for t in tensors.values():
        for problem in (_check_array_doc(reader, t), _check_segments(t)):
            if problem is not None:
                report.damage.append(problem)
    entries = checked

    counter = ProgressCounter(progress, sum(t.nbytes for t in entries))
    workers = threads or default_threads()
    piece = max(_MIN_PIECE, min(_MAX_PIECE, group_bytes // workers))
    gate = _ByteGate(group_bytes)  # compressed chunks in memory at once
    jobs = (functools.partial(_check_chunk, reader, t, c, piece, gate) for t in entries for c in t.chunks)
    chunks = ((t, c) for t in entries for c in t.chunks)
    # a window of jobs in flight, not one future per chunk of a million-chunk checkpoint
    with contextlib.closing(
        run_ordered(jobs, window=4 * workers, threads=workers, name="gpuckpt-verify")
    ) as found:
        for (t, c), damage in zip(chunks, found, strict=True):
            nbytes = c.spec.nelem * t.dtype.itemsize
            if damage is not None:
                report.damage.append(damage)
            else:  # (what was read and found whole: a missing chunk is not checked bytes)
                report.bytes_checked += nbytes
            counter.add(nbytes)
    return report


def _size(nbytes: int) -> str:
    """``nbytes`` for a reader: bytes, kB, MB or GB (decimal units)."""
    if nbytes < 1000:
        return f"{nbytes} B"
    for unit, scale in (("kB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        if nbytes < scale * 1000 or unit == "GB":
            return f"{nbytes / scale:.1f} {unit}"
    raise AssertionError("unreachable")
