"""Uniform caching (SiloD §2.2, §6): the admission and eviction rules, with no I/O.

Training reads every item of a dataset once per epoch in random order. If the cache admits
items on first read until the dataset's allocation c is full and then never evicts, the set of
cached items is a uniform random sample of the dataset, so every epoch hits c/d of its bytes.
Shrinking the allocation must keep that property, so eviction picks *random* items, not LRU
ones (LRU would evict exactly the items the current epoch is about to need).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CachedItem:
    key: str
    size: int


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
