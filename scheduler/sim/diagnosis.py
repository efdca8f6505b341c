"""Bottleneck diagnosis of the simulator's running jobs (Plumber's question, per step).

For every running job: which resource bounds it this step (gpu, cpu, cache, remote_io;
estimator.pipeline.diagnose) given its f*, its cores, its remote-IO cap and the miss ratio of what
it reads next. The engine adds each step's length to the job's time bound by that resource
(jobs.csv: bound_*_s and `bottleneck`, the resource that bound it longest) and counts the running
jobs per resource at each timeline sample (timeline.csv: bound_*).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numba
import numpy as np

from estimator.measured import FStarEstimate, observe
from estimator.pipeline import RESOURCES
from policies.compiled import kernel, np_max, np_min
from scheduler.sim.reader import SimJob


def cpu_bound_at(job: SimJob, miss: float) -> float:
    """What the job's cores preprocess per second at miss ratio `miss` (autocaching: hits cost
    post_cpu_rate per core; SimJob.ideal_at)."""
    p = job.trace.pipeline
    if p is None:
        return math.inf
    if job.dataset.expansion != 1.0 and p.autocaches:
        m = min(max(miss, 0.0), 1.0)
        return job.cores / ((1.0 - m) / p.post_cpu_rate + m / p.cpu_rate)
    return job.cores * p.cpu_rate


def bound_labels(f: np.ndarray, cpu: np.ndarray, b: np.ndarray, miss: np.ndarray) -> list[str]:
    """gpu | cpu | cache | remote_io from f*, the CPU bound, the IO cap and the miss ratio (source
    caching; see estimator.pipeline.diagnose for the rule)."""
    return [RESOURCES[i] for i in bound_indices(f, cpu, b, miss).tolist()]


@kernel(numba.int64[:](numba.float64[:], numba.float64[:], numba.float64[:], numba.float64[:]))
def bound_indices(f: np.ndarray, cpu: np.ndarray, b: np.ndarray, miss: np.ndarray) -> np.ndarray:
    """bound_labels as positions in RESOURCES (int column). Compiled: the engine asks it of every
    running job at every step."""
    tol = 1e-9
    out = np.empty(len(f), dtype=np.int64)
    for i in range(len(f)):
        m = miss[i]
        divisor = 1.0 if m <= 0.0 else m
        io = np.inf if m <= 0.0 else b[i] / divisor
        top = np_min(f[i], cpu[i])
        now = np_min(top, io)
        # +10% link (a job with no cap: 10% of f*); +10% cache: the hit ratio h grows to 1.1 h.
        io_more = np_min(top, (1.1 * b[i] if b[i] > 0 else 0.1 * f[i]) / divisor)
        new_miss = np_max(1.0 - 1.1 * (1.0 - m), 0.0)
        cache_more = np_min(top, np.inf if new_miss <= 0.0 else b[i] / new_miss)
        if now >= f[i] * (1 - tol):
            out[i] = 0  # gpu
        elif now >= cpu[i] * (1 - tol):
            out[i] = 1  # cpu
        elif cache_more > io_more * (1 + tol):
            out[i] = 2  # cache
        else:
            out[i] = 3  # remote_io
    return out


def observe_fstar(job: SimJob, observed: float, seconds: float, io_cap: float, miss: float) -> FStarEstimate:
    """The job's f* estimate after a step (estimator/measured.py): its IO bound is its cap over
    its miss ratio, its CPU bound its cores times its cpu_rate."""
    io_bound = math.inf if miss <= 1e-12 else io_cap / miss
    pipeline = job.trace.pipeline
    cpu_bound = math.inf if pipeline is None or math.isinf(job.cores) else cpu_bound_at(job, miss)
    return observe(job.fstar, observed, seconds, io_bound, cpu_bound)


def counts(bounds: np.ndarray) -> dict[str, int]:
    """Jobs per resource, from bound_indices."""
    return dict(zip(RESOURCES, np.bincount(bounds, minlength=len(RESOURCES)).tolist()))


def main_bottleneck(bound_s: Mapping[str, float]) -> str:
    """The resource that bound the job longest ('' if it never ran)."""
    return max(RESOURCES, key=lambda r: bound_s.get(r, 0.0)) if any(v > 0 for v in bound_s.values()) else ""


__all__ = ["bound_indices", "bound_labels", "counts", "cpu_bound_at", "main_bottleneck"]
