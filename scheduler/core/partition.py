"""Two partitions of cache and remote IO: regular jobs and irregular jobs (SiloD §6).

SiloDPerf assumes each item is read once per epoch, uniformly. Jobs whose access pattern breaks
that (`JobView.access` not `epoch`: curriculum learning, or any job declared irregular) would be
mis-estimated, and a mis-estimated job can take cache and IO from the regular jobs that SiloD
plans well. So cache and remote IO are split in two partitions; regular jobs are planned inside
the first by the chosen policy with SiloDPerf, irregular jobs inside the second by the same
policy with the storage-unaware (vanilla) estimator, and the second partition's cache is LRU,
shared by its datasets, and its remote IO is shared max-min by demand. The policy is called as
it is (built-ins and plug-ins alike); it never learns that partitions exist.

One round, as a pure function of (snapshot, policy, estimators):

1. **GPUs, one pool.** The policy runs once on every active job with the whole cluster and the
   regular estimator. Only its GPU decision is used, and only to split the GPUs between the two
   kinds: budget_p = sum over jobs of kind p of share_j * gpus_j.
2. **Partition sizes.** The irregular partition gets a fraction s of the cluster's cache and
   remote IO: the operator's pin (`ClusterCapacity.irregular_share`, `--irregular-share`) when
   both kinds are active, else s = irregular jobs' share of demand, sum of share_j * f*_j over
   irregular jobs / the same sum over all jobs (f* alone when no job holds GPUs), recomputed
   every round. With only irregular jobs active, s = 1.
3. **Regular partition.** The policy on the regular jobs, with capacity (ceil(budget_R) GPUs,
   (1-s) cache, (1-s) remote IO) and the regular estimator: it decides who of them runs, the
   cache per dataset and the IO per job. Datasets read by both kinds are planned here (uniform).
4. **Irregular partition.** The policy on the irregular jobs with (ceil(budget_I) GPUs, s cache,
   s IO) and the vanilla estimator decides who of them runs. Their storage is the partition's
   shared pool: the LRU cache of s * C is split among the datasets only irregular jobs read
   (regular jobs that hold no GPUs this round do not count as readers) in
   proportion to their read rate (sum of share_j f*_j of their running readers), each capped at
   the dataset's size -- where a shared LRU's occupancy settles when items are drawn uniformly
   from each dataset (first order of Che's approximation); the remote IO s * B is shared
   max-min by each running job's demand f* (1 - c/d), as an unallocated link would share it.

Time-sharing policies (Gavel) return fractional shares; a partition call gets ceil(budget) GPUs
and its shares are scaled down if they use more than the budget, so the two partitions together
never use more GPUs than step 1 did. With no irregular job active, or with a storage-unaware
estimator (the baseline cache systems decide storage themselves), this is exactly one policy
call, as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from policies.base import Policy
from policies.cpu import cores_the_link_can_feed, cpu_for_running
from policies.estimators import Estimator, VanillaEstimator
from policies.storage import max_min_share
from policies.types import Allocation, ClusterCapacity, JobView, Snapshot, StoragePartition
from policies.validation import AllocationError, validate_allocation

_REL_TOL = 1e-9


def allocate_partitioned(
    snapshot: Snapshot,
    policy: Policy,
    estimator: Estimator,
    irregular_estimator: Estimator | None = None,
) -> Allocation:
    """The allocation of one round with regular and irregular partitions (module docstring).

    `estimator` plans regular jobs (SiloDPerf); `irregular_estimator` (default: vanilla) is the
    one the policy gets for irregular jobs. The result carries `Allocation.partition` when the
    partitions were applied and is checked against both partitions (AllocationError); the
    scheduling core checks it against the whole cluster, as every allocation.
    """
    cols = snapshot.job_columns()
    if (cols is not None and cols.all_regular) or not estimator.manages_storage:
        return policy.allocate(snapshot, estimator)
    regular_flags = [j.access.regular for j in snapshot.jobs]
    if all(regular_flags):
        return policy.allocate(snapshot, estimator)
    irregular_estimator = irregular_estimator if irregular_estimator is not None else VanillaEstimator()
    regular = tuple(j for j, r in zip(snapshot.jobs, regular_flags, strict=True) if r)
    irregular = tuple(j for j, r in zip(snapshot.jobs, regular_flags, strict=True) if not r)
    cap = snapshot.capacity

    # 1. One GPU pool: the policy's decision over every job says how many GPUs each kind gets.
    # (Not validated on its own: the final allocation is checked against the budgets it sets.)
    whole = policy.allocate(snapshot, estimator)
    budget_r = _gpus_used(regular, whole.gpu_share)
    budget_i = _gpus_used(irregular, whole.gpu_share)

    # 2. Partition sizes.
    share, pinned = partition_share(snapshot, whole.gpu_share, regular_flags)
    cap_r = _partition_capacity(cap, budget_r, 1.0 - share)
    cap_i = _partition_capacity(cap, budget_i, share)

    # 3 and 4. The policy inside each partition.
    alloc_r = _allocate_in_partition(regular, snapshot, cap_r, budget_r, policy, estimator)
    alloc_i = _allocate_in_partition(irregular, snapshot, cap_i, budget_i, policy, irregular_estimator)
    gpu_share = {j.job_id: 0.0 for j in snapshot.jobs} | dict(alloc_r.gpu_share) | dict(alloc_i.gpu_share)
    lru = lru_datasets(snapshot.jobs, gpu_share)
    regular_cache = {k: v for k, v in (alloc_r.cache or {}).items() if k not in lru}
    lru_cache = shared_lru_cache(irregular, gpu_share, snapshot, lru, cap_i.cache)
    cache = regular_cache | lru_cache
    irregular_io = shared_remote_io(irregular, gpu_share, snapshot, cache, cap_i.remote_io)
    remote_io = {j.job_id: 0.0 for j in regular} | dict(alloc_r.remote_io or {}) | irregular_io
    objectives = [a.objective for a in (alloc_r, alloc_i) if a.objective is not None]

    partition = StoragePartition(
        irregular_share=share, pinned=pinned,
        regular_cache=cap_r.cache, regular_io=cap_r.remote_io,
        irregular_cache=cap_i.cache, irregular_io=cap_i.remote_io,
        regular_gpus=budget_r, irregular_gpus=budget_i,
        lru_datasets=frozenset(lru),
        regular_jobs=frozenset(j.job_id for j in regular),
        irregular_jobs=frozenset(j.job_id for j in irregular),
    )
    # CPU is not partitioned: cores go to the jobs that hold GPUs by the cluster's CPU rule
    # (policies/cpu.py), once the partitions have said who runs, each no more than the whole link
    # could keep busy with its dataset's allocation cached (as policies.fifo.running_allocation).
    holding = [j for j in snapshot.jobs if gpu_share.get(j.job_id, 0.0) > 0]
    ceiling = cores_the_link_can_feed(holding, cache, snapshot.datasets, cap) if cap.manages_cpu and cap.cpu_allocation == "model" else None
    cpu = cpu_for_running(holding, snapshot.jobs, cap, ceiling)
    result = Allocation(gpu_share=gpu_share, cache=cache, remote_io=remote_io, cpu=cpu,
                        objective=min(objectives) if objectives else None, partition=partition)
    problems = partition_violations(snapshot, result)
    if problems:
        raise AllocationError("invalid partitioned allocation: " + "; ".join(problems))
    return result  # the scheduling core validates it against the cluster, as any allocation


def partition_share(
    snapshot: Snapshot, gpu_share: Mapping[str, float], regular_flags: Sequence[bool] | None = None
) -> tuple[float, bool]:
    """(s, pinned): the irregular partition's fraction of cache and remote IO this round."""
    if regular_flags is None:
        regular_flags = [j.access.regular for j in snapshot.jobs]
    kinds = ~np.array(regular_flags, dtype=bool)
    if not kinds.any():
        return 0.0, False
    if kinds.all():
        return 1.0, False
    pin = snapshot.capacity.irregular_share
    if pin is not None:
        return float(pin), True
    ideal = np.array([j.ideal_throughput for j in snapshot.jobs], dtype=float)
    held = np.array([gpu_share.get(j.job_id, 0.0) for j in snapshot.jobs], dtype=float)
    weight = held * ideal
    if weight.sum() <= 0:  # nobody holds GPUs: fall back to what the active jobs would read
        weight = ideal
    return float(np.clip(weight[kinds].sum() / weight.sum(), 0.0, 1.0)), False


