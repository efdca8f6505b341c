"""Blocking HTTP(S) GETs of item bytes on the fetching thread, held to the allow-list.

Why not fsspec's session: every aiohttp request of the mount runs on fsspec's one event-loop
thread, and a cold epoch's misses all queue there (request, response parsing, the body copied by
aiohttp's parser, the result handed back to the waiting fetch thread through fsspec's `sync`);
profiled, that thread was > 90% of a miss's GIL time. Here each fetch thread does its own GET
with the standard library's http.client (no new dependency, and the least Python per request of
the clients at hand) on a connection taken from a small keep-alive pool, and reads the body with
`readinto1` straight into the buffer the caller stages from: no event loop, no hand-over, no
copy beyond the kernel's.

The same guarantees as safe_http.py gives the aiohttp session, applied here on every hop:
- each request URL, and each redirect target before it is followed, passes `HttpGuard.check_url`
  (scheme, the allow-list prefix or rule, literal addresses in any spelling);
- the connection is made to an address `HttpGuard.check_address` allowed, after this module's own
  resolution (DNS rebinding cannot slip between check and connect), names an operator's prefix
  names are noted as trusted, exactly as the aiohttp resolver does;
- redirects are followed by this module (at most `MAX_REDIRECTS`), never by the client.

Liveness: every wait for a byte (connect aside, which has its own timeout) is bounded by the
caller's `timeout()` as it is at that moment, and every `recv` that returns data is reported
through `on_piece` at once, so a slow but alive item is never taken for a dead one.

Interruptible waits: a thread that must be able to give up a request at once (a fetch run on the
thread of the open waiting for it, whose reader may be killed) sets a check with
`interruptible(check)`; its waits for the connection and for bytes then poll the socket in
slices of `CHECK_SLICE_S` and call `check()` between them, which raises to abandon the request.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import io
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import quote, urljoin, urlsplit

from fuse_client.safe_http import DestinationRefused, HttpGuard

MAX_REDIRECTS = 10  # aiohttp's default, which the fsspec path followed
_REDIRECTS = (301, 302, 303, 307, 308)
_DEFAULT_PORTS = {"http": 80, "https": 443}
_HEADER_BUFFER = 64 * 1024  # the reader's buffer: headers, and the body's first bytes with them
# Characters left as they are in a URL's path and query: reserved ones, and `%` so that the
# listing's paths (kept percent-encoded as the server's index spelled them) are sent unchanged.
_SAFE = "/%:@!$&'()*+,;=~-._?"
CHECK_SLICE_S = 0.05  # how often an interruptible wait calls its check (see `interruptible`)
_thread = threading.local()  # .check: this thread's interrupt check, or absent


@contextlib.contextmanager
def interruptible(check: Callable[[float], None]) -> Iterator[None]:
    """Inside the block, this thread's waits for a connection or bytes call `check(due)` every
    CHECK_SLICE_S (`due`: when that slice should have ended, time.monotonic()); whatever it
    raises ends the request (the connection is closed)."""
    _thread.check = check
    try:
        yield
    finally:
        _thread.check = None


def _await(sock: socket.socket, limit: float, check: Callable[[float], None], events: int) -> float:
    """Wait up to `limit` seconds for `events` on `sock` in slices, calling `check()` between
    them; returns what is left of `limit` when they are there or the limit is over (the
    caller's own call then times out)."""
    if events == select.POLLIN and isinstance(sock, ssl.SSLSocket) and sock.pending():
        return limit
    poller = select.poll()
    poller.register(sock, events)
    end = time.monotonic() + limit
    while True:
        now = time.monotonic()
        left = end - now
        step = min(left, CHECK_SLICE_S)
        if left <= 0 or poller.poll(step * 1000):
            return max(0.001, left)
        check(now + step)


def _ready(poller: select.poll, limit: float, check: Callable[[float], None] | None) -> bool:
    """Whether the poller's socket is ready within `limit` seconds; with a `check`, waits in
    CHECK_SLICE_S slices and calls it between them (as `_await`)."""
    if check is None:
        return bool(poller.poll(limit * 1000))
    end = time.monotonic() + limit
    while True:
        now = time.monotonic()
        left = end - now
        if left <= 0:
            return False
        step = min(left, CHECK_SLICE_S)
        if poller.poll(step * 1000):
            return True
        check(now + step)


def encode_url(url: str) -> str:
    """The URL as sent: spaces, non-ASCII and other unsafe characters percent-encoded, the rest
    (existing %XX escapes included) as they are."""
    parts = urlsplit(url)
    path = quote(parts.path, safe=_SAFE) or "/"
    query = ("?" + quote(parts.query, safe=_SAFE)) if parts.query else ""
    return f"{parts.scheme}://{parts.netloc}{path}{query}"


def guarded_connect(guard: HttpGuard, host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to `host:port` on an address the guard allows (tried in resolver order;
    a refused address is skipped). DestinationRefused when every address is refused."""
    infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    guard.note_resolved(host, port, [str(info[4][0]) for info in infos])
    last: OSError | None = None
    for family, type_, proto, _canon, sockaddr in infos:
        try:
            guard.check_address(str(sockaddr[0]), int(sockaddr[1]))
        except DestinationRefused as exc:
            last = exc
            continue
        sock = socket.socket(family, type_, proto)
        try:
            check = getattr(_thread, "check", None)
            if check is not None:  # connect without blocking, waiting in slices
                sock.setblocking(False)
                err = sock.connect_ex(sockaddr)
                if err == errno.EINPROGRESS:
                    _await(sock, timeout, check, select.POLLOUT)
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if not err and not select.select([], [sock], [], 0)[1]:
                        raise TimeoutError(errno.ETIMEDOUT, f"connecting to {sockaddr} timed out")
                if err:
                    raise OSError(err, f"connecting to {sockaddr}: {errno.errorcode.get(err, err)}")
            sock.settimeout(timeout)
            if check is None:
                sock.connect(sockaddr)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    raise last or OSError(f"{host!r} resolves to no address")


class _Wait:
    """What bounds the connection's next wait for bytes, and whom to tell when bytes arrive
    (changed by the caller between the phases of one request)."""

    __slots__ = ("timeout", "on_piece")

    def __init__(self) -> None:
        self.timeout: Callable[[], float] = lambda: 30.0
        self.on_piece: Callable[[int], None] = lambda n: None


class _SocketReader(io.RawIOBase):
    """The socket as the response reads it: each wait bounded by `wait.timeout()` taken just
    before it, each arrival reported to `wait.on_piece`. `raw` is the socket's own unbuffered
    file (it holds a reference, so a connection http.client closes early - `Connection: close` -
    stays open until the body is read); closing this leaves the connection open for reuse."""

    def __init__(self, sock: socket.socket, wait: _Wait) -> None:
        self._sock = sock
        self._raw = sock.makefile("rb", buffering=0)
        self._wait = wait
        self._plain = not isinstance(sock, ssl.SSLSocket)
        self._poller: select.poll | None = None  # made at the first wait, kept for the next ones

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self._plain:
            n = self._recv_plain(b)
        else:
            limit = max(0.001, self._wait.timeout())
            check = getattr(_thread, "check", None)
            if check is not None:
                limit = _await(self._sock, limit, check, select.POLLIN)
            self._sock.settimeout(limit)
            n = self._raw.readinto(b)
        if n:
            self._wait.on_piece(n)
        return n

    def _recv_plain(self, b) -> int:
        """One recv when bytes are there already (most reads of a body arriving over a fast
        link); only an empty socket is waited for, with one poll (or the interruptible slices).
        A socket with a timeout would poll before every recv (CPython's sock_call) and the
        timeout itself costs an ioctl per call, so the socket stays non-blocking while it is read
        (`HttpPool._request` sets the timeout again before sending the next request)."""
        sock = self._sock
        if sock.gettimeout() != 0.0:
            sock.settimeout(0.0)
        while True:
            try:
                return sock.recv_into(b)
            except BlockingIOError:
                pass
            if self._poller is None:
                self._poller = select.poll()
                self._poller.register(sock, select.POLLIN)
            if not _ready(self._poller, max(0.001, self._wait.timeout()), getattr(_thread, "check", None)):
                raise TimeoutError("timed out")

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class _Shim:
    """What http.client's response is built from: only `makefile` is asked for."""

    __slots__ = ("sock", "wait")

    def __init__(self, sock: socket.socket, wait: _Wait) -> None:
        self.sock, self.wait = sock, wait

    def makefile(self, mode: str, *args, **kwargs):
        return io.BufferedReader(_SocketReader(self.sock, self.wait), _HEADER_BUFFER)


class _Connection:
    """One keep-alive connection to an origin, connected through `guarded_connect`."""

    def __init__(self, pool: "HttpPool", scheme: str, host: str, port: int) -> None:
        self.wait = _Wait()
        wait = self.wait
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        kw = {"context": pool.ssl_context} if scheme == "https" else {}

        class Conn(cls):  # type: ignore[misc, valid-type]
            def connect(self) -> None:
                sock = guarded_connect(pool.guard, host, port, min(pool.connect_timeout_s, max(0.001, wait.timeout())))
                if scheme == "https":
                    sock = pool.ssl_context.wrap_socket(sock, server_hostname=host)
                self.sock = sock

        self.http = Conn(host, port, **kw)
        self.http.response_class = lambda sock, *a, **k: http.client.HTTPResponse(_Shim(sock, wait), *a, **k)
        self.used = False

    def dropped(self) -> bool:
        """An idle connection the server closed (or sent something on unasked)."""
        sock = self.http.sock
        if sock is None:
            return True
        try:
            return bool(select.select([sock], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        try:
            self.http.close()
        except Exception:  # a broken connection is closed already
            pass


class Response:
    """An open response to a GET: its status and headers are read, its body is not."""

    def __init__(self, pool: "HttpPool", key: tuple, conn: _Connection, resp: http.client.HTTPResponse, url: str) -> None:
        self._pool, self._key, self._conn, self._resp = pool, key, conn, resp
        self.url = url
        self.status = resp.status
        self.headers = resp.headers
        # The bytes of the body not read yet, when the server said (no Transfer-Encoding).
        self._left: int | None = None if resp.chunked or resp.length is None else resp.length

    def readinto1(self, view: memoryview, timeout: Callable[[], float], on_piece: Callable[[int], None]) -> int:
        """Up to len(view) bytes of the body into `view` from at most one arrival; 0 at its end.
        `timeout()` bounds each wait for a byte; `on_piece(n)` hears of every arrival."""
        if self._conn is None:
            raise ValueError("the response is closed")
        wait = self._conn.wait
        wait.timeout, wait.on_piece = timeout, on_piece
        resp = self._resp
        if self._left is None:  # chunked, or until the server closes: http.client decodes it
            if resp.isclosed():
                return 0
            piece = resp.read1(len(view))
            view[:len(piece)] = piece
            return len(piece)
        if not self._left:
            return 0
        n = resp.fp.readinto1(view[:self._left])
        if not n:
            raise http.client.IncompleteRead(b"", self._left)
        self._left -= n
        return n

    def close_quietly(self) -> None:
        """Close the response and its connection (a redirect's body is not read)."""
        conn, self._conn = self._conn, None
        self._resp.close()
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Give the connection back for the next request if the body was read to its end, else
        close it (an unread rest is dropped with the connection, never drained)."""
        resp, conn = self._resp, self._conn
        if conn is None:  # closed already
            return
        self._conn = None
        done = resp.isclosed() if self._left is None else self._left == 0
        if done and not resp.will_close:
            resp.length = 0  # read through fp: tell http.client the body is over, so the
            resp.close()     # connection takes the next request
            self._pool._give(self._key, conn)
        else:
            resp.close()
            conn.close()


class HttpPool:
    """Keep-alive connections for blocking GETs, shared by the fetch threads (each connection is
    used by one thread at a time: taken for a request, given back once its body is read)."""

    def __init__(self, guard: HttpGuard, connect_timeout_s: float, max_idle: int = 64) -> None:
        self.guard = guard
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self.ssl_context = ssl.create_default_context()
        self._idle: dict[tuple, list[_Connection]] = {}
        self._n_idle = 0
        self._lock = threading.Lock()

    def get(self, url: str, headers: dict[str, str], timeout: Callable[[], float]) -> Response:
        """GET `url` (redirects followed, each target checked first); the response's status and
        headers are read. `timeout()` bounds each wait (connect: also the connect timeout)."""
        why = "request"
        for _ in range(MAX_REDIRECTS + 1):
            url = encode_url(url)
            self.guard.check_url(url, why=why)
            resp = self._request(url, headers, timeout)
            if resp.status not in _REDIRECTS:
                return resp
            location = resp.headers.get("Location") or resp.headers.get("URI")
            resp.close_quietly()
            if not location:
                raise OSError(f"{url}: HTTP {resp.status} without a Location")
            why, url = f"redirect from {url}", urljoin(url, location.strip())
            self.guard.check_url(encode_url(url), why=why)  # before anything is connected to it
        raise OSError(f"{url}: more than {MAX_REDIRECTS} redirects")

    def _request(self, url: str, headers: dict[str, str], timeout: Callable[[], float]) -> Response:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        host = (parts.hostname or "").rstrip(".")
        port = parts.port or _DEFAULT_PORTS[scheme]
        target = url[len(f"{parts.scheme}://{parts.netloc}"):] or "/"
        key = (scheme, host.lower(), port)
        headers = {"Accept-Encoding": "identity", **headers}
        while True:
            conn, reused = self._take(key)
            conn.wait.timeout, conn.wait.on_piece = timeout, lambda n: None
            try:
                if conn.http.sock is not None:
                    conn.http.sock.settimeout(max(0.001, timeout()))
                conn.http.request("GET", target, headers=headers)
                resp = conn.http.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                conn.close()
                if reused:  # the server closed an idle connection as we used it: a new one
                    continue
                raise OSError(f"{url}: {type(exc).__name__}: {exc}") from exc
            except BaseException:
                conn.close()
                raise
            return Response(self, key, conn, resp, url)

    def _take(self, key: tuple) -> tuple[_Connection, bool]:
        while True:
            with self._lock:
                idle = self._idle.get(key)
                conn = idle.pop() if idle else None
                if conn is not None:
                    self._n_idle -= 1
            if conn is None:
                return _Connection(self, *key), False
            if not conn.dropped():
                return conn, True
            conn.close()

    def _give(self, key: tuple, conn: _Connection) -> None:
        with self._lock:
            if self._n_idle < self.max_idle:
                self._idle.setdefault(key, []).append(conn)
                self._n_idle += 1
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
            self._n_idle = 0
        for conn in conns:
            conn.close()
