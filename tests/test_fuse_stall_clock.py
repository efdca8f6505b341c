"""The clock a waiting open judges the remote's stall by counts only time this process ran,
and is never read half-updated.

Before (found 2026-11-29): a mount process stopped with SIGSTOP counted the stop as the remote's
stall, so an open could fail with EIO right after SIGCONT although the remote was fine; and a
waiter could see a flight's token-wait (or peer-wait) mark cleared while its progress stamp was
still the one from before that wait, failing the open with EIO just as a long grant arrived
(test_fuse_peer_freeze.py's stopped peer's own read, in 4 of 13 runs).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import fuse_client.single_flight as single_flight
from fuse_client.accounting import JobAccounting
from fuse_client.breaker import RetryPolicy
from fuse_client.cache_store import DatasetCache
from fuse_client.dataplane import WAIT_SLICE_S, ItemResolver
from fuse_client.pause_log import PauseLog
from fuse_client.peer_watch import all_threads_stopped
from fuse_client.remote import FileEntry, RemoteStore
from fuse_client.token_bucket import Throttle

from dataplane_helpers import wait_until

REPO = Path(__file__).resolve().parents[1]

# -- the log of spans the process did not run ---------------------------------------------------


def test_a_wait_late_by_no_more_than_the_margin_is_no_pause():
    log = PauseLog(margin_s=0.25)
    log.woke(10.0, 10.25)
    log.woke(20.0, 20.1)
    assert log.paused(0.0, 100.0) == 0.0
    log.woke(30.0, 30.3)
    assert log.paused(0.0, 100.0) == pytest.approx(0.3)


def test_a_pause_counts_only_from_the_reference_on_and_up_to_now():
    log = PauseLog(margin_s=0.25)
    log.woke(10.0, 13.0)
    assert log.paused(5.0, 20.0) == pytest.approx(3.0)
    assert log.paused(12.0, 20.0) == pytest.approx(1.0)  # stamped during the pause (another thread, first to run)
    assert log.paused(13.0, 20.0) == 0.0  # stamped after it
    assert log.paused(5.0, 11.5) == pytest.approx(1.5)


def test_waits_that_saw_one_stop_count_it_once_whatever_order_they_report_in():
    log = PauseLog(margin_s=0.25)
    log.woke(10.03, 13.01)  # three waiters slept through the same stop
    log.woke(10.00, 13.02)
    log.woke(10.04, 13.00)
    assert log.paused(0.0, 20.0) == pytest.approx(3.02)
    log.woke(15.0, 16.0)  # a second stop
    log.woke(12.9, 13.5)  # a waiter that reached the lock last, its span overlapping the first
    assert log.paused(0.0, 20.0) == pytest.approx(3.5 + 1.0)
    assert log.paused(14.0, 20.0) == pytest.approx(1.0)


def test_the_log_keeps_the_newest_spans():
    log = PauseLog(margin_s=0.0, keep=3)
    for i in range(5):
        log.woke(10.0 * i, 10.0 * i + 1.0)
    assert log.paused(0.0, 100.0) == pytest.approx(3.0)  # the two oldest are gone
    assert log.paused(25.0, 100.0) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        PauseLog(margin_s=-1.0)


# -- the leader's stamps, as a waiter may see them at any moment ----------------------------------


class _Watched(single_flight.Flight):
    """A flight that asks its resolver after every change the leader makes to it whether a waiter
    looking right then would call it stalled: a waiter wakes at any moment, so none may say yes.
    Its resolver is the one watched when it was made (flights made before are not judged)."""

    resolver: ItemResolver | None = None
    seen: list[tuple[str, object]] = []

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name == "key":  # the first field
            super().__setattr__("judge", _Watched.resolver)
        elif name in ("started", "progress", "throttled", "waiting_peer") and "leader_gone" in self.__dict__:
            judge: ItemResolver | None = self.__dict__["judge"]
            if judge is not None and judge._stalled(self):
                _Watched.seen.append((name, value))


@pytest.fixture()
def watched(monkeypatch):
    monkeypatch.setattr(single_flight, "Flight", _Watched)
    monkeypatch.setattr(_Watched, "seen", [])
    yield _Watched
    _Watched.resolver = None


# RetryPolicy(deadline_s=0.1): client timeout 0.1 s, stall limit 0.1 + 0.1 + 1 = 1.2 s. At 40 KB/s
# the first 64 KiB chunk waits 1.64 s for its tokens: one grant gap longer than the limit.
_POLICY = RetryPolicy(deadline_s=0.1)
_RATE = 40_000
_SIZE = 64 * 1024


def _resolver(tmp_path: Path, rate: float, cache: DatasetCache | None = None) -> tuple[ItemResolver, FileEntry]:
    src = tmp_path / "src"
    if not src.exists():
        src.mkdir()
        (src / "item.bin").write_bytes(os.urandom(_SIZE))
    store = RemoteStore(str(src), _POLICY)
    entry = store.list().files["item.bin"]
    resolver = ItemResolver(store, cache or DatasetCache(tmp_path / "cache", "ds"), Throttle(rate), JobAccounting(1))
    return resolver, entry


def test_a_grant_after_a_token_wait_longer_than_the_limit_is_never_seen_as_a_stall(tmp_path, watched):
    resolver, entry = _resolver(tmp_path, _RATE)
    assert resolver._stall_limit() == pytest.approx(1.2)
    watched.resolver = resolver
    t0 = time.monotonic()
    item = resolver.resolve(entry)
    assert time.monotonic() - t0 > resolver._stall_limit()  # the token wait really was longer
    assert os.pread(item.fd, _SIZE + 1, 0) == (tmp_path / "src" / "item.bin").read_bytes()
    os.close(item.fd)
    resolver.close()
    # Before: `throttled` was cleared before `progress` was shifted past the wait (and `started`
    # set before its first stamp, 0.0): a waiter looking in between failed the open.
    assert watched.seen == []


def test_the_end_of_a_long_wait_for_a_peer_is_never_seen_as_a_stall(tmp_path, watched):
    """r1 fetches slowly (one 1.64 s token wait) while r2, on the same cache dir with its own lock
    descriptor as another mount process has, waits for the item's lock: r2's end of that wait
    must not look like a stall."""
    r1, entry = _resolver(tmp_path, _RATE)
    r2, _ = _resolver(tmp_path, float("inf"), cache=DatasetCache(tmp_path / "cache", "ds"))
    first = threading.Thread(target=r1.resolve, args=(entry,))
    first.start()
    # Its staging file exists once it holds the item's lock.
    wait_until(lambda: any(r1.cache.staging_dir.iterdir()), 5.0, interval=0.005, message="r1 fetches")
    watched.resolver = r2
    t0 = time.monotonic()
    item = r2.resolve(entry)
    first.join(10)
    assert time.monotonic() - t0 > r2._stall_limit()  # it waited longer than its limit for r1
    assert os.pread(item.fd, _SIZE + 1, 0) == (tmp_path / "src" / "item.bin").read_bytes()
    assert r2.accounting.remote_bytes == 0
    os.close(item.fd)
    for r in (r1, r2):
        r.close()
    assert watched.seen == []


# -- a real process, stopped and continued --------------------------------------------------------

# A resolver whose remote is this test: the item's bytes are what the test writes to the child's
# stdin, when it writes them, so the child's fetch can be held silent across a stop.
_CHILD = """
import os, sys, time
from pathlib import Path
from fuse_client.accounting import JobAccounting
from fuse_client.breaker import RetryPolicy
from fuse_client.cache_store import DatasetCache
from fuse_client.dataplane import ItemResolver
from fuse_client.remote import RemoteStore
from fuse_client.token_bucket import Throttle

