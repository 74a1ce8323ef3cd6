"""Compressed chunks: the Zarr v3 ``blosc`` and ``zstd`` codecs between ``bytes`` and ``crc32c``.

A compressed tensor's array lists the codecs ``bytes`` (little-endian) ->
``blosc`` (or ``zstd``) -> ``crc32c``: a stored chunk is the compressed form of
the chunk's padded C-order bytes, followed by the CRC32C of the compressed bytes
(4 bytes, little-endian), exactly what zarr-python and TensorStore decode. The
codec of each tensor is recorded in its ``storage_data`` entry (``codec``: the
codec's Zarr JSON) and each chunk's stored size in its record (format version 4,
:mod:`gpuckpt.format.records`).

Nothing read is trusted: a chunk's stored size is bounded by what its codec can
produce from the chunk's logical size (:meth:`Codec.max_stored`), the frame header
must announce exactly the chunk's logical size before anything is decompressed,
and decompression writes into the destination of that size and no further
(:func:`decode_into`): a decompression bomb fails without allocating.

Compression runs in numcodecs (which zarr depends on): both codecs release the
GIL while they work, so the I/O threads of a save compress in parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuckpt.errors import MetadataError

__all__ = [
    "BLOSC_MAX_BYTES",
    "COMPRESSION_KEY",
    "PRESETS",
    "Codec",
    "CodecError",
    "Compression",
    "auto_report",
    "parse_compression",
    "decode_into",
    "encode",
    "parse_codec",
]

#: the blosc1 frame format holds at most this many bytes (2**31 - 1 less its header)
BLOSC_MAX_BYTES = (1 << 31) - 1 - 16
_BLOSC_HEADER = 16
_BLOSC_CNAMES = ("zstd", "lz4", "lz4hc", "blosclz", "zlib")
_SHUFFLES = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
#: the largest blosc block size a checkpoint records: TensorStore's zarr3 driver refuses to open
#: an array whose blosc codec names a larger one (tensorstore 0.1.86: 715827543 is refused)
MAX_BLOSC_BLOCKSIZE = 715827542
_ZSTD_MAGIC = 0xFD2FB528


class CodecError(ValueError):
    """A compressed chunk that does not decode to its chunk's bytes (the caller names the chunk)."""


@dataclass(frozen=True, slots=True)
class Codec:
    """The compression of one tensor's chunks: the Zarr v3 ``blosc`` codec (``cname``,
    ``level``, ``shuffle``, ``typesize``, ``blocksize``) or the core ``zstd`` codec (``level``)."""

    name: str  # "blosc" or "zstd"
    level: int
    cname: str = "zstd"
    shuffle: str = "shuffle"
    typesize: int = 1
    blocksize: int = 0

    def __post_init__(self) -> None:
        if self.name not in ("blosc", "zstd"):
            raise ValueError(f"codec {self.name!r} is not 'blosc' or 'zstd'")
        if self.name == "blosc":
            if self.cname not in _BLOSC_CNAMES:
                raise ValueError(f"blosc cname {self.cname!r} is not one of {', '.join(_BLOSC_CNAMES)}")
            if not isinstance(self.shuffle, str) or self.shuffle not in _SHUFFLES:
                raise ValueError(f"blosc shuffle {self.shuffle!r} is not one of {', '.join(_SHUFFLES)}")
            if type(self.level) is not int or not 0 <= self.level <= 9:
                raise ValueError(f"blosc clevel {self.level!r} is not an integer in 0..9")
            if type(self.typesize) is not int or not 1 <= self.typesize <= 255:
                raise ValueError(f"blosc typesize {self.typesize!r} is not an integer in 1..255")
            if type(self.blocksize) is not int or not 0 <= self.blocksize <= MAX_BLOSC_BLOCKSIZE:
                raise ValueError(
                    f"blosc blocksize {self.blocksize!r} is not an integer in 0..{MAX_BLOSC_BLOCKSIZE} "
                    "(0: the library chooses; larger blocks are what TensorStore refuses to read)"
                )
        elif type(self.level) is not int or not -131072 <= self.level <= 22:
            raise ValueError(f"zstd level {self.level!r} is not an integer in -131072..22")

    def to_json(self) -> dict[str, Any]:
        """The codec as an entry of a Zarr v3 array's ``codecs`` list."""
        if self.name == "zstd":
            return {"name": "zstd", "configuration": {"level": self.level, "checksum": False}}
        return {
            "name": "blosc",
            "configuration": {
                "cname": self.cname,
                "clevel": self.level,
                "shuffle": self.shuffle,
                "typesize": self.typesize,
                "blocksize": self.blocksize,
            },
        }

    def max_stored(self, nbytes: int) -> int:
        """The most bytes the compressed form of ``nbytes`` bytes may take (the codec's bound)."""
        if self.name == "blosc":
            return nbytes + _BLOSC_HEADER
        # ZSTD_COMPRESSBOUND, plus room for a frame header and an empty frame
        return nbytes + (nbytes >> 8) + ((128 << 10) - nbytes >> 11 if nbytes < 128 << 10 else 0) + 64

    def fits(self, nbytes: int) -> bool:
        """Whether a chunk of ``nbytes`` logical bytes can be stored with this codec."""
        return self.name != "blosc" or nbytes <= BLOSC_MAX_BYTES


