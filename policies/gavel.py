"""Gavel max-min fairness with cache and remote IO as resources (Eq. 8 and 9).

    maximise  min_j  perf(j, R_j) / perf(j, R_equal)      subject to the capacities

Variables per job: x_j, the fraction of time it runs on its g_j GPUs, and B_j, its time-averaged
remote IO; per dataset k: cache c_k. A job's time-averaged throughput is
min(x_j f*_j, B_j / (1 - c_k/d_k)).

Exact solution without an LP. Fix the target ratio t: every job needs throughput T_j = t ref_j.
Then x_j = T_j / f*_j (<= 1), the GPUs used are linear in t, and the IO needed is
sum_j T_j (1 - c_k/d_k) = t * (sum_j ref_j - sum_k c_k e_k) with e_k = sum_{j in k} ref_j / d_k.
Minimising it under the cache budget is a fractional knapsack whose order (by e_k) does not
depend on t. So each constraint bounds t linearly and t* is the smallest bound: O(n log n).
`gavel_reference.py` solves the same problem with cvxpy for the tests.

CPU cores (when the cluster models them; estimator/pipeline.py): job j preprocesses r_j source
bytes/s per core and may hold at most cap_j cores while it runs (its nodes' cores). Its
throughput needs T_j / r_j time-averaged cores, so the pool adds one more linear bound,
sum_j t ref_j / r_j <= K, and the cap makes its useful speed per unit of GPU time
f'_j = min(f*_j, cap_j r_j), used in place of f*_j for the GPU bounds. With GPU-proportional
CPU (the baseline) cap_j is the job's GPU-proportional cores and the pool bound is dropped.

Equal share R_equal: every active job gets 1/n of the GPUs (as a time fraction of its g_j GPUs,
at most 1), 1/n of the remote IO, and each dataset the equal cache shares of its readers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter

import numpy as np

from estimator import can_reuse_new_cache
from policies.base import Policy
from policies.estimators import Estimator
from policies.loader import planned_rate
from policies.types import Allocation, Snapshot, miss_rates, name_ranks


@dataclass(frozen=True, slots=True)
class GavelProblem:
    """The arrays of one max-min instance (index j over jobs, k over datasets)."""

    job_ids: tuple[str, ...]
    gpus: np.ndarray  # g_j
    ideal: np.ndarray  # f*_j
    dataset_index: np.ndarray  # k(j)
    dataset_names: tuple[str, ...]
    dataset_size: np.ndarray  # d_k
    total_gpus: float
    total_cache: float
    total_io: float
    manages_storage: bool
    #: bytes of each dataset in cache now (None: assume allocations are filled, as Eq. 9 does;
    #: always None without storage, as `reuse` is: neither plays a part in the GPU bounds)
    dataset_cached: np.ndarray | None = None
    #: per job, share of its remaining reads new cache can serve (None: all, as Eq. 5 assumes)
    reuse: np.ndarray | None = None
    #: per job, measured hit ratio on the rest of its epoch (NaN where unknown)
    hit_now: np.ndarray | None = None
    #: per job, source bytes/s per core (inf: not CPU-bound); None: CPU not modelled
    cpu_rate: np.ndarray | None = None
    #: per job, most cores while it runs (inf: unbounded)
    cpu_cap: np.ndarray | None = None
    total_cpus: float = float("inf")

    @property
    def gpu_ideal(self) -> np.ndarray:
        """f'_j = min(f*_j, cap_j r_j): the most a job reads per unit of GPU time with its cores."""
        if self.cpu_rate is None:
            return self.ideal
        with np.errstate(invalid="ignore"):
            cpu = np.where(np.isinf(self.cpu_rate), np.inf, self.cpu_cap * self.cpu_rate)
        return np.minimum(self.ideal, cpu)

    def cpu_per_throughput(self) -> np.ndarray:
        """1 / r_j: core-seconds per byte (0 where not CPU-bound)."""
        if self.cpu_rate is None:
            return np.zeros(self.n)
        return np.where(np.isinf(self.cpu_rate), 0.0, 1.0 / self.cpu_rate)

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot, manages_storage: bool) -> GavelProblem:
        # A decision builds the same problem twice (the policy; the simulator's Eq. 8
        # references): the last one is kept, keyed by the snapshot object itself (immutable).
        global _LAST_PROBLEM
        last = _LAST_PROBLEM
        if last is not None and last[0] is snapshot and last[1].manages_storage == manages_storage:
            return last[1]
        problem = cls._build(snapshot, manages_storage)
        cols = snapshot.job_columns()
        problem = problem.with_loaders(cols.miss_rate if cols is not None else miss_rates(snapshot.jobs))
        _LAST_PROBLEM = (snapshot, problem)
        return problem

    @classmethod
    def built_for(cls, snapshot: Snapshot, manages_storage: bool) -> GavelProblem | None:
        """The problem from_snapshot last built, if it was for this snapshot (else None)."""
        last = _LAST_PROBLEM
        if last is not None and last[0] is snapshot and last[1].manages_storage == manages_storage:
            return last[1]
        return None

    @classmethod
    def _build(cls, snapshot: Snapshot, manages_storage: bool) -> GavelProblem:
        cols = snapshot.job_columns()
        if cols is not None and not snapshot.capacity.manages_cpu:
            return cls._from_columns(snapshot, cols, manages_storage)
        names = tuple(sorted({j.dataset for j in snapshot.jobs}))
        index = {n: i for i, n in enumerate(names)}
        cap = snapshot.capacity
        cpu_rate = cpu_cap = None
        total_cpus = float("inf")
        if cap.manages_cpu:
            cpu_rate = np.array([j.cpu_rate for j in snapshot.jobs], dtype=float)
            if cap.cpu_allocation == "gpu-proportional":
                cpu_cap = np.array([cap.gpu_proportional_cpu(j.gpus) for j in snapshot.jobs], dtype=float)
            else:
                cpu_cap = np.array([cap.cpu_cap(j.gpus) for j in snapshot.jobs], dtype=float)
                total_cpus = cap.cpus
        return cls(
            job_ids=tuple(j.job_id for j in snapshot.jobs),
            gpus=np.array([j.gpus for j in snapshot.jobs], dtype=float),
            ideal=np.array([j.ideal_throughput for j in snapshot.jobs], dtype=float),
            dataset_index=np.array([index[j.dataset] for j in snapshot.jobs], dtype=np.int64),
            dataset_names=names,
            dataset_size=np.array([snapshot.datasets[n].size for n in names], dtype=float),
            total_gpus=float(cap.gpus),
            total_cache=float(cap.cache),
            total_io=float(cap.remote_io),
            manages_storage=manages_storage,
            cpu_rate=cpu_rate,
            cpu_cap=cpu_cap,
            total_cpus=total_cpus,
            hit_now=(
                None
                if all(j.hit_ratio_now is None for j in snapshot.jobs)
                else np.array([np.nan if j.hit_ratio_now is None else j.hit_ratio_now for j in snapshot.jobs], dtype=float)
            ),
            reuse=None if not manages_storage else np.asarray(
                can_reuse_new_cache([j.remaining_bytes for j in snapshot.jobs], [snapshot.datasets[j.dataset].size for j in snapshot.jobs],
                                    [sum(o.dataset == j.dataset for o in snapshot.jobs) > 1 for j in snapshot.jobs]),
                dtype=float,
            ).reshape(-1),
            dataset_cached=(
                None
                if not manages_storage or all(snapshot.datasets[n].cached is None for n in names)
                else np.array([snapshot.datasets[n].filled(snapshot.datasets[n].size) for n in names], dtype=float)
            ),
        )

    @classmethod
    def _from_columns(cls, snapshot: Snapshot, cols, manages_storage: bool) -> GavelProblem:
        """The same problem from the snapshot's columns (no per-job Python beyond the ids and
        dataset names; CPU-modelled clusters take the per-view path)."""
        # Grouped by the datasets' ranks (small ints: a mask over them, in the names' order), not
        # by sorting the names at each decision when the backend hands the ranks in.
        rank = cols.dataset_rank if cols.dataset_rank is not None else name_ranks(cols.datasets)
        position = np.empty(int(rank.max()) + 1 if rank.size else 0, dtype=np.int64)
        position[rank] = np.arange(rank.size)  # a job of each rank (any: they read the same dataset)
        present = np.zeros(position.size, dtype=bool)
        present[rank] = True
        ranks = present.nonzero()[0]
        names = tuple(map(cols.datasets.__getitem__, position[ranks].tolist()))
        position[ranks] = np.arange(ranks.size)
        dataset_index = position[rank]
        views = list(map(snapshot.datasets.__getitem__, names))
        sizes = np.fromiter(map(_SIZE, views), dtype=float, count=len(views))
        return cls(
            job_ids=cols.ids,
            gpus=cols.gpus,
            ideal=cols.ideal,
            dataset_index=dataset_index,
            dataset_names=names,
            dataset_size=sizes,
            total_gpus=float(snapshot.capacity.gpus),
            total_cache=float(snapshot.capacity.cache),
            total_io=float(snapshot.capacity.remote_io),
            manages_storage=manages_storage,
            hit_now=cols.hit_now,
            # can_reuse_new_cache: more than an epoch left, or a co-reader on the dataset
            reuse=((cols.remaining > sizes[dataset_index]) | (np.bincount(dataset_index, minlength=sizes.size)[dataset_index] > 1)).astype(float)
            if manages_storage else None,
            dataset_cached=_filled(sizes, list(map(_CACHED, views))) if manages_storage else None,
        )

    @property
    def n(self) -> int:
        return len(self.job_ids)

    def with_loaders(self, miss_rate: np.ndarray | None) -> GavelProblem:
        """The problem with each loader job's f* replaced by the rate its loader allows at its
        hit ratio now (policies/loader.py: X(h) = 1 / (1/f* + (1-h)/m); h measured on the rest of
        its epoch, else its dataset's cached part, else 0): the GPU time it needs for a target
        is T / X(h). Storage-unaware baselines and jobs without a loader term keep f*."""
        if miss_rate is None or not self.manages_storage or not np.isfinite(miss_rate).any():
            return self
        per_ds = (np.zeros(len(self.dataset_names)) if self.dataset_cached is None
                  else np.minimum(self.dataset_cached / self.dataset_size, 1.0))
        h = per_ds[self.dataset_index]
        if self.hit_now is not None:
            h = np.where(np.isnan(self.hit_now), h, self.hit_now)
        return replace(self, ideal=planned_rate(self.ideal, miss_rate, h))


