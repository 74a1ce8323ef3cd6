"""A fault-injecting HTTP proxy on loopback, in front of an S3-protocol server (tests, benchmarks).

:class:`FaultProxy` forwards each request to the upstream server and, with a
probability per request drawn from a seeded generator, injects one fault:

``slowdown``
    answers ``503 SlowDown`` (S3's throttling) without forwarding;
``error``
    answers ``500 InternalError`` without forwarding;
``reset``
    forwards the request (the server acts on it), then sends part of the
    answer and resets the connection (RST) mid-body;
``drop``
    resets the connection before forwarding (nothing reached the server);
``stall``
    holds the request for ``stall_seconds`` without answering, then closes.

:meth:`FaultProxy.fail` answers the next requests that a test picks (by their
kind and path) with a ``500``, whatever the rate. :meth:`FaultProxy.hold` parks
the next request that a test picks before it is forwarded, until the test
releases it: a request in flight, held there while other clients act (a
stalled writer's put that lands late).

With ``rate=0`` it is a counting proxy: :attr:`FaultProxy.counts` tells the
requests by kind (``put``, ``part``, ``get``, ``head``, ``list``, ...), which the
benchmark reports per save. The decisions come from ``random.Random(seed)`` in
arrival order; which request gets which fault still depends on the order the
client's threads send them.

Examples
--------
>>> with s3_server("b") as upstream, FaultProxy(upstream, rate=0.1, seed=7) as proxy:  # doctest: +SKIP
...     gpuckpt.save(state, "s3://b/ck", storage_options=s3_options(proxy.endpoint))
"""

from __future__ import annotations

import http.client
import random
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

__all__ = ["FAULTS", "FaultProxy", "Hold", "request_kind"]

FAULTS = ("slowdown", "error", "reset", "drop", "stall")
_BODIES = {
    "slowdown": (
        503,
        "Slow Down",
        b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>",
    ),
    "error": (
        500,
        "Internal Server Error",
        b"<Error><Code>InternalError</Code><Message>injected</Message></Error>",
    ),
}
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}


def request_kind(method: str, target: str) -> str:
    """What an S3 request does: put, part, create_upload, complete_upload, get, head, list, delete, ..."""
    query = target.partition("?")[2]
    if method == "PUT":
        return "part" if "partNumber=" in query else "put"
    if method == "POST":
        if "delete" in query.split("&") or query.startswith("delete"):
            return "delete"
        return "create_upload" if query.startswith("uploads") else "complete_upload"
    if method == "GET":
        return "list" if "list-type" in query or query.startswith("prefix") else "get"
    return method.lower()


