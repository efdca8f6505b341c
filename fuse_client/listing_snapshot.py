"""The dataset listing of the last mount, kept in the cache directory so a remount needs no full listing.

Listing a remote dataset is the slow part of a mount at scale (100k local files: ~5 s here;
1.28M: ~45 s; an object store: one request per 1,000 keys). Datasets are immutable while
mounted, and the cache already assumes an item's content does not change between mounts (it is
keyed by path), so a remount may start from the previous listing of the *same source URL*:

- before trusting a snapshot, the mount reads one byte of one item with its own credentials, so
  a mount that cannot reach (or is not allowed to read) the source still fails as before;
- the source is listed again in the background; if it changed, the mount keeps serving the
  listing it started with (item numbers index the epoch bitset and must not shift under a running
  job), logs a warning, and saves the new listing for the next mount.

The file is the listing's columns (listing.py) as they are in memory, after a header line: it
is read into them without a per-item object (a JSON snapshot of 1.5M items took ~150 MB to load).
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from array import array
from pathlib import Path

from fuse_client.listing import DatasetListing

log = logging.getLogger(__name__)

FORMAT = "silod-listing-v2"
_COLUMNS = (("paths", None), ("offsets", "Q"), ("sizes", "Q"), ("dirs", None), ("dir_offsets", "Q"))


def snapshot_path(cache_root: Path) -> Path:
    return cache_root / "listing.bin"


def load(path: Path, source: str) -> DatasetListing | None:
    """The saved listing of `source`, or None (missing, another source, or malformed)."""
    try:
        with open(path, "rb") as f:
            header = json.loads(f.readline(1 << 16))
            if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("source") != source:
                return None
            crc = 0
            columns = {}
            for name, typecode in _COLUMNS:
                n = header["bytes"][name]
                data = f.read(n)
                if len(data) != n:
                    raise ValueError(f"{name} is cut short")
                crc = zlib.crc32(data, crc)
                if typecode is None:
                    columns[name] = bytearray(data)
                else:
                    columns[name] = array(typecode)
                    columns[name].frombytes(data)
                del data
            if f.read(1) or crc != header["crc"]:
                raise ValueError("checksum or length differs")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the listing snapshot %s: %s", path, exc)
        return None
    n = len(columns["sizes"])
    if not n or len(columns["offsets"]) != n + 1 or columns["offsets"][-1] != len(columns["paths"]) \
            or not columns["dir_offsets"] or columns["dir_offsets"][-1] != len(columns["dirs"]):
        log.warning("ignoring the listing snapshot %s: its columns disagree", path)
        return None
    return DatasetListing.from_columns(**columns)


def save(path: Path, source: str, listing: DatasetListing) -> None:
    """Write atomically (temp file + rename): a reader sees the old or the new snapshot.

    The temp file goes to staging/, which crash recovery empties, so a mount that exits
    while writing leaves nothing behind for long."""
    columns = listing.columns()
    blobs = [memoryview(columns[name]).cast("B") for name, _ in _COLUMNS]
    crc = 0
    for blob in blobs:
        crc = zlib.crc32(blob, crc)
    header = {"format": FORMAT, "source": source, "crc": crc,
              "bytes": {name: len(blob) for (name, _), blob in zip(_COLUMNS, blobs)}}
    tmp = path.parent / "staging" / f"listing.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(json.dumps(header).encode() + b"\n")
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)
    old = path.parent / "listing.json"  # the format before this one
    if old.exists():
        old.unlink()


def same(a: DatasetListing, b: DatasetListing) -> bool:
    return a.same(b)
