"""Per-chunk records of a checkpoint: one module encodes and decodes them, in both of their forms.

Every stored chunk has a record: its file key, its stored byte size and its
CRC32C. The key and the size follow from the tensor's chunk grid and dtype
(Zarr's key encoding; the stored, padded, chunk shape), so only the checksum
(and any optional per-chunk field) is information. A checkpoint stores the
records in one of two forms, per tensor:

- **listed** (format version 1, and small checkpoints of version 2): the
  tensor's ``storage_data`` entry has ``"chunks": [{"key", "nbytes",
  "crc32c"}, ...]``, one JSON object per chunk;
- **table** (format version 2, checkpoints of more than
  :data:`TABLE_MIN_CHUNKS` chunks): the entry has ``"rows": R``, and the
  tensor's chunks are rows ``R, R+1, ...`` (C order of their grid
  coordinates) of the checkpoint's *chunk table*. Each column of the table
  is a Zarr v3 array next to the tensors' (:func:`column_array_name`), of
  :data:`ROWS_PER_CHUNK` rows per chunk, stored with the ``bytes`` (little
  endian) and ``crc32c`` codecs; ``storage_data["chunk_table"]`` gives the
  number of rows and, per column, the CRC32C of each of its chunks, so the
  root document pins the table. A load reads only the table chunks that
  hold the rows of the tensors it loads.

Columns (:data:`COLUMNS`): ``crc32c`` (``uint32``), and in checkpoints that
record content hashes (:mod:`gpuckpt.saving.incremental`) ``xxh3t`` and ``head``
(16 bytes each: the chunk's XXH3-128 tree hash and the hash of its first
leaf, see :mod:`gpuckpt.format.contenthash`). A column of a fixed-width
per-chunk field is a ``uint8`` array of ``rows x width``; listed, such a field
is a string of ``2 * width`` lowercase hex digits. Optional columns are
written for every chunk or for none; reading, a fixed-width column is taken
only when every record holds a valid value. A listed record without a
``head`` field (as a chunk of one leaf is written by releases that list the
hashes of incremental saves) takes its ``xxh3t`` as its head.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from gpuckpt.errors import CheckpointCorruptedError, MetadataError, MissingChunkError
from gpuckpt.format.blocks import BLOCKS_KEY, TableBlocks
from gpuckpt.format.checksum import CRC_BYTES, crc32c
from gpuckpt.format.documents import is_chunk_file_key

__all__ = [
    "COLUMNS",
    "ROWS_PER_CHUNK",
    "TABLE_KEY",
    "TABLE_MIN_CHUNKS",
    "Column",
    "ChunkTable",
    "ChunkFiles",
    "column_array_name",
    "is_column_array_name",
    "encode_rows",
    "encode_table",
    "listed_records",
    "parse_listed",
    "table_documents",
]


class ChunkFiles(Protocol):
    """What the table reads its chunks through: a store's reader
    (:class:`gpuckpt.storage.base.CheckpointReader`)."""

    def chunk_nbytes(self, name: str, key: str) -> int | None: ...

    def read_chunk_crc(self, name: str, key: str, dests: Sequence[Any]) -> tuple[int, int]: ...


#: checkpoints with more chunks than this keep their per-chunk records in the chunk table
TABLE_MIN_CHUNKS = 4096
#: rows of the chunk table per stored chunk of a column (256 KiB of CRC32Cs)
ROWS_PER_CHUNK = 1 << 16
#: the key of ``storage_data`` that describes the chunk table
TABLE_KEY = "chunk_table"
#: most rows a chunk table may have (4 Gi chunks)
MAX_TABLE_ROWS = 1 << 32
#: most rows one stored chunk of the table may hold when read (16 MiB of a 16-byte column)
MAX_ROWS_PER_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class Column:
    """One per-chunk field: its name, its element type and its width (elements per row)."""

    name: str
    dtype: np.dtype[Any]
    width: int = 1
    #: listed form: a record without this field takes the value of this other field
    absent: str | None = None

    @property
    def row_bytes(self) -> int:
        return self.dtype.itemsize * self.width


#: the per-chunk fields, by name: the CRC32C (every checkpoint), the stored size (checkpoints
#: with compressed tensors: format version 4), the content hash and the hash of the first leaf
#: (checkpoints that record content hashes)
COLUMNS: dict[str, Column] = {
    "crc32c": Column("crc32c", np.dtype("<u4")),
    "nbytes": Column("nbytes", np.dtype("<u8")),
    "xxh3t": Column("xxh3t", np.dtype("u1"), 16),
    "head": Column("head", np.dtype("u1"), 16, absent="xxh3t"),
}


_HEX = re.compile(r"[0-9a-f]+")


def column_array_name(column: str) -> str:
    """The array that holds a column; no tensor has it (tensor names begin with a letter, digit or %)."""
    return f"_gpuckpt.table.{column}"


def is_column_array_name(name: object) -> bool:
    """Whether ``name`` is the array of one of the chunk table's columns (:func:`column_array_name`)."""
    return name in _COLUMN_ARRAYS


