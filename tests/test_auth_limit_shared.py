"""The failed-token limit is the server's, not an API worker's (issue 47, round 3).

On 19aec68 nothing limited guesses (431 a second from 64 anonymous clients); the first limit
(http_guard/auth_limit.py) kept a table per worker process and checked it only on arrival, so
`silod serve --workers 2` allowed twice the rate, and 64 guesses arriving at once all passed the
check. Here: a real `silod serve --workers 2` (null backend), 64 anonymous clients on their own
connections (the kernel spreads connections over the workers' SO_REUSEPORT sockets), real HTTP.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from http_guard.auth_limit import FailedAuthLimiter

try:
    from test_service_processes import ADMIN, _port, _serve, _stop, _wait_up
except ImportError:  # tests/ imported as a package
    from tests.test_service_processes import ADMIN, _port, _serve, _stop, _wait_up

BURST, RATE, LOOKUP_THREADS, WORKERS = 20, 2.0, 2, 2


def _get(port: int, token: str, source: str = "127.0.0.1") -> int:
    """GET /v1/jobs on a new connection from `source` (a loopback address): the status code."""
    with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0)) as s:
        s.sendall(f"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                  "Connection: close\r\n\r\n".encode())
        head = s.recv(64)
    return int(head.split(b" ", 2)[1])


def test_64_anonymous_clients_guessing_share_one_budget_across_workers(tmp_path) -> None:
    port = _port()
    proc = _serve(tmp_path, port, workers=WORKERS)
    try:
        _wait_up(f"http://127.0.0.1:{port}", proc, tmp_path)
        start = time.monotonic()
        with ThreadPoolExecutor(64) as pool:
            codes = list(pool.map(lambda i: _get(port, f"guess-{i:05d}-abcdefgh"), range(384)))
        elapsed = time.monotonic() - start
        checked = codes.count(401)
        # One budget for the server: the burst, the refill while it ran, and at most the lookups in
        # flight when it ran out. On a table per worker, checked on arrival only: 64 and more.
        allowed = BURST + RATE * elapsed + LOOKUP_THREADS * WORKERS
        assert checked <= allowed, f"{checked} guesses checked in {elapsed:.1f} s (allowed {allowed:.0f})"
        assert codes.count(429) == len(codes) - checked, codes
        # Past the limit even the right token from there is not checked: the guess learns nothing.
        # (Right after a guess that was checked, the bucket is empty for the next half second.)
        while _get(port, "guess-one-more-abcdefgh") != 401:
            time.sleep(0.05)
        assert _get(port, ADMIN) == 429
        # Another client network has its own budget: checked as before, valid or not.
        assert _get(port, ADMIN, source="127.0.0.2") == 200
        assert _get(port, "guess-other-network-1", source="127.0.0.2") == 401
    finally:
        _stop(proc)


def test_processes_mapping_one_table_share_the_buckets(tmp_path) -> None:
    """Two limiters over one table file (what two workers hold): failures in one count in the
    other; another network's bucket is apart; a table that is not one is refused."""
    now = [100.0]
    path = FailedAuthLimiter.create_table(tmp_path / "t", slots=64)
    a = FailedAuthLimiter(burst=3, rate=1.0, clock=lambda: now[0], path=path)
    b = FailedAuthLimiter(burst=3, rate=1.0, clock=lambda: now[0], path=path)
    try:
        a.failed("10.0.0.1")
        b.failed("10.0.0.1")
        assert a.retry_after("10.0.0.1") == 0 and b.retry_after("10.0.0.1") == 0
        a.failed("10.0.0.1")
        assert b.retry_after("10.0.0.1") == pytest.approx(1.0)
        assert b.retry_after("2001:db8::1") == 0 and a.retry_after("10.0.0.2") == 0
        now[0] += 1.0
        assert b.retry_after("10.0.0.1") == 0
        # More networks than a probe window holds: the fullest bucket gives way, the empty stays.
        for i in range(200):
            a.failed(f"10.1.{i // 256}.{i % 256}")
        a.failed("10.0.0.1")
        a.failed("10.0.0.1")
        assert b.retry_after("10.0.0.1") > 0
    finally:
        a.close()
        b.close()
    (tmp_path / "junk").write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="not a failed-token table"):
        FailedAuthLimiter(path=tmp_path / "junk")
