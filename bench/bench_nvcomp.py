"""Compression on the device with nvCOMP, measured against the host codec, in one run.

What it finds out, per data kind (bf16 weights N(0, 0.02), Adam-like fp32 second moments,
random bytes) and per chunk size:

- nvCOMP's ``Zstd`` in ``RAW`` bitstream mode (plain zstd frames, no nvCOMP header): the
  ratio, the device's compression and decompression throughput (CUDA-synchronized clocks,
  median of rounds after a warm-up), and whether each frame announces its content size
  (gpuckpt's reader and the Zarr ``zstd`` codec size their output from it);
- that the host's zstd (numcodecs) decompresses every frame the device wrote bit-exactly, as do
  gpuckpt's reader and zarr-python reading them as the chunks of a Zarr v3 array with the core
  ``zstd`` codec; and that the device decompresses frames the host wrote;
- the host codec gpuckpt uses today (zstd level 1 after staging) on the same bytes: ratio and
  one thread's throughput, the ceiling the device path must beat;
- ``gpuckpt.save`` of the bf16 weights held on the device with the core zstd codec compressed on
  the device (``compression={"codec": "zstd", "device": True}``) against the same codec on the
  host after staging, at chunks of 4 and 64 MiB: seconds, ratio, and a bit-exact load.

Writes ``bench_nvcomp.json`` under ``--out``. Exits 0 with a message where there is no GPU or no
nvCOMP (the ``nvidia-nvcomp-cu13`` wheel).

Usage: ``python bench/bench_nvcomp.py [--mib 256] [--rounds 3] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a source checkout without an install


def _frame_header(frame: bytes) -> dict[str, Any]:
    """What a zstd frame's header says: whether it is one, one segment, with its own checksum,
    and the content size it announces, read as gpuckpt's reader reads it."""
    from gpuckpt.format.codecs import CodecError, _zstd_content_size

    try:
        content = _zstd_content_size(memoryview(frame))
    except CodecError:
        return {"zstd_frame": False}
    fhd = frame[4]
    return {
        "zstd_frame": True,
        "single_segment": bool((fhd >> 5) & 1),
        "checksum": bool((fhd >> 2) & 1),
        "content_size": content,
    }


