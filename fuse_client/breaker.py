"""Fail fast on a dead remote: one retry policy, a per-open deadline and a circuit breaker.

Without these, a training job whose remote store is down hangs: every open retries for tens of
seconds (the S3 client's own retries nested inside ours) and the data loader's workers pile up.
Here:

- `RetryPolicy` is the only retry loop: the S3/HTTP clients are configured to try once
  (remote.py), and silod retries with backoff around them while the open's deadline allows.
- The deadline bounds how long one open may spend without the remote delivering data
  (connecting, waiting for the first byte, stalls, backoff); time spent waiting for the job's
  own tokens does not count, because a throttled job is slow by decision, not by failure.
- `CircuitBreaker`: after `threshold` consecutive failed opens it opens; opens that need the
  remote then fail at once with EIO (cached items are still served), one log line names the
  remote and the error, and a prober asks the remote every `probe_interval_s` until it
  answers; then the breaker closes and fetches resume.

Pure state machine with the clock passed in; the prober thread lives in dataplane.py.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class RetryPolicy:
    # Tries in a row that deliver nothing (one that delivers bytes starts the count again: a
    # resumed fetch keeps its bytes, so a flaky remote costs a retry, not the item). The
    # deadline bounds them too: at the defaults a dead remote gets about 7 tries in 5 s.
    attempts: int = 8
    backoff_s: float = 0.2  # sleep backoff_s * 2**k before retry k+1, at most max_backoff_s
    max_backoff_s: float = 1.0
    deadline_s: float = 5.0  # an open fails once the remote has delivered nothing for this long
    connect_timeout_s: float = 2.0  # handed to the remote client (capped at half the deadline)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"retry attempts must be >= 1, got {self.attempts}")
        if not self.deadline_s > 0:
            raise ValueError(f"the per-open deadline must be > 0 s, got {self.deadline_s}")

    def backoff(self, retry: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** (retry - 1))

    @property
    def client_timeout_s(self) -> float:
        """Connect/read timeout for one request of the remote's client."""
        return max(0.1, min(self.connect_timeout_s, self.deadline_s / 2))

    @property
    def read_timeout_s(self) -> float:
        """How long one wait for the next byte of a response may last before the request is
        given up and resumed on a new connection: half the deadline (at least the client
        timeout), so that a dead connection gets one more try within the deadline while a pause
        shorter than that is simply waited out (it scales with --open-deadline)."""
        return max(self.client_timeout_s, self.deadline_s / 2)


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"


class RemoteUnavailable(OSError):
    """The breaker is open: the remote failed repeatedly and has not answered a probe since."""


class CircuitBreaker:
    def __init__(self, remote: str, threshold: int = 5, probe_interval_s: float = 1.0) -> None:
        if threshold < 1:
            raise ValueError(f"breaker threshold must be >= 1, got {threshold}")
        if not probe_interval_s > 0:
            raise ValueError(f"probe interval must be > 0 s, got {probe_interval_s}")
        self.remote = remote
        self.threshold = threshold
        self.probe_interval_s = probe_interval_s
        self._lock = threading.Lock()
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.times_opened = 0
        self.last_error = ""
        self.opened_at: float | None = None
        self.rejected = 0  # opens failed at once because the breaker was open

    @property
    def is_open(self) -> bool:
        return self.state is BreakerState.OPEN

    def check(self) -> None:
        """Raise RemoteUnavailable (EIO) if the breaker is open."""
        if self.state is BreakerState.OPEN:
            with self._lock:
                self.rejected += 1
            raise RemoteUnavailable(5, f"remote {self.remote} is unavailable (circuit breaker open after "
                                       f"{self.threshold} consecutive failures; last error: {self.last_error})")

    def record_success(self) -> None:
        with self._lock:
            self.consecutive_failures = 0

    def record_failure(self, error: str, now: float) -> bool:
        """Count a failed open; returns True if this failure opened the breaker."""
        with self._lock:
            self.consecutive_failures += 1
            self.last_error = error
            if self.state is BreakerState.CLOSED and self.consecutive_failures >= self.threshold:
                self.state = BreakerState.OPEN
                self.opened_at = now
                self.times_opened += 1
                return True
            return False

    def close(self) -> bool:
        """The remote answered a probe. Returns True if the breaker was open."""
        with self._lock:
            was_open = self.state is BreakerState.OPEN
            self.state = BreakerState.CLOSED
            self.consecutive_failures = 0
            self.opened_at = None
            return was_open
