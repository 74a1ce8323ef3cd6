"""Build and drive the CPU emulation of the channels-last kernels.

``kernels/emu/emu_driver.cpp`` includes ``kernels/channels_last.cu`` unchanged
under the emulation header; g++ turns it into a shared library that this
module loads with ctypes.  Launches use the same :func:`plan_box_copy` plans
as the CuPy path, so the planner (and its choice of kernel path) is tested
together with the kernels.
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
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # mutants.py, also where this module runs in a child process
    sys.path.insert(0, str(HERE))

from gpuckpt.device import _kernel_ref as ref  # noqa: E402
from gpuckpt.device.kernels import (  # noqa: E402
    MAX_GRID,
    THREADS_PER_BLOCK,
    BoxCopyPlan,
    kernel_source_dir,
    micro_positions_per_thread,
    normalize_box,
    pixel_positions_per_thread,
    plan_box_copy,
)

ORDERS = {"forward": 0, "reverse": 1, "random": 2}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
GUARD = 64  # guard elements on each side of every destination buffer

# Status codes of gpuckpt_emu_launch (see cuda_emu.h).
EMU_OK = 0
EMU_BARRIER_DIVERGENCE = 1
EMU_UNKNOWN_KERNEL = 3
ALIGN = 64  # bytes: every buffer starts `misalign` elements past such a boundary


def gxx() -> str | None:
    """Path of g++, or None."""
    return shutil.which(os.environ.get("CXX", "g++"))


@dataclass(frozen=True)
class Variant:
    """One build of the emulation library: ``mutants`` (see tests/kernels/mutants.py) applied
    to the kernel source, ``defines`` given to the compiler."""

    name: str
    defines: tuple[str, ...] = ()
    sanitize: str | None = None  # "address,undefined" or "thread"
    mutants: tuple[str, ...] = ()

    @property
    def os_threads(self) -> bool:
        return self.sanitize == "thread"


# Builds that break something compile only the kernels the break is about
# (GK_BUILD_* in channels_last.cu): the pixel and micro-tile paths have no
# barrier, the tiled path no slots; that keeps the builds short.
TILED_ONLY = ("GK_BUILD_PX_SIZES=0", "GK_BUILD_MICRO=0")
PIXEL_ONLY = ("GK_BUILD_TILED=0",)  # and the micro-tile kernels

PLAIN = Variant("plain")
BROKEN_SYNC = Variant("break_sync", TILED_ONLY, mutants=("sync",))
BROKEN_DIVERGENCE = Variant("break_divergence", TILED_ONLY, mutants=("divergence",))
BROKEN_PX_SLOTS = Variant("break_px_slots", (*PIXEL_ONLY, "GK_BUILD_PX_SIZES=4"), mutants=("px_slots",))
ASAN = Variant("asan", sanitize="address,undefined")
ASAN_BROKEN_BOUNDS = Variant("asan_break_bounds", ("GK_BUILD_PX_SIZES=4",), "address,undefined", ("bounds",))
ASAN_BROKEN_INDEX32 = Variant(
    "asan_break_index32", ("GK_BUILD_PX_SIZES=1",), "address,undefined", ("index32",)
)
ASAN_BROKEN_ALIGN = Variant(
    "asan_break_align", (*PIXEL_ONLY, "GK_BUILD_PX_SIZES=6"), "address,undefined", ("align",)
)
TSAN = Variant("tsan", sanitize="thread")
TSAN_BROKEN_SYNC = Variant("tsan_break_sync", TILED_ONLY, "thread", ("sync",))
TSAN_BROKEN_DIVERGENCE = Variant("tsan_break_divergence", TILED_ONLY, "thread", ("divergence",))
TSAN_BROKEN_PX_SLOTS = Variant(
    "tsan_break_px_slots", (*PIXEL_ONLY, "GK_BUILD_PX_SIZES=4"), "thread", ("px_slots",)
)
ALL_VARIANTS = (
    PLAIN,
    BROKEN_SYNC,
    BROKEN_DIVERGENCE,
    BROKEN_PX_SLOTS,
    ASAN,
    ASAN_BROKEN_BOUNDS,
    ASAN_BROKEN_INDEX32,
    ASAN_BROKEN_ALIGN,
    TSAN,
    TSAN_BROKEN_SYNC,
    TSAN_BROKEN_DIVERGENCE,
    TSAN_BROKEN_PX_SLOTS,
)


def build_command(variant: Variant, output: Path, sources: Path | None = None) -> list[str]:
    """g++ command line that builds ``variant`` into ``output`` (from the kernel folder
    ``sources``: the shipped one, or a copy holding a mutated kernel source)."""
    compiler = gxx()
    if compiler is None:
        raise FileNotFoundError("g++ not found")
    src = (sources or kernel_source_dir()) / "emu" / "emu_driver.cpp"
    cmd = [
        compiler,
        "-std=c++20",
        "-fPIC",
        "-shared",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-Wno-unknown-pragmas",  # '#pragma unroll' is for nvcc
    ]
    cmd += [f"-D{d}" for d in variant.defines]
    if variant.sanitize is None:
        cmd.append("-O2")  # no -g: it makes the unrolled kernels' build half as long again
    else:
        # -O0 with debug information for the sanitizers' reports: at -O1 the
        # unrolled pixel and micro-tile kernels take three to four times as
        # long to compile, for the small runs that -O0 serves as well.
        cmd += ["-O0", "-g", "-fno-omit-frame-pointer", f"-fsanitize={variant.sanitize}"]
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
    digest.update((HERE / "mutants.py").read_bytes())  # how the broken variants are made
    return digest.hexdigest()[:12]


def mutated_sources(variant: Variant, out_dir: Path) -> Path | None:
    """A kernel folder whose ``channels_last.cu`` has ``variant``'s mutants (None: none), beside
    a copy of the emulation sources that include it."""
    if not variant.mutants:
        return None
    from mutants import mutated_source

    folder = out_dir / f"src_{variant.name}_{source_digest()}"
    if not folder.exists():
        tmp = out_dir / f"{folder.name}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(kernel_source_dir() / "emu", tmp / "emu")
        (tmp / "channels_last.cu").write_text(mutated_source(variant.mutants))
        tmp.replace(folder)
    return folder


def build(variant: Variant, out_dir: Path) -> Path:
    """Build ``variant`` into ``out_dir`` (once) and return the library path.

    Processes may share ``out_dir`` (the test workers of one session do): a lock file per
    library lets one of them build it while the others wait, then use it."""
    output = out_dir / f"libgkemu_{variant.name}_{source_digest()}.so"
    if output.exists():
        return output
    import fcntl

    with open(out_dir / f"{output.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not output.exists():
            tmp = output.with_suffix(f".tmp{os.getpid()}.so")
            sources = mutated_sources(variant, out_dir)
            proc = subprocess.run(build_command(variant, tmp, sources), capture_output=True, text=True)
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
                *plan.int_params(),
            )
        )


class EmuError(AssertionError):
    """The emulator reported an error (e.g. barrier divergence)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"emulated launch failed with status {status}")
        self.status = status


