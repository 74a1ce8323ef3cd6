"""The ``gpuckpt`` command: inspect, verify, convert, demo, bench.

Every command exits 0 on success, 1 when the work failed (a damaged or
missing checkpoint, a failed conversion) and 2 for bad arguments; errors
are one line on stderr (``gpuckpt: error: ...``), never a traceback (set
``GPUCKPT_DEBUG=1`` to get one). Text that comes from a checkpoint (names,
values, paths) is printed with its non-printable characters escaped
(:func:`gpuckpt.printable.printable`). ``python -m gpuckpt.cli`` runs it too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

from gpuckpt.cli.usage import EXIT_FAILURE, EXIT_USAGE, UsageError
from gpuckpt.errors import GpuckptError, InvalidOptionError
from gpuckpt.printable import one_line, printable

__all__ = ["EXIT_FAILURE", "EXIT_USAGE", "UsageError", "main", "one_line", "printable"]


#: what ``gpuckpt --help`` says before the commands (the module's docstring, without its markup)
DESCRIPTION = """Checkpoints of model state in Zarr v3 stores: inspect, verify, convert, demo, bench.

Every command exits 0 on success, 1 when the work failed (a damaged or missing
checkpoint, a failed conversion) and 2 for bad arguments; errors are one line on
stderr ("gpuckpt: error: ..."), never a traceback (set GPUCKPT_DEBUG=1 for one).
Text from a checkpoint (names, values, paths) is printed with its non-printable
characters escaped. "python -m gpuckpt.cli" runs it too."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    from gpuckpt.cli import bench, convert_cmd, demo, inspect_cmd, verify_cmd

    common = _Parser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    common.add_argument("--threads", type=int, default=None, help="I/O threads (default: from the CPU count)")
    parser = _Parser(
        prog="gpuckpt", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"gpuckpt {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for module, name in (
        (inspect_cmd, "inspect"),
        (verify_cmd, "verify"),
        (convert_cmd, "convert"),
        (demo, "demo"),
        (bench, "bench"),
    ):
        p = sub.add_parser(name, parents=[common], help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def _version() -> str:
    from gpuckpt import __version__

    return __version__


class _Interrupts:
    """Whether Ctrl-C came while a command ran: a library may turn the KeyboardInterrupt into its
    own error (torch's DCP wraps it in a CheckpointException; an interrupted torch.save raises a
    RuntimeError), and the command still ends as interrupted (exit 130), not as a failure."""

    def __init__(self) -> None:
        self.seen = False
        self._previous: object = None

    def _on_sigint(self, signum: int, frame: object) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread() and (
            signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]


class _OutputError(OSError):
    """Standard output could not take the command's report (a full disk, a closed file)."""


class _Output:
    """``sys.stdout`` while a command runs: an error writing it is told as the report's loss, not
    as the command's failure (a conversion whose summary meets a full disk is still done)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return int(self._guarded(self._stream.write, text))

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def _guarded(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _OutputError(exc.errno, exc.strerror) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gpuckpt`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    real = sys.stdout
    sys.stdout = _Output(real)
    try:
        with _Interrupts() as interrupts:
            code = _main(argv, interrupts)
    finally:
        sys.stdout = real
    return code


def _main(argv: Sequence[str] | None, interrupts: _Interrupts) -> int:
    debug = bool(os.environ.get("GPUCKPT_DEBUG"))
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help and --version exit through here
            return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_USAGE
        if args.threads is not None and args.threads < 1:
            raise UsageError(f"--threads must be at least 1, got {args.threads}")
        return int(args.run(args))
    except (UsageError, InvalidOptionError) as exc:  # an option a command passed on as given
        if debug and isinstance(exc, InvalidOptionError):
            raise
        _error(str(exc))
        return EXIT_USAGE
    except BrokenPipeError:
        # the reader of our output went away (``gpuckpt inspect ... | head``): stop quietly
        _drop_stdout()
        return EXIT_FAILURE
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except _OutputError as exc:
        _drop_stdout()
        _error(
            f"could not write to standard output: {_describe(exc)} (what the command had done before "
            "is done; its report was lost)"
        )
        return EXIT_FAILURE
    except Exception as exc:
        if debug:
            raise
        if interrupts.seen:  # Ctrl-C, which a library turned into an error of its own
            _error("interrupted")
            return 130
        if isinstance(exc, (GpuckptError, OSError, ValueError, TypeError, KeyError)):
            _error(_describe(exc))
        else:  # the promise: one line, no traceback
            _error(f"unexpected {type(exc).__name__}: {_describe(exc)} (set GPUCKPT_DEBUG=1 for a traceback)")
        return EXIT_FAILURE


def _drop_stdout() -> None:
    """Point standard output at /dev/null: what is still buffered for it cannot be written, and
    the flush at exit would fail (and print) once more."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and not isinstance(exc, GpuckptError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{where}"
    text = str(exc)
    if isinstance(exc, KeyError) and not isinstance(exc, GpuckptError) and exc.args:
        text = f"missing key {exc.args[0]!r}"
    return text or type(exc).__name__


def _error(message: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    print(f"gpuckpt: error: {one_line(message)}", file=sys.stderr)
