"""The file system's operations, independent of how they reach the kernel.

One implementation of what the mount does - names and attributes from the listing, opening an
item through the ItemResolver (cache look-up, admission, token bucket, breaker), per-job
accounting of what is read - shared by both FUSE front ends:

- fs.py adapts it to mfusepy/libfuse (every kernel with FUSE);
- rawfuse/ serves it over /dev/fuse directly, and can hand a cached item's file to the kernel
  (FUSE passthrough, Linux >= 6.9) so its reads never reach this process.

Errors are OSErrors with an errno; each front end turns them into its own error replies.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, NamedTuple

from fuse_client.dataplane import ItemResolver, LocalItem
from fuse_client.pod_attribution import PodAttribution
from fuse_client.remote import DatasetListing, FileEntry

# The dataset is immutable while mounted: the kernel may keep names and attributes for an hour.
METADATA_TIMEOUT_S = 3600.0


class OpenMode(Enum):
    """How the kernel serves the reads of one open file."""

    DAEMON = "daemon"  # every read reaches this process (misses; --no-kernel-cache)
    KERNEL_CACHE = "kernel_cache"  # page cache kept across opens (hits); a cold page still reaches us
    PASSTHROUGH = "passthrough"  # the kernel reads the local file itself (raw backend only)
    # A miss opened while it is fetched: every read reaches this process and waits until the
    # staged bytes cover it (inflight_item.py). Direct I/O on the raw backend (see rawfuse/).
    STREAMING = "streaming"


@dataclass(frozen=True)
class NodeAttr:
    is_dir: bool
    size: int


@dataclass(frozen=True)
class FsStats:
    total_bytes: int
    files: int


class OpenFile(NamedTuple):
    fh: int
    item: LocalItem
    mode: OpenMode
    pod: str = ""  # uid of the pod whose process opened it ("" outside any pod, or not counted)
    borrowed: bool = False  # item.fd belongs to the front end (open_held), not to this handle

    @property
    def count_reads(self) -> bool:
        # Kept and passthrough opens were accounted in full at open (see DatasetOperations.open).
        return self.mode is OpenMode.DAEMON or self.mode is OpenMode.STREAMING


@dataclass
class FrontendCounters:
    """What the kernel asked of this process; the stats file reports it (tests read it too)."""

    read_requests: int = 0
    passthrough_opens: int = 0
    kernel_cache_opens: int = 0
    daemon_opens: int = 0
    streaming_opens: int = 0


class DatasetOperations:
    """Read-only operations on one mounted dataset (one job)."""

    def __init__(self, listing: DatasetListing, resolver: ItemResolver, kernel_cache: bool = True,
                 attribution: PodAttribution | None = None) -> None:
        self.listing = listing
        # With an attribution (the node agent's mounts), bytes and hits are also counted per pod
        # of the opening process (its cgroup, which the pod cannot choose).
        self.attribution = attribution
        self.resolver = resolver
        self.accounting = resolver.accounting
        self.kernel_cache = kernel_cache
        self.mtime_ns = time.time_ns()
        self.counters = FrontendCounters()
        self._handles: dict[int, OpenFile] = {}
        # Daemon-served misses not yet delivered whole: fh -> [open request time, bytes served].
        self._serving: dict[int, list] = {}
        self._next_fh = itertools.count(1)
        self._lock = threading.Lock()

    # -- metadata ----------------------------------------------------------------------------

    def attr(self, rel: str) -> NodeAttr:
        entry = self.listing.files.get(rel)
        if entry is not None:
            return NodeAttr(False, entry.size)
        if rel in self.listing.dirs:
            return NodeAttr(True, 0)
        raise FileNotFoundError(errno.ENOENT, "no such item", rel)

    def list_dir(self, rel: str) -> list[str]:
        children = self.listing.dirs.get(rel)
        if children is None:
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", rel)
        return children

    def statfs(self) -> FsStats:
        return FsStats(self.listing.total_bytes, len(self.listing.files))

    def entry(self, rel: str) -> FileEntry:
        entry = self.listing.files.get(rel)
        if entry is None:
            if rel in self.listing.dirs:
                raise IsADirectoryError(errno.EISDIR, "is a directory", rel)
            raise FileNotFoundError(errno.ENOENT, "no such item", rel)
        return entry

    # -- data --------------------------------------------------------------------------------

    @staticmethod
    def check_flags(flags: int) -> None:
        if (flags & os.O_ACCMODE) != os.O_RDONLY:
            raise OSError(errno.EROFS, "read-only file system")

    def open(self, entry: FileEntry, passthrough: bool = False, pid: int = 0,
             cancelled: Callable[[], bool] | None = None, received: float | None = None) -> OpenFile:
        """Resolve `entry` (hit, shared fetch or remote fetch; may block on the remote).

        `passthrough`: the caller can hand a cached item's descriptor to the kernel. `pid`: the
        opening process (from the FUSE request), for per-pod accounting. `cancelled`: polled
        while waiting for the remote; True (the FUSE request was interrupted) ends the wait with
        EINTR. Raises RemoteFetchError / RemoteUnavailable (OSError EIO) when the remote fails
        or stalls past the open deadline. `received`: time.perf_counter() when the front end took
        the open request (a queued miss counts its wait for the open pool); default now.

        A miss's service time (accounting.miss_served) ends here when the kernel reads the item
        itself (passthrough, whole local file by now), else at its last byte read (read_span).
        """
        t0 = time.perf_counter() if received is None else received
        handle = self._register(self.resolver.resolve(entry, cancelled), passthrough, pod=self._pod(pid))
        if not handle.item.hit:
            if handle.count_reads and handle.item.entry.size > 0:
                with self._lock:
                    self._serving[handle.fh] = [t0, 0, handle.pod]
            else:
                self.accounting.miss_served(time.perf_counter() - t0, handle.item.entry.size, handle.pod)
        return handle

    @property
    def hits_may_block(self) -> bool:
        """True while cached items are checksummed on their first hit (after a crash): a hit may
        then read a whole item before it is served, so callers keep it off threads that must not
        block."""
        return self.resolver.cache.verify_pending

    def open_if_cached(self, entry: FileEntry, passthrough: bool = False, pid: int = 0) -> OpenFile | None:
        """The hit path alone: never waits for the remote; None when `entry` is not cached."""
        whole = passthrough or self.kernel_cache  # a hit is then read by the kernel: account it now
        item = self.resolver.resolve_cached(entry, read_whole=whole)
        return None if item is None else self._register(item, passthrough, accounted=whole, pod=self._pod(pid))

    def open_held(self, entry: FileEntry, fd: int, pid: int = 0) -> OpenFile | None:
        """A passthrough hit on `fd`, a descriptor of the cached item the front end kept from an
        earlier open (and keeps: release does not close it); None when the item was evicted
        since. Accounted like open_if_cached(passthrough=True)."""
        item = self.resolver.resolve_held(entry, fd, read_whole=True)
        return None if item is None else self._register(item, True, accounted=True, pod=self._pod(pid), borrowed=True)

    def _pod(self, pid: int) -> str:
        return self.attribution.pod_of(pid) if self.attribution is not None and pid > 0 else ""

    def _register(self, item: LocalItem, passthrough: bool, accounted: bool = False, pod: str = "",
                  borrowed: bool = False) -> OpenFile:
        if item.stream is not None:
            mode = OpenMode.STREAMING
        elif passthrough:
            # Misses too, but for streaming ones (above; direct I/O on the raw backend, which
            # the kernel allows beside passthrough opens): their descriptor is a complete local
            # file by now (fetched whole at open). Besides saving the reads, this is required: the kernel refuses (EIO) a
            # non-passthrough open of an inode another process holds open in passthrough mode.
            mode = OpenMode.PASSTHROUGH
        elif item.hit and self.kernel_cache:
            mode = OpenMode.KERNEL_CACHE
            if item.entry.path in self.resolver.changed_while_read:
                # Readers got bytes of the version the remote replaced: the page cache may hold
                # them. This one open drops it (no keep-cache); the opens after it keep the new pages.
                self.resolver.changed_while_read.discard(item.entry.path)
                mode = OpenMode.DAEMON
        else:
            # Misses are never kept by the kernel: the page cache would otherwise act as a
            # second, unaccounted cache and break the c/d hit ratio.
            mode = OpenMode.DAEMON
        whole = 0 if mode is OpenMode.DAEMON or mode is OpenMode.STREAMING else item.entry.size
        if whole and not accounted:
            # Reads the kernel serves itself never reach us, so such an open is accounted as a
            # read of the whole item when it is opened (training reads every item whole). This
            # over-counts a job that opens an item and reads only part of it.
            self.accounting.bytes_read(whole, hit=item.hit)
        if pod:
            self.accounting.pod_opened(pod, item.hit, whole)
        fh = next(self._next_fh)
        handle = OpenFile(fh, item, mode, pod, borrowed)
        self._handles[fh] = handle  # one dict store: atomic under the GIL
        c = self.counters
        if mode is OpenMode.PASSTHROUGH:
            c.passthrough_opens += 1
        elif mode is OpenMode.KERNEL_CACHE:
            c.kernel_cache_opens += 1
        elif mode is OpenMode.STREAMING:
            c.streaming_opens += 1
        else:
            c.daemon_opens += 1
        return handle

    def handle(self, fh: int) -> OpenFile:
        handle = self._handles.get(fh)
        if handle is None:
            raise OSError(errno.EBADF, "unknown file handle")
        return handle

    def read_ready(self, fh: int, size: int, offset: int) -> bool:
        """False when read_span would wait (a streaming open whose bytes are not staged yet):
        a front end whose thread must not block hands such a read to a thread that may."""
        handle = self._handles.get(fh)
        if handle is None or handle.item.stream is None:
            return True
        return handle.item.stream.ready(offset, max(0, min(size, handle.item.entry.size - offset)))

    def read_span(self, fh: int, size: int, offset: int, cancelled: Callable[[], bool] | None = None) -> tuple[int, int]:
        """(fd, n): the caller sends `n` bytes of `fd` at `offset`; the read is accounted here.
        A streaming open's read first waits until the bytes are staged (EIO if its fetch
        failed, or the object changed after bytes of it were read; EINTR when `cancelled()`)."""
        handle = self.handle(fh)
        item = handle.item
        n = max(0, min(size, item.entry.size - offset))
        fd = item.fd if item.stream is None else item.stream.span(offset, n, cancelled)
        self.counters.read_requests += 1  # one writer per request; a lost increment is harmless
        if handle.count_reads:
            self.accounting.bytes_read(n, item.hit, handle.pod)
            if not item.hit and n:
                self._served(fh, n, item.entry.size)
        return fd, n

    def _served(self, fh: int, n: int, size: int) -> None:
        """`n` more bytes of a daemon-served miss go out: once they add up to the item, its service
        time is over (the reply with the last bytes follows this call)."""
        with self._lock:
            track = self._serving.get(fh)
            if track is None:
                return
            track[1] += n
            if track[1] < size:
                return
            del self._serving[fh]
        self.accounting.miss_served(time.perf_counter() - track[0], size, track[2])

    def release(self, fh: int) -> OpenFile | None:
        handle = self._handles.pop(fh, None)  # atomic under the GIL
        if self._serving:
            with self._lock:
                self._serving.pop(fh, None)  # released before its last byte: not a whole item
        if handle is not None and not handle.borrowed:
            if handle.item.stream is not None:
                handle.item.stream.release()
            else:
                os.close(handle.item.fd)
        return handle

    def open_handles(self) -> int:
        return len(self._handles)

    def close_all(self) -> None:
        """At exit: close what the kernel never released (e.g. the server is stopping)."""
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for h in handles:
            if h.borrowed:
                continue
            if h.item.stream is not None:
                h.item.stream.release()
                continue
            try:
                os.close(h.item.fd)
            except OSError:
                pass
