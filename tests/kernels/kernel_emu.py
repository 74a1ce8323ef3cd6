"""Build and drive the CPU emulation of the channels-last kernels.

``kernels/emu/emu_driver.cpp`` includes ``kernels/channels_last.cu`` unchanged
under the emulation header; g++ turns it into a shared library that this
module loads with ctypes.  Launches use the same :func:`plan_box_copy` plans
as the CuPy path, so the planner is tested together with the kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # source checkout without an install
    sys.path.insert(0, str(REPO_ROOT))

from gpuckpt.device import _kernel_ref as ref  # noqa: E402
from gpuckpt.device.kernels import (  # noqa: E402
    MAX_GRID,
    BoxCopyPlan,
    kernel_source_dir,
    normalize_box,
    plan_box_copy,
)

ORDERS = {"forward": 0, "reverse": 1, "random": 2}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
GUARD = 64  # guard elements on each side of every destination buffer

# Status codes of gpuckpt_emu_launch (see cuda_emu.h).
EMU_OK = 0
EMU_BARRIER_DIVERGENCE = 1


def gxx() -> str | None:
    """Path of g++, or None."""
    return shutil.which(os.environ.get("CXX", "g++"))


@dataclass(frozen=True)
class Variant:
    """One build of the emulation library."""

    name: str
    defines: tuple[str, ...] = ()
    sanitize: str | None = None  # "address,undefined" or "thread"

    @property
    def os_threads(self) -> bool:
        return self.sanitize == "thread"


PLAIN = Variant("plain")
BROKEN_SYNC = Variant("break_sync", ("GPUCKPT_BREAK_SYNC",))
BROKEN_DIVERGENCE = Variant("break_divergence", ("GPUCKPT_BREAK_DIVERGENCE",))
ASAN = Variant("asan", sanitize="address,undefined")
ASAN_BROKEN_BOUNDS = Variant("asan_break_bounds", ("GPUCKPT_BREAK_BOUNDS",), "address,undefined")
ASAN_BROKEN_INDEX32 = Variant("asan_break_index32", ("GPUCKPT_BREAK_INDEX32",), "address,undefined")
TSAN = Variant("tsan", sanitize="thread")
TSAN_BROKEN_SYNC = Variant("tsan_break_sync", ("GPUCKPT_BREAK_SYNC",), "thread")
TSAN_BROKEN_DIVERGENCE = Variant("tsan_break_divergence", ("GPUCKPT_BREAK_DIVERGENCE",), "thread")
ALL_VARIANTS = (
    PLAIN,
    BROKEN_SYNC,
    BROKEN_DIVERGENCE,
    ASAN,
    ASAN_BROKEN_BOUNDS,
    ASAN_BROKEN_INDEX32,
    TSAN,
    TSAN_BROKEN_SYNC,
    TSAN_BROKEN_DIVERGENCE,
)


def build_command(variant: Variant, output: Path) -> list[str]:
    """g++ command line that builds ``variant`` into ``output``."""
    compiler = gxx()
    if compiler is None:
        raise FileNotFoundError("g++ not found")
    src = kernel_source_dir() / "emu" / "emu_driver.cpp"
    cmd = [
        compiler,
        "-std=c++20",
        "-fPIC",
        "-shared",
        "-g",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-Wno-unknown-pragmas",  # '#pragma unroll' is for nvcc
    ]
    cmd += [f"-D{d}" for d in variant.defines]
    if variant.sanitize is None:
        cmd.append("-O2")
    else:
        cmd += ["-O1", "-fno-omit-frame-pointer", f"-fsanitize={variant.sanitize}"]
        if "undefined" in variant.sanitize:
            cmd.append("-fno-sanitize-recover=all")
        if variant.os_threads:
            cmd.append("-DGPUCKPT_EMU_OS_THREADS")
    cmd += [str(src), "-o", str(output)]
    return cmd


def source_digest() -> str:
    """Hash of the sources a build depends on (for cache names)."""
    digest = hashlib.sha256()
    folder = kernel_source_dir()
    for path in sorted([folder / "channels_last.cu", *sorted((folder / "emu").iterdir())]):
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def build(variant: Variant, out_dir: Path) -> Path:
    """Build ``variant`` into ``out_dir`` (once) and return the library path."""
    output = out_dir / f"libgkemu_{variant.name}_{source_digest()}.so"
    if not output.exists():
        tmp = output.with_suffix(".tmp.so")
        proc = subprocess.run(build_command(variant, tmp), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building {variant.name} failed:\n{proc.stderr}")
        tmp.replace(output)
    return output


class EmuLibrary:
    """ctypes wrapper around one built emulation library."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._lib.gpuckpt_emu_set_order.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
        self._lib.gpuckpt_emu_set_order.restype = ctypes.c_int
        self._lib.gpuckpt_emu_launch.argtypes = [
            ctypes.c_char_p,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_longlong,
            ctypes.c_longlong,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_longlong),
            ctypes.c_int,
            ctypes.c_int,
        ]
        self._lib.gpuckpt_emu_launch.restype = ctypes.c_int

    def set_order(self, order: str, seed: int = 0) -> None:
        rc = self._lib.gpuckpt_emu_set_order(ORDERS[order], seed)
        assert rc == 0, rc

    def launch(
        self,
        plan: BoxCopyPlan,
        to_channels_last: bool,
        src_ptr: int,
        dst_ptr: int,
        first: int = 0,
        last: int = -1,
    ) -> int:
        """Run the kernel for ``plan``; returns the emulator status."""
        params = (ctypes.c_longlong * 14)(*plan.params())
        return int(
            self._lib.gpuckpt_emu_launch(
                plan.kernel_name(to_channels_last).encode(),
                *plan.grid,
                plan.block[0],
                first,
                last,
                src_ptr,
                dst_ptr,
                params,
                plan.log_tc,
                plan.log_tq,
            )
        )


