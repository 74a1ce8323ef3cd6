"""The summary of a GPU run of record (``bench/gpu_check.sh``): JSON plus a table.

Bookkeeping of the GPU runs of record (issue 23's targets, the JSON committed to
``bench/gpu/``), not part of the package: ``gpuckpt bench --device`` prints the
figures themselves (:mod:`gpuckpt.cli.device_bench`). Usage::

    python bench/gpu_summary.py --kernels OUT/bench_kernels.json --gpu OUT/bench_gpu.json \\
        --step gpu-tests=ok ... --commit SHA --out OUT/<date>-summary.json
    python bench/gpu_summary.py --format-test --out DIR/<date>-summary.json

The summary holds the date, the commit, the device, the ceilings measured in
the same run, every kernel row (direction, dtype, shape, box, MiB, GB/s,
percent of the device-to-device copy, speed-up over CuPy), the save, load and
async_save ratios, and which of issue 23's targets the run meets.  The table
printed last is the readable part; the JSON is what gets committed to
``bench/gpu/``.

``--format-test`` writes a summary from made-up inputs, marked
``"kind": "format-test"`` with the device "FORMAT TEST, NO GPU": it checks the
writer and the table on a machine without a GPU and is never a result.
Pure Python; NumPy and CuPy are not needed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FORMAT = "gpuckpt-gpu-summary/1"
MIB = 1 << 20

#: Issue 23's targets.
KERNEL_FRACTION = 0.80  # of the device-to-device copy, rows of 16 MiB and more
KERNEL_FRACTION_FROM_MIB = 16
KERNEL_CUPY_FROM_MIB = 1  # no slower than CuPy from 1 MiB
SAVE_MIN = 0.85  # of min(D2H, disk write)
LOAD_WARM_MIN = 0.80  # of min(H2D, warm read)
LOAD_COLD_MIN = 0.90  # of min(H2D, cold read)
ASYNC_HOST_MAX = 1.1  # x one D2H copy of the state
ASYNC_DEVICE_MAX = 1.2  # x one D2D copy of the state
#: Issue 34's device figures (a CheckpointManager's local tier, one process)
TIER_SAVE_MAX = 1.1  # x one D2H copy of the state
TIER_RESTORE_MIN = 0.8  # of min(H2D, warm read)

KERNEL_ROW_FIELDS = (
    "direction",
    "dtype",
    "shape",
    "box",
    "MiB",
    "GBps",
    "percent_of_copy",
    "speedup_vs_cupy",
    "cupy_GBps",
    "path",
    "group",
)


def _kernel_row(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: row.get(k) for k in KERNEL_ROW_FIELDS}
    if out["MiB"] is None and "bytes" in row:
        out["MiB"] = row["bytes"] / MIB
    if out["percent_of_copy"] is None and "fraction_of_copy" in row:
        out["percent_of_copy"] = 100 * row["fraction_of_copy"]
    if out["GBps"] is None and "ours_GBps" in row:  # tables written before the pixel path
        out["GBps"] = row["ours_GBps"]
    out["group"] = out["group"] or "main"
    out["missed"] = kernel_row_misses(out)
    return out


def kernel_row_misses(row: dict[str, Any]) -> list[str]:
    """The targets a kernel row misses (empty when it meets them)."""
    missed = []
    if row["MiB"] >= KERNEL_FRACTION_FROM_MIB and row["percent_of_copy"] < 100 * KERNEL_FRACTION:
        missed.append(f"<{KERNEL_FRACTION:.0%} of copy")
    if row["MiB"] >= KERNEL_CUPY_FROM_MIB and row["speedup_vs_cupy"] < 1.0:
        missed.append("slower than CuPy")
    return missed


def _ratio(value: Any) -> float | None:
    return None if value is None else float(value)


def _met(value: float | None, *, at_least: float | None = None, at_most: float | None = None) -> bool | None:
    if value is None:
        return None
    if at_least is not None:
        return value >= at_least
    assert at_most is not None
    return value <= at_most


def build_summary(
    *,
    date: str,
    commit: str,
    kernels: dict[str, Any] | None,
    gpu: dict[str, Any] | None,
    steps: dict[str, str],
    kind: str = "measurement",
    note: str | None = None,
) -> dict[str, Any]:
    """The summary of one run from ``bench_kernels.json`` and ``bench_gpu.json``
    (either may be missing when its step failed: its fields are then null)."""
    device = (kernels or {}).get("device") or (gpu or {}).get("device") or "unknown"
    ceilings: dict[str, float | None] = {
        "d2d_read_plus_write": None,
        "d2h_pinned": None,
        "h2d_pinned": None,
        "disk_write_fsync": None,
        "disk_read_warm": None,
        "disk_read_cold": None,
    }
    if kernels is not None:
        ceilings["d2d_read_plus_write"] = _ratio(kernels.get("copy_GBps"))
    if gpu is not None:
        c = gpu.get("ceilings_GBps", {})
        for key in ceilings:
            if c.get(key) is not None and (key != "d2d_read_plus_write" or ceilings[key] is None):
                ceilings[key] = float(c[key])

    rows = [_kernel_row(r) for r in (kernels or {}).get("rows", [])]
    main16 = [r for r in rows if r["group"] == "main" and r["MiB"] >= KERNEL_FRACTION_FROM_MIB]
    from1 = [r for r in rows if r["MiB"] >= KERNEL_CUPY_FROM_MIB]
    g = (gpu or {}).get("gpuckpt", {})
    save_load = {
        "state_bytes": g.get("state_bytes"),
        "save_GBps": _ratio(g.get("save_GBps")),
        "save_ratio_to_min_d2h_disk": _ratio(g.get("save_ratio_to_min_d2h_disk")),
        "load_GBps": _ratio(g.get("load_GBps")),
        "load_ratio_to_min_h2d_warm_read": _ratio(g.get("load_ratio_to_min_h2d_warm_read")),
        "load_cold_GBps": _ratio(g.get("load_cold_GBps")),
        "load_ratio_to_min_h2d_cold_read": _ratio(g.get("load_ratio_to_min_h2d_cold_read")),
        "async_block_s": _ratio(g.get("async_block_s")),
        "async_block_ratio_to_one_d2h": _ratio(g.get("async_block_ratio_to_one_d2h")),
        "async_device_block_s": _ratio(g.get("async_device_block_s")),
        "async_device_block_ratio_to_one_d2d": _ratio(g.get("async_device_block_ratio_to_one_d2d")),
        "async_device_copies": g.get("async_device_copies"),
        "async_device_snapshot_copy_s": _ratio(g.get("async_device_snapshot_copy_s")),
        "cold_files_left_page_cache": g.get("cold_files_left_page_cache"),
        "channels_last_save_GBps": _ratio(g.get("channels_last_save_GBps")),
        "channels_last_load_GBps": _ratio(g.get("channels_last_load_GBps")),
        "tier_save_block_s": _ratio(g.get("tier_save_block_s")),
        "tier_save_block_ratio_to_one_d2h": _ratio(g.get("tier_save_block_ratio_to_one_d2h")),
        "tier_restore_GBps": _ratio(g.get("tier_restore_GBps")),
        "tier_restore_ratio_to_min_h2d_warm_read": _ratio(g.get("tier_restore_ratio_to_min_h2d_warm_read")),
    }
    targets = {
        "kernels_16MiB_at_80pct_of_copy": (
            all(r["percent_of_copy"] >= 100 * KERNEL_FRACTION for r in main16) if main16 else None
        ),
        "kernels_1MiB_not_slower_than_cupy": (
            all(r["speedup_vs_cupy"] >= 1.0 for r in from1) if from1 else None
        ),
        "save": _met(save_load["save_ratio_to_min_d2h_disk"], at_least=SAVE_MIN),
        "load_warm": _met(save_load["load_ratio_to_min_h2d_warm_read"], at_least=LOAD_WARM_MIN),
        "load_cold": _met(save_load["load_ratio_to_min_h2d_cold_read"], at_least=LOAD_COLD_MIN),
        "async_save_host": _met(save_load["async_block_ratio_to_one_d2h"], at_most=ASYNC_HOST_MAX),
        "async_save_device": _met(save_load["async_device_block_ratio_to_one_d2d"], at_most=ASYNC_DEVICE_MAX),
        "tier_save": _met(save_load["tier_save_block_ratio_to_one_d2h"], at_most=TIER_SAVE_MAX),
        "tier_restore": _met(save_load["tier_restore_ratio_to_min_h2d_warm_read"], at_least=TIER_RESTORE_MIN),
    }
    return {
        "format": FORMAT,
        "kind": kind,
        "note": note,
        "date": date,
        "commit": commit,
        "device": device,
        "steps": dict(steps),
        "ceilings_GBps": ceilings,
        "kernels": {
            "copy_GBps": ceilings["d2d_read_plus_write"],
            "compile_s": (kernels or {}).get("compile_s"),
            "rows": rows,
            "rows_skipped": len((kernels or {}).get("rows_skipped", [])),
            "rows_missing_targets": sum(1 for r in rows if r["missed"]),
        },
        "save_load": save_load,
        "targets": {
            "definitions": {
                "kernels": f"rows >= {KERNEL_FRACTION_FROM_MIB} MiB (main group) at >= {KERNEL_FRACTION:.0%} "
                f"of the D2D copy; rows >= {KERNEL_CUPY_FROM_MIB} MiB no slower than CuPy",
                "save": f">= {SAVE_MIN} of min(D2H, disk write)",
                "load_warm": f">= {LOAD_WARM_MIN} of min(H2D, warm read)",
                "load_cold": f">= {LOAD_COLD_MIN} of min(H2D, cold read)",
                "async_save_host": f"<= {ASYNC_HOST_MAX} x one D2H copy",
                "async_save_device": f"<= {ASYNC_DEVICE_MAX} x one D2D copy",
                "tier_save": f"CheckpointManager.save with a local tier blocks <= {TIER_SAVE_MAX} x one D2H copy",
                "tier_restore": f"restore from the local tier >= {TIER_RESTORE_MIN} of min(H2D, warm read)",
            },
            "met": targets,
        },
    }


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _verdict(met: bool | None) -> str:
    return {True: "met", False: "MISSED", None: "not measured"}[met]


def render_table(summary: dict[str, Any]) -> str:
    """The readable part: condensed kernel table, fallback rows, figures, targets."""
    lines = []
    head = f"== gpuckpt GPU summary: {summary['date']}, commit {summary['commit']}, {summary['device']} =="
    if summary["kind"] != "measurement":
        head += f"  [{summary['kind'].upper()}: {summary.get('note') or 'not a result'}]"
    lines.append(head)
    lines.append("steps: " + ", ".join(f"{k} {v}" for k, v in summary["steps"].items()))
    c = summary["ceilings_GBps"]
    lines.append(
        f"ceilings GB/s: D2D {_fmt(c['d2d_read_plus_write'], '.0f')} (read+write)"
        f"  D2H {_fmt(c['d2h_pinned'], '.1f')}"
        f"  H2D {_fmt(c['h2d_pinned'], '.1f')}  disk write+fsync {_fmt(c['disk_write_fsync'])}"
        f"  warm read {_fmt(c['disk_read_warm'])}  cold read {_fmt(c['disk_read_cold'])}"
    )
    rows = summary["kernels"]["rows"]
    if rows:
        lines.append("")
        lines.append("kernels, main rows: % of D2D copy at 16 and 256 MiB, speed-up over CuPy at 1 MiB")
        lines.append(
            f"{'direction':<17}{'dtype':<9}{'C':>5}{'dims':>5}{'path':>7}"
            f"{'16MiB':>8}{'256MiB':>8}{'1MiB x':>8}"
        )
        keyed: dict[tuple[Any, ...], dict[int, dict[str, Any]]] = {}
        for r in rows:
            if r["group"] != "main":
                continue
            key = (r["direction"], r["dtype"], r["shape"][1], len(r["shape"]))
            keyed.setdefault(key, {})[round(r["MiB"])] = r
        for (direction, dtype, ch, ndim), by_size in keyed.items():
            path = next(iter(by_size.values()))["path"]

            def pct(mib: int, by_size: dict[int, dict[str, Any]] = by_size) -> str:
                near = [r for m, r in by_size.items() if abs(m - mib) <= mib * 0.05 + 0.5]
                if not near:
                    return "-"
                mark = "" if near[0]["percent_of_copy"] >= 100 * KERNEL_FRACTION else "*"
                return f"{near[0]['percent_of_copy']:.0f}%{mark}"

            one = [r for m, r in by_size.items() if m <= 1]
            speed = (
                f"{one[0]['speedup_vs_cupy']:.2f}" + ("" if one[0]["speedup_vs_cupy"] >= 1 else "*")
                if one
                else "-"
            )
            lines.append(
                f"{direction:<17}{dtype:<9}{ch:>5}{ndim:>5}{path:>7}{pct(16):>8}{pct(256):>8}{speed:>8}"
            )
        others = [r for r in rows if r["group"] != "main"]
        if others:
            lines.append("")
            lines.append("odd plane sizes and boxes (chunk extraction):")
            for r in others:
                box = "" if r["box"] is None else f" box {r['box'][0]}+{r['box'][1]}"
                lines.append(
                    f"  {r['group']:<4}{r['direction']:<17}{r['dtype']:<9}"
                    f"{'x'.join(map(str, r['shape'])):<20}"
                    f"{r['MiB']:>7.1f} MiB {r['GBps']:>8.1f} GB/s {r['percent_of_copy']:>4.0f}% "
                    f"x{r['speedup_vs_cupy']:.2f} {r['path']}{box}"
                )
        lines.append("(* misses its target)")
    s = summary["save_load"]
    lines.append("")
    lines.append(
        f"save          {_fmt(s['save_GBps'])} GB/s = "
        f"{_fmt(s['save_ratio_to_min_d2h_disk'])} x min(D2H, disk)"
        f"      target >= {SAVE_MIN}"
    )
    lines.append(
        f"load (warm)   {_fmt(s['load_GBps'])} GB/s = "
        f"{_fmt(s['load_ratio_to_min_h2d_warm_read'])} x min(H2D, warm read)"
        f" target >= {LOAD_WARM_MIN}"
    )
    lines.append(
        f"load (cold)   {_fmt(s['load_cold_GBps'])} GB/s = "
        f"{_fmt(s['load_ratio_to_min_h2d_cold_read'])} x min(H2D, cold read)"
        f" target >= {LOAD_COLD_MIN}"
    )
    lines.append(
        f"async_save    blocks {_fmt(s['async_block_s'], '.4f')} s = "
        f"{_fmt(s['async_block_ratio_to_one_d2h'])} x one D2H"
        f"      target <= {ASYNC_HOST_MAX}"
    )
    lines.append(
        f"async device  blocks {_fmt(s['async_device_block_s'], '.4f')} s = "
        f"{_fmt(s['async_device_block_ratio_to_one_d2d'])} x one D2D      target <= {ASYNC_DEVICE_MAX}"
        + ("" if s.get("async_device_copies") is None else f"  ({s['async_device_copies']} device copies)")
        + (
            ""
            if s.get("async_device_snapshot_copy_s") is None
            else f", the copy alone {s['async_device_snapshot_copy_s']:.4f} s"
        )
    )
    lines.append(
        f"tier save     blocks {_fmt(s.get('tier_save_block_s'), '.4f')} s = "
        f"{_fmt(s.get('tier_save_block_ratio_to_one_d2h'))} x one D2H      target <= {TIER_SAVE_MAX}"
    )
    lines.append(
        f"tier restore  {_fmt(s.get('tier_restore_GBps'))} GB/s = "
        f"{_fmt(s.get('tier_restore_ratio_to_min_h2d_warm_read'))} x min(H2D, warm read)"
        f" target >= {TIER_RESTORE_MIN}"
    )
    if s.get("cold_files_left_page_cache") is False:
        lines.append("cold figures: the files stayed in the page cache (tmpfs?); they are warm reads")
    lines.append("")
    met = summary["targets"]["met"]
    k = summary["kernels"]
    lines.append(
        f"kernel rows missing a target: {k['rows_missing_targets']} of {len(k['rows'])}"
        f" ({k['rows_skipped']} left out by the time budget)"
    )
    lines.append("targets: " + ", ".join(f"{name} {_verdict(v)}" for name, v in met.items()))
    lines.extend(_nvcomp_lines(summary.get("nvcomp")))
    return "\n".join(lines)


def _read_exactly(row: dict[str, Any]) -> bool:
    """The CPU's readers (numcodecs' zstd, and where the run checked them zarr-python and
    gpuckpt's reader) all decoded the device's frames bit-exactly."""
    keys = (
        "host_reads_device_frames_exact",
        "zarr_reads_device_frames_exact",
        "gpuckpt_reads_device_frames_exact",
    )
    return all(row.get(k, True) is True for k in keys)


def _nvcomp_lines(nv: dict[str, Any] | None) -> list[str]:
    """Compression on the device (bench/bench_nvcomp.py), one line per data kind and chunk size."""
    if not nv:
        return []
    lines = ["", f"nvCOMP {nv.get('nvcomp')} zstd (RAW frames) against host zstd level 1, one thread:"]
    lines.append(
        f"{'kind':<14}{'chunk':>7}{'ratio':>7}{'host':>7}{'comp':>8}{'decomp':>8}{'host GB/s':>10}"
        f"{'CPU reads':>10}{'size in frame':>14}"
    )
    for r in nv.get("rows", []):
        fcs = (r.get("frame_headers") or [{}])[0].get("content_size")
        lines.append(
            f"{r['kind']:<14}{r['chunk_bytes'] >> 20:>5}Mi{r['device_ratio']:>7.3f}{r['host_l1_ratio']:>7.3f}"
            f"{r['device_compress_GBps']:>8.1f}{r['device_decompress_GBps']:>8.1f}"
            f"{r['host_l1_compress_1thread_GBps']:>10.2f}"
            f"{'exact' if _read_exactly(r) else 'WRONG':>10}{fcs == r['chunk_bytes']!s:>14}"
        )
    saves = nv.get("saves", [])
    if saves:
        lines += ["", "gpuckpt.save of bf16 weights on the device, core zstd codec:"]
        lines.append(f"{'where':<34}{'chunk':>7}{'ratio':>7}{'save s':>8}{'GB/s':>7}{'load':>7}")
        for r in saves:
            lines.append(
                f"{r['save']:<34}{r['chunk_bytes'] >> 20:>5}Mi{r['ratio']:>7.3f}{r['save_s']:>8.3f}"
                f"{r['save_GBps']:>7.2f}{'exact' if r['load_exact'] else 'WRONG':>7}"
            )
    for e in nv.get("errors", []):
        lines.append(f"  {e['kind']} {e.get('chunk_bytes', 0) >> 20} MiB: {e['error'][:150]}")
    return lines


def fake_inputs() -> tuple[dict[str, Any], dict[str, Any]]:
    """Made-up bench outputs for ``--format-test``: the device says so, the
    numbers are placeholders that exercise every branch of the table."""
    rows: list[dict[str, Any]] = []
    for mib, frac, speed in ((1, 0.05, 0.9), (16, 0.81, 3.0), (256, 0.79, 9.0)):
        for direction in ("to_contiguous", "to_channels_last"):
            rows.append(
                {
                    "direction": direction,
                    "dtype": "float32",
                    "shape": [8, 3, 64, 64] if mib == 1 else [8, 3, 1024, 512 * (mib // 16)],
                    "box": None,
                    "group": "main",
                    "path": "pixel",
                    "bytes": mib * MIB,
                    "GBps": frac * 1000.0,
                    "cupy_GBps": frac * 1000.0 / speed,
                    "fraction_of_copy": frac,
                    "speedup_vs_cupy": speed,
                }
            )
    rows.append({**rows[-1], "group": "box", "box": [[0, 0, 4, 4], [8, 3, 8, 8]], "bytes": 64 * MIB})
    kernels = {
        "device": "FORMAT TEST, NO GPU",
        "copy_GBps": 1000.0,
        "compile_s": {"tiled": 0.0},
        "rows": rows,
    }
    gpu = {
        "device": "FORMAT TEST, NO GPU",
        "ceilings_GBps": {
            "d2h_pinned": 50.0,
            "h2d_pinned": 50.0,
            "d2d_read_plus_write": 999.0,
            "disk_write_fsync": 1.0,
            "disk_read_warm": 20.0,
            "disk_read_cold": 3.0,
        },
        "gpuckpt": {
            "state_bytes": 2 << 30,
            "load_cold_GBps": 2.8,
            "load_ratio_to_min_h2d_cold_read": 0.93,
            "cold_files_left_page_cache": True,
            "async_device_copies": 1,
            "save_GBps": 0.9,
            "save_ratio_to_min_d2h_disk": 0.9,
            "load_GBps": 15.0,
            "load_ratio_to_min_h2d_warm_read": 0.75,
            "async_block_s": 0.04,
            "async_block_ratio_to_one_d2h": 1.05,
            "async_device_block_s": 0.002,
            "async_device_block_ratio_to_one_d2d": 1.5,
            "tier_save_block_s": 0.045,
            "tier_save_block_ratio_to_one_d2h": 1.08,
            "tier_restore_GBps": 12.0,
            "tier_restore_ratio_to_min_h2d_warm_read": 0.6,
        },
    }
    return kernels, gpu


def _load(path: str | None) -> dict[str, Any] | None:
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        return None
    data: dict[str, Any] = json.loads(p.read_text())
    return data


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--kernels", help="bench_kernels.json of the run (missing: kernel fields null)")
    ap.add_argument("--gpu", help="bench_gpu.json of the run (missing: save/load fields null)")
    ap.add_argument("--step", action="append", default=[], metavar="NAME=STATUS", help="a step's outcome")
    ap.add_argument("--nvcomp", help="bench_nvcomp.json of the run (compression on the device)")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--date", default=None, help="UTC date of the run (default: today)")
    ap.add_argument("--out", required=True, help="the summary JSON to write")
    ap.add_argument(
        "--format-test", action="store_true", help="made-up inputs: checks the writer, not a result"
    )
    args = ap.parse_args(argv)

    date = args.date or dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    steps = dict(s.split("=", 1) for s in args.step)
    if args.format_test:
        kernels, gpu = fake_inputs()
        summary = build_summary(
            date=date,
            commit=args.commit,
            kernels=kernels,
            gpu=gpu,
            steps=steps or {"gpu-tests": "skipped (format test)"},
            kind="format-test",
            note="made-up numbers from bench/gpu_summary.py --format-test; not a measurement",
        )
    else:
        summary = build_summary(
            date=date, commit=args.commit, kernels=_load(args.kernels), gpu=_load(args.gpu), steps=steps
        )
    summary["nvcomp"] = _load(args.nvcomp)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(render_table(summary))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
