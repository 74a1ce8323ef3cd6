"""The summary of one GPU check (``bench/gpu_check.sh``): JSON plus a table.

The logic lives in the package (:mod:`gpuckpt.cli.gpu_summary`, also behind
``gpuckpt bench --device``); this script runs it. Usage::

    python bench/gpu_summary.py --kernels OUT/bench_kernels.json --gpu OUT/bench_gpu.json \\
        --step gpu-tests=ok ... --commit SHA --out OUT/<date>-summary.json
    python bench/gpu_summary.py --format-test --out DIR/<date>-summary.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a source checkout without an install

from gpuckpt.cli.gpu_summary import (
    FORMAT,
    build_summary,
    fake_inputs,
    kernel_row_misses,
    main,
    render_table,
)

__all__ = ["FORMAT", "build_summary", "fake_inputs", "kernel_row_misses", "main", "render_table"]

if __name__ == "__main__":
    sys.exit(main())
