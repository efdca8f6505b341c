"""Multi-resource shortest-job-first (Eq. 6 and 7, after Tetris and Tiresias).

score_j = min over R of  sum_t w_t R_t * remaining_bytes_j / perf(j, R),  w_t = 1/total_t.

With SiloDPerf and a job's GPU count fixed, the optimum runs the job at f* (a slower speed only
lengthens the job while saving IO it could not use), so b = f* (1 - c/d) and the score is

    W/f* * (g/G + c/C) + W (1 - c/d) / B  [+ W / (r K) with CPU: f*/r cores for W/f* s],

linear in c: the minimum is at c = 0 or c = min(d, C). Jobs are ranked by ascending score each
round (preemptive, shortest remaining first); cache goes to the running jobs by Algorithm 2 (the
room they leave keeps what is cached of paused and queued jobs' datasets) and remote IO to them
in score order.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import numpy as np

from policies.base import Policy
from policies.estimators import Estimator
from policies.fifo import place_in_order, place_positions, running_allocation, running_allocation_of
from policies.loader import planned_rate
from policies.types import Allocation, JobView, Snapshot, miss_rates

_SIZE, _SUBMIT, _JOB_ID = attrgetter("size"), attrgetter("submit_time"), attrgetter("job_id")


def sjf_scores(jobs: Sequence[JobView], snapshot: Snapshot, estimator: Estimator) -> np.ndarray:
    work = np.array([j.remaining_bytes for j in jobs], dtype=float)
    ideal = np.array([j.ideal_throughput for j in jobs], dtype=float)
    gpus = np.array([j.gpus for j in jobs], dtype=float)
    return _scores(jobs, work, ideal, gpus, [j.dataset for j in jobs], snapshot, estimator, miss_rates(jobs))


def _scores(jobs: Sequence[JobView], work: np.ndarray, ideal: np.ndarray, gpus: np.ndarray, datasets: Sequence[str],
            snapshot: Snapshot, estimator: Estimator, miss_rate: np.ndarray | None = None) -> np.ndarray:
    """sjf_scores on the jobs' columns (`jobs`: the same jobs' views, read only for CPU stages;
    `miss_rate`: their loader miss rates, None when no job has a loader term). A job with a loader
    term runs its GPUs at X(h) = 1 / (1/f* + (1-h)/m) (policies/loader.py): its duration on its
    GPUs is W / X(0) with no cache and W / X(c/d) with its dataset cached as far as it fits."""
    cap = snapshot.capacity
    gpu_term = gpus / cap.gpus
    # CPU (a fourth resource when the cluster models it): running at f* takes f*/r cores for
    # W/f* seconds, so its term w_cpu R_cpu duration = W / (r K), the same for every c.
    if cap.manages_cpu:
        rate = np.array([j.cpu_rate for j in jobs], dtype=float)
        cpu_term = np.where(np.isinf(rate), 0.0, work / (rate * cap.cpus))
    else:
        cpu_term = np.zeros(len(work))
    if not estimator.manages_storage:
        return work / ideal * gpu_term + cpu_term
    size = np.fromiter(map(_SIZE, map(snapshot.datasets.__getitem__, datasets)), dtype=float, count=len(work))
    with np.errstate(divide="ignore", invalid="ignore"):
        # c = 0: all data from remote.
        io_only = np.where(cap.remote_io > 0, work / max(cap.remote_io, 1e-300), np.inf)
        no_cache = work / planned_rate(ideal, miss_rate, 0.0) * gpu_term + io_only
        # c = min(d, C): as much cached as fits.
        c = np.minimum(size, cap.cache)
        cache_term = np.where(cap.cache > 0, c / max(cap.cache, 1e-300), 0.0)
        miss = 1.0 - c / size
        io_term = np.where(miss > 0, np.where(cap.remote_io > 0, work * miss / max(cap.remote_io, 1e-300), np.inf), 0.0)
        full_cache = work / planned_rate(ideal, miss_rate, 1.0 - miss) * (gpu_term + cache_term) + io_term
    return np.minimum(no_cache, full_cache) + cpu_term


class SjfPolicy(Policy):
    name = "sjf"
    description = "multi-resource shortest job first (Eq. 7); preemptive each round"

    def allocate(self, snapshot: Snapshot, estimator: Estimator) -> Allocation:
        cols = snapshot.job_columns()
        if cols is not None and cols.submit is not None and not snapshot.capacity.manages_cpu:
            # The same ranking, placement and allocation on the columns, without a JobView.
            scores = _scores((), cols.remaining, cols.ideal, cols.gpus, cols.datasets, snapshot, estimator, cols.miss_rate)
            keys = list(zip(scores.tolist(), cols.submit.tolist(), cols.ids))
            ranked = sorted(range(len(keys)), key=keys.__getitem__)
            placed = place_positions(cols.gpus[ranked].tolist(), [False] * len(ranked), snapshot.capacity.gpus, keep_running=False)
            return running_allocation_of(list(map(ranked.__getitem__, placed)), snapshot, cols, estimator, io_rule="priority")
        jobs = list(snapshot.jobs)
        if cols is None:
            scores = sjf_scores(jobs, snapshot, estimator)
        else:
            scores = _scores(jobs, cols.remaining, cols.ideal, cols.gpus, cols.datasets, snapshot, estimator, cols.miss_rate)
        # By (score, arrival, id): the keys made once, of Python floats (indexing numpy scalars
        # per key was most of the sort).
        keys = list(zip(scores.tolist(), map(_SUBMIT, jobs), map(_JOB_ID, jobs)))
        ranked = [jobs[i] for i in sorted(range(len(jobs)), key=keys.__getitem__)]
        running = place_in_order(ranked, snapshot.capacity.gpus, keep_running=False)
        rank = {j.job_id: i for i, j in enumerate(ranked)}
        running.sort(key=lambda j: rank[j.job_id])
        return running_allocation(running, snapshot, estimator, io_rule="priority")
