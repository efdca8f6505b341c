"""The fetch pool's lanes (fuse_client/fetch_lanes.py) on their own, with tasks that block on
events instead of a remote: which task runs when is then decided by the pool alone."""

from __future__ import annotations

import threading
import time

from fuse_client.fetch_lanes import FetchLanes


def test_a_task_left_queued_when_the_monitor_freed_fewer_slots_than_tasks_wait_still_gets_one():
    """One fast slot, three long tasks. The monitor moves the first to the slow lane, which lets
    the second start and leaves the third queued. The second, long too, must be moved in its turn
    (before: the monitor had ended and nothing restarted it, so the third waited until a long
    task finished: the healthy items of tests/test_fuse_bad_day.py waiting 10 s for trickling ones)."""
    lanes = FetchLanes(fast=1, slow=4, slow_after_s=0.2)
    release = threading.Event()
    started: dict[str, float] = {}

    def task(lane, name: str, block: bool) -> None:  # type: ignore[no-untyped-def]
        started[name] = time.monotonic()
        if block:
            release.wait(30)

    try:
        lanes.submit(task, "long1", True)
        deadline = time.monotonic() + 10
        while "long1" not in started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "long1" in started
        lanes.submit(task, "long2", True)
        lanes.submit(task, "short", False)
        deadline = time.monotonic() + 10
        while "short" not in started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "short" in started, (started, lanes.snapshot())
        assert started["long1"] < started["long2"] < started["short"]
        assert lanes.snapshot()["moved_to_slow_lane"] == 2
    finally:
        release.set()
        lanes.shutdown()


def test_run_here_takes_a_free_fast_slot_on_the_callers_thread_and_never_overtakes_queued_tasks():
    """run_here runs the task on the calling thread while a fast slot is free and nothing queues;
    with the fast lane full (a task queued behind it), it runs nothing and the caller submits, so
    tasks still start in arrival order. An inline task that runs long is moved to the slow lane
    like a pool task, and its slot is given back either way."""
    lanes = FetchLanes(fast=1, slow=1, slow_after_s=0.2)
    release = threading.Event()
    ran: list[tuple[str, str]] = []

    def task(lane, name: str, block: bool) -> None:  # type: ignore[no-untyped-def]
        ran.append((name, threading.current_thread().name))
        if block:
            release.wait(30)

    try:
        assert lanes.run_here(task, "first", False)
        assert ran == [("first", threading.current_thread().name)]
        inline = threading.Thread(target=lanes.run_here, args=(task, "long", True), name="opener")
        inline.start()
        deadline = time.monotonic() + 10
        while len(ran) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran[1] == ("long", "opener")
        assert lanes.snapshot()["fast_running"] == 1
        lanes.submit(task, "queued", False)  # waits for the fast slot (the monitor frees it)
        assert not lanes.run_here(task, "late", False)  # something queues: never overtaken here
        deadline = time.monotonic() + 10
        while len(ran) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [name for name, _ in ran] == ["first", "long", "queued"]
        assert lanes.snapshot()["moved_to_slow_lane"] == 1  # the inline task moved like a pool task
        release.set()
        inline.join(10)
        assert lanes.snapshot()["fast_running"] == lanes.snapshot()["slow_running"] == 0
        assert lanes.snapshot()["ran_on_caller"] == 2
    finally:
        release.set()
        lanes.shutdown()
