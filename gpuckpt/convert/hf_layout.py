"""The Hugging Face sharded layout as pure data: which tensor goes in which file at which
offset, the headers, and the pieces an export reads and writes (no arrays, no I/O).

An export (:mod:`gpuckpt.convert.hf`) reads the checkpoint in groups of about
:data:`GROUP_BYTES` of one shard file: each group is a run of consecutive rows (axis 0)
of one or more tensors, cut only at the edges of stored chunks, so that every chunk is
read once, whole, into its place in the group's buffer, which holds the file's bytes
from an aligned offset on; the group is then written with aligned writes
(``O_DIRECT`` where the file system takes it).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.convert.safetensors_io import safetensors_code
from gpuckpt.errors import InvalidOptionError
from gpuckpt.format.safetensors import METADATA_KEY, SINGLE_NAME, shard_name

__all__ = [
    "BUFFER_ALIGN",
    "Group",
    "DEFAULT_MAX_SHARD_BYTES",
    "GROUP_BYTES",
    "Piece",
    "ShardPlan",
    "ShardTensor",
    "parse_size",
    "plan_groups",
    "plan_shards",
]

#: transformers' default ``max_shard_size`` ("5GB": decimal gigabytes)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
#: the export reads the checkpoint into buffers of about this many bytes (two of them)
GROUP_BYTES = 64 * 2**20
#: where pieces start in a group's (page-aligned) buffer: what ``O_DIRECT`` reads need
BUFFER_ALIGN = 4096
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
        except (KeyError, ValueError, OverflowError):
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
    #: where the stored chunks start along axis 0 (a piece never splits a chunk)
    row_edges: tuple[int, ...] = (0,)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def row_items(self) -> int:
        """Elements in one index of axis 0 (1 for a 0-d tensor)."""
        return math.prod(self.shape[1:]) if self.shape else 1


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
class Piece:
    """Rows ``[start, stop)`` of a tensor, at ``file_offset`` in its shard file and at
    ``buffer_offset`` in its group's buffer (the output's bytes, in the output dtype)."""

    tensor: ShardTensor
    start: int
    stop: int
    file_offset: int
    buffer_offset: int

    @property
    def nbytes(self) -> int:
        """Bytes in the output (the output dtype)."""
        return (self.stop - self.start) * self.tensor.row_items * self.tensor.dtype.itemsize

    @property
    def source_nbytes(self) -> int:
        return (self.stop - self.start) * self.tensor.row_items * self.tensor.source_dtype.itemsize


@dataclass(frozen=True, slots=True)
class Group:
    """A run of one shard file's bytes, ``[start, end)``, read into one buffer and written from
    it: ``start`` is a multiple of :data:`BUFFER_ALIGN`, and the buffer's bytes before the first
    piece are the previous group's unwritten tail (or the header); the group writes
    ``[start, end)`` rounded down to :data:`BUFFER_ALIGN` (its last group: to ``end``) and leaves
    the rest to the next one, so that every write of a shard is aligned (``O_DIRECT``)."""

    shard: int
    start: int
    end: int
    pieces: tuple[Piece, ...]
    last: bool

    @property
    def write_end(self) -> int:
        return self.end if self.last else self.end - self.end % BUFFER_ALIGN


def _row_runs(t: ShardTensor, limit: int) -> list[tuple[int, int]]:
    """Consecutive row ranges of ``t`` of at most ``limit`` source bytes where the chunks allow."""
    if not t.shape:
        return [(0, 1)]
    rows = t.shape[0]
    edges = sorted({e for e in t.row_edges if 0 < e < rows} | {0, rows})
    row_bytes = max(t.row_items * t.source_dtype.itemsize, 1)
    runs: list[tuple[int, int]] = []
    start = 0
    for lo, hi in itertools.pairwise(edges):
        if lo > start and (hi - start) * row_bytes > limit:
            runs.append((start, lo))
            start = lo
    runs.append((start, rows))
    return runs


def plan_groups(plans: Sequence[ShardPlan], limit: int = GROUP_BYTES) -> list[Group]:
    """The groups an export reads and writes, shard by shard in file order: each at most about
    ``limit`` bytes unless one run of rows between chunk edges is larger; a tensor appears at
    most once per group, a group holds one shard's bytes only."""
    groups: list[Group] = []
    for s, plan in enumerate(plans):
        start = 0  # the header is the first group's head
        pieces: list[Piece] = []
        end = len(plan.header)
        for t, at in plan.tensors:
            out_row = t.row_items * t.dtype.itemsize
            for lo, hi in _row_runs(t, limit):
                nbytes = (hi - lo) * out_row
                if pieces and end + nbytes - start > limit:
                    groups.append(Group(s, start, end, tuple(pieces), False))
                    start, pieces = end - end % BUFFER_ALIGN, []
                offset = at + lo * out_row
                pieces.append(Piece(t, lo, hi, offset, offset - start))
                end = offset + nbytes
        groups.append(Group(s, start, plan.size, tuple(pieces), True))
    return groups
