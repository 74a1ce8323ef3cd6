"""A stalled ``s3://`` writer's requests that land after another save took its prefix over.

Checking the claim before a request cannot stop one already in flight: a writer
process stopped (SIGSTOP, a hung node) with a put or a delete sent, or about to
be, sends it when it resumes, however long after its lease expired. Here the
fault proxy holds such a request of a real writer process, the process is
stopped, another save takes the prefix over and publishes, and only then does
the held request reach the server and the writer resume. The store fences
them: the late request must neither replace nor delete an object of the save
that took over, whose checkpoint loads bit for bit, and the stale writer ends
with its "taken over" error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt

pytest.importorskip("obstore")
pytest.importorskip("moto.server")

from gpuckpt.storage.base import CrcDigest
from gpuckpt.storage.s3.fence import delete_if_unchanged
from gpuckpt.storage.s3.writer import CLAIM_KEY, ObjectStoreWriter
from gpuckpt.testing.faultproxy import FaultProxy, Hold
from gpuckpt.testing.s3server import list_keys, loopback_s3, s3_options
from gpuckpt.verify import verify_checkpoint

BUCKET = "fencing"
LEASE = 3.0
CHILD = Path(__file__).with_name("s3_writer_child.py")
sys.path.insert(0, str(CHILD.parent))
from s3_writer_child import state  # noqa: E402


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with loopback_s3(BUCKET) as url:
        yield url


def _start(mode: str, url: str, endpoint: str, marker: Path) -> subprocess.Popen[str]:
    """The stale writer: saves ``state(1)`` with a 3 s lease, one chunk at a time."""
    cmd = [sys.executable, str(CHILD), mode, url, endpoint, str(marker), "1"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(event: threading.Event, proc: subprocess.Popen[str], what: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not event.wait(0.05):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{what} never happened: {proc.communicate()[0]}")


def _take_over(
    url: str, endpoint: str, new: dict[str, np.ndarray] | None = None, limit: float = 30.0
) -> None:
    """Save ``new`` (default ``state(2)``) to ``url`` as soon as the stopped writer's lease lets it."""
    opts = s3_options(endpoint, lease_seconds=LEASE)
    deadline = time.monotonic() + limit
    while True:
        try:
            gpuckpt.save(state(2) if new is None else new, url, storage_options=opts)
            return
        except gpuckpt.CheckpointExistsError as exc:
            if "another save to it is running" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.25)


def _same(got: dict[str, Any], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k


def _resume(proc: subprocess.Popen[str], held: Hold) -> str:
    held.release()
    os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=60)
    assert held.answered.wait(10)
    return out


def _chunk_put(name: str) -> Any:
    return lambda kind, path: kind == "put" and path.endswith(f"/{name}/c.0")


def _stale_writer_refused(proc: subprocess.Popen[str], out: str) -> None:
    assert proc.returncode == 3 and out.startswith("CheckpointExistsError"), out
    assert "half its lease" in out or "taken over" in out or "another save" in out, out


def test_a_stale_writers_put_landing_after_the_takeover_published_replaces_nothing(
    endpoint: str, tmp_path: Path
) -> None:
    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/step-1"
    with FaultProxy(endpoint) as proxy:
        held = proxy.hold(_chunk_put("t1"))
        proc = _start("plain", url, proxy.endpoint, tmp_path / "marker")
        try:
            # its claim was checked and its put of t1/c.0 is on its way: the process stops there
            _wait(held.arrived, proc, "the writer's put of t1/c.0")
            os.kill(proc.pid, signal.SIGSTOP)
            _take_over(url, endpoint)
        finally:
            out = _resume(proc, held)  # the put reaches the server only now, then the writer runs on
    _stale_writer_refused(proc, out)
    opts = s3_options(endpoint)
    _same(gpuckpt.load_state_dict(url, storage_options=opts), state(2))
    assert verify_checkpoint(url, storage_options=opts).ok
    # the late put found the new owner's object and replaced nothing
    assert held.status == 412, held.status
    assert CLAIM_KEY not in list_keys(endpoint, BUCKET, url.removeprefix(f"s3://{BUCKET}/"))


