"""A remote that accepts connections and never answers must not take the mount down with it
(issue 19, part 2).

4x --fuse-threads readers open uncached items of such a remote at once. Meanwhile lookups and
reads of cached items must stay fast, and readers killed with -9 must be gone within seconds -
on both front ends. (Before: under libfuse every worker sat in a stalled open, so lookups and
cached reads queued behind them and killed readers stayed in D state until the mount stopped.)
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import threading
import time

import pytest

from dataplane_helpers import mounted
from hostile_http import start_server, stop_server

pytestmark = pytest.mark.fuse

THREADS = 8
STALLED = 4 * THREADS
SIZE = 3000


class _StallingSource:
    """JSON index of `cached` + `stalled` items; items answer until `stall` is set, then every
    item request is accepted and never answered (until `release`, at teardown)."""

    def __init__(self, names: list[str]) -> None:
        self.stall = threading.Event()
        self.release = threading.Event()
        index = json.dumps([{"name": n, "type": "file", "size": SIZE} for n in names]).encode()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/ds/":
                    body = index
                else:
                    if outer.stall.is_set():
                        outer.release.wait(120)  # accepted, never answered (bounded for the test's sake)
                        return
                    body = self.path.encode().ljust(SIZE, b".")
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server, self.url = start_server(Handler)

    def close(self) -> None:
        stop_server(self.server, self.release)


@pytest.mark.parametrize("backend", ["libfuse", "raw"])
def test_stalled_opens_beyond_the_thread_pool_leave_lookups_cached_reads_and_kills_working(tmp_path, backend):
    if backend == "raw" and os.geteuid() != 0:
        pytest.skip("the raw front end mounts with mount(2): run as root")
    cached = [f"c{i:02d}.bin" for i in range(8)]
    fresh = [f"f{i:02d}.bin" for i in range(8)]  # never looked up before the stall
    stalled = [f"s{i:02d}.bin" for i in range(STALLED)]
    src = _StallingSource(cached + fresh + stalled)
    readers: list[subprocess.Popen] = []
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", "--fuse-backend", backend,
                     "--fuse-threads", str(THREADS), "--fetch-workers", "4", "--open-deadline", "60",
                     "--breaker-threshold", "10000") as m:
            mnt = m.mountpoint
            for name in cached:
                assert (mnt / name).read_bytes() == f"/ds/{name}".encode().ljust(SIZE, b".")
            src.stall.set()
            readers = [subprocess.Popen(["cat", str(mnt / name)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                       for name in stalled]
            time.sleep(2.0)  # every reader has its open in flight (or refused) by now
            waiting = [p for p in readers if p.poll() is None]
            assert waiting, "no open is waiting for the stalled remote: the test proves nothing"
            # Lookups of names never seen and reads of cached items: in a child with a timeout, so a
            # lock-up fails the test instead of hanging it.
            t0 = time.monotonic()
            probe = subprocess.run(["sh", "-c", f"cd {mnt} && stat -c %s {' '.join(fresh)} >/dev/null && cat {' '.join(cached)}"],
                                   capture_output=True, timeout=30)
            elapsed = time.monotonic() - t0
            assert probe.returncode == 0, probe.stderr
            assert probe.stdout == b"".join(f"/ds/{n}".encode().ljust(SIZE, b".") for n in cached)
            assert elapsed < 5.0, f"lookups and cached reads took {elapsed:.1f}s behind stalled opens"
            # Kill the waiting readers: they must be gone within seconds, not when the mount stops.
            for p in waiting:
                p.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            for p in waiting:
                try:
                    p.wait(timeout=max(0.1, 10.0 - (time.monotonic() - t0)))
                except subprocess.TimeoutExpired:
                    pass
            stuck = [p.pid for p in waiting if p.poll() is None]
            assert not stuck, f"{len(stuck)} of {len(waiting)} killed readers still there after 10 s"
            gone_in = time.monotonic() - t0
            assert gone_in < 10.0
            if backend == "libfuse":
                # Opens beyond the cap were refused at once, with one log line (not one per open).
                refused = [p for p in readers if p not in waiting]
                assert refused and all(p.returncode != 0 for p in refused)
                assert m.log().count("opens are waiting for the remote") == 1, m.log()
            # The mount still serves after all this.
            assert (mnt / cached[0]).read_bytes().startswith(b"/ds/c00.bin")
    finally:
        for p in readers:
            if p.poll() is None:
                p.kill()
        src.close()


@pytest.mark.parametrize("backend", ["libfuse", "raw"])
def test_opens_queued_behind_stalled_fetches_fail_within_the_open_deadline(tmp_path, backend):
    """With one fetch worker and a remote that never answers, the 24th open used to wait for 23
    stalled fetches before its own (~0.5 s each here: 12 s); now every waiting open fails with
    EIO once nothing of this mount has progressed for its deadline (1 s + client timeout + 1 s)."""
    if backend == "raw" and os.geteuid() != 0:
        pytest.skip("the raw front end mounts with mount(2): run as root")
    stalled = [f"s{i:02d}.bin" for i in range(24)]
    src = _StallingSource(stalled)
    readers: list[subprocess.Popen] = []
    try:
        with mounted(tmp_path / "mnt", src.url, "ds", "job1", tmp_path / "cache", "--fuse-backend", backend,
                     "--fuse-threads", "32", "--fetch-workers", "1", "--open-deadline", "1",
                     "--breaker-threshold", "10000") as m:
            src.stall.set()
            t0 = time.monotonic()
            readers = [subprocess.Popen(["cat", str(m.mountpoint / name)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE) for name in stalled]
            for p in readers:
                try:
                    p.wait(timeout=max(0.1, 6.0 - (time.monotonic() - t0)))
                except subprocess.TimeoutExpired:
                    pass
            waited = time.monotonic() - t0
            still = sum(p.poll() is None for p in readers)
            assert still == 0, f"{still} of 24 opens still waiting after {waited:.1f}s (deadline 1 s):\n{m.log()[-3000:]}"
            assert all(p.returncode != 0 for p in readers)
            assert all(b"Input/output error" in p.stderr.read() for p in readers)
    finally:
        for p in readers:
            if p.poll() is None:
                p.kill()
        src.close()
