"""The active jobs' per-job columns as engine-owned numpy rows.

Every active job holds a row (`SimJob.slot`) from its arrival to its completion, in two arrays:
`rows`, what changes only with a plan, which the engine writes when it changes (arrival, new
cores, a cache layout change); and `state`, the job's reading position (reader.py's columns:
bytes consumed, position in the epoch, byte counters, drift, seconds per bound), which the job
itself reads and writes through its row (`SimJob.state`) and a step advances as columns for
all running jobs at once. A step gathers the running jobs' rows by slot. Under Gavel's time
sharing the running set changes at nearly every round, and rebuilding these columns job by job
was 3-4% of a Fig. 12 run.
"""

from __future__ import annotations

import math
from operator import attrgetter

import numpy as np

from scheduler.sim.cache_systems import SimCacheSystem
from scheduler.sim.column_kernel import sync_expected
from scheduler.sim.reader import N_COLUMNS, SimJob

_SLOT, _JOB_ID = attrgetter("slot"), attrgetter("job_id")

#: Column order of a row (StepState's static fields, before `curriculum` and `scalar` are derived).
K, CHUNK, TOTAL, IDEAL, GPU_IDEAL, CPU_BOUND, GPUS, IRREGULAR, FSTAR, CURRICULUM, VOLATILE = range(11)
# Not StepState fields: the dataset's position in the engine's list (SimDataset.index), the
# submit time, and the job id's place in the sorted ids of the trace (JobColumns.id_rank).
DATASET, SUBMIT, ID_RANK = VOLATILE + 1, VOLATILE + 2, VOLATILE + 3


class JobTable:
    def __init__(self) -> None:
        self.rows = np.zeros((64, ID_RANK + 1), dtype=float)
        #: Bytes/s each job read at in the last step it ran (Eq. 8's perf, engine._fairness).
        self.last_rate = np.zeros(64, dtype=float)
        #: The job's GPU share and Eq. 8's reference (SiloDPerf at the equal share) from the last
        #: decision (0 until its first).
        self.share = np.zeros(64, dtype=float)
        self.reference = np.zeros(64, dtype=float)
        self.state = np.zeros((64, N_COLUMNS), dtype=float)
        #: What the policy last saw of each job (its JobView's remaining bytes, running, hit ratio
        #: and f*; NaN: no view yet): a snapshot rebuilds only the views whose values changed.
        self.seen = np.full((64, 4), np.nan)
        self._owner: list[SimJob | None] = [None] * 64  # whose `state` points here (repointed when it grows)
        self._free: list[int] = []
        self._next = 0

    def add(self, job: SimJob, cache: SimCacheSystem, id_rank: int) -> None:
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._next
            self._next += 1
            if slot >= len(self.rows):
                for name in ("rows", "last_rate", "share", "reference", "state"):
                    setattr(self, name, _doubled(getattr(self, name), 0.0))
                self.seen = _doubled(self.seen, np.nan)
                self._owner.extend([None] * len(self._owner))
                for owner in self._owner:
                    if owner is not None:
                        owner.state = self.state
        job.slot = slot
        self.state[slot] = job.state[job.row]
        job.state, job.row = self.state, slot
        self._owner[slot] = job
        self.last_rate[slot] = self.share[slot] = self.reference[slot] = 0.0
        self.seen[slot] = np.nan
        self.rows[slot] = (job.dataset.n_chunks, job.dataset.chunk_size, job.total_bytes, job.ideal, job.gpu_ideal,
                           _cpu_bound(job), job.gpus, not job.regular, job.fstar is not None, job.pacing is not None,
                           cache.volatile_for(job), job.dataset.index, job.trace.submit_time, id_rank)

    def remove(self, job: SimJob) -> None:
        """The job leaves the table with its reading position (its own copy of its row)."""
        self._free.append(job.slot)
        self._owner[job.slot] = None
        job.state, job.row = self.state[job.slot:job.slot + 1].copy(), 0
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
            slots = np.fromiter(map(_SLOT, jobs), dtype=np.int64, count=len(jobs))
            self.rows[slots, VOLATILE] = np.fromiter((cache.volatile_for(j) for j in jobs), dtype=bool, count=len(jobs))

    def sync(self, slots: np.ndarray, unread: np.ndarray, volatile: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """SimJob.unread_expected of the jobs in rows `slots` at once (`unread`: their
        unread_cached; `volatile`: the argument; `k`: chunks per epoch): their expectations
        take in the cache's changes. Returns their (looked, expected cached unread chunks)."""
        looked, expected = np.empty((2, len(slots)))
        sync_expected(self.state, slots, unread, volatile, k, looked, expected)
        return looked, expected

    def columns(self, jobs: list[SimJob]) -> tuple:
        """(ids, slots, k, chunk, total, ideal, gpu_ideal, cpu bound, gpus, irregular, fstar,
        curriculum, scalar) of `jobs`, in their order: StepState's static fields (fstar: the job
        corrects a declared f*; scalar: curriculum or a volatile cache)."""
        n = len(jobs)
        slots = np.fromiter(map(_SLOT, jobs), dtype=np.int64, count=n)
        cols = self.rows[slots].T.copy()
        curriculum = cols[CURRICULUM] != 0.0
        return (list(map(_JOB_ID, jobs)), slots, cols[K], cols[CHUNK], cols[TOTAL], cols[IDEAL], cols[GPU_IDEAL], cols[CPU_BOUND],
                cols[GPUS].astype(np.int64), cols[IRREGULAR] != 0.0, cols[FSTAR] != 0.0, curriculum, curriculum | (cols[VOLATILE] != 0.0))


def _doubled(a: np.ndarray, fill: float) -> np.ndarray:
    """`a` with as many rows again, filled with `fill`."""
    return np.concatenate([a, np.full_like(a, fill)])


def _cpu_bound(job: SimJob) -> float:
    """What the job's cores preprocess per second (inf: no CPU stage modelled)."""
    return math.inf if job.trace.pipeline is None else job.cores * job.trace.pipeline.cpu_rate
