"""Autocaching (Cachew, ATC'22), applied after any policy: per dataset, cache the source bytes
or the output of the deterministic part of its readers' pipelines (the autocache point),
whichever the estimator projects faster for the resources the policy gave them.

Which datasets can be cached preprocessed: those whose every active reader (queued or running)
declares an autocache point with the same `autocache_expansion` -- preprocessed items are only
of use to a job that runs the same deterministic stage; a reader without one needs the source
bytes, and two different expansions are two different deterministic stages.

The comparison (estimator.pipeline.autocache_gain): the sum over the dataset's running readers
of their normalised throughput X / f* with the cache holding e x the bytes per item (hit ratio
c / (e d)) and cached items costing post_cpu_rate per core, against source caching, for the
cache and cores of this allocation and its IO caps plus an equal part of the link no cap holds. Switching discards the dataset's cache (the bytes
differ), so a dataset changes mode only when the other one gains more than SWITCH_MARGIN (a
fraction of one job's f*); a tie keeps source caching. The scheduling core then plans a change
again at the new sizes and keeps it only if `allocation_score` (the whole cluster's summed
normalised throughput) gains SWITCH_MARGIN too: a decoded copy may take cache from other jobs.

Nothing changes where the allocation leaves storage to the cache system (`cache` None: the
baselines cache source bytes), and a job without CPU cores modelled never gains from it (its
CPU stage is not a bound, so only the lower hit ratio counts).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from estimator.pipeline import autocache_gain, pipeline_perf
from policies.types import Allocation, Snapshot

#: Normalised throughput (sum of X / f* over a dataset's readers) a mode switch must gain: a
#: switch empties the dataset's cache, so a gain within noise of the allocation must not flip it.
SWITCH_MARGIN = 0.05
#: A dataset holding more source bytes than this share of its size keeps caching source bytes.
FRESH_CACHE = 0.05


def _io_with_spare(snapshot: Snapshot, allocation: Allocation, jobs) -> np.ndarray:
    if allocation.remote_io is None:
        return np.full(len(jobs), np.inf)
    # The policy sized IO caps for the current mode (a fully cached source needs none); the
    # other mode may need more: each reader may also use an equal part of the link no cap
    # holds, as the round's work conservation would give it.
    running = sum(1 for j in snapshot.jobs if allocation.gpu_share.get(j.job_id, 0.0) > 0)
    spare = max(snapshot.capacity.remote_io - float(sum(allocation.remote_io.values())), 0.0) / max(running, 1)
    return np.array([allocation.remote_io.get(j.job_id, 0.0) + spare for j in jobs])


def allocation_score(snapshot: Snapshot, allocation: Allocation, modes: Mapping[str, float]) -> float:
    """Sum over the jobs the allocation runs of share x X / f*, X by the estimator with their
    cache (e x bytes per item where `modes` caches preprocessed data), IO and cores: what a set
    of modes and the allocation the policy gave for it are worth to the whole cluster."""
    jobs = [j for j in snapshot.jobs if allocation.gpu_share.get(j.job_id, 0.0) > 0]
    if not jobs or allocation.cache is None:
        return 0.0
    cap = snapshot.capacity
    f = np.array([j.ideal_throughput for j in jobs])
    pre = [modes.get(j.dataset, 1.0) != 1.0 and j.pipeline is not None and j.pipeline.autocaches for j in jobs]
    r = np.array([j.cpu_rate for j in jobs])
    x = np.asarray(pipeline_perf(
        f, _io_with_spare(snapshot, allocation, jobs), np.array([allocation.cache.get(j.dataset, 0.0) for j in jobs]),
        np.array([snapshot.datasets[j.dataset].size for j in jobs]),
        np.array([np.inf if allocation.cpu is None or not cap.manages_cpu else allocation.cpu.get(j.job_id, 0.0) for j in jobs]),
        r, np.array([modes[j.dataset] if p else 1.0 for j, p in zip(jobs, pre, strict=True)]),
        np.array([j.pipeline.post_cpu_rate if p else rj for j, p, rj in zip(jobs, pre, r, strict=True)]),
    ), dtype=float)
    share = np.array([allocation.gpu_share.get(j.job_id, 0.0) for j in jobs])
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.sum(np.where(f > 0, share * x / np.where(f > 0, f, 1.0), 0.0)))


def takes_filled_cache(snapshot: Snapshot, base: Allocation, trial: Allocation, switching: set[str]) -> float:
    """Bytes a mode change's re-planned allocation `trial` takes from the caches other datasets
    already hold: for each dataset not in `switching`, what it holds now and `base` lets it keep,
    less what `trial` gives it. Those bytes are dropped at once, while the switching dataset's
    new (e x larger) copy fills only over the link share it gets: the cluster check compares
    filled allocations and cannot see that loss."""
    if base.cache is None or trial.cache is None:
        return 0.0
    taken = 0.0
    for name, view in snapshot.datasets.items():
        if name in switching or not view.cached:
            continue
        keep = min(float(view.cached), float(base.cache.get(name, 0.0)))
        taken += max(0.0, keep - float(trial.cache.get(name, 0.0)))
    return taken


def eligible_expansions(snapshot: Snapshot) -> dict[str, float]:
    """Datasets that may be cached preprocessed, with their readers' common expansion."""
    cols = snapshot.job_columns()
    if not (cols.autocaches if cols is not None and cols.autocaches is not None
            else any(job.pipeline is not None and job.pipeline.autocaches for job in snapshot.jobs)):
        return {}  # the common case, checked once per decision: no reader declares an autocache point
    seen: dict[str, float | None] = {}
    for job in snapshot.jobs:
        p = job.pipeline
        e = p.autocache_expansion if p is not None and p.autocaches else None
        if job.dataset not in seen:
            seen[job.dataset] = e
        elif seen[job.dataset] != e:
            seen[job.dataset] = None
    return {name: e for name, e in seen.items() if e is not None}


