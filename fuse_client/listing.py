"""The dataset listing: every item's path and size, held in a few bytes per item.

A mount keeps its listing for its lifetime, in a root process that shares the node agent's
memory limit with every other tenant's mounts, and the source decides how long the listing is.
As a dict of path -> NamedTuple (and a list of child names per directory) an item cost about
0.4 KB: 1.5M entries took the mount to ~650 MB. Here the listing is columns:

- the sorted paths, UTF-8, in one buffer with an array of offsets (path length + 8 bytes);
- the sizes in an array (8 bytes);
- the directories (every prefix of a path) the same way.

An item's number is its place in the sorted listing (its bit in the epoch bitset), as before.
A path is found by bisecting the buffer (a few microseconds, once per name: the kernel keeps
the entries), a directory's children by bisecting to each child in turn.

Entries arrive in whatever order the source lists them; `ListingBuilder` collects them in a
private temporary SQLite database on disk, which sorts (and catches duplicates) in bounded
memory, then fills the columns in one pass.
"""

from __future__ import annotations

import bisect
import sqlite3
from array import array
from collections.abc import Iterator, Mapping
from typing import NamedTuple


class FileEntry(NamedTuple):
    """One item of the listing, made when asked for (the listing keeps columns, not entries)."""

    index: int  # position in the sorted listing; the bit of this item in the epoch bitset
    path: str  # relative to the dataset root, '/'-separated
    size: int


def encode(path: str) -> bytes:
    # surrogateescape: a local file name that is not UTF-8 keeps its bytes (os.scandir's spelling)
    return path.encode("utf-8", "surrogateescape")


def decode(raw: bytes | bytearray) -> str:
    return raw.decode("utf-8", "surrogateescape")


class _Column:
    """Sorted byte strings in one buffer: the i-th is buf[offsets[i]:offsets[i + 1]]."""

    __slots__ = ("buf", "offsets")

    def __init__(self, buf: bytearray, offsets: array) -> None:
        self.buf, self.offsets = buf, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> bytearray:  # what bisect reads
        o = self.offsets
        return self.buf[o[i]:o[i + 1]]

    def find(self, key: bytes) -> int:
        i = bisect.bisect_left(self, key)
        return i if i < len(self) and self[i] == key else -1

    @classmethod
    def fill(cls, rows: Iterator[bytes], count: int, nbytes: int) -> "_Column":
        """From `count` sorted strings of `nbytes` in all: the buffer is sized once (growing a
        buffer may hold the old and the new one at once)."""
        buf = bytearray(nbytes)
        offsets = array("Q", bytes(8 * (count + 1)))
        at = 0
        for i, raw in enumerate(rows):
            offsets[i] = at
            buf[at:at + len(raw)] = raw
            at += len(raw)
        offsets[count] = at
        return cls(buf, offsets)


class DatasetListing:
    """The listing's columns, with mapping views (`files`: path -> FileEntry, `dirs`: directory
    path -> child names, '' the root) for the code that asks by name."""

    def __init__(self, paths: _Column, sizes: array, dirs: _Column) -> None:
        self._paths, self._sizes, self._dirs = paths, sizes, dirs
        self.total_bytes = sum(sizes)
        self.files = _Files(self)
        self.dirs = _Dirs(self)

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def num_dirs(self) -> int:
        return len(self._dirs)

    def entry(self, index: int) -> FileEntry:
        return FileEntry(index, decode(self._paths[index]), self._sizes[index])

    def find(self, path: str) -> int:
        """The index of the item at `path`, or -1."""
        return self._paths.find(encode(path))

    def dir_index(self, path: str) -> int:
        """The place of directory `path` among the sorted directories ('' is 0), or -1."""
        return self._dirs.find(encode(path))

    def dir_path(self, index: int) -> str:
        return decode(self._dirs[index])

    def children(self, path: str) -> list[str] | None:
        """The names in directory `path`, in the listing's order (a directory where its first
        item is), or None if it is not one. Costs a bisect per child, whatever lies beneath."""
        if path and self.dir_index(path) < 0:
            return None
        paths = self._paths
        prefix = encode(path) + b"/" if path else b""
        start = len(prefix)
        i, end = (bisect.bisect_left(paths, prefix), bisect.bisect_left(paths, prefix[:-1] + b"0")) if path \
            else (0, len(paths))  # b"0" is the byte after b"/": the end of everything under prefix
        out = []
        while i < end:
            rest = paths[i][start:]
            slash = rest.find(b"/")
            if slash < 0:
                out.append(decode(rest))
                i += 1
            else:
                out.append(decode(rest[:slash]))
                i = bisect.bisect_left(paths, prefix + rest[:slash] + b"0", i, end)
        return out

    def same(self, other: "DatasetListing") -> bool:
        return (self._sizes == other._sizes and self._paths.offsets == other._paths.offsets
                and self._paths.buf == other._paths.buf)

    def columns(self) -> dict:
        """The raw columns, for the listing snapshot."""
        return {"paths": self._paths.buf, "offsets": self._paths.offsets, "sizes": self._sizes,
                "dirs": self._dirs.buf, "dir_offsets": self._dirs.offsets}

    @classmethod
    def from_columns(cls, paths: bytearray, offsets: array, sizes: array, dirs: bytearray,
                     dir_offsets: array) -> "DatasetListing":
        return cls(_Column(paths, offsets), sizes, _Column(dirs, dir_offsets))

    @classmethod
    def from_sizes(cls, sizes: Mapping[str, int]) -> "DatasetListing":
        builder = ListingBuilder()
        try:
            for path, size in sizes.items():
                builder.add(path, size)
            return builder.build()
        finally:
            builder.close()


