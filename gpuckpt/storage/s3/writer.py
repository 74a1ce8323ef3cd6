"""Checkpoints in S3-compatible object storage (``s3://bucket/prefix``).

Object stores have no rename, so a checkpoint is published by its commit
object: the root ``zarr.json`` (:data:`~gpuckpt.format.documents.ROOT_KEY`) is
written last, and a prefix without it is not a checkpoint. Every object sits
at its final key; a reader that finds the root finds everything it lists.

A save to ``s3://bucket/prefix`` goes:

1. ``begin``: refuse a prefix inside a published checkpoint (a ranged GET of
   each enclosing prefix's root document), and refuse if the root exists. Create the *claim* object
   ``prefix/.gpuckpt-writer`` with a conditional put (``If-None-Match: *``),
   so one writer at a time owns the prefix. A claim left by a save that died
   (its process is gone from this machine and pid namespace, or the claim was
   not refreshed for ``lease_seconds``, both times read off the server's clock:
   the age is the claim's last-modified time subtracted from that of a probe
   object the writer puts, so a client clock skewed either way judges no claim) is
   taken over with a compare-and-swap on its ETag. Then, with the root
   checked again, objects of the unfinished save whose claim was taken over
   are deleted (the claim is :mod:`gpuckpt.storage.s3.claim`). Objects under
   a prefix that had no claim, and objects no gpuckpt save writes, are
   refused, never deleted: a prefix holding another program's Zarr store
   (even one whose keys look like a checkpoint's) is left as it is.
2. Array documents and chunks are put at their final keys (a chunk of at
   least twice ``part_bytes`` as a multipart upload, see
   :mod:`gpuckpt.storage.s3.client`; one that fails is aborted by the client,
   and one left by a save killed mid-upload, or whose abort failed, stays on
   the server until the bucket's lifecycle rule removes it: the client can
   neither list nor abort such uploads); a thread refreshes the claim every
   quarter lease. A single put only creates its object, or replaces this
   writer's own last put of it, so that a put of a writer that lost the
   prefix, landing late, replaces nothing of the save that took it over
   (:mod:`gpuckpt.storage.s3.fence`). In a distributed save the other ranks join the save with
   its :attr:`~ObjectStoreWriter.token` (:meth:`ObjectStoreWriter.attach`,
   which checks that the claim is that save's) and put their own chunks; only
   the writer that began the save holds and refreshes the claim, and commits
   after every rank has finished.
3. ``commit``: check the claim is still ours, create the root with a
   conditional put (of two writers, exactly one commits; the other gets
   :class:`~gpuckpt.errors.CheckpointExistsError`), delete the claim.
4. ``abort`` renews the claim (a compare-and-swap), then deletes the
   checkpoint objects under the prefix (every rank's: the claim made them
   all this save's), each only while it is the object it listed, and then
   its claim, unless the prefix has meanwhile passed to another writer or
   was published.

Requests are retried by the client (backoff with jitter), conditional puts of
documents and chunks by :mod:`gpuckpt.storage.s3.fence` (the client does not
retry a conditional put that may have reached the server); a put whose answer
was lost and whose retry then finds the object (the claim or the root
document, byte for byte this save's; a document or chunk holding the bytes
sent) counts as done, so a retried conditional put never fails a save that
went through.

A root ``zarr.json`` that is not a gpuckpt checkpoint's (another program's
Zarr store at that prefix) is refused with a message that says so.

``overwrite=True`` cannot replace a published checkpoint: an object store
cannot swap two sets of objects atomically, and deleting the old root first
would leave no checkpoint at all if the save then failed. Such a save is
refused; save to a new prefix (as :class:`gpuckpt.CheckpointManager` does
with one prefix per step) and delete the old one afterwards.

The back end is obstore's ``S3Store``, called directly: plain and
conditional puts with their outcome, gets with a size limit, listings with
sizes, bulk deletes, and streamed reads into the caller's buffers (zarr is
not imported by a save or a load; :func:`zarr_store` opens a checkpoint with
zarr itself, through zarr's :class:`zarr.storage.ObjectStore`). Conditional puts need
a server that honours ``If-None-Match``/``If-Match`` on PUT (AWS S3, MinIO,
Cloudflare R2, moto); for others pass ``conditional_writes=False``, which
keeps atomic publication but not the guarantees between concurrent saves.

Reading a published checkpoint is :mod:`gpuckpt.storage.s3.reader`; what readers,
writers and roots share (the client, error translation, object keys) is
:mod:`gpuckpt.storage.s3.prefix`.
"""