def _data(cp: Any, kind: str, nbytes: int) -> Any:
    """``nbytes`` of device data of one kind, as a ``uint8`` device array."""
    rng = cp.random.default_rng(7)
    if kind == "bf16_weights":
        w = rng.standard_normal(nbytes // 2, dtype=cp.float32) * 0.02
        bf16 = (w.view(cp.uint32) + 0x8000) >> 16  # round to bfloat16's upper half
        return bf16.astype(cp.uint16).view(cp.uint8)
    if kind == "fp32_moments":
        g = rng.standard_normal(nbytes // 4, dtype=cp.float32) * 1e-3
        return (g * g * 0.999 + 1e-12).astype(cp.float32).view(cp.uint8)
    return rng.integers(0, 256, nbytes, dtype=cp.uint8)


def _median_s(cp: Any, fn: Any, rounds: int) -> tuple[float, Any]:
    fn()
    cp.cuda.Device().synchronize()
    times, out = [], None
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn()
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _zarr_reads(frames: list[bytes], expect: np.ndarray, chunk: int) -> bool | str:
    """zarr-python reads the device's frames as the chunks of a Zarr v3 array with the core
    ``zstd`` codec (the frames written as its chunk files), bit-exactly."""
    import os
    import shutil
    import tempfile

    try:
        import zarr

        where = tempfile.mkdtemp(prefix="gpuckpt-nvcomp-zarr-")
        try:
            zarr.create_array(
                store=where,
                shape=(expect.nbytes,),
                chunks=(chunk,),
                dtype="uint8",
                compressors=zarr.codecs.ZstdCodec(level=1),
                fill_value=0,
            )
            os.makedirs(os.path.join(where, "c"), exist_ok=True)
            for i, frame in enumerate(frames):
                with open(os.path.join(where, "c", str(i)), "wb") as f:
                    f.write(frame)
            return bool(np.array_equal(zarr.open_array(where, mode="r")[:], expect))
        finally:
            shutil.rmtree(where, ignore_errors=True)
    except Exception as exc:  # reported, never the end of the run
        return f"{type(exc).__name__}: {exc}"


def _gpuckpt_reads(frames: list[bytes], expect: np.ndarray, chunk: int) -> bool | str:
    """gpuckpt's own reader of compressed chunks (the size the frame announces is checked)
    decodes the device's frames bit-exactly."""
    try:
        from gpuckpt.format.codecs import Codec, decode_into

        dest = np.empty(chunk, np.uint8)
        for i, frame in enumerate(frames):
            decode_into(Codec("zstd", 1), memoryview(frame), dest)
            if not np.array_equal(dest, expect[i * chunk : (i + 1) * chunk]):
                return False
        return True
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def measure_one(cp: Any, nvcomp: Any, kind: str, total: int, chunk: int, rounds: int) -> dict[str, Any]:
    from numcodecs import zstd as host_zstd

    data = _data(cp, kind, total)
    n = total // chunk
    offsets, sizes = [i * chunk for i in range(n)], [chunk] * n
    codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW, uncomp_chunk_size=chunk)
    batch = nvcomp.as_arrays(data, offsets, sizes)
    enc_s, enc = _median_s(cp, lambda: codec.encode(batch), rounds)
    comp_sizes = list(enc.buffer_sizes)
    stored = sum(comp_sizes)
    host_frames = [bytes(np.asarray(a)) for a in enc.cpu()]
    headers = [_frame_header(f) for f in host_frames[:2]]
    dec_s, dec = _median_s(cp, lambda: codec.decode(enc), rounds)
    expect = cp.asnumpy(data)
    device_exact = all(
        bool((cp.asarray(dec[i]).view(cp.uint8) == data[offsets[i] : offsets[i] + chunk]).all())
        for i in range(n)
    )
    # the host reads what the device wrote (numcodecs: zarr-python's zstd codec)
    t0 = time.perf_counter()
    host_exact = True
    for i, frame in enumerate(host_frames):
        dest = np.empty(chunk, np.uint8)
        host_zstd.decompress(frame, dest)
        host_exact &= bool(np.array_equal(dest, expect[offsets[i] : offsets[i] + chunk]))
    host_dec_s = time.perf_counter() - t0
    # the host codec of today (level 1, one thread) on the same bytes
    t0 = time.perf_counter()
    host_frames_l1 = [host_zstd.compress(expect[o : o + chunk], 1) for o in offsets]
    host_enc_s = time.perf_counter() - t0
    host_stored = sum(len(f) for f in host_frames_l1)
    # the device reads what the host wrote
    host_batch = nvcomp.as_arrays([np.frombuffer(f, np.uint8) for f in host_frames_l1]).cuda()
    d2 = codec.decode(host_batch)
    device_reads_host = all(
        bool((cp.asarray(d2[i]).view(cp.uint8) == data[offsets[i] : offsets[i] + chunk]).all())
        for i in range(n)
    )
    return {
        # numcodecs decoded every frame above; zarr-python and gpuckpt's reader read the first
        # four of each row (seconds, not the step's budget)
        "zarr_reads_device_frames_exact": _zarr_reads(host_frames[:4], expect[: 4 * chunk], chunk),
        "gpuckpt_reads_device_frames_exact": _gpuckpt_reads(host_frames[:4], expect[: 4 * chunk], chunk),
        "kind": kind,
        "chunk_bytes": chunk,
        "chunks": n,
        "bytes": total,
        "device_ratio": total / stored,
        "device_compress_GBps": total / enc_s / 1e9,
        "device_decompress_GBps": total / dec_s / 1e9,
        "device_roundtrip_exact": device_exact,
        "host_reads_device_frames_exact": host_exact,
        "host_decompress_1thread_GBps": total / host_dec_s / 1e9,
        "frame_headers": headers,
        "host_l1_ratio": total / host_stored,
        "host_l1_compress_1thread_GBps": total / host_enc_s / 1e9,
        "device_reads_host_frames_exact": device_reads_host,
    }


def measure_saves(cp: Any, mib: int, rounds: int, where: Path) -> list[dict[str, Any]]:
    """``gpuckpt.save`` of a device state of bf16 weights with the core zstd codec compressed on
    the device (``device: True``, nvCOMP) against the same codec on the host after staging:
    seconds (median of ``rounds``), stored bytes, and a bit-exact load of each."""
    import shutil

    import gpuckpt

    rows: list[dict[str, Any]] = []
    w = _data(cp, "bf16_weights", mib << 20).view(cp.uint16).reshape(-1, 4096)
    cp.cuda.Device().synchronize()
    for chunk in (4 << 20, 64 << 20):
        for device in (True, False):
            path = where / f"save-{chunk}-{device}"
            times = []
            for _ in range(rounds):
                shutil.rmtree(path, ignore_errors=True)
                t0 = time.perf_counter()
                gpuckpt.save(
                    {"w": w}, path, compression={"codec": "zstd", "device": device}, chunk_bytes=chunk
                )
                times.append(time.perf_counter() - t0)
            stored = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name != "zarr.json")
            back = cp.zeros_like(w)
            gpuckpt.load({"w": back}, path)
            rows.append(
                {
                    "save": "zstd on the device (nvCOMP)" if device else "zstd on the host after staging",
                    "chunk_bytes": chunk,
                    "bytes": int(w.nbytes),
                    "stored_bytes": stored,
                    "ratio": w.nbytes / stored,
                    "save_s": statistics.median(times),
                    "save_GBps": w.nbytes / statistics.median(times) / 1e9,
                    "load_exact": bool((back == w).all()),
                }
            )
            shutil.rmtree(path, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="bytes of each data kind")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="write bench_nvcomp.json here")
    args = ap.parse_args(argv)
    try:
        import cupy as cp

        cp.cuda.runtime.getDeviceCount()
        from gpuckpt.device.compress import import_nvcomp

        nvcomp = import_nvcomp()
    except Exception as exc:  # no CuPy, no device or no nvCOMP: nothing to measure
        print(f"bench_nvcomp: nothing to measure here ({type(exc).__name__}: {exc})")
        return 0
    res: dict[str, Any] = {
        "nvcomp": nvcomp.__version__,
        "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
    }
    rows, errors = [], []
    total = args.mib << 20
    for kind in ("bf16_weights", "fp32_moments", "random_bytes"):
        for chunk in (1 << 20, 4 << 20, 64 << 20):  # (16 MiB left out: the step's time is the saves')
            try:
                row = measure_one(cp, nvcomp, kind, total, chunk, args.rounds)
                rows.append(row)
                print(json.dumps(row), flush=True)
            except Exception as exc:
                errors.append({"kind": kind, "chunk_bytes": chunk, "error": f"{type(exc).__name__}: {exc}"})
                print(f"{kind} chunk {chunk}: {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc()
    try:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="gpuckpt-nvcomp-saves-") as where:
            res["saves"] = measure_saves(cp, args.mib, 2, Path(where))
        for row in res["saves"]:
            print(json.dumps(row), flush=True)
    except Exception as exc:
        errors.append({"kind": "saves", "error": f"{type(exc).__name__}: {exc}"})
        traceback.print_exc()
    res["rows"], res["errors"] = rows, errors
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_nvcomp.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
