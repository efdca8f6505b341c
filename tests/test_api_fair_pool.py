"""The hot routes' threads, shared fairly (scheduler/service/api/fair_pool.py).

Issue 20, outside review of b563298 (the hot routes on 4 threads of their own): one tenant's 32
parallel `GET /v1/jobs?limit=10000` loops pushed another tenant's `GET /v1/jobs/1` to 3.8 s at
the median and 12 s at worst, and 8 submissions waiting on another process's SQLite write lock
held all 4 threads, so an unrelated GET waited 29 s. The tests of submissions on the write lock
and of one tenant's queue of slow reads fail on ee1317d.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from scheduler.service.api.fair_pool import FairThreadPool
from scheduler.service.api.server import ServerThread

try:
    from test_api import H_ALICE, H_BOB, IMAGENET, JOB, make_app
except ImportError:
    from tests.test_api import H_ALICE, H_BOB, IMAGENET, JOB, make_app


def test_a_freed_thread_goes_to_the_waiting_tenant_holding_fewest_then_served_longest_ago() -> None:
    started: list[str] = []
    gates = {name: threading.Event() for name in ("a0", "a1", "a2", "a3", "a4", "b0", "b1", "c0")}

    def work(name: str) -> str:
        started.append(name)
        gates[name].wait(10)
        return name

    async def main() -> None:
        pool = FairThreadPool(2)
        async with anyio.create_task_group() as tg:
            for tenant, name in (("a", "a0"), ("a", "a1"), ("a", "a2"), ("a", "a3"), ("a", "a4"),
                                 ("b", "b0"), ("b", "b1"), ("c", "c0")):
                tg.start_soon(pool.run, tenant, work, name)  # a takes both threads, then all queue
                await anyio.sleep(0.01)
            assert pool.holding("a") == 2 and pool.queued("a") == 3 and pool.queued("b") == 2
            for name in ("a0", "a1", "b0", "c0", "a2", "b1", "a3", "a4"):  # each finishes in turn
                assert name in started
                gates[name].set()
                await anyio.sleep(0.05)
        assert pool.holding("a") == 0 and pool.queued("a") == 0

    anyio.run(main)
    # a0 ends: b and c hold none and were never served; b queued first. a1 ends: c (never served)
    # before a (holding none too, but served). b0 ends: a (served before b). c0 ends: b holds none.
    assert started == ["a0", "a1", "b0", "c0", "a2", "b1", "a3", "a4"]


def test_a_tenant_with_a_second_request_waiting_is_not_overtaken_forever() -> None:
    """Outside review of the first version, which forgot a tenant once it held and waited for
    nothing: five tenants each keeping one request in flight then looked never served at every
    return, and overtook B's second request for as long as they kept going (1,175 of theirs in
    3 s, B's second never ran)."""
    done: list[float] = []
    while_others_ran: list[int] = []

    async def main() -> None:
        pool = FairThreadPool(4)
        stop = anyio.Event()

        async def light(i: int) -> None:
            while not stop.is_set():
                await pool.run(f"light{i}", time.sleep, 0.01)

        async def b() -> None:
            t0 = time.perf_counter()
            await pool.run("B", time.sleep, 0.01)
            done.append(time.perf_counter() - t0)

        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(light, i)
            await anyio.sleep(0.2)
            tg.start_soon(b)
            tg.start_soon(b)
            with anyio.move_on_after(10):
                while len(done) < 2:
                    await anyio.sleep(0.01)
            while_others_ran.append(len(done))  # before the others stop (then B's would run anyway)
            stop.set()

    anyio.run(main)
    assert while_others_ran == [2], "B's second request got no thread in 10 s while the others kept asking"


def test_a_request_cancelled_while_waiting_gives_up_its_place() -> None:
    release = threading.Event()

    async def main() -> None:
        pool = FairThreadPool(1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run, "a", release.wait, 10)
            await anyio.sleep(0.01)
            with anyio.move_on_after(0.05):
                await pool.run("b", time.sleep, 0)  # never gets the thread: cancelled in the queue
            assert pool.queued("b") == 0
            release.set()
        # The one thread is free again: a later request runs at once.
        with anyio.fail_after(5):
            assert await pool.run("c", lambda: "ran") == "ran"
        assert pool.holding("a") == pool.holding("b") == pool.holding("c") == 0

    anyio.run(main)


def test_a_pool_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FairThreadPool(0)


@pytest.fixture
def served(tmp_path):  # type: ignore[no-untyped-def]
    db = tmp_path / "fair.db"
    app, service = make_app(f"sqlite:///{db}", tmp_path, run_loop=False)
    try:
        with ServerThread(app) as server:
            url = f"http://127.0.0.1:{server.port}"
            for h in (H_ALICE, H_BOB):
                assert httpx.post(f"{url}/v1/datasets", json=IMAGENET, headers=h).status_code == 201
            jobs = {who: httpx.post(f"{url}/v1/jobs", json=JOB, headers=h).json()["id"]
                    for who, h in (("alice", H_ALICE), ("bob", H_BOB))}
            yield url, db, service, jobs
    finally:
        service.close()