class EmuError(AssertionError):
    """The emulator reported an error (e.g. barrier divergence)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"emulated launch failed with status {status}")
        self.status = status


def _guarded(n: int, dtype: Any, fill: int) -> tuple[np.ndarray, np.ndarray]:
    """A flat buffer of n elements between guard regions; returns (whole, inner)."""
    whole = np.full(n + 2 * GUARD, fill, dtype=dtype)
    return whole, whole[GUARD : GUARD + n]


def _check_guards(whole: np.ndarray, fill: int) -> None:
    head, tail = whole[:GUARD], whole[-GUARD:]
    if not ((head == fill).all() and (tail == fill).all()):
        raise AssertionError("kernel wrote outside the destination buffer")


def random_channels_last(shape: tuple[int, ...], itemsize: int, seed: int) -> np.ndarray:
    """A channels-last array of random unsigned integers of ``itemsize``."""
    rng = np.random.default_rng(seed)
    dtype = UINT[itemsize]
    logical = rng.integers(0, np.iinfo(dtype).max, size=shape, dtype=dtype, endpoint=True)
    return ref.as_channels_last(logical)


def emu_to_contiguous(
    lib: EmuLibrary,
    src: np.ndarray,
    box: Any = None,
    *,
    order: str = "forward",
    seed: int = 0,
    grid_limit: tuple[int, int, int] = MAX_GRID,
) -> np.ndarray:
    """Channels-last ``src`` -> logical block, through the emulated kernel."""
    offsets, sizes = normalize_box(box, src.shape)
    plan = plan_box_copy(src.shape, offsets, sizes, src.itemsize, grid_limit=grid_limit)
    fill = np.iinfo(src.dtype).max // 3
    whole, inner = _guarded(int(np.prod(sizes)), src.dtype, fill)
    out = inner.reshape(sizes)
    if not plan.empty:
        lib.set_order(order, seed)
        status = lib.launch(plan, False, src.ctypes.data, out.ctypes.data)
        if status != EMU_OK:
            raise EmuError(status)
    _check_guards(whole, fill)
    return out


def emu_to_channels_last(
    lib: EmuLibrary,
    src: np.ndarray,
    dst: np.ndarray,
    box: Any = None,
    *,
    order: str = "forward",
    seed: int = 0,
    grid_limit: tuple[int, int, int] = MAX_GRID,
) -> np.ndarray:
    """Logical block ``src`` -> box of channels-last ``dst`` (a guarded copy
    of it is written and returned; ``dst`` itself is left alone)."""
    offsets, sizes = normalize_box(box, dst.shape)
    plan = plan_box_copy(dst.shape, offsets, sizes, dst.itemsize, grid_limit=grid_limit)
    fill = np.iinfo(dst.dtype).max // 3
    physical_shape = (dst.shape[0], *dst.shape[2:], dst.shape[1])
    whole, inner = _guarded(int(np.prod(dst.shape)), dst.dtype, fill)
    target = np.moveaxis(inner.reshape(physical_shape), -1, 1)
    target[...] = dst
    src = np.ascontiguousarray(src)
    if not plan.empty:
        lib.set_order(order, seed)
        status = lib.launch(plan, True, src.ctypes.data, target.ctypes.data)
        if status != EMU_OK:
            raise EmuError(status)
    _check_guards(whole, fill)
    return target


def check_case(
    lib: EmuLibrary,
    shape: tuple[int, ...],
    itemsize: int,
    box: Any = None,
    *,
    to_channels_last: bool,
    order: str = "forward",
    seed: int = 0,
    grid_limit: tuple[int, int, int] = MAX_GRID,
) -> None:
    """Run one case through the emulation and compare with the NumPy reference."""
    src_cl = random_channels_last(shape, itemsize, seed)
    if not to_channels_last:
        got = emu_to_contiguous(lib, src_cl, box, order=order, seed=seed, grid_limit=grid_limit)
        want = ref.channels_last_to_contiguous(src_cl, box=box)
    else:
        _, sizes = normalize_box(box, shape)
        block = random_channels_last((sizes[0], sizes[1], *sizes[2:]), itemsize, seed + 1)
        block = np.ascontiguousarray(block)
        got = emu_to_channels_last(lib, block, src_cl, box, order=order, seed=seed, grid_limit=grid_limit)
        want = ref.contiguous_to_channels_last(block, src_cl.copy(order="K"), box=box)
    if not np.array_equal(got, want):
        bad = np.argwhere(got != want)
        raise AssertionError(
            f"mismatch for shape {shape} itemsize {itemsize} box {box} "
            f"to_channels_last={to_channels_last} order={order}: {len(bad)} elements differ, "
            f"first at {tuple(bad[0])}"
        )


# --------------------------------------------------------------------------
# Tensors over 2**31 elements: only the far end is touched.

MAP_NORESERVE = 0x4000  # Linux; the mmap module does not export it


def _virtual_buffer(nbytes: int) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    return mmap.mmap(-1, nbytes, flags=flags)


def _address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def check_huge_tail(
    lib: EmuLibrary, shape: tuple[int, ...], itemsize: int, *, to_channels_last: bool, nblocks: int
) -> int:
    """Run the last ``nblocks`` blocks of a whole-tensor copy of a huge tensor.

    The buffers are reserved, not committed: only the pages the last blocks
    touch ever get memory.  Returns the largest element offset checked.
    """
    n = int(np.prod(shape))
    plan = plan_box_copy(shape, (0,) * len(shape), shape, itemsize)
    assert plan.grid == plan.tiles, "the huge case assumes one tile per block"
    total = plan.grid[0] * plan.grid[1] * plan.grid[2]
    dtype = UINT[itemsize]
    cl_buf, cf_buf = _virtual_buffer(n * itemsize), _virtual_buffer(n * itemsize)
    cl_mem = np.frombuffer(cl_buf, dtype=dtype)
    cf_mem = np.frombuffer(cf_buf, dtype=dtype)
    nb, ch = shape[0], shape[1]
    run = n // (nb * ch)
    cl = cl_mem.reshape(nb, run, ch)  # [N][spatial][C]
    cf = cf_mem.reshape(nb, ch, run)  # [N][C][spatial]
    tq, tc = 1 << plan.log_tq, 1 << plan.log_tc
    regions = []
    gx, gy = plan.grid[0], plan.grid[1]
    for b in range(total - nblocks, total):
        qt, ct, line = b % gx, (b // gx) % gy, b // (gx * gy)
        q0, c0 = qt * tq, ct * tc
        q1, c1 = min(q0 + tq, run), min(c0 + tc, ch)
        regions.append((line, q0, q1, c0, c1))
        q = np.arange(q0, q1, dtype=np.int64)[:, None]
        c = np.arange(c0, c1, dtype=np.int64)[None, :]
        pattern = ((q * 31 + c * 7) % 251 + 1).astype(dtype)  # never 0
        if to_channels_last:
            cf[line, c0:c1, q0:q1] = pattern.T
        else:
            cl[line, q0:q1, c0:c1] = pattern
    src, dst = (cf_buf, cl_buf) if to_channels_last else (cl_buf, cf_buf)
    status = lib.launch(plan, to_channels_last, _address(src), _address(dst), total - nblocks, total)
    if status != EMU_OK:
        raise EmuError(status)
    top = 0
    for line, q0, q1, c0, c1 in regions:
        q = np.arange(q0, q1, dtype=np.int64)[:, None]
        c = np.arange(c0, c1, dtype=np.int64)[None, :]
        pattern = ((q * 31 + c * 7) % 251 + 1).astype(dtype)
        got = cl[line, q0:q1, c0:c1] if to_channels_last else cf[line, c0:c1, q0:q1].T
        if not np.array_equal(got, pattern):
            raise AssertionError(f"huge tensor: wrong values in block region {(line, q0, q1, c0, c1)}")
        top = max(top, line * run * ch + (q1 - 1) * ch + c1 - 1)
    del cl, cf, cl_mem, cf_mem, got
    cl_buf.close()
    cf_buf.close()
    return top


# --------------------------------------------------------------------------
# Sanitizer runs in a subprocess (the runtime must be preloaded into Python)


def sanitizer_runtime(sanitize: str) -> list[str]:
    """Shared runtimes to LD_PRELOAD for a sanitizer build."""
    compiler = gxx()
    assert compiler is not None
    names = ["libtsan.so"] if sanitize == "thread" else ["libasan.so", "libubsan.so"]
    paths = []
    for name in names:
        out = subprocess.run(
            [compiler, f"-print-file-name={name}"], capture_output=True, text=True
        ).stdout.strip()
        if not os.path.isabs(out) or not os.path.exists(out):
            raise FileNotFoundError(f"{name} not found for {compiler}")
        paths.append(os.path.realpath(out))
    return paths


def run_sanitized(
    library: Path, sanitize: str, cases: list[dict[str, Any]], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``cases`` (see kernel_emu_runner.py) against a sanitizer build."""
    import json

    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(sanitizer_runtime(sanitize))
    env["ASAN_OPTIONS"] = "detect_leaks=0:halt_on_error=1:exitcode=86"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1:exitcode=87"
    env["TSAN_OPTIONS"] = "halt_on_error=1:exitcode=88:report_signal_unsafe=0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    runner = Path(__file__).with_name("kernel_emu_runner.py")
    return subprocess.run(
        [sys.executable, str(runner), str(library), json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