def _aligned_flat(n: int, dtype: Any, misalign: int) -> np.ndarray:
    """n elements starting ``misalign`` elements past an ALIGN-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(n * dtype.itemsize + 2 * ALIGN + misalign * dtype.itemsize, np.uint8)
    start = (-raw.ctypes.data) % ALIGN + misalign * dtype.itemsize
    return raw[start : start + n * dtype.itemsize].view(dtype)


def _guarded(n: int, dtype: Any, fill: int, misalign: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A flat buffer of n elements between guard regions; returns (whole, inner).
    The inner part starts ``misalign`` elements past an ALIGN-byte boundary."""
    whole = _aligned_flat(n + 2 * GUARD, dtype, misalign)
    whole[...] = fill
    return whole, whole[GUARD : GUARD + n]


def _check_guards(whole: np.ndarray, fill: int) -> None:
    head, tail = whole[:GUARD], whole[-GUARD:]
    if not ((head == fill).all() and (tail == fill).all()):
        raise AssertionError("kernel wrote outside the destination buffer")


def channels_last_like(logical: np.ndarray, misalign: int = 0) -> np.ndarray:
    """``logical`` copied into channels-last memory that starts ``misalign``
    elements past an ALIGN-byte boundary."""
    shape = logical.shape
    physical_shape = (shape[0], *shape[2:], shape[1])
    flat = _aligned_flat(int(np.prod(shape)), logical.dtype, misalign)
    out = np.moveaxis(flat.reshape(physical_shape), -1, 1)
    out[...] = logical
    return out


