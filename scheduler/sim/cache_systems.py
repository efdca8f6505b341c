"""Cache systems of the simulator: SiloD's uniform cache and the paper's three baselines.

State is kept per dataset chunk (a chunk is 1/resolution of a dataset; with resolution equal to
the item count it is item level). A job *looks up* each chunk of its epoch when it starts
reading it (`access`); the cache system answers hit or miss, admits what it decides to admit
and evicts what it must, at that moment.

Every reader keeps a count of the chunks that are cached and that it has not read yet in its
epoch (`SimJob.unread_cached`): its expected hit ratio on the rest of the epoch, because the
epoch's order is a uniform random permutation. Whatever changes the cached set — another job
admitting, an LRU eviction, a shrinking allocation — updates the counts of the readers it
concerns at once (`_changed`), so the reader always reads at the ratio the cache holds now.

- silod:   uniform caching per dataset with the policy's allocation; admit on miss while the
           dataset is under its allocation, never evict otherwise; random eviction on shrink.
           Datasets that only irregular jobs read (the irregular partition, §6) are LRU caches
           instead, each within its allocation: every miss is admitted and the least recently
           used chunks of that dataset are evicted at admission (and on shrink).
- alluxio: one cluster-wide LRU cache, read-through: every miss is admitted and the least
           recently used chunks are evicted at admission, so it never holds more than its size.
- coordl:  each running job caches uniformly into a private static share, its GPUs' share of
           the cluster's cache; nothing is shared across jobs and a job's cache is lost when it
           stops running.
- quiver:  whole datasets only, ranked by benefit/cost (data rate gained per byte) over every
           started, unfinished job's dataset (running or paused), with an optional profile error per dataset
           (0 by default) redrawn when it is re-profiled every 12 h; a dataset that does not fit
           the space left gets nothing.
See docs/simulator-accuracy.md for each baseline's modelling choices and their sources.

How they run: silod, quiver and coordl are DomainCaches, whose uniform domains keep their chunks
in one ChunkPool so that a step's look-ups run compiled (uniform_kernel.py); alluxio's LRU is
arrays that lru_kernel.py works on. SimCacheSystem.look_up_in_turn is the Python loop both
compiled loops are tested against (tests/test_sim_compiled.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
import math
from operator import attrgetter

import numpy as np

from estimator.errors import UserError
from scheduler.sim.lru_kernel import EPOCH, FINISHED_EPOCH, lru_access, lru_advance, lru_clock, lru_turns
from scheduler.sim.reader_rows import MOVED, UNREAD
from scheduler.sim.reader_rows import ReaderGroups, ReaderRows
from scheduler.sim.types import CacheReader, TurnAdvance
from scheduler.sim.types import SimDataset, StepResult
from scheduler.sim.uniform_kernel import NO_DOMAIN, PER_JOB, PYTHON_DOMAIN, uniform_turns

CACHE_SYSTEMS = ("silod", "alluxio", "coordl", "quiver")
_NO_CHUNKS = np.zeros(0, dtype=np.int64)
_NO_CHUNKS.flags.writeable = False


@dataclass(eq=False, slots=True)
class CacheDomain:
    """One dataset's cached chunks within a limit (an allocation); subclasses say what to
    admit and what to evict."""

    dataset: SimDataset
    cached: np.ndarray | None = None  # None: a zeroed array of its own (ChunkPool.domain gives a region instead)
    count: int = 0
    limit_chunks: int = 0

    def __post_init__(self) -> None:
        if self.cached is None:
            self.cached = np.zeros(self.dataset.n_chunks, dtype=bool)

    def _limit(self, nbytes: float) -> None:
        # A partial chunk cannot be cached: round down (resolution controls this error). On
        # Python floats: a CoorDL job sets a new domain's limit at every Gavel round it resumes.
        q = nbytes / self.dataset.cached_chunk_bytes + 1e-9
        n = self.dataset.n_chunks
        self.limit_chunks = n if not q < n else math.floor(q)

    def take_over(self, other: CacheDomain) -> None:
        """Keep what `other` held (a dataset switching between uniform and LRU caching)."""
        self.cached[:] = other.cached
        self.count, self.limit_chunks = other.count, other.limit_chunks

    @property
    def filling(self) -> bool:
        return self.count < self.limit_chunks

    @property
    def cached_bytes(self) -> float:
        return self.count * self.dataset.cached_chunk_bytes


@dataclass(eq=False, slots=True)
class UniformDomain(CacheDomain):
    """A uniform cache over one dataset's chunks with a limit (SiloD §2.2)."""

    slot: int = -1  # its region in its cache system's ChunkPool (-1: an array of its own)

    def set_limit(self, nbytes: float, rng: np.random.Generator) -> np.ndarray:
        """Set the allocation; returns the chunks evicted to fit it (random, as §2.2 says)."""
        self._limit(nbytes)
        excess = self.count - self.limit_chunks
        if excess <= 0:
            return _NO_CHUNKS
        victims = rng.choice(self.cached.nonzero()[0], size=excess, replace=False)
        self.cached[victims] = False
        self.count -= excess
        return victims

    def admit(self, missed: np.ndarray) -> np.ndarray:
        """Admit missed chunks, in order, while there is room; returns the ones admitted.
        `missed` are distinct chunks that are not cached: one look-up's misses (an epoch's
        chunks are a permutation; a curriculum job's draws repeat only where nothing can be
        admitted, reader.advance)."""
        room = self.limit_chunks - self.count
        if room <= 0 or missed.size == 0:
            return missed[:0]
        fresh = missed[:room] if missed.size > room else missed
        self.cached[fresh] = True
        self.count += int(fresh.size)
        return fresh


@dataclass(eq=False, slots=True)
class LruDomain(CacheDomain):
    """An LRU cache over one dataset's chunks with a limit (the irregular partition's datasets,
    as the mount's `--cache-mode lru` keeps them)."""

    order: OrderedDict = field(default_factory=OrderedDict)  # chunk -> None, least recent first

    def take_over(self, other: CacheDomain) -> None:
        CacheDomain.take_over(self, other)  # slots dataclass: zero-argument super() does not work
        for c in other.cached.nonzero()[0].tolist():  # recency unknown: chunk order
            self.order[c] = None

    def set_limit(self, nbytes: float, rng: np.random.Generator) -> np.ndarray:
        """Set the allocation; returns the chunks evicted to fit it (least recently used)."""
        self._limit(nbytes)
        return self._evict()

    def _evict(self) -> np.ndarray:
        victims = []
        while self.count > self.limit_chunks:
            c, _ = self.order.popitem(last=False)
            self.cached[c] = False
            self.count -= 1
            victims.append(c)
        return np.array(victims, dtype=np.int64)

    def touch(self, chunk: int) -> None:
        self.order.move_to_end(chunk)

    def admit_one(self, chunk: int) -> np.ndarray:
        """Admit a missed chunk (if the allocation holds one at all); returns the victims."""
        if self.limit_chunks <= 0 or self.cached[chunk]:
            return np.zeros(0, dtype=np.int64)
        self.cached[chunk] = True
        self.count += 1
        self.order[chunk] = None
        return self._evict()


