"""A FUSE server over /dev/fuse in Python, serving the shared DatasetOperations.

Why it exists: libfuse 3.14 (Debian bookworm) predates FUSE passthrough (Linux 6.9, protocol
7.40), and mfusepy binds whatever libfuse is installed. Speaking the protocol ourselves lets an
OPEN of a cached item answer FOPEN_PASSTHROUGH with a backing id registered by the
FUSE_DEV_IOC_BACKING_OPEN ioctl: the kernel then reads (and mmaps) the cache file itself and no
READ of that open ever reaches this process.

Threads:
- `silod-raw-N` (a few) each read requests from their own cloned /dev/fuse fd and answer
  everything that cannot block on their own: metadata from the in-memory listing, opens of
  cached items, reads of open items (a pread of a local file), releases;
- an open that misses the cache is handed to `silod-rawopen-*` (up to --fuse-threads), which
  waits for the fetch (dataplane.py's single flight and fetch pool) and then replies; so a
  hit never waits behind a miss;
- `silod-raw-sweep` closes kept backing files of items evicted since (see _BackingFiles).

With passthrough every open is a passthrough open, misses included (a miss is fetched whole
before its open returns, so its local file is complete): the kernel refuses a page-cached open
of an inode that is open in passthrough mode elsewhere, and reads never reach us anyway. The
exception is a streaming miss (a large item opened while it is fetched, dataplane.py): its
open is direct I/O, which the kernel allows beside passthrough opens, and its reads come here;
one whose bytes are not staged yet waits on the open pool, never on a reader thread.

Inodes are static (the listing is immutable while mounted): node 1 is the root, the other
directories follow, file i of the listing is node `file_base + i`. FORGET is therefore a no-op.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from fuse_client.operations import METADATA_TIMEOUT_S, DatasetOperations, OpenFile, OpenMode
from fuse_client.rawfuse import device
from fuse_client.rawfuse import protocol as p
from fuse_client.remote import FileEntry

log = logging.getLogger(__name__)

# Reader threads: every request of a cached open is a few microseconds of Python, so more threads
# only contend for the GIL (measured on 2 cores: 1 thread 12k opens/s, 2 threads 9.8k, 4 threads
# 6k); anything that can block (a miss) leaves the reader thread for the open pool.
DEFAULT_READERS = int(os.environ.get("SILOD_RAW_READERS", "1"))
# The reader thread is the one serial stage between all of a job's data-loader processes and
# their files; on a busy node it should not queue behind them for a CPU. Negative = higher
# priority (root only; ignored otherwise).
NICE = int(os.environ.get("SILOD_RAW_NICE", "-10"))
_TIMEOUT_S = int(METADATA_TIMEOUT_S)
_OPEN_REPLY = p.OPEN_REPLY.pack
_OUT_HEADER = p.OUT_HEADER.pack
_RELEASE_IN = p.RELEASE_IN.unpack_from
BLKSIZE = 128 * 1024  # st_blksize: buffered readers read in chunks of this size
# Cached items whose backing file is kept between opens (see _BackingFiles): each costs one
# descriptor here and one open file in the kernel (~1 KiB with its pinned inode).
KEEP_BACKING = int(os.environ.get("SILOD_RAW_KEEP_BACKING", "65536"))
FD_MARGIN = 4096  # descriptors left for open handles, fetches, sockets
SWEEP_S = 2.0  # kept descriptors of evicted items are closed within this time


class RawFuseError(RuntimeError):
    pass


@dataclass
class Negotiated:
    kernel_minor: int
    kernel_flags: int
    flags: int
    max_stack_depth: int

    @property
    def passthrough(self) -> bool:
        return bool(self.flags & p.PASSTHROUGH)


@dataclass
class RawCounters:
    """Requests by opcode name, for the stats file and the tests."""

    requests: dict[int, int] = field(default_factory=dict)  # by opcode
    interrupted_opens: int = 0
    backing_open_failures: int = 0
    kept_opens: int = 0  # opens answered with a kept backing file (no open(2), no ioctl)
    closed_at_eviction: int = 0  # kept backing files closed when this mount evicted their item


class _Inodes:
    """Node ids over the listing's columns: 1 is the root, then the other directories in sorted
    order, then the items by index (nothing per item is kept here)."""

    def __init__(self, ops: DatasetOperations) -> None:
        listing = ops.listing
        self.file_base = 1 + listing.num_dirs  # the directories are 1.. (the root, '', sorts first)
        self.num_files = len(listing)
        self.listing = listing

    def file(self, nodeid: int) -> FileEntry | None:
        i = nodeid - self.file_base
        return self.listing.entry(i) if 0 <= i < self.num_files else None

    def dir_path(self, nodeid: int) -> str | None:
        return self.listing.dir_path(nodeid - 1) if 1 <= nodeid < self.file_base else None

    def child(self, parent: str, name: str) -> tuple[int, FileEntry | None] | None:
        rel = f"{parent}/{name}" if parent else name
        listing = self.listing
        i = listing.find(rel)
        if i >= 0:
            return self.file_base + i, listing.entry(i)
        d = listing.dir_index(rel)
        if d >= 0:
            return d + 1, None
        return None


@dataclass
class _Backing:
    backing_id: int
    fd: int  # our own descriptor of the cached item kept for re-opens, or -1 (not kept)
    opens: int = 1
    evicted: bool = False  # this mount evicted the item: close the kept descriptor at the last release


class _BackingFiles:
    """Backing ids per inode, kept across opens of cached items.

    The kernel binds an inode to one backing file for as long as passthrough opens of it are
    open (a second, different backing id for the same inode is refused with EBUSY), and looks
    the id up after our OPEN reply is written; so an id lives at least from the first open of an
    inode to its last RELEASE.

    A cached item's id also outlives its last release, with a descriptor of the item that this
    process keeps (up to `keep` idle ones, least recently used dropped first): a data loader
    re-opens the same items every epoch, and a re-open then costs one fstat (is the item still
    cached?) instead of open(2) + two ioctls + close(2), which were half of the reader thread's
    time per cached file. An item evicted meanwhile (its link count drops to 0) is re-opened
    from the cache; `sweep` closes kept descriptors of evicted items so their disk space is
    freed within SWEEP_S."""

    def __init__(self, dev_fd: int, keep: int = 0) -> None:
        self.dev_fd = dev_fd
        self.keep = keep
        self._slots: dict[int, _Backing] = {}  # nodeid -> backing
        self._idle: OrderedDict[int, None] = OrderedDict()  # kept slots without opens, oldest first
        self._lock = threading.Lock()

    def take_kept(self, nodeid: int) -> _Backing | None:
        """The kept backing of `nodeid`, now counted as open; None if there is none."""
        with self._lock:
            slot = self._slots.get(nodeid)
            if slot is None or slot.fd < 0:
                return None
            slot.opens += 1
            self._idle.pop(nodeid, None)
            return slot

    def acquire(self, nodeid: int, fd: int, keep: bool) -> int:
        """The backing id for an open of `nodeid` whose item is open as `fd` (the caller's);
        `keep`: `fd` is a cached item's, worth keeping for re-opens."""
        with self._lock:
            slot = self._slots.get(nodeid)
            if slot is not None:
                slot.opens += 1
                self._idle.pop(nodeid, None)
                return slot.backing_id
            backing_id = device.backing_open(self.dev_fd, fd)
            self._slots[nodeid] = _Backing(backing_id, os.dup(fd) if keep and self.keep else -1)
            return backing_id

    def release(self, nodeid: int, evicted: bool = False) -> None:
        """One open of `nodeid` ended; `evicted`: its kept item is known to be gone."""
        drop: list[_Backing] = []
        with self._lock:
            slot = self._slots.get(nodeid)
            if slot is None:
                return
            slot.opens -= 1
            if slot.opens > 0:
                return
            if slot.fd >= 0 and not evicted and not slot.evicted:
                self._idle[nodeid] = None
                while len(self._idle) > self.keep:
                    drop.append(self._slots.pop(self._idle.popitem(last=False)[0]))
            else:
                drop.append(self._slots.pop(nodeid))
        for slot in drop:  # the ioctls outside the lock
            self._close(slot)

    def evicted(self, nodeid: int) -> bool:
        """This mount evicted the item of `nodeid`: close its kept descriptor now if no open uses
        it (its disk blocks are freed at once), else at its last release. True if closed now."""
        with self._lock:
            slot = self._slots.get(nodeid)
            if slot is None or slot.fd < 0:
                return False
            if slot.opens > 0:
                slot.evicted = True
                return False
            self._idle.pop(nodeid, None)
            del self._slots[nodeid]
        self._close(slot)
        return True

    def sweep(self) -> int:
        """Drop idle kept backings whose item was evicted; returns how many."""
        with self._lock:
            idle = [(nodeid, self._slots[nodeid]) for nodeid in self._idle]
        gone = []
        for nodeid, slot in idle:  # fstat outside the lock: opens are not held up by a sweep
            try:
                if os.fstat(slot.fd).st_nlink == 0:
                    gone.append(nodeid)
            except OSError:
                pass
        drop = []
        with self._lock:
            for nodeid in gone:
                if nodeid in self._idle:  # not re-opened meanwhile
                    del self._idle[nodeid]
                    drop.append(self._slots.pop(nodeid))
        for slot in drop:
            self._close(slot)
        return len(drop)

    def close_all(self) -> None:
        with self._lock:
            slots, self._slots = list(self._slots.values()), {}
            self._idle.clear()
        for slot in slots:
            if slot.fd >= 0:
                os.close(slot.fd)

    def _close(self, slot: _Backing) -> None:
        try:
            device.backing_close(self.dev_fd, slot.backing_id)
        except OSError as exc:
            if exc.errno != errno.ENODEV:  # unmounted: the ids are gone with the connection
                log.warning("closing backing id %d failed: %s", slot.backing_id, exc)
        if slot.fd >= 0:
            os.close(slot.fd)

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def idle(self) -> int:
        return len(self._idle)


@dataclass
class _PendingOpen:
    fd: int
    interrupted: bool = False


class RawFuseServer:
    """Mounts `ops` at `mountpoint` over /dev/fuse and serves it until unmounted."""

    def __init__(self, ops: DatasetOperations, mountpoint: Path, fsname: str, *, passthrough: bool = True,
                 allow_other: bool = False, readers: int = DEFAULT_READERS, open_threads: int = 128,
                 backing_dir: Path | None = None, keep_backing: int = KEEP_BACKING) -> None:
        self.ops = ops
        self.mountpoint = mountpoint
        self.fsname = fsname
        self.want_passthrough = passthrough
        self.allow_other = allow_other
        self.readers = max(1, readers)
        self.backing_dir = backing_dir
        self.keep_backing = keep_backing
        self.inodes = _Inodes(ops)
        self._file_base = self.inodes.file_base
        self.counters = RawCounters()
        self.negotiated: Negotiated | None = None
        self._fd = -1
        self._fds: list[int] = []
        self._threads: list[threading.Thread] = []
        self._open_pool = ThreadPoolExecutor(open_threads, thread_name_prefix="silod-rawopen")
        self._pending: dict[int, _PendingOpen] = {}
        self._pending_lock = threading.Lock()
        self._backing: _BackingFiles | None = None
        self._passthrough = False
        self._stopped = threading.Event()
        self._key_nodes: dict[str, int] | None = None
        self._mtime = ops.mtime_ns // 1_000_000_000
        self._mtime_ns = ops.mtime_ns % 1_000_000_000

    # -- mount and handshake -----------------------------------------------------------------

    def mount(self) -> Negotiated:
        """mount(2), answer INIT, check that passthrough really works; no reader thread yet.

        Raises device.RawFuseUnavailable if this process cannot mount over /dev/fuse."""
        self._fd = device.open_device()
        try:
            device.mount(self._fd, self.mountpoint, self.fsname, "silod", self.allow_other)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise
        try:
            self.negotiated = self._handshake()
            self._backing = _BackingFiles(self._fd, keep=descriptor_budget(self.keep_backing))
            self._passthrough = self.negotiated.passthrough and self._backing_works()
        except BaseException:
            self.abort()
            raise
        return self.negotiated

    @property
    def passthrough(self) -> bool:
        """True when cached items are opened in passthrough mode."""
        return self._passthrough

    def _handshake(self) -> Negotiated:
        buf = bytearray(p.REQUEST_BUFFER)
        n = os.readv(self._fd, [buf])
        length, opcode, unique, _nodeid, *_ = p.IN_HEADER.unpack_from(buf, 0)
        if opcode != p.INIT or n < p.IN_HEADER.size + 16:
            raise RawFuseError(f"expected FUSE_INIT from the kernel, got opcode {opcode}")
        major, minor, max_readahead, flags = p.INIT_IN.unpack_from(buf, p.IN_HEADER.size)[:4]
        flags2 = 0
        if flags & p.INIT_EXT and n >= p.IN_HEADER.size + p.INIT_IN.size:
            flags2 = p.INIT_IN.unpack_from(buf, p.IN_HEADER.size)[4]
        offered = flags | (flags2 << 32)
        if major != p.KERNEL_MAJOR or minor < p.MIN_KERNEL_MINOR:
            self._reply_error(self._fd, unique, errno.EPROTO)
            raise RawFuseError(f"kernel FUSE protocol {major}.{minor} is older than 7.{p.MIN_KERNEL_MINOR}; "
                               "use --fuse-backend libfuse")
        want = p.ASYNC_READ | p.MAX_PAGES | p.DO_READDIRPLUS | p.PARALLEL_DIROPS | p.INIT_EXT
        depth = 0
        if self.want_passthrough:
            want |= p.PASSTHROUGH | p.DIRECT_IO_ALLOW_MMAP  # streaming misses are direct I/O then
            depth = device.stack_depth_for(self.backing_dir or Path("/"))
        agreed = want & offered
        if not agreed & p.PASSTHROUGH:
            depth = 0
        reply = p.INIT_OUT.pack(p.KERNEL_MAJOR, min(minor, p.OUR_MINOR), max_readahead, agreed & 0xFFFFFFFF,
                                64, 48, p.MAX_WRITE, 1, p.MAX_PAGES_GRANTED, 0, agreed >> 32, depth)
        self._reply(self._fd, unique, reply)
        return Negotiated(minor, offered, agreed, depth)

    def _backing_works(self) -> bool:
        """Register and drop one backing file in the cache directory: proves the ioctl is allowed
        (CAP_SYS_ADMIN) and the cache's file system is not stacked too deep."""
        probe_dir = self.backing_dir or Path("/tmp")
        path = probe_dir / f".passthrough-probe-{os.getpid()}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            log.warning("passthrough probe: cannot create %s: %s", path, exc)
            return False
        try:
            backing_id = device.backing_open(self._fd, fd)
            device.backing_close(self._fd, backing_id)
            return True
        except OSError as exc:
            log.warning("the kernel refused a passthrough backing file in %s (%s); cached reads go through "
                        "this process", probe_dir, exc)
            return False
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)

    # -- serving -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the reader threads (on cloned fds when the kernel allows it)."""
        self._fds = [self._fd]
        for _ in range(self.readers - 1):
            try:
                self._fds.append(device.clone(self._fd))
            except OSError as exc:  # old kernels: share the one fd
                log.info("FUSE_DEV_IOC_CLONE failed (%s); reader threads share one fd", exc)
                self._fds.append(self._fd)
        for i, fd in enumerate(self._fds):
            t = threading.Thread(target=self._loop, args=(fd,), name=f"silod-raw-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        if self._passthrough and self._backing.keep:
            threading.Thread(target=self._sweep_loop, name="silod-raw-sweep", daemon=True).start()

    def _sweep_loop(self) -> None:
        while not self._stopped.wait(SWEEP_S):
            try:
                self._backing.sweep()
            except Exception:  # never end the sweeps: kept descriptors would pin evicted items
                log.exception("sweeping kept backing files failed")

    def serve_forever(self) -> None:
        """Start the readers and block until the file system is unmounted (or the connection aborted)."""
        if not self._threads:
            self.start()
        for t in self._threads:
            t.join()
            log.debug("FUSE reader %s ended", t.name)
        self._shutdown()

    def abort(self) -> None:
        """Drop the mount without serving (e.g. passthrough not available under --fuse-backend auto)."""
        device.unmount(self.mountpoint, lazy=True)
        self._shutdown()

    def _shutdown(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._open_pool.shutdown(wait=False, cancel_futures=True)
        for fd in set(self._fds) | ({self._fd} if self._fd >= 0 else set()):
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds, self._fd = [], -1
        if self._backing is not None:  # the backing ids ended with the connection
            self._backing.close_all()

    def _loop(self, fd: int) -> None:
        if NICE:
            try:  # see NICE
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
            except OSError:
                pass
        buf = bytearray(p.REQUEST_BUFFER)
        view = memoryview(buf)
        out = bytearray(p.READ_REPLY_BUFFER)  # READ replies: header + up to the granted max_pages
        out_view = memoryview(out)
        handlers = self._handlers()
        counts = self.counters.requests
        names = p.OPCODE_NAMES
        unpack_header = p.IN_HEADER.unpack_from
        readv = os.readv
        open_fast, release_fast = self._open, self._release
        OPEN, RELEASE, READ = p.OPEN, p.RELEASE, p.READ
        while True:
            try:
                n = readv(fd, [buf])
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):  # ENOENT: the request was interrupted
                    continue
                if exc.errno != errno.ENODEV:  # ENODEV: unmounted
                    log.error("reading /dev/fuse failed: %s", exc)
                log.debug("FUSE reader on fd %d stops: %s", fd, exc)
                return
            if n < 40:  # p.IN_HEADER.size
                continue
            _len, opcode, unique, nodeid = unpack_header(buf, 0)[:4]
            counts[opcode] = counts.get(opcode, 0) + 1
            try:
                # The two requests of every cached open first, without a dictionary look-up.
                if opcode == OPEN:
                    open_fast(fd, unique, nodeid, view)
                elif opcode == RELEASE:
                    release_fast(fd, unique, nodeid, view)
                elif opcode == READ:
                    self._read(fd, unique, view, out, out_view)
                else:
                    handler = handlers.get(opcode)
                    if handler is not None:
                        handler(fd, unique, nodeid, view)
                    elif opcode not in (p.FORGET, p.BATCH_FORGET):  # static inodes; FORGET has no reply
                        self._reply_error(fd, unique, errno.ENOSYS)
            except OSError as exc:
                self._reply_error(fd, unique, exc.errno or errno.EIO)
            except Exception:
                log.exception("FUSE request %s failed", names.get(opcode, opcode))
                self._reply_error(fd, unique, errno.EIO)
            if opcode == p.DESTROY:
                log.debug("FUSE_DESTROY: the kernel is done with this file system")
                return

    def _handlers(self) -> dict:
        return {
            p.LOOKUP: self._lookup, p.GETATTR: self._getattr, p.OPEN: self._open, p.READ: self._read,
            p.RELEASE: self._release, p.OPENDIR: self._opendir, p.READDIR: self._readdir,
            p.READDIRPLUS: self._readdirplus, p.RELEASEDIR: self._ok, p.STATFS: self._statfs,
            p.FLUSH: self._nosys, p.INTERRUPT: self._interrupt, p.DESTROY: self._ok, p.IOCTL: self._ioctl,
            p.GETXATTR: self._nosys, p.LISTXATTR: self._nosys, p.ACCESS: self._nosys,
        }

    # -- replies -----------------------------------------------------------------------------

    @staticmethod
    def _reply(fd: int, unique: int, payload: bytes | bytearray | memoryview = b"") -> None:
        try:
            os.writev(fd, [p.OUT_HEADER.pack(p.OUT_HEADER.size + len(payload), 0, unique), payload])
        except OSError as exc:
            # ENOENT: the request was interrupted and is gone; ENODEV: unmounted meanwhile.
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                raise

    @staticmethod
    def _reply_error(fd: int, unique: int, err: int) -> None:
        try:
            os.write(fd, p.OUT_HEADER.pack(p.OUT_HEADER.size, -err, unique))
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                log.warning("error reply %d for request %d failed: %s", err, unique, exc)

    def _ok(self, fd: int, unique: int, nodeid: int, view) -> None:
        self._reply(fd, unique)

    def _nosys(self, fd: int, unique: int, nodeid: int, view) -> None:
        # The kernel remembers ENOSYS for FLUSH, GETXATTR, LISTXATTR and ACCESS and stops asking.
        self._reply_error(fd, unique, errno.ENOSYS)

    def _ioctl(self, fd: int, unique: int, nodeid: int, view) -> None:
        # Python's buffered open() asks isatty() (TCGETS) once per file. The kernel forwards every
        # ioctl on a FUSE file and does not remember ENOSYS for it (it turns it into ENOTTY), so
        # the cheapest answer is this one, on the reader thread without touching anything else.
        self._reply_error(fd, unique, errno.ENOTTY)

    # -- metadata ----------------------------------------------------------------------------

    def _entry_out(self, nodeid: int, entry: FileEntry | None) -> bytes:
        return p.ENTRY_OUT.pack(nodeid, 0, _TIMEOUT_S, _TIMEOUT_S, 0, 0, *self._attr_fields(nodeid, entry))

    def _attr_fields(self, nodeid: int, entry: FileEntry | None) -> tuple:
        t, tn = self._mtime, self._mtime_ns
        if entry is None:
            return (nodeid, 0, 0, t, t, t, tn, tn, tn, p.S_IFDIR | 0o555, 2, 0, 0, 0, BLKSIZE, 0)
        size = entry.size
        return (nodeid, size, (size + 511) // 512, t, t, t, tn, tn, tn, p.S_IFREG | 0o444, 1, 0, 0, 0, BLKSIZE, 0)

    def _lookup(self, fd: int, unique: int, nodeid: int, view) -> None:
        parent = self.inodes.dir_path(nodeid)
        if parent is None:
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        raw = bytes(view[p.IN_HEADER.size:_request_end(view)])
        name = raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        found = self.inodes.child(parent, name)
        if found is None:
            # A zero node id with a timeout is a negative entry the kernel keeps (unlike ENOENT).
            self._reply(fd, unique, p.ENTRY_OUT.pack(0, 0, _TIMEOUT_S, 0, 0, 0, *([0] * 16)))
            return
        child_id, entry = found
        self._reply(fd, unique, self._entry_out(child_id, entry))

    def _node(self, nodeid: int) -> FileEntry | None:
        """The file entry of `nodeid`, None for a directory; ENOENT for an unknown node."""
        entry = self.inodes.file(nodeid)
        if entry is None and self.inodes.dir_path(nodeid) is None:
            raise FileNotFoundError(errno.ENOENT, "unknown node")
        return entry

    def _getattr(self, fd: int, unique: int, nodeid: int, view) -> None:
        entry = self._node(nodeid)
        self._reply(fd, unique, p.ATTR_OUT.pack(_TIMEOUT_S, 0, 0, *self._attr_fields(nodeid, entry)))

    def _statfs(self, fd: int, unique: int, nodeid: int, view) -> None:
        st = self.ops.statfs()
        self._reply(fd, unique, p.STATFS_OUT.pack((st.total_bytes + 4095) // 4096, 0, 0, st.files, 0, 4096, 255, 4096, 0))

    def _opendir(self, fd: int, unique: int, nodeid: int, view) -> None:
        if self.inodes.dir_path(nodeid) is None:
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        # The listing never changes while mounted: let the kernel cache directory contents.
        self._reply(fd, unique, p.OPEN_OUT.pack(0, p.FOPEN_CACHE_DIR | p.FOPEN_KEEP_CACHE, 0))

    def _readdir(self, fd: int, unique: int, nodeid: int, view) -> None:
        self._readdir_common(fd, unique, nodeid, view, plus=False)

    def _readdirplus(self, fd: int, unique: int, nodeid: int, view) -> None:
        self._readdir_common(fd, unique, nodeid, view, plus=True)

    def _readdir_common(self, fd: int, unique: int, nodeid: int, view, plus: bool) -> None:
        path = self.inodes.dir_path(nodeid)
        if path is None:
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        _fh, offset, size = p.READ_IN.unpack_from(view, p.IN_HEADER.size)[:3]
        children = self.ops.list_dir(path)
        out = bytearray()
        i = offset
        total = len(children) + 2
        while i < total:
            if i == 0:
                name, child_id, entry, dtype = ".", nodeid, None, p.DT_DIR
            elif i == 1:
                name, child_id, entry, dtype = "..", 0, None, p.DT_DIR
            else:
                name = children[i - 2]
                child_id, entry = self.inodes.child(path, name)
                dtype = p.DT_DIR if entry is None else p.DT_REG
            raw = name.encode("utf-8", "surrogateescape")
            rec = p.dirent_size(len(raw))
            if plus:
                rec += p.ENTRY_OUT.size
            if len(out) + rec > size:
                break
            if plus:
                if i < 2:  # the kernel skips "." and ".."; no attributes, no lookup count
                    out += p.ENTRY_OUT.pack(0, 0, 0, 0, 0, 0, *([0] * 16))
                else:
                    out += self._entry_out(child_id, entry)
            out += p.DIRENT.pack(child_id or p.ROOT_ID, i + 1, len(raw), dtype)
            out += raw
            out += b"\0" * (p.dirent_size(len(raw)) - p.DIRENT.size - len(raw))
            i += 1
        self._reply(fd, unique, out)

    # -- data --------------------------------------------------------------------------------

    def _open(self, fd: int, unique: int, nodeid: int, view) -> None:
        # The hot path of every cached read: kept to a few calls on purpose.
        entry = self.inodes.file(nodeid)
        if entry is None:
            if self.inodes.dir_path(nodeid) is not None:
                raise IsADirectoryError(errno.EISDIR, "is a directory")
            raise FileNotFoundError(errno.ENOENT, "unknown node")
        if p.OPEN_IN.unpack_from(view, 40)[0] & os.O_ACCMODE:
            raise OSError(errno.EROFS, "read-only file system")
        ops = self.ops
        pid = p.IN_HEADER.unpack_from(view, 0)[6] if ops.attribution is not None else 0  # per-pod counts
        if not ops.hits_may_block:  # after a crash a first hit checksums its item: open pool
            if self._passthrough and (kept := self._backing.take_kept(nodeid)) is not None:
                try:
                    handle = ops.open_held(entry, kept.fd, pid=pid)
                except BaseException:
                    self._backing.release(nodeid)
                    raise
                if handle is not None:
                    self.counters.kept_opens += 1
                    self._reply_passthrough(fd, unique, nodeid, handle, kept.backing_id)
                    return
                self._backing.release(nodeid, evicted=True)  # evicted since: open it afresh
            handle = ops.open_if_cached(entry, passthrough=self._passthrough, pid=pid)
            if handle is not None:
                self._reply_open(fd, unique, nodeid, handle)
                return
        # A miss may wait for the remote: answer it from the open pool, never on this thread.
        with self._pending_lock:
            self._pending[unique] = _PendingOpen(fd)
        try:
            self._open_pool.submit(self._open_slow, fd, unique, nodeid, entry, pid, time.perf_counter())
        except RuntimeError:  # shutting down
            with self._pending_lock:
                self._pending.pop(unique, None)
            raise OSError(errno.EIO, "unmounting") from None

    def _open_slow(self, fd: int, unique: int, nodeid: int, entry: FileEntry, pid: int = 0,
                   received: float | None = None) -> None:
        handle = error = None
        with self._pending_lock:
            pending = self._pending.get(unique)
        try:
            # An interrupted opener already got EINTR (see _interrupt): stop waiting for it then.
            handle = self.ops.open(entry, passthrough=self._passthrough, pid=pid,
                                   cancelled=(lambda: pending.interrupted) if pending is not None else None,
                                   received=received)
        except OSError as exc:
            error = exc.errno or errno.EIO
        except Exception:
            log.exception("open of %s failed", entry.path)
            error = errno.EIO
        with self._pending_lock:
            pending = self._pending.pop(unique, None)
        if pending is not None and pending.interrupted and error == errno.EINTR:
            return  # answered with EINTR by _interrupt already
        if pending is not None and pending.interrupted:  # the opener gave up and got EINTR
            if handle is not None:
                self.ops.release(handle.fh)
            return
        if error is not None:
            self._reply_error(fd, unique, error)
            return
        try:
            self._reply_open(fd, unique, nodeid, handle)
        except Exception:  # after the backing id was taken: release both
            self._release_handle(nodeid, handle.fh)
            log.exception("replying to the open of %s failed", entry.path)

    def _reply_open(self, fd: int, unique: int, nodeid: int, handle: OpenFile) -> None:
        if handle.mode is OpenMode.PASSTHROUGH:
            try:
                backing_id = self._backing.acquire(nodeid, handle.item.fd, keep=handle.item.hit)
            except OSError as exc:
                # Still correct without passthrough (the open was accounted in full already).
                self.counters.backing_open_failures += 1
                log.warning("FUSE_DEV_IOC_BACKING_OPEN failed for %s (%s); serving its reads here",
                            handle.item.entry.path, exc)
                backing_id, flags = 0, 0
            else:
                flags = p.FOPEN_PASSTHROUGH | p.FOPEN_NOFLUSH
        elif handle.mode is OpenMode.STREAMING:
            # Read while it is fetched, so not a passthrough open; with passthrough on, direct
            # I/O: the kernel refuses a page-cached open of an inode that another process holds
            # in passthrough mode (and the reverse), not a direct one.
            backing_id, flags = 0, p.FOPEN_DIRECT_IO if self._passthrough else 0
        else:
            backing_id, flags = 0, p.FOPEN_KEEP_CACHE if handle.mode is OpenMode.KERNEL_CACHE else 0
        try:
            os.write(fd, _OPEN_REPLY(32, 0, unique, handle.fh, flags, backing_id))
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENODEV):  # the opener was interrupted / unmounted
                raise
            self._release_handle(nodeid, handle.fh)

    def _reply_passthrough(self, fd: int, unique: int, nodeid: int, handle: OpenFile, backing_id: int) -> None:
        try:
            os.write(fd, _OPEN_REPLY(32, 0, unique, handle.fh, p.FOPEN_PASSTHROUGH | p.FOPEN_NOFLUSH, backing_id))
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                raise
            self._release_handle(nodeid, handle.fh)

    def _read(self, fd: int, unique: int, view, out: bytearray, out_view: memoryview) -> None:
        fh, offset, size = p.READ_IN.unpack_from(view, p.IN_HEADER.size)[:3]
        if not self.ops.read_ready(fh, size, offset):
            # A streaming open's bytes are not staged yet: wait on the open pool, not here, and
            # interruptibly, as an open does (a killed reader's READ is answered at once).
            pending = _PendingOpen(fd)
            with self._pending_lock:
                self._pending[unique] = pending
            try:
                self._open_pool.submit(self._read_slow, fd, unique, fh, size, offset, pending)
            except RuntimeError:  # shutting down
                with self._pending_lock:
                    self._pending.pop(unique, None)
                raise OSError(errno.EIO, "unmounting") from None
            return
        self._answer_read(fd, unique, fh, size, offset, out, out_view)

    def _read_slow(self, fd: int, unique: int, fh: int, size: int, offset: int, pending: _PendingOpen) -> None:
        out = bytearray(p.OUT_HEADER.size + size)
        try:
            self._answer_read(fd, unique, fh, size, offset, out, memoryview(out), pending)
        except OSError as exc:
            if self._answered(unique):
                self._reply_error(fd, unique, exc.errno or errno.EIO)
        except Exception:
            log.exception("read of handle %d failed", fh)
            if self._answered(unique):
                self._reply_error(fd, unique, errno.EIO)

    def _answered(self, unique: int) -> bool:
        """Take a waiting request off the pending list: False when _interrupt answered it already."""
        with self._pending_lock:
            pending = self._pending.pop(unique, None)
        return pending is not None and not pending.interrupted

    def _answer_read(self, fd: int, unique: int, fh: int, size: int, offset: int, out: bytearray,
                     out_view: memoryview, pending: _PendingOpen | None = None) -> None:
        if pending is None:
            src, n = self.ops.read_span(fh, size, offset)
        else:
            src, n = self.ops.read_span(fh, size, offset, lambda: pending.interrupted)
        if n > len(out) - p.OUT_HEADER.size:
            # Never answer short: the kernel takes a short reply as end of file. The kernel never
            # asks more than INIT granted (MAX_READ), so this is a protocol error, said as one.
            raise OSError(errno.EIO, f"READ of {size} bytes exceeds the granted maximum {p.MAX_READ}")
        got = 0
        while got < n:  # preadv may return fewer bytes than asked (signals, some file systems)
            k = os.preadv(src, [out_view[p.OUT_HEADER.size + got:p.OUT_HEADER.size + n]], offset + got)
            if k <= 0:
                # The cached item is shorter than the listing says: an error, never a short file.
                log.error("cache file of handle %d ended at %d, expected %d bytes", fh, offset + got, offset + n)
                raise OSError(errno.EIO, "cache file shorter than the item")
            got += k
        if pending is not None and not self._answered(unique):
            return  # the reader was interrupted and got EINTR already
        p.OUT_HEADER.pack_into(out, 0, p.OUT_HEADER.size + got, 0, unique)
        try:
            os.write(fd, out_view[:p.OUT_HEADER.size + got])
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                raise

    def _release(self, fd: int, unique: int, nodeid: int, view) -> None:
        self._release_handle(nodeid, _RELEASE_IN(view, 40)[0])
        try:
            os.write(fd, _OUT_HEADER(16, 0, unique))
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                raise

    def _release_handle(self, nodeid: int, fh: int) -> None:
        handle = self.ops.release(fh)
        if handle is not None and handle.mode is OpenMode.PASSTHROUGH:
            self._backing.release(nodeid)

    def _interrupt(self, fd: int, unique: int, nodeid: int, view) -> None:
        target = p.INTERRUPT_IN.unpack_from(view, p.IN_HEADER.size)[0]
        with self._pending_lock:
            pending = self._pending.get(target)
            if pending is None or pending.interrupted:
                return  # already answered (or not a request we wait on): nothing to do, no reply
            pending.interrupted = True
        self.counters.interrupted_opens += 1
        # The fetch goes on (and may be admitted for the next reader); the opener gets EINTR.
        self._reply_error(pending.fd, target, errno.EINTR)

    def on_evicted(self, key: str) -> None:
        """DatasetCache.on_evicted: this mount unlinked the cached item `key`. Evictions by other
        mounts of the dataset are left to the sweep (SWEEP_S)."""
        if self._backing is None or not len(self._backing):
            return
        nodeid = self._node_of_key().get(key)
        if nodeid is not None and self._backing.evicted(nodeid):
            self.counters.closed_at_eviction += 1

    def _node_of_key(self) -> dict[str, int]:
        # Built on the first eviction (a shrink), not at mount: one sha1 per item.
        if self._key_nodes is None:
            from fuse_client.cache_store import item_key

            self._key_nodes = {item_key(e.path): self._file_base + e.index for e in self.inodes.listing.files.values()}
        return self._key_nodes

    # -- introspection -----------------------------------------------------------------------

    def stats(self) -> dict:
        return {
            "fuse_requests": {p.OPCODE_NAMES.get(op, str(op)): n for op, n in list(self.counters.requests.items())},
            "fuse_backing_files": 0 if self._backing is None else len(self._backing),
            "fuse_backing_files_kept_idle": 0 if self._backing is None else self._backing.idle,
            "fuse_interrupted_opens": self.counters.interrupted_opens,
            "fuse_backing_open_failures": self.counters.backing_open_failures,
            "fuse_kept_opens": self.counters.kept_opens,
            "fuse_kept_closed_at_eviction": self.counters.closed_at_eviction,
        }


def descriptor_budget(want: int) -> int:
    """How many backing files to keep: `want`, within what RLIMIT_NOFILE allows after raising
    its soft limit (and, as root, its hard limit) to fit them."""
    if want <= 0:
        return 0
    need = want + FD_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        for limits in ((need, max(hard, need)) if hard != resource.RLIM_INFINITY else (need, hard), (min(need, hard), hard)):
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, limits)
                break
            except (OSError, ValueError):
                continue
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return want
    return max(0, min(want, soft - FD_MARGIN))


def _request_end(view) -> int:
    return p.IN_HEADER.unpack_from(view, 0)[0]


def wait_mounted(path: Path, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.ismount(path):
            return True
        time.sleep(0.01)
    return False
