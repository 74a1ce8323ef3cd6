"""A prefix of checkpoints in S3 object storage (``s3://bucket/run1``), as a :class:`CheckpointRoot`.

Children are the prefixes one level down (``s3://bucket/run1/step_00000040``),
found by one delimited listing of the root: the objects inside the children
are never listed to find them. A child is committed when its root document
(:data:`~gpuckpt.format.documents.ROOT_KEY`) exists and starts as a gpuckpt
root document does: one ranged GET of its first bytes, which is as cheap as
a HEAD and also tells another program's Zarr store apart (its ``zarr.json``
exists too). Only an empty ``zarr.json``, which the server refuses a range
of, costs a HEAD more. Nothing cheaper tells the two apart: a listing shows
a child, never what its root document says, so a caller probes each child
once and remembers (:class:`~gpuckpt.CheckpointManager` does).

Deletion of checkpoints goes, for all of them together:

1. claim each (the claim object of :mod:`gpuckpt.storage.s3.writer`, as a save
   takes it), so that an interrupted deletion leaves a claim that ages like a
   dead save's;
2. delete their root documents in one batch: each stops being a checkpoint
   at once;
3. list each one's objects and delete them all in batches (the client sends
   bulk deletes of up to 1,000 keys), then the claims.

:meth:`ObjectStoreRoot.cleanup` finishes what dead saves and interrupted
deletions left: a child without a root document but with a claim whose
holder is gone (its process is dead on this machine, or its lease expired)
is taken over and emptied, exactly as a new save to it would. A live
claim, and a child without a claim (another program's objects), are left.
Finding the claims takes a HEAD per child looked at: a caller that has
probed the children passes those not committed, and only they are looked at.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from gpuckpt.errors import CheckpointExistsError
from gpuckpt.format.documents import ROOT_KEY
from gpuckpt.format.names import is_safe_name
from gpuckpt.storage.base import CheckpointRoot
from gpuckpt.storage.s3.prefix import CLAIM_KEY, Prefix, holds_checkpoint
from gpuckpt.storage.s3.writer import ObjectStoreWriter

__all__ = ["ObjectStoreRoot", "is_child_name"]

#: a checkpoint's name under a root: one key component of the characters of array names and
#: ``=+,@`` (a Lightning checkpoint is ``epoch=3-step=400.ckpt``), never hidden, never ``.``
_CHILD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.~=+,@-]{0,254}$")


def is_child_name(name: object) -> bool:
    """Whether ``name`` is taken as a checkpoint's name under an ``s3://`` root of checkpoints:
    a manager's step names, Lightning's, any array name (:func:`~gpuckpt.format.names.is_safe_name`)."""
    return (
        isinstance(name, str)
        and name != ROOT_KEY
        and (_CHILD_NAME.match(name) is not None or is_safe_name(name))
    )


class ObjectStoreRoot(Prefix, CheckpointRoot):
    """The prefix of ``url`` (``s3://bucket/prefix``) as a root of checkpoints.

    ``storage_options`` are those of :class:`~gpuckpt.storage.s3.writer.ObjectStoreWriter`;
    every child is opened with them.
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        self._options = dict(storage_options)
        super().__init__(url, dict(storage_options))

    def child(self, name: str) -> str:
        if not is_child_name(name):
            raise ValueError(f"refusing checkpoint name {name!r} under {self.path}: not a plain name")
        return f"{self.path}/{name}"

    def children(self) -> list[str]:
        import obstore as obs

        with self._io("listing the checkpoints"):
            found = obs.list_with_delimiter(self._obs)["common_prefixes"]
        names = (p.rstrip("/").rsplit("/", 1)[-1] for p in found)
        return sorted(n for n in names if n and not n.startswith(".") and is_child_name(n))

    def is_committed(self, name: str) -> bool:
        rel = f"{name}/{ROOT_KEY}"
        with self._io(f"reading {rel}"):
            return holds_checkpoint(self._obs, rel)

    def delete(self, names: Sequence[str]) -> None:
        import obstore as obs

        if not names:
            return
        claims = []
        for name in names:
            w = ObjectStoreWriter(self.child(name), **self._options)
            try:
                with w._io("claiming the checkpoint to delete it"):
                    w._claim.take()
                claims.append(f"{name}/{CLAIM_KEY}")
            except CheckpointExistsError:
                pass  # another deletion of it runs: the batches below are idempotent
        with self._io(f"deleting {len(names)} checkpoint(s)"):
            # unpublished first, all at once: from here on none of them is a checkpoint
            obs.delete(self._obs, [f"{n}/{ROOT_KEY}" for n in names])
            keys = [
                m["path"]
                for n in names
                for batch in obs.list(self._obs, prefix=f"{n}/")
                for m in batch
                if not m["path"].endswith(f"/{CLAIM_KEY}")
            ]
            if keys:
                obs.delete(self._obs, keys)  # bulk deletes of up to 1,000 keys each
            if claims:
                obs.delete(self._obs, claims)

    def cleanup(self, candidates: Sequence[str] | None = None) -> list[str]:
        import obstore as obs

        names = self.children() if candidates is None else candidates
        removed = []
        for name in names:
            if name.startswith(".") or not is_child_name(name):
                continue
            with self._io(f"reading {name}/{CLAIM_KEY}"):
                try:
                    obs.head(self._obs, f"{name}/{CLAIM_KEY}")
                except FileNotFoundError:
                    continue
            if self.is_committed(name):
                continue  # a deletion that stopped after its claim: the step stays
            w = ObjectStoreWriter(self.child(name), **self._options)
            try:
                w.begin()  # takes the claim over only when its holder is gone
            except CheckpointExistsError:
                continue  # a live save, or objects that are not a gpuckpt save's
            w.abort()  # deletes the dead save's objects, then the claim
            removed.append(name)
        return removed