def parse_codec(raw: Any, itemsize: int, where: str) -> Codec:
    """The codec of a tensor's ``storage_data`` entry (untrusted JSON), checked; raises
    :class:`~gpuckpt.errors.MetadataError` naming ``where``."""
    conf = raw.get("configuration") if type(raw) is dict else None
    name = raw.get("name") if type(raw) is dict else None
    try:
        if type(conf) is not dict:
            raise ValueError("expected an object with 'name' and 'configuration'")
        if name == "zstd":
            if conf.get("checksum", False) is not False:
                raise ValueError("zstd frames with their own checksum are not written by gpuckpt")
            level: Any = conf.get("level")
            return Codec("zstd", level)
        if name == "blosc":
            get: Any = conf.get
            codec = Codec(
                "blosc", get("clevel"), get("cname"), get("shuffle"), get("typesize"), get("blocksize", 0)
            )
            if codec.typesize != itemsize:
                raise ValueError(f"typesize {codec.typesize} is not the tensor's element size {itemsize}")
            return codec
        raise ValueError(f"codec {name!r:.40} is not 'blosc' or 'zstd'")
    except ValueError as exc:
        raise MetadataError(
            f"{where}: its codec is not one gpuckpt reads ({exc}); the checkpoint is damaged or was not "
            "written by gpuckpt"
        ) from None


def encode(codec: Codec, data: np.ndarray, pad: int) -> np.ndarray:
    """The compressed form of the bytes ``data`` followed by ``pad`` zero bytes (a chunk's padded
    C-order bytes, :func:`gpuckpt.format.chunks.chunk_bytes`), as a new ``uint8`` array."""
    if pad:
        whole = np.zeros(data.nbytes + pad, np.uint8)
        whole[: data.nbytes] = data
        data = whole
    if codec.name == "blosc":
        from numcodecs import blosc

        out = blosc.compress(
            data,
            codec.cname.encode(),
            codec.level,
            _SHUFFLES[codec.shuffle],
            codec.blocksize,
            codec.typesize,
        )
    else:
        from numcodecs import zstd

        out = zstd.compress(data, codec.level)
    return np.frombuffer(out, np.uint8)


def _zstd_content_size(src: memoryview) -> int | None:
    """The content size a zstd frame's header announces (None: the frame does not say)."""
    if len(src) < 6 or int.from_bytes(src[:4], "little") != _ZSTD_MAGIC:
        raise CodecError("it does not begin with a zstd frame")
    fhd = src[4]
    fcs_flag, single = fhd >> 6, (fhd >> 5) & 1
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if size == 0:
        return None
    if len(src) < at + size:
        raise CodecError("its zstd frame header is truncated")
    value = int.from_bytes(src[at : at + size], "little")
    return value + 256 if size == 2 else value


