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
