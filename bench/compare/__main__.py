"""``python -m bench.compare``: see :mod:`bench.compare.driver`."""

from __future__ import annotations

import sys

from bench.compare.driver import main

sys.exit(main())
