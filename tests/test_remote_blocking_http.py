"""Item bytes of an HTTP(S) source are fetched on the fetching thread (fuse_client/blocking_http.py),
not on fsspec's shared event loop, over keep-alive connections held to the allow-list.

Real HTTP servers on 127.0.0.1 (Python's, HTTP/1.1 keep-alive); RemoteStore.fetch as the mount
calls it. The allow-list attacks through the mount are in test_allow_list_attacks.py; the slow,
paused, dropped and replaced items in test_fuse_bad_day.py and test_fuse_stall*.py.
"""

from __future__ import annotations

import http.server
import os
import socket
import threading
import zlib

import pytest

from fuse_client.remote import FileEntry, RemoteFetchError, RemoteStore
from fuse_client.token_bucket import Throttle

ITEMS = {"a.bin": os.urandom(100_000), "b.bin": os.urandom(9 * 1024 * 1024), "c.bin": b"tiny"}


class KeepAliveSource:
    """HTTP/1.1 with keep-alive; counts the TCP connections it accepted. `chunked`: bodies are
    sent with Transfer-Encoding: chunked (no Content-Length). `idle_timeout_s`: the server closes
    a connection idle that long (as nginx's keepalive_timeout does)."""

    def __init__(self, chunked: bool = False, idle_timeout_s: float | None = None) -> None:
        outer = self
        self.connections = 0
        self.lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = idle_timeout_s

            def setup(self) -> None:
                super().setup()
                with outer.lock:
                    outer.connections += 1

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                data = ITEMS.get(self.path.rpartition("/")[2])
                if data is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for i in range(0, len(data), 100_000):
                        piece = data[i:i + 100_000]
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/ds/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _fetch(store: RemoteStore, name: str, on_progress=lambda: None) -> bytes:
    got = bytearray()

    def write(data, offset: int) -> None:
        assert offset == len(got)
        got.extend(data)

    crc = store.fetch(FileEntry(0, name, len(ITEMS[name])), write, Throttle(float("inf")), lambda n: None, got.clear,
                      sleep=lambda s: None, on_progress=on_progress)
    assert crc == zlib.crc32(got)
    return bytes(got)


@pytest.fixture
def source():
    src = KeepAliveSource()
    yield src
    src.close()


def test_item_bytes_arrive_on_the_fetching_thread_not_on_fsspecs_event_loop(source):
    """Every piece of an item (small: one GET; large: 4 MiB chunks) is received by the thread that
    fetches it: before, each piece came in on fsspec's one event-loop thread and was handed over."""
    store = RemoteStore(source.url)
    for name in ("a.bin", "b.bin"):
        threads: set[str] = set()
        assert _fetch(store, name, lambda: threads.add(threading.current_thread().name)) == ITEMS[name]
        assert threads == {threading.current_thread().name}, (name, threads)
    store.close()


def test_keep_alive_connections_are_reused(source):
    store = RemoteStore(source.url)
    for name in ("a.bin", "b.bin", "c.bin", "a.bin", "b.bin"):
        assert _fetch(store, name) == ITEMS[name]
    assert source.connections == 1  # one connection for every item, one after the other
    store.close()


def test_an_idle_connection_the_server_closed_is_replaced_not_failed():
    src = KeepAliveSource(idle_timeout_s=0.2)
    try:
        store = RemoteStore(src.url)
        assert _fetch(store, "a.bin") == ITEMS["a.bin"]
        threading.Event().wait(0.6)  # the server drops the idle connection
        assert _fetch(store, "b.bin") == ITEMS["b.bin"]
        assert src.connections == 2
        store.close()
    finally:
        src.close()


def test_chunked_bodies_are_decoded_and_the_connection_kept():
    src = KeepAliveSource(chunked=True)
    try:
        store = RemoteStore(src.url)
        for name in ("a.bin", "b.bin", "c.bin", "a.bin"):
            assert _fetch(store, name) == ITEMS[name]
        assert src.connections == 1
        store.close()
    finally:
        src.close()


def test_an_item_name_that_resolves_to_an_internal_address_is_refused_at_connect_time(monkeypatch):
    """DNS rebinding on the item path: the URL passes the allow-list (a public-looking https
    name), the name then resolves to loopback; no TCP connection is made, the fetch fails."""
    from contract.uri_policy import UriPolicy

    real = socket.getaddrinfo

    def fake_getaddrinfo(host, port, *args, **kwargs):  # type: ignore[no-untyped-def]
        return real("127.0.0.1" if host == "rebind.example.com" else host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    connections = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    threading.Thread(target=lambda: connections.append(listener.accept()), daemon=True).start()
    try:
        store = RemoteStore(f"https://rebind.example.com:{port}/ds/", allow=UriPolicy())
        with pytest.raises(RemoteFetchError, match="refused"):
            _fetch(store, "a.bin")
        assert connections == []  # not even a TCP connection was made
    finally:
        listener.close()


def test_body_bytes_already_received_are_read_without_a_poll(source, monkeypatch):
    """A body whose bytes are in the socket already is read with recv alone: before, every read
    of an interruptible fetch (a miss on its open's thread) made a poll object and polled once,
    and the socket's timeout then polled again in CPython before the recv."""
    from fuse_client import blocking_http

    store = RemoteStore(source.url)
    pool = store._streams()._http  # the store's own pool, held to its allow-list guard
    resp = pool.get(source.url + "a.bin", {}, lambda: 30.0)
    threading.Event().wait(0.3)  # the rest of the 100 KB body arrives in the socket's buffer
    polls = []
    real_poll = blocking_http.select.poll

    class CountingSelect:  # the module's `select`, with every poll object made counted
        POLLIN, POLLOUT = blocking_http.select.POLLIN, blocking_http.select.POLLOUT

        @staticmethod
        def poll():
            polls.append(1)
            return real_poll()

        select = staticmethod(blocking_http.select.select)

    monkeypatch.setattr(blocking_http, "select", CountingSelect)
    got = bytearray(len(ITEMS["a.bin"]))
    view, n = memoryview(got), 0
    with blocking_http.interruptible(lambda due: None):
        while k := resp.readinto1(view[n:], lambda: 30.0, lambda k: None):
            n += k
    assert bytes(got[:n]) == ITEMS["a.bin"]
    assert polls == []
    resp.close()
    store.close()


def test_a_body_that_stops_arriving_times_out_after_the_wait_limit():
    """The non-blocking read still waits for bytes, up to `timeout()`, then raises TimeoutError
    (as the socket's own timeout did)."""
    import time

    from fuse_client import blocking_http

    held = threading.Event()

    class Stalling(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b"x" * 10)
            self.wfile.flush()
            held.wait(10)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stalling)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/ds/"
    try:
        store = RemoteStore(url)
        for check in (None, lambda due: None):
            resp = store._streams()._http.get(url + "a.bin", {}, lambda: 30.0)
            buf = memoryview(bytearray(1000))
            assert resp.readinto1(buf, lambda: 0.3, lambda n: None) == 10
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                if check is None:
                    resp.readinto1(buf[10:], lambda: 0.3, lambda n: None)
                else:
                    with blocking_http.interruptible(check):
                        resp.readinto1(buf[10:], lambda: 0.3, lambda n: None)
            assert 0.25 <= time.monotonic() - t0 < 5
            resp.close_quietly()
        store.close()
    finally:
        held.set()
        server.shutdown()
        server.server_close()
