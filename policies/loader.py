"""The data loader's miss term in the policies' plans (estimator.loader_perf), pure.

A job that declared its loader (W workers, s-byte items) and whose misses' service time L is known
has a miss rate m = W s / L (JobView.loader_miss_rate): each byte it misses costs its loader 1/m
seconds beside its compute, so with a hit ratio h its GPUs run at

    X(h) = 1 / (1/f* + (1 - h)/m)        (estimator.loader_perf; X = f* when m = inf)

Two rules follow, used by every policy through policies/storage.py, sjf.py and gavel.py:

- the rate a job is planned at, and the remote IO it can use, are X(h) and X(h) (1 - h), not
  f* and f* (1 - h): IO beyond what its loader lets it read is IO another job could have used;
- a byte of cache on its dataset saves the link f*/d (Eq. 5) *and* its loader's time, 1/(m d)
  seconds per second of reading at the speed Algorithm 2 plans for (f*), which is f*^2 / (m d)
  bytes/s of its progress. Both are bytes/s per byte of cache, and Algorithm 2's knapsack counts
  both: weight f* (1 + f*/m) in place of f*. A job whose loader makes misses expensive (small m)
  is the one whose dataset is worth caching first.

A job with m = inf gets f* exactly, on the same arithmetic (no 1/(1/f*) round trip): plans of
snapshots without a loader term are bit-identical to the paper's.
"""

from __future__ import annotations

import numpy as np


def planned_rate(ideal: np.ndarray, miss_rate: np.ndarray | None, hit: np.ndarray | float) -> np.ndarray:
    """X(h) = 1 / (1/f* + (1-h)/m) where m is finite, f* (the same array) where not or when
    `miss_rate` is None."""
    if miss_rate is None:
        return ideal
    finite = np.isfinite(miss_rate)
    if not finite.any():
        return ideal
    h = np.clip(np.asarray(hit, dtype=float), 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = 1.0 / (1.0 / ideal + (1.0 - h) / np.where(finite, miss_rate, 1.0))
    return np.where(finite, x, ideal)


def cache_weight(ideal: np.ndarray, miss_rate: np.ndarray | None) -> np.ndarray:
    """Algorithm 2's per-job weight of a byte of cache (times 1/d): f* (1 + f*/m), f* where m is
    infinite (or `miss_rate` None)."""
    if miss_rate is None:
        return ideal
    finite = np.isfinite(miss_rate)
    if not finite.any():
        return ideal
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(finite, ideal * (1.0 + ideal / np.where(finite, miss_rate, 1.0)), ideal)


__all__ = ["cache_weight", "planned_rate"]
