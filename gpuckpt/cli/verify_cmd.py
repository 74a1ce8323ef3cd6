"""``gpuckpt verify PATH``: read every chunk, check every checksum (a directory or an ``s3://`` URL)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpuckpt.cli.convert_cmd import not_gpuckpt
from gpuckpt.cli.inspect_cmd import describe_root, describe_tier
from gpuckpt.cli.progressbar import progress_for
from gpuckpt.errors import CheckpointNotFoundError
from gpuckpt.printable import one_line, printable
from gpuckpt.storage.stores import scheme_of
from gpuckpt.verify import verify_checkpoint

HELP = "read every chunk of a checkpoint and check every checksum; exit 1 if anything is damaged"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path",
        metavar="PATH",
        help="checkpoint directory, or s3://bucket/prefix (endpoint and credentials from the AWS_* "
        "environment variables, e.g. AWS_ENDPOINT_URL)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--allow-pickle", action="store_true", help="also decode pickled values (runs their code)")


def run(args: argparse.Namespace) -> int:
    bar = progress_for("verify", quiet=args.quiet)
    try:
        report = verify_checkpoint(
            args.path, allow_pickle=args.allow_pickle, threads=args.threads, progress=bar
        )
    except CheckpointNotFoundError as exc:
        foreign = not_gpuckpt(args.path, "verify")
        error = CheckpointNotFoundError(foreign or f"{exc}{_what_it_is(args.path)}")
        if args.json:  # a script reading the report gets one whatever happened
            print(
                json.dumps({"path": args.path, "ok": False, "checked": False, "error": str(error)}, indent=2)
            )
        raise error from None
    finally:
        if bar is not None:
            bar.close()
    print(json.dumps(report.to_json(), indent=2) if args.json else report.format())
    if report.ok:
        return 0
    first = report.damage[0]
    print(
        f"gpuckpt: error: {printable(args.path)} is damaged: {len(report.damage)} problem(s), first: "
        f"{one_line(first.where)}: {one_line(first.problem)}",
        file=sys.stderr,
    )
    return 1


def _what_it_is(text: str) -> str:
    """Where ``text`` is a manager's root or a local tier rather than a checkpoint, what to verify
    instead (else nothing)."""
    path: Path | str = Path(text) if scheme_of(text) == "file" else text
    try:
        root = describe_root(path)
        if root is not None:
            steps = [s["step"] for s in root["steps"]]
            return (
                f"; it is a CheckpointManager root with committed steps {steps}: verify a step, "
                f"e.g. gpuckpt verify {printable(root['steps'][-1]['path'])}"
            )
        tier = describe_tier(path) if isinstance(path, Path) else None
    except Exception:  # (the error already says what is wrong; this only adds a hint)
        return ""
    if tier is not None:
        return (
            f"; it is a manager's local tier holding steps {[e['step'] for e in tier['steps']]}: each "
            "part in it is a checkpoint of its own (gpuckpt inspect lists them)"
        )
    return ""
