"""The trace-driven simulator: a backend of the scheduling core.

Event-driven over arrivals, completions and scheduling rounds; between two events every running
job reads its dataset chunk by chunk (reader.py) through the chosen cache system
(cache_systems.py). Decisions come from the same `SchedulingCore` the live service uses: the
policy is asked for an Allocation when the set of jobs changes, and the round planner chooses
who holds GPUs every round (Gavel-style time sharing).

Irregular jobs (estimator/access.py) are scheduled in the irregular partition of cache and remote
IO (scheduler/core/partition.py) and their datasets are LRU-cached there (cache system `silod`).
Curriculum jobs read as reader.py describes; jobs that only say `irregular` read like epoch jobs
(their real pattern is unknown), scheduled as irregular.
"""

from __future__ import annotations

import heapq
import math
from itertools import repeat
from operator import attrgetter, is_
import time as wallclock
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from types import MappingProxyType

import numpy as np

from estimator.access import AccessPattern
from estimator.errors import UserError
from estimator.measured import FStarEstimate
from policies.base import Policy
from policies.estimators import Estimator
from policies.gavel import GavelProblem, equal_share_throughput
from policies.types import ClusterCapacity, DatasetView, JobView, LazyJobColumns, LazyJobs, LazySnapshot, Snapshot, job_view, values_for
from scheduler.sim.cache_systems import SimCacheSystem, make_cache_system
from scheduler.sim.column_kernel import column_apply, column_step, drift_bound, miss_ratios, seconds_to_event, step_results
from scheduler.sim.link_kernel import below_level, claimed_caps, max_min
from scheduler.sim.diagnosis import bound_indices, counts, cpu_bound_at, observe_fstar
from scheduler.sim.job_table import CURRICULUM, DATASET, FSTAR, GPU_IDEAL, GPUS, ID_RANK, IRREGULAR, K, SUBMIT, TOTAL, VOLATILE, JobTable
from scheduler.sim.reader_rows import MOVED, UNREAD
from scheduler.sim.types import SimDataset, TurnAdvance
from scheduler.sim.reader import CONSUMED, DEMAND_CHANGE, LOOKED, POS, REMOTE, VOLATILE_SUBSTEP, SimJob, StepResult, advance
from scheduler.core.planner import SchedulingCore
from traces.catalog import DATASETS
from traces.model import Trace, TraceJob


#: Datasets read by curriculum jobs get at least this many chunks in their smallest eligible
#: set (`--resolution` still sets the minimum), and at most MAX_CURRICULUM_CHUNKS chunks.
CURRICULUM_MIN_CHUNKS = 64
_EPOCH = AccessPattern.epoch()
# Per-job reads of every running or active job (map(attrgetter) is about twice a generator's speed).
_RUNNING, _VIEW, _JOB_ID, _CROW, _INDEX, _PIPELINE = (
    attrgetter(a) for a in ("running", "view", "job_id", "crow", "index", "trace.pipeline"))
MAX_CURRICULUM_CHUNKS = 4096
#: Most chunks per dataset `--resolution` may ask for: each active job holds ~9 bytes per
#: chunk of its dataset (twice that under Alluxio's finer LRU), ~1.2 MB a job here.
MAX_RESOLUTION = 65_536

#: A curriculum job's step may let the link bring in at most 1/VOLATILE_STEPS of its eligible
#: set while its cache fills (its own admissions move its miss ratio).
VOLATILE_STEPS = 16
#: The step bound takes a job's unread chunks as at least this share of its epoch (_step_limit).
DRIFT_FLOOR = 1 / 16
#: Weight of a job's earlier steps in its measured drift, per step (1/2: the last step counts as
#: much as all before it): a count over a few chunks is noisy.
DRIFT_MEMORY = 0.5
_NO_COLUMN = np.zeros(0)  # a kernel's column argument it does not read
#: step_budget's factor: steps per event (arrival, completion, epoch boundary, round)
STEP_BUDGET_FACTOR = 4.0