def lru_datasets(jobs: Sequence[JobView], gpu_share: Mapping[str, float] | None = None) -> set[str]:
    """Datasets read only by irregular jobs. A dataset that a regular job holding GPUs this
    round reads (any regular job, without `gpu_share`) stays uniform and belongs to the regular
    partition, whoever else reads it. A queued regular reader does not count: the regular
    partition plans cache only for the datasets of the jobs it runs, so it would leave a
    dataset that only a running curriculum job reads with no cache at all (1.4-3.4x the
    item-level JCT in the simulator's fuzzing)."""
    regular = {j.dataset for j in jobs if j.access.regular and (gpu_share is None or gpu_share.get(j.job_id, 0.0) > 0)}
    return {j.dataset for j in jobs if not j.access.regular} - regular


def shared_lru_cache(
    irregular: Sequence[JobView], gpu_share: Mapping[str, float], snapshot: Snapshot, lru: set[str], capacity: float
) -> dict[str, float]:
    """The irregular partition's LRU pool as bytes per dataset: proportional to each dataset's
    read rate (sum of share_j f*_j of its running readers), capped at its size."""
    rate: dict[str, float] = {}
    for j in irregular:
        share = gpu_share.get(j.job_id, 0.0)
        if j.dataset in lru and share > 0:
            rate[j.dataset] = rate.get(j.dataset, 0.0) + share * j.ideal_throughput
    names = sorted(rate)
    if not names:
        return {}
    weights = np.array([rate[n] for n in names], dtype=float)
    sizes = np.array([snapshot.datasets[n].size for n in names], dtype=float)
    granted = proportional_fill(weights, sizes, capacity)
    return dict(zip(names, granted.tolist(), strict=True))


