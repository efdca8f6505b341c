"""How one training job reads its dataset during a simulation step.

Each epoch reads every chunk once in a fresh uniformly random order. Loading and computation
are pipelined (SiloD §4): the loader fetches misses over the remote link while the GPU consumes,
so the job reads at

    rate = min(f*, b / m),   m = the miss ratio of what it is about to read.

With a CPU preprocessing stage (trace column cpu_rate) on k allocated cores the job cannot read
faster than it preprocesses: f* above is the job's ideal rate min(f*_GPU, k x cpu_rate)
(`SimJob.set_cores`; estimator/pipeline.py, source caching).

Because the order is a uniform random permutation, the next chunk is equally likely to be any
chunk the epoch has not read yet, so m is the uncached share of the chunks not yet read, taken
on the cache *as it is now* (`SimJob.unread_cached`, which the cache system keeps current as
other jobs admit and as LRU evicts). Remote bytes are charged at m as the job reads, so time,
rate and IO always agree; the chunks themselves are looked up (and admitted or evicted) when the
job starts reading each of them, at the time it does.

Where the cached set can move under the reader (LRU), it reads in short sub-steps of a few
chunks and re-reads m after each; elsewhere m only changes at the job's own epoch boundary and
when the engine tells it (a new step), and a sub-step runs to the epoch's end.

Curriculum jobs (estimator/access.py, SiloD §7.4) have no epochs: at iteration i every item
read is drawn uniformly from the g(i) easiest items, with replacement across batches. Items are
sorted by difficulty, so the eligible items are a prefix of the dataset: the first
e = g(i) x item_size / chunk_size chunks (the last one partly). A chunk's worth of reading is one
draw from that prefix, weighted by how much of each chunk is eligible, looked up when reading
reaches it; m = the uncached share of the eligible bytes, re-read after every draw while the
cache grows (every e/16 draws once it is full) and at every growth of the set. The iteration is the job's items read so far / batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from estimator.access import CurriculumPacing
from estimator.measured import FStarEstimate
from estimator.pipeline import RESOURCES
from estimator.model import loader_perf
from policies.types import JobView
from scheduler.sim.cache_systems import SimCacheSystem
from scheduler.sim.position import (BOUND, CONSUMED, DRIFT_M, DRIFT_T, EPOCH_READ, EPOCH_REMOTE, EXPECTED, HIT, LOOKED, N_ADVANCED,
                                    N_COLUMNS, POS, REMOTE, SYNCED, TAIL_MISS)
from scheduler.sim.reader_rows import MOVED, UNREAD
from scheduler.sim.types import SimDataset, StepResult
from traces.model import TraceJob




def _column(index: int, doc: str, kind: type = float) -> property:
    def get(job: SimJob) -> float:
        return kind(job.state[job.row, index])

    def set_(job: SimJob, value: float) -> None:
        job.state[job.row, index] = value

    return property(get, set_, doc=doc)


def _count(index: int, doc: str) -> property:
    def get(job: SimJob) -> int:
        return int(job.counts[job.crow, index])

    def set_(job: SimJob, value: int) -> None:
        job.counts[job.crow, index] = value

    return property(get, set_, doc=doc)


@dataclass(eq=False, slots=True)
class SimJob:
    trace: TraceJob
    dataset: SimDataset
    ideal: float  # bytes/s the job reads at when IO does not bind: min(f*, cores x cpu_rate)
    total_bytes: float
    rng: np.random.Generator
    gpu_ideal: float | None = None  # f*, bytes/s, after GPU-speed scaling (default: `ideal`)
    cores: float = math.inf  # CPU cores this round (inf: CPU not modelled)
    fstar: FStarEstimate | None = None  # the scheduler's f* when the declared one is not exact
    # The epoch's state the cache system reads and writes at every look-up: arrays of its own
    # until the cache system registers the job, views of its row there (reader_rows.py).
    perm: np.ndarray = field(init=False)  # the epoch's order of chunks
    read_mask: np.ndarray = field(init=False)  # chunks looked up in the current epoch (§6 bitset)
    counts: np.ndarray = field(init=False)  # row `crow`: (unread_cached, moved)
    crow: int = 0
    epoch: int = 0
    start_time: float | None = None
    finish_time: float | None = None
    running: bool = False
    epoch_hit_ratios: list[float] = field(default_factory=list)  # completed epochs
    job_id: str = field(init=False)
    pacing: CurriculumPacing | None = None  # curriculum jobs: their pacing function
    item_size: float = 0.0  # bytes per item (curriculum jobs count items and iterations)
    _level: int = -1  # pacing level floor(i / step) that _eligible and _growth_at are for
    _eligible: float = 0.0
    _growth_at: float = math.inf
    view: JobView | None = None  # what the policy last saw of it (the engine rebuilds it when it changes)
    regular: bool = field(init=False)  # reads as `epoch` (trace.access.regular, asked at every step)
    slot: int = -1  # its row in the engine's job table while active (job_table.py)
    #: The 2-D array holding its reading position (row `row`, the columns CONSUMED... above): a
    #: one-row array of its own until the engine's job table takes the row over (job_table.py),
    #: so that a step can advance every running job's position as columns.
    state: np.ndarray = field(init=False)
    row: int = 0

    consumed = _column(CONSUMED, "bytes read so far")
    pos = _column(POS, "chunks of the current epoch already read (fractional)")
    #: The miss ratio the epoch's last look-up was charged at: once every chunk is looked up,
    #: the rest of the last chunk is still read at it (the next epoch's ratio starts at its end).
    tail_miss = _column(TAIL_MISS, "the miss ratio the epoch's last look-up was charged at")
    remote_bytes = _column(REMOTE, "expected remote bytes so far (its misses, as it read them)")
    hit_bytes = _column(HIT, "bytes read as hits so far")
    epoch_read = _column(EPOCH_READ, "bytes read in the current epoch")
    epoch_remote = _column(EPOCH_REMOTE, "remote bytes in the current epoch")
    drift_m = _column(DRIFT_M, "decayed sum of the share of its unread chunks others moved, per step (engine._step_limit)")
    drift_t = _column(DRIFT_T, "decayed sum of those steps' seconds (0: never measured)")
    looked = _column(LOOKED, "chunks of the current epoch looked up (a prefix of perm)", int)
    #: Cached chunks expected among the unread ones: what the cache does to them is taken in
    #: (`unread_expected`), the job's own look-ups are not (they leave the expected share as it
    #: is; see `looked_up`), so a cache nobody else moves gives one miss ratio for the whole epoch.
    expected_cached = _column(EXPECTED, "cached chunks expected among the epoch's unread ones")
    synced = _column(SYNCED, "unread_cached when expected_cached last took in the cache's changes", int)

    unread_cached = _count(UNREAD, "cached chunks not looked up yet this epoch")
    moved = _count(MOVED, "of those counts, changes made by others' admissions and evictions since the engine reset it")

    @property
    def bound_s(self) -> dict[str, float]:
        """Seconds running, per resource that bound it (diagnosis.py), in RESOURCES order."""
        row = self.state[self.row]
        return {r: float(row[BOUND + i]) for i, r in enumerate(RESOURCES) if row[BOUND + i] > 0.0}

    def __post_init__(self) -> None:
        self.state = np.zeros((1, N_COLUMNS), dtype=float)
        self.state[0, TAIL_MISS] = 1.0
        if self.gpu_ideal is None:
            self.gpu_ideal = self.ideal
        self.job_id = self.trace.job_id
        self.regular = self.trace.access.regular
        self.perm = self.rng.permutation(self.dataset.n_chunks)
        self.read_mask = np.zeros(self.dataset.n_chunks, dtype=bool)
        self.counts = np.zeros((1, 2), dtype=np.int64)

    @property
    def gpus(self) -> int:
        return self.trace.num_gpus

    def set_cores(self, cores: float) -> None:
        """The job's cores for the round: its ideal rate becomes min(f*, cores x cpu_rate)."""
        self.cores = cores
        pipeline = self.trace.pipeline
        if pipeline is None or math.isinf(cores):
            self.ideal = self.gpu_ideal
        else:
            self.ideal = min(self.gpu_ideal, cores * pipeline.cpu_rate)

    def ideal_at(self, miss: float) -> float:
        """The rate IO does not bind, at miss ratio `miss`. Caching preprocessed data
        (autocaching: the dataset's expansion is not 1) a hit costs post_cpu_rate per core and a
        miss cpu_rate, so on k cores: min(f*, k / ((1-m)/p + m/r)) (estimator/pipeline.py);
        otherwise `ideal`. A job with a loader term (TraceJob.loader_miss_rate) reads that at
        1 / (1/ideal + m / loader_miss_rate) (estimator.loader_perf)."""
        pipeline = self.trace.pipeline
        if self.dataset.expansion == 1.0 or pipeline is None or not pipeline.autocaches or math.isinf(self.cores):
            ideal = self.ideal
        else:
            cost = (1.0 - miss) / pipeline.post_cpu_rate + miss / pipeline.cpu_rate
            ideal = min(self.gpu_ideal, self.cores / cost)
        loader = self.trace.loader_miss_rate
        if loader is None or miss <= 0.0:
            return ideal
        return float(loader_perf(ideal, 1.0 - miss, loader))  # the service's estimator, the same function

    @property
    def remaining(self) -> float:
        return max(self.total_bytes - self.consumed, 0.0)

    def start_epoch_view(self, cache: SimCacheSystem) -> None:
        """Called when the job becomes active: everything cached counts as unread."""
        self.unread_cached = self.synced = cache.visible_chunks(self)
        self.expected_cached = float(self.unread_cached)

    def unread_expected(self, volatile: bool = False) -> float:
        """Cached chunks expected among the epoch's unread ones, the cache's changes since the
        last look taken in.

        Why not `unread_cached` itself: the epoch reads a uniform random permutation, so which
        of the unread chunks the job's own look-ups turn out to hit is chance; charging the rest
        of the epoch at the ratio those hits leave makes each epoch's remote bytes a random walk
        around the truth (one job alone on a half-cached dataset: 7,900 s instead of 8,000 s).
        The expectation moves only when the cache changes what is cached among them.

        `volatile` (an LRU: SimCacheSystem.volatile_for): the count itself. There the job's own
        hits refresh what it read and the cache evicts the rest first, so which chunks it hit is
        not chance but what the future evictions depend on; an expectation that ignored them
        would drift from the cache (the five-job LRU reference case: 7% slow)."""
        if volatile:
            self.expected_cached = float(self.unread_cached)
            self.synced = self.unread_cached
            return self.expected_cached
        delta = self.unread_cached - self.synced
        if delta:
            left = self.dataset.n_chunks - self.looked
            self.expected_cached = min(max(self.expected_cached + delta, 0.0), float(max(left, 0)))
            self.synced = self.unread_cached
        return self.expected_cached

    def fetched(self, looked: int, hits: int) -> float:
        """Bytes fetched from remote storage for the `looked` chunks just looked up, `hits` of
        them cached: each miss is one whole chunk, counted when it is looked up. This is the link's
        traffic (StepResult.remote_bytes: the run's remote bytes and timeline), and it agrees
        with the cache: every chunk a cache holds was fetched once. A job that stops inside a
        fetched chunk is counted the whole chunk, as the cache holds all of it for the next
        reader. The job's own remote bytes and epoch hit ratios stay its expected misses, like
        its pace: at 128-256 chunks the chunks one epoch happens to hit scatter 2-3x more than
        item by item (tests/test_sim_curriculum.py, mixed-alluxio), while summed over readers
        expected charges miss the chunks fetched by -4..+5% seed to seed (two readers of a
        dataset that fits the cache; tests/test_simulator.py)."""
        return float(looked - hits) * self.dataset.chunk_size

    def looked_up(self, hits: int, before: int, after: int) -> None:
        """The job looked up chunks perm[before:after] itself, `hits` of them cached: its own
        hits are not a change of the cache, and the expected cached share of the rest holds."""
        self.synced -= hits
        left = self.dataset.n_chunks - before
        self.expected_cached = self.expected_cached * (self.dataset.n_chunks - after) / left if left > 0 else 0.0

    # ------------------------------------------------------------ curriculum
    @property
    def items(self) -> int:
        return max(1, int(round(self.dataset.size / self.item_size)))

    def iteration(self) -> float:
        # The nudge puts a position a rounding error short of a growth boundary on it, so the
        # eligible set and the next boundary (bytes_to_growth) always agree.
        return self.consumed / (self.pacing.batch * self.item_size) * (1.0 + 1e-12)

    def _pace(self) -> tuple[float, float]:
        """(e, bytes consumed at the next growth), recomputed only when the pacing level
        floor(i / step) changes: the eligible set is constant between growths."""
        level = math.floor(self.iteration() / self.pacing.step)
        if level != self._level:
            p = self.pacing
            g = int(p.eligible_items(level * p.step, self.items))
            self._eligible = min(g * self.item_size / self.dataset.chunk_size, float(self.dataset.n_chunks))
            whole = p.fraction(level * p.step) >= 1.0
            self._growth_at = math.inf if whole else (level + 1) * p.step * p.batch * self.item_size
            self._level = level
        return self._eligible, self._growth_at

    def eligible_chunks(self) -> float:
        """e: how many chunks the eligible items span now (the last one partly)."""
        return self._pace()[0]

    def bytes_to_growth(self) -> float:
        """Bytes the job reads before its eligible set grows next (inf once it is whole)."""
        return max(self._pace()[1] - self.consumed, 0.0)

    def curriculum_miss(self, mask: np.ndarray, e: float | None = None) -> float:
        """The uncached share of the eligible bytes (`mask`: the chunks cached for the job)."""
        e = self.eligible_chunks() if e is None else e
        whole = int(e)
        cached = float(np.count_nonzero(mask[:whole]))
        if whole < self.dataset.n_chunks and e > whole and mask[whole]:
            cached += e - whole
        return min(max(1.0 - cached / e, 0.0), 1.0)

    # ------------------------------------------------------------ both kinds
    def miss_ratio(self, cache: SimCacheSystem) -> float:
        """Miss ratio of what the job reads next: the uncached share of the chunks its epoch has
        not looked up yet; at the epoch's very end, the next epoch's (all chunks unread).
        Curriculum: the uncached share of the eligible items."""
        if self.pacing is not None:
            return self.curriculum_miss(cache.cached_mask(self))
        left = self.dataset.n_chunks - self.looked
        if left <= 0:
            if self.pos < self.dataset.n_chunks - 1e-9:
                return self.tail_miss  # inside the last chunk, already looked up
            return 1.0 - cache.visible_chunks(self) / self.dataset.n_chunks
        return min(max(1.0 - self.unread_expected(cache.volatile_for(self)) / left, 0.0), 1.0)

    def hit_ratio_now(self, cache: SimCacheSystem) -> float:
        return 1.0 - self.miss_ratio(cache)

    def new_epoch(self, cache: SimCacheSystem) -> None:
        """Epoch readers: a new permutation. Curriculum jobs: a pass-equivalent (a dataset's
        worth of bytes) ends, and its hit ratio is recorded like an epoch's."""
        if self.epoch_read > 0:
            self.epoch_hit_ratios.append(1.0 - self.epoch_remote / self.epoch_read)
        self.epoch += 1
        self.pos = 0.0
        self.looked = 0
        self.epoch_remote = self.epoch_read = 0.0
        if self.pacing is not None:
            return  # `pos` and `looked` count draws; there is no order to shuffle
        self.perm[:] = self.rng.permutation(self.dataset.n_chunks)
        self.read_mask[:] = False
        self.unread_cached = self.synced = cache.visible_chunks(self)
        self.expected_cached = float(self.unread_cached)

    def rate(self, io_cap: float, cache: SimCacheSystem, miss: float | None = None) -> float:
        """Eq. 4 with the measured miss ratio: min(f*, b / m)."""
        m = self.miss_ratio(cache) if miss is None else miss
        ideal = self.ideal_at(m)
        if m <= 1e-12:
            return ideal
        return min(ideal, io_cap / m) if io_cap > 0 else 0.0

    def seconds_to_event(self, io_cap: float, cache: SimCacheSystem, epoch_matters: bool = True, miss: float | None = None) -> float:
        """Time until the job finishes or, if `epoch_matters`, reaches an epoch boundary where
        its miss ratio (so its demand on the link) will change, at its current rate."""
        m = self.miss_ratio(cache) if miss is None else miss
        r = self.rate(io_cap, cache, m)
        if r <= 0:
            return math.inf
        left = self.total_bytes - self.consumed
        if epoch_matters and self.pacing is not None:
            left = min(left, self.bytes_to_growth())  # the eligible set grows: m jumps
        elif epoch_matters:
            k = self.dataset.n_chunks
            # What the next epoch will see: the cache now plus what this epoch's misses admit.
            misses_left = (k - self.looked) - self.unread_cached
            next_miss = 1.0 - (cache.visible_chunks(self) + min(cache.room(self), misses_left)) / k
            if abs(next_miss - m) > DEMAND_CHANGE:
                left = min(left, (k - self.pos) * self.dataset.chunk_size)
        return max(left, 0.0) / r


