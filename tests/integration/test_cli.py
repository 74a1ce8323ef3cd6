"""The ``gpuckpt`` command, run as a real subprocess: output, exit codes, one-line errors."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import gpuckpt
from gpuckpt.cli import main
from gpuckpt.cli.progressbar import ProgressBar, format_bytes, progress_for
from gpuckpt.manager import CheckpointManager


def gpuckpt_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUCKPT_DEBUG": ""}
    return subprocess.run(
        [sys.executable, "-m", "gpuckpt.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
    )


def assert_one_line_error(r: subprocess.CompletedProcess[str], code: int, match: str) -> None:
    assert r.returncode == code, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("gpuckpt: error: ") and match in lines[0], lines[0]
    assert "Traceback" not in r.stderr + r.stdout


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    sd = {
        "layer": {"weight": rng.standard_normal((64, 16)).astype(np.float32)},
        "bf": np.ones(7, ml_dtypes.bfloat16),
        "conv": np.zeros((2, 5, 6, 3), np.float32).transpose(0, 3, 1, 2),
        "step": 3,
        "note": "hello",
    }
    gpuckpt.save(sd, tmp_path / "c", chunk_bytes=1024, sync="none")
    return tmp_path / "c"


def test_inspect_table(ckpt: Path) -> None:
    r = gpuckpt_cli("inspect", str(ckpt))
    assert r.returncode == 0 and r.stderr == ""
    out = r.stdout
    for text in (
        "layer.weight",
        "64x16",
        "float32",
        "4 of 16x16",
        "bfloat16",
        "channels_last",
        "2x3x5x6",
        "'hello'",
    ):
        assert text in out
    assert "total: 3 tensors, 6 chunks" in out and "2 objects" in out


def test_inspect_json(ckpt: Path) -> None:
    r = gpuckpt_cli("inspect", "--json", str(ckpt))
    d = json.loads(r.stdout)
    rows = {t["name"]: t for t in d["tensors"]}
    disk = rows["layer.weight"].pop("disk_bytes")  # allocated blocks: up to the file system
    assert isinstance(disk, int) and disk % 512 == 0
    stored = 4 * (16 * 16 * 4 + 4)
    assert rows["layer.weight"] == {
        "name": "layer.weight", "shape": [64, 16], "dtype": "float32", "memory_format": "contiguous_format",
        "chunks": 4, "chunk_shape": [16, 16], "bytes": 4096, "codec": None, "stored_bytes": stored,
        "file_bytes": stored, "shared_bytes": 0, "own_bytes": stored, "missing_chunks": 0,
    }  # fmt: skip
    assert {o["name"]: o["type"] for o in d["objects"]} == {"step": "int", "note": "str"}
    assert d["totals"]["bytes"] == 4096 + 14 + 720


def test_inspect_json_gives_plain_values_exactly_where_json_can(tmp_path: Path) -> None:
    values = {
        "step": 2**70, "lr": 0.1, "name": "a\nb", "betas": (0.9, 0.95), "n": None, "on": True,
        "cfg": {"depth": [1, (2.5, None)]}, "nan": float("nan"), "raw": b"ab", "long": "x" * 5000,
    }  # fmt: skip
    gpuckpt.save({"w": np.ones(2)} | values, tmp_path / "c")
    d = json.loads(gpuckpt_cli("inspect", "--json", str(tmp_path / "c")).stdout)
    exact = {o["name"]: o["json"] for o in d["objects"] if "json" in o}
    assert exact == {
        "step": 2**70, "lr": 0.1, "name": "a\nb", "betas": [0.9, 0.95], "n": None, "on": True,
        "cfg.depth": [1, [2.5, None]],
    }  # fmt: skip
    assert {o["name"] for o in d["objects"]} == set(exact) | {"nan", "raw", "long"}  # shown, not exact


def test_inspect_manager_root(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False, sync="none") as mgr:
        for s in (5, 10):
            mgr.save(s, {"x": np.ones(2)})
    r = gpuckpt_cli("inspect", "--json", str(tmp_path))
    assert json.loads(r.stdout)["latest_step"] == 10
    assert "latest step: 10" in gpuckpt_cli("inspect", str(tmp_path)).stdout


def test_verify_ok_and_damaged(ckpt: Path) -> None:
    r = gpuckpt_cli("verify", str(ckpt))
    assert r.returncode == 0 and r.stdout.startswith("OK:")
    p = ckpt / "layer.weight" / "c.1.0"
    raw = bytearray(p.read_bytes())
    raw[5] ^= 1
    p.write_bytes(raw)
    os.remove(ckpt / "layer.weight" / "c.3.0")
    r = gpuckpt_cli("verify", str(ckpt))
    assert_one_line_error(r, 1, "is damaged: 2 problem(s)")
    assert "layer.weight/c.1.0: checksum mismatch" in r.stdout and "layer.weight/c.3.0: missing" in r.stdout
    d = json.loads(gpuckpt_cli("verify", "--json", str(ckpt)).stdout)
    assert d["ok"] is False and len(d["damage"]) == 2


@pytest.mark.parametrize(
    ("args", "code", "match"),
    [
        (["inspect", "/no/such/ckpt"], 1, "no checkpoint at /no/such/ckpt"),
        (["verify", "/no/such/ckpt"], 1, "no checkpoint at"),
        (["bogus"], 2, "invalid choice: 'bogus'"),
        (["inspect"], 2, "required: PATH"),
        (["verify", "x", "--threads", "zero"], 2, "invalid int value"),
        (["verify", "x", "--threads", "0"], 2, "--threads must be at least 1"),
        (["convert", "/no/such/file", "/tmp/out"], 1, "No such file or directory"),
        (["bench", "--size-mb", "0"], 2, "--size-mb"),
        (["bench", "--gib", "2"], 2, "--gib sets the --device figures only"),
        (["bench", "--no-cold", "--gib", "2"], 2, "--gib and --no-cold set the --device figures only"),
        (["demo", "--steps", "0"], 2, "--steps must be at least 1"),
        ([], 2, "required: COMMAND"),
    ],
)
def test_bad_arguments_one_line(args: list[str], code: int, match: str) -> None:
    assert_one_line_error(gpuckpt_cli(*args), code, match)


def test_bad_checkpoints_one_line(tmp_path: Path, ckpt: Path) -> None:
    (ckpt / "zarr.json").write_text("{not json")
    assert_one_line_error(gpuckpt_cli("inspect", str(ckpt)), 1, "not valid JSON")
    r = gpuckpt_cli("verify", str(ckpt))
    assert_one_line_error(r, 1, "is damaged")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(gpuckpt_cli("inspect", str(tmp_path / "empty")), 1, "not a committed checkpoint")


def test_help_exits_zero() -> None:
    r = gpuckpt_cli("--help")
    assert r.returncode == 0 and "inspect" in r.stdout and "convert" in r.stdout
    assert gpuckpt_cli("convert", "--help").returncode == 0


def test_convert_roundtrip_and_errors(tmp_path: Path, ckpt: Path) -> None:
    st = tmp_path / "m.safetensors"
    r = gpuckpt_cli("convert", str(ckpt), str(st))
    assert r.returncode == 0 and "3 tensors" in r.stdout and r.stderr == ""
    r = gpuckpt_cli("convert", "-q", str(st), str(tmp_path / "back"))
    assert r.returncode == 0
    back = gpuckpt.load_state_dict(tmp_path / "back")
    assert back["note"] == "hello" and back["bf"].dtype == ml_dtypes.bfloat16
    assert_one_line_error(gpuckpt_cli("convert", str(st), str(tmp_path / "back")), 1, "destination exists")
    assert gpuckpt_cli("convert", "--overwrite", str(st), str(tmp_path / "back")).returncode == 0
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"\x80\x04x")
    assert_one_line_error(
        gpuckpt_cli("convert", str(tmp_path / "dcp"), str(tmp_path / "o")), 1, "--trust-pickle-metadata"
    )
    gpuckpt.save({"z": np.zeros(2, np.complex128)}, tmp_path / "cx", sync="none")
    assert_one_line_error(
        gpuckpt_cli("convert", str(tmp_path / "cx"), str(tmp_path / "cx.safetensors")), 1, "complex128"
    )
    assert_one_line_error(
        gpuckpt_cli("convert", str(st), str(tmp_path / "o2"), "--to", "onnx"), 2, "invalid choice"
    )


def test_demo_small(tmp_path: Path) -> None:
    r = gpuckpt_cli(
        "demo", str(tmp_path), "--layers", "1", "--steps", "8", "--save-every", "2", "--kill-at", "4"
    )
    assert r.returncode == 0, r.stderr
    assert "killed it with SIGKILL" in r.stdout and "bit-exact" in r.stdout and "GB/s" in r.stdout
    assert CheckpointManager(tmp_path / "checkpoints").latest_step() == 8


def test_demo_on_gpu_without_one_says_so(tmp_path: Path) -> None:
    from gpuckpt.device import cuda

    if cuda.gpu_available():
        pytest.skip("a GPU is present")
    r = gpuckpt_cli("demo", str(tmp_path), "--device", "gpu", "--steps", "2")
    assert_one_line_error(r, 1, "NVIDIA GPU")  # CuPy missing, or no device
    assert not (tmp_path / "checkpoints").exists()


def test_demo_module_entry_point() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "gpuckpt.cli", "demo", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "--kill-at" in r.stdout


def test_bench_json(tmp_path: Path) -> None:
    r = gpuckpt_cli("bench", "--size-mb", "4", "--rounds", "1", "--json", "--dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert set(d["systems"]) == {"raw-files", "raw-single", "gpuckpt"}
    assert d["systems"]["gpuckpt"]["save"]["gbps"] > 0
    assert list(tmp_path.iterdir()) == []


def test_bench_device_without_a_gpu_says_so_and_fails(tmp_path: Path) -> None:
    from gpuckpt.device import cuda

    if cuda.gpu_available():
        pytest.skip("a GPU is present")
    r = gpuckpt_cli("bench", "--device", "--dir", str(tmp_path))
    assert_one_line_error(r, 1, "no usable GPU here")
    assert r.stdout == ""
    assert list(tmp_path.iterdir()) == []  # nothing measured, nothing written


def test_bench_device_reports_each_figure_against_its_ceiling() -> None:
    """What ``gpuckpt bench --device`` prints from the figures :func:`measure` returns (made up
    here, in its format): every figure with the ceiling it is measured against, no targets."""
    from gpuckpt.cli.device_bench import report

    res = {
        "device": "a device",
        "gib": 2.0,
        "ceilings_GBps": {"d2h_pinned": 50.0, "h2d_pinned": 51.0, "d2d_read_plus_write": 999.0},
        "gpuckpt": {"save_GBps": 0.9, "save_ratio_to_min_d2h_disk": 0.9, "load_GBps": 15.0},
        "kernels": {"rows": [{"fraction_of_copy": 0.81, "speedup_vs_cupy": 3.0}]},
    }
    text = report(res)
    assert text.splitlines()[0].startswith("a device: a device state of 2.0 GiB")
    assert "D2H 50.0  H2D 51.0" in text and "save          0.90 GB/s = 0.90 x min(D2H, disk write)" in text
    assert "load (cold)   - GB/s" in text  # not measured: said, not invented
    assert "1 rows at 81-81% of the D2D copy" in text and "target" not in text
    assert "FAILED" not in text
    # a group of figures that failed on the device is named with its error; the rest still print
    res["errors"] = {"async_save_device": "CUDARuntimeError: cudaErrorInvalidValue: invalid argument"}
    text = report(res)
    assert "FAILED async_save_device: CUDARuntimeError: cudaErrorInvalidValue" in text
    assert "save          0.90 GB/s" in text


@pytest.mark.gpu
def test_bench_device_on_a_gpu(tmp_path: Path) -> None:
    r = gpuckpt_cli(
        "bench", "--device", "--gib", "0.25", "--rounds", "1", "--no-cold", "--json", "--dir", str(tmp_path)
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["gpuckpt"]["load_GBps"] > 0 and d["ceilings_GBps"]["d2h_pinned"] > 0
    assert d["kernels"]["rows"] and list(tmp_path.iterdir()) == []


def test_main_in_process_returns_codes(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(ckpt)]) == 0
    assert main(["inspect", str(ckpt / "nope")]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_progress_bar_draws_and_stays_quiet_without_a_terminal() -> None:
    buf = io.StringIO()
    bar = ProgressBar("save", buf, interval=0)
    bar(0, 2048)
    bar(1024, 2048)
    bar(2048, 2048)
    bar.close()
    out = buf.getvalue()
    assert out.count("\r") == 4 and "100%" in out and out.endswith("\n") and "2.0 KiB/2.0 KiB" in out
    assert progress_for("x", quiet=False, stream=io.StringIO()) is None  # not a terminal

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert progress_for("x", quiet=False, stream=Tty()) is not None
    assert progress_for("x", quiet=True, stream=Tty()) is None
    assert [format_bytes(n) for n in (5, 1536, 3 << 30)] == ["5 B", "1.5 KiB", "3.0 GiB"]


def test_options_a_command_passes_on_are_bad_arguments(
    tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2, as the parser's own refusals, for options the library refuses (InvalidOptionError);
    nothing written."""
    hf = tmp_path / "hf"
    for args, match in (
        (["--to", "hf", "--dtype", "foo"], "dtype='foo'"),
        (["--to", "hf", "--max-shard-size", "abc"], "is not a size"),
    ):
        assert main(["convert", "-q", str(ckpt), str(hf), *args]) == 2
        assert match in capsys.readouterr().err
    assert main(["convert", "-q", str(ckpt), str(tmp_path / "o.safetensors"), "--compression", "zstd"]) == 2
    assert "compression applies to a gpuckpt target" in capsys.readouterr().err
    assert not hf.exists() and not (tmp_path / "o.safetensors").exists()


