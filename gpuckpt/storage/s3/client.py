"""How gpuckpt talks to an object store: retries, timeouts, requests in flight, multipart parts.

Everything here is the object-store client's own machinery (obstore, on the
Rust ``object_store`` crate), configured, not a retry loop of ours:

* **Retries.** Server errors (5xx, 503 SlowDown included), dropped and reset
  connections and timeouts of reads are retried by the client with
  exponential backoff and jitter (:data:`DEFAULT_RETRY`); a caller's
  ``retry_config`` replaces it key by key (unknown keys are refused). The
  client does not retry a conditional put that failed in transit (it may have
  reached the server): :mod:`gpuckpt.storage.s3.fence` retries those of
  documents and chunks, and its conditional deletes, with the same settings
  and the same schedule (:class:`Retries`). Either way no retry starts once
  ``retry_timeout`` has passed since the request's first attempt, the
  attempts' own time included; the attempt then under way may still take its
  ``timeout``.
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
  within the request and memory budgets. The client aborts an upload that
  failed; when the abort fails too it reports only that, and
  :func:`upload_left_by` names the upload left. The client can neither list
  incomplete uploads nor abort one by its id (nor presign those requests), so
  uploads left by a save killed mid-upload are the bucket's lifecycle rule's
  to remove (docs/object-storage.md).

The gpuckpt keys of ``storage_options`` handled here are popped by
:func:`pop_transfer_options`; the rest go to the store, opened by
:func:`obstore_for` (``s3://`` URLs, with the spellings of fsspec and boto
accepted for its settings).
"""

from __future__ import annotations

import math
import os
import random
import re
import threading
import time
import unicodedata
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from numbers import Real
from typing import Any
from urllib.parse import urlsplit

from gpuckpt.errors import InvalidOptionError, InvalidPathError

__all__ = [
    "DEFAULT_CLIENT_OPTIONS",
    "DEFAULT_MAX_REQUESTS",
    "DEFAULT_PART_BYTES",
    "DEFAULT_RETRY",
    "RequestBudget",
    "Retries",
    "TransferOptions",
    "WatchedPieces",
    "plan_parts",
    "client_options",
    "pop_transfer_options",
    "retry_config",
    "upload_left_by",
]

#: at most 10 retries of a request, none starting later than 2 minutes after its first attempt;
#: the first pause 100 ms, each next one drawn between 100 ms and twice the last, at most 10 s
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


_RETRY_KEYS = ("max_retries", "retry_timeout", "backoff")
_BACKOFF_KEYS = ("init_backoff", "max_backoff", "base")


def retry_config(given: Any) -> dict[str, Any]:
    """:data:`DEFAULT_RETRY` with the keys of ``given`` (a dict or None) replacing its own.

    Raises :class:`~gpuckpt.errors.InvalidOptionError` for another type, an unknown key (a
    misspelt one would be dropped without a word) or a value the client cannot use.
    """
    given = {} if given is None else given
    backoff = _known_keys("retry_config", given, _RETRY_KEYS).get("backoff", {})
    merged = {**DEFAULT_RETRY, **given}
    merged["backoff"] = {
        **DEFAULT_RETRY["backoff"],
        **_known_keys("retry_config backoff", backoff, _BACKOFF_KEYS),
    }
    _check_retry_values(merged)
    return merged


