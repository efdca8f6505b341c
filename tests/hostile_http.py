"""A real HTTP source on 127.0.0.1 that misbehaves on purpose, for the data path's bad-day tests.

It serves a flat dataset of in-memory items under /ds/ with nginx's JSON directory index
(`autoindex_format json`), answers `Range: bytes=N-` with 206 and honours `If-Range` (strong
ETag or Last-Modified), as nginx does, and can, per item:

- trickle: send `rate` bytes per second in small pieces (slow but alive);
- pause: stop for `seconds` once `at` bytes of the body are sent, on its first `times` responses;
- drop: close the connection once `at` bytes are sent (or every response after `drop_every`
  bytes of its body), on its first `times` responses;
- replace: after `at` bytes of the first response, replace the item's content (a new ETag and
  date) and close the connection, as a store does when an object is overwritten mid-fetch;
- no_ranges: ignore Range and answer every request with the whole item (200);
- keep_validators: keep the first ETag and Last-Modified after a replace (other bytes, same validators);
- no_validators: send no ETag and no Last-Modified (ranges are still honoured, without If-Range);
- oversend: send `extra` bytes more than the listing says, with no Content-Length (a hostile
  source that would fill the mount's memory).

Every request is recorded (path, Range header, bytes sent), so a test can prove a retry resumed.
"""

from __future__ import annotations

import contextlib
import email.utils
import hashlib
import http.server
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path


_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


