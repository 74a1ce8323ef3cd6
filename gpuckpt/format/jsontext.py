"""JSON parsed from bytes gpuckpt did not write (a checkpoint's documents, a safetensors header,
a Hugging Face index): a parse that runs out of memory is a ``ValueError`` as any other bad
JSON is, so that each reader names the file in its own typed error.

Parsed, JSON costs far more than its text: each value is a Python object (``[[],[],...]``: about
28 bytes of memory per byte of text). The size caps on documents bound the text; where the
objects outgrow the process's memory (a limit set with ``ulimit -v``, a container's), the
parse stops with this error instead of a bare ``MemoryError``.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads"]


def loads(raw: bytes | bytearray | str) -> Any:
    """``json.loads(raw)``; a parse out of memory raises ``ValueError`` naming the size."""
    try:
        return json.loads(raw)
    except MemoryError:
        raise ValueError(
            f"its {len(raw)} bytes of JSON hold more values than this process has memory for"
        ) from None
