"""A fault-injecting HTTP proxy on loopback, put in front of an object-store server (moto's S3) by tests.

Storage faults are what a checkpoint meets on a real object store and never on
an emulator: throttling, server errors, connections reset, answers cut short,
slow answers, one part of a multipart upload failing.  :class:`FaultProxy`
forwards every request to the server behind it and, where a :class:`Rule`
matches, does something else instead::

    with FaultProxy(s3_endpoint) as proxy:                  # tests: the ``proxied_s3`` fixture
        options = options_through(proxy, s3_options)           # client_kwargs.endpoint_url -> the proxy
        rule = proxy.add("slowdown", method="PUT", path=r"/data/", times=2)
        skc.save(state, url, storage_options=options)        # the first two data PUTs get 503 SlowDown
        assert rule.hits == 2

Fault kinds (:data:`KINDS`):

* ``"slowdown"`` -- 503 with S3's ``SlowDown`` XML error body;
* ``"throttle"`` -- 429 ``TooManyRequests`` (what S3-compatible stores and GCS send);
* ``"internal"`` -- 500 ``InternalError``;
* ``"reset"`` -- the request is read, then the connection is reset (RST, no answer);
* ``"cut"`` -- the server's answer is relayed with its full ``Content-Length`` but only half its body
  (an answer without a body, a PUT's, loses half its head), then the connection is closed; the
  request itself reached the server whole;
* ``"slow_first_byte"`` -- the server's answer is held back ``delay`` seconds before its first byte;
* ``"latency"`` -- ``delay`` seconds added before the request is forwarded.

A rule matches on ``method`` (exact), ``path`` and ``query`` (regular expressions searched in the
request's path and query string; S3's multipart parts are ``query=r"partNumber=2&"``, or use
:func:`part`), skips its first ``skip`` matches, then fires ``times`` times (``None``: for ever).
The first rule that fires wins.  Every request is logged in :attr:`FaultProxy.requests`.

Everything is bounded: sockets time out after ``io_timeout`` seconds, a connection is served until its
client closes it, and :meth:`FaultProxy.stop` closes the listener and every open connection.  The
proxy listens on 127.0.0.1 only, on a free port.
"""

from __future__ import annotations

import re
import socket
import socketserver
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Iterator

__all__ = ["KINDS", "FaultProxy", "Request", "Rule", "options_through", "part", "s3_error_body"]

KINDS = ("slowdown", "throttle", "internal", "reset", "cut", "slow_first_byte", "latency")
_STATUS = {"slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
           "throttle": (429, "Too Many Requests", "TooManyRequests", "Please reduce your request rate."),
           "internal": (500, "Internal Server Error", "InternalError",
                        "We encountered an internal error. Please try again.")}
_MAX_HEADER_LINES = 200


def s3_error_body(code: str, message: str, resource: str) -> bytes:
    """An S3 error document as S3 sends it."""
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<Resource>{resource}</Resource><RequestId>FAULTPROXY0000001</RequestId></Error>").encode()


def options_through(proxy: "FaultProxy", options: dict) -> dict:
    """s3fs ``storage_options`` (such as the ``s3_server`` fixture's) sent through ``proxy`` instead, with a
    client of their own (fsspec's instance cache would hand back a client bound to another endpoint)."""
    return {**options, "client_kwargs": {**(options.get("client_kwargs") or {}), "endpoint_url": proxy.endpoint},
            "skip_instance_cache": True}


def part(n: int) -> str:
    """The ``query`` pattern of part ``n`` of a multipart upload (``PUT ...?partNumber=n&uploadId=...``)."""
    return rf"(^|&)partNumber={n}(&|$)"


@dataclass(frozen=True)
class Request:
    """One request the proxy saw: ``fault`` is the kind that fired ("" when forwarded as is);
    ``status`` the status the client was sent (0 for a reset); ``nbytes`` the body bytes it carried
    (the request's, a PUT's part, plus the answer's, a GET's range)."""
    method: str
    path: str
    query: str
    fault: str
    status: int
    at: float
    nbytes: int = 0


@dataclass
class Rule:
    """A programmed fault: see the module's docstring.  ``hits`` counts the times it fired."""
    kind: str
    method: str | None = None
    path: str | None = None
    query: str | None = None
    times: int | None = 1
    skip: int = 0
    delay: float = 0.0
    seen: int = 0
    hits: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault {self.kind!r}; one of {', '.join(KINDS)}")

    def fires(self, method: str, path: str, query: str) -> bool:
        if self.method is not None and method != self.method:
            return False
        if self.path is not None and not re.search(self.path, path):
            return False
        if self.query is not None and not re.search(self.query, query):
            return False
        with self._lock:
            self.seen += 1
            if self.seen <= self.skip or (self.times is not None and self.hits >= self.times):
                return False
            self.hits += 1
            return True


class _Closed(Exception):
    """The client closed its connection (or sent something that is not HTTP)."""


def _read_head(reader) -> tuple[str, list[tuple[str, str]]]:
    first = reader.readline(65537)
    if not first:
        raise _Closed()
    headers = []
    for _ in range(_MAX_HEADER_LINES):
        line = reader.readline(65537)
        if line in (b"\r\n", b"\n", b""):
            return first.decode("latin-1").rstrip("\r\n"), headers
        name, _, value = line.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    raise _Closed()


def _header(headers: list[tuple[str, str]], name: str) -> str | None:
    return next((v for k, v in headers if k.lower() == name), None)


def _without(headers: list[tuple[str, str]], *names: str) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() not in names]


