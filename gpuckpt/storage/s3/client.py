"""How gpuckpt talks to an object store: retries, timeouts, requests in flight, multipart parts.

Everything here is the object-store client's own machinery (obstore, on the
Rust ``object_store`` crate), configured, not a retry loop of ours:

* **Retries.** Server errors (5xx, 503 SlowDown included), dropped and reset
  connections and timeouts of reads are retried by the client with
  exponential backoff and jitter (:data:`DEFAULT_RETRY`); a caller's
  ``retry_config`` replaces it key by key. The client does not retry a
  conditional put that failed in transit (it may have reached the server):
  :mod:`gpuckpt.storage.s3.fence` retries those of documents and chunks, and
  its conditional deletes, with the same settings.
* **Timeouts.** :data:`DEFAULT_CLIENT_OPTIONS` bounds connecting and each
  request, so a stalled connection is given up and retried instead of hanging
  a save; a caller's ``client_options`` win.
* **Requests in flight.** A :class:`RequestBudget` of ``max_requests`` slots
  per reader or writer: a plain put or get takes one, a multipart upload one
  per part it sends at once. A rank does not flood the endpoint.
* **Upload memory.** The client gathers what a put sends (a chunk and its
  checksum trailer, or a multipart part) into a buffer of its own while it is
  in flight; the same budget bounds those buffers to ``upload_buffer_bytes``
  per writer (default 256 MiB), next to the save's ``staging_bytes``, whatever
  the number of I/O threads. A single chunk larger than that budget goes alone.
* **Multipart.** A chunk of at least two ``part_bytes`` goes up as a multipart
  upload (:func:`plan_parts`: parts of ``part_bytes`` to twice that, never a
  tiny last part for the trailer), up to ``max_parts_in_flight`` parts at once,
  within the request and memory budgets.

The gpuckpt keys of ``storage_options`` handled here are popped by
:func:`pop_transfer_options`; the rest go to the store, opened by
:func:`obstore_for` (``s3://`` URLs, with the spellings of fsspec and boto
accepted for its settings).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from gpuckpt.errors import InvalidOptionError, InvalidPathError

__all__ = [
    "DEFAULT_CLIENT_OPTIONS",
    "DEFAULT_MAX_REQUESTS",
    "DEFAULT_PART_BYTES",
    "DEFAULT_RETRY",
    "RequestBudget",
    "TransferOptions",
    "plan_parts",
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
#: bytes of the client's put buffers one writer may hold at once
DEFAULT_UPLOAD_BUFFER_BYTES = 256 << 20
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
    upload_buffer_bytes: int = DEFAULT_UPLOAD_BUFFER_BYTES


def pop_transfer_options(options: dict[str, Any]) -> TransferOptions:
    """Take ``max_requests``, ``part_bytes``, ``max_parts_in_flight`` and ``upload_buffer_bytes``
    out of ``options``, validated."""
    return TransferOptions(
        _positive_int("max_requests", options.pop("max_requests", DEFAULT_MAX_REQUESTS)),
        _positive_int("part_bytes", options.pop("part_bytes", DEFAULT_PART_BYTES), _MIN_PART_BYTES),
        _positive_int("max_parts_in_flight", options.pop("max_parts_in_flight", DEFAULT_PARTS_IN_FLIGHT)),
        _positive_int("upload_buffer_bytes", options.pop("upload_buffer_bytes", DEFAULT_UPLOAD_BUFFER_BYTES)),
    )


def plan_parts(nbytes: int, part_bytes: int) -> tuple[int, int]:
    """``(parts, part size)`` of an upload of ``nbytes``: one part below ``2 * part_bytes``, else
    equal parts of ``part_bytes`` up to twice that (the last one a little smaller).

    >>> plan_parts((16 << 20) + 4, 16 << 20)   # a chunk and its trailer: one put, not 16 MiB + 4 bytes
    (1, 16777220)
    >>> plan_parts((64 << 20) + 4, 16 << 20)
    (4, 16777217)
    """
    parts = max(1, nbytes // part_bytes)
    return parts, -(-nbytes // parts)


class RequestBudget:
    """At most ``limit`` requests and ``byte_limit`` bytes of put buffers in flight.

    :meth:`take` blocks until ``n`` slots and ``nbytes`` bytes are free, and takes
    them at once (never a few now and the rest later), so two multipart uploads
    waiting for room cannot deadlock each other. A request larger than the whole
    byte budget waits until it is alone.
    """

    def __init__(self, limit: int, byte_limit: int = DEFAULT_UPLOAD_BUFFER_BYTES) -> None:
        self.limit, self.byte_limit = limit, byte_limit
        self._free, self._free_bytes = limit, byte_limit
        self._cond = threading.Condition()

    @contextmanager
    def take(self, n: int = 1, nbytes: int = 0) -> Iterator[int]:
        """Hold ``n`` request slots (at most ``limit``) and ``nbytes`` bytes; yields the slots held."""
        n = max(1, min(n, self.limit))
        b = max(0, min(nbytes, self.byte_limit))
        with self._cond:
            self._cond.wait_for(lambda: self._free >= n and self._free_bytes >= b)
            self._free -= n
            self._free_bytes -= b
        try:
            yield n
        finally:
            with self._cond:
                self._free += n
                self._free_bytes += b
                self._cond.notify_all()

    @property
    def in_use(self) -> tuple[int, int]:
        """Requests and bytes held now."""
        with self._cond:
            return self.limit - self._free, self.byte_limit - self._free_bytes


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


# storage_options spellings (fsspec/s3fs and boto) -> obstore S3Config keys
_ALIASES = {
    "endpoint_url": "endpoint",
    "region_name": "region",
    "key": "access_key_id",
    "aws_access_key_id": "access_key_id",
    "secret": "secret_access_key",
    "aws_secret_access_key": "secret_access_key",
    "token": "session_token",
    "aws_session_token": "session_token",
    "anon": "skip_signature",
}


def parse_s3_url(url: str) -> tuple[str, str]:
    """Split ``s3://bucket/some/prefix`` into bucket and normalised prefix.

    Raises
    ------
    InvalidPathError
        (a ``ValueError``) For another scheme, no bucket, no prefix (a checkpoint never takes a
        whole bucket), or a prefix with empty, ``.`` or ``..`` segments.
    """
    scheme, sep, rest = url.partition("://")
    if scheme.lower() != "s3" or not sep:
        raise InvalidPathError(f"{url!r} is not an s3:// URL; expected s3://bucket/prefix")
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.rstrip("/")  # (a trailing slash names the same prefix; a leading one is an empty segment)
    segments = prefix.split("/") if prefix else []
    bad = [s for s in segments if s in ("", ".", "..") or any(c in s for c in "\\\0?#")]
    if not bucket or not segments or bad:
        raise InvalidPathError(
            f"{url!r}: expected s3://bucket/prefix with a non-empty prefix of plain segments "
            f"(no '', '.', '..', '?', '#'); found bucket {bucket!r}, prefix {prefix!r}"
        )
    return bucket, prefix


def _s3_config(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``storage_options`` -> (S3Store keyword arguments, client options)."""
    config: dict[str, Any] = {}
    client = dict(options.pop("client_options", None) or {})
    for k, v in options.items():
        config[_ALIASES.get(k, k)] = v
    # the endpoint given, else the one obstore takes from the environment (gpuckpt verify s3://...)
    endpoint = config.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
    if "allow_http" in config:
        client["allow_http"] = bool(config.pop("allow_http"))
    elif str(endpoint or "").startswith("http://"):
        client["allow_http"] = True  # the caller named a plain-HTTP endpoint
    return config, client