class ChunkPool:
    """The uniform domains' cached chunks as regions of one array, which the compiled look-ups
    (uniform_kernel.py) index by slot: a domain's region starts at `offset[slot]`; `count` and
    `limit` hold its counts while a step's compiled loop runs (DomainCache.look_up_in_turn).

    A domain takes a slot when it is made (`domain`) and gives it back when its cache system
    drops it (`release`); a freed slot goes to the next domain of the same chunk count, zeroed.
    Its region stays as it was until then, so a dropped domain's chunks can still be read (the
    evictions it causes). When the array grows, every live domain's `cached` follows it."""

    def __init__(self) -> None:
        self.cached = np.zeros(1024, dtype=bool)
        self.offset = np.zeros(16, dtype=np.int64)
        self.count = np.zeros(16, dtype=np.int64)
        self.limit = np.zeros(16, dtype=np.int64)
        self.owners: list[UniformDomain | None] = []  # per slot, the live domain holding it
        self._width: list[int] = []  # per slot, its chunks
        self._free: dict[int, list[int]] = {}  # chunks -> free slots of that many
        self._end = 0  # elements of `cached` given out

    def domain(self, dataset: SimDataset) -> UniformDomain:
        """A new, empty uniform domain of `dataset`, on a slot of its own."""
        n = dataset.n_chunks
        free = self._free.get(n)
        if free:
            slot = free.pop()
        else:
            slot = len(self._width)
            if self._end + n > len(self.cached):
                grown = np.zeros(max(2 * len(self.cached), self._end + n), dtype=bool)
                grown[:self._end] = self.cached[:self._end]
                self.cached = grown
                for s, dom in enumerate(self.owners):
                    if dom is not None:
                        dom.cached = grown[self.offset[s]:self.offset[s] + self._width[s]]
            if slot >= len(self.offset):
                for name in ("offset", "count", "limit"):
                    old = getattr(self, name)
                    setattr(self, name, np.concatenate([old, np.zeros_like(old)]))
            self.offset[slot] = self._end
            self._end += n
            self._width.append(n)
            self.owners.append(None)
        region = self.cached[self.offset[slot]:self.offset[slot] + n]
        region[:] = False
        dom = UniformDomain(dataset, region, 0, 0, slot)
        self.owners[slot] = dom
        return dom

    def release(self, dom: UniformDomain) -> None:
        """`dom` was dropped: its slot goes to a later domain."""
        if self.owners[dom.slot] is not dom:
            raise RuntimeError(f"slot {dom.slot} of the chunk pool is not held by this domain of {dom.dataset.name!r}")
        self.owners[dom.slot] = None
        self._free.setdefault(self._width[dom.slot], []).append(dom.slot)


