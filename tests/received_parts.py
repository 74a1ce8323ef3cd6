"""A saved part's files as a replaced node's restore receives them, without a transport.

Each file travels as the messages :func:`gpuckpt.tiers.placement.message_sizes` gives it;
a file that ``targets`` names is received into that memory (the transport writes the bytes
into the array), every other message into a buffer of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuckpt.tiers.placement import message_sizes


def receive(path: Path, targets: dict[str, memoryview]) -> dict[str, list[Any]]:
    """Every file of ``path`` as its messages, each put where a restore puts it."""
    files: dict[str, list[Any]] = {}
    for p in sorted(path.rglob("*")):
        if not p.is_file():
            continue
        rel, data = str(p.relative_to(path)), p.read_bytes()
        t = targets.get(rel)
        pieces: list[Any] = []
        at = 0
        for i, n in enumerate(message_sizes(rel, len(data))):
            chunk = data[at : at + n]
            if t is not None and i == 0 and n == t.nbytes:
                t[:] = chunk
                pieces.append(t)
            else:
                pieces.append(bytearray(chunk))
            at += n
        files[rel] = pieces
    return files
