"""A small miss fetched on its open's own thread (dataplane.ItemResolver._lead_here), and what
must still hold then: a killed reader's open leaves at once while the fetch goes on in the pool
for the opens that wait for it; a throttled fetch waits for tokens in the pool, not on the open;
the index's write transactions of one process queue in the process (cache_store._tx).

Real components: an HTTP server on 127.0.0.1, a real DatasetCache (SQLite) in tmp_path, the real
RemoteStore and ItemResolver; no FUSE mount (the front ends are covered by test_fuse_stall.py,
whose killed readers of an unanswered small item take this path on both front ends)."""

from __future__ import annotations

import http.server
import os
import sqlite3
import threading
import time

import pytest

from fuse_client import blocking_http
from fuse_client.accounting import JobAccounting
from fuse_client.cache_store import DatasetCache
from fuse_client.dataplane import ItemResolver
from fuse_client.remote import FileEntry, RemoteStore
from fuse_client.token_bucket import Throttle
from hostile_http import start_server, stop_server

BODY = os.urandom(50_000)


class TricklingSource:
    """Every item is BODY; with `trickle` set, its headers and first byte come at once and the
    rest only after `release` is set (a slow but alive item)."""

    def __init__(self) -> None:
        self.trickle = threading.Event()
        self.release = threading.Event()
        self.requests = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                outer.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(BODY)))
                self.end_headers()
                if outer.trickle.is_set():
                    self.wfile.write(BODY[:1])
                    self.wfile.flush()
                    outer.release.wait(60)
                    self.wfile.write(BODY[1:])
                else:
                    self.wfile.write(BODY)

        self.server, self.url = start_server(Handler)

    def close(self) -> None:
        stop_server(self.server, self.release)


@pytest.fixture
def source():
    src = TricklingSource()
    yield src
    src.close()


def _resolver(tmp_path, url: str, rate: float = float("inf")) -> ItemResolver:
    return ItemResolver(RemoteStore(url), DatasetCache(tmp_path / "cache", "ds"), Throttle(rate), JobAccounting(8))


def _content(item) -> bytes:
    return os.pread(item.fd, len(BODY) + 1, 0)


def test_a_small_miss_is_fetched_on_the_opening_thread(tmp_path, source):
    resolver = _resolver(tmp_path, source.url)
    seen: set[str] = set()
    store_fetch = resolver.store.fetch

    def fetch(*args, **kw):  # records the thread the fetch runs on; the real fetch does the work
        seen.add(threading.current_thread().name)
        return store_fetch(*args, **kw)

    resolver.store.fetch = fetch
    try:
        for i in range(3):
            item = resolver.resolve(FileEntry(i, f"f{i}.bin", len(BODY)))
            assert _content(item) == BODY
            os.close(item.fd)
        assert seen == {threading.current_thread().name}
        assert resolver.lanes_snapshot()["ran_on_caller"] == 3
    finally:
        resolver.close()


def test_an_interrupted_open_leaves_at_once_and_the_fetch_goes_on_in_the_pool(tmp_path, source):
    """The open's reader is killed while its item trickles: the open gets EINTR within a slice or
    two (not when the item ends), and a second open of the item gets the whole item, fetched by
    the pool."""
    resolver = _resolver(tmp_path, source.url)
    source.trickle.set()
    cancel = threading.Event()
    outcome: list = []
    entry = FileEntry(0, "slow.bin", len(BODY))

    def first_open() -> None:
        try:
            outcome.append(resolver.resolve(entry, cancel.is_set))
        except BaseException as exc:
            outcome.append(exc)

    try:
        t = threading.Thread(target=first_open)
        t.start()
        deadline = time.monotonic() + 10
        while source.requests < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert source.requests == 1
        assert resolver.lanes_snapshot()["ran_on_caller"] == 1  # it is fetched on the open's thread
        cancel.set()
        t.join(5)  # a few slices; the item is held back for 60 s
        assert not t.is_alive(), "the interrupted open still waits for its trickling item"
        assert isinstance(outcome[0], InterruptedError), outcome
        # The fetch moved to the pool (started again there); a second open waits for it.
        second: list = []
        t2 = threading.Thread(target=lambda: second.append(resolver.resolve(entry)))
        t2.start()
        while source.requests < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert source.requests == 2
        source.release.set()
        t2.join(30)
        assert second and _content(second[0]) == BODY
    finally:
        source.release.set()
        resolver.close()