def proportional_fill(weights: np.ndarray, caps: np.ndarray, capacity: float) -> np.ndarray:
    """Split `capacity` in proportion to `weights`, no item above its cap; what a capped item
    cannot take goes to the others in the same proportion (water-filling)."""
    granted = np.zeros(len(weights))
    free = weights > 0
    left = float(capacity)
    while free.any() and left > 0:
        trial = left * weights[free] / weights[free].sum()
        room = caps[free]
        full = trial >= room
        index = np.flatnonzero(free)
        if not full.any():
            granted[index] = trial
            break
        granted[index[full]] = room[full]
        left -= float(room[full].sum())
        free[index[full]] = False
    return granted


def shared_remote_io(
    irregular: Sequence[JobView],
    gpu_share: Mapping[str, float],
    snapshot: Snapshot,
    cache: Mapping[str, float],
    capacity: float,
) -> dict[str, float]:
    """The irregular partition's link, shared max-min by the time-averaged demand of its running
    jobs, share_j f*_j (1 - c/d) with c the filled part of the dataset's cache (LRU or, for a
    dataset shared with regular jobs, uniform). Returned as a rate while running."""
    ids = [j.job_id for j in irregular]
    share = np.array([gpu_share.get(i, 0.0) for i in ids], dtype=float)
    hit = np.array(
        [min(snapshot.datasets[j.dataset].filled(cache.get(j.dataset, 0.0)) / snapshot.datasets[j.dataset].size, 1.0) for j in irregular],
        dtype=float,
    )
    ideal = np.array([j.ideal_throughput for j in irregular], dtype=float)
    avg = max_min_share(share * ideal * (1.0 - hit), capacity)
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(share > 0, avg / np.where(share > 0, share, 1.0), 0.0)
    return dict(zip(ids, rate.tolist(), strict=True))


