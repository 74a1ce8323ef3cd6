"""What the readers, writers and roots of ``s3://`` prefixes share: the object store client,
the error translation, object keys inside a prefix and the claim object's name."""

from __future__ import annotations

import contextlib
import errno
import math
from collections.abc import Iterator
from numbers import Real
from typing import Any

from gpuckpt.errors import InvalidOptionError, InvalidPathError, StoreError
from gpuckpt.format.documents import ROOT_DOCUMENT_PREFIX, ROOT_KEY, is_chunk_file_key, too_large
from gpuckpt.format.names import is_safe_name
from gpuckpt.format.records import is_column_array_name
from gpuckpt.storage.s3.client import (
    RequestBudget,
    first_line,
    obstore_for,
    parse_s3_url,
    pop_transfer_options,
)

__all__ = [
    "CLAIM_KEY",
    "CLOCK_PROBE_PREFIX",
    "DEFAULT_LEASE_SECONDS",
    "MAX_CLAIM_BYTES",
    "Prefix",
    "holds_checkpoint",
    "is_checkpoint_object",
    "object_key",
]

CLAIM_KEY = ".gpuckpt-writer"
#: keys of the empty objects a writer puts to read the server's clock (a writer's token follows)
CLOCK_PROBE_PREFIX = ".gpuckpt-clock-"
DEFAULT_LEASE_SECONDS = 60.0
#: a week: a claim not refreshed for longer is far past any stall a save survives
MAX_LEASE_SECONDS = 7 * 24 * 3600.0
MAX_CLAIM_BYTES = 1 << 24


def _lease_seconds(value: Any) -> float:
    """``lease_seconds``, refused unless a finite number in (0, :data:`MAX_LEASE_SECONDS`]: the
    claim's heartbeat waits a quarter of it (an infinite wait overflows and kills it)."""
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and 0 < value <= MAX_LEASE_SECONDS):
        raise InvalidOptionError(
            f"storage_options lease_seconds must be a number of seconds > 0 and at most "
            f"{MAX_LEASE_SECONDS:g} (default {DEFAULT_LEASE_SECONDS:g}), got {value!r}"
        )
    return float(value)


def _conditional_writes(value: Any) -> bool:
    # a string from a config file ("false") would be true: only a bool says which is meant
    if not isinstance(value, bool):
        raise InvalidOptionError(
            f"storage_options conditional_writes must be True or False, got {value!r} "
            f"({type(value).__name__})"
        )
    return value


def is_checkpoint_object(name: str, key: str) -> bool:
    """Whether ``name/key`` is an object a checkpoint holds: the document or a chunk of a
    tensor's array, or of one of the chunk table's columns (large checkpoints)."""
    return (is_safe_name(name) or is_column_array_name(name)) and (key == ROOT_KEY or is_chunk_file_key(key))


def holds_checkpoint(store: Any, rel: str) -> bool:
    """Whether the object ``rel`` of ``store`` (a root document's key) starts as a gpuckpt root
    document does: one ranged GET of its first bytes, as cheap as a HEAD, which also tells
    another program's Zarr store apart (its ``zarr.json`` exists too). Only an empty object,
    whose range the server refuses, costs a HEAD more. Errors are the client's."""
    import obstore as obs
    from obstore.exceptions import BaseError

    try:
        # a shorter object comes back whole (and differs)
        head = obs.get(store, rel, options={"range": (0, len(ROOT_DOCUMENT_PREFIX))}).bytes()
    except FileNotFoundError:
        return False
    except BaseError:
        # an empty object has no first bytes: the range is refused (416); any other failure stands
        try:
            if obs.head(store, rel)["size"] == 0:
                return False
        except FileNotFoundError:
            return False
        raise
    return bytes(head) == ROOT_DOCUMENT_PREFIX


def object_key(name: str, key: str) -> str:
    """Key of ``name/key`` inside the prefix; refuses anything that could leave it."""
    if not is_checkpoint_object(name, key):
        raise ValueError(f"refusing object key {name!r}/{key!r}: not a checkpoint array name and key")
    return f"{name}/{key}"