def random_channels_last(shape: tuple[int, ...], itemsize: int, seed: int, misalign: int = 0) -> np.ndarray:
    """A channels-last array of random unsigned integers of ``itemsize``."""
    rng = np.random.default_rng(seed)
    dtype = UINT[itemsize]
    logical = rng.integers(0, np.iinfo(dtype).max, size=shape, dtype=dtype, endpoint=True)
    return channels_last_like(logical, misalign)


def _launch_checked(
    lib: EmuLibrary, plan: BoxCopyPlan, to_cl: bool, src: int, dst: int, order: str, seed: int
) -> None:
    lib.set_order(order, seed)
    status = lib.launch(plan, to_cl, src, dst)
    if status != EMU_OK:
        raise EmuError(status)


def emu_to_contiguous(
    lib: EmuLibrary,
    src: np.ndarray,
    box: Any = None,
    *,
    order: str = "forward",
    seed: int = 0,
    grid_limit: tuple[int, int, int] = MAX_GRID,
    path: str | None = None,
    misalign: int = 0,
) -> np.ndarray:
    """Channels-last ``src`` -> logical block, through the emulated kernel
    (the block starts ``misalign`` elements past an aligned address)."""
    offsets, sizes = normalize_box(box, src.shape)
    plan = plan_box_copy(src.shape, offsets, sizes, src.itemsize, grid_limit=grid_limit, path=path)
    fill = np.iinfo(src.dtype).max // 3
    whole, inner = _guarded(int(np.prod(sizes)), src.dtype, fill, misalign)
    out = inner.reshape(sizes)
    if not plan.empty:
        _launch_checked(lib, plan, False, src.ctypes.data, out.ctypes.data, order, seed)
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
    path: str | None = None,
    misalign: int = 0,
) -> np.ndarray:
    """Logical block ``src`` -> box of channels-last ``dst`` (a guarded copy
    of it, ``misalign`` elements past an aligned address, is written and
    returned; ``dst`` itself is left alone)."""
    offsets, sizes = normalize_box(box, dst.shape)
    plan = plan_box_copy(dst.shape, offsets, sizes, dst.itemsize, grid_limit=grid_limit, path=path)
    fill = np.iinfo(dst.dtype).max // 3
    physical_shape = (dst.shape[0], *dst.shape[2:], dst.shape[1])
    whole, inner = _guarded(int(np.prod(dst.shape)), dst.dtype, fill, misalign)
    target = np.moveaxis(inner.reshape(physical_shape), -1, 1)
    target[...] = dst
    if not src.flags.c_contiguous:
        src = np.ascontiguousarray(src)
    if not plan.empty:
        _launch_checked(lib, plan, True, src.ctypes.data, target.ctypes.data, order, seed)
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
    path: str | None = None,
    misalign: int = 0,
) -> None:
    """Run one case through the emulation and compare with the NumPy reference.

    ``path`` forces a kernel path (default: the planner's choice);
    ``misalign`` shifts the source and the destination by that many elements
    from 64-byte boundaries (default: aligned).
    """
    src_cl = random_channels_last(shape, itemsize, seed, misalign)
    if not to_channels_last:
        got = emu_to_contiguous(
            lib, src_cl, box, order=order, seed=seed, grid_limit=grid_limit, path=path, misalign=misalign
        )
        want = ref.channels_last_to_contiguous(src_cl, box=box)
    else:
        _, sizes = normalize_box(box, shape)
        block = np.ascontiguousarray(random_channels_last(tuple(sizes), itemsize, seed + 1))
        if misalign:
            shifted = _aligned_flat(block.size, block.dtype, misalign).reshape(block.shape)
            shifted[...] = block
            block = shifted
        got = emu_to_channels_last(
            lib,
            block,
            src_cl,
            box,
            order=order,
            seed=seed,
            grid_limit=grid_limit,
            path=path,
            misalign=misalign,
        )
        want = ref.contiguous_to_channels_last(block, src_cl.copy(order="K"), box=box)
    if not np.array_equal(got, want):
        bad = np.argwhere(got != want)
        raise AssertionError(
            f"mismatch for shape {shape} itemsize {itemsize} box {box} "
            f"to_channels_last={to_channels_last} order={order} path={path} misalign={misalign}: "
            f"{len(bad)} elements differ, first at {tuple(bad[0])}"
        )


