"""What every ``gpuckpt`` command shares about failing: the exit codes and :class:`UsageError`.

A command module raises :class:`UsageError` for arguments it cannot take;
:func:`gpuckpt.cli.main` turns it into one line on stderr and exit code
:data:`EXIT_USAGE`. The commands import this module, never the package
``gpuckpt.cli`` that imports them.
"""

from __future__ import annotations

__all__ = ["EXIT_FAILURE", "EXIT_USAGE", "UsageError"]

#: the work failed: a damaged or missing checkpoint, a failed conversion
EXIT_FAILURE = 1
#: bad command-line arguments
EXIT_USAGE = 2


class UsageError(Exception):
    """Bad command-line arguments (exit code :data:`EXIT_USAGE`)."""
