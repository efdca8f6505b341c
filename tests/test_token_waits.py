"""No token wait is unbounded (issue 19, part 2): a job paused at rate 0 fails its uncached opens
with EAGAIN once the pause outlasts the open deadline; a wait at a positive rate ends after its
share of the rate plus the deadline; a reader killed in a token wait is gone within seconds.

The pure bound is tested with a fake clock; the rest on real mounts (both front ends) driven by
a real data manager that pushes the rates.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import threading
import time

import pytest

from fuse_client.token_bucket import Throttle, TokenWaitExpired


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_a_paused_wait_ends_with_eagain_once_the_pause_outlasts_the_deadline():
    clock = _Clock()
    throttle = Throttle(rate=1e6, clock=clock, sleep=clock.sleep, deadline_s=5.0)
    throttle.set_rate(0.0)  # paused at t=100
    clock.now += 3.0
    with pytest.raises(TokenWaitExpired) as e:
        throttle.acquire(1000)  # waits out the rest of the pause's deadline, then gives up
    assert e.value.errno == errno.EAGAIN
    assert 105.0 < clock.now <= 105.2
    t0 = clock.now
    with pytest.raises(TokenWaitExpired):
        throttle.acquire(1000)  # the pause is older than the deadline: fails at once
    assert clock.now - t0 <= 0.1
    throttle.set_rate(1e6)  # granted again: waits succeed
    throttle.acquire(1000)


def test_a_short_pause_costs_a_wait_not_a_failure():
    clock = _Clock()
    throttle = Throttle(rate=0.0, clock=clock, sleep=clock.sleep, deadline_s=5.0)
    done = []

    def sleep(s: float) -> None:
        clock.now += s
        if clock.now >= 103.0:
            throttle.set_rate(1e6)  # the next round grants a rate after 3 s

    throttle._sleep = sleep
    throttle.acquire(1000)
    done.append(clock.now)
    assert done and done[0] < 104.0


def test_a_wait_at_a_positive_rate_is_bounded_by_its_backlog_over_the_rate_plus_the_deadline():
    clock = _Clock()
    throttle = Throttle(rate=1000.0, clock=clock, sleep=clock.sleep, deadline_s=2.0)
    # Another waiter keeps taking every token as it arrives (starvation): our wait of 64 KiB
    # may last 64 KiB / 1000 B/s (its share) + 2 s, no longer.
    real_try_take = throttle._bucket.try_take

    def greedy_try_take(nbytes, now):
        throttle._bucket._refill(now)
        throttle._bucket.tokens = 0.0  # someone else got there first
        return real_try_take(nbytes, now)

    throttle._bucket.try_take = greedy_try_take
    with pytest.raises(TokenWaitExpired) as e:
        throttle.acquire(65536)
    assert e.value.errno == errno.EAGAIN
    assert 100.0 + 65.536 + 2.0 < clock.now <= 100.0 + 65.536 + 2.0 + 0.2


def test_a_rate_change_restarts_the_allowance_of_a_waiter():
    clock = _Clock()
    throttle = Throttle(rate=1000.0, clock=clock, sleep=clock.sleep, deadline_s=1.0)
    throttle._bucket.tokens = -50_000.0  # 50 s of debt at 1000 B/s: the allowance includes it
    changed = []

    def sleep(s: float) -> None:
        clock.now += s
        if clock.now >= 140.0 and not changed:
            changed.append(clock.now)
            throttle.set_rate(1e6)  # a bigger allocation: the debt is paid in 0.05 s

    throttle._sleep = sleep
    throttle.acquire(1000)
    assert changed and clock.now < 141.0


def test_without_a_deadline_waits_are_not_timed_out():
    clock = _Clock()
    throttle = Throttle(rate=0.0, clock=clock, sleep=clock.sleep)

    def sleep(s: float) -> None:
        clock.now += s
        if clock.now >= 10_000.0:
            throttle.set_rate(1e6)

    throttle._sleep = sleep
    throttle.acquire(10)
    assert clock.now >= 10_000.0


# -- real mounts -------------------------------------------------------------------------------


def _mount(tmp_path, backend, ds, dm_url, deadline):
    from dataplane_helpers import mounted

    if backend == "raw" and os.geteuid() != 0:
        pytest.skip("the raw front end mounts with mount(2): run as root")
    return mounted(tmp_path / "mnt", str(ds.root), "ds", "job1", tmp_path / "cache", "--manager", dm_url,
                   "--fuse-backend", backend, "--open-deadline", str(deadline))


@pytest.mark.fuse
@pytest.mark.parametrize("backend", ["raw", "libfuse"])
def test_a_paused_job_fails_uncached_opens_with_eagain_after_the_deadline_and_serves_cached_ones(tmp_path, backend):
    from datamanager.client import DataManagerClient
    from dataplane_helpers import make_dataset, start_datamanager, wait_until

    ds = make_dataset(tmp_path / "remote", n_files=12, seed=4)
    names = sorted(ds.sizes)
    dm = start_datamanager(tmp_path / "state")
    try:
        with DataManagerClient(dm.url) as sched, _mount(tmp_path, backend, ds, dm.url, 1) as m:
            sched.allocate_remote_io("job1", 50e6)
            wait_until(lambda: m.stats()["io_rate_bytes_per_s"] == 50e6, 3.0, message="rate pulled")
            assert (m.mountpoint / names[0]).read_bytes() == (ds.root / names[0]).read_bytes()
            sched.allocate_remote_io("job1", 0)
            wait_until(lambda: m.stats()["io_rate_bytes_per_s"] == 0, 3.0, message="pause pulled")
            # Within the deadline a pause costs a wait; beyond it, the open fails with EAGAIN.
            t0 = time.monotonic()
            reader = subprocess.run(["cat", str(m.mountpoint / names[1])], capture_output=True, timeout=30)
            took = time.monotonic() - t0
            assert reader.returncode != 0 and b"Resource temporarily unavailable" in reader.stderr, reader.stderr
            assert took < 3.0, took  # at most the deadline (1 s) from the pause, plus slack
            # Once the pause is older than the deadline, further opens fail at once.
            t0 = time.monotonic()
            with pytest.raises(OSError) as e:
                (m.mountpoint / names[2]).read_bytes()
            assert e.value.errno == errno.EAGAIN and time.monotonic() - t0 < 1.0
            # Cached items are served all along; one log line for the whole pause.
            assert (m.mountpoint / names[0]).read_bytes() == (ds.root / names[0]).read_bytes()
            assert m.log().count("remote IO paused (rate 0)") == 1, m.log()
            # The breaker did not take the job's own pause for a dead remote.
            sched.allocate_remote_io("job1", 50e6)
            wait_until(lambda: m.stats()["io_rate_bytes_per_s"] == 50e6, 3.0, message="rate pulled again")
            assert (m.mountpoint / names[2]).read_bytes() == (ds.root / names[2]).read_bytes()
    finally:
        dm.kill()


@pytest.mark.fuse
@pytest.mark.parametrize("backend", ["raw", "libfuse"])
def test_a_slow_positive_rate_is_waited_out_beyond_the_deadline(tmp_path, backend):
    """A wait at a positive rate may last the item's share of the rate plus the deadline: a
    200 KB item at 50 KB/s takes ~4 s with a 1 s deadline, and is read whole."""
    from datamanager.client import DataManagerClient
    from dataplane_helpers import make_dataset, start_datamanager, wait_until

    ds = make_dataset(tmp_path / "remote", n_files=2, min_size=200_000, max_size=200_000, seed=5)
    name = sorted(ds.sizes)[0]
    dm = start_datamanager(tmp_path / "state")
    try:
        with DataManagerClient(dm.url) as sched, _mount(tmp_path, backend, ds, dm.url, 1) as m:
            sched.allocate_remote_io("job1", 50e3)
            wait_until(lambda: m.stats()["io_rate_bytes_per_s"] == 50e3, 3.0, message="rate pulled")
            t0 = time.monotonic()
            assert (m.mountpoint / name).read_bytes() == (ds.root / name).read_bytes()
            assert time.monotonic() - t0 > 2.5  # it really was throttled past the 1 s deadline
    finally:
        dm.kill()


@pytest.mark.fuse
@pytest.mark.parametrize("backend", ["raw", "libfuse"])
def test_a_reader_killed_in_a_token_wait_is_gone_within_seconds(tmp_path, backend):
    from datamanager.client import DataManagerClient
    from dataplane_helpers import make_dataset, start_datamanager, wait_until

    ds = make_dataset(tmp_path / "remote", n_files=8, seed=6)
    names = sorted(ds.sizes)
    dm = start_datamanager(tmp_path / "state")
    readers: list[subprocess.Popen] = []
    try:
        # A long deadline: the readers sit in the paused token wait until they are killed.
        with DataManagerClient(dm.url) as sched, _mount(tmp_path, backend, ds, dm.url, 600) as m:
            sched.allocate_remote_io("job1", 0)
            wait_until(lambda: m.stats()["io_rate_bytes_per_s"] == 0, 3.0, message="pause pulled")
            readers = [subprocess.Popen(["cat", str(m.mountpoint / n)], stdout=subprocess.DEVNULL) for n in names[:6]]
            time.sleep(1.5)
            assert all(p.poll() is None for p in readers), "a reader did not wait for tokens: the test proves nothing"
            for p in readers:
                p.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            for p in readers:
                try:
                    p.wait(timeout=max(0.1, 5.0 - (time.monotonic() - t0)))
                except subprocess.TimeoutExpired:
                    pass
            stuck = [p.pid for p in readers if p.poll() is None]
            assert not stuck, f"{len(stuck)} killed readers still in their token wait after 5 s"
            # The mount serves on once a rate is granted.
            sched.allocate_remote_io("job1", 50e6)
            wait_until(lambda: m.stats()["io_rate_bytes_per_s"] == 50e6, 3.0, message="rate pulled")
            done = threading.Event()
            threading.Thread(target=lambda: ((m.mountpoint / names[7]).read_bytes(), done.set()), daemon=True).start()
            assert done.wait(10.0)
    finally:
        for p in readers:
            if p.poll() is None:
                p.kill()
        dm.kill()
