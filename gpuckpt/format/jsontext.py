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

__all__ = ["loads", "refuse_constant", "STRICT"]


def loads(raw: bytes | bytearray | str, *, unique_keys: bool = False) -> Any:
    """``json.loads(raw)`` of standard JSON: ``NaN``, ``Infinity`` and ``-Infinity``, which
    ``json.loads`` takes and JSON does not have, are a ``ValueError``; so is a parse out of
    memory, naming the size. ``unique_keys``: an object that gives a key twice is a
    ``ValueError`` naming the key (JSON leaves it to the reader; ``json.loads`` keeps the last)."""
    try:
        return json.loads(
            raw, object_pairs_hook=_unique if unique_keys else None, parse_constant=refuse_constant
        )
    except MemoryError:
        raise ValueError(
            f"its {len(raw)} bytes of JSON hold more values than this process has memory for"
        ) from None


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key[:200]!r} is given twice in one object")
        out[key] = value
    return out


def refuse_constant(name: str) -> Any:
    """``parse_constant`` of a standard JSON parse: ``NaN`` and ``Infinity`` are not JSON."""
    raise ValueError(f"{name} is not a JSON value (standard JSON has no NaN or Infinity)")


#: a decoder of standard JSON, for ``raw_decode`` (no NaN or Infinity)
STRICT = json.JSONDecoder(parse_constant=refuse_constant)
