"""Token bucket that throttles one job's remote fetches to its remote-IO allocation b.

The pure `TokenBucket` takes the clock as an argument so it can be tested without sleeping.
`Throttle` wraps it for threads: it sleeps in short slices (<= 0.1 s) and re-reads the rate on
every slice, so a new allocation pushed by the data manager takes effect well within 1 s even
for a fetch that is already waiting.

Only the remote-fetch path calls `Throttle.acquire`; cache hits never touch the bucket.

No token wait is unbounded (issue 19). With `deadline_s` (the mount's --open-deadline) a wait
ends with `TokenWaitExpired` (EAGAIN, the open fails; cache hits go on):
- while the job is paused (rate 0, pushed by the data manager) once the pause has lasted
  `deadline_s`: a pause shorter than that (a re-plan) costs a wait, a longer one fails the
  job's uncached opens at once, one log line per pause, until a rate is granted again;
- at a positive rate r once it has waited `deadline_s` + backlog / r, backlog being the bytes
  every waiter of this job had asked for (its own included) plus the bucket's debt when the
  wait started or the rate last changed: what the allocation delivers, plus the open deadline.
A wait also ends at once when the throttle is closed (unmount); the FUSE layers end the opens
waiting on it at once on an interrupt (a killed reader).
"""

from __future__ import annotations

import errno
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass

log = logging.getLogger(__name__)

# The bucket may hold at most this many seconds of tokens after an idle period. Small, so that a
# job that idles cannot later exceed its rate by much; big enough to absorb scheduling jitter.
BURST_SECONDS = 0.1
# Floor for the burst so that one fetch chunk always fits and tiny rates still make progress.
MIN_BURST_BYTES = 64 * 1024
# Longest single sleep of a waiting fetch; bounds how late a rate change is noticed.
MAX_SLEEP_S = 0.1


@dataclass
class TokenBucket:
    """Bytes allowed at `rate` bytes/s. `rate=inf` means unthrottled; `rate=0` means paused.

    A request for n bytes is granted once the bucket holds min(n, burst) tokens and then takes
    all n, possibly driving the balance negative (debt). Debt makes later requests wait, so the
    long-run rate is exact even when one request is larger than the burst.
    """

    rate: float
    tokens: float = 0.0
    last: float = 0.0

    @property
    def burst(self) -> float:
        if math.isinf(self.rate):
            return math.inf
        return max(MIN_BURST_BYTES, self.rate * BURST_SECONDS)

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.last)
        self.last = now
        if math.isinf(self.rate):
            self.tokens = 0.0
            return
        self.tokens = min(self.burst, self.tokens + self.rate * elapsed)

    def set_rate(self, rate: float, now: float) -> None:
        """Switch to `rate` from `now` on; tokens earned so far at the old rate are kept."""
        if rate < 0 or math.isnan(rate):
            raise ValueError(f"rate must be >= 0, got {rate}")
        self._refill(now)
        self.rate = rate
        self.tokens = min(self.tokens, self.burst)

    def try_take(self, nbytes: int, now: float) -> float:
        """Take `nbytes` and return 0.0, or take nothing and return how long to wait (seconds)."""
        self._refill(now)
        if math.isinf(self.rate):
            return 0.0
        if self.rate == 0:
            return math.inf
        need = min(float(nbytes), self.burst)
        # One byte of slack: waiting for the last fraction of a byte can stall on float rounding.
        if self.tokens >= need - 1.0:
            self.tokens -= nbytes
            return 0.0
        return max((need - self.tokens) / self.rate, 1e-6)


class TokenWaitExpired(BlockingIOError):
    """A token wait the job's allocation cannot deliver within the open deadline (EAGAIN)."""


