"""The claim of an ``s3://`` prefix: one save at a time writes under it.

A save creates the claim object (:data:`~gpuckpt.storage.s3.prefix.CLAIM_KEY`)
with a conditional put (``If-None-Match: *``) and refreshes it every quarter
lease on a thread of its own. A claim left by a save that died (its process
is gone from this machine and pid namespace, or it was not refreshed for its
lease) is taken over with a compare-and-swap on its ETag. Ages are read off the
server's clock only: a claim's last-modified time is subtracted from that of a
probe object the writer puts, so a client clock skewed either way judges no
claim. A save that could not refresh its claim for half a lease stops writing,
since the prefix may be another save's by then (a
:class:`~gpuckpt.errors.CheckpointWriteError` when its refreshes failed to reach
the store, a :class:`~gpuckpt.errors.CheckpointExistsError` otherwise).

:class:`Claim` is that protocol and nothing else; :class:`~gpuckpt.storage.s3.writer.ObjectStoreWriter`
takes it in ``begin``, asks it before every put and at commit, and releases it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

from gpuckpt.errors import CheckpointExistsError, CheckpointWriteError
from gpuckpt.storage.local import fsutil
from gpuckpt.storage.s3.client import first_line
from gpuckpt.storage.s3.prefix import CLAIM_KEY, CLOCK_PROBE_PREFIX, MAX_CLAIM_BYTES, Prefix

__all__ = ["Claim", "claim_token", "machine_identity"]

#: the resolution of the times an S3 server reports (``Last-Modified`` is an HTTP date)
_TIME_RESOLUTION = 1.0
#: puts of a clock probe before giving up, when other saves beginning keep deleting it
_PROBE_ATTEMPTS = 5


def machine_identity() -> str:
    """Boot and pid-namespace identity: a pid is only comparable where both match ("" if unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def claim_token(prefix: Prefix) -> tuple[bool, str | None]:
    """Whether ``prefix`` holds a claim, and the token of the save it names (None if unreadable)."""
    raw = prefix._get_small(CLAIM_KEY, MAX_CLAIM_BYTES, "the claim object's limit")
    try:
        found = json.loads(raw or b"null")["token"]
    except (ValueError, KeyError, TypeError):
        found = None
    return raw is not None, found if isinstance(found, str) else None


class Claim:
    """The claim of one save (``token``) on ``prefix``: taken, refreshed, checked, released."""

    def __init__(self, prefix: Prefix, token: str) -> None:
        self.prefix = prefix
        self.token = token
        self.body = json.dumps(
            {
                "owner": fsutil.tmp_owner(),
                "machine": machine_identity(),
                "token": token,
                "started": datetime.now(UTC).isoformat(),
                "lease_seconds": prefix.lease,
            }
        ).encode()
        #: why this save may no longer write or publish (None while the claim holds)
        self.lost: str | None = None
        self._lost_unreachable = False
        self._etag: str | None = None
        # until when (monotonic clock) no other save can have taken the claim over: half a lease
        # after the start of the last put of the claim that went through; writes stop past it
        self._valid_until: float | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        # why the last refresh failed, while none went through since: the store could not be
        # reached (an outage), which a check that finds the claim lapsed reports as such
        self._unreachable: str | None = None

    @property
    def taken(self) -> bool:
        """Whether this save took the claim (it may have lost it since)."""
        return self._etag is not None

    def take(self) -> bool:
        """Claim the prefix; True when that took over the claim of an abandoned save.

        Raises :class:`~gpuckpt.errors.CheckpointExistsError` while another save's claim is alive."""
        import obstore as obs
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        p = self.prefix
        for _ in range(3):
            sent = time.monotonic()
            try:
                self._etag = p._put(CLAIM_KEY, self.body, "create")
                self._renewed(sent)
                return False
            except AlreadyExistsError:
                pass
            try:
                res = obs.get(p._obs, CLAIM_KEY)
            except FileNotFoundError:
                continue  # released meanwhile: try to create it again
            meta, raw = res.meta, bytes(res.bytes())
            if raw == self.body:
                # our own put: it reached the server, its answer was lost and the retry found it
                self._etag = meta["e_tag"]
                self._renewed(sent)
                return False
            self._refuse_live(meta, raw)
            sent = time.monotonic()
            try:  # take the abandoned claim over, unless another writer does so first
                self._etag = p._put(CLAIM_KEY, self.body, {"e_tag": meta["e_tag"]})
                self._renewed(sent)
                return True
            except (PreconditionError, AlreadyExistsError, FileNotFoundError):
                continue
        raise CheckpointExistsError(
            f"{p.path}: other saves keep claiming this prefix; save to another prefix"
        )

    def _refuse_live(self, meta: Any, raw: bytes) -> None:
        """Raise when the claim ``raw`` (last modified as ``meta`` says) may belong to a live save."""
        p = self.prefix
        try:
            info = json.loads(raw)
            owner, machine = str(info["owner"]), str(info.get("machine", ""))
            # the holder refreshes within its own lease: never judge it by a shorter one
            lease = max(p.lease, float(info.get("lease_seconds", 0.0)))
        except (ValueError, KeyError, TypeError):
            owner, machine, lease = "?", "", p.lease
        host, _, pid = owner.rpartition("-")
        # a pid means something only on the same machine and in the same pid namespace
        same = machine != "" and machine == machine_identity()
        if same and pid.isdigit() and not fsutil.pid_alive(host, int(pid)):
            return
        # the claim's age in the server's time: this machine's clock may run ahead of the server's
        # (every claim would look expired) or behind it (dead ones would look alive); whole seconds
        # on S3: the difference of two such times may exceed the true age by up to one second, so
        # that second is not counted
        age = (self.server_now() - meta["last_modified"]).total_seconds() - _TIME_RESOLUTION
        if age <= lease:
            raise CheckpointExistsError(
                f"{p.path} has no checkpoint but another save to it is running (claimed by "
                f"{owner}, refreshed {max(age, 0.0):.0f} s ago by the server's clock); wait for it "
                f"or save to another prefix. If that save died, its claim {p.path}/{CLAIM_KEY} "
                f"expires {lease:g} s after its last refresh (or delete it)"
            )

    def server_now(self) -> datetime:
        """The server's clock now, at the latest: the last-modified time of a probe object this
        save puts (and deletes) now. Ages of claims are differences of two server times, so
        that no client's clock, skewed either way, judges another save's claim."""
        import obstore as obs

        probe = f"{CLOCK_PROBE_PREFIX}{self.token}"
        for attempt in range(_PROBE_ATTEMPTS):
            obs.put(self.prefix._obs, probe, b"", mode="overwrite")
            try:
                return obs.head(self.prefix._obs, probe)["last_modified"]
            except FileNotFoundError:
                # another save to this prefix, beginning, took the probe for one a dead process
                # left and deleted it between the put and the head: put it again
                if attempt == _PROBE_ATTEMPTS - 1:
                    raise
            finally:
                # a probe left behind is deleted by the next save's begin
                with contextlib.suppress(Exception):
                    obs.delete(self.prefix._obs, [probe])
        raise AssertionError("unreachable")  # (the loop returns or raises)

    def start_refresh(self) -> None:
        """Refresh the claim every quarter lease on a thread, until :meth:`stop_refresh`."""
        self._stop.clear()  # again after stop_refresh (an abort's deletes)
        heartbeat = threading.Thread(target=self._refresh, name="gpuckpt-s3-claim", daemon=True)
        try:
            heartbeat.start()
        except RuntimeError:
            # no thread can be started (a save finished while the interpreter exits): the
            # claim is not refreshed, and commit still refuses to publish if it was lost
            return
        self._heartbeat = heartbeat

    def stop_refresh(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None

    def _refresh(self) -> None:
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        p = self.prefix
        while not self._stop.wait(p.lease / 4):
            sent = time.monotonic()
            try:
                self._etag = p._put(CLAIM_KEY, self.body, {"e_tag": self._etag})
                self._renewed(sent)
            except (PreconditionError, AlreadyExistsError, FileNotFoundError):
                if self._reclaim_own():
                    self._renewed(sent)
                    continue
                self.lost = (
                    f"the claim on {p.path} was taken over by another save while this one ran "
                    f"(more than {p.lease:.0f} s without a refresh); this save was discarded"
                )
                return
            except Exception as exc:  # transient: retry at the next beat, commit checks
                self._unreachable = first_line(exc)
                continue

    def renew(self) -> bool:
        """Refresh the claim now, a compare-and-swap on its ETag: True (and half a lease from now
        to act in) while it is this save's, False once it passed to another save."""
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        if self._etag is None or self.lost is not None:
            return False
        sent = time.monotonic()
        try:
            self._etag = self.prefix._put(CLAIM_KEY, self.body, {"e_tag": self._etag})
        except (PreconditionError, AlreadyExistsError, FileNotFoundError):
            if not self._reclaim_own():
                return False
        except Exception:
            # failed in transit (the client does not retry a conditional put): whether it landed
            # is unknown, so only the window of the last renewal that did counts
            return self._reclaim_own() and self.holds()
        self._renewed(sent)
        return True

    def checked(self, pieces: Iterable[Any]) -> Iterator[Any]:
        """``pieces``, with :meth:`check` before each one is handed over (to an upload)."""
        for piece in pieces:
            self.check()
            yield piece

    def holds(self) -> bool:
        """Whether this save may still act on the prefix: the claim was not lost, and it was
        renewed less than half a lease ago (no other save can have taken it over)."""
        return self.lost is None and (self._valid_until is None or time.monotonic() <= self._valid_until)

    @property
    def etag(self) -> str | None:
        """The ETag of the claim object as this save last put it (None before :meth:`take`)."""
        return self._etag

    def _renewed(self, sent: float) -> None:
        self._valid_until = sent + self.prefix.lease / 2
        self._unreachable = None

    def _reclaim_own(self) -> bool:
        """After a refused refresh: True (and its new ETag kept) when the claim is still ours,
        i.e. our own refresh went through and only its answer was lost before a retry."""
        import obstore as obs

        try:
            res = obs.get(self.prefix._obs, CLAIM_KEY)
            if bytes(res.bytes()) == self.body:
                self._etag = res.meta["e_tag"]
                return True
        except Exception:  # gone, or cannot tell: treated as lost, commit checks again
            pass
        return False

    def still_ours(self) -> bool:
        """Whether the claim object is this save's now (one GET)."""
        import obstore as obs

        if self.lost is not None:
            return False
        try:
            return bytes(obs.get(self.prefix._obs, CLAIM_KEY).bytes()) == self.body
        except FileNotFoundError:
            return False

    def check(self) -> None:
        """Raise when this save may no longer write: :class:`CheckpointExistsError` when its claim
        is lost, or was not refreshed for more than half the lease (a stalled process);
        :class:`CheckpointWriteError` when that was because its refreshes could not reach the
        store (nothing says another save took the prefix over, and none may have)."""
        if self.lost is None and self._valid_until is not None and time.monotonic() > self._valid_until:
            # past half the lease without a refresh: the claim may be another save's by now,
            # whose objects this put could replace
            self.lost, self._lost_unreachable = self._lapsed()
        if self.lost is not None:
            if self._lost_unreachable:
                raise CheckpointWriteError(errno.EIO, self.lost)
            raise CheckpointExistsError(self.lost)

    def _lapsed(self) -> tuple[str, bool]:
        """Why the claim lapsed, and whether it was because the store could not be reached."""
        p = self.prefix
        if self._unreachable is not None:
            return (
                f"the save to {p.path} could not reach the store to refresh its claim for more than half "
                f"its lease ({p.lease:g} s; the last refresh failed: {self._unreachable}); past that "
                "another save could take the prefix over, so this one stopped writing, deleted nothing "
                "and was discarded: save again once the store answers (a longer lease_seconds rides "
                "out longer outages)"
            ), True
        return (
            f"the save to {p.path} could not refresh its claim for more than half its lease "
            f"({p.lease:g} s; this process or its refreshes were stalled); another save may have taken "
            "the prefix over, so this one stopped writing and was discarded"
        ), False
