"""One queue for the writers of one SQLite file across the API worker processes (issue 47).

SQLite has one writer at a time. A connection that finds the write lock taken waits in SQLite's
busy handler, which sleeps 1, 2, 5, 10, 15, 20, 25 ... 100 ms between tries and does not wake
when the lock is freed. With `silod serve --workers 2`, each worker's submissions queue behind
its process-local lock, and the one at the head of a worker's queue slept in that handler while
the other worker wrote: the database sat idle for most of each sleep, and that worker's whole
queue waited behind it. Submissions per second were capped by those sleeps, not by the CPU
(bench_api.py at 16 clients: silod's API used no more CPU per submission than the bare app and
served 0.65-0.8x its submissions).

`DatabaseWriteLock` is the process-local re-entrant lock plus an exclusive `flock` on a file
beside the database, held from the outermost `with` to its end: a writer of another worker waits
in the kernel and is woken as soon as the lock is released. Writes still take SQLite's own lock;
this only orders the API workers before they ask for it (the scheduling process's round writes
still meet them in SQLite's busy handler, as before). The kernel drops a dead process's flock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from pathlib import Path
from types import TracebackType

from sqlalchemy import Engine

log = logging.getLogger("silod.db")

LOCK_SUFFIX = "-silod-writers"


class DatabaseWriteLock:
    """A re-entrant lock shared by every process that opens it on the same path."""

    def __init__(self, path: Path):
        self.path = path
        self._local = threading.RLock()
        # O_CLOEXEC (Python's default): a child process never inherits the lock.
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._depth = 0  # nesting of this process's holder (only the holder of _local touches it)

    def __enter__(self) -> DatabaseWriteLock:
        self._local.acquire()
        if self._depth == 0:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)  # releases the GIL while it waits
            except BaseException:
                self._local.release()
                raise
        self._depth += 1
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._depth -= 1
        try:
            if self._depth == 0:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._local.release()

    def close(self) -> None:
        os.close(self._fd)


def writers_lock(engine: Engine) -> DatabaseWriteLock | threading.RLock:
    """The lock an API worker's writes take: for a SQLite file, a DatabaseWriteLock beside it
    (`<file>-silod-writers`, mode 0600, like the database's own -wal and -shm files); for
    PostgreSQL (row locks, no single writer) or a file whose directory refuses the lock file, the
    process-local RLock alone."""
    if engine.dialect.name != "sqlite" or not engine.url.database:
        return threading.RLock()
    path = Path(engine.url.database).expanduser()
    path = path.with_name(path.name + LOCK_SUFFIX)
    try:
        return DatabaseWriteLock(path)
    except OSError as exc:
        log.warning("cannot open %s (%s): the API workers' submissions queue in SQLite's busy handler", path, exc)
        return threading.RLock()
