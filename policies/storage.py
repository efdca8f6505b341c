"""Cache and remote-IO allocation rules shared by the policies.

All functions are pure and vectorised over jobs or datasets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import repeat
from operator import attrgetter

import numpy as np

from estimator import can_reuse_new_cache
from policies.loader import cache_weight, planned_rate
from policies.types import DatasetView, JobView, miss_rates

_DATASET, _IDEAL, _REMAINING = attrgetter("dataset"), attrgetter("ideal_throughput"), attrgetter("remaining_bytes")
_SIZE = attrgetter("size")


def greedy_cache(
    jobs: Sequence[JobView],
    datasets: Mapping[str, DatasetView],
    capacity: float,
    weights: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Algorithm 2 at dataset level: fill datasets in descending cache efficiency.

    A dataset's efficiency is the sum of f*/d over the jobs reading it (§6, dataset sharing),
    each job weighted by `weights` (default 1). This is a fractional knapsack: it minimises the
    remote IO the jobs need to run at their weighted speed.

    When the data layer reports what is cached (DatasetView.cached), bytes not cached yet count
    only the jobs with more than one epoch left or with a co-reader on their dataset
    (estimator.can_reuse_new_cache: an item a job caches now helps it from the next epoch on,
    and a co-reader's admissions help it in this one), while bytes already cached keep the full
    f*/d. Without this, a job in its last epoch would take cache it can never use from a job
    that can. (Algorithm 2 as the paper writes it counts every reader for every byte.)
    """
    # The loader's miss term (policies/loader.py): a job whose misses cost its loader weighs more.
    rate = cache_weight(np.fromiter(map(_IDEAL, jobs), dtype=float, count=len(jobs)), miss_rates(jobs))
    if weights is not None:
        rate *= np.array([weights.get(j.job_id, 0.0) for j in jobs], dtype=float)
    return greedy_cache_of(list(map(_DATASET, jobs)), rate, np.fromiter(map(_REMAINING, jobs), dtype=float, count=len(jobs)), datasets,
                           capacity)


def greedy_cache_of(names_read: Sequence[str], rate: np.ndarray, remaining: np.ndarray, datasets: Mapping[str, DatasetView],
                    capacity: float) -> dict[str, float]:
    """greedy_cache on columns: each job's dataset name, weighted f* (policies.loader.cache_weight
    of it for jobs with a loader term) and remaining bytes."""
    count = len(names_read)
    names = sorted(set(names_read))
    if not names:
        return {}
    index = {n: i for i, n in enumerate(names)}
    job_ds = np.fromiter(map(index.__getitem__, names_read), dtype=np.int64, count=count)
    views = [datasets[n] for n in names]
    sizes = np.array([d.size for d in views], dtype=float)
    shared = np.bincount(job_ds, minlength=len(names))[job_ds] > 1
    reuse = np.asarray(can_reuse_new_cache(remaining, sizes[job_ds], shared), dtype=float)
    full = np.bincount(job_ds, weights=rate, minlength=len(names))
    fresh = np.bincount(job_ds, weights=rate * reuse, minlength=len(names))
    filled = np.array([0.0 if d.cached is None else min(d.cached, d.size) for d in views], dtype=float)
    known = np.array([d.cached is not None for d in views], dtype=bool)
    fresh = np.where(known, fresh, full)  # unknown state: the paper's rule for every byte
    # Two knapsack items per dataset: its cached bytes at f*/d, the rest at the reuse-weighted rate.
    granted = fill_in_order(np.concatenate([filled, sizes - filled]), np.concatenate([full, fresh]) / np.concatenate([sizes, sizes]), capacity)
    per_dataset = granted[: len(names)] + granted[len(names) :]
    keep = (full > 0) | (per_dataset > 0)
    return {n: v for n, v, k in zip(names, per_dataset.tolist(), keep.tolist(), strict=True) if k}


