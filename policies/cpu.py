"""CPU cores for the input pipelines: the fourth resource (Plumber, Cachew, Synergy).

A job that preprocesses on k cores at r source bytes/s per core runs at most at k r
(estimator/pipeline.py), so it needs f*/r cores to run at f* and no more. CPU is a cluster pool
(ClusterCapacity.cpus) with a per-job cap: the cores of the nodes its gang spans.

Rules, pure and vectorised:
- `cores_in_order` (FIFO, SJF, greedy): the running jobs get cores by marginal speed-up, i.e.
  a fractional knapsack in descending r_j / f*_j (the share of its full speed one core buys a
  job), each job up to what makes it no longer CPU-bound (min(f*/r, its node cap)). This
  maximises the sum of the running jobs' normalised speeds under the core budget.
- `gpu_proportional` (the baseline, today's practice): cores follow GPUs, cpus_per_node /
  gpus_per_node per GPU, whatever the job needs.
- Gavel's max-min allocates cores inside its closed form (policies/gavel.py).

`effective_jobs` returns the jobs with f* replaced by min(f*, k r), so that the cache and IO
rules downstream plan for the speed a job can actually reach with its cores.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from policies.storage import fill_in_order
from policies.types import ClusterCapacity, DatasetView, JobView


def cores_to_full_speed(jobs: Sequence[JobView], capacity: ClusterCapacity) -> np.ndarray:
    """min(f*_j / r_j, node cap_j): the cores beyond which job j is no longer CPU-bound (or can
    use no more); 0 for jobs that are not CPU-bound."""
    f = np.array([j.ideal_throughput for j in jobs], dtype=float)
    r = np.array([j.cpu_rate for j in jobs], dtype=float)
    cap = np.array([capacity.cpu_cap(j.gpus) for j in jobs], dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        need = np.where(np.isinf(r), 0.0, f / r)
    return np.minimum(need, cap)


def gpu_proportional(jobs: Sequence[JobView], capacity: ClusterCapacity) -> dict[str, float]:
    return {j.job_id: capacity.gpu_proportional_cpu(j.gpus) for j in jobs}


def cores_the_link_can_feed(jobs: Sequence[JobView], cache: Mapping[str, float] | None, datasets: Mapping[str, DatasetView],
                            capacity: ClusterCapacity) -> np.ndarray:
    """The most cores each job could keep busy this round, whatever the others do: with the whole
    remote link to itself it reads at most link / m bytes/s, where m >= 1 - a/d (a: the most of
    its dataset the cache may hold this round, its allocation in `cache`, or the cluster's cache
    where storage is not managed), and a byte costs at most 1/r core-seconds (a preprocessed hit
    costs 1/p, and p >= r). inf where the link does not bound it (m = 0, or not CPU-bound), and for
    jobs that do not read their dataset uniformly (`JobView.access` not `epoch`: a curriculum job
    reads a prefix of it, which may all be cached while a/d is small)."""
    link = capacity.remote_io
    out = np.full(len(jobs), np.inf)
    for i, j in enumerate(jobs):
        r = j.cpu_rate
        if np.isinf(r) or not j.access.regular:
            continue
        d = datasets[j.dataset].size
        held = capacity.cache if cache is None else cache.get(j.dataset, 0.0)
        miss = 1.0 - min(held, d) / d if d > 0 else 0.0
        if miss > 1e-12:
            out[i] = link / miss / r
    return out


def cores_in_order(jobs: Sequence[JobView], capacity: ClusterCapacity, ceiling: np.ndarray | None = None) -> dict[str, float]:
    """Cores for jobs that all hold their GPUs: knapsack by marginal speed-up r/f* (see module),
    each job also up to `ceiling` (per job, in the order of `jobs`; `cores_the_link_can_feed`)."""
    if not jobs:
        return {}
    need = cores_to_full_speed(jobs, capacity)
    if ceiling is not None:
        need = np.minimum(need, ceiling)
    f = np.array([j.ideal_throughput for j in jobs], dtype=float)
    r = np.array([j.cpu_rate for j in jobs], dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = np.where(np.isinf(r) | (f <= 0), 0.0, r / np.where(f > 0, f, 1.0))
    granted = fill_in_order(need, gain, capacity.cpus)
    return dict(zip((j.job_id for j in jobs), granted.tolist(), strict=True))


def cpu_for_running(running: Sequence[JobView], all_jobs: Sequence[JobView], capacity: ClusterCapacity,
                    ceiling: np.ndarray | None = None) -> dict[str, float] | None:
    """Cores per job (0 for jobs without GPUs) by the cluster's cpu_allocation rule; None when
    the cluster does not model CPU. `ceiling`: see cores_in_order (the model rule only)."""
    if not capacity.manages_cpu:
        return None
    if capacity.cpu_allocation == "gpu-proportional":
        granted = gpu_proportional(running, capacity)
    else:
        granted = cores_in_order(running, capacity, ceiling)
    return {j.job_id: 0.0 for j in all_jobs} | granted


def effective_jobs(jobs: Sequence[JobView], cpu: Mapping[str, float] | None) -> list[JobView]:
    """The jobs with f* replaced by min(f*, k r): the speed their cores allow."""
    if cpu is None:
        return list(jobs)
    out = []
    for j in jobs:
        r = j.cpu_rate
        if np.isinf(r):
            out.append(j)
            continue
        out.append(replace(j, ideal_throughput=min(j.ideal_throughput, cpu.get(j.job_id, 0.0) * r)))
    return out


__all__ = ["cores_in_order", "cores_the_link_can_feed", "cores_to_full_speed", "cpu_for_running", "effective_jobs", "gpu_proportional"]