def test_a_fetch_that_must_wait_for_tokens_waits_in_the_pool(tmp_path, source):
    """A throttled job: the first miss spends the bucket's burst, the next must wait for tokens;
    that wait happens on a pool thread (the open waits for it as for any pool fetch)."""
    resolver = _resolver(tmp_path, source.url, rate=200_000.0)  # burst 64 KiB: one item, then a wait
    waited_on: list[str] = []
    acquire = resolver.throttle.acquire

    def record(n: int) -> None:
        waited_on.append(threading.current_thread().name)
        acquire(n)

    resolver.throttle.acquire = record
    try:
        time.sleep(0.4)  # the bucket fills to its burst
        for i in range(3):
            item = resolver.resolve(FileEntry(i, f"t{i}.bin", len(BODY)))
            assert _content(item) == BODY
            os.close(item.fd)
        assert waited_on, "no fetch waited for tokens: the test proves nothing"
        assert threading.current_thread().name not in waited_on, waited_on
    finally:
        resolver.close()


def test_interruptible_waits_call_the_check_while_no_byte_arrives(source):
    """blocking_http's waits in slices: a check that raises ends a request whose answer never
    comes."""
    source.trickle.set()
    store = RemoteStore(source.url)
    pool = store._streams()._http  # the store's own pool, held to its allow-list guard
    calls = []

    class Stop(BaseException):
        pass

    def check(due: float) -> None:
        calls.append(due)
        if len(calls) >= 3:
            raise Stop

    resp = pool.get(source.url + "x.bin", {}, lambda: 30.0)
    buf = memoryview(bytearray(len(BODY)))
    assert resp.readinto1(buf, lambda: 30.0, lambda n: None) == 1
    with blocking_http.interruptible(check), pytest.raises(Stop):
        resp.readinto1(buf[1:], lambda: 30.0, lambda n: None)
    assert len(calls) == 3
    resp.close_quietly()
    store.close()


def test_write_transactions_of_one_process_queue_in_the_process_not_in_sqlites_busy_handler(tmp_path, monkeypatch):
    """While one thread holds a write transaction, another thread's publish waits in the process
    and begins its own only after the first committed. Before, it began at once and met
    SQLITE_BUSY, and SQLite's busy handler slept and retried (1, 2, 5, 10... ms): with 16 fetch
    threads admitting items, twice per small miss."""
    cache = DatasetCache(tmp_path / "cache", "ds")
    events: list[tuple[str, str]] = []
    connect = sqlite3.connect

    def traced(*args, **kw):  # the real connection, its statements recorded in order
        db = connect(*args, **kw)
        name = threading.current_thread().name
        db.set_trace_callback(lambda sql: events.append((name, sql.split()[0].upper())))
        return db

    monkeypatch.setattr(sqlite3, "connect", traced)
    holding, go = threading.Event(), threading.Event()

    def hold() -> None:
        with cache._tx():
            holding.set()
            go.wait(10)
            time.sleep(0.3)  # the other thread is waiting for the index by now

    def publish() -> None:
        fd, staging = cache.new_staging_file("ab" * 20)
        os.write(fd, b"x")
        os.close(fd)
        go.set()
        assert cache.publish("ab" * 20, staging, 1, 0)

    a = threading.Thread(target=hold, name="holder")
    a.start()
    assert holding.wait(10)
    b = threading.Thread(target=publish, name="publisher")
    b.start()
    a.join(10)
    b.join(10)
    order = [e for e in events if e[1] in ("BEGIN", "COMMIT")]
    assert order[:2] == [("holder", "BEGIN"), ("holder", "COMMIT")], order
    assert ("publisher", "BEGIN") in order[2:], order
    assert cache.open_cached("ab" * 20) is not None
