"""The on-disk cache of one dataset on one node, shared by every mount (job) that reads it.

Layout under `<cache-dir>/<dataset>/`:

    index.sqlite      items(key, size, crc32); meta(allocation_bytes, cached_bytes,
                      items_cached, clean, verify_pending); journal(key): items whose file is
                      being evicted right now. WAL mode
    cache_mode        uniform | lru: which CachePolicy (fuse_client/lru_cache.py); absent = uniform
    items/ab/<key>    complete, verified item files; presence here means "cached"
    staging/          items being fetched or admitted (never served by name, never counted);
                      `<key>.<pid>.<thread>.<rand>`, so the name says which item it is
    transient/        fetched items that were not admitted, kept only while jobs of other
                      processes that waited for the same fetch pick them up
    fetch.lock        one file of byte-range locks: per-item single flight across processes
                      (single_flight.NodeItemLocks); no per-item lock files
    alive.lock        every live mount holds a shared flock; the first one to start takes it
                      exclusively and runs recovery, the last one to stop marks the index clean

Why SQLite: several FUSE processes admit items into one allocation. Admission is
"cached + item <= allocation", which needs one atomic read-modify-write across processes;
`BEGIN IMMEDIATE` gives exactly that. The cached bytes and items are counters in `meta`,
updated in the same transactions as the rows, so an admission costs O(log n) (a primary-key
insert), not a sum over the index. The hit path does not touch SQLite at all: it opens
`items/ab/<key>`, because a file only ever appears there by an atomic rename of a complete,
checksummed file, done inside the admitting transaction.

Crash safety without re-reading the cache: an admission links its staging file into items/
inside its transaction and removes the staging name after the commit, so the staging names
left by a crash are exactly the admissions in flight. Every eviction unlink is preceded by a
committed journal row for its key and followed by the transaction that deletes it. A clean
unmount of the last mount sets `clean`; the next mount then trusts the index and serves at
once. After a crash, recovery fixes only the staging names and journaled keys (the items in
flight when it died), rebuilds the counters, and sets `verify_pending`: every mount then
checksums each item on its first hit (and the recovering mount verifies the rest in the
background), so a torn file is never served.

The caching *policy* (which item to admit, which to evict) is a `CachePolicy`
(uniform_cache.py), chosen by the dataset's persisted mode: `UniformPolicy` (SiloD's) or
`LruPolicy` (lru_cache.py, for irregular jobs); this module is only the mechanics. A policy
that `uses_recency` gets the hits noted in memory (a dict store on the hit path, no I/O) and
stamped on the item files' mtimes every control tick and before victims are chosen. A policy
that `evicts_to_admit` chooses victims from a read snapshot, journals them like any eviction,
and has them removed (rows, counters, files) in the transaction that admits the item, so the
cached bytes never exceed the allocation, in the index or on disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
from collections.abc import Callable
import math
import os
import random
import shutil
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fuse_client import lru_cache
from fuse_client.lru_cache import CacheMode
from fuse_client.single_flight import NodeItemLocks
from fuse_client.uniform_cache import CachedItem, CachePolicy

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


def fd_matches(fd: int, size: int, crc: int) -> bool:
    return os.fstat(fd).st_size == size and file_crc32(fd, size) == crc


@dataclass(frozen=True)
class CacheUsage:
    cached_bytes: int
    items_cached: int
    allocation_bytes: int


@dataclass(frozen=True)
class RecoveryReport:
    ran: bool
    clean: bool = False  # the previous mount unmounted cleanly: nothing was checked
    verified: int = 0
    dropped_corrupt: int = 0
    dropped_unindexed: int = 0
    dropped_missing_rows: int = 0
    removed_staging: int = 0
    journaled: int = 0  # items in flight at the crash (the only ones checked before serving)
    seconds: float = 0.0


_META_DEFAULTS = {"allocation_bytes": UNLIMITED_BYTES, "clean": 0, "verify_pending": 0}


@dataclass(eq=False)
class _Admission:
    """One fetched item waiting to be admitted (`DatasetCache.publish`); `outcome` is set, under
    the write lock, once its transaction committed: admitted, present (admitted by another
    process meanwhile), refused (does not fit), or failed (`error`)."""

    key: str
    staging: Path
    size: int
    crc: int
    outcome: str | None = None
    error: BaseException | None = None


class DatasetCache:
    """One dataset's cache directory. Thread-safe; one instance per mount process."""

    def __init__(self, cache_dir: Path, dataset: str) -> None:
        self.root = Path(cache_dir) / dataset
        self.items_dir = self.root / "items"
        self.staging_dir = self.root / "staging"
        self.transient_dir = self.root / "transient"
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)  # private to the data path: a job reads items only through its mount
        for d in (self.items_dir, self.staging_dir, self.transient_dir):
            d.mkdir(parents=True, exist_ok=True)
        for i in range(256):
            (self.items_dir / f"{i:02x}").mkdir(exist_ok=True)
        self._items_prefix = str(self.items_dir) + "/"
        self._db_path = self.root / "index.sqlite"
        self._local = threading.local()
        # One write transaction at a time inside this process: its threads queue here, on a
        # lock that wakes the next one as the last commits, instead of in SQLite's busy
        # handler, which sleeps and retries (1, 2, 5, 10... ms) - with 16 fetch threads each
        # admitting an item it slept twice per small miss. Other processes still meet
        # BEGIN IMMEDIATE's lock and the busy timeout.
        self._write_lock = threading.Lock()
        # Items waiting for their admission transaction (group commit, see `publish`).
        self._pending: list[_Admission] = []
        self._pending_lock = threading.Lock()
        self.admission_commits = 0  # transactions that admitted fetched items (stats)
        self.busy_timeout_s = 30.0  # SQLite's wait for another process's write transaction
        self._alive_fd: int | None = None
        self.locks = NodeItemLocks(self.root / "fetch.lock")
        # Read by the hit path; refreshed from the index by `refresh_verify_pending`.
        self.verify_pending = False
        # Called with each key this process evicts, right after its unlink (see _evicted).
        self.on_evicted: Callable[[str], None] | None = None
        with self._tx() as db:
            db.execute("CREATE TABLE IF NOT EXISTS items (key TEXT PRIMARY KEY, size INTEGER NOT NULL, crc INTEGER NOT NULL)")
            db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
            db.execute("CREATE TABLE IF NOT EXISTS journal (key TEXT PRIMARY KEY)")
            fresh = db.execute("SELECT COUNT(*) FROM meta").fetchone()[0] == 0
            for name, value in _META_DEFAULTS.items():
                db.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", (name, value))
            if db.execute("SELECT 1 FROM meta WHERE name = 'cached_bytes'").fetchone() is None:
                # An index written before the counters existed: count once, then keep counting.
                self._rebuild_counters(db)
                db.execute("UPDATE meta SET value = 0 WHERE name = 'clean'")
            if fresh:  # a brand-new cache has nothing to repair: its first mount is not a recovery
                db.execute("UPDATE meta SET value = 1 WHERE name = 'clean'")
        # Hits of a recency-using policy (LRU), stamped on the item files by flush_recency().
        self.recency = lru_cache.RecencyLog()
        # The policy follows the dataset's mode, a file next to the index (shared by every
        # mount on the node, kept across restarts); the hit path reads only `_note_hits`.
        self._use_policy(lru_cache.policy_for(lru_cache.read_mode(self.root)))

    # -- SQLite ------------------------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self._db_path, timeout=self.busy_timeout_s, isolation_level=None)
            # Switching a fresh index to WAL needs an exclusive lock that SQLite's busy handler
            # does not wait for; two mounts starting together on a new cache would race.
            for attempt in range(200):
                try:
                    if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                        db.execute("PRAGMA journal_mode=WAL")
                    break
                except sqlite3.OperationalError:
                    if attempt == 199:
                        raise
                    time.sleep(0.01)
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
        return db

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """A write transaction that excludes every other writer on the node (BEGIN IMMEDIATE)."""
        with self._write_lock, self._tx_held() as db:
            yield db

    @contextlib.contextmanager
    def _tx_held(self) -> Iterator[sqlite3.Connection]:
        """`_tx` for a caller that holds `_write_lock` already."""
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    @staticmethod
    def _meta(db: sqlite3.Connection, name: str) -> int:
        return db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()[0]

    @staticmethod
    def _set_meta(db: sqlite3.Connection, name: str, value: int) -> None:
        db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (name, int(value)))

    @staticmethod
    def _add_counters(db: sqlite3.Connection, nbytes: int, nitems: int) -> None:
        db.execute("UPDATE meta SET value = value + ? WHERE name = 'cached_bytes'", (nbytes,))
        db.execute("UPDATE meta SET value = value + ? WHERE name = 'items_cached'", (nitems,))

    def _rebuild_counters(self, db: sqlite3.Connection) -> None:
        cached, count = db.execute("SELECT COALESCE(SUM(size), 0), COUNT(*) FROM items").fetchone()
        self._set_meta(db, "cached_bytes", cached)
        self._set_meta(db, "items_cached", count)

    def _journal(self, keys: list[str]) -> None:
        """Commit the keys whose files are about to change, before touching the files."""
        with self._tx() as db:
            db.executemany("INSERT OR IGNORE INTO journal VALUES (?)", [(k,) for k in keys])

    # -- paths -------------------------------------------------------------------------------

    def item_path(self, key: str) -> Path:
        return self.items_dir / key[:2] / key

    def _item_str(self, key: str) -> str:
        # A str, not a Path: building a Path per item was 2/3 of an LRU victim scan.
        return f"{self._items_prefix}{key[:2]}/{key}"

    # -- lifetime and recovery ---------------------------------------------------------------

    def attach(self) -> RecoveryReport:
        """Join the set of live mounts of this cache; the first one to arrive runs recovery.

        A mount holds a shared flock on alive.lock for its lifetime. If we can take it
        exclusively, no other mount is alive, so leftovers from crashed ones can be cleaned
        without racing a live writer. Every mount clears `clean` once it is in: a crash of
        any live mount must leave the index marked unclean.
        """
        fd = os.open(self.root / "alive.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self._alive_fd = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fcntl.flock(fd, fcntl.LOCK_SH)
            with self._tx() as db:
                self._set_meta(db, "clean", 0)
            self.refresh_verify_pending()
            return RecoveryReport(ran=False)
        try:
            report = self._recover()
        finally:
            fcntl.flock(fd, fcntl.LOCK_SH)
        self.refresh_verify_pending()
        return report

    # The IO rate the data manager last gave each job, kept beside the allocation: a mount
    # restarted while the manager is down throttles at it instead of running unthrottled.
    # Stored in bytes/s (the meta table holds integers); absent: never set.
    def saved_io_rate(self, job: str) -> float | None:
        row = self._db().execute("SELECT value FROM meta WHERE name = ?", (f"io_rate:{job}",)).fetchone()
        return None if row is None else (math.inf if row[0] < 0 else float(row[0]))

    def save_io_rate(self, job: str, rate: float) -> None:
        value = -1 if math.isinf(rate) else int(round(rate))
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (f"io_rate:{job}", value))

    def detach(self, clean: bool = True) -> bool:
        """Leave the set of live mounts; the last one marks the index clean. Returns that."""
        marked = False
        with contextlib.suppress(OSError):
            self.flush_recency()  # the last tick's LRU hits survive the restart too
        if self._alive_fd is not None and clean:
            try:
                fcntl.flock(self._alive_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass  # other mounts are alive; the last of them marks the index
            else:
                with self._tx() as db:
                    if db.execute("SELECT 1 FROM journal LIMIT 1").fetchone() is None:
                        self._set_meta(db, "clean", 1)
                        marked = True
        if self._alive_fd is not None:
            os.close(self._alive_fd)
            self._alive_fd = None
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None
        return marked

    def _remove_leftovers(self, db: sqlite3.Connection) -> tuple[int, int]:
        """Remove staging and transient files; a staging file whose key has no index row may
        have been linked into items/ by an admission that never committed: unlink that too."""
        removed = unindexed = 0
        for entry in os.scandir(self.staging_dir):
            key = entry.name.split(".", 1)[0]
            if len(key) == 40 and db.execute("SELECT 1 FROM items WHERE key = ?", (key,)).fetchone() is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.item_path(key))
                    unindexed += 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed += 1
        for entry in os.scandir(self.transient_dir):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed += 1
        legacy_locks = self.root / "locks"  # per-item lock files of earlier versions
        if legacy_locks.is_dir():
            shutil.rmtree(legacy_locks, ignore_errors=True)
        return removed, unindexed

    def _recover(self) -> RecoveryReport:
        t0 = time.monotonic()
        with self._tx() as db:
            removed_staging, unindexed = self._remove_leftovers(db)
            clean = self._meta(db, "clean") == 1
            self._set_meta(db, "clean", 0)
            if clean:
                return RecoveryReport(ran=True, clean=True, removed_staging=removed_staging, seconds=time.monotonic() - t0)
            verified = corrupt = missing = 0
            journaled = [k for (k,) in db.execute("SELECT key FROM journal")]
            for key in journaled:
                row = db.execute("SELECT size, crc FROM items WHERE key = ?", (key,)).fetchone()
                path = self.item_path(key)
                if row is None:
                    # Renamed but its admission never committed, or evicted: nothing vouches for it.
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                        unindexed += 1
                    continue
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    db.execute("DELETE FROM items WHERE key = ?", (key,))  # unlinked by an eviction
                    missing += 1
                    continue
                try:
                    ok = fd_matches(fd, *row)
                finally:
                    os.close(fd)
                if ok:
                    verified += 1
                else:
                    log.warning("cache item %s fails its checksum; dropping it", key)
                    os.unlink(path)
                    db.execute("DELETE FROM items WHERE key = ?", (key,))
                    corrupt += 1
            db.execute("DELETE FROM journal")
            self._rebuild_counters(db)
            # Items not in flight are checked lazily: on first hit, and in the background.
            self._set_meta(db, "verify_pending", 1 if self._meta(db, "items_cached") else 0)
        return RecoveryReport(
            ran=True, verified=verified, dropped_corrupt=corrupt, dropped_unindexed=unindexed,
            dropped_missing_rows=missing, removed_staging=removed_staging, journaled=len(journaled),
            seconds=time.monotonic() - t0,
        )

    # -- verification after a crash ----------------------------------------------------------

    def refresh_verify_pending(self) -> bool:
        self.verify_pending = self._meta(self._db(), "verify_pending") == 1
        return self.verify_pending

    def verify_item(self, key: str, fd: int) -> bool:
        """Check an open cached item against its row; drop it (and return False) if it fails."""
        row = self._db().execute("SELECT size, crc FROM items WHERE key = ?", (key,)).fetchone()
        if row is not None and fd_matches(fd, *row):
            return True
        log.warning("cache item %s %s; dropping it", key, "has no index row" if row is None else "fails its checksum")
        self.drop(key)
        return False

    def verify_batch(self, after: str, limit: int = 256) -> tuple[str | None, int, int]:
        """Verify up to `limit` items with key > `after`. Returns (last key or None at the end, checked, dropped)."""
        rows = self._db().execute("SELECT key FROM items WHERE key > ? ORDER BY key LIMIT ?", (after, limit)).fetchall()
        checked = dropped = 0
        for (key,) in rows:
            fd = self._open_item(key)  # not a use: verifying must not make every item recent
            if fd is None:
                self.drop(key)
                dropped += 1
                continue
            try:
                if not self.verify_item(key, fd):
                    dropped += 1
            finally:
                os.close(fd)
            checked += 1
        return (rows[-1][0] if rows else None), checked, dropped

    def finish_verification(self) -> None:
        with self._tx() as db:
            self._set_meta(db, "verify_pending", 0)
        self.verify_pending = False

    def drop(self, key: str) -> int:
        """Remove one item (row, counters, file); returns its size, 0 if it was not indexed."""
        self._journal([key])
        with self._tx() as db:
            row = db.execute("SELECT size FROM items WHERE key = ?", (key,)).fetchone()
            if row is not None:
                db.execute("DELETE FROM items WHERE key = ?", (key,))
                self._add_counters(db, -row[0], -1)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.item_path(key))
            db.execute("DELETE FROM journal WHERE key = ?", (key,))
        return 0 if row is None else row[0]

    # -- hit path ----------------------------------------------------------------------------

    def open_cached(self, key: str) -> int | None:
        """A read-only fd of the cached item, or None. No SQLite: this is the hot path.

        Under a recency-using policy (LRU) a hit is noted in memory; the I/O (a utime) happens
        in flush_recency, off this path."""
        try:
            fd = os.open(f"{self._items_prefix}{key[:2]}/{key}", os.O_RDONLY)
        except FileNotFoundError:
            return None
        if self._note_hits:
            self.recency.note(key)
        return fd

    def still_cached(self, key: str, fd: int) -> bool:
        """Whether `fd`, a descriptor of the cached item `key` opened earlier, is still in the
        cache, noted as a use like open_cached. Evictions unlink the item's only name, so a link
        count of 0 means it was evicted (by this or another process) since: one fstat, no path
        walk, for front ends that keep descriptors of hot items across opens."""
        if os.fstat(fd).st_nlink == 0:
            return False
        if self._note_hits:
            self.recency.note(key)
        return True

    def _open_item(self, key: str) -> int | None:
        """Open a cached item without counting it as a use (verification reads)."""
        try:
            return os.open(f"{self._items_prefix}{key[:2]}/{key}", os.O_RDONLY)
        except FileNotFoundError:
            return None

    # -- miss path ---------------------------------------------------------------------------

    def take_transient(self, key: str) -> int | None:
        """Open the not-admitted copy another process fetched while we waited; the last waiter removes it."""
        path = self.transient_dir / key
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        if not self.locks.others_waiting(key):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return fd

    def new_staging_file(self, key: str) -> tuple[int, Path]:
        path = self.staging_dir / f"{key}.{os.getpid()}.{threading.get_ident()}.{random.getrandbits(32):08x}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        return fd, path

    def publish(self, key: str, staging: Path, size: int, crc: int) -> bool:
        """Admit a completely fetched item if the policy says so: one transaction, O(log n)
        while the item fits.

        The staging file is hard-linked into items/ inside the transaction that records the
        checksum and the counters, so no other process can evict or count the item half-way.
        The staging file is the journal: it is removed only after the commit, so a crash
        between link and commit leaves `staging/<key>.*` behind and recovery unlinks the
        unindexed `items/<key>`. On success the staging name is gone; on refusal it is kept.

        If the item does not fit and the policy evicts to admit (LRU), see `_evict_and_admit`.

        Group commit: the items of misses that publish while another thread's transaction runs
        are admitted together, in one transaction run by whichever of them gets the write lock
        first; each call still returns only after its own item is committed (or refused).
        A transaction costs ~23 system calls (file locks, WAL writes, page reads) and the thread
        switches around them; a batch pays them once.
        """
        req = _Admission(key, staging, size, crc)
        with self._pending_lock:
            self._pending.append(req)
        with self._write_lock:
            if req.outcome is None:  # not committed by an earlier holder: commit every pending one
                with self._pending_lock:
                    batch, self._pending = self._pending, []
                self._admit_pending(batch)
        if req.error is not None:
            raise req.error
        if req.outcome == "present":
            return False
        if req.outcome == "refused":
            return self._evict_and_admit(key, staging, size, crc)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
        return True

    def _admit_pending(self, batch: list[_Admission]) -> None:
        """Under `_write_lock`: one transaction admitting every item of `batch` that fits, each
        given its outcome. If it fails, nothing of it is committed and each item is tried in a
        transaction of its own, so an error reaches only the call whose item caused it."""
        try:
            # Few statements: each is a GIL release and a thread switch or two under load.
            with self._tx_held() as db:
                meta = dict(db.execute("SELECT name, value FROM meta WHERE name IN ('cached_bytes', 'allocation_bytes')"))
                cached, allocation = meta["cached_bytes"], meta["allocation_bytes"]
                added, admitted = 0, set()
                outcomes = []
                for req in batch:
                    if req.key in admitted:
                        outcomes.append("present")
                    elif self.policy.should_admit(cached + added, req.size, allocation):
                        if not db.execute("INSERT OR IGNORE INTO items VALUES (?, ?, ?)",
                                          (req.key, req.size, req.crc)).rowcount:
                            outcomes.append("present")  # another process admitted it meanwhile
                            continue
                        self._link_item(req.key, req.staging)
                        added += req.size
                        admitted.add(req.key)
                        outcomes.append("admitted")
                    elif db.execute("SELECT 1 FROM items WHERE key = ?", (req.key,)).fetchone():
                        outcomes.append("present")
                    else:
                        outcomes.append("refused")
                if admitted:
                    db.execute("UPDATE meta SET value = value + CASE name WHEN 'cached_bytes' THEN ? ELSE ? END "
                               "WHERE name IN ('cached_bytes', 'items_cached')", (added, len(admitted)))
            self.admission_commits += 1
        except BaseException as exc:
            if len(batch) == 1:
                batch[0].error, batch[0].outcome = exc, "failed"
                return
            for req in batch:
                self._admit_pending([req])
            return
        for req, outcome in zip(batch, outcomes):
            req.outcome = outcome

    def _admit(self, db: sqlite3.Connection, key: str, staging: Path, size: int, crc: int) -> None:
        """Inside a transaction: the row, the counters and the link into items/."""
        db.execute("INSERT INTO items VALUES (?, ?, ?)", (key, size, crc))
        self._add_counters(db, size, 1)
        self._link_item(key, staging)

    def _link_item(self, key: str, staging: Path) -> None:
        target = self.item_path(key)
        try:
            os.link(staging, target)
        except FileExistsError:
            # An unindexed leftover (e.g. a crash of a mount that did not run recovery yet).
            os.unlink(target)
            os.link(staging, target)

    def _evict_and_admit(self, key: str, staging: Path, size: int, crc: int, attempts: int = 3) -> bool:
        """Eviction at admission (a policy that `evicts_to_admit`, i.e. LRU).

        The policy chooses victims from a read snapshot of the index and the items' stamps (the
        O(n) part, once per batch of evictions, outside any write lock); their keys are
        journaled in a committed row, like every eviction. Then one transaction re-checks the
        room, removes the victims (rows, counters, files) and admits the item, so no mount ever
        sees the dataset over its allocation, in the index or on disk. If other mounts changed
        the cache in between so that the victims no longer make room, nothing is evicted and
        the choice is made again (a few times; then the item is not admitted).
        """
        for _ in range(attempts):
            db = self._db()
            allocation = self._meta(db, "allocation_bytes")
            policy = self.refresh_policy()  # fresh: another mount may have switched the mode
            if not policy.evicts_to_admit(size, allocation):
                return False
            victims = policy.admission_victims(self._policy_items(db, policy), allocation, size)
            if victims:
                self._journal([v.key for v in victims])
            admitted = False
            with self._tx() as db:
                if db.execute("SELECT 1 FROM items WHERE key = ?", (key,)).fetchone() is not None:
                    db.executemany("DELETE FROM journal WHERE key = ?", [(v.key,) for v in victims])
                    return False  # another mount admitted it meanwhile
                present = [v for v in victims
                           if db.execute("SELECT 1 FROM items WHERE key = ?", (v.key,)).fetchone() is not None]
                cached = self._meta(db, "cached_bytes")
                allocation = self._meta(db, "allocation_bytes")
                if self.policy.should_admit(cached - sum(v.size for v in present), size, allocation):
                    for item in present:
                        db.execute("DELETE FROM items WHERE key = ?", (item.key,))
                        self._add_counters(db, -item.size, -1)
                        # Unlinked inside the transaction (journaled above): a reader that has
                        # the fd keeps reading; a new open sees ENOENT and treats it as a miss.
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(self.item_path(item.key))
                        self._evicted(item.key)
                    self._admit(db, key, staging, size, crc)
                    admitted = True
                db.executemany("DELETE FROM journal WHERE key = ?", [(v.key,) for v in victims])
            if admitted:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(staging)
                return True
        return False

    def keep_transient(self, key: str, staging: Path) -> None:
        """Expose a not-admitted item to the processes waiting for it (marked in fetch.lock)."""
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
            self._set_meta(db, "allocation_bytes", allocation_bytes)
        return self.enforce_allocation()

    def enforce_allocation(self, rng: random.Random | None = None) -> int:
        """Evict the policy's victims until the cached bytes fit the allocation; returns bytes evicted.

        O(1) when the dataset fits (the common case, checked every tick); a shrink reads the
        index once (and, under LRU, the items' stamps) to let the policy choose.
        """
        db = self._db()
        if self._meta(db, "cached_bytes") <= self._meta(db, "allocation_bytes"):
            return 0
        policy = self.refresh_policy()  # uniform evicts random items, LRU the least recent
        victims = policy.choose_evictions(self._policy_items(db, policy), self._meta(db, "allocation_bytes"), rng)
        if not victims:
            return 0
        self._journal([v.key for v in victims])
        evicted = 0
        with self._tx() as db:
            allocation = self._meta(db, "allocation_bytes")
            cached = self._meta(db, "cached_bytes")
            for item in victims:
                # Another mount may have evicted concurrently: stop as soon as the dataset fits.
                if cached <= allocation:
                    break
                if db.execute("DELETE FROM items WHERE key = ?", (item.key,)).rowcount:
                    # Unlink inside the transaction: a reader that already has the fd keeps
                    # reading; a new open sees ENOENT and treats the item as a miss.
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.item_path(item.key))
                    self._evicted(item.key)
                    self._add_counters(db, -item.size, -1)
                    cached -= item.size
                    evicted += item.size
            db.executemany("DELETE FROM journal WHERE key = ?", [(v.key,) for v in victims])
        return evicted

    def _evicted(self, key: str) -> None:
        """Tell the front end (on_evicted) right after each unlink, so descriptors it keeps of
        the item are closed now: disk use then exceeds the allocation by at most the one item
        being evicted, not by every kept item until a sweep."""
        hook = self.on_evicted
        if hook is not None:
            try:
                hook(key)
            except Exception:  # never fail an eviction for it: the sweep closes it later
                log.exception("closing kept descriptors of evicted item %s failed", key)

    def _policy_items(self, db: sqlite3.Connection, policy: CachePolicy) -> list[CachedItem]:
        """Every indexed item, with its last use if the policy wants it (this process's noted
        hits are stamped first; other mounts' are at most a control tick late)."""
        rows = db.execute("SELECT key, size FROM items").fetchall()
        if not policy.uses_recency:
            return [CachedItem(k, s) for k, s in rows]
        self.flush_recency()
        return lru_cache.stamp(rows, self._item_str)

    # -- cache mode (uniform | lru): which policy ----------------------------------------------

    def _use_policy(self, policy: CachePolicy) -> None:
        self.policy = policy
        self._note_hits = policy.uses_recency  # the one thing the hit path reads

    @property
    def mode(self) -> CacheMode:
        return CacheMode(self.policy.name)

    def set_mode(self, mode: CacheMode) -> int:
        """Switch the dataset's cache to `mode` (latest writer wins, like the allocation),
        persist it next to the index and enforce the allocation under it; returns bytes evicted."""
        mode = CacheMode(mode)
        if lru_cache.read_mode(self.root) is not mode:
            lru_cache.write_mode(self.root, mode)
        self._use_policy(lru_cache.policy_for(mode))
        return self.enforce_allocation()

    def refresh_policy(self) -> CachePolicy:
        """Re-read the mode another mount may have set; returns the policy now in use."""
        mode = lru_cache.read_mode(self.root)
        if mode is not self.mode:
            self._use_policy(lru_cache.policy_for(mode))
        return self.policy

    def refresh_mode(self) -> CacheMode:
        """Re-read the mode another mount may have set (every control tick)."""
        return CacheMode(self.refresh_policy().name)

    def flush_recency(self) -> int:
        """Write this process's noted hits to the items' stamps (every control tick, before
        choosing victims and at detach); returns how many items were stamped."""
        return self.recency.flush(self._item_str)

    def usage(self) -> CacheUsage:
        """O(1): the counters kept with the index."""
        rows = dict(self._db().execute("SELECT name, value FROM meta WHERE name IN ('cached_bytes', 'items_cached', 'allocation_bytes')"))
        return CacheUsage(cached_bytes=rows["cached_bytes"], items_cached=rows["items_cached"], allocation_bytes=rows["allocation_bytes"])

    def close(self) -> None:
        self.locks.close()
