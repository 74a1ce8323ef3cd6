"""The local file system back end: its writer, reader and root, direct I/O, the native
batches of small files and the copy-with-CRC."""