def decode_into(codec: Codec, src: memoryview, dest: np.ndarray) -> None:
    """Decompress the compressed chunk ``src`` into ``dest`` (C-contiguous ``uint8``, exactly the
    chunk's padded logical size); raises :class:`CodecError` when the frame does not announce
    that size, or does not decompress to exactly it. Never writes past ``dest`` nor allocates
    by what the frame claims."""
    want = dest.nbytes
    if codec.name == "blosc":
        if len(src) < _BLOSC_HEADER:
            raise CodecError(f"it is {len(src)} bytes, shorter than a blosc header")
        nbytes = int.from_bytes(src[4:8], "little")
        cbytes = int.from_bytes(src[12:16], "little")
        if nbytes != want:
            raise CodecError(f"its blosc header announces {nbytes} bytes, the chunk has {want}")
        if cbytes != len(src):
            raise CodecError(
                f"its blosc header announces {cbytes} compressed bytes, the chunk holds {len(src)}"
            )
        from numcodecs import blosc

        try:
            blosc.decompress(src, dest)
        except Exception as exc:  # numcodecs raises RuntimeError (and others) for bad frames
            raise CodecError(f"blosc cannot decompress it ({exc})") from None
        return
    size = _zstd_content_size(src)
    if size != want:
        raise CodecError(f"its zstd frame announces {size} bytes, the chunk has {want}")
    from numcodecs import zstd

    try:
        out = zstd.decompress(src, dest)
    except Exception as exc:
        raise CodecError(f"zstd cannot decompress it ({exc})") from None
    if out is not None and not isinstance(out, np.ndarray) and len(out) != want:
        raise CodecError(f"it decompresses to {len(out)} bytes, the chunk has {want}")


#: the entry of a checkpoint's ``planner_data`` that says what ``compression="auto"`` decided and
#: why (:attr:`Compression.report`): ``decision`` (one line), ``tensors`` (why each tensor of
#: 1 MiB or more was left uncompressed, by FQN) and the figures the decision was made from. Its
#: name sorts after a tier part's record (``"gpuckpt.tier"``), which must lead the document
#: (:func:`~gpuckpt.format.documents.leading_planner_entry`)
COMPRESSION_KEY = "gpuckpt.why_compression"


def auto_report(planner_data: Any) -> tuple[str, dict[str, str]] | None:
    """``(decision, why by FQN)`` of the ``"auto"`` report in a checkpoint's ``planner_data``
    (None where it has none, or one that is not as gpuckpt writes it: the report only
    explains, so a damaged one is left out, never an error)."""
    r = planner_data.get(COMPRESSION_KEY) if isinstance(planner_data, dict) else None
    if not isinstance(r, dict) or not isinstance(r.get("decision"), str):
        return None
    tensors = r.get("tensors")
    if not isinstance(tensors, dict):
        tensors = {}
    return r["decision"], {k: v for k, v in tensors.items() if isinstance(k, str) and isinstance(v, str)}