#: A change of miss ratio at an epoch boundary below this does not re-divide the link.
DEMAND_CHANGE = 0.05


#: LRU: the share of an epoch read between two looks at the miss ratio (the cached set moves
#: at every miss, slowly against an epoch).
VOLATILE_SUBSTEP = 1 / 16


def advance(job: SimJob, now: float, dt: float, io_cap: float, cache: SimCacheSystem, substeps: int | None = None) -> StepResult:
    """Let `job` read for `dt` seconds from `now` with remote bandwidth `io_cap` (bytes/s);
    with `substeps`, stop after that many looks at the miss ratio (to interleave jobs).

    An epoch reader of a cache system with a compiled advance (Alluxio's LRU: lru_kernel.py)
    takes that, which makes the same steps as `python_advance`."""
    compiled = cache.compiled_advance
    if compiled is not None and job.pacing is None and job.dataset.expansion == 1.0 and job.trace.loader_miss_rate is None:
        k = job.dataset.n_chunks
        read, remote, finished_at, elapsed = compiled(job, now, dt, io_cap, substeps, max(1, int(k * VOLATILE_SUBSTEP))).tolist()
        return StepResult(read, remote, None if math.isnan(finished_at) else finished_at, elapsed)
    return python_advance(job, now, dt, io_cap, cache, substeps)