class SimCacheSystem(ABC):
    name: str
    #: Whether the cached set changes under a reader as other chunks are read (LRU evicts at
    #: every miss); the engine then keeps steps short enough for the change to be followed.
    volatile = False
    #: Changes whenever volatile_for() may answer differently for some job (the engine keeps
    #: per-job columns between steps while it stays the same).
    layout_version = 0
    #: Chunks per dataset as a multiple of the engine's resolution (`--resolution`).
    resolution_factor = 1
    #: reader.advance compiled for this cache system's epoch readers (None: the Python one).
    compiled_advance: Callable[..., np.ndarray] | None = None

    def __init__(self, capacity: float, total_gpus: int, seed: int):
        self.capacity = capacity
        self.total_gpus = total_gpus
        self.rng = np.random.default_rng(seed)
        self.readers: dict[str, list[CacheReader]] = {}  # domain key -> active jobs reading it
        self.rows = ReaderRows()  # the registered readers' epoch state
        self.evicted_bytes = 0.0  # bytes evicted to make room or on shrink (cache churn)

    # ----------------------------------------------------------------- readers
    def key(self, job: CacheReader) -> str:
        """The cache domain a job reads through (its dataset; CoorDL: the job itself)."""
        return job.dataset.name

    def register(self, job: CacheReader) -> None:
        self.rows.add(job)
        self.readers.setdefault(self.key(job), []).append(job)

    def unregister(self, job: CacheReader) -> None:
        key = self.key(job)
        group = self.readers.get(key)
        if group is not None and job in group:
            group.remove(job)
            self.rows.remove(job)
            if not group:
                # Only keys with active readers stay: Quiver ranks every one at every plan, and
                # a Fig. 12 trace's 1,400 datasets made that a pass over mostly empty groups.
                del self.readers[key]

    def _changed(self, key: str, chunks: np.ndarray, delta: int) -> None:
        """`chunks` of domain `key` became cached (+1) or uncached (-1): readers that have not
        read them yet in their epoch see a different rest-of-epoch hit ratio."""
        if chunks.size == 0:
            return
        counts = self.rows.counts
        if chunks.size == 1:  # the common case (_access_uniform), on scalars
            c = int(chunks[0])
            for job in self.readers.get(key, ()):
                if not job.read_mask[c]:
                    row = job.crow
                    counts[row, UNREAD] += delta
                    counts[row, MOVED] += 1
            return
        for job in self.readers.get(key, ()):
            moved = int(np.count_nonzero(~job.read_mask[chunks]))
            counts[job.crow, UNREAD] += delta * moved
            counts[job.crow, MOVED] += moved

    def look_up_in_turn(self, jobs: Sequence[CacheReader], crows: np.ndarray, turns: np.ndarray, simple: np.ndarray,
                        unread: np.ndarray, lo: np.ndarray, hi: np.ndarray, fresh: bool, hits: np.ndarray,
                        per_job: Callable[[int], None], step: TurnAdvance | None = None) -> None:
        """A step's look-ups, job by job in order, as the per-job loop makes them (the engine's
        column advance). `turns`: the positions in `jobs` (ascending) of the jobs that look
        chunks `perm[lo:hi]` up if `simple`, else are advanced by `per_job(i)`. A job whose count
        of cached unread chunks is no longer `unread` (its rows `crows` in `self.rows`) when its
        turn comes, because an earlier job's admissions or evictions moved it, is advanced by
        `per_job` instead, at its turn: among the turns, and among the jobs between them once
        the cache may have changed (from the start unless `fresh`). `hits[i]` gets the hits of
        each look-up made. `step`: what a compiled per-job advance needs (AlluxioLRUCache; the
        others call `per_job`)."""
        unread_col = self.rows.counts[:, UNREAD]
        crow_l, simple_l, unread_l, lo_l, hi_l = crows.tolist(), simple.tolist(), unread.tolist(), lo.tolist(), hi.tolist()
        changed = not fresh
        prev = 0
        n = len(jobs)
        for q in (*turns.tolist(), n):
            if changed:
                for i in range(prev, q):
                    if unread_col[crow_l[i]] != unread_l[i]:
                        per_job(i)
            if q == n:
                break
            prev = q + 1
            changed = True
            if not simple_l[q] or unread_col[crow_l[q]] != unread_l[q]:
                per_job(q)
                continue
            job = jobs[q]
            hits[q] = self.access(job, job.perm[lo_l[q]:hi_l[q]])

    # ----------------------------------------------------------------- interface
    def apply_autocache(self, autocache: Mapping[str, float], datasets: Mapping[str, SimDataset]) -> None:
        """The round's autocaching choice (dataset -> expansion; absent: source bytes). Only a
        cache that takes the policy's allocation (silod) can hold preprocessed data."""
        if autocache:
            raise ValueError(f"the {self.name} cache system caches source bytes only; autocaching needs a storage-managing policy")

    @abstractmethod
    def apply_plan(self, cache_alloc: Mapping[str, float] | None, running: Sequence[CacheReader], datasets: Mapping[str, SimDataset],
                   now: float = 0.0, lru_datasets: frozenset[str] = frozenset()) -> None:
        """Take the round's cache allocation (None for unmanaged baselines) and running jobs;
        `lru_datasets` are the irregular partition's (only systems that take allocations use it)."""

    @abstractmethod
    def cached_mask(self, job: CacheReader) -> np.ndarray:
        """Which chunks of `job`'s dataset are cached for it right now (read-only view)."""

    @abstractmethod
    def access(self, job: CacheReader, chunks: np.ndarray) -> int:
        """`job` starts reading `chunks` (in this order, now): mark them read in its epoch,
        admit and evict as the cache system does, and return how many were hits."""

    @abstractmethod
    def cached_bytes(self) -> dict[str, float]:
        """Bytes cached per dataset name (only non-zero entries)."""

    def volatile_for(self, job: CacheReader) -> bool:
        """Whether the chunks cached for `job` move while it reads (LRU evictions)."""
        return self.volatile

    def visible_chunks(self, job: CacheReader) -> int:
        """Chunks of `job`'s dataset cached for it now (the start of an epoch sees them all)."""
        return int(np.count_nonzero(self.cached_mask(job)))

    def room(self, job: CacheReader) -> int:
        """Chunks `job`'s misses may still add to what it sees cached (0 where unknown)."""
        return 0

    # The engine asks these of every running job at every step: one call for all of them.
    def visible_and_room(self, jobs: Sequence[CacheReader], crows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """visible_chunks and room of every job in `jobs`, as two float columns (`crows`: their
        reader rows, where the caller has them)."""
        n = len(jobs)
        return (np.fromiter((self.visible_chunks(j) for j in jobs), dtype=float, count=n),
                np.fromiter((self.room(j) for j in jobs), dtype=float, count=n))

    def moves_under_all(self, jobs: Sequence[CacheReader]) -> np.ndarray:
        """moves_under of every job in `jobs` (bool column)."""
        return np.fromiter((self.moves_under(j) for j in jobs), dtype=bool, count=len(jobs))

    def evicting_all(self, jobs: Sequence[CacheReader], crows: np.ndarray | None = None) -> np.ndarray:
        """evicting of every job in `jobs` (bool column; `crows` as for visible_and_room)."""
        return np.fromiter((self.evicting(j) for j in jobs), dtype=bool, count=len(jobs))

    def jobs_stopped(self, jobs: Sequence[CacheReader]) -> None:
        """`jobs` finished or were descheduled (one call a round: a Gavel round pauses ~60)."""

    def volatile_bytes(self) -> list[tuple[float, Sequence[CacheReader] | None]]:
        """Bytes whose cached state moves under the readers as others read: each LRU that
        evicts at every miss, or domain that several readers share while it fills, with the
        readers whose misses are admitted into it (None: a cache every reader admits into,
        bounded only by the link). An LRU of C bytes admitting at b bytes/s turns its contents
        over in about C/b seconds, so a reader's hit ratio moves by about b x dt / C in dt; b
        is at most the IO of the readers that admit into it."""
        return []

    def free_before_eviction(self) -> list[tuple[float, Sequence[CacheReader] | None]]:
        """Bytes each LRU can still admit before it starts evicting, with the readers that
        admit into it (None: every reader). Until then others' reads move nobody's cached
        chunks out; from then on, at every miss."""
        return []

    def moves_under(self, job: CacheReader) -> bool:
        """Whether other reads can change which of `job`'s unread chunks are cached while it
        reads: an LRU evicting at admission, or a dataset it shares with other active readers
        while it fills (their admissions are its hits)."""
        return self.volatile_for(job)

    def evicting(self, job: CacheReader) -> bool:
        """Whether `job`'s chunks sit in an LRU that is full: every miss admitted into it now
        evicts, so others' reads can move its unread chunks out at any time."""
        return False


def _access_uniform(job: CacheReader, dom: UniformDomain | None, chunks: np.ndarray) -> tuple[int, np.ndarray]:
    """Look `chunks` up in a uniform domain (mark them read, count the hits) and admit the
    misses while it has room; returns (hits, chunks admitted)."""
    if chunks.size == 1:
        # One chunk (55-87% of the look-ups in a Fig. 12 run): the same steps on scalars, without
        # numpy's per-call cost of fancy indexing (3 us -> under 1).
        c = int(chunks[0])
        job.read_mask[c] = True
        if dom is None:
            return 0, chunks[:0]
        if dom.cached[c]:
            job.counts[job.crow, UNREAD] -= 1
            return 1, chunks[:0]
        if dom.count < dom.limit_chunks:
            dom.cached[c] = True
            dom.count += 1
            return 0, chunks
        return 0, chunks[:0]
    if dom is None:
        job.read_mask[chunks] = True
        return 0, chunks[:0]
    hits = dom.cached[chunks]
    job.read_mask[chunks] = True
    n_hits = int(np.count_nonzero(hits))
    job.counts[job.crow, UNREAD] -= n_hits
    return n_hits, (dom.admit(chunks[~hits]) if dom.filling else chunks[:0])


class DomainCache(SimCacheSystem):
    """A cache system of domains by key (`key`: SiloD's and Quiver's per dataset, CoorDL's per
    job), the uniform ones in a ChunkPool, with a step's look-ups compiled (uniform_kernel.py).

    Each reader row (reader_rows.py) holds the code of its key's domain: its slot, NO_DOMAIN or
    PYTHON_DOMAIN (an LRU domain, which the loop leaves to `access`). Domains come and go
    through `_set_domain` and `_drop_domain`, which keep those codes and the pool in step
    (CoorDL's pauses and resumes, a round's worth at a time, set their jobs' codes on columns)."""

    #: Whether a domain's admissions move other readers' counts (False: private domains, CoorDL).
    shared = True

    def __init__(self, capacity: float, total_gpus: int, seed: int):
        super().__init__(capacity, total_gpus, seed)
        self.domains: dict[str, CacheDomain] = {}
        self.pool = ChunkPool()
        self._groups = ReaderGroups()  # per reader row, its domain's code
        self._readers: tuple[np.ndarray, np.ndarray] | None = None  # each slot's readers' rows (CSR; None: stale)

    @staticmethod
    def _code(dom: CacheDomain | None) -> int:
        if dom is None:
            return NO_DOMAIN
        return dom.slot if isinstance(dom, UniformDomain) else PYTHON_DOMAIN

    def register(self, job):
        super().register(job)
        self._groups.hold(job.crow, self._code(self.domains.get(self.key(job))))
        self._readers = None

    def unregister(self, job):
        if job in self.readers.get(self.key(job), ()):
            self._groups.held[job.crow] = False  # before the row leaves with the job
            self._readers = None
        super().unregister(job)

    def _set_domain(self, key: str, dom: CacheDomain) -> None:
        """`dom` is `key`'s domain from now on (a uniform domain it replaces gives its slot back)."""
        old = self.domains.get(key)
        self.domains[key] = dom
        if old is not None and old is not dom and type(old) is UniformDomain:
            self.pool.release(old)
        self._point_readers(key, self._code(dom))

    def _drop_domain(self, key: str) -> CacheDomain | None:
        """`key` has no domain any more; returns the one it had (its chunks still readable)."""
        dom = self.domains.pop(key, None)
        if dom is not None:
            if type(dom) is UniformDomain:
                self.pool.release(dom)
            self._point_readers(key, NO_DOMAIN)
        return dom

    def _point_readers(self, key: str, code: int) -> None:
        codes = self._groups.code
        for job in self.readers.get(key, ()):
            codes[job.crow] = code
        if self.shared:
            self._readers = None

    def _readers_csr(self) -> tuple[np.ndarray, np.ndarray]:
        """Each slot's readers' rows, as uniform_access moves their counts (rebuilt on columns
        once a reader or domain came or went); none where domains are private."""
        if not self.shared:
            if self._readers is None or len(self._readers[0]) <= len(self.pool.owners):
                self._readers = (np.zeros(len(self.pool.owners) + 1, dtype=np.int64), np.zeros(0, dtype=np.int64))
            return self._readers
        if self._readers is None:
            self._readers = self._groups.csr(len(self.pool.owners))
        return self._readers

    def look_up_in_turn(self, jobs, crows, turns, simple, unread, lo, hi, fresh, hits, per_job, step=None):
        # SimCacheSystem.look_up_in_turn's loop, compiled; it returns to Python for `per_job`
        # and for look-ups in LRU domains. The domains' counts move into the pool's columns for
        # the loop and back into the domains whenever Python takes over.
        # Only the look-ups' domains are moved in; the per-job advance and `access` of a job read
        # and change only the job's own domain (reader.py), so only that one moves out and back
        # around them.
        n = len(jobs)
        if n == 0:
            return
        pool, rows, owners = self.pool, self.rows, self.pool.owners
        dom_of = self._groups.code[crows]
        looking = dom_of[turns[simple[turns]]]
        moved_in = np.zeros(len(owners), dtype=bool)
        moved_in[looking[looking >= 0]] = True
        used = moved_in.nonzero()[0]
        for s in used.tolist():
            dom = owners[s]
            pool.count[s], pool.limit[s] = dom.count, dom.limit_chunks
        before = pool.count[used]
        r_ptr, r_rows = self._readers_csr()
        turns = np.concatenate((turns, (n,)))  # (np.append: a Python wrapper around it)
        at, prev, changed = 0, 0, not fresh
        while True:
            i, at, prev, need = uniform_turns(turns, at, prev, changed, simple, unread, crows, lo, hi, dom_of, hits, rows.reads,
                                              rows.counts, rows.perms, pool.cached, pool.offset, pool.count, pool.limit, r_ptr, r_rows)
            if i < 0:
                break
            changed = True
            d = int(dom_of[i])
            mine = owners[d] if d >= 0 and moved_in[d] else None
            if mine is not None:
                mine.count = int(pool.count[d])
            if need == PER_JOB:
                per_job(i)
            else:
                job = jobs[i]
                hits[i] = self.access(job, job.perm[lo[i]:hi[i]])
            if mine is not None:
                pool.count[d] = mine.count
        for s in used[pool.count[used] != before].tolist():
            owners[s].count = int(pool.count[s])


class SiloDCache(DomainCache):
    name = "silod"

    def __init__(self, capacity: float, total_gpus: int, seed: int):
        super().__init__(capacity, total_gpus, seed)
        self._lru_names: list[str] = []  # the LRU domains' datasets as of layout `_lru_version`
        self._lru_version = -1

    @property
    def volatile(self) -> bool:  # type: ignore[override]
        """LRU datasets read by several jobs: their reads must interleave in time."""
        if self._lru_version != self.layout_version:  # which domains are LRUs changes only with the layout
            self._lru_names = [n for n, d in self.domains.items() if isinstance(d, LruDomain)]
            self._lru_version = self.layout_version
        readers = self.readers
        return any(len(readers.get(n, ())) > 1 for n in self._lru_names)

    def volatile_for(self, job):
        return isinstance(self.domains.get(job.dataset.name), LruDomain)

    def _domain(self, dataset: SimDataset, lru: bool) -> CacheDomain:
        kind = LruDomain if lru else UniformDomain
        dom = self.domains.get(dataset.name)
        if type(dom) is not kind:
            fresh = LruDomain(dataset) if lru else self.pool.domain(dataset)
            self.layout_version += 1
            if dom is not None:
                fresh.take_over(dom)
            self._set_domain(dataset.name, fresh)
            dom = fresh
        return dom

    def apply_autocache(self, autocache, datasets):
        """A dataset whose mode changes loses what it cached (source bytes are not its
        preprocessed data, nor the other way round); its next allocation is counted in chunks
        of the new size (apply_plan)."""
        for name, ds in datasets.items():
            e = float(autocache.get(name, 1.0))
            if e == ds.expansion:
                continue
            dom = self._drop_domain(name)
            if dom is not None:
                # An LRU domain gone makes its readers non-volatile; if the plan gives the
                # dataset no allocation, no new domain bumps the version for it.
                self.layout_version += 1
            if dom is not None and dom.count:
                victims = dom.cached.nonzero()[0]
                self.evicted_bytes += victims.size * ds.cached_chunk_bytes
                self._changed(name, victims, -1)
            ds.expansion = e

    def apply_plan(self, cache_alloc, running, datasets, now=0.0, lru_datasets=frozenset()):
        """`lru_datasets`: the irregular partition's datasets, LRU-cached within their allocation."""
        if cache_alloc is None:
            raise ValueError("the silod cache system needs a storage-managing policy (SiloD estimator)")
        for name, dom in list(self.domains.items()):
            new = cache_alloc.get(name, 0.0)
            dom = self._domain(dom.dataset, name in lru_datasets)
            victims = dom.set_limit(new, self.rng)
            if victims.size:
                self.evicted_bytes += victims.size * dom.dataset.cached_chunk_bytes
                self._changed(name, victims, -1)
            if dom.count == 0 and new <= 0:
                self._drop_domain(name)
                self.layout_version += 1
        for name, nbytes in cache_alloc.items():
            if nbytes > 0 and name in datasets and name not in self.domains:
                self._domain(datasets[name], name in lru_datasets).set_limit(nbytes, self.rng)

    def cached_mask(self, job):
        dom = self.domains.get(job.dataset.name)
        return dom.cached if dom is not None else np.zeros(job.dataset.n_chunks, dtype=bool)

    def visible_chunks(self, job):
        dom = self.domains.get(job.dataset.name)
        return dom.count if dom is not None else 0

    def room(self, job):
        dom = self.domains.get(job.dataset.name)
        return max(dom.limit_chunks - dom.count, 0) if dom is not None else 0

    def visible_and_room(self, jobs, crows=None):
        return _domain_counts([self.domains.get(j.dataset.name) for j in jobs])

    def access(self, job, chunks):
        name = job.dataset.name
        dom = self.domains.get(name)
        if isinstance(dom, LruDomain):
            return self._access_lru(job, dom, chunks)
        hits, admitted = _access_uniform(job, dom, chunks)
        self._changed(name, admitted, +1)
        return hits

    def _access_lru(self, job, dom: LruDomain, chunks: np.ndarray) -> int:
        name = job.dataset.name
        hits = 0
        read = job.read_mask
        for c in chunks.tolist():
            read[c] = True
            if dom.cached[c]:
                hits += 1
                job.unread_cached -= 1
                dom.touch(c)
                continue
            victims = dom.admit_one(c)
            if dom.cached[c]:
                self._changed(name, np.array([c]), +1)
            if victims.size:
                self.evicted_bytes += victims.size * dom.dataset.chunk_size
                self._changed(name, victims, -1)
        return hits

    def cached_bytes(self):
        return {n: d.cached_bytes for n, d in self.domains.items() if d.count}

    def volatile_bytes(self):
        # An LRU domain admits only its own dataset's readers' misses. A filling uniform domain
        # is still bounded by the whole link (conservative; its readers' IO would do, but
        # that moves the Fig. 12 runs' steps and was not re-measured).
        out = []
        for n, d in self.domains.items():
            group = self.readers.get(n)
            if not group:
                continue
            if isinstance(d, LruDomain) and d.limit_chunks > 0:
                out.append((d.limit_chunks * d.dataset.chunk_size, group))
            elif not isinstance(d, LruDomain) and d.filling and len(group) > 1 and d.dataset.size > 0:
                out.append((d.dataset.size, None))
        return out

    def free_before_eviction(self):
        return [((d.limit_chunks - d.count) * d.dataset.chunk_size, self.readers[n]) for n, d in self.domains.items()
                if isinstance(d, LruDomain) and d.count < d.limit_chunks and self.readers.get(n)]

    def moves_under(self, job):
        dom = self.domains.get(job.dataset.name)
        if dom is None:
            return False
        return isinstance(dom, LruDomain) or (dom.filling and len(self.readers.get(job.dataset.name, ())) > 1)

    def evicting(self, job):
        dom = self.domains.get(job.dataset.name)
        return isinstance(dom, LruDomain) and 0 < dom.limit_chunks <= dom.count


class QuiverCache(SiloDCache):
    """Whole-dataset caching by benefit/cost (Quiver, FAST'20, as SiloD §7 describes it), on
    the uniform-cache mechanics.

    - Candidates: the datasets of every job that has started and not finished, running or
      paused: Quiver learns of a job from its data loader and knows nothing of the scheduler's
      rounds, so a paused job keeps its dataset cached unless a better candidate needs the
      space (a job still queued for its first GPUs is not known to it yet).
    - Benefit of a dataset: the sum of f* of its active readers (the data rate caching it
      saves) times its profile factor; cost: its size. Ranked by benefit/cost, each dataset
      cached whole if it fits in what is left, else not at all.
    - Profiles: SiloD §7.1.2 says Quiver's online latency profiles are "not stable when the remote
      IO fluctuates". A dataset's profile factor is exp(N(0, profile_noise)), drawn when it is
      first profiled and kept until it is re-profiled every REPROFILE_S. profile_noise is 0 by
      default (exact profiles, Quiver at its strongest); `--profile-noise` / the quiver-noise
      experiment measure the sensitivity.
    """

    name = "quiver"
    REPROFILE_S = 12 * 3600.0  # how long a dataset's profile is trusted before it is measured again

    def __init__(self, capacity: float, total_gpus: int, seed: int, profile_noise: float = 0.0):
        super().__init__(capacity, total_gpus, seed)
        if not profile_noise >= 0:
            raise UserError(f"--profile-noise {profile_noise} must be >= 0 (the sigma of a log-normal error; 0 = exact profiles)")
        self.profile_noise = profile_noise
        self.noise_rng = np.random.default_rng([seed, 1])  # its own stream: noise 0 leaves eviction draws as they were
        self.profiles: dict[str, tuple[float, float]] = {}  # dataset -> (profiled at, factor)
        self._ranked_for: dict[str, float] | None = None  # the benefits the last choice was made for
        self._chosen: dict[str, float] = {}

    def _profile(self, dataset: str, now: float) -> float:
        if self.profile_noise == 0:
            return 1.0
        measured = self.profiles.get(dataset)
        if measured is None or now - measured[0] >= self.REPROFILE_S:
            measured = (now, float(np.exp(self.noise_rng.normal(0.0, self.profile_noise))))
            self.profiles[dataset] = measured
        return measured[1]

    def apply_plan(self, cache_alloc, running, datasets, now=0.0, lru_datasets=frozenset()):
        benefit: dict[str, float] = {}
        exact = self.profile_noise == 0  # (x 1.0 changes no float)
        for name, group in self.readers.items():  # every started job, running or paused
            r = 0.0
            for job in group:
                if job.start_time is not None:
                    r += job.ideal
            if r > 0:
                benefit[name] = r if exact else r * self._profile(name, now)
        if benefit != self._ranked_for:  # the same benefits choose the same datasets (40% of a Gavel run's plans)
            free = self.capacity
            chosen: dict[str, float] = {}
            for _, name in sorted((-b / datasets[name].size, name) for name, b in benefit.items()):
                size = datasets[name].size
                if size <= free * (1 + 1e-12):
                    chosen[name] = size
                    free -= size
            self._ranked_for, self._chosen = benefit, chosen
        super().apply_plan(self._chosen, running, datasets, now)


class CoorDLCache(DomainCache):
    """Per-job private uniform caches of a static size (the job's GPUs' share of local disk)."""

    name = "coordl"

    shared = False

    def __init__(self, capacity: float, total_gpus: int, seed: int):
        super().__init__(capacity, total_gpus, seed)
        # A paused job's domain object and slot wait for it to resume, when they are emptied (it
        # resumes with an empty cache, as with a new domain), and go back to the pool when the
        # job leaves: a job pauses at nearly every Gavel round, 390,000 times in a Fig. 12 run.
        self._parked: dict[str, UniformDomain] = {}

    def key(self, job):
        return job.job_id

    def unregister(self, job):
        super().unregister(job)
        parked = self._parked.pop(job.job_id, None)
        if parked is not None:
            self.pool.release(parked)

    def apply_plan(self, cache_alloc, running, datasets, now=0.0, lru_datasets=frozenset()):
        per_gpu = self.capacity / self.total_gpus
        domains, parked = self.domains, self._parked
        resumed, slots = [], []
        # (the jobs without a domain, found at C level: most running jobs keep theirs every round)
        for job in [j for j, held in zip(running, map(domains.__contains__, map(_JOB_ID, running))) if not held]:
            key = job.job_id
            dom = parked.pop(key, None)
            if dom is None:
                dom = self.pool.domain(job.dataset)
                self._set_domain(key, dom)
                dom.set_limit(per_gpu * job.gpus, self.rng)
            else:
                # Emptied, as a new domain would be; its limit is the one it was made with (the
                # job's GPUs' share never changes). It was parked because the job is registered,
                # so the job is its only reader: _set_domain's work, on columns below.
                dom.cached[:] = False
                dom.count = 0
                domains[key] = dom
                resumed.append(job.crow)
                slots.append(dom.slot)
        if resumed:
            self._groups.code[resumed] = slots

    def jobs_stopped(self, jobs):
        # A registered job's domain is parked for its resume (the job is its only reader); a
        # finished one's slot goes back to the pool. What leaves a paused job's view is every
        # cached chunk it has not read, which its count of cached unread chunks is (nobody else
        # reads a private cache): _changed's result without a pass over the chunks (a job pauses
        # at nearly every Gavel round: 390,000 times in a Fig. 12 run).
        domains, parked, readers = self.domains, self._parked, self.readers
        paused, emptied = [], []
        for job in jobs:
            key = job.job_id
            dom = domains.pop(key, None)
            if dom is None:
                continue
            if key in readers:
                parked[key] = dom
                paused.append(job.crow)
                if dom.count:
                    emptied.append(job.crow)
            elif type(dom) is UniformDomain:
                self.pool.release(dom)
        if paused:
            self._groups.code[paused] = NO_DOMAIN
        if emptied:
            counts = self.rows.counts
            counts[emptied, MOVED] += counts[emptied, UNREAD]
            counts[emptied, UNREAD] = 0

    def cached_mask(self, job):
        dom = self.domains.get(job.job_id)
        return dom.cached if dom is not None else np.zeros(job.dataset.n_chunks, dtype=bool)

    def visible_chunks(self, job):
        dom = self.domains.get(job.job_id)
        return dom.count if dom is not None else 0

    def room(self, job):
        dom = self.domains.get(job.job_id)
        return max(dom.limit_chunks - dom.count, 0) if dom is not None else 0

    def visible_and_room(self, jobs, crows=None):
        return _domain_counts([self.domains.get(j.job_id) for j in jobs])

    def access(self, job, chunks):
        return _access_uniform(job, self.domains.get(job.job_id), chunks)[0]  # private: nobody else's ratio moves

    def cached_bytes(self):
        out: dict[str, float] = {}
        for dom in self.domains.values():
            if dom.count:
                out[dom.dataset.name] = out.get(dom.dataset.name, 0.0) + dom.cached_bytes
        return out


class AlluxioLRUCache(SimCacheSystem):
    """One cluster-wide LRU cache over all datasets' chunks, read-through, evicting at admission."""

    name = "alluxio"
    volatile = True
    #: Which chunk is least recently used is decided per chunk, so several readers' interleaved
    #: misses evict at chunk grain: at 128 chunks per dataset five jobs on one LRU ran 6% slower
    #: than item level (tests/test_sim_reference.py, five-lru-alluxio), at 256 within 1-3%.
    #: Twice the resolution here leaves the uniform caches' results as they were.
    resolution_factor = 2

    def __init__(self, capacity: float, total_gpus: int, seed: int):
        self._totals = np.zeros(2, dtype=float)  # bytes cached, bytes evicted (lru_access keeps both)
        super().__init__(capacity, total_gpus, seed)
        self.datasets: dict[str, SimDataset] = {}
        self.index: dict[str, int] = {}  # dataset name -> its index in the arrays below
        self._names: list[str] = []  # by index
        # Per chunk key (a dataset's offset + the chunk; key 0 heads the LRU list), the arrays
        # lru_kernel.lru_access works on: cached or not, the LRU order as a doubly linked list
        # (least recent first), and the key's dataset.
        self._cached = np.zeros(1024, dtype=bool)
        self._next = np.zeros(1024, dtype=np.int64)
        self._prev = np.zeros(1024, dtype=np.int64)
        self._key_ds = np.zeros(1024, dtype=np.int64)
        self._keys = 1
        self.cached: dict[str, np.ndarray] = {}  # per dataset, a view of its keys' `_cached`
        # Per dataset index: its first key, chunk bytes and cached chunks.
        self._offsets = np.zeros(16, dtype=np.int64)
        self._ds_size = np.zeros(16, dtype=float)
        self._ds_counts = np.zeros(16, dtype=np.int64)
        self._admit = np.zeros(16, dtype=bool)  # whether its chunk fits the cache at all
        self._groups = ReaderGroups()  # per reader row, its dataset's index (-1: none yet)
        self._reader_ptr = np.zeros(17, dtype=np.int64)  # each dataset's readers' rows (CSR; _readers_csr)
        self._reader_rows = np.zeros(0, dtype=np.int64)
        self._readers_stale = True
        self._kernel: tuple = ()  # kernel_state's tuple, rebuilt while _readers_stale
        self.min_chunk = float("inf")  # smallest chunk of any dataset it has seen

    # The running totals live in `_totals`, where the compiled look-up adds to them.
    total_bytes = property(lambda self: float(self._totals[0]))

    @property
    def evicted_bytes(self) -> float:
        return float(self._totals[1])

    @evicted_bytes.setter
    def evicted_bytes(self, value: float) -> None:
        self._totals[1] = value

    def register(self, job):
        super().register(job)
        self._readers_stale = True
        self._groups.hold(job.crow, self.index.get(job.dataset.name, -1))

    def unregister(self, job):
        if job in self.readers.get(self.key(job), ()):
            self._groups.held[job.crow] = False  # before the row leaves with the job
        super().unregister(job)
        self._readers_stale = True

    def _dataset_index(self, dataset: SimDataset) -> int:
        i = self.index.get(dataset.name)
        if i is not None:
            return i
        i = self.index[dataset.name] = len(self.datasets)
        self.datasets[dataset.name] = dataset
        self._names.append(dataset.name)
        n = dataset.n_chunks
        if self._keys + n > len(self._cached):
            size = max(2 * len(self._cached), self._keys + n)
            for name in ("_cached", "_next", "_prev", "_key_ds"):
                old = getattr(self, name)
                grown = np.zeros(size, dtype=old.dtype)
                grown[:len(old)] = old
                setattr(self, name, grown)
            for name, j in self.index.items():  # the views follow the grown array
                if name in self.cached:
                    self.cached[name] = self._cached[self._offsets[j]:self._offsets[j] + self.datasets[name].n_chunks]
        if i >= len(self._offsets):
            for name in ("_offsets", "_ds_size", "_ds_counts", "_admit"):
                old = getattr(self, name)
                setattr(self, name, np.concatenate([old, np.zeros_like(old)]))
        self._offsets[i], self._ds_size[i], self._admit[i] = self._keys, dataset.chunk_size, dataset.chunk_size <= self.capacity
        self._key_ds[self._keys:self._keys + n] = i
        self.cached[dataset.name] = self._cached[self._keys:self._keys + n]
        self._keys += n
        self.min_chunk = min(self.min_chunk, dataset.chunk_size)
        self._readers_stale = True
        for job in self.readers.get(dataset.name, ()):
            self._groups.code[job.crow] = i
        return i

    def _readers_csr(self) -> None:
        """Each known dataset's readers' rows, as the compiled look-up reads them (rebuilt at
        every arrival and completion: on columns, not a pass over the readers)."""
        self._reader_ptr, self._reader_rows = self._groups.csr(len(self.datasets))
        self._readers_stale = False

    def apply_plan(self, cache_alloc, running, datasets, now=0.0, lru_datasets=frozenset()):
        return None  # LRU takes no allocation: that is the point of the baseline

    def cached_mask(self, job):
        arr = self.cached.get(job.dataset.name)
        return arr if arr is not None else np.zeros(job.dataset.n_chunks, dtype=bool)

    def visible_chunks(self, job):
        i = self.index.get(job.dataset.name)
        return 0 if i is None else int(self._ds_counts[i])

    def kernel_state(self) -> tuple:
        """The arrays lru_kernel works on (its LRU tuple), the readers' rows brought up to date.
        Kept until a reader or dataset comes or goes (which may also replace the arrays)."""
        if self._readers_stale:
            self._readers_csr()
            rows = self.rows
            self._kernel = (rows.reads, rows.counts, rows.perms, self._cached, self._next, self._prev, self._key_ds, self._ds_counts,
                            self._offsets, self._ds_size, self._admit, self._totals, self._reader_ptr, self._reader_rows,
                            self.capacity * (1 + 1e-12))
        return self._kernel

    def access(self, job, chunks):
        ds = self._dataset_index(job.dataset)
        return lru_access(chunks, job.crow, ds, self.kernel_state())

    def compiled_advance(self, job, now: float, dt: float, io_cap: float, substeps: int | None, substep: int) -> np.ndarray:
        """reader.advance of an epoch reader (not curriculum, not preprocessed), compiled:
        (bytes read, bytes fetched, finished at or NaN, elapsed). `substep`: its chunks per sub-step."""
        ds = self._dataset_index(job.dataset)
        lru = self.kernel_state()
        res = np.array([0.0, 0.0, np.nan, 0.0])
        k = job.dataset.n_chunks
        code, t, left = lru_advance(job.row, job.crow, ds, k, substep, job.dataset.chunk_size, job.ideal, job.total_bytes, io_cap, now,
                                    dt, 0.0, -1 if substeps is None else substeps, True, res, job.state, lru)
        self._advance_on(job, ds, code, t, left, substep, io_cap, now, dt, res, lru)
        return res

    def _advance_on(self, job, ds: int, code: int, t: float, left: int, substep: int, io_cap: float, now: float, dt: float,
                    res: np.ndarray, lru: tuple) -> None:
        """Where lru_advance stopped at an epoch's end: the job's next epoch (a new permutation
        from its own generator), and on with its advance."""
        while code == EPOCH:
            job.new_epoch(self)
            code, t, left = lru_advance(job.row, job.crow, ds, job.dataset.n_chunks, substep, job.dataset.chunk_size, job.ideal,
                                        job.total_bytes, io_cap, now, dt, t, left, False, res, job.state, lru)
        if code == FINISHED_EPOCH:
            job.new_epoch(self)  # records the last epoch's hit ratio

    def look_up_in_turn(self, jobs, crows, turns, simple, unread, lo, hi, fresh, hits, per_job, step=None):
        # SimCacheSystem.look_up_in_turn's loop, compiled, with the per-job advance compiled
        # where `step` says what it needs: it returns to Python for `per_job` and epoch ends.
        n = len(jobs)
        ds_of = self._groups.code[crows]
        for i in (ds_of < 0).nonzero()[0].tolist():  # a dataset read for the first time
            ds_of[i] = self._dataset_index(jobs[i].dataset)
        lru = self.kernel_state()
        turns = np.concatenate((turns, (n,)))  # (np.append: a Python wrapper around it)
        if step is None:  # every per-job advance in Python
            z, zi = np.zeros(n), np.zeros(n, dtype=np.int64)
            step = TurnAdvance(python=np.ones(n, dtype=bool), slots=zi, substep=zi, k=z, chunk=z, ideal=z, total=z, caps=z, now=0.0,
                               dt=0.0, substeps=-1, state=np.zeros((1, 1)), read=z, remote=z, finished_at=z, elapsed=z,
                               applied=np.zeros(n, dtype=bool))
        res = np.empty(4)
        at, prev, changed = 0, 0, not fresh
        while True:
            i, at, prev, need, t, left = lru_turns(
                turns, at, prev, changed, simple, unread, crows, lo, hi, ds_of, hits, lru, step.python, step.slots, step.k,
                step.chunk, step.ideal, step.total, step.substep, step.caps, step.now, step.dt, step.substeps, step.state, step.read,
                step.remote, step.finished_at, step.elapsed, step.applied, res)
            if i < 0:
                return
            changed = True
            if need < 0:
                per_job(i)
                continue
            self._advance_on(jobs[i], int(ds_of[i]), need, t, left, int(step.substep[i]), float(step.caps[i]), step.now, step.dt, res, lru)
            step.read[i], step.remote[i], step.finished_at[i], step.elapsed[i] = res

    def advance_clock(self, jobs, crows: np.ndarray, left: np.ndarray, t0: np.ndarray, step: TurnAdvance, tol: float,
                      per_job: Callable[[int, float], StepResult]) -> None:
        """Simulator._interleave's clock, compiled (lru_kernel.lru_clock): the jobs at positions
        `left` of `jobs` (reader rows `crows`), each `t0` into the step, advance a sub-step at a
        time, earliest first, until each finishes or reaches the step's end; their results are
        added to `step.read`, `step.remote`, `step.finished_at`. A `step.python` job's sub-step
        is `per_job(i, t)` (the per-job advance from `t`). As a Python loop, one call per
        sub-step per job was two thirds of a 400-GPU Gavel run on this LRU."""
        ds_of = self._groups.code[crows]
        python = step.python
        for i in left[ds_of[left] < 0].tolist():
            if not python[i]:
                ds_of[i] = self._dataset_index(jobs[i].dataset)
        # heapq's initial heap of (t, position): a sorted array is a heap.
        order = np.lexsort((left, t0))
        heap_t, heap_i = t0[order].astype(float), left[order].astype(np.int64)
        caps = np.ascontiguousarray(step.caps, dtype=float)
        res = np.empty(4)
        now, dt = step.now, step.dt
        size, pending, pending_t = len(left), -1, 0.0
        while True:
            i, size, t, need, t_in, left_n = lru_clock(heap_t, heap_i, size, pending, pending_t, python, step.slots, crows, ds_of,
                                                       step.k, step.substep, step.chunk, step.ideal, step.total, caps, now, dt, tol,
                                                       step.state, step.read, step.remote, step.finished_at, res, self.kernel_state())
            if i < 0:
                return
            if need < 0:
                part = per_job(i, t)
                res[:] = (part.bytes_read, part.remote_bytes, np.nan if part.finished_at is None else part.finished_at, part.elapsed)
            else:
                self._advance_on(jobs[i], int(ds_of[i]), need, t_in, left_n, int(step.substep[i]), float(caps[i]), now + t, dt - t,
                                 res, self.kernel_state())
            pending, pending_t = i, t

    def recency(self) -> list[tuple[str, int]]:
        """The cached chunks as (dataset, chunk), least recently used first."""
        names = list(self.datasets)
        out, key = [], int(self._next[0])
        while key:
            ds = int(self._key_ds[key])
            out.append((names[ds], key - int(self._offsets[ds])))
            key = int(self._next[key])
        return out

    def cached_bytes(self):
        # On the columns: a pass over every dataset the trace has read (1,400 in a Fig. 12 run)
        # by numpy scalar was most of a timeline sample.
        held = self._ds_counts[:len(self.datasets)].nonzero()[0].tolist()
        names = self._names
        return {names[i]: c * s for i, c, s in zip(held, self._ds_counts[held].tolist(), self._ds_size[held].tolist())}

    def room(self, job):
        return max(int((self.capacity - self.total_bytes) / job.dataset.chunk_size + 1e-9), 0)

    def evicting(self, job):
        return 0 < self.capacity and self.capacity - self.total_bytes < job.dataset.chunk_size

    def _datasets_of(self, jobs, crows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Each job's dataset index (-1: nobody has read it yet) and chunk bytes."""
        if crows is None:
            crows = np.fromiter(map(_CROW, jobs), dtype=np.int64, count=len(jobs))
        ds = self._groups.code[crows]
        chunk = self._ds_size[ds]
        for i in (ds < 0).nonzero()[0].tolist():
            chunk[i] = jobs[i].dataset.chunk_size
        return ds, chunk

    def visible_and_room(self, jobs, crows=None):
        ds, chunk = self._datasets_of(jobs, crows)
        visible = np.where(ds >= 0, self._ds_counts[ds], 0).astype(float)
        room = np.maximum(np.trunc((self.capacity - self.total_bytes) / chunk + 1e-9), 0.0)
        return visible, room

    def moves_under_all(self, jobs):
        return np.ones(len(jobs), dtype=bool)  # volatile for every reader

    def evicting_all(self, jobs, crows=None):
        if not 0 < self.capacity:
            return np.zeros(len(jobs), dtype=bool)
        return self.capacity - self.total_bytes < self._datasets_of(jobs, crows)[1]

    def volatile_bytes(self):
        # One cache: every reader's misses are admitted into it. No cache: nothing moves (a
        # zero-byte turnover bound made 1-ms steps).
        return [(self.capacity, None)] if self.capacity > 0 else []

    def free_before_eviction(self):
        # Once it has evicted it is full for good (this LRU frees bytes only by evicting): what
        # it keeps free is the slack of evicting whole chunks, up to one chunk, which a reader of
        # smaller chunks fills without evicting while the others evict at every miss. Counted as
        # room, it ended every step at slack / link (~0.2 s) for the rest of a run: a 1 MB
        # dataset of 3.9 KB chunks among ImageNet readers took a 400-GPU msr trace to 3.2 M steps.
        if self.evicted_bytes > 0:
            return []
        # Less than a chunk free is what a full cache of unequal chunks keeps: it evicts already.
        free = self.capacity - self.total_bytes
        if free < self.min_chunk:
            return []  # below every dataset's chunk (the usual case: a full LRU), so below the readers'
        chunks = [self.datasets[n].chunk_size for n, group in self.readers.items() if group and n in self.datasets]
        return [(free, None)] if chunks and free >= min(chunks) else []


_CROW, _JOB_ID = attrgetter("crow"), attrgetter("job_id")


def _domain_counts(domains: Sequence[CacheDomain | None]) -> tuple[np.ndarray, np.ndarray]:
    """(cached chunks, room) of each domain (None: no domain, 0 and 0) as float columns."""
    n = len(domains)
    counts = np.fromiter((0 if d is None else d.count for d in domains), dtype=float, count=n)
    limits = np.fromiter((0 if d is None else d.limit_chunks for d in domains), dtype=float, count=n)
    return counts, np.maximum(limits - counts, 0.0)


def make_cache_system(name: str, capacity: float, total_gpus: int, seed: int = 0, profile_noise: float = 0.0) -> SimCacheSystem:
    """`profile_noise`: Quiver's profile error (sigma of a log-normal factor); other systems
    have no profiles and refuse a non-zero value."""
    classes = {c.name: c for c in (SiloDCache, AlluxioLRUCache, CoorDLCache, QuiverCache)}
    if name not in classes:
        raise UserError(f"unknown cache system {name!r}; choose one of: {', '.join(CACHE_SYSTEMS)}")
    if name == "quiver":
        return QuiverCache(capacity, total_gpus, seed, profile_noise)
    if profile_noise:
        raise UserError(f"--profile-noise applies to the quiver cache system only (it profiles jobs online), not {name!r}")
    return classes[name](capacity, total_gpus, seed)
