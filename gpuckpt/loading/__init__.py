"""A load, from a checkpoint's path to the caller's arrays: opening it (:mod:`~gpuckpt.loading.open`),
checking its chunk files (:mod:`~gpuckpt.loading.checks`), reading whole tensors
(:mod:`~gpuckpt.loading.chunk_reads`) and ranges of them (:mod:`~gpuckpt.loading.ranged`)."""
