"""Storage: the Zarr v3 layout, chunk bytes, safe object encoding and atomic commit."""