def _read_body(reader, headers: list[tuple[str, str]], *, until_close: bool) -> bytes:
    if (_header(headers, "transfer-encoding") or "").lower() == "chunked":
        out = bytearray()
        while True:
            size = int(reader.readline(1024).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while reader.readline(65537) not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(out)
            out += reader.read(size)
            reader.readline(16)
    length = _header(headers, "content-length")
    if length is not None:
        return reader.read(int(length))
    return reader.read() if until_close else b""


def _encode(head: str, headers: list[tuple[str, str]]) -> bytes:
    return (head + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode("latin-1")


class _Handler(socketserver.StreamRequestHandler):
    server: "_Server"

    def handle(self) -> None:
        self.request.settimeout(self.server.proxy.io_timeout)
        self.server.proxy.track(self.request, True)
        try:
            while not self.server.proxy.stopped.is_set():
                if not self.one_request():
                    return
        except (_Closed, OSError, ValueError):
            return
        finally:
            self.server.proxy.track(self.request, False)

    def one_request(self) -> bool:
        """Serve one request; whether the connection stays open for the next."""
        proxy = self.server.proxy
        head, headers = _read_head(self.rfile)
        method, target, _ = head.split(" ", 2)
        if (_header(headers, "expect") or "").lower() == "100-continue":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.wfile.flush()
        body = _read_body(self.rfile, headers, until_close=False)
        parsed = urllib.parse.urlsplit(target)
        rule = proxy.rule_for(method, parsed.path, parsed.query)
        kind = rule.kind if rule else ""

        def log(status: int, answer: bytes = b"") -> None:
            proxy.log(Request(method, parsed.path, parsed.query, kind, status, time.monotonic(),
                              len(body) + len(answer)))

        if kind in _STATUS:
            status, reason, code, message = _STATUS[kind]
            payload = s3_error_body(code, message, parsed.path) if method != "HEAD" else b""
            log(status)  # before the answer: a client that fails on it must find its request logged
            self.wfile.write(_encode(f"HTTP/1.1 {status} {reason}", [
                ("Content-Type", "application/xml"), ("Content-Length", str(len(payload))),
                ("x-amz-request-id", "FAULTPROXY0000001")]) + payload)
            self.wfile.flush()
            return True
        if kind == "reset":
            self.request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            log(0)
            self.request.close()
            return False
        if kind == "latency":
            proxy.stopped.wait(rule.delay)
        status_line, out_headers, payload = proxy.forward(method, target, headers, body)
        status = int(status_line.split(" ", 2)[1])
        log(status, payload)
        if kind == "slow_first_byte":
            proxy.stopped.wait(rule.delay)
        if method == "HEAD":
            self.wfile.write(_encode(status_line, _without(out_headers, "transfer-encoding", "connection")))
            self.wfile.flush()
            return True
        out_headers = _without(out_headers, "transfer-encoding", "content-length", "connection")
        out_headers.append(("Content-Length", str(len(payload))))
        if kind == "cut":  # half the body; an answer without one (a PUT's) loses half its head instead
            whole = _encode(status_line, out_headers) + payload
            self.wfile.write(whole[:len(whole) - len(payload) // 2] if payload else whole[:len(whole) // 2])
            self.wfile.flush()
            self.request.shutdown(socket.SHUT_RDWR)
            return False
        self.wfile.write(_encode(status_line, out_headers) + payload)
        self.wfile.flush()
        return True


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: "FaultProxy"


class FaultProxy:
    """A proxy on ``127.0.0.1`` (a free port) in front of the HTTP server at ``upstream``."""

    def __init__(self, upstream: str, *, io_timeout: float = 60.0) -> None:
        parts = urllib.parse.urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.io_timeout = io_timeout
        self.rules: list[Rule] = []
        self.requests: list[Request] = []
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None

    # -- lifetime ----------------------------------------------------------
    def start(self) -> "FaultProxy":
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            for sock in list(self._open):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- programming faults --------------------------------------------------
    def add(self, kind: str, *, method: str | None = None, path: str | None = None, query: str | None = None,
            times: int | None = 1, skip: int = 0, delay: float = 0.0) -> Rule:
        """Program a fault (see the module's docstring); returns the rule, whose ``hits`` count its firings."""
        rule = Rule(kind, method, path, query, times, skip, delay)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every rule and forget the requests seen: from now on everything is forwarded as is."""
        with self._lock:
            self.rules.clear()
            self.requests.clear()

    def faults(self) -> Iterator[Request]:
        """The requests a fault was injected into."""
        return (r for r in list(self.requests) if r.fault)

    # -- used by the handler ---------------------------------------------------
    def rule_for(self, method: str, path: str, query: str) -> Rule | None:
        with self._lock:
            rules = list(self.rules)
        return next((r for r in rules if r.fires(method, path, query)), None)

    def log(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def track(self, sock: socket.socket, opened: bool) -> None:
        with self._lock:
            (self._open.add if opened else self._open.discard)(sock)

    def forward(self, method: str, target: str, headers: list[tuple[str, str]],
                body: bytes) -> tuple[str, list[tuple[str, str]], bytes]:
        """Send the request upstream on a connection of its own: (status line, headers, body) of the answer."""
        headers = _without(headers, "expect", "transfer-encoding", "content-length", "connection")
        if body or method in ("PUT", "POST"):
            headers.append(("Content-Length", str(len(body))))
        headers.append(("Connection", "close"))
        with socket.create_connection(self.upstream, timeout=self.io_timeout) as up:
            up.sendall(_encode(f"{method} {target} HTTP/1.1", headers) + body)
            with up.makefile("rb") as reader:
                while True:
                    status_line, out_headers = _read_head(reader)
                    if not status_line.split(" ", 2)[1].startswith("1"):
                        break
                has_body = method != "HEAD" and status_line.split(" ", 2)[1] not in ("204", "304")
                payload = _read_body(reader, out_headers, until_close=True) if has_body else b""
        return status_line, out_headers, payload
