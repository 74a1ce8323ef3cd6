"""Streamed reads of a chunk object into the caller's buffers, checksummed as the pieces arrive.

One GET (with a byte range) streams the object's bytes from ``offset`` into
the caller's buffers in order; the CRC32C is computed while each piece is
copied (in one pass with the native copy-with-CRC loop where it is built),
never in a second pass: over every buffer but the last (a whole chunk, its
trailer in the last buffer), or per buffer (the segments of a ranged read,
see :mod:`gpuckpt.format.segments`, each checked against its record).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from gpuckpt.format.checksum import crc32c
from gpuckpt.storage.local import crccopy

__all__ = ["stream_into"]

_STREAM_PIECE = 4 << 20


def stream_into(
    store: Any, rel: str, offset: int, dests: Sequence[Any], checksum: Literal["none", "chunk", "each"]
) -> tuple[int, list[int]]:
    """Fill ``dests`` from object ``rel`` of the obstore ``store`` at ``offset`` on.

    Returns ``(bytes read, CRC32Cs)``: for ``checksum="chunk"`` one CRC32C, of every
    buffer but the last (the trailer's); for ``"each"`` one per buffer; for ``"none"``
    zeros. A CRC is meaningful only when its buffers were filled. Errors are the
    client's (the caller translates them).
    """
    import obstore as obs

    views = [memoryview(d).cast("B") for d in dests]
    want = sum(v.nbytes for v in views)
    each = checksum == "each"
    crcs = [0] * (len(views) if each else 1)
    if want == 0:
        return 0, crcs
    fused = checksum != "none" and crccopy.available()
    last = len(views) - 1
    i, pos, total = 0, 0, 0
    res = obs.get(store, rel, options={"range": (offset, offset + want)})
    for piece in res.stream(min_chunk_size=_STREAM_PIECE):
        src = memoryview(piece).cast("B")
        while src.nbytes and i < len(views):
            n = min(src.nbytes, views[i].nbytes - pos)
            dst = views[i][pos : pos + n]
            k = i if each else 0
            if checksum == "none" or (checksum == "chunk" and i == last):
                dst[:] = src[:n]
            elif fused:
                crcs[k] = crccopy.crc_copy(src[:n], dst, crcs[k])
            else:
                dst[:] = src[:n]
                crcs[k] = crc32c(dst, crcs[k])  # while the piece is still in the cache
            src, pos, total = src[n:], pos + n, total + n
            if pos == views[i].nbytes:
                i, pos = i + 1, 0
        if i == len(views):
            break
    return total, crcs
