"""Reading a checkpoint published under an ``s3://`` prefix (see :mod:`gpuckpt.storage.s3.writer`)."""

from __future__ import annotations

import errno
import threading
from collections.abc import Sequence
from typing import Any

from gpuckpt.errors import CheckpointNotFoundError
from gpuckpt.format.checksum import CRC_BYTES, crc32c
from gpuckpt.format.documents import (
    MAX_ARRAY_DOCUMENT_BYTES,
    MAX_ROOT_DOCUMENT_BYTES,
    ROOT_KEY,
    is_chunk_file_key,
)
from gpuckpt.storage.base import Capabilities, CheckpointReader
from gpuckpt.storage.s3.prefix import CLAIM_KEY, MAX_CLAIM_BYTES, Prefix, object_key
from gpuckpt.storage.s3.ranges import stream_into

__all__ = ["ObjectStoreReader"]


class ObjectStoreReader(Prefix, CheckpointReader):
    """Reads a checkpoint published under an ``s3://`` prefix.

    Object sizes come from one listing of the prefix (not a HEAD per chunk);
    chunks are streamed with a ranged GET into the caller's buffers. Keys are
    checked to stay inside the prefix.
    """

    # each chunk is a request: small ones are fetched in parallel
    capabilities = Capabilities(batches_chunks=False, reads_ranges=True)

    def read_range_crcs(
        self, name: str, key: str, offset: int, dests: Sequence[Any]
    ) -> tuple[int, list[int]]:
        rel = object_key(name, key)
        with self._io(f"reading {rel} from byte {offset}"), self.budget.take():
            return stream_into(self._obs, rel, offset, dests, "each")

    def __init__(self, url: str, **storage_options: Any) -> None:
        super().__init__(url, storage_options)
        self._sizes: dict[str, int] | None = None
        self._lock = threading.Lock()

    def read_root(self) -> bytes:
        with self._io("reading the root metadata"):
            raw = self._get_small(ROOT_KEY, MAX_ROOT_DOCUMENT_BYTES, "MAX_ROOT_DOCUMENT_BYTES")
            if raw is not None:
                return raw
            claimed = self._get_small(CLAIM_KEY, MAX_CLAIM_BYTES, "the claim object's limit") is not None
        hint = " (a save to it is running or died: its claim object is there)" if claimed else ""
        raise CheckpointNotFoundError(f"no checkpoint at {self.path}: it has no {ROOT_KEY}{hint}")

    def read_array_document(self, name: str) -> bytes:
        rel = object_key(name, ROOT_KEY)
        with self._io(f"reading {rel}"):
            raw = self._get_small(rel, MAX_ARRAY_DOCUMENT_BYTES, "MAX_ARRAY_DOCUMENT_BYTES")
        if raw is None:
            raise FileNotFoundError(errno.ENOENT, "array document missing", f"{self.path}/{rel}")
        return raw

    def _listed(self) -> dict[str, int]:
        """Every object of the checkpoint with its size, listed once."""
        with self._lock:
            if self._sizes is None:
                with self._io("listing the checkpoint"):
                    self._sizes = self._list()
            return self._sizes

    def chunk_nbytes(self, name: str, key: str) -> int | None:
        return self._listed().get(object_key(name, key))

    def chunk_keys(self, name: str) -> set[str]:
        """The chunk keys under the array's prefix, from the one listing of the checkpoint."""
        prefix = object_key(name, ROOT_KEY)[: -len(ROOT_KEY)]
        return {
            rel[len(prefix) :]
            for rel in self._listed()
            if rel.startswith(prefix) and is_chunk_file_key(rel[len(prefix) :])
        }

    def read_chunk_into(self, name: str, key: str, dests: Sequence[Any]) -> int:
        return self._stream_into(name, key, dests, checksum=False)[0]

    def read_chunk_crc(self, name: str, key: str, dests: Sequence[Any]) -> tuple[int, int]:
        """Streams the object into ``dests``, checksumming each piece as it is copied (in one
        pass with the native copy-with-CRC loop where it is built), not in a second pass."""
        return self._stream_into(name, key, dests, checksum=True)

    def _stream_into(self, name: str, key: str, dests: Sequence[Any], checksum: bool) -> tuple[int, int]:
        """Fill ``dests`` in order from the object; ``(bytes read, CRC32C of all but the last
        buffer)`` (the CRC is 0 unless ``checksum``)."""
        rel = object_key(name, key)
        with self._io(f"reading {rel}"), self.budget.take():
            total, crcs = stream_into(self._obs, rel, 0, dests, "chunk" if checksum else "none")
        return total, crcs[0]

    def read_chunk_checksum(self, name: str, key: str, nbytes: int, piece: int) -> tuple[int, int, int]:
        """Streams the object in pieces of about ``piece`` bytes, checksummed as they arrive."""
        import obstore as obs

        rel = object_key(name, key)
        data = max(0, nbytes - CRC_BYTES)
        total = value = 0
        trailer = bytearray()
        if nbytes == 0:
            return 0, 0, 0
        with self._io(f"reading {rel}"), self.budget.take():
            res = obs.get(self._obs, rel, options={"range": (0, nbytes)})
            for part in res.stream(min_chunk_size=max(1, piece)):
                view = memoryview(part).cast("B")[: nbytes - total]
                take = min(view.nbytes, max(0, data - total))
                if take:
                    value = crc32c(view[:take], value)
                trailer += view[take:]
                total += view.nbytes
                if total == nbytes:
                    break
        stored = int.from_bytes(trailer, "little") if len(trailer) == CRC_BYTES else 0
        return total, value, stored
