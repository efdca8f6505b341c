"""Who schedules, kept apart from the rounds: the leader lease renewed on a thread of its own,
and what the scheduling process is doing, for everyone to read.

The loop used to renew the lease between rounds, so a long round, or the first Gavel round
compiling its kernels (a minute at nice +10 on a busy node), let the lease expire while its
holder was alive: `/readyz` then said nothing schedules and another replica could take over.
`LeaseKeeper` renews it every `renew_s` (a third of the TTL) whatever the loop is doing; the
loop reads `leading` and recovers when it becomes true. The thread needs a few milliseconds of
CPU per renewal, which even a process at nice +10 gets.

`Activity` is the process's own account of what it is doing ("compiling policy kernels",
"recovering the backend's jobs", "scheduling") and since when; the keeper writes it to the
`scheduler_activity` setting at each change and with every renewal (control.py), where `/readyz`,
the queue's wait reasons and `silod top` read it.
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy.orm import sessionmaker

from scheduler.service import control

log = logging.getLogger("silod.leadership")

LEASE_TTL_S = 15.0  # a leader that stops renewing (killed) is replaced after this long


class Activity:
    """What this process is doing, and since when (thread-safe; read by the keeper)."""

    def __init__(self, phase: str = "starting") -> None:
        self._lock = threading.Lock()
        self._phase, self._since = phase, time.time()
        self.round_since: float | None = None  # when the round in progress started (no write of its own)
        self.changed = threading.Event()

    def set(self, phase: str) -> None:
        with self._lock:
            if phase == self._phase:
                return
            self._phase, self._since = phase, time.time()
        self.changed.set()

    def get(self) -> tuple[str, float]:
        with self._lock:
            return self._phase, self._since


class LeaseKeeper:
    """Takes and renews the leader lease on its own thread once `contend()` is called; writes
    the activity record from the start (so a process still compiling says so)."""

    def __init__(self, sessions: sessionmaker, holder: str, activity: Activity,
                 ttl_s: float = LEASE_TTL_S, renew_s: float | None = None) -> None:
        self.sessions, self.holder, self.activity = sessions, holder, activity
        self.ttl_s = ttl_s
        self.renew_s = ttl_s / 3 if renew_s is None else renew_s
        self.leading = threading.Event()
        self._contend = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="silod-lease", daemon=True)
            self._thread.start()

    def contend(self) -> None:
        """From now on, take the lease when it is free and keep it."""
        self._contend.set()
        self.activity.changed.set()  # try at once

    def stop(self) -> None:
        self._stop.set()
        self.activity.changed.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self.leading.is_set():
            try:
                control.release_lead(self.sessions, self.holder)
            except Exception:  # the lease then simply expires
                log.warning("could not release the leader lease")
            self.leading.clear()
        try:
            self._write("stopped")
        except Exception:
            pass

    def renew_once(self) -> bool:
        """One renewal (and activity write); whether this process leads now."""
        if self._contend.is_set():
            leading = control.try_lead(self.sessions, self.holder, self.ttl_s)
            if leading and not self.leading.is_set():
                log.info("this process holds the scheduling lease (%s)", self.holder)
            elif not leading and self.leading.is_set():
                log.warning("lost the leader lease; another process schedules now")
            (self.leading.set if leading else self.leading.clear)()
        phase, _ = self.activity.get()
        self._write(phase)
        return self.leading.is_set()

    def _write(self, phase: str) -> None:
        _, since = self.activity.get()
        control.write_activity(self.sessions, {"holder": self.holder, "phase": phase, "since": since,
                                               "round_since": self.activity.round_since, "updated": time.time()})

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.renew_once()
            except Exception:  # a database outage: the next renewal retries (the lease may expire meanwhile)
                log.warning("could not renew the scheduling lease", exc_info=True)
            self.activity.changed.wait(self.renew_s)
            self.activity.changed.clear()
