"""The remote link's max-min split (policies.storage.max_min_share) for the engine, its contended
case compiled (numba), and the claimers' caps on a contended LRU link (engine._claimable).

The engine splits the link at every step, and again for the jobs at the water level when
claimers read first and for the spare IO a managed plan leaves: 110,000 contended splits in a
Fig. 12 Gavel/Alluxio run, each some ten numpy calls on short columns (about 13 us; compiled,
about 2). The result is bit-identical to max_min_share's: the sum that decides whether the link
is contended is numpy's own (pairwise), the prefix sums are sequential as np.cumsum's, the
stable sort orders ties as numpy's does, and a NaN demand goes to max_min_share itself.
tests/test_sim_compiled.py compares the two on random splits.
"""

from __future__ import annotations

import numba
import numpy as np

from policies.compiled import kernel, np_max, np_min, pairwise_sum
from policies.storage import max_min_share

F = numba.float64[:]


@kernel(F(F, numba.float64))
def _contended(demands: np.ndarray, capacity: float) -> np.ndarray:
    """max_min_share where the demands' sum exceeds `capacity`; empty where a demand is NaN."""
    n = len(demands)
    for i in range(n):
        if demands[i] != demands[i]:
            return np.empty(0)
    order = np.argsort(demands, kind="mergesort")
    sorted_d = demands[order]
    # The water level L: sum(min(d_i, L)) = capacity, at the first (ascending) demand above its
    # level (capacity - the smaller demands' sum) / (the demands left).
    level = (capacity - 0.0) / n  # np.argmax over no True picks the first level
    prefix = 0.0
    for i in range(n):
        if i == 1:
            prefix = sorted_d[0]  # np.cumsum starts from the first element, not 0 + it
        elif i > 1:
            prefix += sorted_d[i - 1]
        here = (capacity - prefix) / (n - i)
        if here <= sorted_d[i]:
            level = here
            break
    out = np.empty(n)
    for i in range(n):
        out[order[i]] = np_min(sorted_d[i], level)
    return out


def max_min(demands: np.ndarray, capacity: float) -> np.ndarray:
    """max_min_share(demands, capacity) (float demands)."""
    if len(demands) == 0:
        return max_min_share(demands, capacity)
    if demands.sum() <= capacity:
        return demands.astype(float).copy()  # max_min_share's answer, without summing twice
    out = _contended(demands, float(capacity))
    return out if out.size else max_min_share(demands, capacity)


@kernel(numba.types.Tuple((numba.boolean[:], numba.int64))(F))
def below_level(caps: np.ndarray) -> tuple[np.ndarray, int]:
    """Which caps lie below the max-min water level (the largest cap, within 1e-9), and how
    many are at it (engine._claimable; numpy's max: a NaN is the level)."""
    n = caps.size
    level = caps[0]
    for i in range(1, n):
        if level != level:
            break
        if caps[i] != caps[i] or caps[i] > level:
            level = caps[i]
    threshold = level * (1 - 1e-9)
    below = np.empty(n, dtype=np.bool_)
    at_level = 0
    for i in range(n):
        below[i] = caps[i] < threshold
        at_level += not below[i]
    return below, at_level


@kernel(F(F, numba.boolean[:], numba.boolean[:], numba.float64, numba.int64))
def claimed_caps(caps: np.ndarray, below: np.ndarray, mask: np.ndarray, total: float, at_level: int) -> np.ndarray:
    """The claimers' (`mask`) caps raised to what they could claim, (total - (the caps below the
    level, summed as numpy does) + their own) / (at_level + 1); the others' as they are."""
    n = caps.size
    taken = np.empty(n)
    m = 0
    for i in range(n):
        if below[i]:
            taken[m] = caps[i]
            m += 1
    below_sum = pairwise_sum(taken, m)
    out = np.empty(n)
    for i in range(n):
        out[i] = np_max(caps[i], (total - (below_sum - caps[i])) / (at_level + 1)) if mask[i] else caps[i]
    return out
