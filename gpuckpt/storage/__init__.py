"""Where the bytes of a checkpoint live: layout, encoding, and the stores that hold them.

The rest of gpuckpt uses :mod:`~gpuckpt.storage.stores` (open a writer or a
reader for a path or URL, join a save, tidy a directory of checkpoints) and
the interfaces of :mod:`~gpuckpt.storage.base`, never a back end directly.

What is where:

* what is written: :mod:`~gpuckpt.storage.layout` (the Zarr documents),
  :mod:`~gpuckpt.storage.names` (array names from FQNs),
  :mod:`~gpuckpt.storage.chunks` (a chunk's stored bytes),
  :mod:`~gpuckpt.storage.checksum` (CRC32C), :mod:`~gpuckpt.storage.values`
  (plain values as tagged JSON), :mod:`~gpuckpt.storage.zarr_dtypes` (the
  zarr plug-in for bfloat16 and the float8 types);
* where bytes hit the disk: :mod:`~gpuckpt.storage.local` (a directory,
  published atomically; read by :mod:`~gpuckpt.storage.local_reader`),
  :mod:`~gpuckpt.storage.direct` (``O_DIRECT``
  writes), :mod:`~gpuckpt.storage.leftovers` (what crashed saves leave),
  :mod:`~gpuckpt.storage.fileio` and :mod:`~gpuckpt.storage.fsutil` (system
  calls), :mod:`~gpuckpt.storage.crccopy` (the native copy-with-checksum);
* object storage: :mod:`~gpuckpt.storage.s3`.
"""
