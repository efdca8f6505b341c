"""Bottleneck diagnosis of the simulator's running jobs (Plumber's question, per step).

For every running job: which resource bounds it this step (gpu, cpu, cache, remote_io;
estimator.pipeline.diagnose) given its f*, its cores, its remote-IO cap and the miss ratio of what
it reads next. The engine adds each step's length to the job's time bound by that resource
(jobs.csv: bound_*_s and `bottleneck`, the resource that bound it longest) and counts the running
jobs per resource at each timeline sample (timeline.csv: bound_*).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from estimator.measured import FStarEstimate, observe
from estimator.pipeline import RESOURCES, diagnose
from scheduler.sim.reader import SimJob


def bounds_now(running: Sequence[SimJob], caps: Mapping[str, float], misses: Mapping[str, float]) -> list[str]:
    """The resource bounding each running job this step (same order as `running`)."""
    if not running:
        return []
    f = np.array([j.gpu_ideal for j in running], dtype=float)
    d = np.array([j.dataset.size for j in running], dtype=float)
    miss = np.clip(np.array([misses[j.job_id] for j in running], dtype=float), 0.0, 1.0)
    cores = np.array([j.cores for j in running], dtype=float)
    rate = np.array([math.inf if j.trace.pipeline is None else j.trace.pipeline.cpu_rate for j in running], dtype=float)
    io = np.array([caps.get(j.job_id, 0.0) for j in running], dtype=float)
    gpus = np.array([j.gpus for j in running], dtype=float)
    return [str(b) for b in diagnose(f, gpus, io, (1.0 - miss) * d, d, cores, rate).bound]


def observe_fstar(job: SimJob, observed: float, seconds: float, io_cap: float, miss: float) -> FStarEstimate:
    """The job's f* estimate after a step (estimator/measured.py): its IO bound is its cap over
    its miss ratio, its CPU bound its cores times its cpu_rate."""
    io_bound = math.inf if miss <= 1e-12 else io_cap / miss
    pipeline = job.trace.pipeline
    cpu_bound = math.inf if pipeline is None or math.isinf(job.cores) else job.cores * pipeline.cpu_rate
    return observe(job.fstar, observed, seconds, io_bound, cpu_bound)


def record_bounds(running: Sequence[SimJob], bounds: Sequence[str], dt: float) -> None:
    for job, bound in zip(running, bounds, strict=True):
        job.bound_s[bound] = job.bound_s.get(bound, 0.0) + dt


def counts(bounds: Sequence[str]) -> dict[str, int]:
    return {r: sum(1 for b in bounds if b == r) for r in RESOURCES}


def main_bottleneck(bound_s: Mapping[str, float]) -> str:
    """The resource that bound the job longest ('' if it never ran)."""
    return max(RESOURCES, key=lambda r: bound_s.get(r, 0.0)) if any(v > 0 for v in bound_s.values()) else ""


__all__ = ["bounds_now", "counts", "main_bottleneck", "record_bounds"]
