"""SiloD's performance model (EuroSys'23 §4), as pure numpy-vectorised functions.

Notation (all bytes and bytes/s):
    f* = ideal      data throughput of the job when IO is not the bottleneck
    b  = remote_io  remote bandwidth allocated to the job (exclusive to it)
    c  = cache      cache allocated to the job's dataset (shared by its readers)
    d  = dataset_size

Under uniform caching each epoch reads every item once in random order, so the hit ratio is
c/d and only the misses, a fraction (1 - c/d), cross the remote link:

    IOPerf    = b / (1 - c/d)            (Eq. 3; unbounded when c >= d)
    SiloDPerf = min(f*, IOPerf)          (Eq. 4)
    demand    = f* (1 - c/d)             (Eq. 2, remote IO needed at full speed)
    -db/dc    = f* / d                   (Eq. 5, cache efficiency)

Every function accepts scalars or numpy arrays (broadcast together) and returns a float for
scalar input, an ndarray otherwise. Invalid input raises ValueError naming the argument.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
from numpy.typing import ArrayLike

Number = float | np.ndarray


def _as_array(value: ArrayLike, name: str, *, positive: bool = False) -> np.ndarray:
    arr = np.asarray(value, dtype=float)
    # One pass on the good path (NaN fails both comparisons); the errors are told apart after.
    if (arr > 0).all() if positive else (arr >= 0).all():
        return arr
    if np.isnan(arr).any():
        raise ValueError(f"{name} is NaN; give a number of bytes (or bytes/s)")
    if (arr < 0).any():
        bad = arr[arr < 0].flat[0]
        raise ValueError(f"{name} = {bad!r} is negative; sizes and rates must be >= 0")
    raise ValueError(f"{name} must be > 0 (got {arr[arr <= 0].flat[0]!r}); an empty dataset has no throughput model")


def _out(result: np.ndarray) -> Number:
    return float(result) if result.ndim == 0 else result


# The formulas on inputs already checked by _as_array (the `_k` kernels): the public functions
# check and call them, and callers that evaluate the model many times on the same inputs
# (estimator/pipeline.py's diagnose) check once.

def _hit_k(c: np.ndarray, d: np.ndarray) -> np.ndarray:
    return np.minimum(c / d, 1.0)


def _io_k(b: np.ndarray, h: np.ndarray) -> np.ndarray:
    """b / (1 - h), +inf where nothing misses."""
    miss = 1.0 - h
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(np.where(miss <= 0.0, np.inf, b / np.where(miss <= 0.0, 1.0, miss)), dtype=float)


def hit_ratio(cache: ArrayLike, dataset_size: ArrayLike) -> Number:
    """Expected hit ratio c/d of uniform caching, clipped to [0, 1]."""
    c = _as_array(cache, "cache")
    d = _as_array(dataset_size, "dataset_size", positive=True)
    return _out(_hit_k(c, d))


def io_perf(remote_io: ArrayLike, cache: ArrayLike, dataset_size: ArrayLike) -> Number:
    """Data-loading throughput b / (1 - c/d) (Eq. 3); +inf once the whole dataset is cached."""
    b = _as_array(remote_io, "remote_io")
    h = np.asarray(hit_ratio(cache, dataset_size))
    return _out(_io_k(b, h))


def silod_perf(ideal: ArrayLike, remote_io: ArrayLike, cache: ArrayLike, dataset_size: ArrayLike) -> Number:
    """End-to-end throughput min(f*, b / (1 - c/d)) (Eq. 4)."""
    f = _as_array(ideal, "ideal")
    return _out(np.minimum(f, np.asarray(io_perf(remote_io, cache, dataset_size))))


def window_io_perf(remote_io: ArrayLike, cache: ArrayLike, dataset_size: ArrayLike, seconds: ArrayLike,
                   burst: ArrayLike) -> Number:
    """IOPerf over a window of `seconds` that starts with `burst` bytes of remote IO banked:
    (b + burst / seconds) / (1 - c/d); +inf once the whole dataset is cached.

    A token bucket (the mount's rate limiter) keeps up to a bounded burst of its rate while the
    link idles, so a job that reads after an idle spell fetches b x seconds + burst in its first
    `seconds`. Over a long run the term vanishes and this is `io_perf` (Eq. 3); it matters for
    short measurement windows (an epoch of a fraction of a second after the link idled)."""
    b = _as_array(remote_io, "remote_io")
    t = _as_array(seconds, "seconds", positive=True)
    extra = _as_array(burst, "burst")
    h = np.asarray(hit_ratio(cache, dataset_size))
    return _out(_io_k(b + extra / t, h))


#: Most loader workers a job may declare, and the largest item: a declaration past these is a
#: typo (the loader term uses them as given). The REST API's and the trace reader's bounds.
MAX_LOADER_WORKERS = 1024
MAX_LOADER_ITEM_BYTES = 2.0**40
#: Longest per-miss service time a trace may give (as the service caps a measured one): an hour.
MAX_LOADER_MISS_S = 3600.0


def loader_miss_rate(workers: ArrayLike, item_bytes: ArrayLike, miss_latency_s: ArrayLike) -> Number:
    """m = W s / L: the bytes per second of misses a loader of W workers absorbs when each miss
    of an s-byte item holds its worker L seconds (Little's law); +inf when a miss costs nothing."""
    w = _as_array(workers, "workers", positive=True)
    s = _as_array(item_bytes, "item_bytes", positive=True)
    lat = _as_array(miss_latency_s, "miss_latency_s")
    with np.errstate(divide="ignore"):
        return _out(np.asarray(np.where(lat <= 0.0, np.inf, w * s / np.where(lat <= 0.0, 1.0, lat)), dtype=float))


def loader_miss_time(miss_free_s: ArrayLike, workers: ArrayLike, item_bytes: ArrayLike, ideal: ArrayLike, hit: ArrayLike,
                     remote_io: ArrayLike, burst: ArrayLike = 0.0, seconds: ArrayLike = np.inf) -> Number:
    """L(b): the seconds a miss holds its loader worker when the job's remote IO is capped at b by
    the mount's token bucket (fuse_client/token_bucket.py), from L_free, its service time with
    the link not binding:

        L(b) = max(L_free, W s (1/b' - 1/((1 - h) f*))),    b' = b + burst / seconds

    Why: the bucket refills at b and banks at most `burst` bytes (max(64 KiB, 0.1 s of b)); a
    miss of s <= burst bytes goes through at once while it holds s tokens, else waits in arrival
    order. With misses costing L_free the loader would miss X(1 - h) bytes/s, X = loader_perf at
    m = W s / L_free. If that is within b', the bank refills between misses and the mean wait is 0
    (L = L_free). If not, the bank empties and the waiters' queue grows until each miss's time L
    makes the loader's misses flow at the bucket's rate: X(h; m = W s / L) (1 - h) = b', i.e.
    1/f* + (1 - h) L / (W s) = (1 - h) / b', which is the second term (Little's law at the
    bucket). Over a window of `seconds` that starts with the bank full, b' = b + burst / seconds
    (window_io_perf's). h = 1 (nothing missed) or b = inf: L_free; b' = 0: inf.

    The throughput this L gives through loader_perf is min(loader_perf(L_free), b'/(1 - h)):
    the loader term with a miss time measured at a binding allocation carries that allocation's
    b, which is why planning uses L_free (the service folds no link-bound interval's misses)."""
    lf = _as_array(miss_free_s, "miss_free_s")
    w = _as_array(workers, "workers", positive=True)
    s = _as_array(item_bytes, "item_bytes", positive=True)
    f = _as_array(ideal, "ideal", positive=True)
    h = np.clip(_as_array(hit, "hit"), 0.0, 1.0)
    b = _as_array(remote_io, "remote_io")
    t = _as_array(seconds, "seconds", positive=True)
    extra = _as_array(burst, "burst")
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = b + np.where(np.isinf(t), 0.0, extra / t)
        per_b = np.where(rate > 0, 1.0 / np.where(rate > 0, rate, 1.0), np.inf)
        per_miss = np.where(h < 1.0, 1.0 / (np.where(h < 1.0, 1.0 - h, 1.0) * f), np.inf)
        queued = np.where(h < 1.0, w * s * (per_b - per_miss), -np.inf)
    return _out(np.asarray(np.maximum(lf, queued), dtype=float))


def loader_perf(ideal: ArrayLike, hit: ArrayLike, miss_rate: ArrayLike = np.inf) -> Number:
    """1 / (1/f* + (1 - h)/m): the job's rate when each byte of input costs its compute (1/f*)
    and each missed byte the loader's time to absorb it (1/m, `loader_miss_rate`), which the
    loader's workers cannot hide behind compute (on a machine whose cores both share, or with
    too few workers for the miss latency). m = inf (a job that declares nothing about its
    loader) gives f*: the paper's model."""
    f = _as_array(ideal, "ideal", positive=True)
    h = np.clip(_as_array(hit, "hit"), 0.0, 1.0)
    m = _as_array(miss_rate, "miss_rate", positive=True)
    return _out(np.asarray(1.0 / (1.0 / f + (1.0 - h) / m), dtype=float))


def silod_loader_perf(ideal: ArrayLike, remote_io: ArrayLike, cache: ArrayLike, dataset_size: ArrayLike,
                      miss_rate: ArrayLike = np.inf) -> Number:
    """min(1 / (1/f* + (1 - c/d)/m), b / (1 - c/d)): SiloDPerf (Eq. 4) with the loader's miss
    term (`loader_perf`); exactly `silod_perf` when m = inf."""
    h = np.asarray(hit_ratio(cache, dataset_size))
    return _out(np.minimum(np.asarray(loader_perf(ideal, h, miss_rate)), np.asarray(io_perf(remote_io, cache, dataset_size))))


def remote_demand(ideal: ArrayLike, cache: ArrayLike, dataset_size: ArrayLike) -> Number:
    """Remote IO a job needs to run at full speed: f* (1 - c/d) (Eq. 2)."""
    f = _as_array(ideal, "ideal")
    h = np.asarray(hit_ratio(cache, dataset_size))
    return _out(f * (1.0 - h))


def cache_efficiency(ideal: ArrayLike, dataset_size: ArrayLike) -> Number:
    """Remote IO saved per byte of cache, f*/d (Eq. 5), in (bytes/s) per byte."""
    f = _as_array(ideal, "ideal")
    d = _as_array(dataset_size, "dataset_size", positive=True)
    return _out(f / d)


def can_reuse_new_cache(remaining_bytes: ArrayLike, dataset_size: ArrayLike, shared: ArrayLike | None = None) -> Number:
    """1.0 where a job has more than one epoch of work left, or (`shared`) another active job
    reads its dataset; else 0.0.

    An item is cached when first read in the current epoch and only saves its reader IO when
    read again in a later epoch (delayed effectiveness, §6). A job in its last epoch that reads
    its dataset alone gains nothing from new cache, so its f*/d (Eq. 5) must not count for
    bytes that are not cached yet; otherwise a finishing job takes cache from a job that could
    use it. (SiloD's Algorithm 2 counts every reader for every byte; the paper leaves delayed
    effectiveness to policies that inspect the effective cache, §6.) On a shared dataset the
    co-readers admit items it has not read yet, which it then hits in this epoch: there it
    counts. A step, not a fraction: a smooth weight makes two otherwise equal datasets swap
    allocations as their jobs progress.
    """
    w = _as_array(remaining_bytes, "remaining_bytes")
    d = _as_array(dataset_size, "dataset_size", positive=True)
    reuse = w > d
    if shared is not None:
        reuse = reuse | np.asarray(shared, dtype=bool)
    return _out(reuse.astype(float))


def dataset_cache_efficiency(readers_ideal: Iterable[float], dataset_size: float) -> float:
    """Cache efficiency of a dataset read by several jobs: the sum of theirs (§6, dataset sharing).

    Cache is charged once per dataset but saves remote IO for every job that reads it.
    """
    f = _as_array(list(readers_ideal), "ideal")
    d = float(_as_array(dataset_size, "dataset_size", positive=True))
    return float(f.sum() / d)


def dataset_cache_efficiencies(readers: Mapping[str, Iterable[float]], sizes: Mapping[str, float]) -> dict[str, float]:
    """Cache efficiency per dataset name, for datasets shared by several jobs."""
    unknown = set(readers) - set(sizes)
    if unknown:
        raise ValueError(f"no size given for dataset(s) {sorted(unknown)}")
    return {name: dataset_cache_efficiency(fs, sizes[name]) for name, fs in readers.items()}
