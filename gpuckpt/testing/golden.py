"""The state behind the golden checkpoints in ``tests/fixtures/``.

``python -m gpuckpt.testing.golden DIR [--chunk-table | --columns]`` writes a
checkpoint of :func:`golden_state` with the current code. The committed copies
under ``tests/fixtures/format-v1`` (written by format version 1),
``tests/fixtures/format-v2`` (format version 2, its chunk records in a chunk
table, as large checkpoints keep them) and ``tests/fixtures/format-v3`` (format
version 3, its tensor entries in columns too, as checkpoints of many tensors keep
them) are loaded by every test run and
compared with :func:`golden_state`, so a change that would make old
checkpoints unreadable (format drift) fails loudly.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from gpuckpt.format.dtypes import dtype_from_name
from gpuckpt.testing.states import ALL_DTYPE_NAMES


def golden_state() -> dict[str, Any]:
    """Deterministic values of every dtype, layouts, nesting and plain values."""
    tensors: dict[str, Any] = {}
    for i, name in enumerate(ALL_DTYPE_NAMES):
        dt = dtype_from_name(name)
        raw = (np.arange(3 * 5 * dt.itemsize, dtype=np.uint64) * (2 * i + 7) % 251).astype(np.uint8)
        a = raw.view(dt).reshape(3, 5)
        if dt == np.bool_:
            a = (raw[:15] % 2).astype(np.bool_).reshape(3, 5)
        tensors[name] = a
    base = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 4, 5, 3)
    return {
        "dtypes": tensors,
        "layouts": {
            "channels_last": base.transpose(0, 3, 1, 2),
            "channels_last_3d": np.arange(2 * 3 * 2 * 2 * 2, dtype=np.int16)
            .reshape(2, 2, 2, 2, 3)
            .transpose(0, 4, 1, 2, 3),
            "fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
            "scalar": np.array(3.25),
            "empty": np.zeros((0, 4), np.int32),
            "chunked": np.arange(1000, dtype=np.int64).reshape(100, 10),
        },
        "layers": [{"w": np.full((2, 2), i, np.float16)} for i in range(2)],
        "plain": {
            "step": 42,
            "lr": 0.001,
            "betas": (0.9, 0.999),
            "name": "golden",
            "blob": b"\x00\xff",
            "none": None,
            "big": 2**80,
            "np": np.float32(1.5),
            3: "int key",
        },
    }


def main(argv: list[str]) -> int:
    """``DIR``: a checkpoint of :func:`golden_state`; ``DIR --chunk-table``: the same with its
    per-chunk records in a chunk table, as large checkpoints of format version 2 keep them;
    ``DIR --columns``: also its tensor entries in columns, as format version 3 keeps them."""
    import gpuckpt
    from gpuckpt.saving import commit

    if "--columns" in argv[1:]:
        commit.COLUMNS_MIN_TENSORS = 1  # this process writes only the fixture: the switch is global
    elif "--chunk-table" not in argv[1:]:
        gpuckpt.save(golden_state(), argv[0], chunk_bytes=512)
        return 0
    from gpuckpt.options import SaveOptions
    from gpuckpt.planning.plan import plan_save
    from gpuckpt.saving.session import execute_save
    from gpuckpt.saving.sources import describe_state
    from gpuckpt.saving.writing import open_save_writer

    options = SaveOptions(chunk_bytes=512)
    local, sources = describe_state(golden_state(), allow_pickle=False)
    plan = plan_save([local], chunk_bytes=options.chunk_bytes)
    writer = open_save_writer(argv[0], options, expected_files=plan.nfiles, direct_io=False)
    name = "golden-v3" if "--columns" in argv[1:] else "golden-v2"
    execute_save(plan, sources, writer, options, checkpoint_id=name, table=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
