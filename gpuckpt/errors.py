"""The errors gpuckpt raises.

Every error derives from :class:`GpuckptError` and also from the built-in
exception a caller would already catch for the same problem, so that
``except FileNotFoundError`` or ``except ValueError`` keep working.
Messages name the key, what was expected, what was found, and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "CheckpointCorruptedError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointTooLargeError",
    "CheckpointWriteError",
    "CoordinatorError",
    "DistributedError",
    "MissingDependencyError",
    "ChecksumError",
    "ChunkDecodeError",
    "DeviceUnavailableError",
    "GpuckptError",
    "InvalidOptionError",
    "TierBudgetError",
    "InvalidPathError",
    "MetadataError",
    "MissingChunkError",
    "MissingKeyError",
    "ReadOnlyTargetError",
    "ShapeMismatchError",
    "StepOrderError",
    "DTypeMismatchError",
    "UnsafeCheckpointError",
    "UnsupportedValueError",
    "UnsupportedVersionError",
    "StagingMemoryError",
    "StagingTimeoutError",
    "StoreError",
    "ForkedSaveError",
    "IncrementalBaseWarning",
]


class GpuckptError(Exception):
    """Root of every error gpuckpt raises."""


class CheckpointNotFoundError(GpuckptError, FileNotFoundError):
    """No committed checkpoint exists at the given path."""


class CheckpointExistsError(GpuckptError, FileExistsError):
    """A save would overwrite an existing checkpoint without ``overwrite=True``."""


class CheckpointWriteError(GpuckptError, OSError):
    """Writing a checkpoint failed (disk full, I/O error); ``errno`` is the system's."""


class StoreError(GpuckptError, OSError):
    """A request to a store (object storage) was refused or failed while reading or listing: the
    credentials (``errno.EACCES``), a bucket that does not exist (``errno.ENOENT``), the network
    or the server (``errno.EIO``). A failed write is a :class:`CheckpointWriteError`."""


class MetadataError(GpuckptError, ValueError):
    """The checkpoint's metadata is malformed or inconsistent."""


class UnsupportedVersionError(MetadataError):
    """The checkpoint was written by a newer, unknown format version."""


class CheckpointCorruptedError(GpuckptError, OSError):
    """Stored bytes do not match what the metadata promises."""


class ChecksumError(CheckpointCorruptedError):
    """A chunk's CRC32C checksum does not match its bytes.

    Attributes
    ----------
    fqn, key
        The tensor and its chunk's key (``c.1.0``); None when not given.
    computed
        The CRC32C of the chunk's bytes as read.
    stored
        The checksum stored with the chunk (the 4 bytes after its data).
    expected
        The checksum the checkpoint's metadata lists for the chunk.

    The three values are None when not given; they survive pickling (an error
    reported by another process keeps them).
    """

    def __init__(
        self,
        message: str,
        *,
        fqn: str | None = None,
        key: str | None = None,
        computed: int | None = None,
        stored: int | None = None,
        expected: int | None = None,
    ) -> None:
        super().__init__(message)
        self.fqn = fqn
        self.key = key
        self.computed = computed
        self.stored = stored
        self.expected = expected

    @property
    def mismatch(self) -> str:
        """What disagrees, in words, from the fields (``""`` when they were not given)."""
        if self.computed is None or self.stored is None or self.expected is None:
            return ""
        what = (
            "its bytes do not match their checksum"
            if self.computed != self.stored
            else "it is a valid chunk but not the one the metadata lists"
        )
        return (
            f"{what}: computed {self.computed:#010x}, chunk file {self.stored:#010x}, "
            f"metadata {self.expected:#010x}"
        )


class ChunkDecodeError(CheckpointCorruptedError):
    """A compressed chunk matches its checksum but does not decompress to its chunk's bytes
    (a frame that announces another size, or does not decode): a hostile or miswritten chunk.

    Attributes ``fqn`` and ``key`` name the tensor and its chunk."""

    def __init__(self, message: str, *, fqn: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.fqn = fqn
        self.key = key


class MissingChunkError(CheckpointCorruptedError):
    """A chunk the metadata lists is absent from the store."""


class CheckpointTooLargeError(GpuckptError, MemoryError):
    """Memory for a tensor of the checkpoint cannot be allocated."""


class MissingKeyError(GpuckptError, KeyError):
    """A key of the state dict is absent from the checkpoint (``strict=True``)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(GpuckptError, ValueError):
    """A target array's shape differs from the stored tensor's shape."""


class DTypeMismatchError(GpuckptError, TypeError):
    """A target array's dtype differs from the stored tensor's dtype."""


class StepOrderError(GpuckptError, ValueError):
    """A :class:`~gpuckpt.CheckpointManager` save of a step older than a committed step."""


class ReadOnlyTargetError(GpuckptError, ValueError):
    """A target array of a load in place cannot be written (read-only NumPy array or memmap)."""


class UnsupportedValueError(GpuckptError, TypeError):
    """A value in the state dict cannot be stored safely."""


class UnsafeCheckpointError(GpuckptError, PermissionError):
    """Loading would need an unsafe operation (pickle) that was not allowed."""


class DeviceUnavailableError(GpuckptError, RuntimeError):
    """A GPU feature was used without CuPy or without a usable device."""


class MissingDependencyError(GpuckptError, ImportError):
    """An optional dependency (mpi4py, torch) is needed for the feature that was used."""


class InvalidOptionError(GpuckptError, ValueError, TypeError):
    """An option of a save or a load has a wrong type or value (caught as ValueError or TypeError)."""


class TierBudgetError(InvalidOptionError):
    """A node's local tier cannot hold ``local_max_to_keep`` steps of its parts and replicas."""


class InvalidPathError(GpuckptError, ValueError, TypeError):
    """A checkpoint path or URL is of a wrong type, empty, or of a scheme gpuckpt has no store for
    (caught as ValueError or TypeError)."""


class CoordinatorError(GpuckptError, RuntimeError):
    """A coordinator cannot be set up, or a collective was called against its discipline."""


class DistributedError(GpuckptError, RuntimeError):
    """One or more ranks failed a collective step; raised on every rank.

    Attributes
    ----------
    failures
        Rank -> ``"TypeName: message"`` of the error that rank reported.
    """

    failures: dict[int, str]

    def __init__(self, failures: Mapping[int, str], world_size: int | None = None) -> None:
        self.failures = {int(r): str(m) for r, m in sorted(failures.items())}
        self.world_size = world_size
        of = f" (of {world_size})" if world_size is not None else ""
        if len(self.failures) == 1:
            ((rank, report),) = self.failures.items()
            message = f"rank {rank}{of} failed: {report}"
        else:
            details = "; ".join(f"rank {r}: {m}" for r, m in self.failures.items())
            message = f"{len(self.failures)} ranks{of} failed: {details}"
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.failures, self.world_size))


class StagingMemoryError(GpuckptError, MemoryError):
    """Staging memory for a snapshot cannot be allocated (memory or address space limit)."""


class StagingTimeoutError(GpuckptError, TimeoutError):
    """No staging memory became free: within the timeout, or ever (no save in flight holds it)."""


class ForkedSaveError(GpuckptError, RuntimeError):
    """A background save was started by the parent of a ``fork()``; it completes there only."""


class IncrementalBaseWarning(UserWarning):
    """The ``base`` of an incremental save cannot be used (missing, damaged, another format):
    the save goes on and writes every chunk; some of its chunk files are not as its records
    describe (the save writes those in full and names the first); or chunks cannot be hashed (``base`` or
    ``content_hash=True`` without the ``xxhash`` package): the save records no hashes. A
    warning, not an error: the save succeeds."""