class _Files(Mapping):
    """path -> FileEntry over the columns (entries are made when asked for)."""

    def __init__(self, listing: DatasetListing) -> None:
        self._l = listing

    def get(self, path, default=None):
        i = self._l.find(path) if isinstance(path, str) else -1
        return self._l.entry(i) if i >= 0 else default

    def __getitem__(self, path: str) -> FileEntry:
        entry = self.get(path)
        if entry is None:
            raise KeyError(path)
        return entry

    def __contains__(self, path) -> bool:
        return isinstance(path, str) and self._l.find(path) >= 0

    def __len__(self) -> int:
        return len(self._l)

    def __iter__(self) -> Iterator[str]:
        paths = self._l._paths
        return (decode(paths[i]) for i in range(len(paths)))

    def values(self) -> Iterator[FileEntry]:  # type: ignore[override]
        return (self._l.entry(i) for i in range(len(self._l)))

    def items(self) -> Iterator[tuple[str, FileEntry]]:  # type: ignore[override]
        return ((e.path, e) for e in self.values())


class _Dirs(Mapping):
    """directory path -> its child names (computed when asked for)."""

    def __init__(self, listing: DatasetListing) -> None:
        self._l = listing

    def get(self, path, default=None):
        children = self._l.children(path) if isinstance(path, str) else None
        return default if children is None else children

    def __getitem__(self, path: str) -> list[str]:
        children = self.get(path)
        if children is None:
            raise KeyError(path)
        return children

    def __contains__(self, path) -> bool:
        return isinstance(path, str) and self._l.dir_index(path) >= 0

    def __len__(self) -> int:
        return self._l.num_dirs

    def __iter__(self) -> Iterator[str]:
        return (self._l.dir_path(i) for i in range(self._l.num_dirs))


class DuplicatePath(ValueError):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


class ListingFull(ValueError):
    """The listing's paths passed the byte limit given to the builder."""