def test_paths_that_are_not_checkpoints_say_what_they_are(
    tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "f.txt").write_text("hi")
    for command in ("inspect", "verify"):
        assert main([command, str(tmp_path / "f.txt")]) == 1
        assert "f.txt is a file, not a checkpoint" in capsys.readouterr().err
        assert main([command, str(ckpt / "layer.weight")]) == 1
        assert "describes a Zarr array, not a checkpoint" in capsys.readouterr().err
    root = tmp_path / "root"
    with CheckpointManager(root, async_save=False, sync="none") as mgr:
        for s in (5, 10):
            mgr.save(s, {"x": np.ones(2)})
    assert main(["verify", str(root)]) == 1
    err = capsys.readouterr().err
    assert "a CheckpointManager root with committed steps [5, 10]: verify a step" in err
    assert f"gpuckpt verify {root / 'step_00000010'}" in err


def test_a_hugging_face_directory_or_a_safetensors_file_gets_the_convert_command(
    tmp_path: Path, ckpt: Path
) -> None:
    """inspect and verify of what convert reads (a Hugging Face model directory: safetensors
    weights, their index and config.json; a safetensors file) say what it is and give the
    command line that converts it, which then works."""
    from gpuckpt.convert import convert

    hf = tmp_path / "my model"  # a name the command line must quote
    convert(ckpt, hf, target_format="hf", keys=["layer"], config={"model_type": "tiny"})
    assert (hf / "config.json").is_file() and (hf / "model.safetensors.index.json").is_file()
    single = tmp_path / "w.safetensors"
    convert(ckpt, single)
    for command in ("inspect", "verify"):
        r = gpuckpt_cli(command, str(hf))
        assert_one_line_error(r, 1, "is a Hugging Face model directory")
        assert f"gpuckpt convert '{hf}' CKPT && gpuckpt {command} CKPT" in r.stderr, r.stderr
        r = gpuckpt_cli(command, str(single))
        assert_one_line_error(r, 1, "is a safetensors file")
        assert f"gpuckpt convert {single} CKPT && gpuckpt {command} CKPT" in r.stderr, r.stderr
    r = gpuckpt_cli("verify", "--json", str(hf))
    assert r.returncode == 1 and "gpuckpt convert" in json.loads(r.stdout)["error"]
    # the command given does what it says
    r = gpuckpt_cli("convert", str(hf), str(tmp_path / "CKPT"), "--quiet")
    assert r.returncode == 0, r.stderr
    assert gpuckpt_cli("verify", str(tmp_path / "CKPT")).returncode == 0


