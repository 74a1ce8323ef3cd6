"""The S3 back end: its writer, reader and root, the client, ranged reads, the prefix layout
and the claim protocol."""