_SIZE, _CACHED = attrgetter("size"), attrgetter("cached")


def _filled(sizes: np.ndarray, cached: list[float | None]) -> np.ndarray | None:
    """DatasetView.filled(size) of each dataset, in one pass (None: no cached bytes reported)."""
    if not cached or (cached[0] is None and all(c is None for c in cached)):
        return None
    reported = np.fromiter(cached, dtype=float, count=len(cached))  # (None reads as NaN here)
    if np.isnan(reported).any():  # some not reported (or NaN): each one by the rule
        reported = np.array([np.inf if c is None else c for c in cached], dtype=float)
    return np.minimum(sizes, reported)


#: (snapshot, problem) of the last from_snapshot call (see there).
_LAST_PROBLEM: tuple[Snapshot, GavelProblem] | None = None


def equal_share_throughput(p: GavelProblem) -> np.ndarray:
    """ref_j = perf(j, R_equal), the denominator of Eq. 8/9 (read-only: one decision asks for
    it three times, so the last problem's is kept, keyed by the problem object)."""
    global _LAST_REFERENCE
    last = _LAST_REFERENCE
    if last is not None and last[0] is p:
        return last[1]
    ref = _equal_share_throughput(p)
    ref.flags.writeable = False
    _LAST_REFERENCE = (p, ref)
    return ref


