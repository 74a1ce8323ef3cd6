"""Format version 5: a chunk table whose rows are grouped in blocks, one per writing rank.

The chunk table (:mod:`gpuckpt.format.records`) of versions 2 to 4 holds each
tensor's records in rows ``R, R+1, ...``, C order of its grid, so one stored
chunk of a column holds rows of many ranks' chunks and one process must gather
them all. Version 5 adds a way to order the rows so that each rank of a
distributed save stores its own (:mod:`gpuckpt.planning.table` decides it). The
table's ``storage_data["chunk_table"]`` entry then has ::

    "blocks": {"count": N, "rows": B, "used": K}

and its first ``N * B`` rows are ``N`` blocks of ``B`` rows (``B`` a multiple of
``rows_per_chunk``, so each stored chunk of a column lies in one block), of which
the first ``K`` hold records (the others are zeros). A tensor whose entry says
``"rows": R`` with ``R < B`` has ``n = N * k`` chunks, ``k`` in every block: its
chunk ``i`` (C order of its grid) is row ``(i // k) * B + R + i % k``. Its runs
``[R, R + k)`` of the tensors so placed tile ``[0, K)``. Every other tensor has
``R >= N * B``: its chunks are rows ``R, R+1, ...`` of the *tail*, which the
tensors' runs tile from ``N * B`` to the table's end, as in version 2.

Everything else is version 4's: the column arrays, their codecs, the root
document pinning the CRC32C of every stored chunk of every column. zarr-python
and TensorStore read the column arrays as before (their rows are in block order);
releases that read version 4 refuse a version 5 checkpoint as newer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuckpt.errors import MetadataError

__all__ = ["BLOCKS_KEY", "TableBlocks"]

#: the key of the chunk table's entry that describes its blocks
BLOCKS_KEY = "blocks"


@dataclass(frozen=True, slots=True)
class TableBlocks:
    """``count`` blocks of ``rows`` rows each, the first ``used`` of which hold records."""

    count: int
    rows: int
    used: int

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "rows": self.rows, "used": self.used}

    @classmethod
    def parse(cls, raw: Any, table_rows: int, chunk_rows: int) -> TableBlocks:
        """The blocks entry ``raw`` (untrusted JSON) of a table of ``table_rows`` rows stored
        ``chunk_rows`` per chunk, checked."""
        if type(raw) is not dict or set(raw) != {"count", "rows", "used"}:
            raise _bad(f"blocks must be an object of count, rows and used, found {raw!r:.100}")
        count, rows, used = raw["count"], raw["rows"], raw["used"]
        if any(type(v) is not int or v < 1 for v in (count, rows, used)):
            raise _bad(f"blocks {raw!r:.100} must hold positive integers")
        if rows % chunk_rows or used > rows or count * rows > table_rows:
            raise _bad(
                f"{count} blocks of {rows} rows ({used} used) do not fit a table of {table_rows} rows "
                f"stored {chunk_rows} per chunk"
            )
        # as gpuckpt writes them: a block's chunks hold no more rows than it uses, and its rows
        # are its used rows rounded up to whole chunks (rows no record uses would cost a reader
        # their memory: a claim of padding, not of chunks)
        if chunk_rows > used or rows != chunk_rows * -(-used // chunk_rows):
            raise _bad(
                f"blocks of {rows} rows of which {used} are used, stored {chunk_rows} per chunk, hold "
                "rows that no record uses"
            )
        return cls(count, rows, used)

    def holds(self, row: int) -> bool:
        """Whether a tensor entry's ``rows`` value ``row`` places it in the blocks (not the tail)."""
        return row < self.rows

    def span_problem(self, row: int, nchunks: int) -> str | None:
        """What is wrong with a tensor of ``nchunks`` chunks placed at ``row`` in the blocks, or None."""
        if nchunks % self.count:
            return f"its {nchunks} chunks do not split into the table's {self.count} blocks"
        if row < 0 or row + nchunks // self.count > self.used:
            end = row + nchunks // self.count
            return f"its rows {row}..{end} of each block lie outside the {self.used} used"
        return None

    @property
    def tail(self) -> int:
        """The first row of the tail."""
        return self.count * self.rows


def _bad(what: str) -> MetadataError:
    return MetadataError(
        f"metadata.storage_data.chunk_table is inconsistent: {what}; the checkpoint is damaged or "
        "was not written by gpuckpt"
    )
