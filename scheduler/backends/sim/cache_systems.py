"""Cache systems of the simulator: SiloD's uniform cache and the paper's three baselines.

State is kept per dataset chunk (a chunk is 1/resolution of a dataset; with resolution equal to
the item count it is exact item-level simulation). A job asks `lookup` which of the chunks it
is about to read are cached, then reports what it read with `record_reads`; the cache system
decides what to admit and what to evict. Allocations arrive through `apply_plan` once per
scheduling round.

- silod:   uniform caching per dataset with the policy's allocation; admit on miss while the
           dataset is under its allocation, never evict otherwise; random eviction on shrink.
- alluxio: one cluster-wide LRU cache, read-through (every miss is admitted, the least recently
           used chunks are evicted). Evictions are applied at the end of each simulation step.
- coordl:  each running job caches uniformly into a private static share, its GPUs' share of
           its nodes' local disks; nothing is shared across jobs and a job's cache is lost when
           it stops running.
- quiver:  whole datasets only, ranked by benefit/cost (data rate gained per byte) from noisy
           online profiles (each job re-profiled every 12 h); a dataset that does not fit gets
           nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from estimator.errors import UserError

CACHE_SYSTEMS = ("silod", "alluxio", "coordl", "quiver")


@dataclass(eq=False)
class SimDataset:
    name: str
    size: float
    n_chunks: int
    index: int  # position in the engine's dataset list

    @property
    def chunk_size(self) -> float:
        return self.size / self.n_chunks


@dataclass(eq=False)
class UniformDomain:
    """A uniform cache over one dataset's chunks with a byte limit (SiloD §2.2)."""

    dataset: SimDataset
    cached: np.ndarray = field(init=False)
    count: int = 0
    limit_chunks: int = 0

    def __post_init__(self) -> None:
        self.cached = np.zeros(self.dataset.n_chunks, dtype=bool)

    def set_limit(self, nbytes: float, rng: np.random.Generator) -> int:
        """Set the allocation; returns how many chunks had to be evicted."""
        # A partial chunk cannot be cached: round down (resolution controls this error).
        self.limit_chunks = int(min(self.dataset.n_chunks, np.floor(nbytes / self.dataset.chunk_size + 1e-9)))
        excess = self.count - self.limit_chunks
        if excess <= 0:
            return 0
        if excess > 0:
            victims = rng.choice(np.flatnonzero(self.cached), size=excess, replace=False)
            self.cached[victims] = False
            self.count -= excess
        return excess

    def admit(self, missed: np.ndarray) -> None:
        room = self.limit_chunks - self.count
        if room <= 0 or missed.size == 0:
            return
        fresh = missed[~self.cached[missed]]
        if fresh.size > room:
            fresh = fresh[:room]
        self.cached[fresh] = True
        self.count += int(fresh.size)

    def drop(self) -> None:
        self.cached[:] = False
        self.count = 0

    @property
    def cached_bytes(self) -> float:
        return self.count * self.dataset.chunk_size


class SimCacheSystem(ABC):
    name: str

    def __init__(self, capacity: float, total_gpus: int, seed: int):
        self.capacity = capacity
        self.total_gpus = total_gpus
        self.rng = np.random.default_rng(seed)
        self._versions: dict[str, int] = {}
        self.evicted_bytes = 0.0  # bytes evicted to make room or on shrink (cache churn)

    def bump(self, dataset_name: str) -> None:
        """The cached set of `dataset_name` changed other than by a reader admitting what it
        has just read; readers must look again."""
        self._versions[dataset_name] = self._versions.get(dataset_name, 0) + 1

    def version_of(self, job) -> int:
        return self._versions.get(job.dataset.name, 0)

    @abstractmethod
    def apply_plan(self, cache_alloc: Mapping[str, float] | None, running: Sequence, datasets: Mapping[str, SimDataset], now: float = 0.0) -> None:
        """Take the round's cache allocation (None for unmanaged baselines) and running jobs."""

    @abstractmethod
    def lookup(self, job, chunks: np.ndarray) -> np.ndarray:
        """Boolean hit mask for `chunks` of `job`'s dataset."""

    @abstractmethod
    def record_reads(self, job, chunks: np.ndarray, hits: np.ndarray, times: np.ndarray) -> None:
        """`job` has read `chunks` (in order, at `times`); `hits` is what lookup returned."""

    def wants_reads(self, job) -> bool:
        """Whether `record_reads` would do anything for `job` (lets steady jobs skip building it)."""
        return True

    def end_step(self) -> None:
        """Called once after every job has advanced through a step."""

    def job_stopped(self, job) -> None:
        """`job` finished or was descheduled."""

    @abstractmethod
    def cached_mask(self, job) -> np.ndarray:
        """Which chunks of `job`'s dataset are cached for it right now (read-only view)."""

    @abstractmethod
    def cached_bytes(self) -> dict[str, float]:
        """Bytes cached per dataset name (only non-zero entries)."""

    def allocated_bytes(self) -> float:
        return float(sum(self.cached_bytes().values()))