#: (problem, its equal-share throughput) of the last equal_share_throughput call.
_LAST_REFERENCE: tuple[GavelProblem, np.ndarray] | None = None


def _equal_share_throughput(p: GavelProblem) -> np.ndarray:
    n = p.n
    x_eq = np.minimum(1.0, p.total_gpus / (n * p.gpus))
    gpu_bound = x_eq * p.gpu_ideal
    if p.cpu_rate is not None and np.isfinite(p.total_cpus):
        # 1/n of the cores (time-averaged), no more than its cap for the time it runs.
        cores = np.minimum(p.total_cpus / n, x_eq * p.cpu_cap)
        with np.errstate(invalid="ignore"):
            gpu_bound = np.minimum(gpu_bound, np.where(np.isinf(p.cpu_rate), np.inf, cores * p.cpu_rate))
    if not p.manages_storage:
        return gpu_bound
    readers = np.bincount(p.dataset_index, minlength=len(p.dataset_names))
    c_eq = np.minimum(p.dataset_size, p.total_cache / n * readers)
    miss = 1.0 - c_eq[p.dataset_index] / p.dataset_size[p.dataset_index]
    b_eq = p.total_io / n
    with np.errstate(divide="ignore"):
        io_limited = np.where(miss > 0, b_eq / np.where(miss > 0, miss, 1.0), np.inf)
    return np.minimum(gpu_bound, io_limited)


