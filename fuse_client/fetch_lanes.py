"""The fetch pool: a fast lane of `fast` fetches, and a slow lane that long fetches move to.

A fetch holds its thread until its item is staged, however slowly the remote sends it. With one
fixed pool, 16 items trickling at 1 KB/s held all 16 workers and every healthy miss queued
behind them until its open failed. Here a fetch that has run for `slow_after_s` moves to the
slow lane (when the slow lane has room), which frees its fast slot at once for the next queued
fetch: healthy items wait only behind other healthy items, and at most `fast + slow` fetches
(threads) run. A fetch in the slow lane reads in small chunks (`SLOW_CHUNK`), so the lanes
together hold at most `fast * 4 MiB + slow * SLOW_CHUNK` of fetched data in memory
(`inflight_bound`).

A task is moved by a monitor while fetches are queued and the fast lane is full, not by the
task itself: a task may sit in one long read (a trickling item) and never come back to ask.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

FAST_CHUNK = 4 * 1024 * 1024
SLOW_CHUNK = 256 * 1024
DEFAULT_SLOW_FETCHES = 64
SLOW_AFTER_S = 1.0
_MONITOR_S = 0.1


class Lane:
    """One task's place: which lane it runs in (read by its fetch before each chunk)."""

    __slots__ = ("slow", "started")

    def __init__(self) -> None:
        self.slow = False
        self.started = time.monotonic()

    def chunk_cap(self) -> int:
        return SLOW_CHUNK if self.slow else FAST_CHUNK


class FetchLanes:
    def __init__(self, fast: int, slow: int = DEFAULT_SLOW_FETCHES, slow_after_s: float = SLOW_AFTER_S,
                 name: str = "silod-fetch") -> None:
        if fast < 1:
            raise ValueError(f"fetch workers must be >= 1, got {fast}")
        if slow < 0:
            raise ValueError(f"slow fetches must be >= 0, got {slow}")
        self.fast, self.slow, self.slow_after_s = fast, slow, slow_after_s
        self._name = name
        self._cv = threading.Condition()
        self._queue: deque[tuple[Callable, tuple]] = deque()
        self._fast_free = fast
        self._slow_free = slow
        self._running: list[Lane] = []  # in the fast lane
        self._threads = self._idle = 0
        self._monitor = False
        self._shutdown = False
        self.moved = 0  # fetches moved to the slow lane so far
        self.ran_here = 0  # tasks run on their caller's thread (run_here)

    @property
    def inflight_bound(self) -> int:
        return self.fast * FAST_CHUNK + self.slow * SLOW_CHUNK

    def snapshot(self) -> dict:
        with self._cv:
            return {"fast_running": self.fast - self._fast_free, "slow_running": self.slow - self._slow_free,
                    "queued": len(self._queue), "moved_to_slow_lane": self.moved, "ran_on_caller": self.ran_here,
                    "inflight_bytes_bound": self.inflight_bound}

    def submit(self, fn: Callable[[Lane], None], *args) -> None:
        """Run `fn(lane, *args)` in a lane; RuntimeError once shut down (unmounting)."""
        with self._cv:
            if self._shutdown:
                raise RuntimeError("the fetch pool is shut down")
            self._queue.append((fn, args))
            self._kick()

    def run_here(self, fn: Callable[[Lane], None], *args) -> bool:
        """Run `fn(lane, *args)` on the calling thread when a fast slot is free and nothing is
        queued (saves the hand-off to a pool thread and back); False, having run nothing, else.
        The task holds its fast slot as a pool task does (the monitor may move it to the slow
        lane); RuntimeError once shut down."""
        with self._cv:
            if self._shutdown:
                raise RuntimeError("the fetch pool is shut down")
            if self._queue or self._fast_free <= 0:
                return False
            self._fast_free -= 1
            lane = Lane()
            self._running.append(lane)
            self.ran_here += 1
        try:
            fn(lane, *args)
        finally:
            with self._cv:
                if lane.slow:
                    self._slow_free += 1
                else:
                    self._running.remove(lane)
                    self._fast_free += 1
                self._kick()
        return True

    def shutdown(self) -> list[tuple[Callable, tuple]]:
        """Stop taking tasks; returns the queued ones, which will never run."""
        with self._cv:
            self._shutdown = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
            return dropped

    # -- under self._cv ----------------------------------------------------------------------

    def _kick(self) -> None:
        if not self._queue:
            return
        if self._fast_free > 0:
            runnable = min(len(self._queue), self._fast_free)
            woken = min(runnable, self._idle)
            if woken:
                self._cv.notify(woken)
            for _ in range(min(runnable - woken, self.fast + self.slow - self._threads)):
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self._name}-{self._threads}", daemon=True).start()
        elif self._slow_free > 0 and not self._monitor:
            self._monitor = True
            threading.Thread(target=self._watch, name=f"{self._name}-lanes", daemon=True).start()

    def _move_slow_ones(self) -> None:
        now = time.monotonic()
        for lane in list(self._running):
            if self._slow_free <= 0 or len(self._queue) <= self._fast_free:
                return
            if now - lane.started >= self.slow_after_s:
                lane.slow = True
                self._running.remove(lane)
                self._slow_free -= 1
                self._fast_free += 1
                self.moved += 1

    # -- threads -----------------------------------------------------------------------------

    def _watch(self) -> None:
        with self._cv:
            try:
                while not self._shutdown and self._queue and self._fast_free == 0 and self._slow_free > 0:
                    self._move_slow_ones()
                    if self._fast_free:
                        break
                    self._cv.wait(_MONITOR_S)
            finally:
                self._monitor = False
            self._kick()

    def _work(self) -> None:
        cv = self._cv
        with cv:
            while True:
                while not self._shutdown and not (self._queue and self._fast_free > 0):
                    self._idle += 1
                    woke = cv.wait(30.0)
                    self._idle -= 1
                    if not woke and not self._queue:  # idle for long: let the thread go
                        self._threads -= 1
                        return
                if self._shutdown:
                    self._threads -= 1
                    return
                fn, args = self._queue.popleft()
                self._fast_free -= 1
                lane = Lane()
                self._running.append(lane)
                if self._queue and not self._fast_free:
                    # Tasks still wait and this one took the last fast slot: the monitor must
                    # watch it (it may have just ended, having freed fewer slots than tasks wait).
                    self._kick()
                cv.release()
                try:
                    fn(lane, *args)
                except BaseException:  # the task reports its own outcome; never lose the thread
                    pass
                finally:
                    cv.acquire()
                    if lane.slow:
                        self._slow_free += 1
                    else:
                        self._running.remove(lane)
                        self._fast_free += 1
                    if not (self._queue and self._fast_free > 0):  # else this thread takes the next
                        self._kick()
