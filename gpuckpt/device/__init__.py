"""Device: array adapters, memory targets, staging and kernels."""
