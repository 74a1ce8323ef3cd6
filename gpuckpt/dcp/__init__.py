"""gpuckpt as the storage layer of ``torch.distributed.checkpoint`` (DCP).

``Writer`` and ``Reader`` are DCP's ``StorageWriter`` and ``StorageReader``;
``Stager`` is the ``AsyncStager`` of ``dcp.async_save``. Importing this
package imports torch (``import gpuckpt`` alone never does); without torch it
raises ``ImportError`` with an install hint.
"""

# first: without torch, the ImportError with its install hint comes from here
from gpuckpt.dcp.tensors import torch as _torch  # noqa: F401, I001
from gpuckpt.dcp.reader import Reader
from gpuckpt.dcp.stager import Stager, StagingTimeoutError
from gpuckpt.dcp.writer import Writer

__all__ = ["Reader", "Stager", "StagingTimeoutError", "Writer"]
