"""gpuckpt: GPU-aware checkpoints of model state in Zarr v3 stores."""

from importlib import metadata as _metadata

from gpuckpt.api import load, load_state_dict, read_metadata, save
from gpuckpt.background import SaveFuture, async_save
from gpuckpt.device.sharded import ShardedArray
from gpuckpt.errors import (
    CheckpointCorruptedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointTooLargeError,
    CheckpointWriteError,
    ChecksumError,
    ChunkDecodeError,
    CoordinatorError,
    DeviceUnavailableError,
    DistributedError,
    DTypeMismatchError,
    GpuckptError,
    InvalidOptionError,
    InvalidPathError,
    MetadataError,
    MissingChunkError,
    MissingKeyError,
    ReadOnlyTargetError,
    ShapeMismatchError,
    StepOrderError,
    StoreError,
    TierBudgetError,
    UnsafeCheckpointError,
    UnsupportedValueError,
    UnsupportedVersionError,
)
from gpuckpt.format.dtypes import get_default_dtype, set_default_dtype
from gpuckpt.format.memory_format import (
    channels_last,
    channels_last_3d,
    contiguous_format,
    preserve_format,
    strided,
)
from gpuckpt.format.metadata import (
    STATE_DICT_TYPE,
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from gpuckpt.manager import CheckpointManager

try:
    __version__ = _metadata.version("gpuckpt")  # one source: the version the package was installed as
except _metadata.PackageNotFoundError:  # a source tree used without installing it
    __version__ = "0+unknown"

__all__ = [
    "STATE_DICT_TYPE",
    "STORAGE_TYPES",
    "BytesStorageMetadata",
    "CheckpointManager",
    "CheckpointCorruptedError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointTooLargeError",
    "CheckpointWriteError",
    "ChecksumError",
    "ChunkDecodeError",
    "ChunkStorageMetadata",
    "DTypeMismatchError",
    "CoordinatorError",
    "DeviceUnavailableError",
    "DistributedError",
    "GpuckptError",
    "InvalidOptionError",
    "TierBudgetError",
    "InvalidPathError",
    "Metadata",
    "MetadataError",
    "MetadataIndex",
    "MissingChunkError",
    "MissingKeyError",
    "ReadOnlyTargetError",
    "SaveFuture",
    "ShardedArray",
    "ShapeMismatchError",
    "StepOrderError",
    "StoreError",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "UnsafeCheckpointError",
    "UnsupportedValueError",
    "UnsupportedVersionError",
    "async_save",
    "channels_last",
    "channels_last_3d",
    "contiguous_format",
    "get_default_dtype",
    "load",
    "load_state_dict",
    "preserve_format",
    "read_metadata",
    "save",
    "set_default_dtype",
    "strided",
]
