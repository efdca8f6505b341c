"""How one training job reads its dataset during a simulation step.

Each epoch reads every chunk once in a fresh random order. Loading and computation are
pipelined (SiloD §4), so reading from position p to x (in chunks of size s) takes

    rate = min(f*, b / m),  m = the miss ratio of the rest of the current epoch,

Eq. 4 with the miss ratio measured on what is actually cached rather than assumed to be c/d. That is what makes delayed effectiveness, sharing
and LRU thrashing visible: a chunk cached during this epoch was already read, so it only helps
in the next epoch or another job.

m comes from a prefix sum of misses along the epoch's order (`miss_prefix`). It stays
valid while nobody but the job itself changes its dataset's cache, because what the job admits
it has already read; the cache system bumps a per-dataset version whenever anything else
changes it, and the prefix is then recomputed. Between such changes a step costs O(log K).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from scheduler.backends.sim.cache_systems import SimCacheSystem, SimDataset
from traces.model import TraceJob


@dataclass(eq=False)
class SimJob:
    trace: TraceJob
    dataset: SimDataset
    ideal: float  # f*, bytes/s, after GPU-speed scaling
    total_bytes: float
    rng: np.random.Generator
    consumed: float = 0.0
    perm: np.ndarray = field(init=False)
    pos: float = 0.0  # chunks of the current epoch already read (fractional)
    epoch: int = 0
    start_time: float | None = None
    finish_time: float | None = None
    running: bool = False
    dataset_readers: int = 1  # active jobs on the same dataset
    remote_bytes: float = 0.0
    hit_bytes: float = 0.0
    last_rate: float = 0.0  # bytes/s in the last step it ran
    run_seconds: float = 0.0
    reference: float = 0.0  # SiloDPerf at the equal share (Eq. 8 denominator)
    share: float = 0.0
    consumed_at_sample: float = 0.0  # progress at the previous timeline sample (for Eq. 8)
    sampled_since: float | None = None  # time of that sample, None before the job's first one
    miss_prefix: np.ndarray | None = None  # misses along perm, cumulative, length K + 1
    miss_prefix_list: list[float] = field(default_factory=list)  # the same, for fast scalar reads
    prefix_version: int = -1

    def __post_init__(self) -> None:
        self.perm = self.rng.permutation(self.dataset.n_chunks)

    @property
    def job_id(self) -> str:
        return self.trace.job_id

    @property
    def gpus(self) -> int:
        return self.trace.num_gpus

    @property
    def remaining(self) -> float:
        return max(self.total_bytes - self.consumed, 0.0)

    def read_mask(self) -> np.ndarray:
        """Chunks already read in the current epoch (the per-job bitset of §6)."""
        mask = np.zeros(self.dataset.n_chunks, dtype=bool)
        mask[self.perm[: int(self.pos)]] = True
        return mask

    def prefix(self, cache: SimCacheSystem) -> list[float]:
        version = cache.version_of(self)
        if self.miss_prefix is None or self.prefix_version != version:
            misses = ~cache.lookup(self, self.perm)
            self.miss_prefix = np.concatenate(([0.0], np.cumsum(misses, dtype=float)))
            self.miss_prefix_list = self.miss_prefix.tolist()
            self.prefix_version = version
        return self.miss_prefix_list

    def hit_ratio_now(self, cache: SimCacheSystem) -> float:
        """Hit ratio on the rest of this epoch: cached chunks the job has not read yet (§6 bitset)."""
        prefix = self.prefix(cache)
        k = self.dataset.n_chunks
        left = k - self.pos
        if left < 1e-9:
            return 1.0 - prefix[-1] / k
        return 1.0 - (prefix[-1] - _missed_to(prefix, self.pos)) / left

    def new_epoch(self) -> None:
        self.epoch += 1
        self.pos = 0.0
        self.perm = self.rng.permutation(self.dataset.n_chunks)
        self.miss_prefix = None


def _missed_to(prefix: list[float], x: float) -> float:
    """Misses (in chunks) from the epoch start to position x, linear inside a chunk."""
    i = int(x)
    if i >= len(prefix) - 1:
        return prefix[-1]
    return prefix[i] + (x - i) * (prefix[i + 1] - prefix[i])


def miss_fraction_ahead(job: SimJob, cache: SimCacheSystem, horizon_s: float) -> float:
    """Miss ratio the job will read at next (its IO demand / f*): that of the rest of its epoch,
    as `advance` reads it; at the epoch end, the whole dataset's for the next epoch."""
    prefix = job.prefix(cache)
    k = job.dataset.n_chunks
    rest = k - job.pos
    if rest < 1e-9:
        return prefix[-1] / k
    return min(max(prefix[-1] - _missed_to(prefix, job.pos), 0.0) / rest, 1.0)


@dataclass
class StepResult:
    bytes_read: float = 0.0
    remote_bytes: float = 0.0
    finished_at: float | None = None


def advance(job: SimJob, now: float, dt: float, io_cap: float, cache: SimCacheSystem) -> StepResult:
    """Let `job` read for `dt` seconds from `now` with remote bandwidth `io_cap` (bytes/s)."""
    result = StepResult()
    s = job.dataset.chunk_size
    k = job.dataset.n_chunks
    f = job.ideal
    t = 0.0
    while dt - t > 1e-9 * dt and job.total_bytes > job.consumed:
        if job.pos >= k - 1e-9:
            job.new_epoch()
        prefix = job.prefix(cache)
        p = job.pos
        left = dt - t
        m_p = _missed_to(prefix, p)
        # Items are read in random order, so the misses left in this epoch are spread evenly
        # over the rest of it: the job reads at min(f*, b / miss ratio of the rest), Eq. 4 with
        # the measured ratio. (Taking chunks strictly in sequence would make a 1%-miss job stall
        # for hours on one whole missed chunk at a small IO allocation: a chunking artefact.)
        # Re-measured every step on the chunks actually left: a running count of expected misses
        # drifts from them and can leave a job "owing" misses its cache already covers, with no IO.
        rest = k - p
        miss_rest = min(max(prefix[-1] - m_p, 0.0) / rest, 1.0) if rest > 1e-12 else 0.0
        rate = f if miss_rest <= 0 else min(f, io_cap / miss_rest) if io_cap > 0 else 0.0
        x_need = p + (job.total_bytes - job.consumed) / s
        x = min(p + rate * left / s, x_need, float(k))
        missed = miss_rest * (x - p)
        elapsed = (x - p) * s / rate if rate > 0 else left
        elapsed = min(elapsed, left)
        done = (x - p) * s
        first, last = int(math.ceil(p - 1e-12)), int(x + 1e-12)  # chunks started before p are not re-recorded
        if last > first and cache.wants_reads(job):
            idx = job.perm[first:last]
            mp = job.miss_prefix
            hits = mp[first + 1 : last + 1] == mp[first:last]
            times = now + t + elapsed * (np.arange(first + 1, last + 1) - p) / max(x - p, 1e-12)
            cache.record_reads(job, idx, hits, times)
        job.consumed += done
        job.remote_bytes += missed * s
        job.hit_bytes += done - missed * s
        result.bytes_read += done
        result.remote_bytes += missed * s
        job.pos = x
        t += elapsed
        if x >= x_need - 1e-9 or job.total_bytes - job.consumed <= 1e-9 * job.total_bytes:
            job.consumed = job.total_bytes
            result.finished_at = now + t
            return result
        if done <= 0:
            break  # stalled on a miss with no remote bandwidth
    return result