_COLUMN_ARRAYS = frozenset(column_array_name(c) for c in COLUMNS)


def _chunk_key(k: int, column: Column) -> str:
    return f"c.{k}" if column.width == 1 else f"c.{k}.0"


def listed_records(
    keys: Sequence[str], nbytes: Sequence[int], columns: Mapping[str, np.ndarray]
) -> list[dict[str, Any]]:
    """The listed form: one JSON object per chunk (``key``, ``nbytes`` and each column's value)."""
    out: list[dict[str, Any]] = [{"key": k, "nbytes": n} for k, n in zip(keys, nbytes, strict=True)]
    for name, values in columns.items():
        if name == "nbytes":
            continue  # the stored sizes are ``nbytes`` (a compressed tensor's, as written)
        col = COLUMNS[name]
        if col.width == 1:
            for rec, v in zip(out, values.tolist(), strict=True):
                rec[name] = v
        else:
            for rec, v in zip(out, values, strict=True):
                rec[name] = bytes(v).hex()
    return out


def parse_listed(
    raw: list[Any],
    keys: Sequence[str],
    nbytes: Sequence[int],
    bad: Callable[[str], Exception],
    compressed: bool = False,
) -> dict[str, np.ndarray]:
    """The columns of listed records ``raw`` (untrusted JSON), each checked against the key and
    byte size the grid gives its chunk (``keys``, ``nbytes``); ``bad(what)`` makes the error.
    ``compressed``: the chunks of a compressed tensor, whose byte size may be anything from 5
    to ``nbytes`` (then the most the codec may store), returned as the column ``nbytes``.

    ``crc32c`` must be a 32-bit integer in every record. A fixed-width column is taken only
    when every record holds a valid value (``2 * width`` lowercase hex digits; a record
    without the field takes the value of its column's ``absent`` field, if any); a record
    without one leaves that column out, never an error.
    """
    crcs = np.zeros(len(raw), np.uint32)
    sizes = np.zeros(len(raw), np.uint64) if compressed else None
    wide = {name: col for name, col in COLUMNS.items() if col.width > 1}
    found: dict[str, list[bytes] | None] = {name: [] for name in wide}
    for i, rec in enumerate(raw):
        if not isinstance(rec, dict):
            raise bad(f"chunk {i} storage entry is not an object")
        key, size, crc = rec.get("key"), rec.get("nbytes"), rec.get("crc32c")
        if not is_chunk_file_key(key) or key != keys[i]:
            raise bad(f"chunk {i} key {key!r} is not {keys[i]!r}")
        if sizes is not None:
            if type(size) is not int or not CRC_BYTES < size <= nbytes[i]:
                raise bad(
                    f"chunk {key} claims {size!r} bytes, its codec stores {CRC_BYTES + 1} to {nbytes[i]}"
                )
            sizes[i] = size
        elif type(size) is not int or size != nbytes[i]:
            raise bad(f"chunk {key} claims {size!r} bytes, its shape needs {nbytes[i]}")
        if not isinstance(crc, int) or isinstance(crc, bool) or not 0 <= crc < 2**32:
            raise bad(f"chunk {key} checksum {crc!r} is not a 32-bit value")
        crcs[i] = crc
        for name, col in wide.items():
            values = found[name]
            if values is None:
                continue
            text = rec[name] if name in rec else rec.get(col.absent) if col.absent else None
            if isinstance(text, str) and len(text) == 2 * col.width and _HEX.fullmatch(text):
                values.append(bytes.fromhex(text))
            else:
                found[name] = None
    columns: dict[str, np.ndarray] = {"crc32c": crcs}
    if sizes is not None:
        columns["nbytes"] = sizes
    for name, values in found.items():
        if values is not None and raw:
            columns[name] = np.frombuffer(b"".join(values), np.uint8).reshape(len(raw), wide[name].width)
    return columns


