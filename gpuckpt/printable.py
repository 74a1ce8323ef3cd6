"""Text from a checkpoint made safe for a terminal.

Names, values and paths in a checkpoint are untrusted: a tensor named
``"a\\x1b[2J"`` or ``"x\\n  fake row"`` must not clear the screen or forge lines
of ``gpuckpt inspect``. Every human-readable output passes such text through
:func:`printable`, which spells each non-printable character as its Python
escape and leaves everything else as it is. (``--json`` output needs nothing:
:func:`json.dumps` escapes control characters already.)
"""

from __future__ import annotations

__all__ = ["one_line", "printable"]

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: object) -> str:
    """``str(text)`` with every non-printable character escaped (``\\n``, ``\\x1b``, ``\\u202e``).

    Printable means :meth:`str.isprintable`: control characters, line and
    paragraph separators, format characters (bidirectional overrides), spaces
    other than the ASCII one, unassigned code points and lone surrogates are
    escaped.

    Examples
    --------
    >>> printable("layer\\x1b[31m.weight\\n")
    'layer\\\\x1b[31m.weight\\\\n'
    """
    s = str(text)
    if s.isprintable():
        return s
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in s)


def one_line(text: object) -> str:
    """``text`` on one line: every run of white space made one space, the rest :func:`printable`."""
    return printable(" ".join(str(text).split()))