class Prefix:
    """What readers and writers share: the store and error translation."""

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.lease = _lease_seconds(storage_options.pop("lease_seconds", DEFAULT_LEASE_SECONDS))
        self.conditional = _conditional_writes(storage_options.pop("conditional_writes", True))
        self.transfer = pop_transfer_options(storage_options)
        self.budget = RequestBudget(self.transfer.max_requests, self.transfer.upload_buffer_bytes)
        self.path = url.rstrip("/")
        self._obs = obstore_for(url, storage_options)

    def _bucket_store(self) -> Any:
        """A store on the root of this prefix's bucket, with the same settings (for objects
        under other prefixes: an incremental save's base, the checkpoints this one may be in)."""
        from obstore.store import S3Store

        return S3Store(
            config=self._obs.config,
            client_options=self._obs.client_options,
            retry_config=self._obs.retry_config,
            credential_provider=self._obs.credential_provider,
        )

    def refuse_inside_a_checkpoint(self) -> None:
        """Refuse this prefix when it lies inside a published checkpoint, at any depth (as a
        local path is refused): deleting that checkpoint (a manager's retention) deletes every
        object under its prefix, this one's too. One ranged GET per enclosing prefix (one for a
        manager's step), before anything is written; for a save, and for a manager's root when
        it is opened."""
        _, prefix = parse_s3_url(self.path)
        segments = prefix.split("/")
        store = self._bucket_store()
        for depth in range(len(segments) - 1, 0, -1):
            outer = "/".join(segments[:depth])
            if holds_checkpoint(store, f"{outer}/{ROOT_KEY}"):
                outer_url = self.path[: len(self.path) - len(prefix)] + outer
                raise InvalidPathError(
                    f"{self.path} is inside the gpuckpt checkpoint {outer_url}: deleting that checkpoint "
                    "(a manager's retention, a removal) would delete what is saved here too; nothing was "
                    "written. Save beside it instead (a sibling prefix)"
                )

    def _put(self, rel: str, data: Any, mode: Any) -> str | None:
        """Put with ``mode`` ("create" or {"e_tag": ...}); plain put when conditional writes are off."""
        import obstore as obs

        if not self.conditional:
            if mode == "create" and self._exists(rel):
                from obstore.exceptions import AlreadyExistsError

                raise AlreadyExistsError(rel)
            mode = "overwrite"
        return obs.put(self._obs, rel, data, mode=mode)["e_tag"]

    def _exists(self, rel: str) -> bool:
        import obstore as obs

        try:
            obs.head(self._obs, rel)
        except FileNotFoundError:
            return False
        return True

    #: what errors of the store become (:meth:`_io`) where no other type is asked for
    _error: type[OSError] = StoreError

    @contextlib.contextmanager
    def _io(self, what: str, error: type[OSError] | None = None) -> Iterator[None]:
        """Turn obstore's errors (not OSErrors, except not-found) into ``error`` naming ``what``.

        Nested blocks name the innermost operation: an error already turned is an
        OSError, which passes through the outer ones.
        """
        error = error or self._error
        from obstore.exceptions import (
            BaseError,
            NotSupportedError,
            PermissionDeniedError,
            UnauthenticatedError,
        )

        try:
            yield
        except FileNotFoundError as exc:  # an object not found passes, a bucket not found does not
            if "NoSuchBucket" in str(exc):
                raise error(errno.ENOENT, self._no_bucket(what)) from None
            raise
        except (PermissionDeniedError, UnauthenticatedError) as exc:
            raise error(
                errno.EACCES,
                f"{what} at {self.path} was refused ({first_line(exc)}); check the credentials "
                "and bucket policy in storage_options",
            ) from None
        except NotSupportedError as exc:
            raise error(
                errno.EOPNOTSUPP,
                f"{what} at {self.path}: the server refused a request ({first_line(exc)}); if it does not "
                "support conditional puts (If-None-Match), pass storage_options conditional_writes=False",
            ) from None
        except BaseError as exc:
            text = str(exc)
            if "NoSuchBucket" in text:
                raise error(errno.ENOENT, self._no_bucket(what)) from None
            if "403 Forbidden" in text or "AccessDenied" in text or "InvalidAccessKeyId" in text:
                raise error(
                    errno.EACCES,
                    f"{what} at {self.path} was refused ({first_line(exc)}); check the credentials "
                    "and bucket policy in storage_options",
                ) from None
            raise error(errno.EIO, f"{what} at {self.path} failed: {first_line(exc)}") from exc

    def _no_bucket(self, what: str) -> str:
        return (
            f"{what} at {self.path}: the bucket does not exist; create it, or fix the bucket in the URL "
            "(and the endpoint in storage_options)"
        )

    def _get_small(self, rel: str, limit: int, name: str) -> bytes | None:
        """The object ``rel`` (None when absent), refused unread above ``limit`` (the cap ``name``)."""
        import obstore as obs

        with self._io(f"reading {rel}"):
            try:
                res = obs.get(self._obs, rel)
            except FileNotFoundError as exc:
                if "NoSuchBucket" in str(exc):  # not an absent object: _io names the bucket
                    raise
                return None
            size = res.meta["size"]
            if size > limit:
                raise too_large(f"{self.path}/{rel}", size, limit, name)
            return bytes(res.bytes())

    def _list(self) -> dict[str, int]:
        """Every object under the prefix: relative key -> size."""
        return {k: size for k, (size, _) in self._list_meta().items()}

    def _list_meta(self) -> dict[str, tuple[int, str | None]]:
        """Every object under the prefix: relative key -> (size, ETag)."""
        import obstore as obs

        with self._io("listing the objects"):
            return {m["path"]: (m["size"], m["e_tag"]) for batch in obs.list(self._obs) for m in batch}