@dataclass(frozen=True, slots=True)
class TablePart:
    """One stored chunk of a column: array ``name``, chunk ``key``, its bytes (padded) and their CRC32C."""

    name: str
    key: str
    data: memoryview
    crc: int


def _array_document(column: Column, rows: int, chunk_rows: int) -> bytes:
    shape = [rows] if column.width == 1 else [rows, column.width]
    chunks = [chunk_rows] if column.width == 1 else [chunk_rows, column.width]
    codecs: list[dict[str, Any]] = [{"name": "bytes"}, {"name": "crc32c"}]
    if column.dtype.itemsize > 1:
        codecs[0]["configuration"] = {"endian": "little"}
    doc = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": shape,
        "data_type": column.dtype.newbyteorder("=").name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": 0,
        "codecs": codecs,
        "attributes": {"gpuckpt": {"chunk_table": column.name}},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def _encode_chunks(
    values: np.ndarray, column: Column, arr_name: str, first: int, chunk_rows: int
) -> list[TablePart]:
    """The stored chunks ``first, first + 1, ...`` of a column that hold the rows ``values``
    (the last chunk padded with zeros)."""
    rows = len(values)
    nchunks = -(-rows // chunk_rows)
    padded = np.zeros(nchunks * chunk_rows * column.width, column.dtype)
    padded[: rows * column.width] = np.ascontiguousarray(values, column.dtype).reshape(-1)
    raw = memoryview(padded.view(np.uint8)).cast("B")
    step = chunk_rows * column.row_bytes
    parts = []
    for k in range(nchunks):
        data = raw[k * step : (k + 1) * step]
        parts.append(TablePart(arr_name, _chunk_key(first + k, column), data, crc32c(data)))
    return parts


def table_documents(names: Sequence[str], rows: int, chunk_rows: int) -> list[tuple[str, bytes]]:
    """``(array name, zarr.json)`` of the columns ``names`` of a table of ``rows`` rows."""
    return [(column_array_name(n), _array_document(COLUMNS[n], rows, chunk_rows)) for n in names]


def encode_table(
    columns: Mapping[str, np.ndarray],
) -> tuple[dict[str, Any], list[tuple[str, bytes]], list[TablePart]]:
    """The chunk table of ``columns`` (each ``rows`` long): its ``storage_data`` entry, the array
    documents ``(name, zarr.json)`` and the chunks to store. Entries of ``columns`` that are not
    table columns (:data:`COLUMNS`; segment records go to the tensors' entries) are left out."""
    columns = {name: values for name, values in columns.items() if name in COLUMNS}
    rows = len(next(iter(columns.values())))
    if rows == 0 or rows > MAX_TABLE_ROWS:
        raise ValueError(f"a chunk table has 1 to {MAX_TABLE_ROWS} rows, not {rows}")
    chunk_rows = min(ROWS_PER_CHUNK, rows)
    entry: dict[str, Any] = {"rows": rows, "rows_per_chunk": chunk_rows, "columns": {}}
    parts = []
    for name, values in columns.items():
        if len(values) != rows:
            raise ValueError(f"column {name!r} has {len(values)} rows, the table {rows}")
        mine = _encode_chunks(values, COLUMNS[name], column_array_name(name), 0, chunk_rows)
        parts.extend(mine)
        entry["columns"][name] = {"name": column_array_name(name), "chunk_crc32c": [p.crc for p in mine]}
    return entry, table_documents(list(columns), rows, chunk_rows), parts


def encode_rows(
    columns: Mapping[str, np.ndarray], first_row: int, chunk_rows: int
) -> dict[str, list[TablePart]]:
    """The stored chunks of the rows ``[first_row, first_row + len)`` of each column of
    ``columns`` (``first_row`` a multiple of ``chunk_rows``): one block of a block-ordered
    table (:mod:`gpuckpt.format.blocks`), or its tail."""
    if first_row % chunk_rows:
        raise ValueError(f"row {first_row} does not begin a chunk of {chunk_rows} rows")
    return {
        name: _encode_chunks(
            values, COLUMNS[name], column_array_name(name), first_row // chunk_rows, chunk_rows
        )
        for name, values in columns.items()
        if name in COLUMNS
    }


def _bad_table(what: str) -> MetadataError:
    return MetadataError(
        f"metadata.storage_data.{TABLE_KEY} is inconsistent: {what}; the checkpoint is damaged or "
        "was not written by gpuckpt"
    )


@dataclass
class ChunkTable:
    """The chunk table a root document describes (validated), read chunk by chunk when rows are asked for."""

    rows: int
    chunk_rows: int
    columns: dict[str, tuple[Column, str, list[int]]]  # name -> column, array name, chunk CRC32Cs
    #: the blocks of a table ordered by writing rank (format version 5), else None
    blocks: TableBlocks | None = None
    _chunks: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    _matrices: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def parse(cls, entry: Any, *, blocks: bool = False) -> ChunkTable:
        """The table of ``entry`` (``storage_data["chunk_table"]``, untrusted JSON), checked;
        ``blocks``: the document's version may order the table in blocks (version 5)."""
        if not isinstance(entry, dict):
            raise _bad_table(f"expected an object, found {type(entry).__name__}")
        rows, chunk_rows, cols = entry.get("rows"), entry.get("rows_per_chunk"), entry.get("columns")
        if type(rows) is not int or not 0 < rows <= MAX_TABLE_ROWS:
            raise _bad_table(f"rows is {rows!r}, expected an integer in [1, {MAX_TABLE_ROWS}]")
        # any chunking a writer chose is read, within a bound on what one chunk may allocate
        if type(chunk_rows) is not int or not 1 <= chunk_rows <= min(rows, MAX_ROWS_PER_CHUNK):
            most = min(rows, MAX_ROWS_PER_CHUNK)
            raise _bad_table(f"rows_per_chunk is {chunk_rows!r}, expected an integer in [1, {most}]")
        if not isinstance(cols, dict) or "crc32c" not in cols:
            raise _bad_table("columns must be an object with a 'crc32c' column")
        nchunks = -(-rows // chunk_rows)
        columns = {}
        for name, c in cols.items():
            col = COLUMNS.get(name)
            if col is None:
                continue  # a field this release does not know: not needed to load
            if not isinstance(c, dict) or c.get("name") != column_array_name(name):
                raise _bad_table(f"column {name!r} must name the array {column_array_name(name)!r}")
            crcs = c.get("chunk_crc32c")
            if (
                not isinstance(crcs, list)
                or len(crcs) != nchunks
                or not all(type(v) is int and 0 <= v < 2**32 for v in crcs)
            ):
                raise _bad_table(f"column {name!r} must list {nchunks} 32-bit chunk checksums")
            columns[name] = (col, column_array_name(name), crcs)
        placed = None
        if BLOCKS_KEY in entry:
            if not blocks:
                raise _bad_table("it has blocks, which its format version does not have")
            placed = TableBlocks.parse(entry[BLOCKS_KEY], rows, chunk_rows)
        return cls(rows, chunk_rows, columns, placed)

    def span_problem(self, row: int, nchunks: int) -> str | None:
        """What is wrong with a tensor of ``nchunks`` chunks whose entry says ``"rows": row``, or None."""
        if self.blocks is not None and self.blocks.holds(row):
            return self.blocks.span_problem(row, nchunks)
        first = 0 if self.blocks is None else self.blocks.tail
        if not first <= row <= self.rows - nchunks:
            return f"its {nchunks} chunk table rows begin at {row}, outside rows {first}..{self.rows}"
        return None

    def tensor_rows(self, reader: ChunkFiles, name: str, row: int, nchunks: int) -> Any:
        """Column ``name`` of the ``nchunks`` chunks (C order) of a tensor whose entry says
        ``"rows": row``: an array, or for a tensor in the blocks of a version 5 table a
        :class:`BlockRows` that reads the table chunk of a row when the row is first asked for."""
        if self.blocks is not None and self.blocks.holds(row):
            return BlockRows(self, reader, name, row, nchunks // self.blocks.count)
        return self.rows_of(reader, name, row, nchunks)

    def _chunk(self, reader: ChunkFiles, name: str, k: int) -> np.ndarray:
        hit = self._chunks.get((name, k))
        if hit is not None:
            return hit
        col, arr, crcs = self.columns[name]
        key = _chunk_key(k, col)
        nbytes = self.chunk_rows * col.row_bytes + CRC_BYTES
        where = f"chunk table {arr}/{key}"
        size = reader.chunk_nbytes(arr, key)
        if size is None:
            raise MissingChunkError(
                f"{where} is missing; the checkpoint is damaged: restore it from a copy or use an "
                "earlier checkpoint"
            )
        if size != nbytes:
            raise CheckpointCorruptedError(
                f"{where} is {size} bytes, expected {nbytes}; the checkpoint is damaged"
            )
        buf = np.empty(self.chunk_rows * col.width, col.dtype)
        trailer = bytearray(CRC_BYTES)
        try:
            got, value = reader.read_chunk_crc(arr, key, [buf.view(np.uint8), trailer])
        except FileNotFoundError:
            raise MissingChunkError(f"{where} disappeared while loading; load again") from None
        stored = int.from_bytes(trailer, "little")
        if got != nbytes or value != stored or value != crcs[k]:
            raise CheckpointCorruptedError(
                f"{where} failed its check (read {got} of {nbytes} bytes, CRC32C {value:#010x}, chunk "
                f"file {stored:#010x}, root document {crcs[k]:#010x}); the checkpoint is damaged"
            )
        if col.width > 1:
            buf = buf.reshape(self.chunk_rows, col.width)
        self._chunks[(name, k)] = buf
        return buf

    def block_matrix(self, reader: ChunkFiles, name: str) -> np.ndarray:
        """Column ``name``'s blocks as one ``(blocks, block rows[, width])`` array (every table
        chunk of the blocks read once, and kept)."""
        hit = self._matrices.get(name)
        if hit is not None:
            return hit
        blocks = self.blocks
        assert blocks is not None
        col = self.columns[name][0]
        per = self.chunk_rows
        flat = np.empty((blocks.tail, col.width) if col.width > 1 else blocks.tail, col.dtype)
        for k in range(blocks.tail // per):
            flat[k * per : (k + 1) * per] = self._chunk(reader, name, k)
            self._chunks[(name, k)] = flat[k * per : (k + 1) * per]
        matrix = self._matrices[name] = flat.reshape((blocks.count, blocks.rows, *flat.shape[1:]))
        return matrix

    def row_value(self, reader: ChunkFiles, name: str, row: int) -> Any:
        """Row ``row`` of column ``name`` (reading the table chunk that holds it, once)."""
        k = row // self.chunk_rows
        hit = self._chunks.get((name, k))
        if hit is None:
            hit = self._chunk(reader, name, k)
        return hit[row - k * self.chunk_rows]

    def check_files(self, reader: ChunkFiles) -> None:
        """Check that every chunk of every column exists with the size the table's row count
        needs (no byte is read): a root document cannot claim more rows than the files hold."""
        for col, arr, crcs in self.columns.values():
            nbytes = self.chunk_rows * col.row_bytes + CRC_BYTES
            for k in range(len(crcs)):
                key = _chunk_key(k, col)
                size = reader.chunk_nbytes(arr, key)
                if size is None:
                    raise MissingChunkError(
                        f"chunk table {arr}/{key} is missing; the checkpoint is damaged: restore it from "
                        "a copy or use an earlier checkpoint"
                    )
                if size != nbytes:
                    raise CheckpointCorruptedError(
                        f"chunk table {arr}/{key} is {size} bytes, expected {nbytes}; "
                        "the checkpoint is damaged"
                    )

    def rows_of(self, reader: ChunkFiles, name: str, start: int, count: int) -> np.ndarray:
        """:meth:`read`, with fewer steps for rows that lie in one chunk of the table already
        read (the rows of one small tensor, asked for once per tensor by a load)."""
        k = start // self.chunk_rows
        hit = self._chunks.get((name, k))
        at = start - k * self.chunk_rows
        if hit is None or count < 1 or start < 0 or at + count > self.chunk_rows or start + count > self.rows:
            return self.read(reader, name, start, count)
        return hit[at : at + count]

    def read(self, reader: ChunkFiles, name: str, start: int, count: int) -> np.ndarray:
        """Rows ``[start, start + count)`` of column ``name``, reading only the chunks that hold them."""
        if not 0 <= start <= start + count <= self.rows:
            raise _bad_table(f"rows {start}..{start + count} lie outside the table of {self.rows} rows")
        if count == 0:
            col = self.columns[name][0]
            return np.empty((0,) if col.width == 1 else (0, col.width), col.dtype)
        first, last = start // self.chunk_rows, (start + count - 1) // self.chunk_rows
        pieces = [self._chunk(reader, name, k) for k in range(first, last + 1)]
        joined = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        at = start - first * self.chunk_rows
        return joined[at : at + count]


class BlockRows:
    """The rows of one column of one tensor in the blocks of a version 5 table
    (:mod:`gpuckpt.format.blocks`), indexed by chunk (C order): a row is read with the
    table chunk that holds it when first asked for, so that a rank that loads its shard
    reads the block its rank wrote, not the table. ``np.asarray`` gives them all."""

    __slots__ = ("_reader", "_table", "column", "per_block", "row")

    def __init__(self, table: ChunkTable, reader: ChunkFiles, column: str, row: int, per_block: int) -> None:
        self._table, self._reader, self.column, self.row, self.per_block = (
            table,
            reader,
            column,
            row,
            per_block,
        )

    def __len__(self) -> int:
        blocks = self._table.blocks
        assert blocks is not None
        return self.per_block * blocks.count

    def table_row(self, index: int) -> int:
        """The table row of chunk ``index``."""
        blocks = self._table.blocks
        assert blocks is not None
        if not 0 <= index < len(self):
            raise IndexError(f"chunk {index} of {len(self)}")
        b, i = divmod(index, self.per_block)
        return b * blocks.rows + self.row + i

    def __getitem__(self, index: int) -> Any:
        return self._table.row_value(self._reader, self.column, self.table_row(int(index)))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        matrix = self._table.block_matrix(self._reader, self.column)
        part = matrix[:, self.row : self.row + self.per_block]
        out = part.reshape((len(self), *matrix.shape[2:]))
        return out if dtype is None else out.astype(dtype, copy=False)

    def tolist(self) -> list[Any]:
        values: list[Any] = np.asarray(self).tolist()
        return values