def test_small_sizes_read_as_what_they_are(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "-q", str(ckpt)]) == 0
    assert "6 chunks, 4.8 kB)" in capsys.readouterr().out  # 4830 bytes of tensors; not "0.0 MB"
    assert main(["inspect", str(ckpt)]) == 0  # 4 bytes of CRC32C per chunk outweigh nothing saved
    assert "x larger: each chunk also stores its 4-byte CRC32C" in capsys.readouterr().out


def test_version_and_plain_help() -> None:
    r = gpuckpt_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("gpuckpt ") and r.stdout.split()[1][0].isdigit()
    r = gpuckpt_cli("--help")
    assert r.returncode == 0 and "``" not in r.stdout and ":func:" not in r.stdout
    # python -m gpuckpt is the same command
    r = subprocess.run(
        [sys.executable, "-m", "gpuckpt", "--version"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.startswith("gpuckpt ")


def test_ctrl_c_that_a_library_turns_into_its_own_error_still_ends_as_interrupted(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch's DCP wraps a KeyboardInterrupt in a CheckpointException, and an interrupted
    torch.save raises a RuntimeError: the command said "unexpected RuntimeError" (exit 1) or
    printed a traceback. A Ctrl-C during a command now ends it as interrupted (130), one line."""
    import signal

    import gpuckpt.cli.convert_cmd as convert_cmd

    def interrupted_inside(*args: object, **kwargs: object) -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while a library works
            for _ in range(1000):  # (the handler runs at the next bytecode boundary)
                pass
        except KeyboardInterrupt as exc:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos") from exc
        raise AssertionError("no KeyboardInterrupt was raised")

    monkeypatch.setattr(convert_cmd, "convert", interrupted_inside)
    # the command's own process has Python's handler (a test worker may ignore SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert main(["convert", str(ckpt), str(tmp_path / "out.safetensors"), "-q"]) == 130
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert err == "gpuckpt: error: interrupted\n", err
    # without a Ctrl-C the same error is a failure, as before
    monkeypatch.setattr(convert_cmd, "convert", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    assert main(["convert", str(ckpt), str(tmp_path / "out.safetensors"), "-q"]) == 1
    assert "unexpected RuntimeError: boom" in capsys.readouterr().err


def test_inspect_of_a_checkpoint_with_a_chunk_missing_fails_with_one_line(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It listed the checkpoint with a warning on stdout and exited 0; what it sees of damage is
    now one line on stderr and exit 1, as the help says for a damaged checkpoint (verify says more)."""
    victim = next(p for p in sorted(ckpt.rglob("c*")) if p.is_file() and p.parent != ckpt)
    victim.unlink()
    assert main(["inspect", str(ckpt)]) == 1
    out, err = capsys.readouterr()
    assert "warning" not in out and "tensors (" in out
    assert err.startswith("gpuckpt: error: 1 chunk file(s) missing") and err.count("\n") == 1, err
    assert main(["inspect", "--json", str(ckpt)]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["totals"]["missing_chunks"] == 1 and "missing" in err


def test_a_tier_listing_escapes_the_node_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The node a part's record names comes from the checkpoint: escaped like every other text."""
    evil = "n\x1b[31m\nX\u202e"
    mgr = CheckpointManager(
        tmp_path / "root", local_dir=tmp_path / "tier", node=evil, replicas=0, async_save=False
    )
    mgr.save(1, {"w": np.ones(4)})
    mgr.close()
    assert main(["inspect", str(tmp_path / "tier")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out and "from n\\x1b[31m\\nX" in out, out
    assert main(["inspect", "--json", str(tmp_path / "tier")]) == 0
    (step,) = json.loads(capsys.readouterr().out)["steps"]
    assert [p["node"] for p in step["parts"].values()] == [evil]  # exact in JSON


def test_a_tier_step_holding_parts_of_two_saves_is_shown_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Parts of one step number from two saves (jobs of 1 and 2 ranks) are told apart, not
    listed as one step missing a part."""
    import shutil

    from gpuckpt.distributed.threads import run_ranks
    from gpuckpt.format.parts import part_name

    with CheckpointManager(tmp_path / "r1", local_dir=tmp_path / "t1", node="a", replicas=0) as mgr:
        mgr.save(1, {"w": np.ones(4)})

    def two(coord: gpuckpt.distributed.Coordinator) -> None:
        kw = {"coordinator": coord, "node": "b", "replicas": 0}
        with CheckpointManager(tmp_path / "r2", local_dir=tmp_path / "t2", **kw) as mgr:
            mgr.save(1, {"w": gpuckpt.ShardedArray(np.ones(2), offsets=(2 * coord.rank,), global_shape=(4,))})

    run_ranks(2, two)
    shutil.copytree(tmp_path / "t2" / part_name(1, 1), tmp_path / "t1" / part_name(1, 1))
    assert main(["inspect", str(tmp_path / "t1")]) == 0
    out = capsys.readouterr().out
    assert "parts of 2 different saves" in out and "(save B, a job of 2 ranks)" in out, out
    assert main(["inspect", "--json", str(tmp_path / "t1")]) == 0
    (step,) = json.loads(capsys.readouterr().out)["steps"]
    assert step["saves"] == 2 and step["complete_here"] is False


def test_verify_json_prints_a_report_when_there_is_no_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A script that reads verify's JSON got nothing on stdout for a missing path or an empty
    directory; it now gets a report with ok false and the error (still exit 1, one line on stderr)."""
    (tmp_path / "empty").mkdir()
    for where in (tmp_path / "missing", tmp_path / "empty"):
        assert main(["verify", "--json", "-q", str(where)]) == 1
        out, err = capsys.readouterr()
        got = json.loads(out)
        assert got["ok"] is False and got["checked"] is False and got["path"] == str(where)
        assert got["error"] and err.startswith("gpuckpt: error: ") and err.count("\n") == 1


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_output_that_cannot_be_written_is_not_told_as_a_failed_conversion(tmp_path: Path, ckpt: Path) -> None:
    out = tmp_path / "w.safetensors"
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "gpuckpt.cli", "convert", str(ckpt), str(out), "--to", "safetensors"],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=120, env={**os.environ, "GPUCKPT_DEBUG": ""},
        )  # fmt: skip
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "gpuckpt: error: could not write to standard output: No space left on device (what the command "
        "had done before is done; its report was lost)"
    ]
    from safetensors.numpy import load_file

    assert (
        load_file(out)["layer.weight"].tobytes() == gpuckpt.load_state_dict(ckpt)["layer"]["weight"].tobytes()
    )


def test_convert_of_a_pickled_value_names_the_flag_that_allows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import fractions

    src = tmp_path / "pk"
    gpuckpt.save({"f": fractions.Fraction(1, 3), "w": np.ones(2)}, src, allow_pickle=True, sync="none")
    for dst in ("pk.safetensors", "pk_copy"):
        assert main(["convert", "-q", str(src), str(tmp_path / dst)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "entry 'f' is a pickle" in err and "--allow-pickle" in err, err
        assert not (tmp_path / dst).exists()
    assert main(["convert", "-q", "--allow-pickle", str(src), str(tmp_path / "pk.safetensors")]) == 0
    # a safetensors source holding the pickled value is refused the same way
    assert main(["convert", "-q", str(tmp_path / "pk.safetensors"), str(tmp_path / "back")]) == 1
    assert "--allow-pickle" in capsys.readouterr().err
    assert (
        main(["convert", "-q", "--allow-pickle", str(tmp_path / "pk.safetensors"), str(tmp_path / "back")])
        == 0
    )
    assert gpuckpt.load_state_dict(tmp_path / "back", allow_pickle=True)["f"] == fractions.Fraction(1, 3)