def partition_violations(snapshot: Snapshot, allocation: Allocation) -> list[str]:
    """Every way `allocation` breaks its partitions (empty when it keeps them, or has none)."""
    p = allocation.partition
    if p is None:
        return []
    jobs = {j.job_id: j for j in snapshot.jobs}
    problems: list[str] = []
    cache = allocation.cache or {}
    io = allocation.remote_io or {}

    def over(used: float, limit: float) -> bool:
        return used > limit * (1 + 1e-6) + 1e-6

    lru_bytes = sum(v for k, v in cache.items() if k in p.lru_datasets)
    regular_bytes = sum(v for k, v in cache.items() if k not in p.lru_datasets)
    if over(lru_bytes, p.irregular_cache):
        problems.append(f"irregular partition: cache {lru_bytes:.6g} B > its {p.irregular_cache:.6g} B")
    if over(regular_bytes, p.regular_cache):
        problems.append(f"regular partition: cache {regular_bytes:.6g} B > its {p.regular_cache:.6g} B")
    for kind, members, limit in (("regular", p.regular_jobs, p.regular_io), ("irregular", p.irregular_jobs, p.irregular_io)):
        used = sum(io.get(k, 0.0) * allocation.gpu_share.get(k, 0.0) for k in members)
        if over(used, limit):
            problems.append(f"{kind} partition: remote IO {used:.6g} B/s > its {limit:.6g} B/s")
    if over(p.regular_cache + p.irregular_cache, snapshot.capacity.cache) or over(p.regular_io + p.irregular_io, snapshot.capacity.remote_io):
        problems.append("the partitions add up to more than the cluster")
    gpus = sum(allocation.gpu_share.get(k, 0.0) * jobs[k].gpus for k in jobs)
    if over(gpus, p.regular_gpus + p.irregular_gpus):
        problems.append(f"GPUs: {gpus:.6g} used > the {p.regular_gpus + p.irregular_gpus:.6g} of the one pool's decision")
    wrong = {j.dataset for j in snapshot.jobs if j.access.regular and allocation.gpu_share.get(j.job_id, 0.0) > 0} & p.lru_datasets
    if wrong:
        problems.append(f"datasets read by regular jobs holding GPUs must stay uniform: {sorted(wrong)}")
    return problems


def _gpus_used(jobs: Sequence[JobView], gpu_share: Mapping[str, float]) -> float:
    return float(sum(gpu_share.get(j.job_id, 0.0) * j.gpus for j in jobs))


def _partition_capacity(cap: ClusterCapacity, gpu_budget: float, fraction: float) -> ClusterCapacity:
    # Without cpus_per_node: the partitions plan GPUs and storage; cores are given after the merge.
    gpus = min(cap.gpus, max(1, math.ceil(gpu_budget - _REL_TOL * cap.gpus)))
    return ClusterCapacity(gpus=gpus, cache=cap.cache * fraction, remote_io=cap.remote_io * fraction, gpus_per_node=cap.gpus_per_node)


def _allocate_in_partition(
    jobs: tuple[JobView, ...],
    snapshot: Snapshot,
    capacity: ClusterCapacity,
    gpu_budget: float,
    policy: Policy,
    estimator: Estimator,
) -> Allocation:
    """The policy on one partition's jobs, within its GPU budget and storage."""
    if not jobs:
        return Allocation(gpu_share={})
    if gpu_budget <= _REL_TOL * snapshot.capacity.gpus:
        # No GPU for this kind this round: nothing runs, so nothing to plan storage for.
        return Allocation(gpu_share={j.job_id: 0.0 for j in jobs}, cache={}, remote_io={j.job_id: 0.0 for j in jobs})
    names = {j.dataset for j in jobs}
    part = Snapshot(time=snapshot.time, jobs=jobs, datasets={n: snapshot.datasets[n] for n in names}, capacity=capacity)
    # Checked against this partition's capacity here, because the partition is what the policy
    # was given; the merged result is checked against the cluster by the core.
    alloc = validate_allocation(part, policy.allocate(part, estimator))
    used = _gpus_used(jobs, alloc.gpu_share)
    if used <= gpu_budget * (1 + _REL_TOL):
        return alloc
    # Fractional budgets (time sharing) were rounded up for the call: scale back into the budget.
    # IO rates are while running, so the time-averaged IO only shrinks.
    factor = gpu_budget / used
    return Allocation(gpu_share={k: v * factor for k, v in alloc.gpu_share.items()}, cache=alloc.cache,
                      remote_io=alloc.remote_io, objective=alloc.objective)


__all__ = [
    "allocate_partitioned",
    "lru_datasets",
    "partition_share",
    "partition_violations",
    "proportional_fill",
    "shared_lru_cache",
    "shared_remote_io",
]
