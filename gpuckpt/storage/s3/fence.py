"""Fencing: what a writer that lost its ``s3://`` prefix may still send must change nothing there.

A save checks its claim (:mod:`gpuckpt.storage.s3.claim`) before each request,
but a check cannot stop a request already sent, or about to be sent by a
process that stops right after its check (SIGSTOP, a hung node, a request held
in the network): it reaches the server whenever the process resumes, possibly
after another save took the prefix over. Only a condition that the server
evaluates with the request excludes that, so with ``conditional_writes`` on:

* **Puts** of documents and chunks create their object (``If-None-Match: *``),
  and a put of a key the writer put before replaces exactly its own object
  (``If-Match`` on the ETag its put returned). A late put of a stale writer is
  refused (412) wherever the new owner wrote; the new owner's put refused
  because a stale writer's put landed first finds that stray, deletes it
  (:func:`delete_if_unchanged`) and puts again (:data:`STRAY_ATTEMPTS` times
  at most, then :class:`~gpuckpt.errors.CheckpointWriteError`); a put refused
  because its own earlier attempt went through (the answer was lost) finds its
  own bytes and counts as done (:func:`same_bytes`). A writer whose put is
  refused by another save's object, and whose claim is gone, stops with
  :class:`~gpuckpt.errors.CheckpointExistsError` ("taken over"). The client
  does not retry a conditional put that failed in transit (it may have reached
  the server), so :class:`Fence` does, as ``retry_config`` says
  (:class:`~gpuckpt.storage.s3.client.Retries`: no retry once ``retry_timeout``
  has passed since the first attempt, the attempts' time counted). None of this
  adds a request to a save that meets no stray: a conditional put is one put.
* **Deletes** of checkpoint objects (a save's abort, the cleanup after a
  takeover, a stray) are ``DELETE`` requests with ``If-Match`` on the ETag the
  object was listed or put with (honoured by AWS S3 general purpose buckets
  since September 2025, Ceph RGW and moto; a server that ignores the header
  deletes as before), so an object another save put since is not deleted. The
  object-store client has no conditional delete: they go out as presigned
  requests (:func:`obstore.sign`) over :mod:`urllib`, which follows neither
  ``client_options`` nor the client's connection pool; failures in transit and
  5xx answers are retried as ``retry_config`` says (a retry of a delete that
  went through finds the object gone, which counts as deleted). An abort makes
  one such request per object instead of one bulk request per 1,000, and
  renews its claim (a compare-and-swap put) first and keeps refreshing it
  while it deletes: each delete goes out only while the claim holds (renewed
  less than half a lease ago), so a writer stalled meanwhile sends at most the
  deletes already past that check. What an abort could not delete, with its
  claim, is left to the next save's cleanup.

What stays unfenced, narrowed by the claim checks only:

* the completion of a multipart upload (chunks of at least two ``part_bytes``):
  the client completes it without a condition, so the claim is checked before
  every piece handed to the upload, and a stale writer resumed mid-upload
  stops at its next piece; a completion already under way still lands;
* a server-side copy of a base chunk in an incremental save (``CopyObject``);
* the root document's put: conditional (one root per prefix), but a stale
  writer's, landing before the new owner publishes, would publish;
* a late delete of an object whose bytes the new owner put again unchanged:
  an ETag is a hash of the bytes, so the two cannot be told apart (an array
  document of the same shape, a chunk of the same values); only the renewal
  before an abort's deletes protects those.

With ``conditional_writes=False`` nothing is fenced: puts and deletes are
plain, and one save at a time per prefix is the caller's promise.
"""

from __future__ import annotations

import errno
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from gpuckpt.errors import CheckpointExistsError, CheckpointWriteError
from gpuckpt.storage.s3.claim import Claim, claim_token
from gpuckpt.storage.s3.client import Retries, first_line
from gpuckpt.storage.s3.prefix import CLAIM_KEY, Prefix

__all__ = ["STRAY_ATTEMPTS", "Fence", "delete_if_unchanged", "same_bytes"]

#: puts of one key a writer makes at most while stale writers' strays keep landing there
STRAY_ATTEMPTS = 4
#: how long a presigned delete stays valid (it is sent at once)
_SIGNED_FOR = timedelta(minutes=10)
_DELETE_TIMEOUT_S = 60.0
#: what the client reports when a request failed in transit (it may have reached the server)
_IN_TRANSIT = re.compile(
    r"error sending request|timed out|timeout|connection|body error|reset|broken pipe|status code: 5\d\d",
    re.I,
)


