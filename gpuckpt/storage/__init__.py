"""Where the bytes of a checkpoint live: the stores that hold them (what the bytes mean is
:mod:`gpuckpt.format`).

The rest of gpuckpt uses :mod:`~gpuckpt.storage.stores` (open a writer or a
reader for a path or URL, join a save, tidy a directory of checkpoints) and
the interfaces of :mod:`~gpuckpt.storage.base`, never a back end directly.

What is where:

* where bytes hit the disk: :mod:`~gpuckpt.storage.local.writer` (a directory,
  published atomically; read by :mod:`~gpuckpt.storage.local.reader`),
  :mod:`~gpuckpt.storage.local.direct` (``O_DIRECT``
  writes), :mod:`~gpuckpt.storage.local.leftovers` (what crashed saves leave),
  :mod:`~gpuckpt.storage.local.fileio` and :mod:`~gpuckpt.storage.local.fsutil` (system
  calls), :mod:`~gpuckpt.storage.local.crccopy` (the native copy-with-checksum),
  :mod:`~gpuckpt.format.checksum` (CRC32C);
* object storage: :mod:`~gpuckpt.storage.s3.writer`.
"""
