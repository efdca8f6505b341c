"""The libfuse front end: mfusepy callbacks over the shared DatasetOperations (operations.py).

Binding: mfusepy (maintained fork of fusepy with libfuse 3 support; pure ctypes, no compile).
It exposes `read_buf`, which lets us answer reads with the cache file's descriptor so libfuse
copies (or splices) the bytes in C; see fusebuf.py and docs/data-plane.md for why that matters.

Each `open` resolves the item (hit, shared fetch or remote fetch) and keeps its fd for the
handle's lifetime; reads are then served from that fd. Opening for writing fails with EROFS.
The other front end, rawfuse/, serves the same operations over /dev/fuse with passthrough.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import stat
import threading
import time
from typing import Any

import mfusepy

from fuse_client.fusebuf import enable_splice, pin_thread_state, reply_with_fd
from fuse_client.operations import METADATA_TIMEOUT_S, DatasetOperations, OpenMode

log = logging.getLogger(__name__)

__all__ = ["SilodFS", "METADATA_TIMEOUT_S"]


def waiting_open_cap(fuse_threads: int) -> int:
    """Opens that may wait for the remote at once under libfuse: the workers less a reserve
    (a quarter, at least 2) that keeps serving lookups, cached reads and interrupts."""
    return max(1, fuse_threads - max(2, fuse_threads // 4))


_fuse_interrupted = mfusepy._libfuse.fuse_interrupted
_fuse_interrupted.restype = ctypes.c_int
_fuse_interrupted.argtypes = []


def _interrupted() -> bool:
    """Whether the kernel interrupted the request this worker thread serves (its caller got a
    signal, e.g. was killed): libfuse marks the request when another worker reads the INTERRUPT."""
    return bool(_fuse_interrupted())


def _fuse_error(exc: OSError) -> mfusepy.FuseOSError:
    return mfusepy.FuseOSError(exc.errno or errno.EIO)


class SilodFS(mfusepy.Operations):
    """mfusepy's callbacks, each a few lines over the shared DatasetOperations."""

    use_ns = True

    def __init__(self, ops: DatasetOperations, fuse_threads: int = 128) -> None:
        self.ops = ops
        self.on_init = lambda: None  # called once the kernel has accepted the mount
        # libfuse answers a request on the worker that read it, and reads no more requests once
        # all `fuse_threads` workers are busy: opens waiting for the remote must leave some
        # workers free, or lookups, cached reads and the kernel's INTERRUPTs (of killed readers)
        # queue behind them. See waiting_open_cap.
        self.fuse_threads = fuse_threads
        self.wait_cap = waiting_open_cap(fuse_threads)
        self._waiting = threading.BoundedSemaphore(self.wait_cap)
        self.refused_opens = 0
        self._last_refusal_log = 0.0

    # -- lifecycle ---------------------------------------------------------------------------

    def init_with_config(self, conn_info, config_3) -> None:
        enable_splice(conn_info)
        if conn_info is not None:
            # Bigger kernel readahead → bigger read requests → fewer Python callbacks per byte.
            conn_info.max_readahead = max(conn_info.max_readahead, 1 << 20)
        if config_3 is not None:
            config_3.entry_timeout = METADATA_TIMEOUT_S
            config_3.attr_timeout = METADATA_TIMEOUT_S
            config_3.negative_timeout = METADATA_TIMEOUT_S
        self.on_init()

    # -- metadata ----------------------------------------------------------------------------

    @staticmethod
    def _rel(path: str) -> str:
        return path.strip("/")

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        pin_thread_state()
        try:
            attr = self.ops.attr(self._rel(path))
        except OSError as exc:
            raise _fuse_error(exc) from None
        t = self.ops.mtime_ns
        common = {"st_mtime": t, "st_ctime": t, "st_atime": t, "st_uid": 0, "st_gid": 0}
        if attr.is_dir:
            return {"st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2, **common}
        return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": attr.size, "st_blocks": (attr.size + 511) // 512, **common}

    def readdir(self, path: str, fh: int):
        pin_thread_state()
        try:
            children = self.ops.list_dir(self._rel(path))
        except OSError as exc:
            raise _fuse_error(exc) from None
        return [".", "..", *children]

    def statfs(self, path: str) -> dict[str, int]:
        st = self.ops.statfs()
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": (st.total_bytes + 4095) // 4096, "f_bfree": 0, "f_bavail": 0,
                "f_files": st.files, "f_ffree": 0, "f_namemax": 255}

    # -- data --------------------------------------------------------------------------------

    def open(self, path: str, fi) -> int:
        # raw_fi=True: `fi` is the fuse_file_info struct, so we can set fh and keep_cache.
        received = time.perf_counter()  # a miss's service time starts with its request
        pin_thread_state()
        try:
            self.ops.check_flags(fi.flags)
            pid = mfusepy.fuse_get_context()[2] if self.ops.attribution is not None else 0
            entry = self.ops.entry(self._rel(path))
            handle = None if self.ops.hits_may_block else self.ops.open_if_cached(entry, pid=pid)
            if handle is None:
                handle = self._open_waiting(entry, pid, received)  # a remote failure is EIO
        except OSError as exc:
            raise _fuse_error(exc) from None
        fi.fh = handle.fh
        # Cached items never change, so the kernel may keep their pages across opens.
        fi.keep_cache = 1 if handle.mode is OpenMode.KERNEL_CACHE else 0
        return 0

    def _open_waiting(self, entry, pid: int, received: float | None = None):
        """An open that may wait for the remote: only while a waiting slot is free (else EAGAIN
        at once), and interruptible (a killed reader's INTERRUPT ends the wait with EINTR)."""
        if not self._waiting.acquire(blocking=False):
            self.refused_opens += 1
            now = time.monotonic()
            if now - self._last_refusal_log > 10:  # one line, not one per refused open
                self._last_refusal_log = now
                log.warning("%d opens are waiting for the remote (the cap for --fuse-threads %d); further uncached "
                            "opens fail with EAGAIN until some finish (%d refused so far); raise --fuse-threads for "
                            "more parallel misses", self.wait_cap, self.fuse_threads,
                            self.refused_opens)
            raise OSError(errno.EAGAIN, "too many opens waiting for the remote")
        try:
            return self.ops.open(entry, pid=pid, cancelled=_interrupted, received=received)
        finally:
            self._waiting.release()

    def read_buf(self, path: str, bufpp, size: int, offset: int, fi) -> int:
        pin_thread_state()
        try:
            # A streaming open's read may wait for its bytes on this worker; interruptible.
            fd, n = self.ops.read_span(fi.fh, size, offset, _interrupted)
        except OSError as exc:
            return -(exc.errno or errno.EIO)
        return reply_with_fd(bufpp, fd, n, offset)

    def release(self, path: str, fi) -> int:
        pin_thread_state()
        self.ops.release(fi.fh)
        return 0

    def open_handles(self) -> int:
        return self.ops.open_handles()
