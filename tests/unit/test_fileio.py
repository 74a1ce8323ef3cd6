"""Vectored reads and writes of chunk bytes."""

from __future__ import annotations

import os
import threading

from hypothesis import given
from hypothesis import strategies as st

from gpuckpt.storage.local.fileio import _advance, readv_exact, writev_all


@given(sizes=st.lists(st.integers(0, 9), max_size=6), data=st.data())
def test_advance_drops_exactly_n_bytes(sizes, data):
    blob = bytes(range(sum(sizes)))
    views, start = [], 0
    for s in sizes:
        views.append(memoryview(blob)[start : start + s])
        start += s
    n = data.draw(st.integers(0, len(blob)))
    rest = _advance(views, n)
    assert b"".join(bytes(v) for v in rest) == blob[n:]


def test_readv_exact_fills_buffers_across_short_reads():
    r, w = os.pipe()
    payload = os.urandom(200_000)

    def feed() -> None:
        for i in range(0, len(payload), 7_001):  # many short reads on the other end
            os.write(w, payload[i : i + 7_001])
        os.close(w)

    t = threading.Thread(target=feed)
    t.start()
    bufs = [bytearray(150_000), bytearray(0), bytearray(50_000)]
    try:
        assert readv_exact(r, bufs) == len(payload)
    finally:
        t.join()
        os.close(r)
    assert bytes(bufs[0]) + bytes(bufs[2]) == payload


def test_readv_exact_is_short_at_end_of_file(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"abcdef")
    fd = os.open(p, os.O_RDONLY)
    try:
        a, b = bytearray(4), bytearray(4)
        assert readv_exact(fd, [a, b]) == 6
    finally:
        os.close(fd)
    assert bytes(a) == b"abcd" and bytes(b[:2]) == b"ef"


def test_writev_all_writes_everything_through_a_pipe():
    # a pipe takes at most its capacity per call: writev returns short counts
    r, w = os.pipe()
    parts = [os.urandom(100_000), b"", os.urandom(70_000), b"xyz"]
    got = bytearray()

    def drain() -> None:
        while chunk := os.read(r, 5_000):
            got.extend(chunk)

    t = threading.Thread(target=drain)
    t.start()
    writev_all(w, parts)
    os.close(w)
    t.join()
    os.close(r)
    assert bytes(got) == b"".join(parts)
