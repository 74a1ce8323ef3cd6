"""``python -m gpuckpt.cli``: the ``gpuckpt`` command."""

from __future__ import annotations

import sys

from gpuckpt.cli import main

sys.exit(main())
