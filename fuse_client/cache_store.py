"""The on-disk cache of one dataset on one node, shared by every mount (job) that reads it.

Layout under `<cache-dir>/<dataset>/`:

    index.sqlite      items(key, size, crc32) and meta(allocation_bytes); WAL mode
    cache_mode        uniform | lru (fuse_client/lru_cache.py); absent = uniform
    items/ab/<key>    complete, verified item files; presence here means "cached"
    staging/          items being fetched (never served by name, never counted)
    transient/        fetched items that were not admitted, kept only while jobs that waited
                      for the same fetch pick them up (single flight across processes)
    locks/<key>.lock  flock held while an item is fetched; <key>.wait.* mark waiters
    alive.lock        every live mount holds a shared flock; the first one to start takes it
                      exclusively and runs recovery

Why SQLite and flocks: several FUSE processes admit items into one allocation. Admission is
"sum(size) + item <= allocation", which needs one atomic read-modify-write across processes;
`BEGIN IMMEDIATE` gives exactly that. The hit path does not touch SQLite at all: it opens
`items/ab/<key>`, because a file only ever appears there by an atomic rename of a complete,
checksummed file, done inside the admitting transaction.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import random
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fuse_client import lru_cache
from fuse_client.lru_cache import CacheMode
from fuse_client.uniform_cache import CachedItem, choose_evictions, should_admit

log = logging.getLogger(__name__)

# Stands for "no limit" in the SQLite index (an INTEGER column); a fresh cache starts unlimited.
UNLIMITED_BYTES = 2**62
# A transient (not admitted) item left behind by a waiter that died is removed after this long.
TRANSIENT_TTL_S = 60.0
_READ_CHUNK = 4 * 1024 * 1024


def item_key(path: str) -> str:
    """Flat, fixed-length, filesystem-safe name of a dataset item (its path in the dataset)."""
    return hashlib.sha1(path.encode("utf-8", "surrogateescape")).hexdigest()


def file_crc32(fd: int, size: int) -> int:
    crc, offset = 0, 0
    while offset < size:
        chunk = os.pread(fd, min(_READ_CHUNK, size - offset), offset)
        if not chunk:
            break
        crc = zlib.crc32(chunk, crc)
        offset += len(chunk)
    return crc


@dataclass(frozen=True)
class CacheUsage:
    cached_bytes: int
    items_cached: int
    allocation_bytes: int


@dataclass(frozen=True)
class RecoveryReport:
    ran: bool
    verified: int = 0
    dropped_corrupt: int = 0
    dropped_unindexed: int = 0
    dropped_missing_rows: int = 0
    removed_staging: int = 0


class DatasetCache:
    """One dataset's cache directory. Thread-safe; one instance per mount process."""

    def __init__(self, cache_dir: Path, dataset: str) -> None:
        self.root = Path(cache_dir) / dataset
        self.items_dir = self.root / "items"
        self.staging_dir = self.root / "staging"
        self.transient_dir = self.root / "transient"
        self.locks_dir = self.root / "locks"
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)  # private to the data path: a job reads items only through its mount
        for d in (self.items_dir, self.staging_dir, self.transient_dir, self.locks_dir):
            d.mkdir(parents=True, exist_ok=True)
        for i in range(256):
            (self.items_dir / f"{i:02x}").mkdir(exist_ok=True)
        self._items_prefix = str(self.items_dir) + "/"
        self._db_path = self.root / "index.sqlite"
        self._local = threading.local()
        self._alive_fd: int | None = None
        with self._tx() as db:
            db.execute("CREATE TABLE IF NOT EXISTS items (key TEXT PRIMARY KEY, size INTEGER NOT NULL, crc INTEGER NOT NULL)")
            db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
            db.execute("INSERT OR IGNORE INTO meta VALUES ('allocation_bytes', ?)", (UNLIMITED_BYTES,))
        # uniform | lru (fuse_client/lru_cache.py); kept in a file next to the index.
        self.mode = lru_cache.read_mode(self.root)
        self.recency = lru_cache.RecencyLog()  # LRU hits, stamped on the item files by flush_recency()

    # -- SQLite ------------------------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self._db_path, timeout=30.0, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
        return db

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """A write transaction that excludes every other writer on the node (BEGIN IMMEDIATE)."""
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    # -- paths -------------------------------------------------------------------------------

    def item_path(self, key: str) -> Path:
        return self.items_dir / key[:2] / key

    def _lock_path(self, key: str) -> Path:
        return self.locks_dir / f"{key}.lock"

    # -- lifetime and recovery ---------------------------------------------------------------

    def attach(self) -> RecoveryReport:
        """Join the set of live mounts of this cache; the first one to arrive runs recovery.

        A mount holds a shared flock on alive.lock for its lifetime. If we can take it
        exclusively, no other mount is alive, so leftovers from crashed ones (staging files,
        transient files, waiter marks, rows without files, files that fail their checksum) can
        be cleaned without racing a live writer.
        """
        fd = os.open(self.root / "alive.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self._alive_fd = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fcntl.flock(fd, fcntl.LOCK_SH)
            return RecoveryReport(ran=False)
        try:
            return self._recover()
        finally:
            fcntl.flock(fd, fcntl.LOCK_SH)

    def detach(self) -> None:
        if self._alive_fd is not None:
            os.close(self._alive_fd)
            self._alive_fd = None
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    def _recover(self) -> RecoveryReport:
        removed_staging = 0
        for d in (self.staging_dir, self.transient_dir, self.locks_dir):
            for entry in os.scandir(d):
                if d is self.locks_dir and entry.name.endswith(".lock"):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed_staging += 1
        verified = corrupt = unindexed = missing = 0
        with self._tx() as db:
            rows = {key: (size, crc) for key, size, crc in db.execute("SELECT key, size, crc FROM items")}
            on_disk: set[str] = set()
            for sub in os.scandir(self.items_dir):
                if not sub.is_dir():
                    continue
                for entry in os.scandir(sub.path):
                    key = entry.name
                    row = rows.get(key)
                    if row is None:
                        # Renamed but the transaction recording its checksum never committed:
                        # nothing vouches for its content, so drop it.
                        os.unlink(entry.path)
                        unindexed += 1
                        continue
                    size, crc = row
                    fd = os.open(entry.path, os.O_RDONLY)
                    try:
                        ok = os.fstat(fd).st_size == size and file_crc32(fd, size) == crc
                    finally:
                        os.close(fd)
                    if ok:
                        on_disk.add(key)
                        verified += 1
                    else:
                        log.warning("cache item %s fails its checksum; dropping it", key)
                        os.unlink(entry.path)
                        corrupt += 1
            for key in rows.keys() - on_disk:
                db.execute("DELETE FROM items WHERE key = ?", (key,))
                missing += 1
        return RecoveryReport(
            ran=True,
            verified=verified,
            dropped_corrupt=corrupt,
            dropped_unindexed=unindexed,
            # Rows of corrupt files were deleted too; count them once, as corrupt.
            dropped_missing_rows=missing - corrupt,
            removed_staging=removed_staging,
        )

    # -- hit path ----------------------------------------------------------------------------

    def open_cached(self, key: str) -> int | None:
        """A read-only fd of the cached item, or None. No SQLite: this is the hot path."""
        try:
            fd = os.open(f"{self._items_prefix}{key[:2]}/{key}", os.O_RDONLY)
        except FileNotFoundError:
            return None
        if self.mode is CacheMode.LRU:
            self.recency.note(key)
        return fd

    # -- single flight across processes ------------------------------------------------------

    @contextlib.contextmanager
    def fetch_lock(self, key: str) -> Iterator[None]:
        """Serialise fetches of one item across every mount on the node (flock on a lock file)."""
        fd = os.open(self._lock_path(key), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def add_waiter(self, key: str) -> Path:
        mark = self.locks_dir / f"{key}.wait.{os.getpid()}.{threading.get_ident()}.{random.getrandbits(32):08x}"
        mark.touch()
        return mark

    def has_waiters(self, key: str) -> bool:
        prefix = f"{key}.wait."
        return any(e.name.startswith(prefix) for e in os.scandir(self.locks_dir))

    def take_transient(self, key: str) -> int | None:
        """Open the not-admitted copy another job fetched while we waited; the last waiter removes it."""
        path = self.transient_dir / key
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        if not self.has_waiters(key):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return fd

    def new_staging_file(self, key: str) -> tuple[int, Path]:
        path = self.staging_dir / f"{key}.{os.getpid()}.{threading.get_ident()}.{random.getrandbits(32):08x}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        return fd, path

    def publish(self, key: str, staging: Path, size: int, crc: int) -> bool:
        """Admit a completely fetched item if the dataset stays within its allocation.

        The rename into items/ happens inside the transaction that records the checksum, so no
        other process can evict or count the item half-way; a crash between rename and commit
        leaves an unindexed file that recovery drops.
        """
        with self._tx() as db:
            allocation = db.execute("SELECT value FROM meta WHERE name = 'allocation_bytes'").fetchone()[0]
            cached = db.execute("SELECT COALESCE(SUM(size), 0) FROM items").fetchone()[0]
            if db.execute("SELECT 1 FROM items WHERE key = ?", (key,)).fetchone() is not None:
                return False
            if not should_admit(cached, size, allocation):
                self.mode = lru_cache.read_mode(self.root)  # fresh: another mount may have switched it
                if self.mode is not CacheMode.LRU or size > allocation:
                    return False
                self.flush_recency()
                rows = db.execute("SELECT key, size FROM items").fetchall()
                self._evict(db, lru_cache.admission_victims(lru_cache.stamp(rows, self.item_path), allocation, size))
            db.execute("INSERT INTO items VALUES (?, ?, ?)", (key, size, crc))
            os.rename(staging, self.item_path(key))
            return True

    def keep_transient(self, key: str, staging: Path) -> None:
        """Expose a not-admitted item to the jobs waiting for it (they are marked in locks/)."""
        with contextlib.suppress(FileExistsError, FileNotFoundError):
            os.link(staging, self.transient_dir / key)

    def sweep_transient(self, now: float | None = None) -> int:
        """Remove transient copies older than TRANSIENT_TTL_S (their waiters died)."""
        now = time.time() if now is None else now
        removed = 0
        for entry in os.scandir(self.transient_dir):
            with contextlib.suppress(FileNotFoundError):
                if now - entry.stat().st_mtime > TRANSIENT_TTL_S:
                    os.unlink(entry.path)
                    removed += 1
        return removed

    # -- allocation and eviction -------------------------------------------------------------

    def set_allocation(self, allocation_bytes: int) -> int:
        """Record the dataset's allocation (latest writer wins) and evict down to it; returns bytes evicted."""
        with self._tx() as db:
            db.execute("UPDATE meta SET value = ? WHERE name = 'allocation_bytes'", (int(allocation_bytes),))
        return self.enforce_allocation()

    def enforce_allocation(self, rng: random.Random | None = None) -> int:
        """Evict random items until the cached bytes fit the allocation; returns bytes evicted."""
        with self._tx() as db:
            allocation = db.execute("SELECT value FROM meta WHERE name = 'allocation_bytes'").fetchone()[0]
            cached = db.execute("SELECT COALESCE(SUM(size), 0) FROM items").fetchone()[0]
            if cached <= allocation:
                return 0
            if lru_cache.read_mode(self.root) is CacheMode.LRU:
                return self._evict(db, self._lru_victims(db, allocation))
            items = [CachedItem(k, s) for k, s in db.execute("SELECT key, size FROM items")]
            return self._evict(db, choose_evictions(items, allocation, rng))

    def _evict(self, db: sqlite3.Connection, victims) -> int:
        for item in victims:
            db.execute("DELETE FROM items WHERE key = ?", (item.key,))
            # Unlink inside the transaction: a reader that already has the fd keeps reading;
            # a new open sees ENOENT and treats the item as a miss.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.item_path(item.key))
        return sum(item.size for item in victims)

    def _lru_victims(self, db: sqlite3.Connection, target_bytes: int) -> list:
        self.flush_recency()
        rows = db.execute("SELECT key, size FROM items").fetchall()
        return lru_cache.choose_lru_evictions(lru_cache.stamp(rows, self.item_path), target_bytes)

    # -- cache mode (uniform | lru) ------------------------------------------------------------

    def set_mode(self, mode: CacheMode) -> int:
        """Switch the dataset's cache to `mode` (latest writer wins, like the allocation) and
        enforce the allocation under it; returns bytes evicted."""
        mode = CacheMode(mode)
        if lru_cache.read_mode(self.root) is not mode:
            lru_cache.write_mode(self.root, mode)
        self.mode = mode
        return self.enforce_allocation()

    def flush_recency(self) -> int:
        """Write this process's noted LRU hits to the items' stamps (every tick, and before
        choosing victims); returns how many items were stamped."""
        return self.recency.flush(self.item_path)

    def refresh_mode(self) -> CacheMode:
        """Re-read the mode another mount may have set (the hit path uses `self.mode`)."""
        self.mode = lru_cache.read_mode(self.root)
        return self.mode

    def usage(self) -> CacheUsage:
        db = self._db()
        cached, count = db.execute("SELECT COALESCE(SUM(size), 0), COUNT(*) FROM items").fetchone()
        allocation = db.execute("SELECT value FROM meta WHERE name = 'allocation_bytes'").fetchone()[0]
        return CacheUsage(cached_bytes=cached, items_cached=count, allocation_bytes=allocation)

