"""What the bytes of a checkpoint mean: the metadata model, its JSON, the root and array
documents, chunk bytes and records, and the one reader of a root document
(:mod:`gpuckpt.format.reader`). The prose specification is ``docs/format.md``."""
