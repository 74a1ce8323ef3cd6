"""The writer claim of ``s3://`` saves under crashes and stalls, with real processes.

A save killed mid-upload (SIGKILL) publishes nothing and blocks nobody; a save
stopped mid-upload (SIGSTOP, a hung node) keeps its prefix while its lease
runs, loses it once the lease has expired, and when it resumes it neither
publishes nor overwrites the save that took the prefix over.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt

pytest.importorskip("obstore")
pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

from gpuckpt.storage.s3.writer import CLAIM_KEY  # noqa: E402 - after the skips
from gpuckpt.testing.faultproxy import FaultProxy  # noqa: E402
from gpuckpt.testing.s3server import list_keys, loopback_s3, s3_options  # noqa: E402

BUCKET = "lease"
CHILD = Path(__file__).with_name("s3_writer_child.py")
sys.path.insert(0, str(CHILD.parent))
from s3_writer_child import state  # noqa: E402


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with loopback_s3(BUCKET) as url:
        yield url


def _keys(endpoint: str, url: str) -> set[str]:
    return list_keys(endpoint, BUCKET, url.removeprefix(f"s3://{BUCKET}/"))


def _start(mode: str, url: str, endpoint: str, marker: Path, seed: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(CHILD), mode, url, endpoint, str(marker), str(seed)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(marker: Path, proc: subprocess.Popen[str], limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the writer never reached its first upload: {proc.communicate()[0]}")
        time.sleep(0.02)


def _same(got: dict[str, Any], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k


def test_writer_killed_mid_upload_publishes_nothing_and_the_next_save_succeeds(
    endpoint: str, tmp_path: Path
) -> None:
    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/step-1"
    proc = _start("kill", url, endpoint, tmp_path / "marker", 1)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, out
    left = _keys(endpoint, url)
    assert CLAIM_KEY in left and "zarr.json" not in left and len(left) > 1, left
    with pytest.raises(gpuckpt.CheckpointNotFoundError, match="claim"):
        gpuckpt.read_metadata(url, storage_options=s3_options(endpoint))
    # the dead writer's claim is taken over (its process is gone) and its objects removed
    gpuckpt.save(state(2), url, storage_options=s3_options(endpoint, lease_seconds=3.0))
    _same(gpuckpt.load_state_dict(url, storage_options=s3_options(endpoint)), state(2))
    assert CLAIM_KEY not in _keys(endpoint, url)


def test_stalled_writer_keeps_its_claim_until_the_lease_expires_then_loses_it(
    endpoint: str, tmp_path: Path
) -> None:
    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/step-1"
    opts = s3_options(endpoint, lease_seconds=3.0)
    proc = _start("stop", url, endpoint, tmp_path / "marker", 1)
    try:
        _wait_for(tmp_path / "marker", proc)
        # a live claim (its process exists, the lease runs) is never taken over
        with pytest.raises(gpuckpt.CheckpointExistsError, match="another save to it is running"):
            gpuckpt.save(state(2), url, storage_options=opts)
        # once the stopped writer's lease has expired, the next save takes the prefix over
        deadline = time.monotonic() + 20.0
        while True:
            try:
                gpuckpt.save(state(2), url, storage_options=opts)
                break
            except gpuckpt.CheckpointExistsError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.25)
    finally:
        proc.send_signal(signal.SIGCONT)
    out, _ = proc.communicate(timeout=60)
    # the resumed writer saw that its claim may be gone: it stopped writing and published nothing
    assert proc.returncode == 3 and out.startswith("CheckpointExistsError"), out
    assert "half its lease" in out or "taken over" in out or "another save" in out, out
    _same(gpuckpt.load_state_dict(url, storage_options=opts), state(2))
    assert CLAIM_KEY not in _keys(endpoint, url)


def test_a_shorter_lease_of_the_next_save_never_cuts_a_live_claim_short(endpoint: str) -> None:
    from gpuckpt.storage.s3.writer import ObjectStoreWriter

    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/step-1"
    live = ObjectStoreWriter(url, **s3_options(endpoint, lease_seconds=30.0))
    live.begin()
    try:
        time.sleep(1.5)  # past the next save's own lease of 1 s (S3 times have 1 s resolution)
        with pytest.raises(gpuckpt.CheckpointExistsError, match="expires 30 s after"):
            ObjectStoreWriter(url, **s3_options(endpoint, lease_seconds=1.0)).begin()
        live.write_array_document("a", b"{}")
    finally:
        live.abort()
    assert _keys(endpoint, url) == set()


SKEWED = CHILD.with_name("skewed_clock_save.py")


def _skewed_save(
    skew: float, url: str, endpoint: str, lease: float, seed: int
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(SKEWED), str(skew), url, endpoint, str(lease), str(seed)]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)


def _claim_of_another_machine(endpoint: str, url: str, lease: float) -> None:
    """A claim as a save on another machine leaves it (its pid means nothing here)."""
    import json

    body = {
        "owner": "node-17-4242",
        "machine": "another-boot/pid:[4026531836]",
        "token": "0123456789abcdef",
        "started": "2026-01-01T00:00:00+00:00",
        "lease_seconds": lease,
    }
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    key = f"{url.removeprefix(f's3://{BUCKET}/')}/{CLAIM_KEY}"
    client.put_object(Bucket=BUCKET, Key=key, Body=json.dumps(body).encode())


@pytest.mark.parametrize("skew", [120.0, -120.0])
def test_a_writer_with_a_skewed_clock_never_takes_over_a_live_claim(endpoint: str, skew: float) -> None:
    from gpuckpt.storage.s3.writer import ObjectStoreWriter

    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/step-1"
    live = ObjectStoreWriter(url, **s3_options(endpoint, lease_seconds=3.0))
    live.begin()  # refreshed every 0.75 s by its heartbeat for as long as it runs
    try:
        time.sleep(1.0)
        done = _skewed_save(skew, url, endpoint, 3.0, 2)
        assert done.returncode == 3, done.stdout
        assert (
            done.stdout.startswith("CheckpointExistsError") and "another save to it is running" in done.stdout
        )
        # the live save still holds its prefix and publishes
        live.write_array_document("a", b"{}")
        assert live._claim.still_ours()
    finally:
        live.abort()
    assert _keys(endpoint, url) == set()


@pytest.mark.parametrize("skew", [120.0, -120.0])
def test_a_writer_with_a_skewed_clock_takes_over_a_claim_past_its_lease(endpoint: str, skew: float) -> None:
    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/step-1"
    _claim_of_another_machine(endpoint, url, lease=2.0)
    time.sleep(4.2)  # past the lease, and S3's one-second resolution, by the server's clock
    done = _skewed_save(skew, url, endpoint, 2.0, 5)
    assert done.stdout.strip() == "saved", done.stdout
    _same(gpuckpt.load_state_dict(url, storage_options=s3_options(endpoint)), state(5))
    assert not any(k.startswith(".gpuckpt-") for k in _keys(endpoint, url)), _keys(endpoint, url)


def test_a_clock_probe_left_by_a_dead_process_is_removed_not_refused(endpoint: str) -> None:
    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/step-1"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    prefix = url.removeprefix(f"s3://{BUCKET}/")
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/.gpuckpt-clock-deadbeefdeadbeef", Body=b"")
    gpuckpt.save(state(3), url, storage_options=s3_options(endpoint))
    assert _keys(endpoint, url) - {"zarr.json"} and not any(k.startswith(".") for k in _keys(endpoint, url))


def test_a_clock_probe_deleted_by_another_save_beginning_is_put_again(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save judging a live claim reads the server's clock from a probe object it puts; another
    save beginning on the prefix deletes probes it takes for a dead process's (here, once,
    between the put and the head). The probe is put again: the save is refused because the
    claim is alive (CheckpointExistsError), not failed by the vanished probe."""
    import obstore

    from gpuckpt.storage.s3.prefix import CLOCK_PROBE_PREFIX
    from gpuckpt.storage.s3.writer import ObjectStoreWriter

    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/step-1"
    holder = ObjectStoreWriter(url, **s3_options(endpoint))
    holder.begin()
    real_head = obstore.head
    deleted: list[str] = []

    def head(store: Any, path: str) -> Any:
        if CLOCK_PROBE_PREFIX in path and not deleted:
            obstore.delete(store, [path])  # what the other save's begin does
            deleted.append(path)
        return real_head(store, path)

    monkeypatch.setattr(obstore, "head", head)
    try:
        second = ObjectStoreWriter(url, **s3_options(endpoint))
        with pytest.raises(gpuckpt.CheckpointExistsError, match="another save to it is running"):
            second.begin()
        assert deleted
    finally:
        monkeypatch.undo()
        holder.abort()
    assert not any(k.startswith(".gpuckpt-clock-") for k in _keys(endpoint, url))