class Throttle:
    """Thread-safe blocking front of a TokenBucket (one per job, i.e. per mount)."""

    def __init__(self, rate: float = math.inf, clock=time.monotonic, sleep=time.sleep,
                 deadline_s: float | None = None) -> None:
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._bucket = TokenBucket(rate=rate, tokens=0.0, last=clock())
        self._closed = False
        self.deadline_s = deadline_s  # None: waits are not timed out (unit tests, benchmarks)
        self._generation = 0  # bumped at every rate change: a waiter's allowance starts again
        self._paused_since: float | None = self._bucket.last if rate == 0 else None
        self._waiting_bytes = 0  # asked for by the waiters now
        self._logged_generation = -1
        self._last_overrun_log = -math.inf
        self._queue: deque[threading.Event] = deque()  # waiters in arrival order; the first takes tokens

    @property
    def rate(self) -> float:
        return self._bucket.rate

    def set_rate(self, rate: float) -> None:
        with self._lock:
            if rate != self._bucket.rate:
                now = self._clock()
                self._bucket.set_rate(rate, now)
                self._generation += 1
                self._paused_since = now if rate == 0 else None

    def close(self) -> None:
        """Wake every waiter with an error; used at unmount so no thread sleeps forever."""
        self._closed = True

    def acquire(self, nbytes: int) -> None:
        """Block until `nbytes` may be fetched; raises InterruptedError if the throttle closed,
        TokenWaitExpired when the wait outlasts its bound (module docstring).

        Waiters are served in arrival order: only the first in line takes tokens, the others
        wait for their turn. (Before, every waiter polled the bucket and whoever woke first
        won, so with 128 loader workers on a slow allocation some waiters lost every race and
        failed with EAGAIN while later arrivals were served.)"""
        if self._bucket.rate == math.inf and not self._queue:
            return
        generation, since, allowance = -1, 0.0, math.inf
        turn = threading.Event()
        with self._lock:
            self._waiting_bytes += nbytes
            self._queue.append(turn)
            if self._queue[0] is turn:
                turn.set()
        try:
            while True:
                if self._closed:
                    raise InterruptedError("throttle closed")
                with self._lock:
                    now = self._clock()
                    first = self._queue[0] is turn
                    wait = self._bucket.try_take(nbytes, now) if first else MAX_SLEEP_S
                    if wait == 0.0:
                        return
                    if self.deadline_s is not None:
                        if self._bucket.rate == 0:
                            if now - self._paused_since > self.deadline_s:
                                raise self._paused(now)
                        else:
                            if generation != self._generation:
                                generation, since = self._generation, now
                                backlog = self._waiting_bytes + max(0.0, -self._bucket.tokens)
                                allowance = self.deadline_s + backlog / self._bucket.rate
                            if now - since > allowance:
                                raise self._overrun(nbytes, now, allowance)
                if first:
                    self._sleep(min(wait, MAX_SLEEP_S))
                else:
                    turn.wait(MAX_SLEEP_S)
        finally:
            with self._lock:
                self._waiting_bytes -= nbytes
                self._queue.remove(turn)
                if self._queue:
                    self._queue[0].set()

    def try_acquire(self, nbytes: int) -> bool:
        """Take `nbytes` if they are there now and nobody waits before us; False, having taken
        nothing, when acquire() would wait (a caller that must not block, dataplane's inline
        fetch, then leaves the wait to a thread that may)."""
        if self._bucket.rate == math.inf and not self._queue:
            return True
        with self._lock:
            if self._closed:
                raise InterruptedError("throttle closed")
            return not self._queue and self._bucket.try_take(nbytes, self._clock()) == 0.0

    def _paused(self, now: float) -> TokenWaitExpired:
        """The error of a wait at rate 0; logged once per pause (called under the lock)."""
        paused_for = now - self._paused_since
        if self._logged_generation != self._generation:
            self._logged_generation = self._generation
            log.warning("remote IO paused (rate 0) for %.1f s, beyond the open deadline (%g s): opens of uncached "
                        "items fail with EAGAIN until the data manager grants a rate; cached items are served",
                        paused_for, self.deadline_s)
        return TokenWaitExpired(errno.EAGAIN, f"remote IO of this job paused (rate 0) for {paused_for:.1f} s, "
                                              f"beyond the open deadline {self.deadline_s:g} s")

    def _overrun(self, nbytes: int, now: float, allowance: float) -> TokenWaitExpired:
        if now - self._last_overrun_log >= 10.0:
            self._last_overrun_log = now
            log.warning("a wait for %d bytes of tokens at %.0f B/s outlasted %.1f s (its share of the rate plus the "
                        "open deadline): the open fails with EAGAIN (logged once per 10 s)", nbytes,
                        self._bucket.rate, allowance)
        return TokenWaitExpired(errno.EAGAIN, f"token wait for {nbytes} bytes at {self._bucket.rate:.0f} B/s "
                                              f"outlasted {allowance:.1f} s")


def chunk_size_for(rate: float) -> int:
    """Fetch granularity: about 1/20 s of tokens, between 64 KiB and 4 MiB.

    Small chunks keep the achieved rate smooth at low rates; large chunks keep per-chunk
    overhead (a token check, an fsspec read call) negligible at high rates.
    """
    if math.isinf(rate) or rate <= 0:
        return 4 * 1024 * 1024
    return int(min(4 * 1024 * 1024, max(64 * 1024, rate / 20)))