class Hold:
    """One request parked by :meth:`FaultProxy.hold`: it waits, unforwarded, until :meth:`release`."""

    def __init__(self, match: Callable[[str, str], bool]) -> None:
        self.match = match
        #: set when the request reached the proxy (it waits there now)
        self.arrived = threading.Event()
        #: set once the server answered it (after :meth:`release`); :attr:`status` is that answer's
        self.answered = threading.Event()
        self.status: int | None = None
        #: ``(kind, path)`` of the request held
        self.request: tuple[str, str] | None = None
        self._go = threading.Event()

    def release(self) -> None:
        """Forward the request (now, or as soon as it arrives)."""
        self._go.set()


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        try:
            while True:
                line = self.rfile.readline(65537)
                if not line or not line.strip():
                    return
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers: list[tuple[str, str]] = []
                while True:
                    h = self.rfile.readline(65537)
                    if h in (b"\r\n", b"\n", b""):
                        break
                    name, _, value = h.decode("latin-1").partition(":")
                    headers.append((name.strip(), value.strip()))
                lower = {k.lower(): v for k, v in headers}
                if lower.get("transfer-encoding", "").lower() == "chunked":
                    body = self._read_chunked()
                    headers = [(k, v) for k, v in headers if k.lower() != "transfer-encoding"]
                    headers.append(("Content-Length", str(len(body))))
                else:
                    body = self.rfile.read(int(lower.get("content-length", "0") or 0))
                self.server.proxy._carry("up", len(body))
                fault = self.server.proxy._decide(method, target, len(body))
                self._kind = request_kind(method, target)
                self._path = target.partition("?")[0]
                self._held = len(body)
                hold = self.server.proxy._hold_for(self._kind, self._path)
                if hold is not None:
                    hold._go.wait()
                try:
                    if not self._answer(fault, method, target, body, headers):
                        return
                finally:
                    self._release()
                    if hold is not None:
                        hold.status = self._status
                        hold.answered.set()
        except (OSError, ValueError, http.client.HTTPException):
            return
        finally:
            if self._upstream is not None:
                self._upstream.close()

    _upstream: http.client.HTTPConnection | None = None
    _held: int | None = None
    _kind = ""
    _path = ""
    _status: int | None = None

    def _release(self) -> None:
        """The request stops counting as in flight (once): before its answer goes out, so that
        the client's next request, sent when it has the answer, never overlaps it here."""
        if self._held is not None:
            self.server.proxy._done(self._held)
            self._held = None

    def _answer(
        self, fault: str | None, method: str, target: str, body: bytes, headers: list[tuple[str, str]]
    ) -> bool:
        """Answer one request (or fail it); False when the connection is gone."""
        if fault in _BODIES:
            status, reason, text = _BODIES[fault]
            self._send(status, reason, [("Content-Type", "application/xml")], text, method)
            return True
        if fault == "drop":
            self._reset()
            return False
        if fault == "stall":
            time.sleep(self.server.proxy.stall_seconds)
            return False
        if self._upstream is None:
            self._upstream = http.client.HTTPConnection(*self.server.proxy._upstream, timeout=60)
        self._upstream.request(method, target, body=body, headers=dict(headers))
        resp = self._upstream.getresponse()
        data = resp.read()
        self._status = resp.status
        out = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
        if fault == "reset":
            self._send(resp.status, resp.reason, out, data, method, cut=True)
            self._reset()
            return False
        self._send(resp.status, resp.reason, out, data, method)
        return True

    def _read_chunked(self) -> bytes:
        parts: list[bytes] = []
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(parts)
            parts.append(self.rfile.read(size))
            self.rfile.readline()

    def _send(
        self,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        body: bytes,
        method: str,
        cut: bool = False,
    ) -> None:
        if method != "HEAD":  # a HEAD answer keeps the object's Content-Length, without a body
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
            headers.append(("Content-Length", str(len(body))))
        self._release()
        head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
        raw = head.encode("latin-1") + (b"" if method == "HEAD" else body)
        if cut:  # part of the answer: half the body, or half the head when there is no body
            raw = raw[: len(head) + len(body) // 2] if len(body) > 1 else raw[: len(head) // 2]
        self.server.proxy._sent(self._kind, len(raw) - len(head) if len(raw) > len(head) else 0, self._path)
        self.server.proxy._carry("down", len(raw) - len(head))
        self.wfile.write(raw)
        self.wfile.flush()

    def _reset(self) -> None:
        # SO_LINGER with a zero timeout: close() sends RST, the client sees a reset connection
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: FaultProxy


class FaultProxy:
    """A proxy on ``127.0.0.1`` forwarding to ``upstream`` (``http://host:port``), injecting faults.

    Parameters
    ----------
    upstream
        The server's endpoint.
    rate
        Probability of a fault per request (0: none, a counting proxy).
    seed
        Seed of the decisions.
    faults
        The kinds to draw from (see the module docstring), with equal weight.
    stall_seconds
        How long a stalled request is held.
    bandwidth
        Bytes per second of the link it stands for, each way (None: as fast as it goes):
        request bodies are held until the link upstream has carried them, answer bodies until
        the link back has, every connection sharing the two (a slow object store, for
        benchmarks).
    """

    def __init__(
        self,
        upstream: str,
        *,
        rate: float = 0.0,
        seed: int = 0,
        faults: tuple[str, ...] = FAULTS,
        stall_seconds: float = 2.0,
        bandwidth: float | None = None,
    ) -> None:
        unknown = sorted(set(faults) - set(FAULTS))
        if unknown:
            raise ValueError(f"unknown faults {unknown}; expected some of {FAULTS}")
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rate, self.faults, self.stall_seconds = rate, faults, stall_seconds
        self.bandwidth = bandwidth
        #: when each direction of the link is free again (``time.monotonic``)
        self._link_free = {"up": 0.0, "down": 0.0}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        #: bytes of answer bodies sent to the client, by request kind (``get``: object bytes read)
        self.body_bytes_out: Counter[str] = Counter()
        #: bytes of ``get`` answer bodies by object path (``/bucket/key``): what each object served
        self.get_bytes_by_path: Counter[str] = Counter()
        #: ``(kind, path)`` of every request, in arrival order
        self.requests: list[tuple[str, str]] = []
        #: the most requests the proxy held at once (received, not yet answered)
        self.max_active = 0
        self._active = 0
        #: the most request-body bytes the proxy held at once
        self.max_active_bytes = 0
        self._active_bytes = 0
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._holds: list[Hold] = []
        self._failing: list[list[Any]] = []  # [match, requests left to fail]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="gpuckpt-fault-proxy", daemon=True
        )

    def _decide(self, method: str, target: str, nbytes: int) -> str | None:
        with self._lock:
            self.counts[request_kind(method, target)] += 1
            self.requests.append((request_kind(method, target), target.partition("?")[0]))
            self._active += 1
            self._active_bytes += nbytes
            self.max_active = max(self.max_active, self._active)
            self.max_active_bytes = max(self.max_active_bytes, self._active_bytes)
            chosen = self._failure_for(request_kind(method, target), target.partition("?")[0])
            if chosen is not None:
                self.injected[chosen] += 1
                return chosen
            if self.rate <= 0 or self._rng.random() >= self.rate:
                return None
            fault = self._rng.choice(self.faults)
            self.injected[fault] += 1
            return fault

    def fail(self, match: Callable[[str, str], bool], times: int = 1) -> None:
        """Answer the next ``times`` requests for which ``match(kind, path)`` is true (as
        :meth:`hold` matches them) with ``500 InternalError``, without forwarding them: a part
        of an upload refused, an abort that fails, whatever the rate."""
        with self._lock:
            self._failing.append([match, times])

    def _failure_for(self, kind: str, path: str) -> str | None:
        for rule in self._failing:
            if rule[0](kind, path):
                rule[1] -= 1
                if rule[1] <= 0:
                    self._failing.remove(rule)
                return "error"
        return None

    def hold(self, match: Callable[[str, str], bool]) -> Hold:
        """Park the next request for which ``match(kind, path)`` is true (kinds as
        :func:`request_kind` names them, paths ``/bucket/key``) before it is forwarded,
        until :meth:`Hold.release`; its client waits for the answer meanwhile."""
        held = Hold(match)
        with self._lock:
            self._holds.append(held)
        return held

    def _hold_for(self, kind: str, path: str) -> Hold | None:
        with self._lock:
            for held in self._holds:
                if held.match(kind, path):
                    self._holds.remove(held)
                    held.request = (kind, path)
                    held.arrived.set()
                    return held
        return None

    def _carry(self, direction: str, nbytes: int) -> None:
        """Wait until ``nbytes`` have crossed the link ``direction`` ("up" or "down"), after
        what it carries already (nothing without a :attr:`bandwidth`)."""
        if self.bandwidth is None or nbytes <= 0:
            return
        with self._lock:
            start = max(time.monotonic(), self._link_free[direction])
            end = self._link_free[direction] = start + nbytes / self.bandwidth
        delay = end - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _sent(self, kind: str, nbytes: int, path: str = "") -> None:
        with self._lock:
            self.body_bytes_out[kind] += nbytes
            if kind == "get":
                self.get_bytes_by_path[path] += nbytes

    def _done(self, nbytes: int) -> None:
        with self._lock:
            self._active -= 1
            self._active_bytes -= nbytes

    def set_rate(self, rate: float) -> None:
        """Change the fault probability from now on (0 turns the faults off)."""
        with self._lock:
            self.rate = rate

    def reset_counts(self) -> dict[str, int]:
        """The request counts so far (then zeroed, with :attr:`body_bytes_out` and :attr:`requests`)."""
        with self._lock:
            out = dict(self.counts)
            self.counts.clear()
            self.body_bytes_out.clear()
            self.get_bytes_by_path.clear()
            self.requests.clear()
            self.max_active = self.max_active_bytes = 0
            return out

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