def test_an_outage_past_half_the_lease_is_a_write_error_that_says_so_and_deletes_nothing(
    endpoint: str,
) -> None:
    """The store drops every request for longer than half the lease while a chunk put is in
    flight: the save stops at its next request, as a stalled one does, but says why (its claim's
    refreshes could not reach the store), as a CheckpointWriteError, not a takeover that nothing
    made. It deletes nothing (the claim may pass to another save by the time its deletes land)."""
    url = f"s3://{BUCKET}/outage-{uuid.uuid4().hex[:8]}"
    lease = 2.0
    fast = {"max_retries": 1, "backoff": {"init_backoff": timedelta(milliseconds=5)}}
    with FaultProxy(endpoint, faults=("drop",)) as proxy:
        opts = s3_options(proxy.endpoint, lease_seconds=lease, retry_config=fast)
        held = proxy.hold(lambda kind, path: kind == "put" and path.endswith("/t1/c.0"))
        outcome: list[BaseException] = []

        def save() -> None:
            try:
                gpuckpt.save(state(1), url, storage_options=opts, threads=1)
            except BaseException as exc:
                outcome.append(exc)

        saver = threading.Thread(target=save)
        saver.start()
        assert held.arrived.wait(30)
        proxy.set_rate(1.0)  # the outage: every request from now on is dropped
        time.sleep(lease)  # the claim's refreshes fail meanwhile
        held.release()  # (the put held was let through before the outage began)
        saver.join(60)
        proxy.set_rate(0.0)
    assert not saver.is_alive() and len(outcome) == 1, outcome
    err = outcome[0]
    assert isinstance(err, gpuckpt.CheckpointWriteError) and not isinstance(
        err, gpuckpt.CheckpointExistsError
    )
    assert "could not reach the store to refresh its claim" in str(err) and url in str(err), err
    assert "the last refresh failed" in str(err) and "deleted nothing" in str(err), err
    left = _keys(endpoint, url)
    assert CLAIM_KEY in left and "t1/c.0" in left and "zarr.json" not in left, left
    # the claim it left ages like a dead save's: the next save takes it over and publishes
    time.sleep(lease)
    gpuckpt.save(state(2), url, storage_options=s3_options(endpoint, lease_seconds=lease))
    _same(gpuckpt.load_state_dict(url, storage_options=s3_options(endpoint)), state(2))