class SiloDCache(SimCacheSystem):
    name = "silod"

    def __init__(self, capacity: float, total_gpus: int, seed: int):
        super().__init__(capacity, total_gpus, seed)
        self.domains: dict[str, UniformDomain] = {}
        self.allocation: dict[str, float] = {}

    def _domain(self, dataset: SimDataset) -> UniformDomain:
        dom = self.domains.get(dataset.name)
        if dom is None:
            dom = self.domains[dataset.name] = UniformDomain(dataset)
        return dom

    def apply_plan(self, cache_alloc, running, datasets, now=0.0):
        if cache_alloc is None:
            raise ValueError("the silod cache system needs a storage-managing policy (SiloD estimator)")
        # Shrinks first so that grows never overshoot the cluster total.
        for name, dom in list(self.domains.items()):
            new = cache_alloc.get(name, 0.0)
            if new < dom.cached_bytes:
                self.evicted_bytes += dom.set_limit(new, self.rng) * dom.dataset.chunk_size
                self.bump(name)
            if dom.count == 0 and new <= 0:
                del self.domains[name]
        for name, nbytes in cache_alloc.items():
            if nbytes > 0 and name in datasets:
                self._domain(datasets[name]).set_limit(nbytes, self.rng)
        self.allocation = dict(cache_alloc)

    def lookup(self, job, chunks):
        dom = self.domains.get(job.dataset.name)
        if dom is None:
            return np.zeros(chunks.size, dtype=bool)
        return dom.cached[chunks]

    def wants_reads(self, job):
        dom = self.domains.get(job.dataset.name)
        return dom is not None and dom.count < dom.limit_chunks

    def record_reads(self, job, chunks, hits, times):
        dom = self.domains.get(job.dataset.name)
        if dom is not None and dom.count < dom.limit_chunks:
            before = dom.count
            dom.admit(chunks[~hits])
            if dom.count != before and job.dataset_readers > 1:
                self.bump(job.dataset.name)

    def cached_mask(self, job):
        dom = self.domains.get(job.dataset.name)
        return dom.cached if dom is not None else np.zeros(job.dataset.n_chunks, dtype=bool)

    def cached_bytes(self):
        return {n: d.cached_bytes for n, d in self.domains.items() if d.count}


class QuiverCache(SiloDCache):
    """Whole-dataset caching by noisy benefit/cost, on the uniform-cache mechanics."""

    name = "quiver"
    PROFILE_NOISE = 0.25  # sigma of the log-normal error of online latency profiles
    REPROFILE_S = 12 * 3600.0  # how long a job's profile is trusted before it is measured again

    def __init__(self, capacity: float, total_gpus: int, seed: int):
        super().__init__(capacity, total_gpus, seed)
        self.profiles: dict[str, tuple[float, float]] = {}  # job id -> (measured at, noise factor)

    def _profile(self, job, now: float) -> float:
        measured = self.profiles.get(job.job_id)
        if measured is None or now - measured[0] >= self.REPROFILE_S:
            measured = (now, float(np.exp(self.rng.normal(0.0, self.PROFILE_NOISE))))
            self.profiles[job.job_id] = measured
        return measured[1]

    def job_stopped(self, job):
        self.profiles.pop(job.job_id, None)

    def apply_plan(self, cache_alloc, running, datasets, now=0.0):
        benefit: dict[str, float] = {}
        for job in running:
            benefit[job.dataset.name] = benefit.get(job.dataset.name, 0.0) + job.ideal * self._profile(job, now)
        ranked = sorted(benefit, key=lambda n: benefit[n] / datasets[n].size, reverse=True)
        free = self.capacity
        chosen: dict[str, float] = {}
        for name in ranked:
            size = datasets[name].size
            if size <= free:
                chosen[name] = size
                free -= size
        super().apply_plan(chosen, running, datasets, now)


