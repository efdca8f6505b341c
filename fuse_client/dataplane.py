"""Turn "job J opens item X" into a local file descriptor: cache hit, shared fetch, or remote fetch.

This is the one place that combines the shared cache, the remote store, the job's token bucket,
the circuit breaker and its accounting. It knows nothing about FUSE, so it is tested directly as
well as through real mounts.

Threads: a hit is served on the calling (FUSE worker) thread and never waits for anything but
its own open(2). A miss joins the item's flight (single_flight.py); the flight's leader runs in
a separate fetch pool, so the number of concurrent remote fetches is bounded independently of
the FUSE worker threads, and misses of different items never wait for each other.

Streaming opens: a miss of an item of at least `stream_min_bytes` (--stream-min-size; None: off)
returns as soon as its fetch
has staged the first bytes, with a LocalItem whose reads wait only until the staged bytes cover
them (inflight_item.py), instead of after the item's last byte: the reader works while the
rest arrives. Failures before the first byte still fail the open; later ones fail the reads.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

from fuse_client import blocking_http
from fuse_client.accounting import JobAccounting
from fuse_client.breaker import CircuitBreaker, RemoteUnavailable
from fuse_client.cache_store import DatasetCache, item_key
from fuse_client.fetch_lanes import DEFAULT_SLOW_FETCHES, FetchLanes, Lane
from fuse_client.inflight_item import InFlightItem
from fuse_client.memory_staging import MemoryStaging
from fuse_client.pause_log import PauseLog
from fuse_client.peer_watch import PeerWatch
from fuse_client.remote import FileEntry, RemoteFetchError, RemoteStore
from fuse_client.single_flight import Flight, Flights
from fuse_client.token_bucket import Throttle, TokenWaitExpired

log = logging.getLogger(__name__)

DEFAULT_FETCH_WORKERS = 16
WAIT_SLICE_S = 0.05  # how often a waiting open looks at its FUSE request's interrupt flag
# Misses of items this large are read while they are fetched (two 4 MiB chunks and more: below
# that, the wait for the whole item is about the wait for the first chunk anyway).
DEFAULT_STREAM_MIN_BYTES = 8 * 1024 * 1024
# The staging file is written in slices of this size, not in whole 4 MiB chunks: a large write
# makes the page cache allocate large folios, and filling fresh ones cost 5-10x the system time
# of 256 KiB writes on the test VM (256 MiB: 0.2-0.8 s against 0.05-0.06 s; each size measured in
# a new process with os.pwrite on ext4, kernel 6.18).
STAGING_WRITE_BYTES = 256 * 1024


class _HandOff(BaseException):
    """Raised inside a fetch run on its open's thread: the fetch moves to the fetch pool (it
    starts again there, for the opens that wait for it). `error`: what the open itself raises
    (EINTR when it was interrupted, EIO when the fetch stalls), None when it goes on waiting
    (the fetch would wait for tokens or room, which a pool thread does).

    A BaseException: no handler of the fetch's own (retries take an Exception for the remote's
    failure) may catch it, and not an OSError of EINTR either, which Python's buffered reader
    retries the read after."""

    def __init__(self, error: OSError | None) -> None:
        super().__init__("the fetch moves to the fetch pool")
        self.error = error


class LocalItem(NamedTuple):
    """An item ready to serve: `fd` is a read-only descriptor of its complete content, or -1 and
    `stream` for an item still being fetched (its reads go through the stream).
    (A NamedTuple: one is made per open, on the hit path that serves tens of thousands a second.)"""

    fd: int
    entry: FileEntry
    hit: bool
    stream: InFlightItem | None = None  # this open's reference (released with the open)


@dataclass
class _LeaderResult:
    fd: int
    source: str  # "cache" (admitted by another process meanwhile), "transient" or "remote"
    admitted: bool = False


class ItemResolver:
    def __init__(
        self,
        store: RemoteStore,
        cache: DatasetCache,
        throttle: Throttle,
        accounting: JobAccounting,
        breaker: CircuitBreaker | None = None,
        fetch_workers: int = DEFAULT_FETCH_WORKERS,
        slow_fetches: int = DEFAULT_SLOW_FETCHES,
        memory_staging_bytes: int = 256 * 1024 * 1024,
        max_inflight_bytes: int | None = None,
        stream_min_bytes: int | None = DEFAULT_STREAM_MIN_BYTES,  # None: no streaming opens
    ) -> None:
        if fetch_workers < 1:
            raise ValueError(f"fetch workers must be >= 1, got {fetch_workers}")
        self.store = store
        self.stream_min_bytes = stream_min_bytes
        self.cache = cache
        self.throttle = throttle
        self.accounting = accounting
        self.breaker = breaker or CircuitBreaker(store.url)
        self.flights = Flights()
        # Long fetches move to a slow lane of their own so that healthy misses never queue
        # behind them (fetch_lanes.py).
        self._pool = FetchLanes(fetch_workers, slow_fetches)
        # Misses staged in memory while the cache disk refuses writes (memory_staging.py).
        self.memory_staging = MemoryStaging(memory_staging_bytes)
        # Items whose old version readers got bytes of before the object was replaced: the
        # kernel's page cache may hold those bytes, so the next cached open of each must not keep
        # it (Operations._register). A set of paths; add and discard are atomic under the GIL.
        self.changed_while_read: set[str] = set()
        self._keys: dict[str, str] = {}  # item path -> cache key; sha1 per open is measurable
        # After a crash every cached item is checksummed on its first hit (one bit per item).
        self._verified = bytearray((accounting.num_items + 7) // 8)
        self._prober: threading.Thread | None = None
        self._closed = threading.Event()
        self._active = 0  # leaders running in the pool (drained before the index is marked clean)
        self._active_lock = threading.Lock()
        self._last_progress = time.monotonic()  # any fetch of this mount delivered / started
        self._throttled_fetches = 0  # leaders waiting for tokens now
        self._pauses = PauseLog()  # when this process did not run: not the remote's stall
        self._inflight_bytes = 0  # fetched data the pool may hold in memory now
        self._inflight_peak = 0
        # A chunk waits for room under this bound before it is read (--max-inflight-bytes; by
        # default what the lanes can hold anyway: workers x 4 MiB + slow x 256 KiB).
        self.max_inflight_bytes = max_inflight_bytes or self._pool.inflight_bound
        self._inflight_cv = threading.Condition()

    def close(self) -> None:
        """At unmount: stop the prober, cancel queued fetches and wake the opens waiting for them.

        Running fetches end on their own (the throttle is closed first, so they raise
        InterruptedError at their next chunk) and finish their flights."""
        self._closed.set()
        with self._inflight_cv:
            self._inflight_cv.notify_all()
        self._pool.shutdown()
        self.flights.abort_all(InterruptedError("unmounting"))

    def lanes_snapshot(self) -> dict:
        with self._inflight_cv:
            inflight, peak = self._inflight_bytes, self._inflight_peak
        return {**self._pool.snapshot(), "inflight_bytes": inflight, "inflight_bytes_peak": peak,
                "inflight_bytes_bound": self.max_inflight_bytes}

    def _buffered(self, n: int, inline: bool = False) -> None:
        """A fetch is about to read `n` bytes into memory (n > 0: waits until they fit under the
        bound; a chunk larger than the bound waits until it is alone), or has staged them (n < 0).
        `inline`: a fetch on its open's thread, which moves to the pool rather than wait here."""
        with self._inflight_cv:
            if n > 0:
                while self._inflight_bytes and self._inflight_bytes + n > self.max_inflight_bytes:
                    if inline:
                        raise _HandOff(None)
                    if self._closed.is_set():
                        raise InterruptedError("unmounting")
                    self._inflight_cv.wait(0.5)
            self._inflight_bytes += n
            if n > 0:
                self._inflight_peak = max(self._inflight_peak, self._inflight_bytes)
            else:
                self._inflight_cv.notify_all()

    def fetches_running(self) -> int:
        with self._active_lock:
            return self._active

    # -- the open path -----------------------------------------------------------------------

    def resolve(self, entry: FileEntry, cancelled: Callable[[], bool] | None = None) -> LocalItem:
        """Return a LocalItem for `entry`, fetching it (once per node) if it is not cached.

        Raises RemoteFetchError / RemoteUnavailable (OSErrors with errno EIO) if the remote
        fails; nothing partial is ever admitted, because only a complete, checksummed file is
        renamed into the cache. A miss waits in slices: it raises InterruptedError (EINTR) as
        soon as `cancelled()` (the FUSE request was interrupted, e.g. its reader was killed), and
        RemoteFetchError once its fetch - or, while it is queued, every fetch of this mount - has
        made no progress for the open deadline while this process ran (see _stalled; time it
        was stopped does not count: pause_log.py). The fetch itself goes on.
        """
        t0 = time.perf_counter()
        hit = self.resolve_cached(entry, t0)
        if hit is not None:
            return hit
        key = self._key(entry)
        try:
            item = self._miss(entry, key, cancelled)
        except OSError:
            self.accounting.open_failed()
            raise
        self.accounting.open_finished(time.perf_counter() - t0, hit=item.hit)
        return item

    def resolve_cached(self, entry: FileEntry, t0: float | None = None, read_whole: bool = False) -> LocalItem | None:
        """The hit path alone (never waits for the remote or another open): a LocalItem of the
        cached `entry`, accounted as a hit, or None when it is not cached. `read_whole`: also
        account the whole item as read (for opens whose reads the kernel serves itself)."""
        if t0 is None:
            t0 = time.perf_counter()
        key = self._key(entry)
        fd = self.cache.open_cached(key)
        if fd is not None and self.cache.verify_pending and not self._check(entry, key, fd):
            fd = None
        if fd is None:
            return None
        self.accounting.hit_opened(entry.index, time.perf_counter() - t0, entry.size if read_whole else 0)
        return LocalItem(fd, entry, True)

    def resolve_held(self, entry: FileEntry, fd: int, read_whole: bool = False) -> LocalItem | None:
        """resolve_cached for a descriptor of the cached item the caller kept from an earlier
        open (`fd` stays the caller's): None when the item has been evicted since."""
        t0 = time.perf_counter()
        if not self.cache.still_cached(self._key(entry), fd):
            return None
        self.accounting.hit_opened(entry.index, time.perf_counter() - t0, entry.size if read_whole else 0)
        return LocalItem(fd, entry, True)

    def _key(self, entry: FileEntry) -> str:
        key = self._keys.get(entry.path)
        if key is None:
            key = self._keys[entry.path] = item_key(entry.path)
        return key

    def _check(self, entry: FileEntry, key: str, fd: int) -> bool:
        byte, mask = entry.index >> 3, 1 << (entry.index & 7)
        if self._verified[byte] & mask:
            return True
        if self.cache.verify_item(key, fd):
            self._verified[byte] |= mask
            return True
        os.close(fd)
        return False

    def _miss(self, entry: FileEntry, key: str, cancelled: Callable[[], bool] | None = None) -> LocalItem:
        self.breaker.check()  # fail at once while the remote is known to be down
        flight, leader = self.flights.join(key)
        if leader:
            result: list[_LeaderResult] = []
            try:
                if not self._lead_here(flight, entry, key, result, cancelled):
                    self._pool.submit(self._lead, flight, entry, key, result)
            except RuntimeError as exc:  # the pool is shut down: we are unmounting
                self.flights.finish(flight, error=InterruptedError(str(exc)))
            if not self._wait(flight, entry, True, cancelled, result):
                item = self._streamed(flight, entry, True)
                if item is not None:
                    return item
            if flight.error is not None:
                raise flight.error
            r = result[0]
            if r.source == "cache":
                self.accounting.item_opened(entry.index, hit=True)
                return LocalItem(r.fd, entry, hit=True)
            shared = r.source == "transient"
            self.accounting.item_opened(entry.index, hit=False, shared_fetch=shared,
                                        admitted_size=entry.size if r.admitted else 0)
            return LocalItem(r.fd, entry, hit=False)
        if not self._wait(flight, entry, False, cancelled):
            item = self._streamed(flight, entry, False)
            if item is not None:
                return item
        if flight.error is not None:
            raise flight.error
        if flight.admitted:
            fd = self.cache.open_cached(key)
            if fd is not None:
                self.accounting.item_opened(entry.index, hit=True)
                return LocalItem(fd, entry, hit=True)
            return self._miss(entry, key, cancelled)  # evicted in between (a shrink): try again
        self.accounting.item_opened(entry.index, hit=False, shared_fetch=True)
        return LocalItem(flight.fds.pop(), entry, hit=False)

    def _lead_here(self, flight: Flight, entry: FileEntry, key: str, result: list[_LeaderResult],
                   cancelled: Callable[[], bool] | None) -> bool:
        """Lead `flight` on this thread, the open's own, when a fast fetch slot is free and no
        fetch queues for one (FetchLanes.run_here; a small item of an HTTP(S) source): a miss
        then costs no hand-over to a pool thread and back, which profiled as most of a small
        miss's CPU (futex wake-ups and GIL hand-overs). False when it did not run here (the
        caller submits it to the pool).

        The open must still give up at once when its request is interrupted, and with EIO when
        the fetch stalls: the fetch's waits (for bytes, a connection, a peer's lock) call a
        check every slice, which then hands the fetch to the pool (it starts again there, for
        the opens that wait for it) and raises the open's error here. A fetch that would wait
        for tokens or for room under the in-flight bound moves to the pool too, and this open
        waits for it as for any pool fetch."""
        # Streamed opens return at the first bytes; S3 and files wait elsewhere. With streaming
        # off, items past the default threshold still go to the pool: they are not "small".
        small_below = self.stream_min_bytes if self.stream_min_bytes is not None else DEFAULT_STREAM_MIN_BYTES
        if entry.size >= small_below or self.store.protocol not in ("http", "https"):
            return False
        handed: list[_HandOff] = []

        def check(due: float) -> None:
            self._pauses.woke(due, time.monotonic())  # as the waits of _wait do
            if cancelled is not None and cancelled():
                raise _HandOff(InterruptedError(errno.EINTR, f"open of {entry.path!r} interrupted"))
            if self._stalled(flight):
                error = RemoteFetchError(errno.EIO, f"remote store {self.store.url} delivered nothing for "
                                         f"{self._stall_limit():.1f} s while {entry.path!r} waited for it")
                log.warning("%s", error)
                raise _HandOff(error)

        def lead(lane: Lane) -> None:
            flight.check = check
            try:
                with blocking_http.interruptible(check):
                    self._lead(lane, flight, entry, key, result)
            except _HandOff as exc:
                handed.append(exc)
            finally:
                flight.check = None

        if not self._pool.run_here(lead):
            return False
        if handed:
            flight.started = False  # queued again: judged as a queued fetch until it runs
            self._pool.submit(self._lead, flight, entry, key, result)
            error = handed[0].error
            if error is not None:
                if self.flights.leave(flight, True) and result:
                    os.close(result[0].fd)  # finished just now: nobody takes it
                raise error
        return True

    def _streamed(self, flight: Flight, entry: FileEntry, leader: bool) -> LocalItem | None:
        """The open reads `flight`'s item while it is fetched; None when the flight has ended
        meanwhile (the caller then takes its outcome, `flight.done` set)."""
        stream: InFlightItem = flight.stream
        if not stream.acquire():  # the fetch ended and its readers are gone already
            flight.done.wait()
            return None
        if not self.flights.detach(flight, leader):
            stream.release()
            return None
        self.accounting.item_opened(entry.index, hit=False, shared_fetch=not leader)
        return LocalItem(-1, entry, False, stream)

    def _wait(self, flight: Flight, entry: FileEntry, leader: bool, cancelled: Callable[[], bool] | None,
              result: list[_LeaderResult] | None = None) -> bool:
        """Wait for `flight` in slices; leave it (InterruptedError / RemoteFetchError) when the
        request is cancelled or the fetch stalls. Returns True once the flight is done, False
        once its item can be read while it is fetched (flight.stream)."""
        seen = time.monotonic()
        while not flight.ready.wait(WAIT_SLICE_S):
            # From one look to the next should take a slice; much longer, and this process was
            # not running (stopped, frozen, starved): the stall clock must not count that span.
            now = time.monotonic()
            self._pauses.woke(seen + WAIT_SLICE_S, now)
            seen = now
            if cancelled is not None and cancelled():
                error: OSError = InterruptedError(errno.EINTR, f"open of {entry.path!r} interrupted")
            elif self._stalled(flight):
                error = RemoteFetchError(errno.EIO, f"remote store {self.store.url} delivered nothing for "
                                         f"{self._stall_limit():.1f} s while {entry.path!r} waited for it")
                log.warning("%s", error)
            else:
                continue
            if self.flights.leave(flight, leader) and leader and result:
                os.close(result[0].fd)  # finished just now: nobody takes it
            raise error
        return flight.done.is_set()

    def _stall_limit(self) -> float:
        policy = self.store.policy
        # The leader gives up after the deadline on its own; the waiting open a little later, so
        # that normally the leader's own error (the remote's) is the one reported.
        return policy.deadline_s + policy.client_timeout_s + 1.0

    def _stalled(self, flight: Flight) -> bool:
        # Read in the reverse order of the leader's writes (it stamps `progress` before it sets
        # `started` or clears a wait's mark): a cleared mark is then never seen with the stamp
        # from before the wait.
        if flight.waiting_peer or flight.throttled:
            # Another process fetches it, or it waits for the job's own tokens: slow by decision
            # (a rate the data manager set, 0 included), not the remote's stall. Such a wait still
            # ends at once on an interrupt.
            return False
        if flight.started:
            since = flight.progress
        elif self._throttled_fetches:
            return False
        else:
            # Queued behind other fetches: a stall only if none of this mount's fetches progresses.
            since = max(flight.created, self._last_progress)
        now = time.monotonic()
        # Only the time this process ran since then: the remote cannot be blamed for a span in
        # which nothing here could read what it sent.
        return now - since - self._pauses.paused(since, now) > self._stall_limit()

    def _progressed(self, flight: Flight) -> None:
        flight.progress = self._last_progress = time.monotonic()

    # -- the flight leader (fetch pool) ------------------------------------------------------

    def _lead(self, lane: Lane, flight: Flight, entry: FileEntry, key: str, result: list[_LeaderResult]) -> None:
        flight.lane = lane
        with self._active_lock:
            self._active += 1
        # Its own clock starts (the mount's does not: no data yet), before it is marked started:
        # a waiter must never see it started with no stamp (0.0, a stall since boot).
        flight.progress = time.monotonic()
        flight.started = True
        try:
            self._lead_flight(flight, entry, key, result)
        finally:
            with self._active_lock:
                self._active -= 1

    def _lead_flight(self, flight: Flight, entry: FileEntry, key: str, result: list[_LeaderResult]) -> None:
        locks = self.cache.locks
        try:
            if not locks.try_acquire(key):
                # Another process fetches this item: wait for it, marked, so that it keeps a
                # copy for us even if the cache has no room for it.
                locks.mark_waiting(key)
                flight.waiting_peer = True
                between = self._peer_check(entry, key)
                if flight.check is not None:  # on its open's thread: the open may give up
                    peer_check, check = between, flight.check

                    def between() -> None:
                        check(time.monotonic())
                        peer_check()
                try:
                    locks.acquire(key, between)
                finally:
                    # Stamped before the mark is cleared: the peer's fetch may have taken longer
                    # than the stall limit, and a waiter that saw the mark gone with the stamp from
                    # before it would fail the open just as its item arrives.
                    flight.progress = time.monotonic()
                    flight.waiting_peer = False
                    locks.unmark_waiting(key)
            try:
                r = self._lead_locked(entry, key, flight)
            finally:
                locks.release(key)
        except _HandOff:
            raise  # the flight goes on in the pool (_lead_here)
        except BaseException as exc:
            self.flights.finish(flight, error=exc)
            return
        result.append(r)
        if self.flights.finish(flight, admitted=r.source == "cache" or r.admitted, fd=r.fd):
            os.close(r.fd)  # the open that led this flight gave up or reads the stream: nobody's
            if flight.leader_streamed and r.admitted:  # this job's own fetch, admitted at its end
                self.accounting.fetch_admitted(entry.size)

    def _peer_check(self, entry: FileEntry, key: str) -> Callable[[], None]:
        """What a leader does between its tries for the lock of an item another process fetches:
        give up at unmount, and with EIO once that process has been frozen (every thread stopped,
        its staging file unchanged: peer_watch.py) for the open's stall limit. A slow peer - a low
        rate, a long token wait, a slow remote - is waited out: its own bounds end its fetch."""
        locks = self.cache.locks
        watch = PeerWatch(self.cache.staging_dir, locks.path, key, locks.fetch_byte(key))
        limit = self._stall_limit()

        def between() -> None:
            if self._closed.is_set():
                raise InterruptedError(errno.EINTR, "unmounting")
            frozen = watch.frozen_for()
            if frozen >= limit:
                holder = watch.holder
                error = RemoteFetchError(errno.EIO, f"process {holder.pid if holder else '?'} fetching {entry.path!r} "
                                         f"for this node is stopped and has made no progress for {frozen:.1f} s; "
                                         f"the open fails; the next open tries again")
                log.warning("%s", error)
                raise error

        return between

    def _lead_locked(self, entry: FileEntry, key: str, flight: Flight | None = None) -> _LeaderResult:
        fd = self.cache.open_cached(key)
        if fd is not None:  # another process fetched and admitted it while we waited
            return _LeaderResult(fd, "cache")
        fd = self.cache.take_transient(key)
        if fd is not None:  # another process fetched it while we waited; not admitted
            return _LeaderResult(fd, "transient")
        self.breaker.check()
        return self._fetch(entry, key, flight)

    def _fetch(self, entry: FileEntry, key: str, flight: Flight | None = None) -> _LeaderResult:
        try:
            fd, staging = self.cache.new_staging_file(key)
        except OSError as exc:  # a full or failing cache disk: stage in memory instead
            self.memory_staging.disk_failed(f"{self.cache.root}: creating a staging file", exc)
            fd, staging = self.memory_staging.take(entry.size, entry.path), None
        target = [fd, staging]  # where the bytes go: the staging file, or a memfd once the disk refused
        errors: list[Exception] = []
        # Published at the first staged bytes of a large item, for opens to read while it is fetched.
        streaming = flight is not None and self.stream_min_bytes is not None and entry.size >= self.stream_min_bytes
        stream: list[InFlightItem] = []

        def on_error(exc: Exception) -> None:
            errors.append(exc)
            self.accounting.remote_error()

        def to_memory(exc: OSError, offset: int) -> None:
            """Move the `offset` bytes staged so far from the refusing disk to memory."""
            self.memory_staging.disk_failed(f"{self.cache.root}: writing a staging file", exc)
            mem = self.memory_staging.take(entry.size, entry.path)
            try:
                done = 0
                while done < offset:
                    data = os.pread(target[0], min(1 << 20, offset - done), done)
                    if not data:
                        raise OSError(errno.EIO, "the staged bytes could not be read back")
                    os.pwrite(mem, data, done)
                    done += len(data)
            except BaseException:
                os.close(mem)
                self.memory_staging.give_back(entry.size)
                raise
            os.close(target[0])  # readers of the stream keep their own descriptor of it
            with contextlib.suppress(OSError):
                target[1].unlink()
            target[0], target[1] = mem, None
            if stream:
                stream[0].moved(mem)

        def write(data: bytes, offset: int) -> None:
            view = memoryview(data)
            while view:
                try:
                    n = os.pwrite(target[0], view[:STAGING_WRITE_BYTES], offset)
                except OSError as exc:
                    if target[1] is None:
                        raise
                    to_memory(exc, offset)
                    continue
                view, offset = view[n:], offset + n
            if stream:
                stream[0].staged_to(offset)
            elif streaming and offset:
                stream.append(InFlightItem(entry.path, entry.size, target[0]))
                stream[0].staged_to(offset)
                flight.stream = stream[0]
                flight.ready.set()

        def reset() -> None:
            if not stream:
                os.ftruncate(target[0], 0)
                return
            # Readers may be sending bytes of the old version from this file right now: it is
            # left as it is and the new version goes to a fresh one (inflight_item.py).
            old_fd, old_staging = target
            if old_staging is not None:
                try:
                    target[0], target[1] = self.cache.new_staging_file(key)
                except OSError as exc:
                    self.memory_staging.disk_failed(f"{self.cache.root}: creating a staging file", exc)
                    target[0], target[1] = self.memory_staging.take(entry.size, entry.path), None
            else:
                target[0] = self.memory_staging.take(entry.size, entry.path)
            os.close(old_fd)
            if old_staging is None:
                self.memory_staging.give_back(entry.size)
            else:
                with contextlib.suppress(OSError):
                    old_staging.unlink()
            if not stream[0].restarted(target[0]):  # readers had bytes of the old version
                self.changed_while_read.add(entry.path)
                stream[0] = InFlightItem(entry.path, entry.size, target[0])
                flight.stream = stream[0]

        try:
            r = self._fetch_into(entry, key, flight, target, errors, on_error, write, reset)
        except BaseException as exc:
            if stream:
                if isinstance(exc, TokenWaitExpired):  # the open's EAGAIN: say why its readers get EIO
                    log.warning("%s: the fetch of this streamed item stopped on the job's token wait (%s); its readers "
                                "get EIO, not EAGAIN (a read(2) caller takes EAGAIN for no data: a sample cut short); "
                                "opened again once the job has a rate, it is fetched again", entry.path, exc)
                stream[0].finish(exc)
            raise
        if stream:
            stream[0].finish()
        return r

    def _fetch_into(self, entry: FileEntry, key: str, flight: Flight | None, target: list, errors: list,
                    on_error: Callable, write: Callable, reset: Callable) -> _LeaderResult:
        """_fetch's fetch, publication and clean-up, writing through its `write` and `reset`."""
        try:
            try:
                if flight is None:
                    throttle, on_bytes, lane = self.throttle, self.accounting.bytes_fetched, None
                    on_progress = None
                else:
                    throttle = _FlightThrottle(self, flight)
                    lane = flight.lane

                    def on_bytes(n: int) -> None:
                        self.accounting.bytes_fetched(n)

                    def on_progress() -> None:  # every piece that arrives (any thread)
                        self._progressed(flight)

                inline = flight is not None and flight.check is not None
                kw: dict = {"on_buffer": (lambda n: self._buffered(n, True)) if inline else self._buffered}
                if on_progress is not None:
                    kw["on_progress"] = on_progress
                bound = self.max_inflight_bytes  # no chunk is larger than the in-flight bound
                cap = lane.chunk_cap if lane is not None else (lambda: 4 * 1024 * 1024)
                kw["chunk_cap"] = lambda: min(cap(), bound)
                crc = self.store.fetch(entry, write, throttle, on_bytes, reset, on_error=on_error, **kw)
            except RemoteFetchError as exc:
                if errors:  # the remote failed (not just "no such object"): count it against it
                    self._remote_failed(entry, exc)
                raise
            self.breaker.record_success()
            fd, staging = target
            if staging is None:  # in memory: served, never admitted
                self.memory_staging.give_back(entry.size)
                return _LeaderResult(fd, "remote", False)
            try:
                admitted = self.cache.publish(key, staging, entry.size, crc)  # removes the staging name
            except (OSError, sqlite3.Error) as exc:  # the disk refused the index or the link: serve it anyway
                self.memory_staging.disk_failed(f"{self.cache.root}: publishing {entry.path!r}", exc
                                                if isinstance(exc, OSError) else OSError(errno.EIO, str(exc)))
                admitted = False
            if admitted:
                self._mark_verified(entry)
            else:
                if self.cache.locks.others_waiting(key):
                    with contextlib.suppress(OSError):
                        self.cache.keep_transient(key, staging)
                staging.unlink(missing_ok=True)  # our fd keeps the data alive for this open
            return _LeaderResult(fd, "remote", admitted)
        except BaseException:
            fd, staging = target
            os.close(fd)
            if staging is None:
                self.memory_staging.give_back(entry.size)
            else:
                with contextlib.suppress(FileNotFoundError):
                    staging.unlink()
            raise

    def _mark_verified(self, entry: FileEntry) -> None:
        self._verified[entry.index >> 3] |= 1 << (entry.index & 7)

    # -- circuit breaker ---------------------------------------------------------------------

    def _remote_failed(self, entry: FileEntry, exc: Exception) -> None:
        if self.breaker.record_failure(str(exc), time.monotonic()):
            log.error("remote %s failed %d opens in a row (last error: %s); circuit breaker open: opens of "
                      "uncached items fail with EIO at once, cached items are still served; probing every %.1f s",
                      self.store.url, self.breaker.threshold, exc, self.breaker.probe_interval_s)
            self._prober = threading.Thread(target=self._probe_until_up, args=(entry,), name="silod-probe", daemon=True)
            self._prober.start()

    def _probe_until_up(self, entry: FileEntry) -> None:
        while not self._closed.wait(self.breaker.probe_interval_s):
            try:
                self.store.probe(entry)
            except Exception as exc:
                self.accounting.remote_error()
                log.debug("probe of %s failed: %s", self.store.url, exc)
                continue
            if self.breaker.close():
                log.warning("remote %s answers again; circuit breaker closed, fetches resume", self.store.url)
            return


