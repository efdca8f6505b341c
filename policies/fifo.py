"""FIFO: GPUs in arrival order; SiloD form adds Algorithm 2 cache and a max-min fair link.

SiloD §5.3 names FIFO as a scheduler without a performance estimator, for which SiloD uses its
greedy policy: cache by Algorithm 2, and no ranking of the jobs for remote IO (the paper's only
rule for an unranked link is a fair share, §7.2). An earlier version served the link in arrival
order, a rule the paper does not have; see docs/results.md (Fig. 12) for what it cost.

Two FIFOs, both explicit. `fifo` backfills: a waiting job whose gang does not fit yet lets later
jobs that fit take the free GPUs. The SiloD paper does not say which FIFO it ran ("SiloD follows
the scheduling order set by the FIFO policy", §7); its cluster ran jobs on Kubernetes, whose
scheduler starts any pod that fits, which is backfilling, and this project's figures use it.
`fifo-strict` is head-of-line FIFO as Gavel's FIFOPolicy runs it (scheduler/policies/fifo.py at
c4fa400: the queue stops at the first job that does not fit): no job overtakes an earlier one.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import numpy as np

from policies.base import Policy
from policies.cpu import cores_the_link_can_feed, cpu_for_running, effective_jobs
from policies.estimators import Estimator
from policies.loader import cache_weight
from policies.storage import (demands_at_full_speed, demands_of, greedy_cache, greedy_cache_of, io_in_priority_order, keep_for_waiting,
                              keep_for_waiting_of, max_min_share)
from policies.types import Allocation, JobColumns, JobView, Snapshot


def place_in_order(jobs: Sequence[JobView], total_gpus: int, keep_running: bool, strict: bool = False) -> list[JobView]:
    """Give jobs their full GPU count in the given order, skipping any that do not fit (strict:
    stopping at the first that does not: head-of-line blocking).

    With keep_running, jobs already running keep their GPUs first (no preemption).
    """
    return [jobs[k] for k in place_positions(list(map(_GPUS, jobs)), list(map(_RUNNING, jobs)), total_gpus, keep_running, strict)]


def place_positions(gpus: Sequence[float], running: Sequence[bool], total_gpus: int, keep_running: bool, strict: bool = False) -> list[int]:
    """place_in_order on columns (each job's GPUs and whether it runs, in the given order): the
    positions of the jobs placed, ascending."""
    free = total_gpus
    placed = [False] * len(gpus)
    if keep_running:
        for k, (g, r) in enumerate(zip(gpus, running, strict=True)):
            if r and g <= free:
                placed[k] = True
                free -= g
    for k, g in enumerate(gpus):
        if placed[k]:
            continue
        if g <= free:
            placed[k] = True
            free -= g
        elif strict:
            break
    return [k for k, p in enumerate(placed) if p]


def storage_for_running(
    running: Sequence[JobView],
    snapshot: Snapshot,
    estimator: Estimator,
    io_rule: str = "priority",
) -> tuple[dict[str, float] | None, dict[str, float] | None]:
    """Cache by Algorithm 2 over the running jobs, then what they leave keeps what is cached of
    the other jobs' datasets (policies.storage.keep_for_waiting); IO by `io_rule` ('priority' in
    the order of `running`, or 'fair' max-min by demand). None, None when storage is
    unmanaged."""
    if not estimator.manages_storage:
        return None, None
    cap = snapshot.capacity
    cache = greedy_cache(running, snapshot.datasets, cap.cache)
    if sum(cache.values()) < cap.cache:  # on a busy cluster the running jobs fill it: no pass over the queue
        running_ids = {j.job_id for j in running}
        cache = keep_for_waiting(cache, [j for j in snapshot.jobs if j.job_id not in running_ids], snapshot.datasets, cap.cache)
    demands = demands_at_full_speed(running, cache, snapshot.datasets)
    return cache, dict(zip(map(_JOB_ID, running), _share_link(demands, cap.remote_io, io_rule).tolist(), strict=True))


def _share_link(demands: np.ndarray, capacity: float, io_rule: str) -> np.ndarray:
    if io_rule == "priority":
        return io_in_priority_order(demands, capacity)
    if io_rule == "fair":
        return max_min_share(demands, capacity)
    raise ValueError(f"unknown io_rule {io_rule!r}")


def running_allocation_of(placed: list[int], snapshot: Snapshot, cols: JobColumns, estimator: Estimator, io_rule: str) -> Allocation:
    """running_allocation on the snapshot's columns for the jobs at positions `placed` (in
    running_allocation's order), on a cluster that does not model CPU: the same allocation
    without reading a JobView."""
    at = np.array(placed, dtype=np.int64)
    ids = list(map(cols.ids.__getitem__, placed))
    cache = io = None
    if estimator.manages_storage:
        cap = snapshot.capacity
        names = list(map(cols.datasets.__getitem__, placed))
        ideal = cols.ideal[at]
        miss = None if cols.miss_rate is None else cols.miss_rate[at]
        cache = greedy_cache_of(names, cache_weight(ideal, miss), cols.remaining[at], snapshot.datasets, cap.cache)
        if sum(cache.values()) < cap.cache:
            waiting = np.ones(len(cols.ids), dtype=bool)
            waiting[at] = False
            w = waiting.nonzero()[0]
            cache = keep_for_waiting_of(cache, list(map(cols.datasets.__getitem__, w.tolist())),
                                        cache_weight(cols.ideal[w], None if cols.miss_rate is None else cols.miss_rate[w]),
                                        snapshot.datasets, cap.cache)
        hits = None if cols.hit_now is None else cols.hit_now[at]
        measured = np.zeros(at.size, dtype=bool) if hits is None else ~np.isnan(hits)
        told = np.where(measured, hits, 0.0) if measured.any() else None
        demands = demands_of(ideal, names, measured, told, cache, snapshot.datasets, miss)
        io = dict(zip(ids, _share_link(demands, cap.remote_io, io_rule).tolist(), strict=True))
    share = dict.fromkeys(cols.ids, 0.0)
    share.update(dict.fromkeys(ids, 1.0))
    return Allocation(gpu_share=share, cache=cache, remote_io=io, cpu=None)


#: The arrival order's key: (submit time, job id).
_ARRIVAL = attrgetter("submit_time", "job_id")
_JOB_ID, _GPUS, _RUNNING = attrgetter("job_id"), attrgetter("gpus"), attrgetter("running")

#: Most re-plans of cores and cache in running_allocation after the first.
CORE_PASSES = 4


def running_allocation(running: Sequence[JobView], snapshot: Snapshot, estimator: Estimator, io_rule: str = "priority") -> Allocation:
    """GPUs to `running`, then CPU cores (policies/cpu.py), then cache and IO planned for the
    speed each job reaches with its cores (a CPU-bound job needs less IO than f* suggests).

    A job gets no more cores than the whole link could keep busy (`cores_the_link_can_feed`):
    first with its dataset cached as far as the cluster's cache allows (true of any plan), then,
    once the cache is planned, as far as its allocation allows; the cores it cannot use go to the
    next jobs in the knapsack and the cache is planned again for the speeds that gives (at most
    CORE_PASSES times, until no job holds more than it can use). Without it an IO-starved job
    held cores another job waited for: 2 GPUs, 4 cores, a 20 MB/s link, one job streaming 10 GB
    that the link holds to 0.8 cores' worth took all 4 and left the other's GPU idle (FIFO,
    average JCT 581 s; now 395 s; docs/policies.md). The bound takes the whole link, not the
    plan's share of it, so a job keeps the cores it could use when the others read less."""
    cap = snapshot.capacity
    bound = None
    if cap.manages_cpu and cap.cpu_allocation == "model" and running:
        bound = cores_the_link_can_feed(running, None, snapshot.datasets, cap)
    cpu = cpu_for_running(running, snapshot.jobs, cap, bound)
    cache, io = storage_for_running(effective_jobs(running, cpu), snapshot, estimator, io_rule)
    if bound is not None and cache is not None:
        for _ in range(CORE_PASSES):
            fed = cores_the_link_can_feed(running, cache, snapshot.datasets, cap)  # an allocation <= the cache: <= bound
            held = np.array([cpu[j.job_id] for j in running], dtype=float)
            if not (held > fed * (1 + 1e-9)).any():
                break
            cpu = cpu_for_running(running, snapshot.jobs, cap, fed)
            cache, io = storage_for_running(effective_jobs(running, cpu), snapshot, estimator, io_rule)
    share = dict.fromkeys(map(_JOB_ID, snapshot.jobs), 0.0)
    share.update(dict.fromkeys(map(_JOB_ID, running), 1.0))
    return Allocation(gpu_share=share, cache=cache, remote_io=io, cpu=cpu)