@dataclass(frozen=True, slots=True)
class GavelSolution:
    ratio: float  # t*, the max-min fairness ratio
    share: np.ndarray  # x_j
    avg_io: np.ndarray  # B_j, time-averaged remote IO
    cache: np.ndarray  # c_k
    reference: np.ndarray  # ref_j
    #: 1 - h_j per job now (solve_max_min's, with storage: the filled part of c_k, no more than
    #: the job's measured hit ratio); None where a solver does not give it (gavel_reference)
    miss: np.ndarray | None = None


def solve_max_min(p: GavelProblem) -> GavelSolution:
    """Exact max-min fairness by the closed form described in the module docstring.

    Jobs whose gang is larger than the cluster, and jobs whose equal share yields nothing (no
    remote IO and nothing cached), cannot be helped by any share of the ratio: they get no GPU
    time and are left out of the minimum.
    """
    n_ds = len(p.dataset_names)
    if p.n == 0:
        return GavelSolution(0.0, np.zeros(0), np.zeros(0), np.zeros(n_ds), np.zeros(0), np.zeros(0))
    ref = equal_share_throughput(p)
    ref = np.where(p.gpus <= p.total_gpus, ref, 0.0)
    counted = ref > 0
    if not counted.any():
        return GavelSolution(0.0, np.zeros(p.n), np.zeros(p.n), np.zeros(n_ds), ref, np.zeros(p.n))
    f = p.gpu_ideal
    bounds = [
        float((f[counted] / ref[counted]).min()),
        p.total_gpus / float((p.gpus * ref / f).sum()),
    ]
    cpu_per_t = float((ref * p.cpu_per_throughput()).sum())
    if np.isfinite(p.total_cpus) and cpu_per_t > 0:
        bounds.append(p.total_cpus / cpu_per_t)
    cache, miss = np.zeros(n_ds), np.zeros(p.n)
    if p.manages_storage:
        # The knapsack of Eq. 9's cache, by efficiency e_k (exact for the max-min ratio), or,
        # when the cache state and remaining work are known, cached bytes at e_k and the rest at
        # the reuse-weighted rate (see policies.storage.greedy_cache for why). It does not depend
        # on t; the IO needed now counts a dataset's cache only as far as it is filled (and a job
        # no more than the hit ratio it measures on the rest of its epoch: Eq. 9's objective is
        # the fairness ratio now), which keeps it linear in t. Compiled (gavel_kernel).
        none = np.zeros(0)
        by_reuse = p.reuse is not None and p.dataset_cached is not None
        cache, miss, io_per_unit_t, ref_total = _kernels().cache_and_misses(
            ref, equal_share_throughput(p), p.dataset_index, p.dataset_size.astype(float, copy=False), float(p.total_cache),
            p.reuse if by_reuse else none, p.dataset_cached if p.dataset_cached is not None else none,
            p.hit_now if p.hit_now is not None else none, by_reuse, p.dataset_cached is not None, p.hit_now is not None)
        if io_per_unit_t > 1e-12 * ref_total:
            bounds.append(p.total_io / io_per_unit_t)
    t = min(bounds)
    target = t * ref
    share = target / f
    avg_io = target * miss if p.manages_storage else np.zeros(p.n)
    return GavelSolution(ratio=t, share=share, avg_io=avg_io, cache=cache, reference=ref, miss=miss)


def water_fill(p: GavelProblem, sol: GavelSolution) -> np.ndarray:
    """Raise jobs above the max-min level where resources are left (leximin, as Gavel's
    water-filling variant does): returns each job's target throughput T_j >= t* ref_j.

    At every level all still-unfrozen jobs grow at the same ratio until a resource binds; then
    the jobs that need that resource freeze (GPUs: all; remote IO: jobs with misses; their own
    gang, x_j = 1: that job). A fully cached job keeps growing on GPUs alone, which plain max-min
    would leave idle. Each level freezes at least one job, so there are at most n levels (run
    compiled: gavel_kernel.water_fill_levels).
    """
    ref = sol.reference
    target = sol.ratio * ref
    if p.n == 0 or sol.ratio <= 0:
        return target
    if p.manages_storage and sol.miss is None:
        raise ValueError("water_fill needs the solution's miss ratios with storage (solve_max_min gives them; gavel_reference does not)")
    miss = sol.miss if p.manages_storage else np.zeros(p.n)
    per_core = p.cpu_per_throughput()
    _kernels().water_fill_levels(target, ref, p.gpu_ideal, p.gpus.astype(float, copy=False), miss, per_core, float(p.total_gpus),
                                 float(p.total_io), float(p.total_cpus), p.manages_storage, bool(per_core.any()))
    return target