# --------------------------------------------------------------------------
# Tensors over 2**31 elements: only the far end is touched.

MAP_NORESERVE = 0x4000  # Linux; the mmap module does not export it


def _virtual_buffer(nbytes: int) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    return mmap.mmap(-1, nbytes, flags=flags)


def _address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def block_regions(plan: BoxCopyPlan, block: int) -> list[tuple[int, int, int, int, int]]:
    """(line, q0, q1, c0, c1) of the whole-tensor box that grid block
    ``block`` (linear index, x fastest) copies, for a grid as large as the
    work (no grid-stride loops)."""
    assert plan.grid == plan.tiles, "one block per work item assumed"
    gx, gy = plan.grid[0], plan.grid[1]
    bx, by, bz = block % gx, (block // gx) % gy, block // (gx * gy)
    if plan.path == "pixel":
        span = THREADS_PER_BLOCK * pixel_positions_per_thread(plan.cl_qs, plan.itemsize)
        q0 = bx * span
        return [(by, q0, min(q0 + span, plan.run_len), 0, plan.nch)]
    if plan.path == "micro":
        span = (THREADS_PER_BLOCK >> plan.log_tc) * micro_positions_per_thread(plan.itemsize)
        chans = (16 // plan.itemsize) << plan.log_tc
        q0, c0 = bx * span, by * chans
        return [(bz, q0, min(q0 + span, plan.run_len), c0, min(c0 + chans, plan.nch))]
    tq, tc = 1 << plan.log_tq, 1 << plan.log_tc
    q0, c0 = bx * tq, by * tc
    return [(bz, q0, min(q0 + tq, plan.run_len), c0, min(c0 + tc, plan.nch))]


def check_huge_tail(
    lib: EmuLibrary,
    shape: tuple[int, ...],
    itemsize: int,
    *,
    to_channels_last: bool,
    nblocks: int,
    path: str | None = None,
) -> int:
    """Run the last ``nblocks`` blocks of a whole-tensor copy of a huge tensor.

    The buffers are reserved, not committed: only the pages the last blocks
    touch ever get memory.  Returns the largest element offset checked.
    """
    n = int(np.prod(shape))
    plan = plan_box_copy(shape, (0,) * len(shape), shape, itemsize, path=path)
    total = plan.grid[0] * plan.grid[1] * plan.grid[2]
    dtype = UINT[itemsize]
    cl_buf, cf_buf = _virtual_buffer(n * itemsize), _virtual_buffer(n * itemsize)
    cl_mem = np.frombuffer(cl_buf, dtype=dtype)
    cf_mem = np.frombuffer(cf_buf, dtype=dtype)
    nb, ch = shape[0], shape[1]
    run = n // (nb * ch)
    cl = cl_mem.reshape(nb, run, ch)  # [N][spatial][C]
    cf = cf_mem.reshape(nb, ch, run)  # [N][C][spatial]
    regions = [r for b in range(total - nblocks, total) for r in block_regions(plan, b)]
    for line, q0, q1, c0, c1 in regions:
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
