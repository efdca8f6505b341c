"""A few worker threads shared fairly between tenants.

The hot routes (submit, get and list jobs) run on a handful of threads of their own rather than
the 40 of anyio's default pool, which cost a third more CPU per request in GIL contention
(app.py, HOT_THREADS). A plain limiter of four threads is first come, first served: one tenant
with 32 requests in flight held all four, and another tenant's single GET waited behind its whole
queue (3.8 s median, 12 s worst, in an outside review). Here a freed thread goes to the waiting
tenant that holds the fewest; among those, to the one served least recently (round robin); within
a tenant, in arrival order. A tenant's wait is bounded by one request of whoever holds the
threads, however many requests others queue.

All bookkeeping runs on the worker's event loop (one thread), so it needs no lock.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


@dataclass
class _Waiter:
    seq: int
    granted: anyio.Event = field(default_factory=anyio.Event)


class FairThreadPool:
    REMEMBERED = 10_000

    def __init__(self, threads: int):
        if threads < 1:
            raise ValueError(f"a thread pool needs at least 1 thread, not {threads}")
        self.threads = threads
        self._limiter: anyio.CapacityLimiter | None = None  # made in the event loop, at first use
        self._free = threads
        self._held: dict[str, int] = {}
        self._waiting: dict[str, deque[_Waiter]] = {}
        # When each tenant last got a thread, for the most recent REMEMBERED tenants. Kept after
        # a tenant goes idle: forgetting it made a tenant that keeps one request in flight look
        # never served at each return, so it overtook, forever, a tenant with a second request
        # waiting. A tenant dropped from the table only gains (it counts as never served).
        self._served: OrderedDict[str, int] = OrderedDict()
        self._seq = itertools.count()

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on one of the pool's threads, once `tenant`'s turn comes."""
        await self._acquire(tenant)
        try:
            if self._limiter is None:
                self._limiter = anyio.CapacityLimiter(self.threads)
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        finally:
            self._release(tenant)

    def holding(self, tenant: str) -> int:
        return self._held.get(tenant, 0)

    def queued(self, tenant: str) -> int:
        return len(self._waiting.get(tenant, ()))

    async def _acquire(self, tenant: str) -> None:
        if self._free > 0 and not self._waiting:
            self._free -= 1
            self._grant(tenant)
            return
        waiter = _Waiter(next(self._seq))
        self._waiting.setdefault(tenant, deque()).append(waiter)
        try:
            await waiter.granted.wait()
        except BaseException:
            # Cancelled (the client went away): a thread already handed over goes to the next
            # in line; otherwise the place in the queue is given up.
            if waiter.granted.is_set():
                self._release(tenant)
            else:
                queue = self._waiting[tenant]
                queue.remove(waiter)
                if not queue:
                    del self._waiting[tenant]
            raise

    def _grant(self, tenant: str) -> None:
        self._held[tenant] = self._held.get(tenant, 0) + 1
        self._served[tenant] = next(self._seq)
        self._served.move_to_end(tenant)
        if len(self._served) > self.REMEMBERED:
            self._served.popitem(last=False)

    def _release(self, tenant: str) -> None:
        held = self._held[tenant] - 1
        if held:
            self._held[tenant] = held
        else:
            del self._held[tenant]
        if not self._waiting:
            self._free += 1
            return
        nxt = min(self._waiting, key=lambda t: (self._held.get(t, 0), self._served.get(t, -1), self._waiting[t][0].seq))
        queue = self._waiting[nxt]
        waiter = queue.popleft()
        if not queue:
            del self._waiting[nxt]
        self._grant(nxt)
        waiter.granted.set()