def same_bytes(stored: Any, pieces: Sequence[Any]) -> bool:
    """Whether the buffer ``stored`` holds exactly ``pieces``, one after the other."""
    whole = memoryview(stored).cast("B")
    at = 0
    for p in pieces:
        view = memoryview(p).cast("B")
        if whole[at : at + view.nbytes] != view:
            return False
        at += view.nbytes
    return at == whole.nbytes


def delete_if_unchanged(
    store: Any, etags: dict[str, str], max_requests: int, may_send: Callable[[], bool] | None = None
) -> dict[str, str]:
    """Delete each object ``key`` of ``etags`` only while its ETag is ``etags[key]``, and (with
    ``may_send``) only while ``may_send()`` says so just before the request goes out.

    At most ``max_requests`` are in flight (the writer's budget). Returns the keys left, each
    with why: ``"changed"`` (the server refused, the object was put again since) or the
    failure of the request. An object already gone counts as deleted.
    """
    import obstore as obs

    if not etags:
        return {}
    keys = sorted(etags)
    try:
        urls = list(obs.sign(store, "DELETE", keys, _SIGNED_FOR))
    except Exception as exc:
        return dict.fromkeys(keys, f"the delete could not be signed ({type(exc).__name__}: {exc})")

    def once(i: int, timeout: float) -> tuple[str | None, bool]:
        """(why the object was left, whether to try again)."""
        req = urllib.request.Request(urls[i], method="DELETE", headers={"If-Match": etags[keys[i]]})
        try:
            with urllib.request.urlopen(req, timeout=timeout):
                return None, False
        except urllib.error.HTTPError as exc:
            # gone counts as deleted: a retry of a delete that went through finds nothing
            if exc.code in (404, 412):
                return (None if exc.code == 404 else "changed"), False
            return f"HTTP {exc.code} {exc.reason}", exc.code >= 500
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}", True

    def one(i: int) -> str | None:
        retries = Retries(getattr(store, "retry_config", None))
        while True:
            if may_send is not None and not may_send():
                return "the claim may have passed to another save"
            # an attempt ends with what is left of retry_timeout (a second at least)
            why, again = once(i, max(1.0, min(_DELETE_TIMEOUT_S, retries.left())))
            pause = retries.pause() if again else None
            if pause is None:
                return why if not again else f"{why}, after {retries.spent()}"
            time.sleep(pause)

    with ThreadPoolExecutor(max(1, min(len(keys), max_requests))) as pool:
        outcomes = list(pool.map(one, range(len(keys))))
    return {k: why for k, why in zip(keys, outcomes, strict=True) if why is not None}