@contextmanager
def _posts_waiting_on_a_held_write_lock(db: Path, url: str, path: str, n: int, settle: float) -> Iterator[None]:
    """`n` POSTs of alice's to `path` (bodies named w0, w1, ...), queued behind a write transaction
    another process holds on `db`; yields while they wait `settle` s and more, then releases the
    lock and checks that every one was created (none lost)."""
    body = JOB if path == "/v1/jobs" else IMAGENET
    holder = sqlite3.connect(db, timeout=30)
    holder.execute("BEGIN IMMEDIATE")
    codes: list[int] = []

    def post(i: int) -> None:
        with httpx.Client(timeout=120) as c:
            codes.append(c.post(f"{url}{path}", json={**body, "name": f"w{i}"}, headers=H_ALICE).status_code)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        time.sleep(settle)
        assert not codes
        yield
    finally:
        holder.rollback()
        holder.close()
        for t in threads:
            t.join(120)
    assert codes == [201] * n


def test_submissions_waiting_on_the_write_lock_hold_no_read_thread(served) -> None:  # type: ignore[no-untyped-def]
    url, db, _service, jobs = served
    with _posts_waiting_on_a_held_write_lock(db, url, "/v1/jobs", 8, settle=1.0):
        with httpx.Client(timeout=5) as c:  # on ee1317d: a ReadTimeout (the reads queued behind them)
            assert c.get(f"{url}/v1/jobs/{jobs['bob']}", headers=H_BOB).json()["state"] == "queued"
            assert c.get(f"{url}/v1/jobs/{jobs['alice']}", headers=H_ALICE).json()["state"] == "queued"
            assert [j["id"] for j in c.get(f"{url}/v1/jobs", headers=H_BOB).json()] == [jobs["bob"]]


def test_reading_jobs_is_answered_while_every_default_thread_waits(served) -> None:  # type: ignore[no-untyped-def]
    """The hot routes run on threads of their own: with all 40 of anyio's default threads waiting
    (45 dataset registrations queued behind the held write lock), a job is still read at once, its
    token looked up on threads of their own too. On 3d77954 the GET waited with them (and with
    the hot pool alone, for its token). The token cache's entry (2 s) has expired by the GET."""
    url, db, _service, jobs = served
    with _posts_waiting_on_a_held_write_lock(db, url, "/v1/datasets", 45, settle=2.5):
        with httpx.Client(timeout=5) as c:
            assert c.get(f"{url}/v1/jobs/{jobs['alice']}", headers=H_ALICE).json()["state"] == "queued"
            assert [j["id"] for j in c.get(f"{url}/v1/jobs", headers=H_ALICE).json()] == [jobs["alice"]]


def test_one_tenants_queue_of_slow_reads_does_not_hold_up_anothers(served, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Alice's listings are made slow (each waits for the test's go); 12 of them hold the 4 read
    threads and queue 8 more. Bob's GET gets the first thread one of hers frees, not the 9th."""
    url, _db, service, jobs = served
    catalogue = service.catalogue
    real_list = catalogue.list_jobs
    go = threading.Semaphore(0)
    started = threading.Semaphore(0)

    def slow_list(who, *args):  # type: ignore[no-untyped-def]
        if who.user == "alice":
            started.release()
            assert go.acquire(timeout=60)
        return real_list(who, *args)

    monkeypatch.setattr(catalogue, "list_jobs", slow_list)
    done: list[str] = []

    def alice(i: int) -> None:
        with httpx.Client(timeout=120) as c:
            assert c.get(f"{url}/v1/jobs", headers=H_ALICE).status_code == 200
        done.append(f"alice{i}")

    threads = [threading.Thread(target=alice, args=(i,)) for i in range(12)]
    try:
        for t in threads:
            t.start()
        for _ in range(4):
            assert started.acquire(timeout=10)  # 4 of hers run, 8 queue
        time.sleep(0.5)
        bob: list[int] = []
        reader = threading.Thread(target=lambda: bob.append(
            httpx.get(f"{url}/v1/jobs/{jobs['bob']}", headers=H_BOB, timeout=60).status_code))
        reader.start()
        time.sleep(0.5)
        assert not bob  # all 4 read threads are alice's
        go.release()  # one of hers finishes: the freed thread is bob's (on ee1317d: her 5th listing's)
        reader.join(5)
        assert bob == [200], "bob's read did not get the first freed thread"
    finally:
        for _ in range(12):
            go.release()
        for t in threads:
            t.join(120)
    assert len(done) == 12