class _FlightThrottle:
    """The job's throttle as one flight's fetch sees it: its token waits are marked on the
    flight, so the opens waiting for it do not take them for a stalled remote."""

    def __init__(self, resolver: ItemResolver, flight: Flight) -> None:
        self._resolver = resolver
        self._flight = flight

    @property
    def rate(self) -> float:
        return self._resolver.throttle.rate

    def acquire(self, nbytes: int) -> None:
        r, f = self._resolver, self._flight
        if f.check is not None:  # on its open's thread: never waits for tokens there
            if r.throttle.try_acquire(nbytes):
                return
            raise _HandOff(None)
        with r._active_lock:
            r._throttled_fetches += 1
        f.throttled += 1
        t0 = time.monotonic()
        try:
            r.throttle.acquire(nbytes)
        finally:
            # The wait for our own tokens is not the remote's stall (as in RemoteStore.fetch);
            # a grant is not progress of the remote either. Shifted before the mark is cleared:
            # a gap between grants can be longer than the stall limit (a low rate), and a waiter
            # that saw the mark gone with the stamp from before the wait failed the open with EIO
            # (test_fuse_peer_freeze.py, the stopped peer's own read, whose wake-up at SIGCONT
            # lined up with the grant's).
            f.progress += time.monotonic() - t0
            f.throttled -= 1
            with r._active_lock:
                r._throttled_fetches -= 1


__all__ = ["ItemResolver", "LocalItem", "RemoteUnavailable"]