def obstore_for(url: str, options: dict[str, Any]) -> Any:
    try:
        from obstore.exceptions import BaseError
        from obstore.store import S3Store
    except ImportError:
        raise ImportError(
            f"{url}: s3:// checkpoints need the obstore package; install it with pip install 'gpuckpt[s3]'"
        ) from None

    bucket, prefix = parse_s3_url(url)
    config, client = _s3_config(dict(options))
    retry = retry_config(config.pop("retry_config", None))
    try:
        return S3Store(
            bucket,
            prefix=prefix,
            client_options=client_options(client),  # type: ignore[arg-type]
            retry_config=retry,  # type: ignore[arg-type]
            **config,
        )
    except (BaseError, TypeError) as exc:
        raise InvalidOptionError(
            f"storage_options for {url} are not valid S3 settings ({first_line(exc)}); use endpoint_url, "
            "region, access_key_id, secret_access_key, session_token, allow_http, skip_signature, "
            "or another obstore S3Config key"
        ) from None


def zarr_store(url: str, *, read_only: bool = True, **storage_options: Any) -> Any:
    """A :class:`zarr.storage.ObjectStore` on the prefix of ``url``, to open a checkpoint with zarr.

    Examples
    --------
    >>> store = zarr_store("s3://bucket/ckpt", endpoint_url="http://127.0.0.1:9000")  # doctest: +SKIP
    >>> zarr.open_array(store, path="model.w", mode="r")[:]  # doctest: +SKIP
    """
    from zarr.storage import ObjectStore

    return ObjectStore(obstore_for(url, storage_options), read_only=read_only)
