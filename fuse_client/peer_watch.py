"""Is the process that fetches an item for this node frozen? (issue 19: no open waits for ever.)

A leader whose item another mount process on the node is fetching waits for that process's
lock on the item (single_flight.NodeItemLocks). That process's own fetch is bounded (its open
deadline, its token-wait bounds), so a waiter need not judge how *slow* it is: a slow peer
(a low rate, a slow remote, a long token wait) is waited out, however long its gaps between
bytes. Only a peer that cannot run at all is given up on, and only on evidence that cannot
come from a slow one:

- the holder is the process the kernel itself names: its pid is taken from the item's staging
  file (cache_store.new_staging_file: `staging/<key>.<pid>.*`) and confirmed in
  /proc/<pid>/fdinfo, which lists the byte-range locks each open file holds - the write lock
  on the item's byte of `fetch.lock` must be there (so a stale staging file of a dead process,
  or a reused pid, never counts);
- every thread of the holder is stopped (/proc/<pid>/task/*/stat state `T`, SIGSTOP or job
  control, or `t`, stopped by a tracer) - a stopped thread does not run at all, unlike one
  sleeping in a token wait or on a socket (`S`) or on the disk (`D`);
- its staging file has not changed size;
- and all three held at every sample for the whole stall limit.

A holder that dies releases its lock (the kernel drops open-file-description locks on the last
close), so "gone" needs no check here. What is *not* caught: a holder we may not inspect
(another user's process, /proc hidden) or frozen outside its fetch (between taking the lock and
creating the staging file, or while publishing) - those waits keep only the interrupt.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

SAMPLE_S = 0.25  # how often a waiting leader looks at the holder (/proc reads; cheap, not free)
STOPPED_STATES = frozenset("Tt")


@dataclass(frozen=True)
class Holder:
    pid: int
    staging: Path
    size: int


def _stat_state(stat_line: str) -> str:
    # "pid (comm) S ...": comm may contain spaces and parentheses; the state follows the last ')'.
    return stat_line[stat_line.rindex(")") + 2]


def all_threads_stopped(pid: int, proc: Path = Path("/proc")) -> bool:
    """True if every thread of `pid` is stopped (state T or t); False if any runs, sleeps or the
    process is gone or unreadable."""
    try:
        tids = os.listdir(proc / str(pid) / "task")
    except OSError:
        return False
    if not tids:
        return False
    for tid in tids:
        try:
            state = _stat_state((proc / str(pid) / "task" / tid / "stat").read_text())
        except (OSError, ValueError, IndexError):
            return False  # a thread that just exited: look again at the next sample
        if state not in STOPPED_STATES:
            return False
    return True


def holds_write_lock(pid: int, lock_file: os.stat_result, offset: int, proc: Path = Path("/proc"),
                     fd_hint: dict[int, int] | None = None) -> bool:
    """True if /proc says `pid` holds an OFD write lock on byte `offset` of the file `lock_file`.

    `fd_hint` remembers, per pid, which descriptor is the lock file (a mount may hold thousands
    of descriptors; the lock file is opened once at start)."""
    fd_dir = proc / str(pid) / "fd"
    hint = fd_hint.get(pid) if fd_hint is not None else None
    candidates = [str(hint)] if hint is not None else None
    if candidates is None:
        try:
            candidates = os.listdir(fd_dir)
        except OSError:
            return False
    for fd in candidates:
        try:
            st = os.stat(fd_dir / fd)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) != (lock_file.st_dev, lock_file.st_ino):
            continue
        if fd_hint is not None:
            fd_hint[pid] = int(fd)
        try:
            info = (proc / str(pid) / "fdinfo" / fd).read_text()
        except OSError:
            return False
        for line in info.splitlines():
            # lock:\t1: OFDLCK ADVISORY  WRITE -1 fe:00:2146643 12345678 12345678
            if not line.startswith("lock:"):
                continue
            fields = line.split()
            if "WRITE" in fields and len(fields) >= 2 and fields[-2] == str(offset) and fields[-1] == str(offset):
                return True
        return False
    if fd_hint is not None:
        fd_hint.pop(pid, None)  # closed or reused: scan afresh next time
    return False


def find_holder(staging_dir: Path, key: str, lock_path: Path, offset: int, proc: Path = Path("/proc"),
                fd_hint: dict[int, int] | None = None) -> Holder | None:
    """The process that holds the fetch lock of `key` and has a staging file for it, confirmed by
    the kernel's own lock list; None if there is none or it cannot be confirmed."""
    try:
        lock_file = os.stat(lock_path)
        names = [n for n in os.listdir(staging_dir) if n.startswith(key + ".")]
    except OSError:
        return None
    for name in names:
        parts = name.split(".")
        if len(parts) < 2 or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid == os.getpid():
            continue
        try:
            size = os.stat(staging_dir / name).st_size
        except OSError:
            continue  # published or abandoned meanwhile
        if holds_write_lock(pid, lock_file, offset, proc, fd_hint):
            return Holder(pid, staging_dir / name, size)
    return None


class PeerWatch:
    """Samples the holder of one item's fetch lock while a leader waits for it; `frozen_for()`
    is how long the holder has been seen frozen (stopped, staging size unchanged) without a
    break - 0.0 unless every sample since then saw it so."""

    def __init__(self, staging_dir: Path, lock_path: Path, key: str, offset: int,
                 clock: Callable[[], float] = time.monotonic, proc: Path = Path("/proc")) -> None:
        self._args = (staging_dir, key, lock_path, offset)
        self._clock = clock
        self._proc = proc
        self._fd_hint: dict[int, int] = {}
        self._next = 0.0
        self._since: float | None = None
        self._holder: Holder | None = None

    def frozen_for(self) -> float:
        now = self._clock()
        if now >= self._next:
            self._next = now + SAMPLE_S
            self._sample(now)
        return 0.0 if self._since is None else now - self._since

    def _sample(self, now: float) -> None:
        staging_dir, key, lock_path, offset = self._args
        holder = find_holder(staging_dir, key, lock_path, offset, self._proc, self._fd_hint)
        frozen = holder is not None and all_threads_stopped(holder.pid, self._proc)
        if frozen and holder == self._holder:
            return  # the same holder, stopped, its staging file the same size: the window goes on
        # Running or sleeping, another holder, or its staging file changed: the window restarts.
        self._since = now if frozen else None
        self._holder = holder if frozen else None

    @property
    def holder(self) -> Holder | None:
        return self._holder