class ListingBuilder:
    """Collects (path, size) in any order in a private temporary SQLite database (a file that
    SQLite deletes when it is closed; its page cache is capped), then builds the columns.

    `max_bytes` caps the bytes of the paths, the files' and then the directories' (ListingFull);
    a path added twice raises DuplicatePath
    (when its batch is written: at the latest at `flush`)."""

    _BATCH = 4096

    def __init__(self, max_bytes: int | None = None) -> None:
        # "" is a temporary database on disk, not in memory: its size is the listing's.
        self._db = sqlite3.connect("", isolation_level=None, check_same_thread=False)
        for pragma in ("journal_mode=OFF", "synchronous=OFF", "temp_store=FILE", "cache_size=-4096"):
            self._db.execute(f"PRAGMA {pragma}")
        self._db.execute("CREATE TABLE f (path BLOB PRIMARY KEY, size INTEGER NOT NULL) WITHOUT ROWID")
        self._db.execute("CREATE TABLE d (path BLOB PRIMARY KEY) WITHOUT ROWID")
        self._db.execute("CREATE TABLE pending (id INTEGER PRIMARY KEY, url TEXT NOT NULL)")
        self._db.execute("CREATE TABLE seen (url TEXT PRIMARY KEY) WITHOUT ROWID")
        self._db.execute("BEGIN")
        self._batch: list[tuple[bytes, int]] = []
        self.max_bytes = max_bytes
        self.path_bytes = 0

    def close(self) -> None:
        self._db.close()

    def add(self, path: str, size: int) -> None:
        raw = encode(path)
        self.path_bytes += len(raw)
        if self.max_bytes is not None and self.path_bytes > self.max_bytes:
            raise ListingFull(path)
        self._batch.append((raw, size))
        if len(self._batch) >= self._BATCH:
            self.flush()

    def flush(self) -> None:
        batch, self._batch = self._batch, []
        if not batch:
            return
        self._db.execute("SAVEPOINT batch")
        try:
            self._db.executemany("INSERT INTO f VALUES (?, ?)", batch)
            self._db.execute("RELEASE batch")
        except sqlite3.IntegrityError:  # name the path: insert the batch again one by one
            self._db.execute("ROLLBACK TO batch")
            self._db.execute("RELEASE batch")
            for raw, size in batch:
                try:
                    self._db.execute("INSERT INTO f VALUES (?, ?)", (raw, size))
                except sqlite3.IntegrityError:
                    raise DuplicatePath(decode(raw)) from None

    # -- directories still to list, kept here too: an index may link a million of them --------

    def push(self, url: str) -> bool:
        """Queue directory `url` to be listed, once; False if it was queued before."""
        if self._db.execute("INSERT OR IGNORE INTO seen VALUES (?)", (url,)).rowcount != 1:
            return False
        self._db.execute("INSERT INTO pending (url) VALUES (?)", (url,))
        return True

    def pop(self) -> str | None:
        row = self._db.execute("SELECT id, url FROM pending ORDER BY id DESC LIMIT 1").fetchone()
        if row is None:
            return None
        self._db.execute("DELETE FROM pending WHERE id = ?", (row[0],))
        return row[1]

    def has(self, path: str) -> bool:
        self.flush()
        return self._db.execute("SELECT 1 FROM f WHERE path = ?", (encode(path),)).fetchone() is not None

    # -- the columns ----------------------------------------------------------------------------

    def count(self) -> int:
        self.flush()
        return self._db.execute("SELECT count(*) FROM f").fetchone()[0]

    def build(self) -> DatasetListing:
        self.flush()
        db = self._db
        n, nbytes = db.execute("SELECT count(*), coalesce(sum(length(path)), 0) FROM f").fetchone()
        sizes = array("Q", bytes(8 * n))

        def paths() -> Iterator[bytes]:
            last_parent = b""
            pending: list[tuple[bytes]] = []
            for i, (raw, size) in enumerate(db.execute("SELECT path, size FROM f ORDER BY path")):
                sizes[i] = size
                parent = raw.rpartition(b"/")[0]
                if parent != last_parent:  # its ancestors are directories (most were seen already)
                    last_parent = parent
                    while parent:
                        pending.append((parent,))
                        parent = parent.rpartition(b"/")[0]
                    if len(pending) >= self._BATCH:
                        # another cursor on the same connection while the SELECT is open: SQLite
                        # allows it; the rows go to the other table
                        db.executemany("INSERT OR IGNORE INTO d VALUES (?)", pending)
                        pending.clear()
                yield raw
            db.executemany("INSERT OR IGNORE INTO d VALUES (?)", pending)

        files = _Column.fill(paths(), n, nbytes)
        db.execute("INSERT OR IGNORE INTO d VALUES (?)", (b"",))
        m, dbytes = db.execute("SELECT count(*), coalesce(sum(length(path)), 0) FROM d").fetchone()
        if self.max_bytes is not None and nbytes + dbytes > self.max_bytes:
            # (a file per directory of its own doubles the paths: the directories count too)
            raise ListingFull(f"{nbytes} bytes of file paths and {dbytes} of directory paths")
        dirs = _Column.fill((raw for (raw,) in db.execute("SELECT path FROM d ORDER BY path")), m, dbytes)
        return DatasetListing(files, sizes, dirs)