def plan_autocache(snapshot: Snapshot, allocation: Allocation, current: Mapping[str, float] | None = None) -> dict[str, float]:
    """Datasets to cache preprocessed -> their expansion. `current`: the datasets cached
    preprocessed now (a switch either way must gain SWITCH_MARGIN)."""
    current = current or {}
    if allocation.cache is None:
        return {}
    eligible = eligible_expansions(snapshot)
    if not eligible:
        return {}
    names = sorted(eligible)
    index = {n: i for i, n in enumerate(names)}
    readers = [j for j in snapshot.jobs if j.dataset in index and allocation.gpu_share.get(j.job_id, 0.0) > 0]
    if not readers:
        return {n: e for n, e in current.items() if n in eligible and eligible[n] == e}
    cap = snapshot.capacity
    io = _io_with_spare(snapshot, allocation, readers)
    gain = autocache_gain(
        np.array([index[j.dataset] for j in readers]),
        len(names),
        np.array([j.ideal_throughput for j in readers]),
        io,
        np.array([allocation.cache.get(n, 0.0) for n in names]),
        np.array([snapshot.datasets[n].size for n in names]),
        np.array([np.inf if allocation.cpu is None or not cap.manages_cpu else allocation.cpu.get(j.job_id, 0.0) for j in readers]),
        np.array([j.pipeline.cpu_rate for j in readers]),
        np.array([j.pipeline.autocache_expansion for j in readers]),
        np.array([j.pipeline.post_cpu_rate for j in readers]),
    )
    chosen = {}
    for n in names:
        g = float(gain[index[n]])
        now = current.get(n) == eligible[n]
        # Cachew decides when a job's data is not cached yet; a filled source cache is not thrown
        # away for a decoded copy (refilling costs the link everyone shares, which the
        # comparison of filled allocations does not see).
        filled = snapshot.datasets[n].cached
        fresh = filled is None or filled <= FRESH_CACHE * snapshot.datasets[n].size
        if (g > SWITCH_MARGIN and (now or fresh)) or (now and g > -SWITCH_MARGIN):
            chosen[n] = eligible[n]
    return chosen


__all__ = ["SWITCH_MARGIN", "allocation_score", "eligible_expansions", "plan_autocache", "takes_filled_cache"]
