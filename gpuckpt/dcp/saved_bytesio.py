"""DCP's ``io.BytesIO`` values, read from their ``torch.save`` bytes without unpickling them.

DCP stores opaque bytes (a data loader's state, RNG state, any blob) as
``io.BytesIO`` values; its default save planner hands them over, as every
non-tensor value, as ``torch.save(value)``: a zip archive whose
``<name>/data.pkl`` rebuilds the BytesIO (pickle protocol 2)::

    GLOBAL '_io BytesIO', EMPTY_TUPLE, NEWOBJ,
    GLOBAL '_codecs encode', BINUNICODE <the bytes as latin-1>, BINUNICODE 'latin1', TUPLE2, REDUCE,
    BININT1 <position>, NONE, TUPLE3, BUILD, STOP

(``__builtin__ bytes`` with no arguments for empty bytes; memo puts between
the steps). ``torch.load(weights_only=True)`` refuses ``_io.BytesIO``, and
allowing it through ``torch.serialization.safe_globals`` changes a set that
is shared by every thread. :func:`saved_bytesio` instead reads the opcodes
with :func:`pickletools.genops`, which decodes them without running any, and
accepts exactly this program: the value it computes is made here (a new
BytesIO of the decoded bytes), nothing in the blob is imported or called.
"""

from __future__ import annotations

import io
import pickletools
import sys
import zipfile
from typing import Any

__all__ = ["saved_bytesio"]

_BYTESIO = ("_io", "BytesIO")
_ENCODE = ("_codecs", "encode")
_BYTES = ("builtins", "bytes")
#: the globals the program may name (protocol 2 spells builtins "__builtin__")
_GLOBALS = {
    ("_io", "BytesIO"): _BYTESIO,
    ("io", "BytesIO"): _BYTESIO,
    ("_codecs", "encode"): _ENCODE,
    ("__builtin__", "bytes"): _BYTES,
    ("builtins", "bytes"): _BYTES,
}
_TEXT = frozenset(("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE"))
_RAW = frozenset(("BINBYTES", "SHORT_BINBYTES", "BINBYTES8"))
_INTS = frozenset(("BININT", "BININT1", "BININT2", "LONG1", "INT"))
_PUTS = frozenset(("BINPUT", "LONG_BINPUT", "PUT"))
_GETS = frozenset(("BINGET", "LONG_BINGET", "GET"))


class _Refused(Exception):
    """The pickle is not the program of a lone BytesIO."""


class _NewBytesIO:
    """The object NEWOBJ made, until BUILD gives it its state."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: tuple[bytes, int] | None = None


def saved_bytesio(blob: bytes) -> io.BytesIO | None:
    """The ``io.BytesIO`` (same bytes, same position) that the ``torch.save`` bytes ``blob`` hold,
    or None when ``blob`` is anything else. Nothing in ``blob`` is run."""
    data = _data_pickle(blob)
    if data is None:
        return None
    try:
        value, pos = _run(data)
    except (_Refused, ValueError, EOFError, KeyError, IndexError, UnicodeError, OverflowError):
        return None
    out = io.BytesIO(value)
    out.seek(pos)
    return out


def _data_pickle(blob: bytes) -> bytes | None:
    """The one ``<name>/data.pkl`` of a ``torch.save`` zip archive, stored uncompressed as torch does."""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            found = [
                info
                for info in archive.infolist()
                if info.filename.endswith("/data.pkl") and info.filename.count("/") == 1
            ]
            if len(found) != 1:
                return None
            info = found[0]
            # stored, and no larger than the archive: nothing to inflate
            if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(blob):
                return None
            return archive.read(info)
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        ValueError,
        OSError,
        EOFError,
        NotImplementedError,
        RuntimeError,
    ):
        # (zipfile raises NotImplementedError for versions and compressions it does not know,
        # RuntimeError for an encrypted entry: not the archive torch.save writes)
        return None


def _run(data: bytes) -> tuple[bytes, int]:
    """Follow the opcodes of ``data`` on a stack of plain values; refuse anything but the program."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    calls = 0  # the program makes its bytes with one call: more would make more (and larger) values
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in ("PROTO", "FRAME"):
            continue
        if name in _PUTS:
            memo[_index(arg)] = stack[-1]
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in _GETS:
            stack.append(memo[_index(arg)])
        elif name == "GLOBAL":
            module, _, attr = str(arg).partition(" ")
            stack.append(_known_global(module, attr))
        elif name == "STACK_GLOBAL":
            attr, module = stack.pop(), stack.pop()
            if not (isinstance(module, str) and isinstance(attr, str)):
                raise _Refused
            stack.append(_known_global(module, attr))
        elif name in _TEXT or name in _RAW:
            stack.append(arg)
        elif name in _INTS:
            if type(arg) is not int:  # INT spells True and False "01" and "00"
                raise _Refused
            stack.append(arg)
        elif name == "NONE":
            stack.append(None)
        elif name == "EMPTY_DICT":
            stack.append({})
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            if len(stack) < n:
                raise _Refused
            items = tuple(stack[len(stack) - n :])
            del stack[len(stack) - n :]
            stack.append(items)
        elif name == "MARK":
            marks.append(len(stack))
        elif name == "TUPLE":
            start = marks.pop()
            items = tuple(stack[start:])
            del stack[start:]
            stack.append(items)
        elif name == "NEWOBJ":
            args, cls = stack.pop(), stack.pop()
            if cls is not _BYTESIO or args != ():
                raise _Refused
            stack.append(_NewBytesIO())
        elif name == "REDUCE":
            calls += 1
            if calls > 1:
                raise _Refused
            args, func = stack.pop(), stack.pop()
            stack.append(_call(func, args))
        elif name == "BUILD":
            state, inst = stack.pop(), stack[-1]
            if not isinstance(inst, _NewBytesIO) or inst.state is not None:
                raise _Refused
            inst.state = _bytesio_state(state)
        elif name == "STOP":
            if len(stack) != 1 or marks or not isinstance(stack[0], _NewBytesIO) or stack[0].state is None:
                raise _Refused
            return stack[0].state
        else:
            raise _Refused
    raise _Refused  # no STOP


def _index(arg: Any) -> int:
    if type(arg) is not int:
        raise _Refused
    return arg


def _known_global(module: str, attr: str) -> tuple[str, str]:
    found = _GLOBALS.get((module, attr))
    if found is None:
        raise _Refused
    return found


def _call(func: Any, args: Any) -> bytes:
    """What the two calls the program makes return, computed here (neither is imported)."""
    if func is _ENCODE and isinstance(args, tuple) and len(args) == 2:
        text, encoding = args
        if isinstance(text, str) and encoding in ("latin1", "latin-1"):
            return text.encode("latin-1")  # UnicodeError for text that is not latin-1: refused
    if func is _BYTES and args == ():
        return b""
    raise _Refused


def _bytesio_state(state: Any) -> tuple[bytes, int]:
    """``BytesIO.__getstate__``'s ``(value, position, __dict__)``, with no attributes set."""
    if not (isinstance(state, tuple) and len(state) == 3):
        raise _Refused
    value, pos, attrs = state
    if (
        not isinstance(value, bytes)
        or type(pos) is not int
        or not 0 <= pos <= sys.maxsize
        or attrs not in (None, {})
    ):
        raise _Refused
    return value, pos