def test_a_stray_put_landing_before_the_new_owners_own_put_is_replaced_by_it(
    endpoint: str, tmp_path: Path
) -> None:
    """The stale put lands after the takeover cleaned the prefix but before the new owner's put
    of that key: the new owner's conditional put is refused, finds the stray, deletes it, puts again."""
    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/step-1"
    with FaultProxy(endpoint) as stale, FaultProxy(endpoint) as owner:
        held = stale.hold(_chunk_put("t1"))
        proc = _start("plain", url, stale.endpoint, tmp_path / "marker")
        failure: list[BaseException] = []
        try:
            _wait(held.arrived, proc, "the writer's put of t1/c.0")
            os.kill(proc.pid, signal.SIGSTOP)
            own = owner.hold(_chunk_put("t1"))

            def take_over() -> None:
                try:
                    _take_over(url, owner.endpoint)
                except BaseException as exc:
                    failure.append(exc)
                    own.release()

            saver = threading.Thread(target=take_over)
            saver.start()
            _wait(own.arrived, proc, "the new owner's put of t1/c.0")
            held.release()  # the stray lands first
            assert held.answered.wait(30) and held.status == 200, held.status
            own.release()
            saver.join(60)
        finally:
            out = _resume(proc, held)
    assert not failure, failure
    assert own.status in (200, 412), own.status
    _stale_writer_refused(proc, out)
    opts = s3_options(endpoint)
    _same(gpuckpt.load_state_dict(url, storage_options=opts), state(2))
    assert verify_checkpoint(url, storage_options=opts).ok


def test_a_stale_writers_abort_deletes_nothing_of_the_save_that_took_over(
    endpoint: str, tmp_path: Path
) -> None:
    """Deletes are conditional on the ETag the aborting writer saw. An ETag is the hash of the
    bytes: an object put again with the very same bytes (an array document of the same shape,
    a chunk of the same values) cannot be told apart, and only the claim's renewal before the
    deletes protects it (see gpuckpt.storage.s3.fence). Here every object of the new save differs."""
    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/step-1"
    new = {k: v.astype(np.float64) for k, v in state(2).items()}
    with FaultProxy(endpoint) as proxy:
        # the save fails after its first chunk and aborts: its first delete is held, the process stopped
        held = proxy.hold(lambda kind, path: kind == "delete" and not path.endswith(CLAIM_KEY))
        proc = _start("fail", url, proxy.endpoint, tmp_path / "marker")
        try:
            _wait(held.arrived, proc, "the aborting writer's delete")
            os.kill(proc.pid, signal.SIGSTOP)
            _take_over(url, endpoint, new)
        finally:
            out = _resume(proc, held)
    assert proc.returncode == 3 and "failed after its first chunk" in out, out
    opts = s3_options(endpoint)
    _same(gpuckpt.load_state_dict(url, storage_options=opts), new)
    assert verify_checkpoint(url, storage_options=opts).ok


# -- the fenced requests of one writer, in this process ------------------------------------


@pytest.fixture
def s3(endpoint: str) -> Any:
    boto3 = pytest.importorskip("boto3")
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def _begun(endpoint: str, **more: Any) -> tuple[ObjectStoreWriter, str]:
    prefix = f"run-{uuid.uuid4().hex[:8]}/step-1"
    w = ObjectStoreWriter(f"s3://{BUCKET}/{prefix}", **s3_options(endpoint, **more))
    w.begin()
    return w, prefix


def _body(s3: Any, key: str) -> bytes:
    return bytes(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())


def test_a_put_refused_because_its_own_bytes_are_there_counts_as_done(endpoint: str, s3: Any) -> None:
    """A put whose answer was lost and whose retry is refused: the object holds the bytes sent."""
    w, prefix = _begun(endpoint)
    try:
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/a/c.0", Body=b"abcdefg")  # the first attempt landed
        w.write_chunk("a", "c.0", [b"abc", b"defg"])
        etag = s3.head_object(Bucket=BUCKET, Key=f"{prefix}/a/c.0")["ETag"]
        assert w._fence.etags["a/c.0"] == etag
    finally:
        w.abort()
    assert list_keys(endpoint, BUCKET, prefix) == set()  # the abort deleted it: this save's object