class StdinRemote:
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        return False
    def read(self, n):
        print("want", flush=True)  # the bytes before (if any) are stamped as progress by now
        data = os.read(0, n)
        print("got", len(data), time.monotonic(), flush=True)
        return data

root, size = Path(sys.argv[1]), int(sys.argv[2])
(root / "src").mkdir()
(root / "src" / "item.bin").write_bytes(bytes(size))  # for the listing; the content is stdin's
store = RemoteStore(str(root / "src"), RetryPolicy(deadline_s=1.0, attempts=1))  # stall limit 2.5 s
store._open = lambda rel, chunk, size=None: StdinRemote()
entry = store.list().files["item.bin"]
resolver = ItemResolver(store, DatasetCache(root / "cache", "ds"), Throttle(), JobAccounting(1))
print("ready", flush=True)
try:
    item = resolver.resolve(entry)
except OSError as exc:
    print("error", exc.errno, time.monotonic(), str(exc), flush=True)
else:
    print("ok", len(os.pread(item.fd, size + 1, 0)), time.monotonic(), flush=True)
"""
_LIMIT = 1.0 + 0.5 + 1.0
_STOP_S = 3.0  # longer than the limit: counted as a stall, it fails the open at SIGCONT


class _Child:
    def __init__(self, tmp_path: Path, size: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), str(size)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=REPO)
        self.lines: queue.Queue[list[str]] = queue.Queue()
        self.stopped = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        assert self.line() == ["ready"]
        assert self.line() == ["want"]

    def _read(self) -> None:
        with self.proc.stdout as out:
            for raw in out:
                self.lines.put(raw.decode().rstrip("\n").split(" ", 3))

    def line(self, timeout: float = 15.0) -> list[str]:
        return self.lines.get(timeout=timeout)

    def send(self, data: bytes, last: bool = False) -> float:
        """The remote delivers `data`; returns when the child read it (its monotonic clock: the
        same CLOCK_MONOTONIC as ours) and, unless it is the `last` piece, has stamped it as
        progress and waits for more (a stop before the stamp would not test the stall clock)."""
        self.proc.stdin.write(data)
        self.proc.stdin.flush()
        got = self.line()
        assert got[:2] == ["got", str(len(data))], got
        if not last:
            assert self.line() == ["want"]
        return float(got[2])

    def stop(self, seconds: float) -> tuple[float, float]:
        """SIGSTOP for `seconds`; returns when it was stopped and continued."""
        t_stop = time.monotonic()
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stopped = True
        wait_until(lambda: all_threads_stopped(self.proc.pid), 5.0, interval=0.01, message="child stopped")
        time.sleep(max(0.0, seconds - (time.monotonic() - t_stop)))
        t_cont = time.monotonic()
        os.kill(self.proc.pid, signal.SIGCONT)
        self.stopped = False
        return t_stop, t_cont

    def close(self) -> None:
        if self.stopped:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(10)
        self.proc.stdin.close()
        self._reader.join(10)


@pytest.fixture()
def child(tmp_path):
    children: list[_Child] = []

    def start(size: int) -> _Child:
        children.append(_Child(tmp_path, size))
        return children[-1]

    yield start
    for c in children:
        c.close()


def test_the_time_a_process_was_stopped_is_not_the_remotes_stall(child):
    """Stopped for longer than its stall limit mid-fetch, then given another 0.5 s of silence
    after SIGCONT: the open succeeds once the rest arrives. (Before: EIO at SIGCONT, every run.)"""
    c = child(2000)
    c.send(b"x" * 1000)
    c.stop(_STOP_S)
    time.sleep(0.5)  # the remote says nothing right after the stop either
    assert c.lines.empty(), c.line()  # no verdict on the open before the remote sends the rest
    c.send(b"y" * 1000, last=True)
    assert c.line()[:2] == ["ok", "2000"]


@pytest.mark.parametrize("stop_s", [0.0, _STOP_S])
def test_a_silent_remote_fails_the_open_after_the_limit_of_time_the_process_ran(child, stop_s):
    """The remote delivers a first piece and then nothing: the open fails with EIO once the
    process has run for the stall limit since that piece, not sooner (the stop is not counted)
    and not much later (a stall is still caught, within a wait slice or two of the limit)."""
    c = child(2000)
    t_got = c.send(b"x" * 1000)
    stopped_for = 0.0
    if stop_s:
        time.sleep(0.5)
        t_stop, t_cont = c.stop(stop_s)
        stopped_for = t_cont - t_stop
    verdict = c.line()
    assert verdict[:2] == ["error", "5"] and "delivered nothing for 2.5 s" in verdict[3], verdict
    ran = float(verdict[2]) - t_got - stopped_for
    assert _LIMIT - 0.1 <= ran <= _LIMIT + 4 * WAIT_SLICE_S + 0.3, (ran, stopped_for)