from __future__ import annotations

import errno
import secrets
from collections.abc import Iterator, Sequence
from typing import Any

from gpuckpt.errors import (
    CheckpointExistsError,
    CheckpointWriteError,
    MetadataError,
)
from gpuckpt.format.checksum import CRC_BYTES
from gpuckpt.format.documents import (
    MAX_ROOT_DOCUMENT_BYTES,
    ROOT_DOCUMENT_PREFIX,
    ROOT_KEY,
    root_document_problem,
)
from gpuckpt.storage.base import BaseRef, Capabilities, CheckpointWriter, ChunkDigest
from gpuckpt.storage.copies import PIECE_BYTES, own_copy
from gpuckpt.storage.s3.claim import Claim, claim_token
from gpuckpt.storage.s3.client import (
    WatchedPieces,
    first_line,
    parse_s3_url,
    plan_parts,
    upload_left_by,
    zarr_store,
)
from gpuckpt.storage.s3.fence import Fence, delete_if_unchanged
from gpuckpt.storage.s3.prefix import (
    CLAIM_KEY,
    CLOCK_PROBE_PREFIX,
    Prefix,
    is_checkpoint_object,
    object_key,
)
from gpuckpt.storage.s3.reader import ObjectStoreReader

__all__ = ["CLAIM_KEY", "ObjectStoreReader", "ObjectStoreWriter", "parse_s3_url", "zarr_store"]


def _slices(pieces: list[Any]) -> Iterator[memoryview]:
    """The buffers ``pieces`` in views of at most :data:`PIECE_BYTES` (no copies)."""
    for p in pieces:
        view = memoryview(p).cast("B")
        for i in range(0, view.nbytes, PIECE_BYTES):
            yield view[i : i + PIECE_BYTES]


