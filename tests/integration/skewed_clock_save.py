"""A save to ``s3://`` from a process whose wall clock runs off the server's (for test_s3_lease.py).

``python skewed_clock_save.py SKEW URL ENDPOINT LEASE SEED``: every wall-clock reading of
the Python process (``time.time``, ``time.time_ns``, ``datetime.now`` and its kin) is
shifted by SKEW seconds (positive: ahead of the server) before gpuckpt is imported,
as on a node whose clock drifted; then it saves ``state(SEED)`` with the given lease.
Prints ``saved``, or the error's type and message and exits 3.
"""

from __future__ import annotations

import datetime as _dt
import sys
import time
from pathlib import Path

SKEW = float(sys.argv[1])
_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + SKEW
time.time_ns = lambda: _time_ns() + int(SKEW * 1e9)


class _SkewedDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz: _dt.tzinfo | None = None) -> _SkewedDatetime:  # type: ignore[override]
        return super().now(tz) + _dt.timedelta(seconds=SKEW)

    @classmethod
    def utcnow(cls) -> _SkewedDatetime:  # type: ignore[override]
        return cls.now(_dt.UTC).replace(tzinfo=None)

    @classmethod
    def today(cls) -> _SkewedDatetime:  # type: ignore[override]
        return cls.now()


_dt.datetime = _SkewedDatetime  # type: ignore[misc]

import gpuckpt  # noqa: E402 - after the clock is skewed
from gpuckpt.testing.s3server import s3_options  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from s3_writer_child import state  # noqa: E402


def main(url: str, endpoint: str, lease: str, seed: str) -> None:
    try:
        gpuckpt.save(state(int(seed)), url, storage_options=s3_options(endpoint, lease_seconds=float(lease)))
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
    print("saved", flush=True)


if __name__ == "__main__":
    main(*sys.argv[2:])