class FifoPolicy(Policy):
    name = "fifo"
    description = "first come, first served; running jobs are never preempted; later jobs backfill free GPUs; Algorithm 2 cache, IO fair-shared"
    #: head-of-line blocking: no job starts before an earlier one that waits (Gavel's FIFO)
    strict: bool = False

    def allocate(self, snapshot: Snapshot, estimator: Estimator) -> Allocation:
        # §5.3: FIFO has no estimator with which to rank jobs for IO, so the link is shared fairly.
        return first_come_first_served(snapshot, estimator, self.strict)


class StrictFifoPolicy(FifoPolicy):
    name = "fifo-strict"
    description = ("first come, first served without backfilling (Gavel's FIFO): a job that does not fit blocks the later ones; "
                   "running jobs are never preempted; Algorithm 2 cache, IO fair-shared")
    strict = True


def first_come_first_served(snapshot: Snapshot, estimator: Estimator, strict: bool = False) -> Allocation:
    """GPUs in arrival order (running jobs kept; strict: up to the first waiting job that does
    not fit), then running_allocation with a fair link: on the snapshot's columns when it has
    them and CPU is not modelled."""
    cols = snapshot.job_columns()
    if cols is not None and cols.submit is not None and cols.id_rank is not None and not snapshot.capacity.manages_cpu:
        return fifo_on_columns(snapshot, cols, estimator, strict)
    jobs = sorted(snapshot.jobs, key=_ARRIVAL)
    running = place_in_order(jobs, snapshot.capacity.gpus, keep_running=True, strict=strict)
    return running_allocation(running, snapshot, estimator, io_rule="fair")