def spread_gpu_time(share: np.ndarray, gpus: np.ndarray, total_gpus: float) -> np.ndarray:
    """Scale shares up by one common factor, each capped at 1, until the GPUs are used.

    When IO binds, max-min leaves GPU time idle. A job's throughput target and time-averaged IO
    stay the same, but a longer share lowers the IO it needs while running (B_j / x_j): jobs
    read steadily instead of in bursts that, run together, would ask the link for more than it
    has. If every gang fits at once, every job gets share 1. The factor is the bisection's
    (gavel_kernel.common_factor, compiled).
    """
    active = share > 0
    if not active.any():
        return share
    if float(np.sum(gpus[active])) <= total_gpus:
        return np.where(active, 1.0, 0.0)
    factor = _kernels().common_factor(share.astype(float, copy=False), gpus.astype(float, copy=False), float(total_gpus))
    return np.minimum(share * factor, 1.0)


def centre_gpu_time(p: GavelProblem, sol: GavelSolution) -> np.ndarray:
    """Shares for the GPU-only problem (no storage or cores to allocate: Gavel's own LP, Eq. 8
    with one resource): the analytic centre of max-min's optimal face
    {t* ref_j / f_j <= x_j <= 1, sum_j g_j x_j <= G} (gavel_kernel.central_shares).

    When fewer jobs than GPUs are active that face holds many allocations: max-min pins the
    jobs that bind t* and leaves the others anywhere between their max-min share and 1. Gavel's
    simulator solves its LP with an interior-point solver (ECOS through cvxpy), which returns a
    point near that face's analytic centre: it neither fills the GPUs nor gives every job the
    same factor (water_fill and spread_gpu_time do both), and the gangs that do not fit together
    take turns by these shares in the round mechanism. Swapping ECOS for the analytic centre
    of its LP's face inside Gavel's simulator keeps 96-100% of its jobs within 10% of their JCT
    on the parity traces (docs/gavel.md). When the GPUs bind at t*, the face is one point and this is sol.share."""
    return _kernels().central_shares(sol.share, p.gpus.astype(float, copy=False), float(p.total_gpus))


def _kernels():
    """policies.gavel_kernel, imported on first use: numba loads only in processes that run
    Gavel (the service's API workers import this module but never allocate)."""
    from policies import gavel_kernel

    return gavel_kernel


class GavelPolicy(Policy):
    name = "gavel"
    description = "Gavel max-min fairness (Eq. 9) over GPU time, cache per dataset and IO per job"
    time_sharing = True

    def allocate(self, snapshot: Snapshot, estimator: Estimator) -> Allocation:
        problem = GavelProblem.from_snapshot(snapshot, estimator.manages_storage)
        sol = solve_max_min(problem)
        if not problem.manages_storage and problem.cpu_rate is None:
            # GPU time is the one resource: split what max-min leaves as Gavel's solver does.
            share = centre_gpu_time(problem, sol)
            return Allocation(gpu_share=dict(zip(problem.job_ids, share.tolist(), strict=True)), objective=sol.ratio)
        target = water_fill(problem, sol)
        share = target / problem.gpu_ideal
        if problem.manages_storage:
            avg_io = target * sol.miss
        if problem.n:
            share = spread_gpu_time(share, problem.gpus, problem.total_gpus)
        ids = problem.job_ids
        cpu = None
        if problem.cpu_rate is not None:
            # Cores while running: the time-averaged T_j / r_j over the time it runs; a job that
            # is not CPU-bound needs none (the model's view; it still has its node's cores).
            with np.errstate(divide="ignore", invalid="ignore"):
                cores = np.where(share > 0, target * problem.cpu_per_throughput() / np.where(share > 0, share, 1.0), 0.0)
            if snapshot.capacity.cpu_allocation == "gpu-proportional":
                cores = np.where(share > 0, problem.cpu_cap, 0.0)
            cpu = dict(zip(ids, np.minimum(cores, problem.cpu_cap).tolist(), strict=True))
        if not problem.manages_storage:
            return Allocation(gpu_share=dict(zip(ids, share.tolist(), strict=True)), cpu=cpu, objective=sol.ratio)
        with np.errstate(divide="ignore", invalid="ignore"):
            io_running = np.where(share > 0, avg_io / np.where(share > 0, share, 1.0), 0.0)
        return Allocation(
            gpu_share=dict(zip(ids, share.tolist(), strict=True)),
            cache=dict(zip(problem.dataset_names, sol.cache.tolist(), strict=True)),
            remote_io=dict(zip(ids, io_running.tolist(), strict=True)),
            cpu=cpu,
            objective=sol.ratio,
        )
