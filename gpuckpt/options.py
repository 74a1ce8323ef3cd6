"""The options of a save and of a load: one frozen, validated value each.

The public functions (:func:`gpuckpt.save`, :func:`gpuckpt.async_save`,
:func:`gpuckpt.load`, :func:`gpuckpt.load_state_dict`,
:class:`gpuckpt.CheckpointManager`) keep their keyword arguments; each makes
one :class:`SaveOptions` or :class:`LoadOptions` from them at the edge and
passes it down whole, so that no path forwards options by hand (and none can
drop one). Validation happens here, before any resource (staging memory,
files, claims) is taken: a bad value fails the call that gave it, with the
name of the option, what was given and what is accepted.

The environment switch ``GPUCKPT_DIRECT_IO`` is read once, when the options
are made, for the same reason.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from gpuckpt.errors import InvalidOptionError
from gpuckpt.format.codecs import Compression, parse_compression
from gpuckpt.format.grid import DEFAULT_CHUNK_BYTES
from gpuckpt.progress import ProgressCallback

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_STAGING_BYTES",
    "DIRECT_IO_MODES",
    "STAGING_MODES",
    "SYNC_MODES",
    "LoadOptions",
    "SaveOptions",
    "check_environment",
    "direct_io_from_env",
    "switch_from_env",
]

#: budget of (page-locked) host memory through which device arrays stream
DEFAULT_STAGING_BYTES = 512 << 20
#: durability modes of a save (see :mod:`gpuckpt.storage.local.writer`)
_SYNC_MEANINGS = {"auto": "choose", "file": "fsync each file", "fs": "one syncfs", "none": "no durability"}
SYNC_MODES = tuple(_SYNC_MEANINGS)
#: where :func:`gpuckpt.async_save` takes its snapshot
_STAGING_MEANINGS = {"host": "snapshot into host memory", "device": "snapshot into spare device memory"}
STAGING_MODES = tuple(_STAGING_MEANINGS)
#: ``O_DIRECT`` writes of large chunk files: the caller's default, or forced on or off
_DIRECT_IO_MEANINGS = {"auto": "background saves only", "on": "always", "off": "never"}
DIRECT_IO_MODES = tuple(_DIRECT_IO_MEANINGS)

_ENV_DIRECT_IO = "GPUCKPT_DIRECT_IO"
_ENV_SWITCHES = (_ENV_DIRECT_IO, "GPUCKPT_BATCHIO", "GPUCKPT_CRCCOPY")
_ON = ("1", "on", "true", "yes")
_OFF = ("0", "off", "false", "no")


def switch_from_env(name: str) -> str:
    """An on/off switch of the environment (``GPUCKPT_DIRECT_IO``, ``GPUCKPT_BATCHIO``,
    ``GPUCKPT_CRCCOPY``) as ``"auto"`` (unset or empty), ``"on"`` (1, on, true, yes) or ``"off"``
    (0, off, false, no), any case; another value is an :class:`InvalidOptionError` naming it."""
    raw = os.environ.get(name, "auto")
    value = raw.strip().lower()
    if value in ("auto", ""):
        return "auto"
    if value in _ON:
        return "on"
    if value in _OFF:
        return "off"
    raise InvalidOptionError(f"{name}={raw!r} is not understood; set it to auto, 1/on or 0/off, or unset it")


def direct_io_from_env() -> str:
    """``GPUCKPT_DIRECT_IO`` as one of :data:`DIRECT_IO_MODES`; a bad value is an option error."""
    return switch_from_env(_ENV_DIRECT_IO)


def check_environment() -> None:
    """Refuse a bad value of gpuckpt's environment switches before a save or a load takes
    anything (each is read where it is used, as late as the first large chunk)."""
    for name in _ENV_SWITCHES:
        switch_from_env(name)
    crc = os.environ.get("GPUCKPT_CRC32C", "auto")
    if crc not in ("auto", "awscrt", "crc32c"):
        raise InvalidOptionError(
            f"GPUCKPT_CRC32C={crc!r}; expected 'auto', 'awscrt' or 'crc32c', or unset it"
        )


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidOptionError(f"{name} must be True or False, got {value!r}")


def _count(name: str, value: Any, meaning: str, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        what = "an integer >= 1 or None (the default)" if optional else f"a positive integer ({meaning})"
        raise InvalidOptionError(f"{name} must be {what}, got {value!r}")


def _choice(name: str, value: Any, choices: dict[str, str], kind: str) -> None:
    if not isinstance(value, str) or value not in choices:
        names = ", ".join(map(repr, choices))
        meanings = ", ".join(f"{k!r}: {v}" for k, v in choices.items())
        raise InvalidOptionError(f"{name}={value!r} is not {kind}; expected one of {names} ({meanings})")


def _callback(name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise InvalidOptionError(
            f"{name} must be a callable {name}(done_bytes, total_bytes) or None, got {value!r}"
        )


def _location(name: str, value: Any) -> None:
    if value is None:
        return
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str) or not text:
        raise InvalidOptionError(
            f"{name} must be the path or URL of an earlier checkpoint (a str or os.PathLike) or None, "
            f"got {value!r}"
        )


def _mapping(name: str, value: Any) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InvalidOptionError(
            f"{name} must be a dict with string keys or None (e.g. endpoint and credentials for s3://), "
            f"got {value!r}"
        )
    # a private read-only copy: later changes to the caller's dict do not reach a queued save
    return MappingProxyType(dict(value))


@dataclass(frozen=True, slots=True)
class SaveOptions:
    """How a checkpoint is written; see :func:`gpuckpt.save` for each field.

    ``base``: an earlier checkpoint whose equal chunks this save reuses instead
    of writing them (:mod:`gpuckpt.saving.incremental`); ``content_hash``: record each
    chunk's content hash even without a base, so that a later save can use this
    one as its base. ``staging`` matters to background saves only; ``direct_io`` is
    ``GPUCKPT_DIRECT_IO`` as read when the value was made (``"auto"``: the
    path decides, see :meth:`use_direct_io`).

    Examples
    --------
    >>> o = SaveOptions(chunk_bytes=1 << 20, sync="file")
    >>> o.replace(overwrite=True).overwrite
    True
    >>> SaveOptions(sync="fsync")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gpuckpt.errors.InvalidOptionError: sync='fsync' is not a durability mode; expected one of 'auto', ...
    """

    overwrite: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    allow_pickle: bool = False
    sync: str = "auto"
    threads: int | None = None
    progress: ProgressCallback | None = None
    staging: str = "host"
    staging_bytes: int = DEFAULT_STAGING_BYTES
    storage_options: Mapping[str, Any] | None = None
    portable: bool = False
    direct_io: str = dataclasses.field(default_factory=direct_io_from_env)
    base: str | os.PathLike[str] | None = None
    content_hash: bool = False
    #: chunk compression (:func:`gpuckpt.format.codecs.parse_compression`): None or "none" (stored
    #: as they are), "zstd", "lz4", "auto", or a dict spec; kept as a
    #: :class:`~gpuckpt.format.codecs.Compression` (None for none)
    compression: Compression | str | Mapping[str, Any] | None = None
    #: entries added to the root document's ``planner_data`` by a single-process save (a local
    #: tier's part record, :mod:`gpuckpt.format.parts`); JSON values
    planner_extra: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        check_environment()
        _flag("overwrite", self.overwrite)
        _count("chunk_bytes", self.chunk_bytes, "bytes per stored chunk")
        _flag("allow_pickle", self.allow_pickle)
        _choice("sync", self.sync, _SYNC_MEANINGS, "a durability mode")
        _count("threads", self.threads, "I/O threads", optional=True)
        _callback("progress", self.progress)
        _choice("staging", self.staging, _STAGING_MEANINGS, "a staging mode")
        _count("staging_bytes", self.staging_bytes, "bytes of staging memory")
        object.__setattr__(self, "storage_options", _mapping("storage_options", self.storage_options))
        _flag("portable", self.portable)
        _choice("direct_io", self.direct_io, _DIRECT_IO_MEANINGS, "a direct I/O mode")
        _location("base", self.base)
        _flag("content_hash", self.content_hash)
        object.__setattr__(self, "planner_extra", _mapping("planner_extra", self.planner_extra))
        try:
            spec = dict(self.compression) if isinstance(self.compression, Mapping) else self.compression
            # "none" is the command line's word for None (--compression none): one meaning everywhere
            object.__setattr__(
                self,
                "compression",
                None if isinstance(spec, str) and spec == "none" else parse_compression(spec),
            )
        except (ValueError, TypeError) as exc:
            raise InvalidOptionError(
                f"{exc}; compression is None or 'none' (chunks stored as they are), 'zstd', 'lz4', "
                "'auto' or a dict spec (see docs/compression.md)"
            ) from None

    @property
    def codecs(self) -> Compression | None:
        """``compression`` as validated (a :class:`~gpuckpt.format.codecs.Compression`, or None)."""
        value = self.compression
        assert value is None or isinstance(value, Compression)
        return value

    @property
    def base_location(self) -> str | None:
        """``base`` as a string (a path or URL), or None."""
        return None if self.base is None else os.fspath(self.base)

    @property
    def hashing(self) -> bool:
        """Whether chunks are hashed: asked for, or needed to compare with a base."""
        return self.content_hash or self.base is not None

    def replace(self, **changes: Any) -> SaveOptions:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def use_direct_io(self, background: bool) -> bool:
        """Whether large chunk files go around the page cache: by default for background saves
        only (nothing dirty next to training; a synchronous save leaves its files cached for a
        reader), unless ``direct_io`` forces it. The platform may still refuse."""
        if self.direct_io == "auto":
            return background
        return self.direct_io == "on"

    def store_options(self) -> dict[str, Any]:
        """``storage_options`` as keyword arguments for a store (a fresh dict)."""
        return dict(self.storage_options or {})


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """How a checkpoint is read; see :func:`gpuckpt.load` for each field.

    ``cooperative``: a load with a coordinator reads each stored chunk that several ranks
    need once for the whole job (:mod:`gpuckpt.distributed.cooperative`), holding at most
    ``staging_bytes`` of such chunks per rank at a time (none for chunks it reads or receives
    straight into its arrays); False: every rank reads what it
    needs itself; None (the default): cooperative where the store serves each rank's reads
    anew (object storage, network file systems), not on a local file system, whose page
    cache already serves the ranks of a node from one read."""

    strict: bool = True
    allow_pickle: bool = False
    threads: int | None = None
    progress: ProgressCallback | None = None
    staging_bytes: int = DEFAULT_STAGING_BYTES
    storage_options: Mapping[str, Any] | None = None
    direct_io: str = dataclasses.field(default_factory=direct_io_from_env)
    cooperative: bool | None = None

    def __post_init__(self) -> None:
        check_environment()
        _flag("strict", self.strict)
        _flag("allow_pickle", self.allow_pickle)
        _count("threads", self.threads, "I/O threads", optional=True)
        _callback("progress", self.progress)
        _count("staging_bytes", self.staging_bytes, "bytes of staging memory")
        object.__setattr__(self, "storage_options", _mapping("storage_options", self.storage_options))
        _choice("direct_io", self.direct_io, _DIRECT_IO_MEANINGS, "a direct I/O mode")
        if self.cooperative is not None:
            _flag("cooperative", self.cooperative)

    def reads_direct(self) -> bool:
        """Whether large chunks that are not in the page cache are read around it (``O_DIRECT``
        into aligned memory: the cache is not filled with a checkpoint read once): unless
        ``direct_io`` is ``"off"`` (``"auto"`` and ``"on"`` both read cold chunks that way; a
        chunk in the cache is copied from it). The platform may still refuse."""
        return self.direct_io != "off"

    def replace(self, **changes: Any) -> LoadOptions:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def store_options(self) -> dict[str, Any]:
        """``storage_options`` as keyword arguments for a store (a fresh dict)."""
        return dict(self.storage_options or {})
