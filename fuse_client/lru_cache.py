"""LRU caching for irregular jobs (SiloD §6, §7.4): the policy, the recency stamps, the mode file.

A dataset's cache is either `uniform` (SiloD's default, fuse_client/uniform_cache.py) or `lru`.
Uniform caching relies on each item being read once per epoch in random order; a job that reads
otherwise (curriculum learning samples the easy items again and again) is better served by LRU,
where a newly cached item helps at once. The scheduler puts datasets that only irregular jobs
read in LRU mode, inside the irregular partition's cache budget (scheduler/core/partition.py).

LRU here is a `CachePolicy` (uniform_cache.py) that the on-disk cache (cache_store.py) plugs in
when the dataset's mode is `lru`. It:
- admits every fetched item that fits in the allocation at all, and **evicts at admission**:
  the least recently used items go, inside the admitting transaction (their rows and the
  counters; their files right after the commit, journaled like every eviction), so the counted
  cached bytes never exceed the allocation (not with several mounts admitting at once either);
- evicts in small batches (LRU_BATCH_FRACTION of the allocation below what the new item needs),
  because choosing victims reads every item's stamp, and a full cache would otherwise do that on
  every miss;
- records recency as the item file's mtime. A hit only notes the time in memory (a dict write:
  a futimens() per hit measured 8x slower than the rest of the hit path, benchmarks/bench_lru.py);
  the notes are written to the files' mtimes every control tick (0.5 s) and before this
  process chooses victims. The stamp lives with the item, needs no index write, is shared by
  every mount process on the node (another process sees a hit at most a tick late), and
  survives a restart like the items themselves;
- shrinks by evicting least recently used items (uniform mode evicts random ones).

The mode of a dataset's cache is a small file next to its index, written atomically, so it also
survives a restart; every mount of the dataset on the node re-reads it (admission reads it
fresh; the hit path uses the value refreshed every control tick).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from fuse_client.uniform_cache import CachedItem, CachePolicy, UniformPolicy

log = logging.getLogger(__name__)

MODE_FILE = "cache_mode"
#: Evict this fraction of the allocation beyond what an admission needs, to amortise the scan.
LRU_BATCH_FRACTION = 0.01


class CacheMode(StrEnum):
    UNIFORM = "uniform"
    LRU = "lru"


def parse_mode(value: str, what: str = "--cache-mode") -> CacheMode:
    try:
        return CacheMode(str(value).strip().lower())
    except ValueError:
        raise ValueError(f"{what} {value!r} is not a cache mode; use one of: {', '.join(m.value for m in CacheMode)}") from None


#: An indexed item with its recency (`last_used_ns`: the item file's mtime, admission or last hit).
StampedItem = CachedItem


def choose_lru_evictions(items: Sequence[StampedItem], target_bytes: int, slack_bytes: int = 0) -> list[StampedItem]:
    """Least recently used items whose removal leaves at most `target_bytes` cached ([] if
    the items already fit); then, in the same order, further items as long as they fit in
    `slack_bytes` more (a batch, so the next admissions need no scan). Ties in the stamp go by
    key, so the choice is deterministic."""
    cached = sum(item.size for item in items)
    excess = cached - max(int(target_bytes), 0)
    if excess <= 0:
        return []
    victims: list[StampedItem] = []
    freed = 0
    for item in sorted(items, key=lambda i: (i.last_used_ns, i.key)):
        if freed >= excess and freed + item.size > excess + slack_bytes:
            break
        victims.append(item)
        freed += item.size
    return victims


def admission_victims(items: Sequence[StampedItem], allocation_bytes: int, item_size: int) -> list[StampedItem]:
    """What to evict before admitting `item_size` bytes under `allocation_bytes`: room for the
    item, plus whole items up to LRU_BATCH_FRACTION of the allocation."""
    return choose_lru_evictions(items, allocation_bytes - item_size, int(allocation_bytes * LRU_BATCH_FRACTION))


@dataclass(frozen=True)
class LruPolicy:
    """The CachePolicy of a dataset in `lru` mode. Pure: the store supplies the stamps."""

    name: str = CacheMode.LRU.value
    uses_recency: bool = True

    def should_admit(self, cached_bytes: int, item_size: int, allocation_bytes: int) -> bool:
        return cached_bytes + item_size <= allocation_bytes

    def evicts_to_admit(self, item_size: int, allocation_bytes: int) -> bool:
        return item_size <= allocation_bytes  # an item larger than the allocation never fits

    def admission_victims(self, items: Sequence[CachedItem], allocation_bytes: int, item_size: int) -> list[CachedItem]:
        return admission_victims(items, allocation_bytes, item_size)

    def choose_evictions(
        self, items: Sequence[CachedItem], allocation_bytes: int, rng: random.Random | None = None
    ) -> list[CachedItem]:
        return choose_lru_evictions(items, allocation_bytes)


def policy_for(mode: CacheMode) -> CachePolicy:
    """The caching policy of a dataset cache in `mode`."""
    return LruPolicy() if CacheMode(mode) is CacheMode.LRU else UniformPolicy()


def stamp(keys_and_sizes: Sequence[tuple[str, int]], item_path: Callable[[str], str | Path]) -> list[StampedItem]:
    """Each indexed item with its recency; an item whose file is gone sorts first (stamp 0)."""
    out = []
    for key, size in keys_and_sizes:
        try:
            last = os.stat(item_path(key)).st_mtime_ns
        except FileNotFoundError:
            last = 0
        out.append(StampedItem(key, size, last))
    return out


class RecencyLog:
    """Hits noted in memory on the hit path, written to the item files' mtimes by `flush`."""

    def __init__(self) -> None:
        self._noted: dict[str, int] = {}
        self._flush_lock = threading.Lock()

    def note(self, key: str) -> None:
        self._noted[key] = time.time_ns()  # one dict store: atomic under the GIL

    def flush(self, item_path: Callable[[str], str | Path]) -> int:
        """Stamp every noted item (gone ones are skipped); returns how many were stamped."""
        with self._flush_lock:
            noted, self._noted = self._noted, {}
            stamped = 0
            for key, ns in noted.items():
                with contextlib.suppress(FileNotFoundError):
                    os.utime(item_path(key), ns=(ns, ns))
                    stamped += 1
            return stamped


def read_mode(root: Path) -> CacheMode:
    """The dataset cache's mode; uniform when never set (a fresh or pre-LRU cache)."""
    try:
        text = (Path(root) / MODE_FILE).read_text().strip()
    except FileNotFoundError:
        return CacheMode.UNIFORM
    try:
        return CacheMode(text)
    except ValueError:
        log.warning("cache mode file %s holds %r; using uniform", Path(root) / MODE_FILE, text)
        return CacheMode.UNIFORM


def write_mode(root: Path, mode: CacheMode) -> None:
    """Persist the mode atomically (write, fsync, rename)."""
    path = Path(root) / MODE_FILE
    tmp = path.with_name(f".{MODE_FILE}.{os.getpid()}.tmp")
    with open(tmp, "w") as handle:
        handle.write(CacheMode(mode).value + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


__all__ = [
    "LRU_BATCH_FRACTION",
    "MODE_FILE",
    "CacheMode",
    "LruPolicy",
    "RecencyLog",
    "StampedItem",
    "admission_victims",
    "choose_lru_evictions",
    "parse_mode",
    "policy_for",
    "read_mode",
    "stamp",
    "write_mode",
]
