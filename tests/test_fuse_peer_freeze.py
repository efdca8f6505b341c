"""An open waiting for another mount process's fetch of the same item never waits for ever
(issue 19, Build 2: the last unbounded wait).

Two `silod mount` processes share one cache directory; the leader of an item in one waits for
the other's fetch lock (single_flight.NodeItemLocks). If that peer is frozen (SIGSTOP), the
waiting open fails with EIO within its stall limit, cached reads go on, and everything
recovers on SIGCONT. A peer that is slow but runs - a token wait at a low rate, with gaps
between its bytes longer than the stall limit, even a short stop - is waited out.
(Before: the leader sat in F_OFD_SETLKW and the waiting opens never gave up.)
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dataplane_helpers import mounted, wait_until
from fuse_client.peer_watch import PeerWatch, all_threads_stopped, find_holder
from fuse_client.single_flight import NodeItemLocks

SMALL = 3000


class _Source:
    """JSON index of `small.bin` (answered at once) and `big.bin` (`big` bytes, sent in 8 KiB
    pieces at `rate` bytes/s, or at once if rate is None)."""

    def __init__(self, big: int, rate: float | None) -> None:
        self.big = bytes((i * 7 + 3) % 251 for i in range(big))
        self.small = b"s" * SMALL
        index = json.dumps([{"name": "big.bin", "type": "file", "size": big},
                            {"name": "small.bin", "type": "file", "size": SMALL}]).encode()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                body = {"/ds/": index, "/ds/big.bin": outer.big, "/ds/small.bin": outer.small}.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    if rate is None or body is not outer.big:
                        self.wfile.write(body)
                        return
                    for i in range(0, len(body), 8192):
                        self.wfile.write(body[i:i + 8192])
                        self.wfile.flush()
                        time.sleep(8192 / rate)
                except OSError:
                    pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/ds/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _staging(cache: Path) -> list[Path]:
    return [p for p in (cache / "ds" / "staging").glob("*") if p.is_file()]


def _skip_raw(backend: str) -> None:
    if backend == "raw" and os.geteuid() != 0:
        pytest.skip("the raw front end mounts with mount(2): run as root")


def _start_fetch_on(mount, cache: Path) -> tuple[subprocess.Popen, int]:
    """A reader of big.bin on `mount`; returns it once `mount` fetches (its staging file exists;
    an unthrottled item of one chunk is written whole at the end) and the pid that fetches (the
    staging file names it)."""
    reader = subprocess.Popen(["cat", str(mount.mountpoint / "big.bin")], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    staging = wait_until(lambda: _staging(cache), 10.0, message="the peer's fetch started")
    time.sleep(0.3)  # mid-fetch
    pid = int(staging[0].name.split(".")[1])
    assert pid == mount.proc.pid, (pid, mount.proc.pid)
    return reader, pid


@pytest.mark.fuse
@pytest.mark.parametrize("backend", ["libfuse", "raw"])
def test_an_open_waiting_for_a_stopped_peer_fails_with_eio_and_recovers_on_sigcont(tmp_path, backend):
    _skip_raw(backend)
    src = _Source(big=600_000, rate=100_000)  # a 6 s fetch
    cache = tmp_path / "cache"
    peer_reader = waiting = None
    stopped = False
    with contextlib.ExitStack() as stack:
        stack.callback(src.close)
        a = stack.enter_context(mounted(tmp_path / "a", src.url, "ds", "job-a", cache, "--open-deadline", "30"))
        b = stack.enter_context(mounted(tmp_path / "b", src.url, "ds", "job-b", cache, "--open-deadline", "1",
                                        "--fuse-backend", backend))
        try:
            assert (b.mountpoint / "small.bin").read_bytes() == src.small  # cached on the node
            fetched = b.fresh_stats()["remote_bytes"]
            peer_reader, pid = _start_fetch_on(a, cache)
            os.kill(pid, signal.SIGSTOP)
            stopped = True
            limit = 1 + 0.5 + 1  # b's stall limit: deadline + client timeout (deadline / 2) + 1
            t0 = time.monotonic()
            waiting = subprocess.Popen(["cat", str(b.mountpoint / "big.bin")], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE)
            # Meanwhile b's cached reads stay fast.
            worst = 0.0
            while waiting.poll() is None and time.monotonic() - t0 < limit + 6:
                t1 = time.monotonic()
                assert (b.mountpoint / "small.bin").read_bytes() == src.small
                worst = max(worst, time.monotonic() - t1)
                time.sleep(0.05)
            took = time.monotonic() - t0
            assert waiting.poll() is not None, f"the open waiting for the stopped peer still waits after {took:.1f} s"
            err = waiting.stderr.read()
            assert waiting.returncode != 0 and b"Input/output error" in err, err
            assert limit - 0.5 < took < limit + 4, took  # it waited its stall limit, not much longer
            assert worst < 0.5, f"a cached read took {worst:.2f} s while an open waited for the stopped peer"
            assert b.log().count("is stopped and has made no progress") == 1, b.log()
            assert b.fresh_stats()["remote_bytes"] == fetched  # b never fetched big.bin itself
            # SIGCONT: the peer's fetch completes, its reader gets every byte, b's next open works.
            os.kill(pid, signal.SIGCONT)
            stopped = False
            out, _ = peer_reader.communicate(timeout=30)
            assert peer_reader.returncode == 0 and out == src.big
            assert (b.mountpoint / "big.bin").read_bytes() == src.big
            assert (b.mountpoint / "small.bin").read_bytes() == src.small
            assert b.fresh_stats()["remote_bytes"] == fetched  # served from the node's cache, fetched by a
        finally:
            if stopped:  # before the mounts stop: a stopped mount cannot unmount
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            for p in (waiting, peer_reader):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait(10)


@pytest.mark.fuse
def test_a_slow_peer_in_token_waits_and_a_short_stop_are_waited_out(tmp_path):
    """The peer fetches at 20 KB/s (its token bucket grants 64 KiB at a time, so its staging file
    stands still for ~3 s between grants - longer than the waiter's 2.5 s stall limit) and is
    stopped for 1.5 s on the way: the waiting open must succeed, not fail, and so must the
    stopped peer's own read (the stop is not its remote's stall: test_fuse_stall_clock.py)."""
    src = _Source(big=190_000, rate=None)  # 3 grants: it outlasts the 3 s below however full the bucket is at the start
    cache = tmp_path / "cache"
    peer_reader = None
    stopped = False
    with contextlib.ExitStack() as stack:
        stack.callback(src.close)
        a = stack.enter_context(mounted(tmp_path / "a", src.url, "ds", "job-a", cache, "--open-deadline", "1",
                                        "--io-rate", "20000"))
        b = stack.enter_context(mounted(tmp_path / "b", src.url, "ds", "job-b", cache, "--open-deadline", "1"))
        try:
            peer_reader, pid = _start_fetch_on(a, cache)
            result: list[bytes | BaseException] = []

            def read() -> None:
                try:
                    result.append((b.mountpoint / "big.bin").read_bytes())
                except OSError as exc:
                    result.append(exc)

            t0 = time.monotonic()
            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            time.sleep(1.0)
            os.kill(pid, signal.SIGSTOP)
            stopped = True
            time.sleep(1.5)
            os.kill(pid, signal.SIGCONT)
            stopped = False
            reader.join(30)
            took = time.monotonic() - t0
            assert result and result[0] == src.big, (result[:1], b.log())
            assert took > 3.0, took  # it really waited past its own stall limit for the peer
            out, err = peer_reader.communicate(timeout=30)
            # The stopped peer's own open, which waited on its own throttled fetch, succeeds too:
            # neither the stop nor the end of a token wait longer than the stall limit is the
            # remote's stall.
            assert peer_reader.returncode == 0 and out == src.big, (err, a.log()[-2500:])
            assert "is stopped" not in b.log()
            assert b.fresh_stats()["remote_bytes"] == 0  # b waited for a's fetch, it did not fetch itself
        finally:
            if stopped:  # before the mounts stop: a stopped mount cannot unmount
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            if peer_reader is not None and peer_reader.poll() is None:
                peer_reader.kill()
                peer_reader.wait(10)


# -- the watch itself, against real processes ---------------------------------------------------

_HOLDER = """
import os, sys, time
from pathlib import Path
from fuse_client.single_flight import NodeItemLocks
locks = NodeItemLocks(Path(sys.argv[1]))
assert locks.try_acquire(sys.argv[2])
staging = Path(sys.argv[3]) / f"{sys.argv[2]}.{os.getpid()}.1.0"
staging.write_bytes(b"x")
print("ready", flush=True)
while True:
    time.sleep(0.2)