def keep_for_waiting(
    cache: Mapping[str, float],
    waiting: Sequence[JobView],
    datasets: Mapping[str, DatasetView],
    capacity: float,
) -> dict[str, float]:
    """`cache` (the running jobs' Algorithm 2) plus, in the room it leaves, what is already
    cached of the datasets that only waiting jobs (paused by a preemptive policy, or queued) will
    read, most efficient first (sum of f*/d over their waiting readers).

    Without this a preempted job's dataset got no allocation and was evicted at once, although
    the cache had room: the job resumed cold and re-fetched it (one SJF-preempted job on a 200 GB
    cache, 190 GB of it free: 8,900 s instead of 6,400). Only bytes already cached are kept, not
    room reserved: nobody fills a dataset that only waiting jobs read, and the running jobs'
    plan, computed first, is never reduced by it (as Quiver keeps a paused job's cache unless a
    better candidate needs the space)."""
    rates = cache_weight(np.fromiter(map(_IDEAL, waiting), dtype=float, count=len(waiting)), miss_rates(waiting))
    return keep_for_waiting_of(cache, list(map(_DATASET, waiting)), rates, datasets, capacity)


def keep_for_waiting_of(cache: Mapping[str, float], names_read: Sequence[str], rates: Sequence[float],
                        datasets: Mapping[str, DatasetView], capacity: float) -> dict[str, float]:
    """keep_for_waiting on columns: the waiting jobs' dataset names and f* (cache_weight of it
    for jobs with a loader term)."""
    out = dict(cache)
    left = capacity - sum(out.values())
    names = sorted(set(names_read))
    if left <= 0 or not names:
        return out
    index = {n: i for i, n in enumerate(names)}
    rate = np.bincount(list(map(index.__getitem__, names_read)), weights=rates, minlength=len(names))
    sizes = np.array([datasets[n].size for n in names], dtype=float)
    cached = np.array([min(datasets[n].cached or 0.0, datasets[n].size) for n in names], dtype=float)
    extra = np.maximum(cached - np.array([out.get(n, 0.0) for n in names]), 0.0)
    granted = fill_in_order(extra, rate / sizes, left)
    for n, g in zip(names, granted.tolist(), strict=True):
        if g > 0:
            out[n] = out.get(n, 0.0) + g
    return out


def fill_in_order(sizes: np.ndarray, efficiency: np.ndarray, capacity: float) -> np.ndarray:
    """Give `capacity` to items in descending efficiency, each up to its size (fractional knapsack)."""
    # (ndarray methods: numpy's functions add a Python wrapper per call, at every decision)
    order = (-efficiency).argsort(kind="stable")
    sorted_sizes = sizes[order]
    before = np.concatenate(([0.0], sorted_sizes.cumsum()[:-1]))
    granted_sorted = (capacity - before).clip(0.0, sorted_sizes)
    granted = np.empty_like(granted_sorted)
    granted[order] = granted_sorted
    return granted


def io_in_priority_order(demands: np.ndarray, capacity: float) -> np.ndarray:
    """Serve demands in the given order until the link is used up (FIFO/SJF order)."""
    before = np.concatenate(([0.0], np.cumsum(demands)[:-1]))
    return np.clip(capacity - before, 0.0, demands)


def max_min_share(demands: np.ndarray, capacity: float) -> np.ndarray:
    """Max-min fair (water-filling) split of `capacity` among `demands`.

    This is how a shared link without any allocation behaves (TCP-like fair sharing): nobody
    gets more than it asks for, and what small demands leave is shared equally by the rest.
    """
    n = len(demands)
    if n == 0:
        return np.zeros(0)
    if demands.sum() <= capacity:
        return demands.astype(float).copy()
    order = demands.argsort(kind="stable")
    sorted_d = demands[order].astype(float)
    # The water level L satisfies sum(min(d_i, L)) = capacity.
    prefix = np.concatenate(([0.0], sorted_d.cumsum()[:-1]))
    remaining = np.arange(n, 0, -1)
    levels = (capacity - prefix) / remaining
    k = int(np.argmax(levels <= sorted_d))  # first index whose demand exceeds its level
    level = levels[k]
    granted_sorted = np.minimum(sorted_d, level)
    out = np.empty(n)
    out[order] = granted_sorted
    return out