@dataclass(frozen=True, slots=True)
class Compression:
    """A save's choice of compression (the ``compression`` save option), as pure data.

    ``codec`` is ``"blosc"`` (``cname``, ``level``, ``shuffle``, ``blocksize``) or ``"zstd"``
    (the core codec, ``level``). ``shuffle`` ``"auto"``: byte shuffle for elements of 2 bytes
    or more, bit shuffle for 1-byte elements (where a byte shuffle does nothing). ``auto``:
    compress only where it pays (:mod:`gpuckpt.saving.compression` decides, per tensor, and
    names those it leaves uncompressed in ``skip``, by FQN). ``device`` (``"zstd"`` only):
    the chunks of device arrays are compressed on their device where its back end can (nvCOMP),
    and only their compressed bytes cross to the host; the stored frames are the same codec's.
    """

    codec: str = "blosc"
    level: int = 1
    cname: str = "zstd"
    shuffle: str = "auto"
    blocksize: int = 1 << 20
    auto: bool = False
    skip: frozenset[str] = frozenset()
    #: "auto" found that nothing pays: every tensor is stored as it is, also those ``skip``
    #: cannot name (the tensors of which a distributed save's rank 0, which decides, holds no box)
    keep_all: bool = False
    device: bool = False
    #: what "auto" decided and why, as JSON values (kept in the checkpoint's ``planner_data``
    #: under :data:`COMPRESSION_KEY`; not part of the choice: equal choices may differ here)
    report: Any = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.codec not in ("blosc", "zstd"):
            raise ValueError(f"compression codec {self.codec!r} is not 'blosc' or 'zstd'")
        if type(self.device) is not bool:
            raise ValueError(f"compression device must be True or False, got {self.device!r}")
        if self.device and self.codec != "zstd":
            raise ValueError(
                "compression device=True needs {'codec': 'zstd'}: a device compresses into the core "
                "zstd codec's frames; blosc's shuffled frames are made on the host after staging"
            )
        self.codec_for("", np.dtype(np.float32), 0)  # raises ValueError for a bad combination

    def codec_for(self, fqn: str, dtype: np.dtype[Any], chunk_nbytes: int) -> Codec | None:
        """The codec of tensor ``fqn`` of ``dtype`` whose stored chunks hold ``chunk_nbytes`` bytes
        each (None: stored uncompressed: left out by "auto", an object dtype, or chunks larger
        than the codec's frame holds)."""
        if self.keep_all or fqn in self.skip or dtype.hasobject:
            return None
        if self.codec == "zstd":
            codec = Codec("zstd", self.level)
        else:
            shuffle = self.shuffle
            if shuffle == "auto":
                shuffle = "shuffle" if dtype.itemsize > 1 else "bitshuffle"
            codec = Codec("blosc", self.level, self.cname, shuffle, min(dtype.itemsize, 255), self.blocksize)
        return codec if codec.fits(chunk_nbytes) else None


#: the names the ``compression`` option takes: byte-shuffled zstd (the default choice), bit-shuffled
#: lz4 (faster, a little larger), and "auto" (byte-shuffled zstd where it pays)
PRESETS: dict[str, Compression] = {
    "zstd": Compression(),
    "lz4": Compression(level=5, cname="lz4", shuffle="bitshuffle"),
    "auto": Compression(auto=True),
}

_SPEC_KEYS = ("codec", "cname", "level", "shuffle", "blocksize", "auto", "device")


def parse_compression(value: Any) -> Compression | None:
    """The ``compression`` save option as a :class:`Compression` (None: no compression); raises
    ValueError naming what is wrong. ``value``: None, a name of :data:`PRESETS`, a
    :class:`Compression`, or a dict of some of ``codec`` ("blosc" or "zstd"), ``cname``,
    ``level``, ``shuffle`` ("shuffle", "bitshuffle", "noshuffle", "auto"), ``blocksize``,
    ``auto`` and ``device`` (the rest as in the "zstd" preset)."""
    if value is None or isinstance(value, Compression):
        return value
    if isinstance(value, str):
        preset = PRESETS.get(value)
        if preset is None:
            raise ValueError(f"compression={value!r} is not one of {', '.join(map(repr, PRESETS))}")
        return preset
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        unknown = sorted(set(value) - set(_SPEC_KEYS))
        if unknown:
            raise ValueError(f"compression has unknown keys {unknown}; expected some of {list(_SPEC_KEYS)}")
        spec = dict(value)
        if spec.get("codec", "blosc") == "zstd":
            blosc_only = sorted(set(spec) & {"cname", "shuffle", "blocksize"})
            if blosc_only:
                raise ValueError(
                    f"compression keys {blosc_only} apply to the blosc codec, not to 'zstd' (the core zstd "
                    "codec has a level only); drop them, or use {'codec': 'blosc', ...} to shuffle"
                )
            spec.setdefault("level", 3)
        if spec.get("shuffle", "auto") not in (*_SHUFFLES, "auto"):
            raise ValueError(f"compression shuffle {spec['shuffle']!r} is not one of {[*_SHUFFLES, 'auto']}")
        if type(spec.get("auto", False)) is not bool:
            raise ValueError(f"compression auto must be True or False, got {spec['auto']!r}")
        return Compression(**spec)
    raise ValueError(
        f"compression must be None, one of {', '.join(map(repr, PRESETS))}, or a dict such as "
        f"{{'codec': 'blosc', 'cname': 'zstd', 'level': 1, 'shuffle': 'shuffle'}}; got {value!r:.100}"
    )