@dataclass(frozen=True, slots=True)
class SimConfig:
    round_s: float = 360.0
    resolution: int = 128  # chunks per dataset (x the cache system's resolution_factor); higher is closer to item level and slower
    gpu_speed: float = 1.0  # multiplies every job's f*
    seed: int = 0
    timeline_interval_s: float = 3600.0
    #: Without time sharing nothing changes between events except which jobs need the link's
    #: spare capacity; that redistribution is refreshed at least this often.
    io_refresh_s: float = 1800.0
    max_sim_time_s: float = 10 * 365 * 86400.0
    #: False: the policy's cache allocations are enforced but its remote-IO allocations are not
    #: (the link is shared by demand), the "remote IO not allocated" run of Fig. 13.
    manage_io: bool = True
    #: False: the scheduler is not told which jobs are irregular (every job is planned as a
    #: regular one with SiloDPerf and uniform caching); jobs still read as they do.
    partition: bool = True
    #: The most a job's miss ratio may move within a step while the link is contended (the
    #: link is re-divided between steps); halving it halves the step bound (see _step_limit).
    demand_tolerance: float = 0.025
    #: Quiver's online-profile error: sigma of a log-normal factor on each dataset's benefit,
    #: redrawn at every re-profiling (12 h). 0: exact profiles (docs/simulator-accuracy.md).
    profile_noise: float = 0.0
    #: Staggered starts for jobs sharing a dataset (policies/stagger.py), off by default.
    stagger: bool = False
    #: Decision coalescing: at most one policy decision per this many seconds while jobs run
    #: (arrivals, completions and demand changes in between wait for it or for the round's
    #: end). 0: decide at every such event (the default; docs/simulator-speed.md gives its effect).
    decision_interval_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.round_s > 0:
            raise UserError(f"round length {self.round_s} s must be > 0")
        if self.resolution < 1:
            raise UserError(f"resolution {self.resolution} must be >= 1 chunk per dataset")
        if self.resolution > MAX_RESOLUTION:
            raise UserError(f"resolution {self.resolution:,} is more than {MAX_RESOLUTION:,} chunks per dataset; every active job"
                            f" keeps an order and a read mask per chunk (about 9 bytes each), so lower --resolution")
        if not self.gpu_speed > 0:
            raise UserError(f"GPU speed {self.gpu_speed} must be > 0")
        if not self.decision_interval_s >= 0:
            raise UserError(f"decision interval {self.decision_interval_s} s must be >= 0 (0: no coalescing)")
        if not 0 < self.demand_tolerance <= 1:
            raise UserError(f"demand tolerance {self.demand_tolerance} must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class JobRecord:
    job_id: str
    submit_s: float
    start_s: float
    finish_s: float
    gpus: int
    dataset: str
    remote_bytes: float
    hit_bytes: float
    epoch_hit_ratios: tuple[float, ...] = ()  # hit ratio of each complete epoch
    #: seconds running bound by each resource (gpu, cpu, cache, remote_io; scheduler/sim/diagnosis.py)
    bound_s: tuple[tuple[str, float], ...] = ()
    declared_ideal: float = math.nan  # f* the scheduler started from (bytes/s, GPU speed applied)
    measured_ideal: float = math.nan  # its self-corrected f* at the end (nan: declared exactly)

    @property
    def jct_s(self) -> float:
        return self.finish_s - self.submit_s


@dataclass(frozen=True, slots=True)
class TimelineRow:
    time_s: float
    running_jobs: int
    queued_jobs: int
    gpus_used: int
    remote_io_used: float  # bytes/s, average since the previous row
    remote_io_limit: float  # bytes/s, the cluster's link
    cache_allocated: float  # bytes the policy allocated (or the cache system holds, unmanaged)
    cache_cached: float  # bytes actually cached
    cache_effective: float  # cached bytes that some running reader has not read yet this epoch
    fairness_ratio: float  # Eq. 8, time average over the interval of min_j share_j x rate_j / ref_j
    throughput: float  # bytes/s consumed by all jobs, average since the previous row
    # The two partitions (§6): bytes cached in the irregular partition's datasets (the LRU
    # datasets silod plans for irregular jobs; 0 for the other systems) and in the rest, and
    # remote bytes/s read by irregular (curriculum/irregular access) and by regular jobs.
    cache_cached_regular: float = 0.0
    cache_cached_irregular: float = 0.0
    remote_io_regular: float = 0.0
    remote_io_irregular: float = 0.0
    # Running jobs bound by each resource in the step that ends at this row (diagnosis.py).
    bound_gpu: int = 0
    bound_cpu: int = 0
    bound_cache: int = 0
    bound_remote_io: int = 0


@dataclass
class SimResult:
    jobs: list[JobRecord]
    timeline: list[TimelineRow]
    makespan_s: float
    gpu_seconds_used: float
    remote_bytes: float
    fairness_time_avg: float
    capacity: ClusterCapacity
    sim_wall_s: float
    steps: int
    sim_cpu_s: float = 0.0  # CPU seconds of this process in run() (wall time is noisy on a shared machine)
    unfinished: list[str] = field(default_factory=list)


def python_clock(jobs: list[SimJob], cache: SimCacheSystem, t0: np.ndarray, left: np.ndarray, now: float, dt: float,
                 caps, tol: float, read: np.ndarray, remote: np.ndarray, finished_at: np.ndarray) -> None:
    """Interleave jobs `left` (each at its own time `t0` into the step) by sub-steps on one heap
    clock, one reader.advance a sub-step, adding to `read`, `remote` and `finished_at` in place:
    the clock of every cache system but Alluxio's, whose compiled clock
    (lru_kernel.lru_clock) makes the same runs (tests/test_sim_compiled.py)."""
    clock = list(zip(t0.tolist(), left.tolist()))
    heapq.heapify(clock)
    while clock:
        t, i = heapq.heappop(clock)
        part = advance(jobs[i], now + t, dt - t, caps[i], cache, substeps=1)
        read[i] += part.bytes_read
        remote[i] += part.remote_bytes
        t += max(part.elapsed, 0.0)
        if part.finished_at is not None:
            finished_at[i] = part.finished_at
        elif dt - t > tol and part.elapsed > 0:
            heapq.heappush(clock, (t, i))


def step_budget(trace: Trace, makespan_s: float, round_s: float, demand_tolerance: float = 0.025) -> float:
    """The most steps a run should take: STEP_BUDGET_FACTOR x (arrivals + completions + every
    job's epoch boundaries + rounds over the makespan) + (its epochs) / demand_tolerance.

    Every step ends at one of those events or at a bound of `_step_limit` that keeps a
    contended link's division, or a cache that moves under its readers, within tolerance: a
    job's miss ratio moves by at most `demand_tolerance` a step, which bounds those steps to
    about 1 / tolerance per epoch read while the link is contended. `benchmarks/bench_sim.py
    --sweep` prints each cell's steps over it; tests/test_sim_steps.py checks it."""
    epochs = sum(math.ceil(j.epochs) for j in trace.jobs)
    events = 2 * len(trace.jobs) + epochs + makespan_s / round_s
    return STEP_BUDGET_FACTOR * events + epochs / demand_tolerance


@dataclass(slots=True)
class StepState:
    """The running jobs as columns for one step (same order as the engine's `running`): what
    does not change between plans (`static`), and the reading position (gathered per step)."""

    ids: list[str]
    slots: np.ndarray  # rows in the job table (job_table.py)
    k: np.ndarray  # chunks per epoch
    chunk: np.ndarray  # bytes per chunk
    total: np.ndarray  # bytes to read in all
    ideal: np.ndarray  # bytes/s without IO limits (f* and cores)
    gpu_ideal: np.ndarray  # f* (bytes/s)
    cpu_bound: np.ndarray  # cores x cpu_rate (inf: not CPU-bound)
    gpus: np.ndarray  # int
    irregular: np.ndarray  # bool: not read as `epoch` (SimJob.regular)
    fstar: np.ndarray  # bool: corrects a declared f* (SimJob.fstar)
    curriculum: np.ndarray  # bool
    scalar: np.ndarray  # bool: advanced by the per-job `advance` (curriculum, volatile cache)
    looked: np.ndarray
    unread: np.ndarray  # cached chunks expected among the unread ones (SimJob.unread_expected)
    unread_real: np.ndarray  # cached unread chunks (SimJob.unread_cached)
    consumed: np.ndarray
    pos: np.ndarray
    crows: np.ndarray  # rows in the cache system's reader rows (reader_rows.py)

    def static(self) -> tuple:
        """The fields up to `scalar` (what JobTable.columns gives)."""
        return tuple(getattr(self, f) for f in self.__slots__[:self.__slots__.index("scalar") + 1])

    def take(self, idx: np.ndarray) -> StepState:
        """The columns of the jobs at positions `idx`, in that order."""
        return StepState(list(map(self.ids.__getitem__, idx.tolist())), *[a[idx] for a in _COLUMN_FIELDS(self)])


_COLUMN_FIELDS = attrgetter(*StepState.__slots__[1:])  # every field but `ids`


class _ActiveJobs(list):
    """The active jobs in arrival order, with their ids, dataset names and job-table rows kept
    beside them as they arrive and leave, which `_members_of` copies instead of a pass per job
    at every arrival or completion. Only `append` and `remove` change it (the engine's only
    two changes to its active list)."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.names: list[str] = []
        self.slots: list[int] = []

    def append(self, job: SimJob) -> None:
        super().append(job)
        self.ids.append(job.job_id)
        self.names.append(job.dataset.name)
        self.slots.append(job.slot)

    def remove(self, job: SimJob) -> None:
        i = self.index(job)
        del self[i], self.ids[i], self.names[i], self.slots[i]


@dataclass(frozen=True, slots=True)
class _Members:
    """The active jobs, in order, and what of them stays the same while they do."""

    jobs: tuple[SimJob, ...]
    slots: np.ndarray  # their job-table rows
    ids: tuple[str, ...]
    datasets: tuple[str, ...]  # each one's dataset name
    needed: list[str]  # the distinct dataset names
    autocaches: bool  # some job's pipeline declares an autocache point (JobColumns.autocaches)


@dataclass(frozen=True, slots=True)
class Claimers:
    """Jobs capped at what they could claim on a contended link (Simulator._claimable)."""

    mask: np.ndarray  # bool per running job: a claimer
    at_level: np.ndarray  # bool per running job: at the max-min water level
    demands: np.ndarray  # bytes/s per running job at the step's start (f* x m)


@dataclass(slots=True)
class Outcome:
    """What a step did for each running job (same order), as columns."""

    read: np.ndarray  # bytes read
    remote: np.ndarray  # bytes fetched from remote storage (the link's traffic)
    finished_at: np.ndarray  # when the job finished (nan: it did not)
    elapsed: np.ndarray  # seconds of the step used (less than dt only for a first sub-step)

    @staticmethod
    def empty(n: int, dt: float) -> Outcome:
        finished_at, elapsed = np.empty(n), np.empty(n)  # (np.full is a Python function: slower)
        finished_at.fill(np.nan)
        elapsed.fill(dt)
        return Outcome(np.zeros(n), np.zeros(n), finished_at, elapsed)

    def put(self, i: int, res: StepResult) -> None:
        self.read[i], self.remote[i], self.elapsed[i] = res.bytes_read, res.remote_bytes, res.elapsed
        self.finished_at[i] = np.nan if res.finished_at is None else res.finished_at


class Simulator:
    def __init__(
        self,
        trace: Trace,
        capacity: ClusterCapacity,
        policy: Policy,
        estimator: Estimator,
        cache_system: str | SimCacheSystem,
        config: SimConfig = SimConfig(),
        progress: Callable[[float], None] | None = None,
    ):
        too_big = [j for j in trace.jobs if j.num_gpus > capacity.gpus]
        if too_big:
            j = too_big[0]
            raise UserError(
                f"job {j.job_id} needs {j.num_gpus} GPUs but the cluster has {capacity.gpus}; "
                f"raise --gpus or drop the job ({len(too_big)} such job(s))"
            )
        if not trace.jobs:
            raise UserError("the trace has no jobs")
        _check_durations(trace, config, capacity)
        self.item_sizes = {j.dataset: _item_size(trace, j) for j in trace.jobs if j.access.curriculum is not None}
        self.trace = trace
        self.capacity = capacity
        self.config = config
        self.core = SchedulingCore(policy, estimator, stagger=config.stagger, round_s=config.round_s)
        self.cache = (
            make_cache_system(cache_system, capacity.cache, capacity.gpus, config.seed, config.profile_noise)
            if isinstance(cache_system, str)
            else cache_system
        )
        if self.cache.name == "silod" and not estimator.manages_storage:
            raise UserError("cache system 'silod' needs the SiloD estimator (its allocations drive the cache)")
        self.progress = progress
        self._autocaching = any(j.pipeline is not None and j.pipeline.autocaches for j in trace.jobs)  # (_Members.autocaches)
        # Jobs with a loader miss term (TraceJob.loader_miss_rate): their rate follows their miss
        # ratio, as autocaching readers' does, so they take the same per-job path.
        self._loaders = any(j.loader_miss_rate is not None for j in trace.jobs)
        self._snapshots = 0  # snapshots taken (the last one's views may reuse the kept ones: _views)
        self.datasets: dict[str, SimDataset] = {}
        starts: dict[str, float] = {}  # smallest starting_percent of each dataset's curriculum readers
        for j in trace.jobs:
            if j.access.curriculum is not None:
                starts[j.dataset] = min(starts.get(j.dataset, 1.0), j.access.curriculum.starting_percent)
        for name, size in trace.dataset_sizes.items():
            chunks = max(1, int(config.resolution) * self.cache.resolution_factor, self._curriculum_chunks(trace, name, starts.get(name)))
            self.datasets[name] = SimDataset(name, float(size), chunks, len(self.datasets))
        self.dataset_views = {n: DatasetView(n, d.size) for n, d in self.datasets.items()}
        # Each dataset's place among the sorted names, by SimDataset.index (JobColumns.dataset_rank).
        self._name_rank = np.empty(len(self.datasets), dtype=np.int64)
        self._name_rank[[self.datasets[n].index for n in sorted(self.datasets)]] = np.arange(len(self.datasets))
        self._dataset_views: dict[str, DatasetView] = {}  # with cached bytes, kept while they stay the same (_snapshot)
        self._kept_cached: dict[str, float] = {}  # the cached bytes each kept view holds
        self._expanded: set[str] = set()  # datasets cached preprocessed now (_apply_autocache)
        self._dataset_order: tuple[tuple[str, ...], np.ndarray] | None = None  # names and sizes by SimDataset.index (_references)
        #: (the _Members, its jobs' GPUs and f* as bytes, their references) of the last references built from the engine's columns
        self._kept_references: tuple[_Members, tuple[bytes, bytes], np.ndarray] | None = None

    # ------------------------------------------------------------------ helpers
    def _curriculum_chunks(self, trace: Trace, name: str, start: float | None) -> int:
        """Chunks for a dataset curriculum jobs read (`start`: their smallest starting_percent,
        None if none does): enough that the smallest eligible set spans CURRICULUM_MIN_CHUNKS
        chunks (each draw admits a whole chunk, so a set of a few chunks fills in lumps), at most
        one per item and MAX_CURRICULUM_CHUNKS."""
        if start is None:
            return 0
        items = int(trace.dataset_sizes[name] / self.item_sizes[name])
        return int(min(max(items, 1), MAX_CURRICULUM_CHUNKS, math.ceil(CURRICULUM_MIN_CHUNKS / start)))

    def _snapshot(self, now: float, active: _ActiveJobs, slots: np.ndarray) -> Snapshot:
        """The jobs as the policy sees them, with the same jobs as columns (JobColumns).

        A job's JobView is kept between decisions and rebuilt only when what the policy sees of
        it changed (a queued job's view stays the same until it runs): building ~300 frozen
        views per decision was the largest single cost of a Fig. 12 run. Likewise a dataset's
        view is kept while its cached bytes stay the same. `slots`: the active jobs' rows in the
        job table (_active_slots)."""
        measured = self.core.estimator.manages_storage
        told = self.config.partition
        cache = self.cache
        # The columns from the job table; the views only where what they hold changed.
        n = len(active)
        table = self._table
        self._refresh_layout()  # the volatile column, which the hit ratios read, follows the layout
        rows = table.rows[slots]
        remaining = np.maximum(rows[:, TOTAL] - table.state[slots, CONSUMED], 0.0)
        ideal = rows[:, GPU_IDEAL].copy()
        for i in (rows[:, FSTAR] != 0.0).nonzero()[0].tolist():
            ideal[i] = active[i].fstar.estimate  # the scheduler's f*, not the declared one
        running = np.fromiter(map(_RUNNING, active), dtype=bool, count=n)
        hits = self._hit_ratios(active, slots, rows) if measured else None
        self._snapshots += 1
        members = self._members_of(active)
        lazy = LazyJobs(partial(self._views, self._snapshots, members.jobs, slots, remaining, running, ideal, hits if measured else None))
        names, needed = members.datasets, members.needed
        all_regular = not (told and bool((rows[:, IRREGULAR] != 0.0).any()))
        if measured:
            # The kept views whose cached bytes changed are rebuilt (`_kept_cached`: the bytes
            # each was built with; None: none yet); the rest is C-level maps, not a loop over
            # the ~300 datasets of every decision.
            kept, built = self._dataset_views, self._kept_cached
            now_cached = list(map(cache.cached_bytes().get, needed, repeat(0.0)))
            for n, c in [(n, c) for n, c, b in zip(needed, now_cached, map(built.get, needed)) if b is None or b != c]:
                kept[n], built[n] = DatasetView(n, self.datasets[n].size, c), c
            dviews = dict(zip(needed, map(kept.__getitem__, needed)))
        else:
            dviews = dict(zip(needed, map(self.dataset_views.__getitem__, needed)))
        columns = LazyJobColumns(lazy, rows[:, GPUS].copy(), ideal, remaining, running, hits if measured and active else None, all_regular,
                                 members.ids, names, rows[:, SUBMIT].copy(), rows[:, ID_RANK].astype(np.int64),
                                 members.autocaches,
                                 self._name_rank[rows[:, DATASET].astype(np.int64)],
                                 self._miss_rates(active) if self._loaders else None)
        # A read-only view of the fresh dict (Snapshot would copy any other mapping into one).
        return LazySnapshot(now, lazy, MappingProxyType(dviews), self.capacity, columns)

    @staticmethod
    def _miss_rates(active: tuple[SimJob, ...]) -> np.ndarray | None:
        """The active jobs' loader miss rates (JobColumns.miss_rate: inf where none; None when
        none of them has one), which the policies plan with (policies/loader.py)."""
        rates = [j.trace.loader_miss_rate for j in active]
        if all(m is None for m in rates):
            return None
        return np.array([math.inf if m is None else m for m in rates], dtype=float)

    def _views(self, taken: int, active: tuple[SimJob, ...], slots: np.ndarray, remaining: np.ndarray, running: np.ndarray,
               ideal: np.ndarray, hits: np.ndarray | None) -> tuple[JobView, ...]:
        """The JobViews of snapshot number `taken` (LazyJobs: built when a stage first reads
        them), from the values it was taken with. A job's view is kept between snapshots and
        rebuilt only when what the policy sees of it changed (a queued job's view stays the same
        until it runs); a snapshot older than the last builds its own, leaving the kept ones
        (its jobs' table rows may belong to other jobs by now)."""
        told = self.config.partition
        hit_l = hits.tolist() if hits is not None else [None] * len(active)

        def view(j: SimJob, f: float, rem: float, is_running: bool, hit: float | None) -> JobView:
            m = j.trace.loader_miss_rate
            return job_view(j.job_id, j.trace.num_gpus, j.dataset.name, f, rem, j.trace.submit_time, is_running, 0, hit,
                            j.trace.access if told else _EPOCH, j.trace.pipeline, math.inf if m is None else m)

        if taken != self._snapshots:
            return tuple(map(view, active, ideal.tolist(), remaining.tolist(), running.tolist(), hit_l))
        table = self._table
        seen = table.seen[slots]
        changed = (seen[:, 0] != remaining) | (seen[:, 1] != running) | (seen[:, 3] != ideal)
        if hits is not None:
            changed |= seen[:, 2] != hits
        idx = changed.nonzero()[0]
        if idx.size:
            rem_l, run_l, f_l = remaining[idx].tolist(), running[idx].tolist(), ideal[idx].tolist()
            for i, rem, is_running, f in zip(idx.tolist(), rem_l, run_l, f_l):
                j = active[i]
                j.view = view(j, f, rem, is_running, hit_l[i])
            table.seen[slots[idx]] = np.column_stack([remaining[idx], running[idx], hits[idx] if hits is not None else np.full(idx.size, np.nan),
                                                      ideal[idx]])
        return tuple(map(_VIEW, active))

    def _hit_ratios(self, active: list[SimJob], slots: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """SimJob.hit_ratio_now of every active job (`rows`: their job-table rows): on the table's
        columns for epoch readers inside an epoch, by the job for the others (curriculum jobs, an
        epoch's end)."""
        table = self._table
        k = rows[:, K]
        left = k - table.state[slots, LOOKED]
        inside = (rows[:, CURRICULUM] == 0.0) & (left > 0)
        idx = inside.nonzero()[0]
        crows = np.fromiter((active[i].crow for i in idx.tolist()), dtype=np.int64, count=idx.size)
        unread = self.cache.rows.counts[crows, UNREAD].astype(float)
        _, expected = table.sync(slots[idx], unread, rows[idx, VOLATILE] != 0.0, k[idx])
        hits = np.empty(len(active))
        hits[idx] = 1.0 - np.minimum(np.maximum(1.0 - expected / left[idx], 0.0), 1.0)
        for i in (~inside).nonzero()[0].tolist():
            hits[i] = 1.0 - active[i].miss_ratio(self.cache)
        return hits

    def _apply_autocache(self, autocache) -> None:
        """The plan's autocaching choice, for the datasets whose mode can change: those it
        caches preprocessed and those cached so until now (every other dataset stays at
        expansion 1). Handing the cache system all of a trace's datasets at every plan cost
        6% of a Fig. 12 run."""
        names = set(autocache) | self._expanded
        datasets = self.datasets
        self.cache.apply_autocache(autocache, {n: datasets[n] for n in sorted(names & datasets.keys(), key=lambda n: datasets[n].index)})
        self._expanded = {n for n in names if n in datasets and datasets[n].expansion != 1.0}

    def _references(self, snapshot: Snapshot, slots: np.ndarray) -> None:
        """Eq. 8 denominators: SiloDPerf at the equal share, the same for every cache system.

        Without CPU modelled, the problem is built from the engine's columns with its own
        dataset positions (all its datasets, not the active ones sorted by name, as
        GavelProblem.from_snapshot builds it for the policy: a tenth of a FIFO run, where no
        policy built it already): each job's reference depends only on its dataset's size
        and readers, so the numbers are the same. Under Gavel the policy's own problem for this
        snapshot is taken, whose references it computed already."""
        if not slots.size:
            return
        cols = snapshot.job_columns()
        problem = GavelProblem.built_for(snapshot, manages_storage=True)
        if problem is None and (cols is None or self.capacity.manages_cpu):
            problem = GavelProblem.from_snapshot(snapshot, manages_storage=True)
        elif problem is None:
            if self._dataset_order is None:
                order = sorted(self.datasets.values(), key=_INDEX)
                self._dataset_order = (tuple(d.name for d in order), np.array([d.size for d in order], dtype=float))
            # Between arrivals and completions (the same `_members`) the references change only
            # with the jobs' f* or GPU counts: the last ones are kept while those are the same to
            # the bit (a FIFO or SJF run decides at nearly every step, and rebuilt this each time).
            members, key = self._members, (cols.gpus.tobytes(), cols.ideal.tobytes())
            kept = self._kept_references
            if kept is not None and kept[0] is members and kept[1] == key:
                self._table.reference[slots] = kept[2]
                return
            names, sizes = self._dataset_order
            cap = self.capacity
            problem = GavelProblem(job_ids=cols.ids, gpus=cols.gpus, ideal=cols.ideal, dataset_index=self._table.rows[slots, DATASET].astype(np.int64),
                                   dataset_names=names, dataset_size=sizes, total_gpus=float(cap.gpus), total_cache=float(cap.cache),
                                   total_io=float(cap.remote_io), manages_storage=True)
            reference = equal_share_throughput(problem)
            self._kept_references = (members, key, reference)
            self._table.reference[slots] = reference
            return
        self._table.reference[slots] = equal_share_throughput(problem)

    def _active_slots(self, active: _ActiveJobs) -> np.ndarray:
        return self._members_of(active).slots

    def _members_of(self, active: _ActiveJobs) -> _Members:
        """What depends only on which jobs are active, kept until one arrives or leaves
        (`self._members`, reset there): a decision without either reuses it."""
        members = self._members
        if members is None:
            names = tuple(active.names)
            members = self._members = _Members(tuple(active), np.array(active.slots, dtype=np.int64), tuple(active.ids), names, list(set(names)),
                                               self._autocaching and any(p is not None and p.autocaches for p in map(_PIPELINE, active)))
        return members

    def _time_shared(self, slots: np.ndarray) -> bool:
        """Whether some active job (`slots`: their rows) holds a GPU share strictly between 0 and 1."""
        share = self._table.share[slots]
        return bool(((share > 0.0) & (share < 1.0 - 1e-9)).any())

    def _step_limit(self, running: list[SimJob], st: StepState, caps_arr: np.ndarray, m: np.ndarray, last_dt: float | None) -> float:
        """Longest step over which every running job's demand on the link (f* x its miss ratio m)
        may be taken as fixed: the link is re-divided between steps, so a job whose m rises
        within a step (its unread chunks evicted by an LRU, or admitted by a co-reader of a
        filling shared dataset) would otherwise be held to the share of its old demand.

        Where the link could not serve every running job at f*, a step is bounded so that no
        such job's m is expected to move by more than `demand_tolerance`. m = (cached unread
        chunks) / (unread chunks); what others' admissions and evictions do to it is counted
        (`SimJob.moved`), and its rate over the last steps (`SimJob.drift_m / drift_t`, averaged with halving
        weights) predicts the next: dt <= tolerance / drift. A job with no measured drift yet is
        bounded a priori: others can move at most one of its unread chunks per chunk the link
        brings in, dt <= tolerance x (its unread bytes) / link. Both take the unread chunks as at
        least DRIFT_FLOOR of an epoch (near its end m swings over a few chunks, but only for as
        long as they take to read, and the epoch boundary is an event of its own). Two bounds
        catch what the last steps could not see: a step ends where an LRU may become full (from
        then on it evicts at every miss), and lasts at most tolerance x (volatile bytes) / (the
        rate they are admitted at) (an LRU of C bytes turns over in about C / that rate; a step
        that happened to count no move would otherwise let the next one grow without bound).
        That rate is the IO of the running readers that admit into the domain, or the link for a
        cache every reader shares (`_admission_rate`): a small LRU partition read by one
        slow job is not bounded by the whole link's worth of admissions it cannot receive.
        A curriculum job whose cache still fills moves its own miss ratio (and so its demand on
        the link) as it reads: its step brings in at most 1/VOLATILE_STEPS of its eligible set,
        and on a contended link its fetch rate may fall by at most tolerance x link (the link
        it frees goes to the others only when the link is re-divided). Without that bound the
        free-space and turnover bounds, taken at the whole link, were what kept such steps
        short, and they made steps of milliseconds for a small LRU partition (a 200-job
        irregular-mix trace: 339 -> 10 CPU s).
        """
        link = self.capacity.remote_io
        if link <= 0:
            return np.inf
        limit = np.inf
        # Autocaching: a preprocessed reader's CPU cost follows m, so its m matters even on a
        # link that could serve everyone.
        contended = sum(st.ideal.tolist()) > link
        if contended or (self._expanded and any(j.dataset.expansion != 1.0 for j in running)) or (
                self._loaders and any(j.trace.loader_miss_rate is not None for j in running)):
            tol = self.config.demand_tolerance
            moves = self.cache.moves_under_all(running)
            if moves.any():
                # Per job: measured drift, dt <= tol / drift; unmeasured, dt <= tol x unread / link.
                limit = min(limit, drift_bound(self._table.state, st.slots, st.k, st.looked, st.chunk, moves, last_dt is not None, tol,
                                               link, DRIFT_FLOOR))
            # An LRU that becomes full starts evicting at every miss: a drift the last step
            # could not see. Admissions cannot outrun the IO of the readers that admit into it
            # (nor the link): stop where it may become full.
            free = self.cache.free_before_eviction()
            volatile = self.cache.volatile_bytes()
            if any(readers is not None for _, readers in (*free, *volatile)):
                admits = self._admission_rates(running, caps_arr, m, link)
            else:
                admits = {}  # one cache every reader shares (Alluxio): the link bounds it
            for nbytes, readers in free:
                rate = _admission_rate(readers, admits, link)
                if rate > 0:
                    limit = min(limit, nbytes / rate)
            # The turnover of the volatile bytes bounds the drift on average (a noisy count).
            for nbytes, readers in volatile:
                rate = _admission_rate(readers, admits, link)
                if rate > 0:
                    limit = min(limit, tol * nbytes / rate)
        for i in st.curriculum.nonzero()[0].tolist():
            job = running[i]
            if m[i] <= 0 and st.ideal[i] > 0:
                # All its eligible items cached: it admits nothing, at f*, until its set grows;
                # then its demand jumps and the link is re-divided.
                limit = min(limit, job.bytes_to_growth() / float(st.ideal[i]))
                continue
            cap = float(caps_arr[i])
            if cap > 0 and self.cache.room(job) > 0:
                eligible = job.eligible_chunks() * job.dataset.chunk_size
                limit = min(limit, eligible / (VOLATILE_STEPS * cap))
                if contended:
                    # Its fetch rate min(cap, f* m) falls by f* x (its fetch / eligible bytes)
                    # per second as its misses are admitted: the link it frees is re-divided
                    # once that is tolerance x link.
                    fetch = min(cap, float(st.ideal[i]) * float(m[i]))
                    if fetch > 0:
                        limit = min(limit, self.config.demand_tolerance * link * eligible / (float(st.ideal[i]) * fetch))
        return max(limit, 1e-3)

    @staticmethod
    def _admission_rates(running: list[SimJob], caps_arr: np.ndarray, m: np.ndarray, link: float) -> dict[str, float]:
        """Job id -> the most a running job's misses can bring into a cache per second: its IO
        cap. A curriculum job whose eligible items are all cached misses nothing until its set
        grows, which ends the step (_step_limit)."""
        return {j.job_id: 0.0 if j.pacing is not None and mi <= 0.0 else min(cap, link)
                for j, mi, cap in zip(running, m.tolist(), caps_arr.tolist(), strict=True)}

    # ------------------------------------------------------------------ main loop
    def run(self) -> SimResult:
        cfg = self.config
        wall0 = wallclock.perf_counter()
        cpu0 = wallclock.process_time()
        seed_seq = np.random.SeedSequence(cfg.seed)
        pending = list(self.trace.jobs)  # sorted by submit time
        next_arrival = 0
        active = _ActiveJobs()
        records: list[JobRecord] = []
        timeline: list[TimelineRow] = []
        now = 0.0
        need_decision = True
        deferred = False  # a decision waits for decision_interval_s (coalescing)
        # Round-based policies (Gavel) see arrivals and completions at the round's end, as
        # Gavel's rounds do: an arrival waits for it, a finished job's GPUs idle until it (a
        # round ends early when all its jobs have finished). Others decide at once.
        round_based = self.core.policy.time_sharing
        job_event = False  # an arrival or completion not yet decided on
        snapshot = None
        allocation = None
        plan = None
        round_end = -np.inf
        running: list[SimJob] = []
        last_decision = -np.inf
        gpu_seconds = 0.0
        remote_total = 0.0
        fairness_area = 0.0
        fairness_time = 0.0
        steps = 0
        last_dt: float | None = None
        self._static = None  # the running jobs' static columns (_step_state)
        self._static_crows = np.zeros(0, dtype=np.int64)  # and their reader rows
        self._table = JobTable()
        id_rank = {job_id: r for r, job_id in enumerate(sorted({j.job_id for j in self.trace.jobs}))}  # JobColumns.id_rank
        self._by_id: dict[str, SimJob] = {}  # the active jobs by id
        self._fair = None  # the fairness columns (_fairness)
        self._members: _Members | None = None  # the active jobs' ids, rows and datasets (_members_of)
        time_shared = False
        self._static_layout = -1
        idle_steps = 0  # consecutive steps in which no job read anything and none can arrive
        next_sample = 0.0
        acc_remote = acc_bytes = acc_time = acc_fair = acc_fair_time = acc_remote_irregular = 0.0
        total_work = sum(j.total_bytes(self.trace.dataset_sizes[j.dataset]) for j in self.trace.jobs)
        done_work = 0.0

        while next_arrival < len(pending) or active:
            while next_arrival < len(pending) and pending[next_arrival].submit_time <= now + 1e-9:
                tj = pending[next_arrival]
                ds = self.datasets[tj.dataset]
                rng = np.random.default_rng(seed_seq.spawn(1)[0])
                job = SimJob(tj, ds, tj.ideal_throughput * cfg.gpu_speed, tj.total_bytes(ds.size), rng,
                             pacing=tj.access.curriculum, item_size=self.item_sizes.get(tj.dataset, 0.0))
                if tj.declared_throughput is not None:
                    job.fstar = FStarEstimate.start(tj.declared_throughput * cfg.gpu_speed)
                self.cache.register(job)
                job.start_epoch_view(self.cache)
                self._table.add(job, self.cache, id_rank[job.job_id])
                active.append(job)
                self._by_id[job.job_id] = job
                self._fair = self._members = None
                next_arrival += 1
                job_event = True
            if not active:
                if need_decision or deferred or job_event:
                    deferred = job_event = False
                    # The last job finished: apply the plan for no jobs as at any completion
                    # (silod and quiver drop the datasets nobody reads any more), idle or not.
                    snapshot = self._snapshot(now, active, np.zeros(0, dtype=np.int64))
                    allocation = self.core.decide(snapshot)
                    plan = self.core.plan_round(snapshot, allocation)
                    running = []
                    round_end = -np.inf
                    part = plan.allocation.partition
                    self._apply_autocache(plan.allocation.autocache)
                    self.cache.apply_plan(plan.cache, running, self.datasets, now, part.lru_datasets if part is not None else frozenset())
                    need_decision = False
                now = pending[next_arrival].submit_time
                continue
            if now > cfg.max_sim_time_s:
                break

            # Caches fill as jobs read, which changes the IO a managed allocation should give:
            # re-decide at least every io_refresh_s even without arrivals or completions.
            if self.core.estimator.manages_storage and now - last_decision >= cfg.io_refresh_s:
                need_decision = True
            recheck = self.core.stagger_recheck_at
            if recheck is not None and now >= recheck - 1e-9:
                need_decision = True  # a held job's staggered start has come
            if job_event and (not round_based or not running or now >= round_end - 1e-9):
                need_decision = True
            # The allocation-recompute interval (Gavel's minimum_time_between_allocation_resets;
            # 0, the default: none): what asks for a decision within decision_interval_s of the
            # last one waits for it (an idle cluster decides at once). Meanwhile each round is
            # planned on the allocation in force over the jobs active now, as Gavel does: jobs
            # that arrived since get no GPUs, finished jobs' GPUs go to the others in it at the
            # round's end.
            interval = cfg.decision_interval_s
            if interval > 0:
                due = not running or (now >= last_decision + interval - 1e-9 and (not round_based or now >= round_end - 1e-9))
                if (need_decision or deferred) and not due:
                    deferred, need_decision = True, False
                    if now >= round_end - 1e-9:
                        snapshot = self._snapshot(now, active, self._active_slots(active))
                elif deferred:
                    deferred, need_decision = False, True
            if need_decision:
                last_decision = now
                job_event = False
                slots = self._active_slots(active)
                snapshot = self._snapshot(now, active, slots)
                allocation = self.core.decide(snapshot)
                self._references(snapshot, slots)
                gpu_share = allocation.gpu_share
                self._table.share[slots] = values_for(gpu_share, snapshot.columns.ids)
                self._fair = None
                # Shares change only here (and finished jobs only leave).
                time_shared = self._time_shared(slots)
            if need_decision or now >= round_end - 1e-9:
                # Who holds GPUs changes only at round boundaries (and when the jobs change).
                plan = self.core.plan_round(snapshot, allocation)
                round_end = now + cfg.round_s if time_shared or (round_based and plan.running) else np.inf
                by_id = self._by_id
                chosen = [by_id[i] for i in plan.running]
                chosen_ids = set(plan.running)
                stopped = [j for j, kept in zip(running, map(chosen_ids.__contains__, map(_JOB_ID, running))) if not kept and j.job_id in by_id]
                for job in stopped:
                    job.running = False
                self.cache.jobs_stopped(stopped)
                for job in chosen:
                    if job.running and plan.cpu is None:
                        continue  # still running, started, on unlimited cores: nothing to change
                    if job.start_time is None:
                        job.start_time = now
                    job.running = True
                    if self._table.set_cores(job, math.inf if plan.cpu is None else plan.cpu.get(job.job_id, 0.0)):
                        self._static = None
                if len(chosen) != len(running) or not all(map(is_, chosen, running)):
                    self._static = None  # the static columns hold while the same jobs run (cores: _step_state)
                running = chosen
                part = plan.allocation.partition
                self._apply_autocache(plan.allocation.autocache)
                self.cache.apply_plan(plan.cache, running, self.datasets, now, part.lru_datasets if part is not None else frozenset())
            need_decision = False

            # Step: to the next round, arrival, or a running job's completion or epoch boundary
            # (where its miss ratio, so its demand, changes and the link is re-divided).
            step_end = min(round_end, now + max(cfg.round_s, cfg.io_refresh_s))
            if next_arrival < len(pending):
                step_end = min(step_end, pending[next_arrival].submit_time)
            if self.core.estimator.manages_storage and not deferred:
                step_end = min(step_end, last_decision + cfg.io_refresh_s)
            if self.core.stagger_recheck_at is not None:
                step_end = min(step_end, max(self.core.stagger_recheck_at, now + 1e-6))
            if deferred and not round_based:
                step_end = min(step_end, last_decision + cfg.decision_interval_s)
            st = self._step_state(running)
            m = self._miss_vector(running, st)
            pre = self._preprocessed(running)
            ideal_m = self._ideal_at(running, st, m, pre)
            caps_arr, contended, claimers = self._io_caps(plan, running, st, m, ideal_m)
            managed = plan.remote_io is not None and cfg.manage_io
            step_end = min(step_end, now + self._seconds_to_event(running, st, caps_arr, m, contended, ideal_m))
            for i in pre:
                # Autocaching: a preprocessed reader's CPU cost per byte changes at its epoch
                # boundaries, so they end a step even on a link that could serve everyone.
                step_end = min(step_end, now + running[i].seconds_to_event(float(caps_arr[i]), self.cache, True, float(m[i])))
            step_end = min(step_end, now + self._step_limit(running, st, caps_arr, m, last_dt))
            dt = max(step_end - now, 1e-6)
            cpu_now = st.cpu_bound
            if pre:
                cpu_now = cpu_now.copy()
                for i in pre:
                    cpu_now[i] = cpu_bound_at(running[i], float(m[i]))
            bounds = bound_indices(st.gpu_ideal, cpu_now, caps_arr, m.clip(0.0, 1.0))
            reader_counts = self.cache.rows.counts
            reader_counts[st.crows, MOVED] = 0

            watch = managed and contended
            if claimers is not None or (self.cache.volatile and len(running) >= 2):
                results = self._advance_all(running, st, m, caps_arr, now, dt, pre, claimers)
            else:
                results = self._advance_vector(running, st, m, caps_arr, now, dt, pre)
            if watch:
                m_after = self._miss_vector(running, self._step_state(running, st))
                if (np.abs(m_after - m) > DEMAND_CHANGE).any():
                    # A job's demand on a contended link changed: the policy re-divides the link
                    # (FIFO and SJF by priority, Gavel by fairness), as on a real cluster.
                    need_decision = True
            finished_at = results.finished_at
            ran, rates = np.empty((2, len(running)))
            # The drift of each job's miss ratio is counted over a few chunks, so it is noisy:
            # it is averaged over the last steps (each weighing half the one after it).
            step_bytes, step_remote, step_remote_irregular = step_results(
                finished_at, now, dt, results.read, results.remote, st.irregular, st.slots, bounds, self._table.state, reader_counts,
                st.crows, st.k, st.looked, DRIFT_FLOOR, DRIFT_MEMORY, ran, rates, self._table.last_rate)
            for i in st.fstar.nonzero()[0].tolist():
                job = running[i]
                job.fstar = observe_fstar(job, float(rates[i]), float(ran[i]), caps_arr[i], float(m[i]))
            gpus_running = int(st.gpus.sum())
            ended = ~np.isnan(finished_at)
            finished = [running[i] for i in ended.nonzero()[0].tolist()]
            for job, at in zip(finished, finished_at[ended].tolist()):
                job.finish_time = at
            fair = self._fairness(active)
            if fair is not None:
                fairness_area += fair * dt
                fairness_time += dt
                acc_fair += fair * dt
                acc_fair_time += dt
            self.core.record(snapshot, plan, dt)
            steps += 1
            last_dt = dt
            gpu_seconds += gpus_running * dt
            remote_total += step_remote
            done_work += step_bytes
            idle_steps = idle_steps + 1 if step_bytes <= 0 and next_arrival >= len(pending) else 0
            if idle_steps > 1000:
                break  # nothing can progress (e.g. no remote IO for a cold cache): report unfinished

            acc_remote += step_remote
            acc_remote_irregular += step_remote_irregular
            acc_bytes += step_bytes
            acc_time += dt
            if now + dt >= next_sample:
                fr = acc_fair / acc_fair_time if acc_fair_time > 0 else None
                timeline.append(replace(self._sample(now + dt, active, running, plan, acc_remote, acc_bytes, acc_time, fr, acc_remote_irregular),
                                        **{f"bound_{k}": v for k, v in counts(bounds).items()}))
                acc_remote = acc_bytes = acc_time = acc_fair = acc_fair_time = acc_remote_irregular = 0.0
                next_sample = now + dt + cfg.timeline_interval_s

            if finished:
                self._static = None
                self._fair = self._members = None
            for job in finished:
                active.remove(job)
                del self._by_id[job.job_id]
                running.remove(job)
                job.running = False
                self.cache.unregister(job)
                self.cache.jobs_stopped((job,))
                self.core.forget(job.job_id)
                self._table.remove(job)
                records.append(
                    JobRecord(job.job_id, job.trace.submit_time, job.start_time or job.trace.submit_time, job.finish_time,
                              job.gpus, job.dataset.name, job.remote_bytes, job.hit_bytes, tuple(job.epoch_hit_ratios),
                              tuple(job.bound_s.items()),
                              job.gpu_ideal if job.fstar is None else job.fstar.declared,
                              math.nan if job.fstar is None else job.fstar.estimate)
                )
                job_event = True
            if finished:
                time_shared = self._time_shared(self._active_slots(active))
            now += dt
            if self.progress is not None:
                self.progress(min(done_work / total_work, 1.0) if total_work > 0 else 1.0)

        makespan = max((r.finish_s for r in records), default=0.0)
        return SimResult(
            jobs=records,
            timeline=timeline,
            makespan_s=makespan,
            gpu_seconds_used=gpu_seconds,
            remote_bytes=remote_total,
            fairness_time_avg=fairness_area / fairness_time if fairness_time > 0 else 0.0,
            capacity=self.capacity,
            sim_wall_s=wallclock.perf_counter() - wall0,
            sim_cpu_s=wallclock.process_time() - cpu0,
            steps=steps,
            unfinished=[j.job_id for j in active],
        )

    def _advance_all(self, running: list[SimJob], st: StepState, m0: np.ndarray, caps_arr: np.ndarray, now: float, dt: float,
                     pre: list[int] = (), claimers: Claimers | None = None):
        """Advance every running job through the step. Where the cached set moves at every
        miss (LRU), jobs advance interleaved in time (`_interleave`).

        `claimers` (`_claimable`): jobs in a full LRU whose cap is the share they could claim,
        above their demand at the step's start. They read first; the jobs at the link's water
        level then share what they left of it (max-min by demand), so the link never carries
        more than its capacity. Their reads are interleaved among themselves, not with the
        others': within one step (the drift bound keeps it short), the claimers' look-ups
        count as older than the others' in the LRU's order."""
        if claimers is None:
            return self._interleave(running, st, m0, caps_arr, now, dt, pre)

        def interleave(idx: np.ndarray, caps: np.ndarray, fresh: bool):
            """`_interleave` on the jobs at positions `idx` of `running`."""
            chosen = idx.tolist()
            if pre:
                positions = {p: n for n, p in enumerate(chosen)}
                pre_here = [positions[p] for p in pre if p in positions]
            else:
                pre_here = []
            return self._interleave([running[i] for i in chosen], st.take(idx), m0[idx], caps, now, dt, pre_here, fresh)

        first = claimers.mask.nonzero()[0]
        rest = (~claimers.mask).nonzero()[0]
        state, first_slots = self._table.state, st.slots[first]
        before = state[first_slots, REMOTE]
        out_first = interleave(first, caps_arr[first], True)
        used = sum((state[first_slots, REMOTE] - before).tolist()) / dt
        caps_rest = caps_arr[rest].copy()
        at_level = claimers.at_level[rest]
        if at_level.any():
            below = float(caps_rest[~at_level].sum())
            caps_rest[at_level] = max_min(claimers.demands[rest][at_level], max(self.capacity.remote_io - used - below, 0.0))
        out_rest = interleave(rest, caps_rest, False)  # the claimers' reads moved the cache since `st`
        out = Outcome.empty(len(running), dt)  # back in the order of `running`
        for idx, part in ((first, out_first), (rest, out_rest)):
            out.read[idx], out.remote[idx], out.finished_at[idx], out.elapsed[idx] = part.read, part.remote, part.finished_at, part.elapsed
        return out

    def _interleave(self, running: list[SimJob], st: StepState, m0: np.ndarray, caps_arr: np.ndarray, now: float, dt: float,
                    pre: list[int] = (), fresh: bool = True):
        """Advance the jobs through the step interleaved in time, sub-step by sub-step,
        earliest first, so that which chunk is least recently used follows the real order of
        accesses.

        Every job's first sub-step starts at the step's start, so those are taken first, in
        the order of `running`; most jobs on a contended link read less than a sub-step in a
        step, and those are done at once on the columns (`_advance_vector` with
        `first_substep`, exactly what `advance(substeps=1)` does). Only the jobs with step
        left go on through the clock, earliest first."""
        caps = caps_arr.tolist()
        if len(running) < 2:
            out = Outcome.empty(len(running), dt)
            for i, (job, cap) in enumerate(zip(running, caps)):
                out.put(i, advance(job, now, dt, cap, self.cache))
            return out
        first = self._advance_vector(running, st, m0, caps_arr, now, dt, pre, first_substep=True, fresh=fresh)
        tol = 1e-9 * max(dt, 1.0)
        elapsed = first.elapsed
        left = (np.isnan(first.finished_at) & (dt - elapsed > tol) & (elapsed > 0)).nonzero()[0]
        if not left.size:
            return first
        if self.cache.compiled_advance is not None:  # the same clock, compiled (Alluxio's LRU)
            python = st.curriculum.copy()
            python[list(pre)] = True  # (a list: an empty tuple as an index is every element)
            k = st.k
            step = TurnAdvance(python, st.slots, np.maximum((k * VOLATILE_SUBSTEP).astype(np.int64), 1), k, st.chunk, st.ideal, st.total,
                               caps_arr, now, dt, 1, self._table.state, first.read, first.remote, first.finished_at, first.elapsed,
                               np.zeros(len(running), dtype=bool))
            self.cache.advance_clock(running, st.crows, left, elapsed[left], step, tol,
                                     lambda i, t: advance(running[i], now + t, dt - t, caps[i], self.cache, substeps=1))
            return first
        python_clock(running, self.cache, elapsed[left], left, now, dt, caps, tol, first.read, first.remote,
                     first.finished_at)
        return first  # its results, with the later sub-steps added

    def _io_caps(self, plan, running: list[SimJob], st, m: np.ndarray, ideal_m: np.ndarray) -> tuple[np.ndarray, bool, Claimers | None]:
        """Remote IO per running job for this step (same order), whether the link is contended,
        and the jobs whose cap is what they could claim (`_claimable`; None: no such job).

        Managed (SiloD): the policy's caps, with work conservation: a job holds no more than it
        can use now (f* times its miss ratio now), and what the caps leave goes max-min to the
        jobs that could use more (e.g. in epoch 1, or when their data was evicted).
        Unmanaged (baselines): the link is shared max-min by demand, like TCP flows.
        """
        total = self.capacity.remote_io
        demands = ideal_m * m
        contended = sum(demands.tolist()) > total * (1 - 1e-9)
        claimers = None
        if plan.remote_io is not None and self.config.manage_io:
            planned = plan.remote_io
            floors = np.minimum(np.fromiter(map(planned.get, st.ids, repeat(0.0)), dtype=float, count=len(st.ids)), demands)
            caps = _spread(floors, demands, total)
        else:
            caps = max_min(demands, total)
            if contended:
                caps, claimers = self._claimable(running, st.crows, caps, demands, total)
        if not contended:
            # Headroom up to f* (the most a job can read remotely), so a job whose miss ratio
            # rises within the step (a new epoch) is not held to the demand it had at its start.
            caps = _spread(caps, ideal_m, total)
        return caps, contended, claimers

    def _claimable(self, running: list[SimJob], crows: np.ndarray, caps: np.ndarray, demands: np.ndarray,
                   total: float) -> tuple[np.ndarray, Claimers | None]:
        """Max-min caps on a contended link, where a job in a full LRU gets below the water level
        what it could claim if its demand rose, not just its demand now: others' admissions evict
        its unread chunks within the step, so its miss ratio (its demand) rises as it reads, and
        a cap fixed at its demand at the step's start stalls it at its first new miss (a job
        whose every unread chunk was cached got a cap of 0). Like a TCP flow that starts
        fetching, it can take up to the share the link would give it then,
        (link - what the other jobs below the level take) / (jobs at the level + 1). The jobs at
        the level get what the claimers leave (`_advance_all`). A fast job streaming another
        dataset through Alluxio while a slow one rereads its own: the slow one 17% slower than
        item level without this, 3% with it (docs/known-gaps.md)."""
        below, at_level = below_level(caps)  # (compiled, as the claims: link_kernel.py)
        if not at_level or at_level == len(caps):
            return caps, None
        mask = below & self.cache.evicting_all(running, crows)
        if not mask.any():
            return caps, None
        return claimed_caps(caps, below, mask, float(total), at_level), Claimers(mask, ~below, demands)

    def _step_state(self, running: list[SimJob], prev: StepState | None = None) -> StepState:
        """Columns of the running jobs: the static ones (the job table's rows) are kept while
        the running set, their cores and the cache's layout stay the same (`self._static`,
        reset where one changes)."""
        n = len(running)
        if prev is None:
            self._refresh_layout()
            static, crows = self._static, self._static_crows
        else:
            static, crows = prev.static(), prev.crows
        if static is None or len(static[0]) != n:
            static = self._static = self._table.columns(running)
            # A job keeps its reader row from its arrival to its completion: with the static columns.
            crows = self._static_crows = np.fromiter(map(_CROW, running), dtype=np.int64, count=n)
        # SimJob.unread_expected of every running job (called with its `scalar` flag, as the
        # per-job advance calls it), on the job table's columns.
        slots = static[1]
        unread = self.cache.rows.counts[crows, UNREAD].astype(float)
        looked, expected = self._table.sync(slots, unread, static[-1], static[2])
        position = self._table.state[slots]
        return StepState(*static, looked, expected, unread, position[:, CONSUMED], position[:, POS], crows)

    def _refresh_layout(self) -> None:
        """Whether a job's cache is volatile changes only with the cache's layout: the job
        table's column follows it (and the running jobs' static columns are rebuilt)."""
        if self.cache.layout_version != self._static_layout:
            self._static_layout = self.cache.layout_version
            self._table.refresh_volatile(list(self._by_id.values()), self.cache)
            self._static = None

    def _preprocessed(self, running: list[SimJob]) -> list[int]:
        """Positions of the running jobs whose dataset's cache holds preprocessed data
        (autocaching) or with a loader miss term: their rate without IO limits depends on their
        miss ratio."""
        if not self._expanded and not self._loaders:
            return []
        return [i for i, j in enumerate(running) if j.dataset.expansion != 1.0 or j.trace.loader_miss_rate is not None]

    @staticmethod
    def _ideal_at(running: list[SimJob], st, m: np.ndarray, pre: list[int]) -> np.ndarray:
        """SimJob.ideal_at for every running job: the static column except for preprocessed readers."""
        if not pre:
            return st.ideal
        ideal = st.ideal.copy()
        for i in pre:
            ideal[i] = running[i].ideal_at(float(m[i]))
        return ideal

    def _miss_vector(self, running: list[SimJob], st) -> np.ndarray:
        """SimJob.miss_ratio of every running job, from the step's columns (a job at its
        epoch's very end and curriculum jobs ask the job)."""
        n = len(running)
        m, ask = np.empty(n), np.empty(n, dtype=np.int64)
        for i in ask[:miss_ratios(st.k, st.looked, st.unread, st.curriculum, m, ask)].tolist():
            m[i] = running[i].miss_ratio(self.cache)
        return m

    def _seconds_to_event(self, running: list[SimJob], st, caps: np.ndarray, m: np.ndarray, contended: bool,
                          ideal_m: np.ndarray) -> float:
        """The earliest SimJob.seconds_to_event over the running jobs, computed on the columns."""
        if not running:
            return np.inf
        if contended:
            visible, room = self.cache.visible_and_room(running, st.crows)
            growth = np.zeros(len(running))
            for i in st.curriculum.nonzero()[0].tolist():
                growth[i] = running[i].bytes_to_growth()
        else:
            visible = room = growth = _NO_COLUMN
        return seconds_to_event(m, ideal_m, caps, st.total, st.consumed, contended, visible, room, st.k, st.looked, st.unread_real,
                                st.pos, st.chunk, st.curriculum, growth, DEMAND_CHANGE)

    def _advance_vector(self, running: list[SimJob], st, m0: np.ndarray, caps: np.ndarray, now: float, dt: float,
                        pre: list[int] = (), first_substep: bool = False, fresh: bool = True):
        """`advance` for every running job at once where a step is one stretch of one epoch at
        one miss ratio (uniform caches: the common case), the per-job `advance` elsewhere (an
        epoch boundary inside the step, a volatile cache, curriculum reads). Jobs are taken in
        order and a job whose count of cached unread chunks was moved by an earlier job's
        admissions in this step is advanced by `advance` too, so the result is exactly the
        per-job loop's.

        `first_substep` (interleaved LRU readers, `_advance_all`): each job's first sub-step
        only, `advance(substeps=1)`: a volatile job's stretch also ends where its sub-step does
        (VOLATILE_SUBSTEP of an epoch), and a job that needs more than one is left to the
        per-job `advance` with its elapsed time (less than `dt`).

        `fresh`: the cache has not changed since `st` was gathered (else every job's count is
        checked at its turn, not only those after a job that may have changed it)."""
        cache = self.cache
        n = len(running)
        k, s, ideal = st.k, st.chunk, st.ideal
        p, looked, unread = st.pos, st.looked, st.unread
        tol = 1e-9 * max(dt, 1.0)
        scalar = st.curriculum.copy() if first_substep else st.scalar
        if pre:  # preprocessed readers' rate follows their miss ratio: the per-job advance
            scalar = scalar.copy()
            scalar[pre] = True
        substeps = 1 if first_substep else None
        m, x, done, missed, t, read, remote, finished_at, elapsed = np.empty((9, n))
        finishing, simple, stalled, looks, applied, ending = np.empty((6, n), dtype=bool)
        last, hits, visit, looked_i, unread_i = np.empty((5, n), dtype=np.int64)
        # advance's `reach` in a first sub-step: a volatile job's sub-step, a whole epoch for the
        # others. Jobs are taken in order, as the per-job loop would: only those that look chunks
        # up or need the per-job `advance` touch the cache (`visit`); the others (reading inside
        # chunks looked up before, or stalled) are checked at their turn only once the cache has
        # changed. `applied`: whose step is the columns' (the rest: advance's).
        visits = column_step(k, s, ideal, p, looked, unread, st.total, st.consumed, caps, dt, tol,
                             VOLATILE_SUBSTEP if first_substep else 0.0, st.scalar, scalar, m, x, finishing, last, done, missed, t,
                             simple, stalled, looks, read, remote, finished_at, elapsed, applied, hits, visit, st.unread_real,
                             looked_i, unread_i)
        out = Outcome(read, remote, finished_at, elapsed)
        visit = visit[:visits]

        def per_job(i: int) -> None:
            out.put(i, advance(running[i], now, dt, float(caps[i]), cache, substeps))
            applied[i] = False

        step = None
        if cache.compiled_advance is not None:
            python = st.curriculum.copy()
            python[pre] = True
            step = TurnAdvance(python, st.slots, np.maximum((k * VOLATILE_SUBSTEP).astype(np.int64), 1), k, s, ideal, st.total, caps, now,
                               dt, -1 if substeps is None else substeps, self._table.state, out.read, out.remote, out.finished_at,
                               out.elapsed, applied)
        cache.look_up_in_turn(running, st.crows, visit, simple, unread_i, looked_i, last, fresh, hits, per_job, step)
        # SimJob.looked_up and SimJob.fetched of the jobs that looked chunks up, and the position
        # of the jobs the columns advanced, as advance() moves it.
        column_apply(hits, st.slots, k, looked, last, s, applied, done, missed, x, m, finishing, st.total, self._table.state, out.remote,
                     ending)
        ends = ending.nonzero()[0]
        if ends.size:
            for i in ends.tolist():
                job = running[i]
                job.consumed = job.total_bytes
                if job.pos >= job.dataset.n_chunks - 1e-6:
                    job.new_epoch(cache)  # records the last epoch's hit ratio
                out.finished_at[i] = now + float(t[i])
        return out

    def _fairness(self, active: list[SimJob]) -> float | None:
        """Eq. 8 now: min over active jobs of perf(j, R_j) / perf(j, R_equal), where perf(j, R_j)
        is the job's share of GPU time times the throughput it reads at while it holds them.

        Shares and references change only at decisions and the active set only at arrivals and
        completions, so the jobs that count and their shares and references are kept as columns
        until then (`self._fair`, reset there); only the rates are read at every step. A job that
        counts with no GPU share makes the minimum 0 (the queue under FIFO and SJF): the ratios
        are products of non-negative finite numbers."""
        cols = self._fair
        if cols is None:
            table = self._table
            slots = self._active_slots(active)
            counted = slots[table.reference[slots] > 0]
            share = table.share[counted]
            cols = self._fair = (counted, share, table.reference[counted], bool((share == 0.0).any()))
        slots, share, reference, some_zero = cols
        if not slots.size:
            return None
        if some_zero:
            return 0.0
        return float((share * self._table.last_rate[slots] / reference).min())

    def _sample(self, t, active, running, plan, acc_remote, acc_bytes, acc_time, fairness, acc_remote_irregular=0.0) -> TimelineRow:
        cached = self.cache.cached_bytes()
        part = plan.allocation.partition
        lru = part.lru_datasets if part is not None and self.cache.name == "silod" else frozenset()
        cached_irregular = float(sum(v for n, v in cached.items() if n in lru))
        # Chunks cached and not yet read this epoch by some running reader, per dataset: a lone
        # epoch reader's count of them is its reader row's (SimJob.unread_cached, which
        # tests/test_sim_columns.py checks against its masks); readers sharing a dataset count
        # the union of their masks.
        effective = 0.0
        by_ds: dict[str, list[SimJob]] = {}
        for job in running:
            by_ds.setdefault(job.dataset.name, []).append(job)
        counts = self.cache.rows.counts
        for name, readers in by_ds.items():
            if len(readers) == 1 and readers[0].pacing is None:
                unread = int(counts[readers[0].crow, UNREAD])
            else:
                mask = self.cache.cached_mask(readers[0]) & ~readers[0].read_mask
                for job in readers[1:]:
                    mask |= self.cache.cached_mask(job) & ~job.read_mask
                unread = np.count_nonzero(mask)
            effective += float(unread) * self.datasets[name].chunk_size
        allocated = float(sum(plan.cache.values())) if plan.cache is not None else float(sum(cached.values()))
        return TimelineRow(
            time_s=t,
            running_jobs=len(running),
            queued_jobs=len(active) - len(running),
            gpus_used=sum(j.gpus for j in running),
            remote_io_used=acc_remote / acc_time if acc_time else 0.0,
            remote_io_limit=self.capacity.remote_io,
            cache_allocated=allocated,
            cache_cached=float(sum(cached.values())),
            cache_effective=effective,
            fairness_ratio=float("nan") if fairness is None else fairness,
            throughput=acc_bytes / acc_time if acc_time else 0.0,
            cache_cached_regular=float(sum(cached.values())) - cached_irregular,
            cache_cached_irregular=cached_irregular,
            remote_io_regular=(acc_remote - acc_remote_irregular) / acc_time if acc_time else 0.0,
            remote_io_irregular=acc_remote_irregular / acc_time if acc_time else 0.0,
        )


def _admission_rate(readers, admits: dict[str, float], link: float) -> float:
    """Bytes/s a cache domain can admit: its running readers' IO (None: every reader, the link)."""
    if readers is None:
        return link
    return min(link, sum(admits.get(r.job_id, 0.0) for r in readers))


def _spread(base: np.ndarray, want: np.ndarray, total_io: float) -> np.ndarray:
    """spread_spare_io on arrays: what `base` leaves of the link goes max-min to what `want`
    exceeds it by."""
    extra_want = np.maximum(want - base, 0.0)
    spare = total_io - float(base.sum())
    if spare <= 0 or not extra_want.any():
        return base
    return base + max_min(extra_want, spare)


#: A job shorter than this at its ideal rate is below the engine's time resolution (a step is
#: at least a microsecond; a job done in less would be charged more GPU time than it ran).
MIN_JOB_SECONDS = 1e-3


def _check_durations(trace: Trace, config: SimConfig, capacity: ClusterCapacity) -> None:
    """Every job can finish within the simulated horizon and lasts longer than a step can be
    short: a job of 1 GB at 1e-3 B/s would have the engine step through ten years of an idle
    cluster, and one of 1e-300 bytes would finish in less than its first step. With CPU modelled
    its fastest rate is also bounded by the most cores it can hold times its best per-core rate
    (a 1 B/s pipeline, or 1e-9 cores per node, ran for minutes towards a horizon it never
    reached)."""
    for j in trace.jobs:
        rate = j.ideal_throughput * config.gpu_speed
        cpu_bound = ""
        if capacity.manages_cpu and j.pipeline is not None:
            cores = (capacity.gpu_proportional_cpu(j.num_gpus) if capacity.cpu_allocation == "gpu-proportional"
                     else capacity.cpu_cap(j.num_gpus))
            per_core = max(j.pipeline.cpu_rate, j.pipeline.post_cpu_rate or 0.0)  # autocache can only speed it up
            if cores * per_core < rate:
                rate = cores * per_core
                cpu_bound = f" ({cores:.3g} cores at most x {per_core:.3g} B/s per core)"
        total = j.total_bytes(trace.dataset_sizes[j.dataset])
        seconds = total / rate
        if not MIN_JOB_SECONDS <= seconds <= config.max_sim_time_s:
            what = ("its cpu_rate and the cluster's CPU cores per node" if cpu_bound
                    else "its dataset_size, ideal_throughput and epochs")
            raise UserError(
                f"job {j.job_id} reads {total:.3g} bytes at an ideal {rate:.3g} B/s{cpu_bound}: {seconds:.3g} s, outside what "
                f"the simulator runs ({MIN_JOB_SECONDS:g} s to {config.max_sim_time_s:.3g} s, its horizon); check the units of "
                f"{what}"
            )


def _item_size(trace: Trace, job: TraceJob) -> float:
    """Bytes per item of a curriculum job's dataset: the trace's `item_size`, else the catalog's."""
    size = trace.item_sizes.get(job.dataset)
    if size is None and job.dataset in DATASETS:
        size = DATASETS[job.dataset].item_size
    if size is None:
        raise UserError(
            f"job {job.job_id} is a curriculum job on dataset {job.dataset!r}, whose item size is unknown: its pacing counts "
            f"items and iterations. Add an item_size column to the trace (bytes per item, e.g. 110KB) or use a catalog "
            f"dataset ({', '.join(sorted(DATASETS))})"
        )
    return size


__all__ = ["JobRecord", "SimConfig", "SimResult", "Simulator", "TimelineRow"]
