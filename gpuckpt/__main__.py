"""``python -m gpuckpt``: the ``gpuckpt`` command (as ``python -m gpuckpt.cli``)."""

from __future__ import annotations

import sys

from gpuckpt.cli import main

sys.exit(main())