class ObjectStoreWriter(Prefix, CheckpointWriter):
    """Writes a checkpoint under an ``s3://`` prefix; see the module docstring for the protocol.

    Parameters
    ----------
    url
        ``s3://bucket/prefix``.
    overwrite
        Accepted for a prefix without a checkpoint; a published one is never
        replaced (see the module docstring).
    **storage_options
        ``endpoint_url``, ``region``, ``access_key_id``, ``secret_access_key``,
        ``session_token``, ``allow_http`` (implied by an ``http://`` endpoint),
        ``skip_signature``, ``client_options``, ``retry_config`` (over the defaults of
        :mod:`gpuckpt.storage.s3.client`), other obstore ``S3Config`` keys; and
        ``lease_seconds`` (claim lease, default 60), ``conditional_writes``
        (default True; False for servers without ``If-None-Match``/``If-Match``
        on PUT, losing the concurrency guarantees and the fencing of
        :mod:`gpuckpt.storage.s3.fence`), ``max_requests``,
        ``part_bytes`` and ``max_parts_in_flight`` (see :mod:`gpuckpt.storage.s3.client`).
    """

    _error = CheckpointWriteError
    # each chunk is a request (small ones go out in parallel); no directories: chunks may land
    # before their array's document
    capabilities = Capabilities(batches_chunks=False, documents_first=False)

    def __init__(self, url: str, *, overwrite: bool = False, **storage_options: Any) -> None:
        super().__init__(url, storage_options)
        self.overwrite = overwrite
        self._token = secrets.token_hex(8)
        self._claim = Claim(self, self._token)
        self._written: set[str] = set()
        self._fence = Fence(self, self._claim, self._token)
        self._published: dict[str, Any] = {}  # base prefix -> its root document's last-modified time
        self._committed = False

    @property
    def token(self) -> str:
        """What the other ranks of a distributed save need to write into it (:meth:`attach`)."""
        return self._token

    @classmethod
    def attach(cls, url: str, token: str, **storage_options: Any) -> ObjectStoreWriter:
        """A rank's writer of chunks into the save ``token`` that another process began.

        Chunks go straight to their final keys under the prefix; the process that
        began the save holds the claim, refreshes it, and commits or aborts (its
        abort deletes every object of the save, the other ranks' included).

        Raises
        ------
        CheckpointExistsError
            When the prefix is not claimed by the save ``token`` (it ended, or
            another save took the prefix over).
        """
        w = cls(url, **storage_options)
        with w._io("joining the save", CheckpointWriteError):
            held, found = claim_token(w)
        if found != token:
            state = "belongs to another save" if held else "is missing"
            raise CheckpointExistsError(
                f"{w.path}: the save this rank was to join (claim token {token!r}) does not hold the prefix "
                f"(its claim {w.path}/{CLAIM_KEY} {state}); the save was aborted or taken over, nothing "
                "of this rank was written"
            )
        w._token = w._fence.token = token
        return w

    def _root_problem(self) -> str | None:
        """Why the root object is not a gpuckpt checkpoint's; None when it is (damaged or not)."""
        import obstore as obs

        n = len(ROOT_DOCUMENT_PREFIX)
        try:
            if obs.head(self._obs, ROOT_KEY)["size"] >= n:
                head = bytes(obs.get(self._obs, ROOT_KEY, options={"range": (0, n)}).bytes())
                if head == ROOT_DOCUMENT_PREFIX:
                    return None
        except FileNotFoundError:
            return None  # deleted meanwhile: nothing to protect, the conditional put decides
        try:
            raw = self._get_small(ROOT_KEY, MAX_ROOT_DOCUMENT_BYTES, "MAX_ROOT_DOCUMENT_BYTES")
        except MetadataError:
            return f"its {ROOT_KEY} is larger than any gpuckpt root document"
        return None if raw is None else root_document_problem(raw)

    def _refuse_published(self) -> None:
        if not self._exists(ROOT_KEY):
            return
        problem = self._root_problem()
        if problem is not None:
            raise CheckpointExistsError(
                f"{self.path} holds something that is not a gpuckpt checkpoint: {problem}; refusing to "
                f"touch it{' even with overwrite=True' if self.overwrite else ''}, nothing was deleted. "
                "Save to another prefix"
            )
        if self.overwrite:
            raise CheckpointExistsError(
                f"Checkpoint already exists at {self.path} and overwrite=True cannot replace it: object "
                "storage has no atomic swap, and unpublishing it first could leave no checkpoint at all; "
                "save to a new prefix, then delete the old one"
            )
        raise CheckpointExistsError(f"Checkpoint already exists at {self.path}; save to a new prefix")

    # -- the CheckpointWriter protocol ------------------------------------
    def begin(self) -> None:
        with self._io("starting a save", CheckpointWriteError):
            self.refuse_inside_a_checkpoint()
            self._refuse_published()
            took_over = self._claim.take()
            # refreshed from now on: deleting what an abandoned save left (one request per
            # object, see gpuckpt.storage.s3.fence) may take longer than half a lease
            self._claim.start_refresh()
            try:
                # the root may have been committed between the first check and the claim
                self._refuse_published()
                self._delete_leftovers(took_over)
            except BaseException:
                self._claim.stop_refresh()
                self._fence.release_claim()
                raise

    def _delete_leftovers(self, took_over: bool) -> None:
        """Delete what the abandoned save whose claim we took over left; refuse anything else.

        Keys shaped like a checkpoint's are not proof enough: a Zarr v3 store of
        another program can have only such keys. Only a claim left behind says
        that the objects are a gpuckpt save's (a save aborts its objects before
        its claim).
        """
        import obstore as obs

        seen = {k: etag for k, (_, etag) in self._list_meta().items() if k != CLAIM_KEY}
        listed = sorted(seen)
        # clock probes (see Claim.server_now) that a process left when it died: gpuckpt's, never in the way
        probes = [k for k in listed if k.startswith(CLOCK_PROBE_PREFIX)]
        if probes:
            obs.delete(self._obs, probes)
        keys = [k for k in listed if not k.startswith(CLOCK_PROBE_PREFIX)]
        foreign = [k for k in keys if not self._is_checkpoint_key(k)]
        if foreign:
            raise CheckpointExistsError(
                f"{self.path} has no checkpoint but holds {len(foreign)} other object(s), e.g. "
                f"{foreign[:3]}; refusing to delete them: save to an empty prefix"
            )
        if keys and not took_over:
            raise CheckpointExistsError(
                f"{self.path} has no checkpoint and no claim of an unfinished gpuckpt save, but holds "
                f"{len(keys)} object(s), e.g. {keys[:3]} (another program's Zarr store?); refusing to "
                "delete them, nothing was deleted: save to an empty prefix"
            )
        if keys:
            self._fence.delete_abandoned({k: seen[k] for k in keys})

    @staticmethod
    def _is_checkpoint_key(rel: str) -> bool:
        name, sep, key = rel.partition("/")
        return bool(sep) and is_checkpoint_object(name, key)

    def _write(self, rel: str, data: Any, streamed: tuple[int, Iterator[Any]] | None = None) -> None:
        """Put ``data`` (a buffer, or a list of buffers to store one after the other) at ``rel``;
        or, with ``streamed`` ``(nbytes, pieces)``, the buffers the iterator ``pieces`` yields as
        the upload asks for them (a multipart upload; ``data`` unused).

        One request, or from twice ``part_bytes`` on a multipart upload whose parts are
        sent a few at a time, within the request and memory budgets (see
        :mod:`gpuckpt.storage.s3.client`). A single put is fenced (see
        :mod:`gpuckpt.storage.s3.fence`); a multipart upload checks the claim before each
        piece it takes.
        """
        import obstore as obs
        from obstore.exceptions import BaseError

        self._claim.check()
        self._written.add(rel)
        pieces = data if isinstance(data, list) else [data]
        nbytes = streamed[0] if streamed is not None else sum(memoryview(p).nbytes for p in pieces)
        nparts, part = plan_parts(nbytes, self.transfer.part_bytes)
        at_once = min(nparts, self.transfer.max_parts_in_flight)
        with (
            self._io(f"writing {rel} ({nbytes} bytes)", CheckpointWriteError),
            # the client's buffers of what is in flight: the whole object, or the parts being sent
            self.budget.take(at_once, nbytes if nparts == 1 else at_once * part) as slots,
        ):
            # the put zarr's ObjectStore.set makes, without its event-loop thread: that thread
            # cannot be started while the interpreter exits, when queued saves still run
            if nparts == 1 and streamed is None:
                self._fence.put(rel, pieces, nbytes)
            else:
                # the client completes a multipart upload without a condition: a writer that lost
                # its claim while stopped mid-upload stops at the next piece it would hand over
                source = WatchedPieces(
                    self._claim.checked(streamed[1] if streamed is not None else _slices(pieces))
                )
                try:
                    put = obs.put(
                        self._obs, rel, source, use_multipart=True, chunk_size=part, max_concurrency=slots
                    )
                except BaseError as exc:
                    raise self._multipart_failure(rel, nbytes, exc, source.raised) from exc
                self._fence.put_done(rel, put["e_tag"])

    def _multipart_failure(
        self, rel: str, nbytes: int, exc: BaseException, raised: BaseException | None
    ) -> BaseException:
        """The error of a failed multipart upload. The client aborts the upload, and when that
        abort fails too it reports only the abort's failure: what failed first is named first
        then (the pieces' own error, else the upload's request), and the upload left behind."""
        stays = upload_left_by(exc)
        if stays is None:
            return raised or exc  # the upload's own failure, its abort went through
        if raised is not None:
            raised.add_note(f"writing {rel} at {self.path}: {stays}")
            return raised
        return CheckpointWriteError(
            errno.EIO,
            f"writing {rel} ({nbytes} bytes) at {self.path} failed: a request of its multipart upload (a "
            f"part, or the completion) failed, the client does not say how; {stays}",
        )

    def write_array_document(self, name: str, document: bytes) -> None:
        self._write(object_key(name, ROOT_KEY), document)

    def rewrite_array_document(self, name: str, document: bytes) -> None:
        self._write(object_key(name, ROOT_KEY), document)  # a put replaces the object

    def write_chunk(self, name: str, key: str, parts: Sequence[Any]) -> None:
        # no concatenation here: a small chunk is joined once for its single put, a large one
        # goes up in parts read from the caller's buffers
        self._write(object_key(name, key), [memoryview(p).cast("B") for p in parts])

    def write_chunk_checked(
        self, name: str, key: str, parts: Sequence[Any], digest: ChunkDigest, *, stable: bool = False
    ) -> None:
        """A chunk of one put is copied whole (unless ``stable``), digested and put (see
        :class:`~gpuckpt.storage.base.CheckpointWriter`); a larger one goes up as a multipart
        upload fed piece by piece, each piece copied into a buffer the upload keeps (a retried
        part resends those bytes, never rereads the caller's memory) and digested as it is handed
        over, the trailer last: memory stays within the parts in flight."""
        nbytes = sum(memoryview(p).nbytes for p in parts) + CRC_BYTES
        if stable or plan_parts(nbytes, self.transfer.part_bytes)[0] == 1:
            super().write_chunk_checked(name, key, parts, digest, stable=stable)
            return

        def pieces() -> Iterator[Any]:
            for p in parts:
                view = memoryview(p).cast("B")
                for i in range(0, view.nbytes, PIECE_BYTES):
                    own = own_copy([view[i : i + PIECE_BYTES]])
                    digest.update(own)
                    yield own
            yield digest.trailer()

        self._write(object_key(name, key), None, streamed=(nbytes, pieces()))

    def reuse_chunk(self, name: str, key: str, base: BaseRef) -> bool:
        """A server-side copy (``CopyObject``: no chunk bytes through this process) of the
        base's chunk object, when the base is in the same bucket of the same endpoint (the
        save's ``storage_options`` reach both) and the object has the size and CRC32C trailer
        the base's metadata gives and is no younger than the base's root document (an object
        put again after the base was published may hold other bytes than its records
        describe); False otherwise, or when the server refuses the copy."""
        import obstore as obs
        from obstore.exceptions import BaseError

        self._claim.check()
        try:
            src_bucket, src_prefix = parse_s3_url(base.location)
            bucket, prefix = parse_s3_url(self.path)
            src = "/".join(p for p in (src_prefix, object_key(base.name, base.key)) if p)
        except ValueError:
            return False
        # a single CopyObject takes objects up to 5 GiB (larger ones need UploadPartCopy)
        if src_bucket != bucket or not CRC_BYTES <= base.nbytes <= 5 << 30:
            return False
        rel = object_key(name, key)
        store = self._bucket_store()  # the base lives under another prefix
        try:
            with self.budget.take():
                published = self._published.get(src_prefix)
                if published is None:
                    root = "/".join(p for p in (src_prefix, ROOT_KEY) if p)
                    published = self._published[src_prefix] = obs.head(store, root)["last_modified"]
                try:
                    meta = obs.head(store, src)
                except FileNotFoundError:
                    self.note_base_mismatch(base, self.BASE_MISSING)
                    return False
                if meta["size"] != base.nbytes:
                    self.note_base_mismatch(base, self.base_other_size(meta["size"], base))
                    return False
                if meta["last_modified"] > published:
                    # put again after its checkpoint was published: not the base's bytes
                    self.note_base_mismatch(base, self.BASE_REWRITTEN)
                    return False
                trailer = bytes(obs.get_range(store, src, start=base.nbytes - CRC_BYTES, end=base.nbytes))
                if int.from_bytes(trailer, "little") != base.crc32c:
                    self.note_base_mismatch(base, self.BASE_OTHER_TRAILER)
                    return False
                self._claim.check()
                self._written.add(rel)
                obs.copy(store, src, "/".join(p for p in (prefix, rel) if p))
        except (FileNotFoundError, BaseError):
            return False
        return True

    def commit(self, root_document: bytes) -> None:
        from obstore.exceptions import AlreadyExistsError, BaseError

        claim = self._claim
        claim.stop_refresh()
        with self._io("publishing the checkpoint", CheckpointWriteError):
            claim.check()
            if not claim.still_ours():
                claim.lost = claim.lost or (
                    f"the claim on {self.path} passed to another save while this one ran; this save "
                    "was discarded"
                )
                raise CheckpointExistsError(claim.lost)
            try:
                self._put(ROOT_KEY, root_document, "create")
            except AlreadyExistsError:
                if self._published_ours(root_document, None):
                    # our own put went through and its retry found it (the document names this save)
                    self._committed = True
                    self._delete_quietly([CLAIM_KEY])
                    return
                claim.lost = (
                    f"Checkpoint already exists at {self.path}: another save published it while this one "
                    "ran; this save was discarded and the other one kept"
                )
                raise CheckpointExistsError(claim.lost) from None
            except BaseError as exc:
                # the retries ran out: the put may still have reached the server (its answers lost)
                if not self._published_ours(root_document, exc):
                    raise
            self._committed = True
        self._delete_quietly([CLAIM_KEY])

    def _published_ours(self, root_document: bytes, failure: BaseException | None) -> bool:
        """Whether the root object is ``root_document`` (unique to this save: it holds its id).

        After a failed put (``failure``) a root that cannot be read leaves the outcome
        unknown: that is raised as such, never reported as a plain failure.
        """
        try:
            found = self._get_small(ROOT_KEY, MAX_ROOT_DOCUMENT_BYTES, "MAX_ROOT_DOCUMENT_BYTES")
        except Exception as exc:
            if failure is None:
                raise
            raise CheckpointWriteError(
                errno.EIO,
                f"publishing {self.path}: the put of {ROOT_KEY} failed ({first_line(failure)}) and reading "
                f"it back failed too ({first_line(exc)}): whether the checkpoint was published is "
                "unknown; gpuckpt.read_metadata on it tells (a published checkpoint is whole)",
            ) from failure
        return found == bytes(root_document)

    def abort(self) -> None:
        claim = self._claim
        claim.stop_refresh()
        if self._committed or not claim.taken:
            return
        if not self.conditional:
            self._abort_unfenced()
            return
        try:
            # a renewal (compare-and-swap) proves the claim ours now and gives half a lease to act
            ours = claim.renew() and not self._exists(ROOT_KEY)
        except Exception:  # cannot tell: leave the objects (and the claim) to the next save's cleanup
            return
        if not ours:
            return  # the prefix belongs to another save now: its objects are not ours to delete
        try:
            listed = {k: etag for k, (_, etag) in self._list_meta().items() if self._is_checkpoint_key(k)}
        except Exception:
            listed = dict(self._fence.etags)  # this writer's own puts, as it put them
        # every checkpoint object under the claimed prefix is this save's (begin refused or removed
        # all others), the other ranks' chunks included; each is deleted only while it is the one
        # listed (and this writer's own puts only while they are what it put), so that deletes that
        # arrive late, after another save took the prefix over, delete nothing of that save
        doomed = self._fence.still_as_put(listed)
        # each delete goes out only while the claim holds (renewed meanwhile, for many objects):
        # a writer stalled since stops, and leaves the rest to the next save's cleanup
        claim.start_refresh()
        try:
            left = delete_if_unchanged(self._obs, doomed, self.transfer.max_requests, claim.holds)
        finally:
            claim.stop_refresh()
        # the claim goes only once they are gone: it is what lets the next save delete them
        if not left:
            self._fence.release_claim()

    def _abort_unfenced(self) -> None:
        """:meth:`abort` without conditional requests (``conditional_writes=False``)."""
        try:
            ours = self._claim.still_ours() and not self._exists(ROOT_KEY)
        except Exception:  # cannot tell: leave the objects to the next save's cleanup
            ours = False
        if not ours:
            return  # the prefix belongs to another save now: its objects are not ours to delete
        try:
            listed = {k for k in self._list() if k != CLAIM_KEY and self._is_checkpoint_key(k)}
        except Exception:
            listed = set()
        if self._delete_quietly(sorted(self._written | listed)):
            self._delete_quietly([CLAIM_KEY])

    def _delete_quietly(self, keys: list[str]) -> bool:
        """Delete ``keys``; False (and no exception) when that failed."""
        import obstore as obs

        try:
            if keys:
                obs.delete(self._obs, keys)
        except Exception:
            return False
        return True