def python_advance(job: SimJob, now: float, dt: float, io_cap: float, cache: SimCacheSystem, substeps: int | None = None) -> StepResult:
    """`advance`, in Python: every cache system, every kind of reader."""
    result = StepResult()
    s = job.dataset.chunk_size
    k = job.dataset.n_chunks
    ideal = job.ideal
    total = job.total_bytes
    # Autocaching (the CPU cost per byte) or the loader's miss term: the rate IO allows follows m.
    preprocessed = job.dataset.expansion != 1.0 or job.trace.loader_miss_rate is not None
    curriculum = job.pacing is not None
    volatile = cache.volatile_for(job)
    substep = max(1, int(k * VOLATILE_SUBSTEP)) if volatile else k
    # The position in locals (its row is a numpy row: job_table.py), written back before
    # anything that reads it from the job (new_epoch, the curriculum's pacing) and at the end.
    row = job.state[job.row]
    consumed, pos, remote, hit, epoch_read, epoch_remote, tail_miss = row[:N_ADVANCED].tolist()
    looked = int(row[LOOKED])  # written through: unread_expected reads it from the row

    def store() -> None:
        row[:N_ADVANCED] = (consumed, pos, remote, hit, epoch_read, epoch_remote, tail_miss)

    t = 0.0
    while dt - t > 1e-9 * max(dt, 1.0) and total > consumed:
        if substeps is not None:
            if substeps <= 0:
                break
            substeps -= 1
        if pos >= k - 1e-9:
            store()
            job.new_epoch(cache)
            pos = epoch_read = epoch_remote = 0.0
            looked = 0
        p = pos
        if curriculum:
            row[CONSUMED] = consumed
            e = job.eligible_chunks()
            m = job.curriculum_miss(cache.cached_mask(job), e)
            if m > 0.0 and cache.room(job) > 0:
                # While the cache grows, a draw's misses are admitted as it reads them: on
                # average m falls by m/e over the draw, so it is read at its midpoint value;
                # and m is re-read after every draw (each admission moves it by up to 1/e).
                m *= 1.0 - 0.5 / max(e, 1.0)
                draws = 1
            else:
                # Every eligible item cached, or a full cache (misses replace cached eligible
                # items under LRU, are not admitted under uniform): m holds until the set grows
                # or another reader moves the cache; re-read it every e/16 draws.
                draws = max(1, int(e * VOLATILE_SUBSTEP))
            reach = min(math.floor(p + 1e-9) + draws, p + job.bytes_to_growth() / s)
        else:
            left = k - looked
            # left == 0: a step ended inside the last chunk, looked up (and charged) before.
            m = 1.0 - job.unread_expected(volatile) / left if left > 0 else tail_miss
            reach = math.floor(p + 1e-9) + substep
        m = 0.0 if m < 1e-12 else (1.0 if m > 1.0 else m)
        if not curriculum:
            tail_miss = m
        if preprocessed:
            ideal = job.ideal_at(m)
        rate = ideal if m == 0.0 else (min(ideal, io_cap / m) if io_cap > 0 else 0.0)
        if rate <= 0:
            t = dt
            break  # every read left misses and there is no remote bandwidth: stalled
        x_need = p + (total - consumed) / s
        x = min(p + rate * (dt - t) / s, x_need, float(k), reach)
        if x <= p:
            t = dt  # what is left of the step moves the position by less than float resolution
            break
        # Chunks are looked up when reading reaches them: those started in [p, x).
        finishing = x >= x_need - 1e-9
        last = min(k, math.ceil(x - (1e-12 if finishing else 1e-9)))
        done = (x - p) * s
        missed = m * done
        fetched = missed  # curriculum reads draw with replacement: their expected misses
        if last > looked:
            if curriculum:
                draws = np.minimum((job.rng.random(last - looked) * e).astype(np.int64), k - 1)
                cache.access(job, draws)
                job.read_mask[draws] = False  # drawn with replacement: nothing is "read this epoch"
            else:
                job.unread_expected(volatile)
                n_hits = cache.access(job, job.perm[looked:last])
                job.looked_up(n_hits, looked, last)
                fetched = job.fetched(last - looked, n_hits)
            looked = last
            row[LOOKED] = last
        elif not curriculum:
            fetched = 0.0  # inside a chunk looked up (and counted) before
        consumed += done
        remote += missed
        hit += done - missed
        epoch_read += done
        epoch_remote += missed
        result.bytes_read += done
        result.remote_bytes += fetched
        pos = x
        t += done / rate
        if finishing or total - consumed <= 1e-9 * total:
            consumed = total
            store()
            if pos >= k - 1e-6:
                job.new_epoch(cache)  # records the last epoch's hit ratio
            result.finished_at = now + t
            result.elapsed = t
            return result
    store()
    result.elapsed = t
    return result