def start_server(handler: type[http.server.BaseHTTPRequestHandler]) -> tuple[http.server.ThreadingHTTPServer, str]:
    """A threaded HTTP server of `handler` on a free port of 127.0.0.1, serving from a daemon
    thread, and the URL of its dataset (`/ds/`)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/ds/"


def stop_server(server: http.server.ThreadingHTTPServer, release: threading.Event | None = None) -> None:
    """Stop `server`; `release` (set first) is what its held-back answers wait on."""
    if release is not None:
        release.set()
    server.shutdown()
    server.server_close()


@dataclass
class Behaviour:
    trickle_rate: float | None = None  # bytes/s
    pause_at: int | tuple[int, ...] | None = None  # one offset, or several (each pauses once)
    pause_s: float = 0.0
    drop_at: int | None = None
    drop_every: int | None = None  # cut each misbehaving response after this many body bytes
    replace_at: int | None = None
    replace_with: bytes | None = None
    oversend: int = 0
    fail_first: int = 0  # the first this many responses are 500s
    no_ranges: bool = False  # ignore Range (every answer is a 200 of the whole item), as some servers do
    # Keep answering with the first ETag and Last-Modified even after `replace` (a broken or
    # lying server: other bytes under the same validators).
    keep_validators: bool = False
    no_validators: bool = False  # no ETag, no Last-Modified: nothing identifies a version
    validators: tuple[str, float] | None = None
    times: int = 1  # responses that pause / drop (the later ones behave)
    served: int = 0


@dataclass
class Request:
    path: str
    range: str | None
    if_range: str | None
    status: int = 0
    sent: int = 0


@dataclass
class HostileSource:
    items: dict[str, bytes]
    behaviour: dict[str, Behaviour] = field(default_factory=dict)
    index_body: bytes | None = None  # a hostile index instead of the real one
    # ... or one streamed from this generator (no Content-Length), with this Content-Type
    index_stream: object = None
    index_type: str = "application/json"
    index_failures: int = 0  # the first this many index requests answer 500

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[Request] = []
        self.mtimes = {name: time.time() - 3600 for name in self.items}
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                outer._get(self)

            def do_HEAD(self) -> None:
                outer._get(self, head=True)

        self.server, self.url = start_server(Handler)

    def close(self) -> None:
        stop_server(self.server)

    def etag(self, name: str) -> str:
        return '"' + hashlib.sha1(self.items[name]).hexdigest()[:16] + '"'

    def item_requests(self, name: str) -> list[Request]:
        with self.lock:
            return [r for r in self.requests if r.path == "/ds/" + name]

    # -- serving -----------------------------------------------------------------------------

    def _index(self) -> bytes:
        return json.dumps([{"name": n, "type": "file", "size": len(d),
                            "mtime": email.utils.formatdate(self.mtimes[n], usegmt=True)}
                           for n, d in sorted(self.items.items())]).encode()

    def _get(self, h: http.server.BaseHTTPRequestHandler, head: bool = False) -> None:
        req = Request(h.path, h.headers.get("Range"), h.headers.get("If-Range"))
        with self.lock:
            self.requests.append(req)
        if h.path == "/ds/":
            with self.lock:
                fail = self.index_failures > 0
                self.index_failures -= fail
            if fail:
                self._send(h, req, 500, {}, b"try again", head)
                return
            if self.index_stream is not None:
                h.send_response(200)
                h.send_header("Content-Type", self.index_type)
                h.send_header("Connection", "close")
                h.end_headers()
                try:
                    for piece in self.index_stream():
                        h.wfile.write(piece)
                        req.sent += len(piece)
                except OSError:  # the client stopped reading
                    pass
                h.close_connection = True
                return
            body = self.index_body if self.index_body is not None else self._index()
            self._send(h, req, 200, {"Content-Type": "application/json"}, body, head)
            return
        name = h.path[len("/ds/"):]
        with self.lock:
            data = self.items.get(name)
            b = self.behaviour.get(name)
            if b is not None:
                b.served += 1
                misbehave = b.served <= b.times
            etag, mtime = (self.etag(name), self.mtimes[name]) if data is not None else (None, 0)
            if b is not None and b.keep_validators and data is not None:
                if b.validators is None:
                    b.validators = (etag, mtime)
                etag, mtime = b.validators
        if data is None:
            self._send(h, req, 404, {}, b"not found", head)
            return
        if b is not None and b.served <= b.fail_first:
            self._send(h, req, 500, {}, b"busy", head)
            return
        headers = {"ETag": etag, "Last-Modified": email.utils.formatdate(mtime, usegmt=True),
                   "Accept-Ranges": "bytes"}
        start, end, status = 0, len(data), 200
        rng = req.range
        if b is not None and b.no_ranges:
            rng = headers["Accept-Ranges"] = None
        if b is not None and b.no_validators:
            headers["ETag"] = headers["Last-Modified"] = None
        m = _RANGE.fullmatch(rng or "")
        if m and int(m.group(1)) < len(data):  # `bytes=N-` (silod) or `bytes=N-M` (rclone)
            if req.if_range is None or req.if_range in (etag, headers["Last-Modified"]):
                start, status = int(m.group(1)), 206
                end = min(len(data), int(m.group(2)) + 1) if m.group(2) else len(data)
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        body = data[start:end]
        if b is not None and b.oversend:
            headers["Content-Length"] = None  # close-delimited: the server decides the length
        self._send(h, req, status, headers, body, head, name, b if (b is not None and misbehave) else None, start,
                   b if b is not None and b.trickle_rate else None)

    def _send(self, h, req: Request, status: int, headers: dict, body: bytes, head: bool, name: str = "",
              b: Behaviour | None = None, start: int = 0, trickle: Behaviour | None = None) -> None:
        req.status = status
        h.send_response(status)
        if headers.get("Content-Length", "") is not None:
            h.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            if v is not None and k != "Content-Length":
                h.send_header(k, v)
        h.send_header("Connection", "close")
        h.end_headers()
        if head:
            return
        try:
            self._body(h, req, body, name, b, start, trickle)
            over = self.behaviour.get(name) if name else None
            if over is not None and over.oversend:  # generated as it is sent: never in memory here
                zeros = bytes(1 << 20)
                left = over.oversend
                while left > 0:
                    h.wfile.write(zeros[:min(left, len(zeros))])
                    req.sent += min(left, len(zeros))
                    left -= len(zeros)
        except OSError:  # the client went away
            pass
        h.close_connection = True

    def _body(self, h, req: Request, body: bytes, name: str, b: Behaviour | None, start: int,
              trickle: Behaviour | None) -> None:
        piece = 64 * 1024
        if trickle is not None:
            piece = max(1, int(trickle.trickle_rate / 10))
        pos = 0
        while pos < len(body):
            at = start + pos  # offset in the object
            end = min(len(body), pos + piece)
            if b is not None and b.drop_every is not None and pos + (end - pos) >= b.drop_every:
                end = pos + max(0, b.drop_every - pos)
                h.wfile.write(body[pos:end])
                req.sent += end - pos
                self._abort(h)
                return
            pauses = () if b is None or b.pause_at is None else (
                (b.pause_at,) if isinstance(b.pause_at, int) else tuple(b.pause_at))
            if b is not None:
                for mark in (*pauses, b.drop_at, b.replace_at):
                    if mark is not None and at < mark < start + end:
                        end = mark - start
            h.wfile.write(body[pos:end])
            req.sent += end - pos
            pos = end
            at = start + pos
            if b is not None:
                if at in pauses:
                    h.wfile.flush()
                    time.sleep(b.pause_s)
                if b.drop_at is not None and at == b.drop_at:
                    self._abort(h)
                    return
                if b.replace_at is not None and at == b.replace_at:
                    with self.lock:
                        self.items[name] = b.replace_with
                        self.mtimes[name] = time.time()
                    self._abort(h)
                    return
            if trickle is not None:
                h.wfile.flush()
                time.sleep(0.1)

    @staticmethod
    def _abort(h) -> None:
        h.wfile.flush()
        try:
            h.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        h.close_connection = True


@contextlib.contextmanager
def mount_and_read(tmp_path: Path, src: HostileSource, name: str, data: bytes, mount_args: Sequence[str],
                   read: Callable[[Path], "bytes | OSError"]) -> Iterator:
    """Mount `src` (dataplane_helpers.mounted: dataset `ds`, job `job1`, with `mount_args`), read
    item `name` through it with `read` (its bytes, or the OSError it failed with) and check they
    are `data` (an OSError fails the test with the mount's log); yield the mount for the test's
    own checks. `src` is closed at the end, whatever happened."""
    from dataplane_helpers import mounted

    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", *mount_args) as m:
            got = read(m.mountpoint / name)
            assert got == data, f"{got!r}\n{m.log()}" if isinstance(got, OSError) else "content differs"
            yield m
    finally:
        src.close()
