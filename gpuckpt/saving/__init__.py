"""A save, from the caller's state to a published checkpoint: the sources it reads
(:mod:`~gpuckpt.saving.sources`), the one save session (:mod:`~gpuckpt.saving.session`),
the chunk writes (:mod:`~gpuckpt.saving.writing`), the chunks an earlier checkpoint serves
(:mod:`~gpuckpt.saving.reuse`, :mod:`~gpuckpt.saving.incremental`) and the commit
(:mod:`~gpuckpt.saving.commit`)."""