def _known_keys(name: str, given: Any, known: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(given, Mapping):
        raise InvalidOptionError(
            f"storage_options {name} must be a dict with some of the keys {', '.join(known)}, got {given!r}"
        )
    unknown = sorted(str(k) for k in given if k not in known)
    if unknown:
        raise InvalidOptionError(
            f"storage_options {name} has unknown key(s) {', '.join(unknown)}; the known keys are "
            f"{', '.join(known)}"
        )
    return dict(given)


def _check_retry_values(cfg: dict[str, Any]) -> None:
    """Refuse what the client would take for something else, or panic on (a base of 1 makes an
    empty range of pauses to draw from)."""
    retries, backoff = cfg["max_retries"], cfg["backoff"]
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise InvalidOptionError(
            f"storage_options retry_config max_retries must be an integer >= 0, got {retries!r}"
        )
    for key, where in (("retry_timeout", cfg), ("init_backoff", backoff), ("max_backoff", backoff)):
        value = where[key]
        if not isinstance(value, timedelta) or value <= timedelta(0):
            raise InvalidOptionError(
                f"storage_options retry_config {key} must be a datetime.timedelta longer than zero, "
                f"got {value!r}"
            )
    if backoff["max_backoff"] < backoff["init_backoff"]:
        raise InvalidOptionError(
            f"storage_options retry_config backoff max_backoff ({backoff['max_backoff']}) must be at least "
            f"init_backoff ({backoff['init_backoff']})"
        )
    base = backoff["base"]
    if isinstance(base, bool) or not isinstance(base, Real) or not math.isfinite(base) or base <= 1:
        raise InvalidOptionError(
            f"storage_options retry_config backoff base must be a finite number > 1, got {base!r}"
        )


class Retries:
    """The retries of one request that gpuckpt sends itself (a conditional put or delete), on the
    schedule the client follows for its own (``retry_config``, see the module docstring).

    After each failed attempt :meth:`pause` says how long to wait before the next one, or None:
    ``max_retries`` are spent, or the pause would end past ``retry_timeout`` after the first
    attempt began (a monotonic clock, the attempts' own time counted, so a request whose
    attempts each hang until their timeout still stops in time).
    """

    def __init__(self, config: Any) -> None:
        cfg = config if isinstance(config, dict) else DEFAULT_RETRY
        backoff = {**DEFAULT_RETRY["backoff"], **(cfg.get("backoff") or {})}
        self.max_retries = int(cfg.get("max_retries", DEFAULT_RETRY["max_retries"]))
        self.timeout = _seconds(cfg.get("retry_timeout", DEFAULT_RETRY["retry_timeout"]))
        self._init, self._cap = _seconds(backoff["init_backoff"]), _seconds(backoff["max_backoff"])
        self._base = float(backoff["base"])
        self._next = self._init
        self._start = time.monotonic()
        #: attempts that failed so far
        self.failed = 0

    def elapsed(self) -> float:
        """Seconds since the first attempt began."""
        return time.monotonic() - self._start

    def left(self) -> float:
        """Seconds left of ``retry_timeout`` (0 once spent)."""
        return max(0.0, self.timeout - self.elapsed())

    def pause(self) -> float | None:
        """After a failed attempt: the pause before the next one, or None when none is left."""
        self.failed += 1
        pause = self._next
        # decorrelated jitter, as the client draws its own: between the first pause and base times the last
        self._next = min(self._cap, random.uniform(self._init, self._next * self._base))
        if self.failed > self.max_retries or self.elapsed() + pause > self.timeout:
            return None
        return pause

    def spent(self) -> str:
        """What the request cost, for an error: its attempts and how long they took."""
        return (
            f"{self.failed} attempt(s) over {self.elapsed():.1f} s (retry_config: at most "
            f"{self.max_retries} retries, none after retry_timeout {self.timeout:g} s)"
        )


def _seconds(value: Any) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def client_options(given: dict[str, Any]) -> dict[str, Any]:
    """:data:`DEFAULT_CLIENT_OPTIONS` under the caller's ``client_options``."""
    return {**DEFAULT_CLIENT_OPTIONS, **given}


def _positive_int(name: str, value: Any, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidOptionError(f"storage_options {name} must be an integer >= {least}, got {value!r}")
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


class WatchedPieces:
    """The pieces of a multipart upload, keeping the error their source raised: the client
    may report another one, the failure of the abort that followed."""

    def __init__(self, pieces: Iterator[Any]) -> None:
        self._pieces = pieces
        self.raised: BaseException | None = None

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._pieces)
        except StopIteration:
            raise
        except BaseException as exc:
            self.raised = exc
            raise


#: the client's report of a failed abort of a multipart upload (``DELETE key?uploadId=...``)
_ABORT_FAILED = re.compile(r"Error performing DELETE \S*?[?&]uploadId=([^\s&]+)")


def upload_left_by(exc: BaseException) -> str | None:
    """When the client's error ``exc`` of a multipart upload is the failure of its abort (the
    failure that led to the abort is not reported), what that leaves on the server; else None."""
    left = _ABORT_FAILED.search(str(exc))
    if left is None:
        return None
    return (
        f"aborting the multipart upload then failed too ({first_line(exc)}), so its incomplete upload "
        f"{left.group(1)} stays on the server, holding the parts sent, until it is aborted or the "
        "bucket's lifecycle rule AbortIncompleteMultipartUpload removes it (see docs/object-storage.md)"
    )


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
        whole bucket), a prefix with empty, ``.`` or ``..`` segments, or a control character.
    """
    control = next((c for c in url if unicodedata.category(c) == "Cc"), None)
    if control is not None:
        # (the client would refuse it deep in a request, or panic; no S3 key should hold one)
        raise InvalidPathError(
            f"{url!r} holds the control character {control!r}; an s3:// URL names its bucket and prefix "
            "in printable characters"
        )
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


#: the storage_options keys (any case) that obstore takes for an endpoint's URL
_ENDPOINT_KEYS = frozenset(
    {
        "endpoint",
        "endpoint_url",
        "aws_endpoint",
        "aws_endpoint_url",
        "aws_endpoint_url_s3",
        "metadata_endpoint",
        "aws_metadata_endpoint",
    }
)
#: the environment variables obstore takes the endpoint from: the first wins over storage_options,
#: the others only stand in for an endpoint they do not name
_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")


def _check_endpoint(value: Any, where: str) -> None:
    """Refuse an endpoint that is not an http(s) URL with a host: the client takes any text
    and panics on it at the first request (a ``BaseException`` and a Rust backtrace)."""
    text = value if isinstance(value, str) else ""
    parts = urlsplit(text)
    try:
        parts.port  # noqa: B018 - a port out of range or not a number raises here
        port_ok = True
    except ValueError:
        port_ok = False
    odd = any(c.isspace() or unicodedata.category(c) == "Cc" for c in text)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname or odd or not port_ok:
        raise InvalidOptionError(
            f"{where} must be an http:// or https:// URL with a host and no spaces, such as "
            f"'https://s3.example.com' or 'http://127.0.0.1:9000', got {value!r}"
        )


def _check_endpoints(options: dict[str, Any]) -> None:
    """Every endpoint the client will use: those of ``options``, else those of the environment."""
    given = [k for k in options if str(k).lower() in _ENDPOINT_KEYS]
    for k in given:
        _check_endpoint(options[k], f"storage_options {k}")
    for i, name in enumerate(_ENDPOINT_ENV):
        if name in os.environ and (i == 0 or not given):
            _check_endpoint(os.environ[name], f"the environment variable {name}")


def _s3_config(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``storage_options`` -> (S3Store keyword arguments, client options)."""
    config: dict[str, Any] = {}
    client = _known_client_options(options.pop("client_options", None))
    _check_endpoints(options)  # (by the names the caller used)
    for k, v in options.items():
        config[_ALIASES.get(k, k)] = v
    # the endpoint given, else the one obstore takes from the environment (gpuckpt verify s3://...)
    endpoint = config.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
    if "allow_http" in config:
        client["allow_http"] = bool(config.pop("allow_http"))
    elif str(endpoint or "").startswith("http://"):
        client["allow_http"] = True  # the caller named a plain-HTTP endpoint
    return config, client


def _known_client_options(given: Any) -> dict[str, Any]:
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise InvalidOptionError(
            f"storage_options client_options must be a dict of obstore ClientConfig keys (such as "
            f"{{'timeout': '60s', 'connect_timeout': '10s'}}), got {given!r}"
        )
    return dict(given)


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
    except (BaseError, TypeError, ValueError, OverflowError) as exc:
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
