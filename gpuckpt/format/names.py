"""Array names derived from FQNs: safe as one path component, reversible.

The rule, applied to the UTF-8 bytes of the FQN:

1. Bytes of ``A-Z a-z 0-9 _ - .`` stay as they are; every other byte
   (``/``, ``%``, spaces, non-ASCII, control characters) becomes ``%XX``
   with two upper-case hex digits.
2. A first character that is not a letter or digit is escaped too, so that no
   name is ``.``, ``..``, hidden, or starts with Zarr's reserved ``__``.
3. The empty FQN is the name ``%`` (no other rule produces a bare ``%``), and
   the FQN ``zarr.json`` is ``%7Aarr.json`` (that name is the group's own
   metadata document).
4. A name longer than 200 bytes is cut to 180 bytes and completed with ``~``
   and 16 hex digits of the FQN's SHA-256; such names are not decodable on
   their own, and the metadata maps them back to their FQN.

Distinct FQNs give distinct names (rules 1-3 are injective; rule 4 adds a
digest), so names never collide and never leave the checkpoint directory.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["MAX_NAME_BYTES", "decode_name", "encode_name", "is_safe_name"]

MAX_NAME_BYTES = 200
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.")
_ALNUM = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
# names that encode to themselves: ASCII letters and digits first, then also _ - .
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", re.ASCII)
_NAME_RE = re.compile(r"^(%|(?:[A-Za-z0-9]|%[0-9A-F]{2})(?:[A-Za-z0-9_.\-]|%[0-9A-F]{2}|~)*)$")


def encode_name(fqn: str) -> str:
    """Array name for ``fqn``.

    Examples
    --------
    >>> encode_name("model.layers.0.weight")
    'model.layers.0.weight'
    >>> encode_name("../etc/passwd")
    '%2E.%2Fetc%2Fpasswd'
    """
    if len(fqn) <= MAX_NAME_BYTES and fqn != "zarr.json" and _PLAIN.fullmatch(fqn):
        return fqn  # nothing to escape (the common case, checked in one regex match)
    if fqn == "":
        return "%"
    raw = fqn.encode("utf-8", "surrogatepass")
    out = []
    for i, b in enumerate(raw):
        if b in _SAFE and (i > 0 or b in _ALNUM):
            out.append(chr(b))
        else:
            out.append(f"%{b:02X}")
    name = "".join(out)
    if name == "zarr.json":
        name = "%7Aarr.json"
    if len(name) > MAX_NAME_BYTES:
        digest = hashlib.sha256(raw).hexdigest()[:16]
        head = name[:180]
        # never cut an escape sequence in half
        cut = head.rfind("%", len(head) - 2)
        if cut != -1:
            head = head[:cut]
        name = f"{head}~{digest}"
    return name


def decode_name(name: str) -> str:
    """FQN of a name produced by :func:`encode_name` (not for hashed long names)."""
    if name == "%":
        return ""
    if "~" in name:
        raise ValueError(f"array name {name!r} is a shortened name; look its FQN up in the metadata")
    out = bytearray()
    i = 0
    while i < len(name):
        if name[i] == "%":
            out.append(int(name[i + 1 : i + 3], 16))
            i += 3
        else:
            out.append(ord(name[i]))
            i += 1
    return out.decode("utf-8", "surrogatepass")


def is_safe_name(name: object) -> bool:
    """True when ``name`` could have come from :func:`encode_name`: one safe path component."""
    return (
        isinstance(name, str)
        and len(name) <= MAX_NAME_BYTES
        and name != "zarr.json"
        and _NAME_RE.match(name) is not None
    )
