"""How gpuckpt talks to an object store: retries, timeouts, requests in flight, multipart parts.

Everything here is the object-store client's own machinery (obstore, on the
Rust ``object_store`` crate), configured, not a retry loop of ours:

* **Retries.** Server errors (5xx, 503 SlowDown included), dropped and reset
  connections and timeouts of reads are retried by the client with
  exponential backoff and jitter (:data:`DEFAULT_RETRY`); a caller's
  ``retry_config`` replaces it key by key.
* **Timeouts.** :data:`DEFAULT_CLIENT_OPTIONS` bounds connecting and each
  request, so a stalled connection is given up and retried instead of hanging
  a save; a caller's ``client_options`` win.
* **Requests in flight.** A :class:`RequestBudget` of ``max_requests`` slots
  per reader or writer: a plain put or get takes one, a multipart upload one
  per part it sends at once. A rank neither floods the endpoint nor holds
  more parts in memory than its budget.
* **Multipart.** A chunk larger than ``part_bytes`` goes up as a multipart
  upload of parts of that size, up to ``max_parts_in_flight`` at once (and
  within the request budget). The parts are views of the chunk's buffer,
  which the save already holds within ``staging_bytes``: no copy is made.

The gpuckpt keys of ``storage_options`` handled here are popped by
:func:`pop_transfer_options`; the rest go to the store.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = [
    "DEFAULT_CLIENT_OPTIONS",
    "DEFAULT_MAX_REQUESTS",
    "DEFAULT_PART_BYTES",
    "DEFAULT_RETRY",
    "RequestBudget",
    "TransferOptions",
    "client_options",
    "pop_transfer_options",
    "retry_config",
]

#: exponential backoff with jitter, from 100 ms up to 10 s, for at most 2 minutes and 10 retries
DEFAULT_RETRY: dict[str, Any] = {
    "max_retries": 10,
    "retry_timeout": timedelta(minutes=2),
    "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=10), "base": 2},
}
#: connect within 10 s; a request (one part or one chunk) within 60 s, else it is retried or fails
DEFAULT_CLIENT_OPTIONS: dict[str, Any] = {"connect_timeout": "10s", "timeout": "60s"}
#: requests one reader or writer has in flight at most
DEFAULT_MAX_REQUESTS = 32
#: size of a multipart upload's parts (S3 takes 5 MiB to 5 GiB)
DEFAULT_PART_BYTES = 16 << 20
#: parts of one multipart upload sent at once
DEFAULT_PARTS_IN_FLIGHT = 8
_MIN_PART_BYTES = 5 << 20


def retry_config(given: Any) -> dict[str, Any]:
    """:data:`DEFAULT_RETRY` with the keys of ``given`` (a dict or None) replacing its own."""
    if given is not None and not isinstance(given, dict):
        raise ValueError(
            f"storage_options retry_config must be a dict of obstore RetryConfig keys, got {given!r}"
        )
    merged = dict(DEFAULT_RETRY)
    merged.update(given or {})
    if "backoff" in (given or {}):
        merged["backoff"] = {**DEFAULT_RETRY["backoff"], **given["backoff"]}  # type: ignore[index]
    return merged


def client_options(given: dict[str, Any]) -> dict[str, Any]:
    """:data:`DEFAULT_CLIENT_OPTIONS` under the caller's ``client_options``."""
    return {**DEFAULT_CLIENT_OPTIONS, **given}


def _positive_int(name: str, value: Any, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"storage_options {name} must be an integer >= {least}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class TransferOptions:
    """The transfer settings of one reader or writer (see the module docstring)."""

    max_requests: int = DEFAULT_MAX_REQUESTS
    part_bytes: int = DEFAULT_PART_BYTES
    max_parts_in_flight: int = DEFAULT_PARTS_IN_FLIGHT


def pop_transfer_options(options: dict[str, Any]) -> TransferOptions:
    """Take ``max_requests``, ``part_bytes`` and ``max_parts_in_flight`` out of ``options``, validated."""
    return TransferOptions(
        _positive_int("max_requests", options.pop("max_requests", DEFAULT_MAX_REQUESTS)),
        _positive_int("part_bytes", options.pop("part_bytes", DEFAULT_PART_BYTES), _MIN_PART_BYTES),
        _positive_int("max_parts_in_flight", options.pop("max_parts_in_flight", DEFAULT_PARTS_IN_FLIGHT)),
    )


class RequestBudget:
    """At most ``limit`` requests in flight: :meth:`take` blocks until ``n`` slots are free.

    ``n`` slots are taken at once (never a few now and the rest later), so two
    multipart uploads waiting for slots cannot deadlock each other.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free = limit
        self._cond = threading.Condition()

    @contextmanager
    def take(self, n: int = 1) -> Iterator[int]:
        n = max(1, min(n, self.limit))
        with self._cond:
            self._cond.wait_for(lambda: self._free >= n)
            self._free -= n
        try:
            yield n
        finally:
            with self._cond:
                self._free += n
                self._cond.notify_all()

    @property
    def in_use(self) -> int:
        with self._cond:
            return self.limit - self._free