def fifo_on_columns(snapshot: Snapshot, cols: JobColumns, estimator: Estimator, strict: bool = False) -> Allocation:
    """FifoPolicy.allocate on the snapshot's columns (no CPU modelled): arrival order is (submit
    time, id), the ids ordered by their ranks."""
    order = np.lexsort((cols.id_rank, cols.submit))
    placed = place_positions(cols.gpus[order].tolist(), cols.running[order].tolist(), snapshot.capacity.gpus, keep_running=True,
                             strict=strict)
    return running_allocation_of(order[placed].tolist(), snapshot, cols, estimator, io_rule="fair")


class GreedyPolicy(Policy):
    """Algorithm 2 for schedulers without a performance estimator.

    GPUs come from the host scheduler's order (FIFO here); only the cache is chosen by cache
    efficiency, and the remote link is shared max-min by demand, because such a scheduler has no
    estimator with which to rank jobs for IO. With FIFO as the host scheduler that is what `fifo`
    does (the paper's SiloD-FIFO, §5.3); the name stays because users and plug-ins rely on it.
    """

    name = "greedy"
    description = "FIFO GPUs; cache datasets in descending cache efficiency (Algorithm 2); IO fair-shared"

    def allocate(self, snapshot: Snapshot, estimator: Estimator) -> Allocation:
        return first_come_first_served(snapshot, estimator)


__all__ = ["FifoPolicy", "GreedyPolicy", "StrictFifoPolicy", "fifo_on_columns", "first_come_first_served", "place_in_order", "place_positions",
           "running_allocation", "running_allocation_of", "storage_for_running"]