"""


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _holder(tmp_path: Path, key: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / "fetch.lock"), key, str(tmp_path / "staging")],
                         stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])
    assert p.stdout.readline() == b"ready\n"
    return p


def _watch(tmp_path: Path, key: str, clock: _Clock) -> PeerWatch:
    return PeerWatch(tmp_path / "staging", tmp_path / "fetch.lock", key, NodeItemLocks.fetch_byte(key), clock=clock)


def _frozen_after(watch: PeerWatch, clock: _Clock, seconds: float) -> float:
    frozen = 0.0
    for _ in range(int(seconds / 0.25) + 1):
        frozen = watch.frozen_for()
        clock.now += 0.25
        time.sleep(0.02)  # let the real process run between samples
    return frozen


def test_the_watch_counts_only_a_stopped_lock_holder_whose_staging_file_stands_still(tmp_path):
    (tmp_path / "staging").mkdir()
    key = "ab" * 20
    clock = _Clock()
    sleeper = _holder(tmp_path, key)
    try:
        holder = find_holder(tmp_path / "staging", key, tmp_path / "fetch.lock", NodeItemLocks.fetch_byte(key))
        assert holder is not None and holder.pid == sleeper.pid
        watch = _watch(tmp_path, key, clock)
        assert _frozen_after(watch, clock, 3.0) == 0.0  # sleeping (a token wait) is not frozen
        sleeper.send_signal(signal.SIGSTOP)
        wait_until(lambda: all_threads_stopped(sleeper.pid), 5.0, message="stopped")
        assert _frozen_after(watch, clock, 3.0) >= 2.9
        # Its staging file grows (it ran between two samples): the window starts again.
        with open(holder.staging, "ab") as f:
            f.write(b"y")
        assert _frozen_after(watch, clock, 1.0) < 1.1
        sleeper.send_signal(signal.SIGCONT)
        wait_until(lambda: not all_threads_stopped(sleeper.pid), 5.0, message="running")
        assert _frozen_after(watch, clock, 1.0) == 0.0
    finally:
        sleeper.kill()
        sleeper.wait(10)
    # Its staging file stays behind, its lock is gone: a dead process is nobody's holder.
    assert find_holder(tmp_path / "staging", key, tmp_path / "fetch.lock", NodeItemLocks.fetch_byte(key)) is None


def test_a_staging_file_of_a_stopped_process_that_does_not_hold_the_lock_is_not_a_holder(tmp_path):
    """A stale staging name whose pid is now a stopped process that does not hold the item's
    lock (pid reuse, or another item's holder) never counts."""
    (tmp_path / "staging").mkdir()
    key, other = "cd" * 20, "ef" * 20
    clock = _Clock()
    p = _holder(tmp_path, other)  # holds `other`'s lock, not `key`'s
    try:
        (tmp_path / "staging" / f"{key}.{p.pid}.1.0").write_bytes(b"x")
        p.send_signal(signal.SIGSTOP)
        wait_until(lambda: all_threads_stopped(p.pid), 5.0, message="stopped")
        assert _frozen_after(_watch(tmp_path, key, clock), clock, 3.0) == 0.0
    finally:
        p.kill()
        p.wait(10)