def demands_at_full_speed(jobs: Sequence[JobView], cache: Mapping[str, float], datasets: Mapping[str, DatasetView]) -> np.ndarray:
    """Eq. 2 for each job, f* (1 - h): the remote IO it needs to run at full speed now.

    h = c/d with c the part of the allocation already filled; when the data layer measures the
    job's hit ratio on the rest of its epoch (JobView.hit_ratio_now), that instead, scaled down
    if the allocation is below what is cached (random eviction). In a job's first epoch every
    read misses whatever is cached, since what it cached itself it has already read (delayed
    effectiveness): c/d there would starve it of the IO it needs.
    """
    told = [j.hit_ratio_now for j in jobs]  # None: not measured
    n = len(jobs)
    measured = np.fromiter((x is not None for x in told), dtype=bool, count=n)
    h = np.fromiter((0.0 if x is None else x for x in told), dtype=float, count=n) if measured.any() else None
    return demands_of(np.fromiter(map(_IDEAL, jobs), dtype=float, count=n), list(map(_DATASET, jobs)), measured, h, cache, datasets,
                      miss_rates(jobs))


def demands_of(ideal: np.ndarray, names: Sequence[str], measured: np.ndarray, told: np.ndarray | None, cache: Mapping[str, float],
               datasets: Mapping[str, DatasetView], miss_rate: np.ndarray | None = None) -> np.ndarray:
    """demands_at_full_speed on columns: f*, dataset names, whether the hit ratio now is
    measured and its values (0.0 where not; None: measured for no job), and each job's loader
    miss rate (None: no job has a loader term). A job with one reads at most X(h) =
    1 / (1/f* + (1-h)/m) (policies/loader.py), so it can use X(h) (1 - h) of the link, not f* (1 - h)."""
    n = len(names)
    views = list(map(datasets.__getitem__, names))
    allocated = np.fromiter(map(cache.get, names, repeat(0.0)), dtype=float, count=n)
    size = np.fromiter(map(_SIZE, views), dtype=float, count=n)
    cached = [v.cached for v in views]  # None: unknown
    # The per-job rules on columns, each min/max as Python's (min(a, b) is b only if b < a):
    # what the data layer did not report reads as +inf (filled: the whole allocation) or 0.0
    # (kept: everything).
    c = np.fromiter((math.inf if x is None else x for x in cached), dtype=float, count=n)
    if ((size == 0.0) & ~measured).any():
        raise ZeroDivisionError("float division by zero (a dataset of size 0)")  # as the division per job raised
    # Python's float arithmetic is silent on inf x 0 and the like (and the size-0 divisions left
    # are those of measured jobs, whose results are not used).
    with np.errstate(all="ignore"):
        hit = _py_min(_py_min(allocated, c) / size, 1.0)  # min(view.filled(allocated) / view.size, 1)
        if told is not None:
            c0 = np.fromiter((0.0 if x is None else x for x in cached), dtype=float, count=n)
            some = c0 != 0.0  # `not view.cached`: None or zero keeps everything
            kept = np.where(some, _py_min(allocated / np.where(some, c0, 1.0), 1.0), 1.0)
            hit = np.where(measured, _py_min(np.where(0.0 > told, 0.0, told) * kept, 1.0), hit)  # min(max(h, 0) x kept, 1)
        return planned_rate(ideal, miss_rate, hit) * (1.0 - hit)


def _py_min(a: np.ndarray, b: np.ndarray | float) -> np.ndarray:
    """Python's min(a, b) elementwise: b where b < a, else a (NaN and signed zeros as Python's)."""
    return np.where(b < a, b, a)