class Fence:
    """The fenced puts and deletes of the writer ``token`` under ``prefix``, claimed by ``claim``
    (the claim of the save it writes for: its own, or another rank's)."""

    def __init__(self, prefix: Prefix, claim: Claim, token: str) -> None:
        self.prefix, self.claim, self.token = prefix, claim, token
        #: key -> ETag of this writer's last put of it: a put of that key again replaces only that
        self.etags: dict[str, str] = {}

    def put_done(self, rel: str, etag: str | None) -> None:
        """Record the ETag of a put of ``rel`` made without a condition (a multipart upload)."""
        if etag is None:
            self.etags.pop(rel, None)
        else:
            self.etags[rel] = etag

    def put(self, rel: str, pieces: list[Any], nbytes: int) -> None:
        """Put ``pieces`` (``nbytes`` in all) at ``rel`` in one request: creating the object, or
        replacing this writer's own last put of it (plain with ``conditional_writes=False``)."""
        import obstore as obs
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        p = self.prefix
        # the client gathers the pieces into its own buffer: no joined copy of ours first
        body = pieces if len(pieces) > 1 else pieces[0]
        if not p.conditional:
            self.put_done(rel, obs.put(p._obs, rel, body, use_multipart=False)["e_tag"])
            return
        for _ in range(STRAY_ATTEMPTS):
            known = self.etags.get(rel)
            mode: Any = {"e_tag": known} if known is not None else "create"
            try:
                self.put_done(rel, self._put_retried(rel, body, mode)["e_tag"])
                return
            except (AlreadyExistsError, PreconditionError, FileNotFoundError):
                pass
            # refused: our own put went through before (its answer lost, the retry refused), or
            # the object is another writer's: a stray of a save that lost the prefix, or the
            # object of the save that took the prefix from this one
            try:
                found = obs.get(p._obs, rel)
            except FileNotFoundError:
                self.etags.pop(rel, None)  # gone meanwhile: create it
                continue
            etag = found.meta["e_tag"]
            if found.meta["size"] == nbytes and same_bytes(found.bytes(), pieces):
                self.put_done(rel, etag)  # the bytes meant for it, whoever put them
                return
            self.refuse_if_taken_over(rel)
            self.delete_abandoned({rel: etag})
            self.etags.pop(rel, None)
        raise CheckpointWriteError(
            errno.EIO,
            f"writing {rel} at {p.path}: {STRAY_ATTEMPTS} puts were refused, each time because another "
            "writer's object had appeared at that key while this save held the prefix; some process "
            f"still writes under {p.path} without its claim: stop it, then save again",
        )

    def _put_retried(self, rel: str, body: Any, mode: Any) -> Any:
        """A conditional put, tried again after a failure in transit as the client's
        ``retry_config`` says: the client does not retry a conditional put that may have reached
        the server. A retry refused because the first one went through is settled by :meth:`put`."""
        import obstore as obs
        from obstore.exceptions import GenericError

        store = self.prefix._obs
        retries = Retries(getattr(store, "retry_config", None))
        while True:
            try:
                return obs.put(store, rel, body, mode=mode, use_multipart=False)
            except GenericError as exc:
                if not _IN_TRANSIT.search(str(exc)):
                    raise
                pause = retries.pause()
                if pause is None:
                    raise CheckpointWriteError(
                        errno.EIO,
                        f"writing {rel} at {self.prefix.path} failed: the put got no answer it could use "
                        f"in {retries.spent()}; the last: {first_line(exc)}. Check the endpoint and the "
                        "network, or allow more time with storage_options retry_config",
                    ) from exc
                time.sleep(pause)

    def refuse_if_taken_over(self, rel: str) -> None:
        """Raise :class:`~gpuckpt.errors.CheckpointExistsError` (this save was taken over)
        unless the prefix's claim is still the one of this writer's save; ``rel`` holds an
        object that is not this writer's."""
        claim, path = self.claim, self.prefix.path
        claim.check()
        _, token = claim_token(self.prefix)
        if token != self.token:
            claim.lost = claim.lost or (
                f"the claim on {path} was taken over by another save while this one ran ({rel} holds "
                "another save's object); this save was discarded and wrote nothing over it"
            )
            raise CheckpointExistsError(claim.lost)

    def delete_abandoned(self, seen: dict[str, str | None]) -> None:
        """Delete the objects ``seen`` (key -> ETag listed) of a save that lost the prefix to
        this one, each only while it is the object listed: should this writer lose the prefix in
        turn before a delete arrives, it deletes nothing the next save put (bytes aside, see the
        module docstring). Without an ETag, with ``conditional_writes=False``, or where the
        conditional delete could not be sent, a plain delete, the claim checked first."""
        import obstore as obs

        p = self.prefix
        plain = [k for k, etag in seen.items() if etag is None or not p.conditional]
        fenced = {k: e for k, e in seen.items() if e is not None and k not in plain}
        left = delete_if_unchanged(p._obs, fenced, p.transfer.max_requests, self.claim.holds)
        if any(why.startswith("the claim") for why in left.values()):
            self.claim.check()
        # "changed": put again since it was listed, by a writer that lost the prefix (only a
        # multipart upload lands without a condition); this save's conditional put of that key
        # finds it and replaces it, a key it does not write stays a stray
        plain += [k for k, why in left.items() if why != "changed"]
        if plain:
            self.claim.check()
            with p._io("deleting the objects of an abandoned save", CheckpointWriteError):
                obs.delete(p._obs, plain)

    def release_claim(self) -> bool:
        """Delete the claim object, only while it is the one this save put last (If-Match on
        its ETag; plain with ``conditional_writes=False``): False when it was left."""
        import obstore as obs

        p, etag = self.prefix, self.claim.etag
        if etag is None:
            return False
        if not p.conditional:
            try:
                obs.delete(p._obs, [CLAIM_KEY])
            except Exception:
                return False
            return True
        return not delete_if_unchanged(p._obs, {CLAIM_KEY: etag}, p.transfer.max_requests)

    def still_as_put(self, listed: dict[str, str | None]) -> dict[str, str]:
        """Of ``listed`` (key -> ETag), the objects that are as this writer put them, or that it
        did not put (another rank's): what an abort deletes, each only while it is as listed."""
        out: dict[str, str] = {}
        for key, seen in listed.items():
            mine = self.etags.get(key)
            if seen is not None and mine in (None, seen):
                out[key] = seen
        return out
