"""Misses staged in memory when the cache disk refuses them, within a byte budget.

A full or failing cache disk is the cache's problem, not the remote's: a miss whose staging file
cannot be created or written is staged in an anonymous memory file (memfd) instead, served from
there and never admitted, and the remote's breaker never hears of it. The budget bounds how much
memory such copies take at once (each is released when its last reader closes it, so the budget
counts them until their flight ends and the memfd's pages are the readers' from then on: the
kernel frees them with the last descriptor). An item that does not fit the budget fails its open
with EIO and one log line naming the disk.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

log = logging.getLogger(__name__)


class CacheDiskUnusable(OSError):
    """The cache disk refused a miss's staged copy and memory staging has no room for it."""


class MemoryStaging:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self._used = 0
        self._lock = threading.Lock()
        self.items = 0  # misses served from memory because the disk refused them
        self.refused = 0  # ... and those that did not fit the budget
        self.last_disk_error = ""
        self.last_disk_error_at = 0.0
        self.disk_errors = 0
        self._logged_at = -1e9

    def disk_failed(self, where: str, exc: OSError) -> None:
        """Count a refused write/create on the cache disk; one log line per 10 s."""
        now = time.monotonic()
        with self._lock:
            self.disk_errors += 1
            self.last_disk_error = f"{where}: {errno.errorcode.get(exc.errno or 0, exc.errno)} ({exc.strerror or exc})"
            self.last_disk_error_at = time.time()
            quiet = now - self._logged_at < 10.0
            if not quiet:
                self._logged_at = now
        if not quiet:
            log.warning("cache disk %s; misses are staged in memory (budget %d MiB) and served "
                        "without caching until the disk takes writes again; the remote is not at fault",
                        self.last_disk_error, self.budget >> 20)

    def take(self, nbytes: int, name: str) -> int:
        """A memfd with room for `nbytes` counted against the budget; CacheDiskUnusable if the
        budget has no room."""
        with self._lock:
            if self._used + nbytes > self.budget:
                self.refused += 1
                raise CacheDiskUnusable(errno.EIO, f"cache disk refused {name!r} ({self.last_disk_error}) and memory "
                                        f"staging is full ({self._used} + {nbytes} > {self.budget} bytes)")
            self._used += nbytes
            self.items += 1
        try:
            return os.memfd_create(f"silod-{name[:200]}", os.MFD_CLOEXEC)
        except OSError:
            self.give_back(nbytes)
            raise

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    def snapshot(self) -> dict:
        with self._lock:
            return {"memory_staging_used_bytes": self._used, "memory_staging_budget_bytes": self.budget,
                    "memory_staged_items": self.items, "memory_staging_refused": self.refused,
                    "cache_disk_errors": self.disk_errors, "cache_disk_last_error": self.last_disk_error}
