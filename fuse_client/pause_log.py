"""The spans of time this mount process did not run, so that they never count as the remote's stall.

An open waiting for a fetch fails with EIO once the remote has delivered nothing for the stall
limit (dataplane.ItemResolver._stalled). Measured on the monotonic clock alone, time in which
the mount process itself could not run - SIGSTOP, a frozen cgroup, a paused VM, a CPU quota or
the GIL withheld for long - would count as the remote's: after SIGCONT the waiting open would
fail at once, although the remote's bytes may have been waiting in the socket all along; the
thread that reads them and the thread that judges the wait wake together, and either may run
first.

Why not another clock: none on Linux stops with a process but runs while it sleeps.
CLOCK_MONOTONIC and CLOCK_BOOTTIME run on through a stop; the process and thread CPU clocks
(time.process_time) stand still in every sleep too, and a healthy wait for the remote is all
sleep. So the evidence is the waits themselves: a waiting open wakes every WAIT_SLICE_S, and
when it wakes more than `margin_s` later than that, it could not run in between. That is taken
as the process not running: in each of those cases the fetching thread could not record the
remote's bytes either, and none of them is the remote's doing.

The spans are kept per process, not per wait, and merged: every open waiting through one stop
sees the same stop, and it must be discounted once. A stall reference (a flight's last
progress, the mount's) is judged by the running time since it, `now - since - paused(since, now)`,
so it does not matter which thread stamped the reference or whether that was before or after the
waiter noticed the stop. A remote that stalls while the process runs is still caught at the
limit: the waits then wake on time and no span is recorded.
"""

from __future__ import annotations

import threading

# Later than this past its due time, a waking wait counts as a pause. Far above the scheduling
# jitter of a busy node (milliseconds; a CFS quota period is 100 ms), so noise never extends a
# stall limit - only a real stop does, by its length. Small beside any stall limit (at least
# 1.1 s): a stop shorter than the margin still counts against the remote, as all stops did.
LATE_MARGIN_S = 0.25
# Spans kept (oldest dropped first). A dropped span is only undercounted for a reference older
# than it: the wait then fails as it did before this log, never later.
KEEP = 64


class PauseLog:
    """Disjoint, sorted [start, end] spans (time.monotonic() values) in which the process did not run."""

    def __init__(self, margin_s: float = LATE_MARGIN_S, keep: int = KEEP) -> None:
        if margin_s < 0 or keep < 1:
            raise ValueError(f"margin must be >= 0 and keep >= 1, got {margin_s}, {keep}")
        self.margin_s = margin_s
        self._keep = keep
        self._lock = threading.Lock()
        self._spans: list[tuple[float, float]] = []

    def woke(self, due: float, now: float) -> None:
        """A wait that should have woken at `due` woke at `now`: record [due, now] if it is late
        by more than the margin."""
        if now - due <= self.margin_s:
            return
        with self._lock:
            # Waits that saw one stop report overlapping spans, in any order (a wait may reach
            # the lock after a later one): merge them so the stop is counted once.
            merged: list[tuple[float, float]] = []
            for start, end in sorted([*self._spans, (due, now)]):
                if merged and start <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], end))
                else:
                    merged.append((start, end))
            self._spans = merged[-self._keep:]

    def paused(self, since: float, now: float) -> float:
        """How much of [since, now] the process was seen not running (seconds)."""
        total = 0.0
        with self._lock:
            for start, end in reversed(self._spans):
                if end <= since:
                    break
                total += max(0.0, min(end, now) - max(start, since))
        return total
