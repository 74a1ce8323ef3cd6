"""Converting checkpoints between gpuckpt, safetensors and PyTorch formats."""

from gpuckpt.convert.core import SOURCE_FORMATS, TARGET_FORMATS, ConvertResult, convert, detect_format
from gpuckpt.convert.safetensors_io import read_safetensors, write_safetensors

__all__ = [
    "SOURCE_FORMATS",
    "TARGET_FORMATS",
    "ConvertResult",
    "convert",
    "detect_format",
    "read_safetensors",
    "write_safetensors",
]
