"""The active jobs' per-job columns as engine-owned numpy rows.

Every active job holds a row (`SimJob.slot`) from its arrival to its completion; the engine
writes a row when what it holds changes (arrival, new cores, a cache layout change) and a step
gathers the running jobs' rows by slot. Under Gavel's time sharing the running set changes at
nearly every round, and rebuilding these columns job by job was 3-4% of a Fig. 12 run.
"""

from __future__ import annotations

import math

import numpy as np

from scheduler.sim.cache_systems import SimCacheSystem
from scheduler.sim.reader import SimJob

#: Column order of a row (StepState's static fields, before `curriculum` and `scalar` are derived).
K, CHUNK, TOTAL, IDEAL, GPU_IDEAL, CPU_BOUND, CURRICULUM, VOLATILE = range(8)


class JobTable:
    def __init__(self) -> None:
        self.rows = np.zeros((64, 8), dtype=float)
        #: Bytes/s each job read at in the last step it ran (Eq. 8's perf, engine._fairness).
        self.last_rate = np.zeros(64, dtype=float)
        self._free: list[int] = []
        self._next = 0

    def add(self, job: SimJob, cache: SimCacheSystem) -> None:
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._next
            self._next += 1
            if slot >= len(self.rows):
                self.rows = np.concatenate([self.rows, np.zeros_like(self.rows)])
                self.last_rate = np.concatenate([self.last_rate, np.zeros_like(self.last_rate)])
        job.slot = slot
        self.last_rate[slot] = 0.0
        self.rows[slot] = (job.dataset.n_chunks, job.dataset.chunk_size, job.total_bytes, job.ideal, job.gpu_ideal,
                           _cpu_bound(job), job.pacing is not None, cache.volatile_for(job))

    def remove(self, job: SimJob) -> None:
        self._free.append(job.slot)
        job.slot = -1

    def set_cores(self, job: SimJob, cores: float) -> bool:
        """SimJob.set_cores, kept in the job's row; whether its row changed. The same cores give
        the same ideal rate (f* does not change), so most plans change no row."""
        if cores == job.cores:
            return False
        job.set_cores(cores)
        row = self.rows[job.slot]
        row[IDEAL] = job.ideal
        row[CPU_BOUND] = _cpu_bound(job)
        return True

    def refresh_volatile(self, jobs: list[SimJob], cache: SimCacheSystem) -> None:
        """Whether each job's cache is volatile (after the cache system's layout changed)."""
        if jobs:
            slots = np.fromiter((j.slot for j in jobs), dtype=np.int64, count=len(jobs))
            self.rows[slots, VOLATILE] = np.fromiter((cache.volatile_for(j) for j in jobs), dtype=bool, count=len(jobs))

    def columns(self, jobs: list[SimJob]) -> tuple:
        """(ids, slots, k, chunk, total, ideal, gpu_ideal, cpu bound, curriculum, scalar) of
        `jobs`, in their order: StepState's static fields (scalar: curriculum or a volatile cache)."""
        n = len(jobs)
        slots = np.fromiter((j.slot for j in jobs), dtype=np.int64, count=n)
        cols = self.rows[slots].T.copy()
        curriculum = cols[CURRICULUM] != 0.0
        return ([j.job_id for j in jobs], slots, cols[K], cols[CHUNK], cols[TOTAL], cols[IDEAL], cols[GPU_IDEAL], cols[CPU_BOUND],
                curriculum, curriculum | (cols[VOLATILE] != 0.0))


def _cpu_bound(job: SimJob) -> float:
    """What the job's cores preprocess per second (inf: no CPU stage modelled)."""
    return math.inf if job.trace.pipeline is None else job.cores * job.trace.pipeline.cpu_rate
