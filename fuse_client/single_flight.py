"""One remote fetch per item per node: per-item waiters in a process, byte-range locks across processes.

Inside one mount process, concurrent misses of one item join one `Flight`: the first thread
(the leader) fetches, the others wait on the flight's event and get the leader's outcome. No
node-wide lock is held while fetching, so misses of different items never wait for each other.

Across the mount processes that share a cache directory, the leaders of one item take a write
lock on one byte of a single file, `fetch.lock`, at an offset derived from the item's key
(open-file-description locks: owned by the descriptor, released by the kernel if
the process dies, no per-item lock files). A leader that has to wait polls for the lock (so it
can give up on a frozen holder: peer_watch.py) and first takes a read lock on the item's
"waiting" byte, so the fetching process can ask the kernel (F_OFD_GETLK) whether
another process wants the bytes even when the cache has no room to admit them.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# struct flock on Linux x86_64/aarch64: short l_type, short l_whence, off_t l_start, off_t l_len,
# pid_t l_pid (+ padding to 32 bytes). l_pid must be 0 for OFD locks.
_FLOCK = struct.Struct("hhqqi4x")
POLL_MIN_S = 0.002
POLL_MAX_S = 0.05


def _byte_of(key: str) -> int:
    """Two bytes per key (fetch, waiting) at an offset from the key's first 56 bits.

    Two keys colliding (p ~ n^2 / 2^57) only serialise their fetches; correctness is unaffected.
    """
    return int(key[:14], 16) * 2


class NodeItemLocks:
    """Cross-process per-item locks on one file; one instance (one descriptor) per process."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    @staticmethod
    def fetch_byte(key: str) -> int:
        """The byte of `fetch.lock` whose write lock the fetching process holds (see peer_watch)."""
        return _byte_of(key)

    def _lock(self, cmd: int, kind: int, offset: int) -> bytes:
        return fcntl.fcntl(self._fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0))

    def mark_waiting(self, key: str) -> None:
        self._lock(fcntl.F_OFD_SETLK, fcntl.F_RDLCK, _byte_of(key) + 1)

    def unmark_waiting(self, key: str) -> None:
        self._lock(fcntl.F_OFD_SETLK, fcntl.F_UNLCK, _byte_of(key) + 1)

    def others_waiting(self, key: str) -> bool:
        """True if another process marked itself waiting for `key` (our own marks don't conflict)."""
        kind = _FLOCK.unpack(self._lock(fcntl.F_OFD_GETLK, fcntl.F_WRLCK, _byte_of(key) + 1))[0]
        return kind != fcntl.F_UNLCK

    def try_acquire(self, key: str) -> bool:
        try:
            self._lock(fcntl.F_OFD_SETLK, fcntl.F_WRLCK, _byte_of(key))
            return True
        except (BlockingIOError, PermissionError):
            return False

    def acquire(self, key: str, between: Callable[[], None]) -> None:
        """Wait until no other process fetches `key`, calling `between()` between attempts (it
        raises to give up: unmount, a frozen peer). Polled, not F_OFD_SETLKW: a blocked SETLKW
        cannot be given up from inside the process. The first tries come quickly (a peer about
        to finish), then every POLL_MAX_S - the latency it adds to a wait that lasted that long."""
        pause = POLL_MIN_S
        while not self.try_acquire(key):
            between()
            time.sleep(pause)  # releases the GIL
            pause = min(POLL_MAX_S, pause * 2)

    def release(self, key: str) -> None:
        self._lock(fcntl.F_OFD_SETLK, fcntl.F_UNLCK, _byte_of(key))

    def close(self) -> None:
        os.close(self._fd)