def test_a_stray_at_a_key_of_the_prefixs_owner_is_deleted_and_put_again(endpoint: str, s3: Any) -> None:
    w, prefix = _begun(endpoint)
    try:
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/a/c.0", Body=b"a stale writer's bytes")
        w.write_chunk("a", "c.0", [b"abc", b"defg"])
        assert _body(s3, f"{prefix}/a/c.0") == b"abcdefg"
        w.write_array_document("a", b'{"v": 1}')
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/a/zarr.json", Body=b'{"v": "stray"}')
        w.rewrite_array_document("a", b'{"v": 2}')  # its own object was replaced: put again
        assert _body(s3, f"{prefix}/a/zarr.json") == b'{"v": 2}'
        w.rewrite_array_document("a", b'{"v": 3}')  # replaces exactly its own put (If-Match)
        assert _body(s3, f"{prefix}/a/zarr.json") == b'{"v": 3}'
    finally:
        w.abort()
    assert list_keys(endpoint, BUCKET, prefix) == set()


def test_a_writer_that_lost_its_prefix_writes_and_deletes_nothing_of_the_new_owner(
    endpoint: str, s3: Any
) -> None:
    import json

    w, prefix = _begun(endpoint)
    w._claim.stop_refresh()
    w.write_chunk("b", "c.0", [b"mine"])
    # another save took the prefix over (its claim), cleaned it and put its own objects
    other = {"owner": "node-9-77", "machine": "", "token": "f" * 16, "lease_seconds": LEASE}
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{CLAIM_KEY}", Body=json.dumps(other).encode())
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/a/c.0", Body=b"theirs")
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/b/c.0", Body=b"theirs too")
    with pytest.raises(gpuckpt.CheckpointExistsError, match="taken over by another save"):
        w.write_chunk("a", "c.0", [b"abc", b"defg"])
    w.abort()
    assert _body(s3, f"{prefix}/a/c.0") == b"theirs" and _body(s3, f"{prefix}/b/c.0") == b"theirs too"
    assert json.loads(_body(s3, f"{prefix}/{CLAIM_KEY}"))["token"] == "f" * 16


class _LosesTheClaim:
    """A digest that marks its writer's claim lost after ``after`` pieces (a stall detected)."""

    def __init__(self, w: ObjectStoreWriter, after: int) -> None:
        self.w, self.after, self.crc = w, after, CrcDigest()

    def update(self, piece: Any) -> None:
        self.crc.update(piece)
        self.after -= 1
        if self.after == 0:
            self.w._claim.lost = "lost while uploading (this test)"

    def trailer(self) -> bytes:
        return self.crc.trailer()


def test_a_multipart_upload_stops_at_the_next_piece_once_the_claim_is_lost(endpoint: str) -> None:
    w, prefix = _begun(endpoint, part_bytes=5 << 20, max_parts_in_flight=1)
    data = np.random.default_rng(0).integers(0, 255, 24 << 20, dtype=np.uint8)
    try:
        with pytest.raises(gpuckpt.CheckpointExistsError, match="lost while uploading"):
            w.write_chunk_checked("a", "c.0", [data], _LosesTheClaim(w, after=2))
    finally:
        w.abort()
    assert "a/c.0" not in list_keys(endpoint, BUCKET, prefix)


def test_conditional_deletes_spare_what_was_put_again(endpoint: str, s3: Any) -> None:
    w, prefix = _begun(endpoint)
    try:
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/x", Body=b"one")
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/y", Body=b"two")
        seen = {k: s3.head_object(Bucket=BUCKET, Key=f"{prefix}/{k}")["ETag"] for k in ("x", "y")}
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/y", Body=b"two, put again")
        left = delete_if_unchanged(w._obs, {**seen, "gone": '"0"'}, max_requests=4)
        assert left == {"y": "changed"}
        assert list_keys(endpoint, BUCKET, prefix) == {"y", CLAIM_KEY}
    finally:
        s3.delete_object(Bucket=BUCKET, Key=f"{prefix}/y")
        w.abort()
