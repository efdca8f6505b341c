"""Typed inputs and outputs of a scheduling policy.

A policy sees an immutable Snapshot (jobs, datasets, capacities) and an Estimator and returns an
Allocation. The same types are produced by the simulator and by the live scheduler, which is
what lets one policy implementation serve both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from types import MappingProxyType

import numpy as np

from estimator.access import EPOCH, AccessPattern
from estimator.errors import UserError
from estimator.pipeline import InputPipeline


@dataclass(frozen=True, slots=True)
class JobView:
    """What a policy may know about one job."""

    job_id: str
    gpus: int  # requested GPUs; a job runs only with all of them (gang scheduling)
    dataset: str
    ideal_throughput: float  # f*, bytes/s at `gpus` GPUs, already scaled by GPU speed
    remaining_bytes: float  # data the job still has to consume (its remaining work)
    submit_time: float
    running: bool = False  # holds GPUs at snapshot time (non-preemptive policies keep it)
    priority: int = 0
    #: Hit ratio the job sees on the rest of its current epoch, from the data layer's bitset of
    #: items it has read (§6); None when unknown. Items the job cached itself this epoch are
    #: already read, so this is below c/d while a cache fills (delayed effectiveness).
    hit_ratio_now: float | None = None
    #: How the job reads (§6): `epoch` jobs are regular and planned with SiloDPerf; any other
    #: pattern is irregular and scheduled in the second partition (scheduler/core/partition.py).
    access: AccessPattern = EPOCH
    #: The job's CPU preprocessing stage (estimator/pipeline.py); None = not CPU-bound.
    pipeline: InputPipeline | None = None
    #: m, the bytes/s of misses the job's data loader absorbs (estimator.loader_miss_rate: W s / L
    #: for a job that declared its loader and whose misses' service time L is known); inf: the
    #: loader hides every miss, the paper's model. Policies plan such a job with the loader term
    #: (policies/loader.py).
    loader_miss_rate: float = math.inf

    @property
    def cpu_rate(self) -> float:
        """Source bytes/s per core; +inf when the job is not CPU-bound."""
        return float("inf") if self.pipeline is None else self.pipeline.cpu_rate

    @property
    def remaining_ideal_seconds(self) -> float:
        return self.remaining_bytes / self.ideal_throughput


_JOB_VIEW_SLOTS = ("job_id", "gpus", "dataset", "ideal_throughput", "remaining_bytes", "submit_time", "running", "priority",
                   "hit_ratio_now", "access", "pipeline", "loader_miss_rate")
if JobView.__slots__ != _JOB_VIEW_SLOTS:  # a field added or moved: job_view() would set the wrong slots
    raise RuntimeError(f"JobView's fields are {JobView.__slots__}; update job_view() and _JOB_VIEW_SLOTS with them")
_set_job_view = tuple(JobView.__dict__[f].__set__ for f in _JOB_VIEW_SLOTS)


def job_view(job_id: str, gpus: int, dataset: str, ideal_throughput: float, remaining_bytes: float, submit_time: float,
             running: bool, priority: int, hit_ratio_now: float | None, access: AccessPattern,
             pipeline: InputPipeline | None, loader_miss_rate: float = math.inf) -> JobView:
    """JobView(...) with every field given in order, its slots set directly: the same object
    without the keyword handling and the frozen dataclass's per-field `object.__setattr__`
    (1.65 -> 0.8 us). The simulator rebuilds about a million views in a Fig. 12 run."""
    v = object.__new__(JobView)
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11 = _set_job_view
    s0(v, job_id)
    s1(v, gpus)
    s2(v, dataset)
    s3(v, ideal_throughput)
    s4(v, remaining_bytes)
    s5(v, submit_time)
    s6(v, running)
    s7(v, priority)
    s8(v, hit_ratio_now)
    s9(v, access)
    s10(v, pipeline)
    s11(v, loader_miss_rate)
    return v


@dataclass(frozen=True, slots=True)
class DatasetView:
    name: str
    size: float  # bytes
    #: Bytes of the dataset in cache now, as the data layer reports it; None when unknown (then a
    #: policy assumes its allocation is already filled, as Eq. 4 does). An allocation that is not
    #: filled yet cannot save IO, and one sized as if filled would starve the reads that fill it
    #: (a fully allocated dataset would get no IO at all), so IO is planned on the filled part.
    cached: float | None = None

    def filled(self, allocated: float) -> float:
        """The part of an allocation that is already in cache."""
        return allocated if self.cached is None else min(allocated, self.cached)


CPU_ALLOCATIONS = ("model", "gpu-proportional")


@dataclass(frozen=True, slots=True)
class ClusterCapacity:
    gpus: int
    cache: float  # bytes, cluster total
    remote_io: float  # bytes/s, cluster total egress from remote storage
    gpus_per_node: int = 8
    #: Operator pin: fraction of cache and remote IO given to the irregular partition whenever
    #: both regular and irregular jobs are active; None = proportional to demand, every round
    #: (scheduler/core/partition.py).
    irregular_share: float | None = None
    #: CPU cores per node for the input pipelines (Plumber, Cachew); None = CPU is not modelled
    #: (every job gets the cores it needs and no allocation carries `cpu`).
    cpus_per_node: float | None = None
    #: How cores are divided when CPU is modelled: "model" (each policy allocates cores as a
    #: fourth resource, by the estimator) or "gpu-proportional" (cores follow GPUs, today's
    #: practice; the baseline).
    cpu_allocation: str = "model"

    def __post_init__(self) -> None:
        if self.cpus_per_node is not None and not (0 < self.cpus_per_node < 1e7):
            raise UserError(f"cpus_per_node = {self.cpus_per_node!r}; give the CPU cores of one node (> 0), or leave it unset when CPU is not constrained")
        if self.cpu_allocation not in CPU_ALLOCATIONS:
            raise UserError(f"cpu_allocation {self.cpu_allocation!r} is unknown; use one of {', '.join(CPU_ALLOCATIONS)}")
        if self.irregular_share is not None and not (0.0 <= self.irregular_share <= 1.0):
            raise UserError(f"irregular_share = {self.irregular_share!r} must be a fraction in [0, 1] (e.g. 0.2), or unset for the demand-proportional default")
        if self.gpus < 1:
            raise UserError(f"cluster gpus = {self.gpus}; a cluster needs at least 1 GPU")
        if self.gpus_per_node < 1:
            raise UserError(f"gpus_per_node = {self.gpus_per_node}; must be >= 1")
        if self.cache < 0 or self.remote_io < 0:
            raise UserError("cluster cache and remote IO must be >= 0")

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def manages_cpu(self) -> bool:
        return self.cpus_per_node is not None

    @property
    def cpus(self) -> float:
        """Cores in the cluster (+inf when CPU is not modelled)."""
        return float("inf") if self.cpus_per_node is None else self.nodes * float(self.cpus_per_node)

    def cpu_cap(self, gpus: int) -> float:
        """Most cores a gang of `gpus` GPUs can use: the cores of the nodes it spans.

        CPU is a cluster pool with this per-job cap: a job's cores are on its own nodes, and the
        pool assumes placement can balance jobs' cores across nodes (the model, not a packer)."""
        if self.cpus_per_node is None:
            return float("inf")
        return -(-gpus // self.gpus_per_node) * float(self.cpus_per_node)

    def gpu_proportional_cpu(self, gpus: int) -> float:
        """The baseline: cores in proportion to GPUs (cpus_per_node / gpus_per_node per GPU)."""
        if self.cpus_per_node is None:
            return float("inf")
        return gpus * float(self.cpus_per_node) / self.gpus_per_node


@dataclass(frozen=True, slots=True, eq=False)
class JobColumns:
    """A snapshot's jobs as numpy columns (same order), for policies that compute on arrays.

    A backend that keeps its job state in arrays (the simulator) hands them in with the
    snapshot so that a policy need not turn every JobView back into arrays at every decision.
    They describe exactly `jobs` (the tuple they were built with, checked by identity): a
    snapshot whose jobs were replaced (e.g. `priority_order`) has no valid columns.
    """

    jobs: tuple[JobView, ...]
    gpus: np.ndarray  # float
    ideal: np.ndarray  # f*, bytes/s
    remaining: np.ndarray  # bytes
    running: np.ndarray  # bool
    hit_now: np.ndarray | None  # NaN where unknown; None when unknown for every job
    all_regular: bool  # every job reads as `epoch` (no irregular partition)
    ids: tuple[str, ...] = ()  # job ids (what every array-computing stage asks first)
    datasets: tuple[str, ...] = ()  # each job's dataset name
    submit: np.ndarray | None = None  # submit times (float); None: read the views
    #: Each job's place in the order of job ids (ints; any numbers ordered as the ids are, e.g.
    #: ranks among more jobs than these), for ties broken by id; None: sort the ids.
    id_rank: np.ndarray | None = None
    #: Whether some job's pipeline declares an autocache point (JobView.pipeline.autocaches);
    #: None: read the views.
    autocaches: bool | None = None
    #: Each job's dataset's place in the order of dataset names (ints; ranks among more names
    #: do, e.g. all a backend knows), for grouping by dataset in name order; None: sort the names.
    dataset_rank: np.ndarray | None = None
    #: Each job's loader miss rate m (JobView.loader_miss_rate, inf where none); None: no job
    #: has a loader term (then every rule is the paper's, on the same arithmetic).
    miss_rate: np.ndarray | None = None

    @classmethod
    def of(cls, jobs: tuple[JobView, ...]) -> JobColumns:
        """Columns built from the views (the reference the simulator's own columns must equal)."""
        hits = [j.hit_ratio_now for j in jobs]
        ids = tuple(j.job_id for j in jobs)
        return cls(
            jobs,
            np.array([j.gpus for j in jobs], dtype=float),
            np.array([j.ideal_throughput for j in jobs], dtype=float),
            np.array([j.remaining_bytes for j in jobs], dtype=float),
            np.array([j.running for j in jobs], dtype=bool),
            None if all(h is None for h in hits) else np.array([np.nan if h is None else h for h in hits], dtype=float),
            all(j.access.regular for j in jobs),
            ids,
            tuple(j.dataset for j in jobs),
            np.array([j.submit_time for j in jobs], dtype=float),
            id_ranks(ids),
            any(j.pipeline is not None and j.pipeline.autocaches for j in jobs),
            name_ranks([j.dataset for j in jobs]),
            miss_rates(jobs),
        )


def miss_rates(jobs: Sequence[JobView]) -> np.ndarray | None:
    """The jobs' loader miss rates (inf where none), or None when no job has a loader term."""
    if all(j.loader_miss_rate == math.inf for j in jobs):
        return None
    return np.array([j.loader_miss_rate for j in jobs], dtype=float)


def name_ranks(names: Sequence[str]) -> np.ndarray:
    """Each name's place among the distinct names, sorted (equal names: the same rank)."""
    index = {n: i for i, n in enumerate(sorted(set(names)))}
    return np.fromiter(map(index.__getitem__, names), dtype=np.int64, count=len(names))


def values_for(mapping: Mapping[str, float], keys: tuple[str, ...], default: float = 0.0) -> np.ndarray:
    """`mapping`'s values for `keys`, in their order (`default` where missing), as floats: one pass
    over its values when its keys are exactly `keys` in order (an allocation built from the
    snapshot's columns), else one look-up per key (read-only mappings make those slow)."""
    if tuple(mapping) == keys:
        return np.fromiter(mapping.values(), dtype=float, count=len(keys))
    return np.fromiter(map(mapping.get, keys, repeat(default)), dtype=float, count=len(keys))


def id_ranks(ids: Sequence[str]) -> np.ndarray:
    """Each id's place in the sorted order of `ids` (equal ids: by position)."""
    rank = np.empty(len(ids), dtype=np.int64)
    rank[np.array(sorted(range(len(ids)), key=ids.__getitem__), dtype=np.int64)] = np.arange(len(ids))
    return rank


@dataclass(frozen=True, slots=True)
class Snapshot:
    time: float
    jobs: tuple[JobView, ...]  # active jobs (queued or running), in arrival order
    datasets: Mapping[str, DatasetView]
    capacity: ClusterCapacity
    #: Optional: the same jobs as columns (JobColumns); policies fall back to `jobs` without it.
    columns: JobColumns | None = field(default=None, compare=False)

    def job_columns(self) -> JobColumns | None:
        """The columns if they describe this snapshot's `jobs`, else None."""
        cols = self.columns
        return cols if cols is not None and cols.jobs is self.jobs and len(cols.ids) == len(self.jobs) else None

    def __post_init__(self) -> None:
        if not isinstance(self.datasets, MappingProxyType):
            object.__setattr__(self, "datasets", MappingProxyType(dict(self.datasets)))
        cols = self.job_columns()
        missing = (set(cols.datasets) if cols is not None else {j.dataset for j in self.jobs}) - self.datasets.keys()
        if missing:
            raise UserError(f"jobs read unknown dataset(s) {sorted(missing)}; register them first")


class LazyJobs:
    """A snapshot's job views, built by `build` when first read (then kept): a backend that
    keeps its jobs as columns (the simulator) hands a policy that reads only JobColumns no
    views at all. `build` must return the views as they were when the snapshot was taken."""

    __slots__ = ("_build", "_jobs")

    def __init__(self, build: Callable[[], tuple[JobView, ...]]) -> None:
        self._build: Callable[[], tuple[JobView, ...]] | None = build
        self._jobs: tuple[JobView, ...] | None = None

    def get(self) -> tuple[JobView, ...]:
        if self._jobs is None:
            self._jobs = tuple(self._build())
            self._build = None
        return self._jobs


def _lazy_jobs(slot) -> property:
    """A `jobs` field read from the instance's LazyJobs (`lazy`) the first time, then from the
    field's own slot (`slot`: its descriptor, which the property shadows). Set with a LazyJobs
    (or, as dataclasses.replace does, with the views themselves)."""

    def get(self) -> tuple[JobView, ...]:
        try:
            return slot.__get__(self)
        except AttributeError:
            jobs = self.lazy.get()
            slot.__set__(self, jobs)
            return jobs

    def set_(self, value) -> None:  # (the dataclass __init__ sets every field)
        if isinstance(value, LazyJobs):
            object.__setattr__(self, "lazy", value)
        else:
            object.__setattr__(self, "lazy", None)
            slot.__set__(self, value)

    return property(get, set_)


class LazyJobColumns(JobColumns):
    """JobColumns whose `jobs` come from a LazyJobs (the same tuple as its LazySnapshot's)."""

    __slots__ = ("lazy",)
    jobs = _lazy_jobs(JobColumns.__dict__["jobs"])


class LazySnapshot(Snapshot):
    """A Snapshot whose `jobs` (a tuple of JobView, as any snapshot's) are built on first read.

    Construct it with a LazyJobs for `jobs` and LazyJobColumns sharing it: `job_columns()` then
    matches them without building the views. Every other use sees a plain Snapshot; one made
    from it by `dataclasses.replace(..., jobs=...)` holds those jobs, and its columns (which
    describe the original jobs) are no longer valid for it, as for any snapshot."""

    __slots__ = ("lazy",)
    jobs = _lazy_jobs(Snapshot.__dict__["jobs"])

    def job_columns(self) -> JobColumns | None:
        cols = self.columns
        if self.lazy is not None and isinstance(cols, LazyJobColumns) and cols.lazy is self.lazy:
            return cols
        return Snapshot.job_columns(self)


def _frozen(mapping: Mapping[str, float] | None) -> Mapping[str, float] | None:
    return None if mapping is None else MappingProxyType(dict(mapping))


@dataclass(frozen=True, slots=True)
class StoragePartition:
    """How one round split cache and remote IO between regular and irregular jobs (§6).

    Set on the Allocation by the partition wrapper (scheduler/core/partition.py) when irregular jobs
    are active; policies never create or read it. GPUs are one pool: `*_gpus` are the GPU
    budgets (time-averaged GPUs) each partition's policy call was given.
    """

    irregular_share: float  # fraction of cache and remote IO in the irregular partition
    pinned: bool  # True: the operator's irregular_share; False: proportional to demand
    regular_cache: float  # bytes
    regular_io: float  # bytes/s
    irregular_cache: float
    irregular_io: float
    regular_gpus: float
    irregular_gpus: float
    #: Datasets read only by irregular jobs: cached LRU inside the irregular partition. A
    #: dataset read by both kinds stays uniform and is charged to the regular partition.
    lru_datasets: frozenset[str] = frozenset()
    regular_jobs: frozenset[str] = frozenset()
    irregular_jobs: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Allocation:
    """A policy's decision.

    gpu_share: fraction of time (0..1) that each job runs on its full set of GPUs. Policies that
        do not time-share return 0 or 1; Gavel returns fractions that the round planner turns
        into rounds.
    cache: bytes per dataset, or None when the policy leaves storage to the cache system
        (the storage-unaware "vanilla" form used with Alluxio, CoorDL and Quiver).
    remote_io: bytes/s per job *while it runs*, or None when storage is unmanaged.
    cpu: CPU cores per job *while it runs*, or None when the cluster does not model CPU
        (ClusterCapacity.cpus_per_node unset; then every job has the cores it needs).
    autocache: datasets whose cache holds their readers' preprocessed data (Cachew's autocache
        point) -> bytes cached per source byte; every other dataset caches source bytes. Set by
        the scheduling core after the policy (policies/autocache.py), never by a policy.
    """

    gpu_share: Mapping[str, float]
    cache: Mapping[str, float] | None = None
    remote_io: Mapping[str, float] | None = None
    cpu: Mapping[str, float] | None = None
    objective: float | None = field(default=None, compare=False)  # e.g. Gavel's min fairness ratio
    partition: StoragePartition | None = field(default=None, compare=False)  # set by scheduler/core/partition.py
    autocache: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpu_share", MappingProxyType(dict(self.gpu_share)))
        object.__setattr__(self, "autocache", MappingProxyType(dict(self.autocache)))
        object.__setattr__(self, "cache", _frozen(self.cache))
        object.__setattr__(self, "remote_io", _frozen(self.remote_io))
        object.__setattr__(self, "cpu", _frozen(self.cpu))

    @property
    def manages_storage(self) -> bool:
        return self.cache is not None
