"""Uniform caching (SiloD §2.2, §6): the admission and eviction rules, with no I/O.

Training reads every item of a dataset once per epoch in random order. If the cache admits
items on first read until the dataset's allocation c is full and then never evicts, the set of
cached items is a uniform random sample of the dataset, so every epoch hits c/d of its bytes.
Shrinking the allocation must keep that property, so eviction picks *random* items, not LRU
ones (LRU would evict exactly the items the current epoch is about to need).

The rules are a `CachePolicy`: the on-disk cache (cache_store.py) owns the index, the
counters and the crash safety, and asks its policy only "admit this item?", "may evicting make
room for it, and which items then?" and "which items go when the allocation shrinks?". LRU for
irregular jobs (lru_cache.py) is the other policy; a dataset's mode picks one.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class CachedItem:
    key: str
    size: int
    #: When the item was last used (admitted or hit), in ns; filled in by the store only for a
    #: policy with `uses_recency` (it costs a stat per item), 0 otherwise.
    last_used_ns: int = 0


class CachePolicy(Protocol):
    """What the on-disk cache asks a caching policy. Pure: no I/O, no clock."""

    name: str  # the dataset's cache mode that selects this policy (lru_cache.CacheMode)
    #: The store notes hits (in memory, off the hit path's I/O) and hands the policy each
    #: item's `last_used_ns` when it asks for victims.
    uses_recency: bool

    def should_admit(self, cached_bytes: int, item_size: int, allocation_bytes: int) -> bool:
        """Admit without evicting anything?"""
        ...

    def evicts_to_admit(self, item_size: int, allocation_bytes: int) -> bool:
        """When `should_admit` refuses: may evicting cached items make room for this one?"""
        ...

    def admission_victims(self, items: Sequence[CachedItem], allocation_bytes: int, item_size: int) -> list[CachedItem]:
        """Items to evict, in the admitting transaction, so that `item_size` more bytes fit."""
        ...

    def choose_evictions(
        self, items: Sequence[CachedItem], allocation_bytes: int, rng: random.Random | None = None
    ) -> list[CachedItem]:
        """Items to evict so that the rest fit in a (shrunk) allocation."""
        ...


def should_admit(cached_bytes: int, item_size: int, allocation_bytes: int) -> bool:
    """Admit an item fetched from remote iff the dataset stays within its allocation."""
    return cached_bytes + item_size <= allocation_bytes


def choose_evictions(
    items: Sequence[CachedItem], allocation_bytes: int, rng: random.Random | None = None
) -> list[CachedItem]:
    """Random items whose removal brings the cached bytes down to at most the allocation.

    Returns [] when the dataset already fits. Removes as few random items as the random order
    allows: it walks a random permutation and stops as soon as the remainder fits.
    """
    cached = sum(item.size for item in items)
    excess = cached - allocation_bytes
    if excess <= 0:
        return []
    order = list(items)
    (rng or random.Random()).shuffle(order)
    victims: list[CachedItem] = []
    freed = 0
    for item in order:
        if freed >= excess:
            break
        victims.append(item)
        freed += item.size
    return victims


@dataclass(frozen=True)
class UniformPolicy:
    """SiloD's uniform caching: admit while it fits, never evict except random items on a shrink."""

    name: str = "uniform"
    uses_recency: bool = False

    def should_admit(self, cached_bytes: int, item_size: int, allocation_bytes: int) -> bool:
        return should_admit(cached_bytes, item_size, allocation_bytes)

    def evicts_to_admit(self, item_size: int, allocation_bytes: int) -> bool:
        return False  # a full uniform cache keeps its random sample: evicting would bias it

    def admission_victims(self, items: Sequence[CachedItem], allocation_bytes: int, item_size: int) -> list[CachedItem]:
        return []

    def choose_evictions(
        self, items: Sequence[CachedItem], allocation_bytes: int, rng: random.Random | None = None
    ) -> list[CachedItem]:
        return choose_evictions(items, allocation_bytes, rng)
