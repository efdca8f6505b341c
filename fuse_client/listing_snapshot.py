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
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from fuse_client.remote import DatasetListing

log = logging.getLogger(__name__)

FORMAT = "silod-listing-v1"


def snapshot_path(cache_root: Path) -> Path:
    return cache_root / "listing.json"


def load(path: Path, source: str) -> DatasetListing | None:
    """The saved listing of `source`, or None (missing, another source, or malformed)."""
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring the listing snapshot %s: %s", path, exc)
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("source") != source:
        return None
    paths, sizes = data.get("paths"), data.get("sizes")
    if not (isinstance(paths, list) and isinstance(sizes, list) and len(paths) == len(sizes) and paths):
        return None
    if not all(isinstance(p, str) for p in paths) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        return None
    return DatasetListing.from_sizes(dict(zip(paths, sizes)))


def save(path: Path, source: str, listing: DatasetListing) -> None:
    """Write atomically (temp file + rename): a reader sees the old or the new snapshot.

    The temp file goes to staging/, which crash recovery empties, so a mount that exits
    while writing leaves nothing behind for long."""
    entries = sorted(listing.files.values(), key=lambda e: e.index)
    body = {"format": FORMAT, "source": source, "paths": [e.path for e in entries], "sizes": [e.size for e in entries]}
    tmp = path.parent / "staging" / f"listing.{os.getpid()}.tmp"
    # dumps, not dump: dump streams through the pure-Python encoder, which held the GIL for
    # seconds at 1.28M items while the mount's first misses waited for it; dumps is one C call.
    data = json.dumps(body, separators=(",", ":"))
    with open(tmp, "w") as f:
        f.write(data)
    os.replace(tmp, path)


def same(a: DatasetListing, b: DatasetListing) -> bool:
    return len(a.files) == len(b.files) and all(b.files.get(p) == e for p, e in a.files.items())
