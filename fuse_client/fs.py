"""The FUSE operations: a thin, read-only layer over the listing and the ItemResolver.

Binding: mfusepy (maintained fork of fusepy with libfuse 3 support; pure ctypes, no compile).
It exposes `read_buf`, which lets us answer reads with the cache file's descriptor so libfuse
copies (or splices) the bytes in C; see fusebuf.py and docs/data-plane.md for why that matters.

Each `open` resolves the item (hit, shared fetch or remote fetch) and keeps its fd for the
handle's lifetime; reads are then served from that fd. Opening for writing fails with EROFS.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from typing import Any

import mfusepy

from fuse_client.dataplane import ItemResolver, LocalItem
from fuse_client.fusebuf import enable_splice, pin_thread_state, reply_with_fd
from fuse_client.pod_attribution import PodAttribution
from fuse_client.remote import DatasetListing

log = logging.getLogger(__name__)

# The dataset is immutable while mounted: let the kernel keep names and attributes for an hour.
METADATA_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class _Handle:
    item: LocalItem
    count_reads: bool  # False when the whole item was accounted at open (kernel-cached hit)
    pod: str = ""  # uid of the pod whose process opened it ("" outside any pod)


class SilodFS(mfusepy.Operations):
    use_ns = True

    def __init__(self, listing: DatasetListing, resolver: ItemResolver, kernel_cache: bool = True,
                 attribution: PodAttribution | None = None) -> None:
        self.listing = listing
        # With an attribution (the node agent's mounts), bytes and hits are also counted per pod.
        self.attribution = attribution
        self.resolver = resolver
        self.accounting = resolver.accounting
        self.kernel_cache = kernel_cache
        self._handles: dict[int, _Handle] = {}
        self._next_fh = itertools.count(1)
        self._lock = threading.Lock()
        self._mtime_ns = time.time_ns()
        self.on_init = lambda: None  # called once the kernel has accepted the mount

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
        rel = self._rel(path)
        entry = self.listing.files.get(rel)
        common = {"st_mtime": self._mtime_ns, "st_ctime": self._mtime_ns, "st_atime": self._mtime_ns, "st_uid": 0, "st_gid": 0}
        if entry is not None:
            return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": entry.size, "st_blocks": (entry.size + 511) // 512, **common}
        if rel in self.listing.dirs:
            return {"st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2, **common}
        raise mfusepy.FuseOSError(errno.ENOENT)

    def readdir(self, path: str, fh: int):
        pin_thread_state()
        children = self.listing.dirs.get(self._rel(path))
        if children is None:
            raise mfusepy.FuseOSError(errno.ENOTDIR)
        return [".", "..", *children]

    def statfs(self, path: str) -> dict[str, int]:
        total = self.listing.total_bytes
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": (total + 4095) // 4096, "f_bfree": 0, "f_bavail": 0,
                "f_files": len(self.listing.files), "f_ffree": 0, "f_namemax": 255}

    # -- data --------------------------------------------------------------------------------

    def open(self, path: str, fi) -> int:
        # raw_fi=True: `fi` is the fuse_file_info struct, so we can set fh and keep_cache.
        pin_thread_state()
        if (fi.flags & os.O_ACCMODE) != os.O_RDONLY:
            raise mfusepy.FuseOSError(errno.EROFS)
        entry = self.listing.files.get(self._rel(path))
        if entry is None:
            raise mfusepy.FuseOSError(errno.ENOENT if self._rel(path) not in self.listing.dirs else errno.EISDIR)
        pod = self.attribution.pod_of(mfusepy.fuse_get_context()[2]) if self.attribution is not None else ""
        item = self.resolver.resolve(entry)  # RemoteFetchError is an OSError(EIO): becomes -EIO
        self.accounting.pod_opened(pod, item.hit)
        # Cached items never change, so the kernel may keep their pages across opens (re-reads
        # then never reach this process). Misses are never kept: the page cache would otherwise
        # act as a second, unaccounted cache and break the c/d hit ratio.
        keep = self.kernel_cache and item.hit
        if keep:
            # Reads served by the kernel are invisible to us, so a kept item is accounted as read
            # in full when it is opened (training reads every item whole).
            self.accounting.bytes_read(entry.size, hit=True, pod=pod)
        fh = next(self._next_fh)
        with self._lock:
            self._handles[fh] = _Handle(item, count_reads=not keep, pod=pod)
        fi.fh = fh
        fi.keep_cache = 1 if keep else 0
        return 0

    def read_buf(self, path: str, bufpp, size: int, offset: int, fi) -> int:
        pin_thread_state()
        handle = self._handles.get(fi.fh)
        if handle is None:
            return -errno.EBADF
        item = handle.item
        n = max(0, min(size, item.entry.size - offset))
        if handle.count_reads:
            self.accounting.bytes_read(n, item.hit, handle.pod)
        return reply_with_fd(bufpp, item.fd, n, offset)

    def release(self, path: str, fi) -> int:
        pin_thread_state()
        with self._lock:
            handle = self._handles.pop(fi.fh, None)
        if handle is not None:
            os.close(handle.item.fd)
        return 0

    def open_handles(self) -> int:
        return len(self._handles)