@dataclass
class Flight:
    """One in-process fetch of one item and the threads waiting for it."""

    key: str
    done: threading.Event = field(default_factory=threading.Event)
    # Set with `done`, or earlier when a large item's first bytes are staged (`stream`): the
    # waiting opens may then return and read the item while it is fetched (inflight_item.py).
    ready: threading.Event = field(default_factory=threading.Event)
    stream: object = None  # inflight_item.InFlightItem once published
    leader_streamed: bool = False  # the leader's own open left with the stream
    waiters: int = 0
    # Set by the leader before `done`: admitted into the cache, or fds of a not-admitted copy
    # (one per waiter), or the error every waiter re-raises.
    admitted: bool = False
    fds: list[int] = field(default_factory=list)
    error: BaseException | None = None
    # For the waiting opens' own deadline (dataplane.py): whether the leader runs yet, when the
    # remote last delivered for it, and whether it waits for tokens (a rate > 0) or for another
    # process fetching the same item - waits that are not the remote's stall.
    created: float = field(default_factory=time.monotonic)
    started: bool = False
    progress: float = 0.0
    throttled: int = 0
    waiting_peer: bool = False
    leader_gone: bool = False  # the leader's own open gave up: the leader closes its descriptor
    lane: object = None  # the fetch lane its leader runs in (fetch_lanes.Lane)
    # Set while the leader runs on its own open's thread (dataplane.py, "inline"): called at the
    # fetch's waits, it raises to hand the fetch to the pool (the open was interrupted, the
    # fetch stalls, or it would wait for tokens or room).
    check: object = None


class Flights:
    """Per-item waiters inside one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[str, Flight] = {}

    def join(self, key: str) -> tuple[Flight, bool]:
        """The flight of `key` and whether the caller leads it (must fetch and then `finish`)."""
        with self._lock:
            flight = self._flights.get(key)
            if flight is not None:
                flight.waiters += 1
                return flight, False
            flight = self._flights[key] = Flight(key)
            return flight, True

    def leave(self, flight: Flight, leader: bool) -> bool:
        """An open waiting for `flight` gives up (interrupted, or past its deadline). Returns
        True if the flight had finished meanwhile: the caller then owns and closes its share."""
        with self._lock:
            if not flight.done.is_set():
                if leader:
                    flight.leader_gone = True
                else:
                    flight.waiters -= 1
                return False
        if not leader and flight.fds:
            with self._lock:
                fd = flight.fds.pop() if flight.fds else None
            if fd is not None:
                os.close(fd)
        return True

    def detach(self, flight: Flight, leader: bool) -> bool:
        """An open stops waiting for `flight` to end because it reads the item while it is
        fetched (flight.stream). False when the flight has ended meanwhile: the open then takes
        the outcome as usual."""
        with self._lock:
            if flight.done.is_set():
                return False
            if leader:
                flight.leader_gone = flight.leader_streamed = True
            else:
                flight.waiters -= 1
            return True

    def finish(self, flight: Flight, *, admitted: bool = False, fd: int | None = None, error: BaseException | None = None) -> bool:
        """Hand the outcome to the waiters. `fd` (a not-admitted copy) is dup'ed for each waiter.
        Returns True when the leader's own open has given up (the caller closes `fd` then)."""
        with self._lock:
            if flight.done.is_set():  # aborted at unmount: its waiters already got the error
                return flight.leader_gone
            if self._flights.get(flight.key) is flight:
                del self._flights[flight.key]
            flight.admitted = admitted
            flight.error = error
            if fd is not None and not admitted and error is None:
                flight.fds = [os.dup(fd) for _ in range(flight.waiters)]
            gone = flight.leader_gone
        flight.done.set()
        flight.ready.set()
        return gone

    def abort_all(self, error: BaseException) -> None:
        """Fail every flight whose leader never ran (its fetch was cancelled at unmount)."""
        with self._lock:
            flights = list(self._flights.values())
            self._flights.clear()
        for flight in flights:
            with self._lock:
                if flight.done.is_set():
                    continue
                flight.error = error
            flight.done.set()
            flight.ready.set()

    def in_flight(self) -> int:
        with self._lock:
            return len(self._flights)
