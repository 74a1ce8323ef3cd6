"""A few kernel launches on the GPU, checked against NumPy; run under
``compute-sanitizer`` by test_kernels_gpu.py.

Usage: ``python kernel_gpu_runner.py [--broken-sync]``

``--broken-sync`` builds the tiled kernels without the tile barrier, which
racecheck must report.  Exit status 0 when every result matched.  The cases
cover both kernel paths (tiled for many channels, pixel for 1 to 8), with
aligned and misaligned buffers and boxes.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
if str(Path(__file__).resolve().parent) not in sys.path:  # mutants.py
    sys.path.insert(0, str(Path(__file__).resolve().parent))


def to_device_channels_last(host):  # type: ignore[no-untyped-def]
    """Copy a channels-last NumPy array to the device, keeping its layout."""
    import cupy
    import numpy as np

    physical = cupy.asarray(np.ascontiguousarray(np.moveaxis(host, 1, -1)))
    return physical.transpose(0, host.ndim - 1, *range(1, host.ndim - 1))


def main(argv: list[str]) -> int:
    import cupy
    import numpy as np

    from gpuckpt.device import _kernel_ref as ref
    from gpuckpt.device import kernels as K

    broken = "--broken-sync" in argv
    if broken:
        # Route every tiled launch through the broken module.
        from mutants import mutated_source

        module = cupy.RawModule(
            code=mutated_source(["sync"]), options=("-std=c++17", *K.module_part_options("tiled"))
        )
        module.compile()
        K._modules[(cupy.cuda.Device().id, (), "tiled")] = module

    rng = np.random.default_rng(0)
    cases = [
        ((2, 3, 17, 9), np.float32, None),
        ((1, 70, 5, 6), np.uint8, ((0, 3, 1, 0), (1, 60, 3, 6))),
        ((2, 5, 3, 4, 6), np.float16, ((1, 1, 0, 1, 2), (1, 3, 3, 2, 4))),
        ((1, 2048, 2, 3), np.float64, None),
        ((2, 17, 9, 9), np.float32, None),  # tiled, barriers
        ((2, 64, 9, 16), np.uint8, ((0, 16, 0, 0), (2, 32, 9, 16))),  # micro-tile
        ((2, 64, 7, 7), np.float32, None),  # micro-tile, 4-byte units
        ((2, 3, 64, 64), np.uint8, None),  # pixel, 16-byte units
        ((2, 4, 33, 31), np.float16, None),  # pixel, element-wise planes
        ((1, 8, 5, 30, 17), np.float64, ((0, 2, 1, 0, 0), (1, 5, 3, 30, 17))),  # pixel, some channels
    ]
    ok = True
    for shape, dtype, box in cases:
        logical = rng.integers(0, 100, size=shape).astype(dtype)
        host = ref.as_channels_last(logical)
        dev = to_device_channels_last(host)
        got = K.channels_last_to_contiguous(dev, box=box).get()
        ok &= bool(np.array_equal(got, ref.channels_last_to_contiguous(host, box=box)))
        target = to_device_channels_last(ref.as_channels_last(np.zeros(shape, dtype)))
        block = cupy.asarray(ref.channels_last_to_contiguous(host, box=box))
        K.contiguous_to_channels_last(block, target, box=box)
        want = ref.contiguous_to_channels_last(
            np.ascontiguousarray(block.get()), ref.as_channels_last(np.zeros(shape, dtype)), box=box
        )
        ok &= bool(np.array_equal(target.get(), want))
    cupy.cuda.Device().synchronize()
    print("results match" if ok else "results differ")
    return 0 if ok or broken else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