class CoorDLCache(SimCacheSystem):
    """Per-job private uniform caches of a static size (the job's GPUs' share of local disk)."""

    name = "coordl"

    def __init__(self, capacity: float, total_gpus: int, seed: int):
        super().__init__(capacity, total_gpus, seed)
        self.domains: dict[str, UniformDomain] = {}

    def apply_plan(self, cache_alloc, running, datasets, now=0.0):
        running_ids = {j.job_id for j in running}
        for job_id in list(self.domains):
            if job_id not in running_ids:
                del self.domains[job_id]
                self.bump(job_id)
        per_gpu = self.capacity / self.total_gpus
        for job in running:
            if job.job_id not in self.domains:
                dom = self.domains[job.job_id] = UniformDomain(job.dataset)
                dom.set_limit(per_gpu * job.gpus, self.rng)

    def lookup(self, job, chunks):
        dom = self.domains.get(job.job_id)
        return dom.cached[chunks] if dom is not None else np.zeros(chunks.size, dtype=bool)

    def wants_reads(self, job):
        dom = self.domains.get(job.job_id)
        return dom is not None and dom.count < dom.limit_chunks

    def record_reads(self, job, chunks, hits, times):
        dom = self.domains.get(job.job_id)
        if dom is not None:
            dom.admit(chunks[~hits])

    def job_stopped(self, job):
        self.domains.pop(job.job_id, None)
        self.bump(job.job_id)

    def version_of(self, job) -> int:
        return self._versions.get(job.job_id, 0)

    def cached_mask(self, job):
        dom = self.domains.get(job.job_id)
        return dom.cached if dom is not None else np.zeros(job.dataset.n_chunks, dtype=bool)

    def cached_bytes(self):
        out: dict[str, float] = {}
        for dom in self.domains.values():
            if dom.count:
                out[dom.dataset.name] = out.get(dom.dataset.name, 0.0) + dom.cached_bytes
        return out


class AlluxioLRUCache(SimCacheSystem):
    """One cluster-wide LRU cache over all datasets' chunks, read-through."""

    name = "alluxio"

    def __init__(self, capacity: float, total_gpus: int, seed: int):
        super().__init__(capacity, total_gpus, seed)
        self.cached: dict[str, np.ndarray] = {}
        self.last_use: dict[str, np.ndarray] = {}
        self.datasets: dict[str, SimDataset] = {}
        self.total_bytes = 0.0

    def _arrays(self, dataset: SimDataset) -> tuple[np.ndarray, np.ndarray]:
        if dataset.name not in self.cached:
            self.cached[dataset.name] = np.zeros(dataset.n_chunks, dtype=bool)
            self.last_use[dataset.name] = np.full(dataset.n_chunks, -np.inf)
            self.datasets[dataset.name] = dataset
        return self.cached[dataset.name], self.last_use[dataset.name]

    def apply_plan(self, cache_alloc, running, datasets, now=0.0):
        return None  # LRU takes no allocation: that is the point of the baseline

    def lookup(self, job, chunks):
        cached = self.cached.get(job.dataset.name)
        return cached[chunks] if cached is not None else np.zeros(chunks.size, dtype=bool)

    def record_reads(self, job, chunks, hits, times):
        if self.capacity < job.dataset.chunk_size:
            return
        cached, last = self._arrays(job.dataset)
        last[chunks] = times
        missed = chunks[~hits]
        fresh = missed[~cached[missed]]
        if fresh.size:
            cached[fresh] = True
            self.total_bytes += fresh.size * job.dataset.chunk_size
            if job.dataset_readers > 1:
                self.bump(job.dataset.name)

    def end_step(self):
        excess = self.total_bytes - self.capacity
        if excess <= 1e-6:
            return
        names = [n for n, c in self.cached.items() if c.any()]
        idx = [np.flatnonzero(self.cached[n]) for n in names]
        stamps = np.concatenate([self.last_use[n][i] for n, i in zip(names, idx, strict=True)])
        sizes = np.concatenate([np.full(i.size, self.datasets[n].chunk_size) for n, i in zip(names, idx, strict=True)])
        owner = np.concatenate([np.full(i.size, k) for k, i in enumerate(idx)])
        local = np.concatenate(idx)
        order = np.argsort(stamps, kind="stable")
        freed = np.cumsum(sizes[order])
        n_evict = int(np.searchsorted(freed, excess - 1e-6) + 1)
        victims = order[:n_evict]
        for k in np.unique(owner[victims]):
            sel = victims[owner[victims] == k]
            self.cached[names[k]][local[sel]] = False
            self.bump(names[k])
        self.total_bytes -= float(freed[n_evict - 1])

    def cached_mask(self, job):
        cached = self.cached.get(job.dataset.name)
        return cached if cached is not None else np.zeros(job.dataset.n_chunks, dtype=bool)

    def cached_bytes(self):
        return {n: float(c.sum()) * self.datasets[n].chunk_size for n, c in self.cached.items() if c.any()}


def make_cache_system(name: str, capacity: float, total_gpus: int, seed: int = 0) -> SimCacheSystem:
    classes = {c.name: c for c in (SiloDCache, AlluxioLRUCache, CoorDLCache, QuiverCache)}
    if name not in classes:
        raise UserError(f"unknown cache system {name!r}; choose one of: {', '.join(CACHE_SYSTEMS)}")
    return classes[name](capacity, total_gpus, seed)
