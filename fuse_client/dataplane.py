"""Turn "job J opens item X" into a local file descriptor: cache hit, shared fetch, or remote fetch.

This is the one place that combines the shared cache, the remote store, the job's token bucket
and its accounting. It knows nothing about FUSE, so it is tested directly as well as through
real mounts.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

from fuse_client.accounting import JobAccounting
from fuse_client.cache_store import DatasetCache, item_key
from fuse_client.remote import FileEntry, RemoteStore
from fuse_client.token_bucket import Throttle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalItem:
    """An item ready to serve: `fd` is a read-only descriptor of its complete content."""

    fd: int
    entry: FileEntry
    hit: bool


class ItemResolver:
    def __init__(self, store: RemoteStore, cache: DatasetCache, throttle: Throttle, accounting: JobAccounting) -> None:
        self.store = store
        self.cache = cache
        self.throttle = throttle
        self.accounting = accounting
        self._keys: dict[str, str] = {}  # item path -> cache key; sha1 per open is measurable

    def resolve(self, entry: FileEntry) -> LocalItem:
        """Return a LocalItem for `entry`, fetching it (once per node) if it is not cached.

        Raises RemoteFetchError (an OSError with errno EIO) if the store keeps failing; nothing
        partial is ever admitted, because only a complete, checksummed file is renamed into the
        cache.
        """
        key = self._keys.get(entry.path)
        if key is None:
            key = self._keys[entry.path] = item_key(entry.path)
        fd = self.cache.open_cached(key)
        if fd is not None:
            self.accounting.item_opened(entry.index, hit=True)
            return LocalItem(fd, entry, hit=True)

        # Mark ourselves as waiting *before* queueing on the lock, so that a job already fetching
        # this item keeps its copy for us even if the cache has no room for it.
        mark = self.cache.add_waiter(key)
        try:
            with self.cache.fetch_lock(key):
                mark.unlink(missing_ok=True)
                fd = self.cache.open_cached(key)
                if fd is not None:  # another job fetched and admitted it while we waited
                    self.accounting.item_opened(entry.index, hit=True)
                    return LocalItem(fd, entry, hit=True)
                fd = self.cache.take_transient(key)
                if fd is not None:  # another job fetched it while we waited; not admitted
                    self.accounting.item_opened(entry.index, hit=False, shared_fetch=True)
                    return LocalItem(fd, entry, hit=False)
                return self._fetch(entry, key)
        finally:
            mark.unlink(missing_ok=True)

    def _fetch(self, entry: FileEntry, key: str) -> LocalItem:
        fd, staging = self.cache.new_staging_file(key)
        try:

            def write(data: bytes, offset: int) -> None:
                view = memoryview(data)
                while view:
                    n = os.pwrite(fd, view, offset)
                    view, offset = view[n:], offset + n

            def reset() -> None:
                os.ftruncate(fd, 0)

            crc = self.store.fetch(entry, write, self.throttle, self.accounting.bytes_fetched, reset)
            admitted = self.cache.publish(key, staging, entry.size, crc)
            if not admitted:
                if self.cache.has_waiters(key):
                    self.cache.keep_transient(key, staging)
                staging.unlink(missing_ok=True)  # our fd keeps the data alive for this open
            self.accounting.item_opened(entry.index, hit=False, admitted_size=entry.size if admitted else 0)
            return LocalItem(fd, entry, hit=False)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                staging.unlink()
            raise
