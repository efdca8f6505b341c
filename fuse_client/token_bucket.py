"""Token bucket that throttles one job's remote fetches to its remote-IO allocation b.

The pure `TokenBucket` takes the clock as an argument so it can be tested without sleeping.
`Throttle` wraps it for threads: it sleeps in short slices (<= 0.1 s) and re-reads the rate on
every slice, so a new allocation pushed by the data manager takes effect well within 1 s even
for a fetch that is already waiting.

Only the remote-fetch path calls `Throttle.acquire`; cache hits never touch the bucket.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

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


class Throttle:
    """Thread-safe blocking front of a TokenBucket (one per job, i.e. per mount)."""

    def __init__(self, rate: float = math.inf, clock=time.monotonic, sleep=time.sleep) -> None:
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._bucket = TokenBucket(rate=rate, tokens=0.0, last=clock())
        self._closed = False

    @property
    def rate(self) -> float:
        return self._bucket.rate

    def set_rate(self, rate: float) -> None:
        with self._lock:
            if rate != self._bucket.rate:
                self._bucket.set_rate(rate, self._clock())

    def close(self) -> None:
        """Wake every waiter with an error; used at unmount so no thread sleeps forever."""
        self._closed = True

    def acquire(self, nbytes: int) -> None:
        """Block until `nbytes` may be fetched; raises InterruptedError if the throttle closed."""
        while True:
            if self._closed:
                raise InterruptedError("throttle closed")
            with self._lock:
                wait = self._bucket.try_take(nbytes, self._clock())
            if wait == 0.0:
                return
            self._sleep(min(wait, MAX_SLEEP_S))


def chunk_size_for(rate: float) -> int:
    """Fetch granularity: about 1/20 s of tokens, between 64 KiB and 4 MiB.

    Small chunks keep the achieved rate smooth at low rates; large chunks keep per-chunk
    overhead (a token check, an fsspec read call) negligible at high rates.
    """
    if math.isinf(rate) or rate <= 0:
        return 4 * 1024 * 1024
    return int(min(4 * 1024 * 1024, max(64 * 1024, rate / 20)))
