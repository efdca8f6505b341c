"""The simulator's compiled parts against plain references.

- Reader rows (scheduler/sim/reader_rows.py): a job's read mask, permutation and counts move
  into its cache system's rows when it registers, follow the rows as they grow (more readers, a
  dataset of more chunks), and leave with the job.
- Alluxio's compiled LRU (scheduler/sim/lru_kernel.py) against an LRU written here on an
  OrderedDict, look-up by look-up: the same hits, the same cached chunks in the same recency
  order, the same evicted bytes; and every reader's count of cached unread chunks equals what
  its read mask and the cache say, counted from scratch.
- The compiled turn-by-turn loop (AlluxioLRUCache.look_up_in_turn) against SimCacheSystem's
  Python loop: the same jobs handed to the per-job advance, the same hits, the same cache; and
  with the per-job advance compiled inside the loop, the same results as reader.python_advance.
- The uniform caches' compiled turn loop (DomainCache.look_up_in_turn, uniform_kernel.py) against
  the same Python loop, for silod, quiver and coordl, through rounds that make, shrink, drop and
  switch domains (slots reused), and the chunk pool that holds their chunks.
- The engine's compiled link split (link_kernel.max_min) against policies.storage.max_min_share,
  to the sign of zero; the kernels' cache directory following every simulator source.
- The compiled per-job advance (lru_kernel.lru_advance, through reader.advance) against
  reader.python_advance, call by call: epoch ends, finishing, sub-step limits, no IO.
The column advance's compiled arithmetic is checked against the per-job advance by
tests/test_simulator.py::test_the_column_advance_is_exactly_the_per_job_advance.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from policies.storage import max_min_share
from scheduler.sim.cache_systems import ChunkPool, SimCacheSystem, make_cache_system
from scheduler.sim.link_kernel import max_min
from scheduler.sim.reader import VOLATILE_SUBSTEP, SimJob, advance, python_advance
from scheduler.sim.types import SimDataset, TurnAdvance
from traces.model import TraceJob

GB = 1e9
MB = 1e6


def _job(name: str, ds: SimDataset, seed: int, total: float = 10 * GB) -> SimJob:
    return SimJob(TraceJob(name, 0.0, 1, "m", ds.name, 100 * MB, 1.0), ds, 100 * MB, total, np.random.default_rng(seed))


def test_a_readers_epoch_state_moves_into_the_cache_systems_rows_and_back_out():
    small, big = SimDataset("small", 1 * GB, 8, 0), SimDataset("big", 4 * GB, 100, 1)
    cache = make_cache_system("silod", 0.0, 8)
    jobs = [_job(f"j{i}", small if i % 3 else big, i) for i in range(40)]  # past 16 rows; a wider dataset after the first
    perms = [job.perm.copy() for job in jobs]
    for i, job in enumerate(jobs):
        job.read_mask[: i % 5] = True
        job.unread_cached, job.moved = i, 2 * i
        cache.register(job)
    rows = cache.rows
    assert rows.reads.shape[0] >= 40 and rows.reads.shape[1] >= 100
    for i, job in enumerate(jobs):
        n = job.dataset.n_chunks
        assert np.shares_memory(job.read_mask, rows.reads) and np.shares_memory(job.perm, rows.perms) and job.counts is rows.counts
        assert job.read_mask.sum() == i % 5 and (job.perm == perms[i]).all() and (job.unread_cached, job.moved) == (i, 2 * i)
        assert not rows.reads[job.crow, n:].any()  # a narrower dataset's row beyond its chunks stays clear
    rows.counts[jobs[7].crow, 0] += 5  # a compiled update is the job's
    rows.reads[jobs[7].crow, 3] = True
    assert jobs[7].unread_cached == 12 and jobs[7].read_mask[3]
    jobs[8].new_epoch(cache)  # a new permutation in place: the row follows
    assert (rows.perms[jobs[8].crow, :jobs[8].dataset.n_chunks] == jobs[8].perm).all() and not jobs[8].read_mask.any()
    gone = jobs[7]
    row = gone.crow
    cache.unregister(gone)
    rows.reads[:] = False
    rows.counts[:] = -1  # what reuses the row does not touch the job that left
    assert gone.unread_cached == 12 and gone.moved == 14 and gone.read_mask[3] and gone.read_mask.sum() == 3
    again = _job("again", big, 99)
    cache.register(again)
    assert again.crow == row and again.unread_cached == 0 and not again.read_mask.any()


class _ReferenceLru:
    """Alluxio's cache as its docstring says, on an OrderedDict: read-through, every miss
    admitted, least recently used chunks evicted at admission."""

    def __init__(self, capacity: float):
        self.capacity, self.order, self.total, self.evicted = capacity, OrderedDict(), 0.0, 0.0

    def access(self, ds: SimDataset, chunks) -> int:
        hits = 0
        for c in chunks:
            key = (ds.name, int(c))
            if key in self.order:
                hits += 1
                self.order.move_to_end(key)
                continue
            if ds.chunk_size > self.capacity:
                continue
            self.order[key] = ds.chunk_size
            self.total += ds.chunk_size
            while self.total > self.capacity * (1 + 1e-12):
                _, size = self.order.popitem(last=False)
                self.total -= size
                self.evicted += size
        return hits


def _lru_scenario(seed: int):
    datasets = [SimDataset("a", 1 * GB, 64, 0), SimDataset("b", 3 * GB, 128, 1), SimDataset("c", 0.5 * GB, 16, 2)]
    cache = make_cache_system("alluxio", 2.2 * GB, 8)
    # Totals of a few epochs, not whole ones, so that jobs finish inside an epoch and at its end.
    jobs = [_job(f"j{i}", datasets[i % 3], seed * 100 + i, (2.37 + i % 3) * datasets[i % 3].size) for i in range(7)]
    for job in jobs:
        cache.register(job)
        job.start_epoch_view(cache)
    return cache, jobs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_compiled_lru_answers_as_an_ordered_dict_lru(seed):
    cache, jobs = _lru_scenario(seed)
    ref = _ReferenceLru(cache.capacity)
    rng = np.random.default_rng(seed)
    for _ in range(600):
        job = jobs[int(rng.integers(len(jobs)))]
        if job.looked >= job.dataset.n_chunks:
            job.new_epoch(cache)
        lo = job.looked
        hi = min(job.dataset.n_chunks, lo + int(rng.integers(1, 6)))
        chunks = job.perm[lo:hi]
        assert cache.access(job, chunks) == ref.access(job.dataset, chunks.tolist())
        job.looked = hi
        assert list(ref.order) == cache.recency()
        assert cache.evicted_bytes == ref.evicted and cache.total_bytes == ref.total
        for other in jobs:  # every reader's count, from scratch
            assert other.unread_cached == int(np.count_nonzero(cache.cached_mask(other) & ~other.read_mask))
    assert ref.evicted > 10 * GB  # the scenario did evict, across datasets


def test_the_compiled_turns_hand_the_same_jobs_to_the_per_job_advance():
    """AlluxioLRUCache.look_up_in_turn (compiled) and SimCacheSystem.look_up_in_turn (the Python
    loop every other cache system runs) on the same turns: the per-job advance here looks up
    the job's next chunks itself, as reader.advance does, so later jobs' counts move."""
    outcomes = []
    for compiled in (True, False):
        cache, jobs = _lru_scenario(5)
        for job in jobs:  # warm the cache up
            cache.access(job, job.perm[:6])
            job.looked = 6
        rng = np.random.default_rng(11)
        advanced: list[int] = []

        def per_job(i: int) -> None:
            advanced.append(i)
            job = jobs[i]
            cache.access(job, job.perm[job.looked:job.looked + 2])
            job.looked = min(job.looked + 2, job.dataset.n_chunks)

        for step in range(40):
            hits = _turns(AlluxioLook if compiled else SimCacheSystem.look_up_in_turn, cache, jobs, rng, 2, step % 2 == 0, per_job)
            outcomes.append((compiled, step, tuple(advanced), tuple(hits.tolist()), cache.evicted_bytes,
                             tuple(j.unread_cached for j in jobs), tuple(j.moved for j in jobs)))
            advanced.clear()
    half = len(outcomes) // 2
    assert [o[1:] for o in outcomes[:half]] == [o[1:] for o in outcomes[half:]]
    assert sum(len(o[2]) for o in outcomes[:half]) > 20  # the per-job path was taken, also for moved counts


AlluxioLook = type(make_cache_system("alluxio", 1.0, 1)).look_up_in_turn


def _turns(look, cache, jobs, rng, most: int, fresh: bool, per_job) -> np.ndarray:
    """One step's look-ups in turn through `look`, on random columns as the engine's column
    advance hands them over (up to `most` chunks a job; a fifth of the jobs to the per-job
    advance); the jobs move past what they looked up, and an epoch nearly read ends. Returns
    the hits (-1: no look-up)."""
    n = len(jobs)
    crows = np.array([j.crow for j in jobs], dtype=np.int64)
    unread = np.array([j.unread_cached for j in jobs], dtype=np.int64)
    simple = rng.random(n) < 0.8
    lo = np.array([j.looked for j in jobs], dtype=np.int64)
    hi = np.minimum(lo + rng.integers(0, most + 1, n), [j.dataset.n_chunks for j in jobs]).astype(np.int64)
    turns = np.flatnonzero(~simple | (hi > lo))
    hits = np.full(n, -1, dtype=np.int64)
    look(cache, jobs, crows, turns, simple, unread, lo, hi, fresh, hits, per_job)
    for i in np.flatnonzero(hits >= 0).tolist():
        jobs[i].looked = int(hi[i])
    for job in jobs:
        if job.looked >= job.dataset.n_chunks - 2:
            job.new_epoch(cache)
    return hits


def _domain_scenario(system: str, seed: int):
    """Four datasets on a uniform cache system: under silod one filling, one full, one an LRU
    domain (the irregular partition's) and one with no allocation; quiver picks its own; under
    coordl the first six jobs run, each with its private domain."""
    datasets = [SimDataset("a", 1 * GB, 64, 0), SimDataset("b", 3 * GB, 128, 1), SimDataset("c", 0.5 * GB, 16, 2),
                SimDataset("d", 0.8 * GB, 32, 3)]
    cache = make_cache_system(system, 2.5 * GB, 8)
    jobs = [_job(f"j{i}", datasets[i % 4], seed * 100 + i) for i in range(9)]
    for job in jobs:
        job.start_time = 0.0
        cache.register(job)
    return cache, jobs, {d.name: d for d in datasets}


def _plan(cache, jobs, datasets, rng) -> None:
    """A new round: new allocations (silod: growing, shrinking, dropped; LRU or not), and under
    coordl some jobs paused and others resumed."""
    if cache.name == "coordl":
        running = [j for j in jobs if rng.random() < 0.7]
        cache.jobs_stopped([j for j in jobs if j not in running])
        cache.apply_plan(None, running, datasets)
        return
    alloc = {n: float(rng.choice([0.0, 0.3, 0.6, 1.0])) * d.size for n, d in datasets.items()}
    lru = frozenset(n for n in datasets if rng.random() < 0.25)
    cache.apply_plan(alloc, jobs, datasets, 0.0, lru)


@pytest.mark.parametrize("system", ["silod", "quiver", "coordl"])
def test_the_compiled_uniform_turns_make_the_python_loops_look_ups(system):
    """DomainCache.look_up_in_turn (compiled, uniform_kernel.py) and SimCacheSystem's Python loop
    on the same turns, rounds and pauses: the same jobs handed to the per-job advance, the same
    hits, domains, cached chunks and counts, and every reader's count is its cached unread
    chunks counted from scratch. Between rounds domains are made, shrunk, dropped, switched to
    LRU and back, and under coordl parked and resumed, so slots are reused."""
    outcomes = []
    for compiled in (True, False):
        cache, jobs, datasets = _domain_scenario(system, 3)
        rng = np.random.default_rng(5)
        _plan(cache, jobs, datasets, rng)
        for job in jobs:
            job.start_epoch_view(cache)
        advanced: list[int] = []

        def per_job(i: int) -> None:
            advanced.append(i)
            job = jobs[i]
            hi = min(job.looked + 2, job.dataset.n_chunks)
            cache.access(job, job.perm[job.looked:hi])
            job.looked = hi

        for step in range(80):
            if step % 9 == 8:
                _plan(cache, jobs, datasets, rng)
            look = type(cache).look_up_in_turn if compiled else SimCacheSystem.look_up_in_turn
            hits = _turns(look, cache, jobs, rng, 3, step % 2 == 0, per_job)
            doms = sorted((k, type(d).__name__, d.count, d.limit_chunks, tuple(np.flatnonzero(d.cached).tolist()))
                          for k, d in cache.domains.items())
            outcomes.append((step, tuple(advanced), tuple(hits.tolist()), tuple(doms), cache.evicted_bytes,
                             tuple(j.unread_cached for j in jobs), tuple(j.moved for j in jobs)))
            advanced.clear()
            if compiled:
                for job in jobs:
                    assert job.unread_cached == int(np.count_nonzero(cache.cached_mask(job) & ~job.read_mask))
    half = len(outcomes) // 2
    assert outcomes[:half] == outcomes[half:]
    assert sum(len(o[1]) for o in outcomes[:half]) > 20  # the per-job path was taken
    assert sum(h for o in outcomes[:half] for h in o[2] if h > 0) > 30  # and look-ups hit
    assert len({o[3] for o in outcomes[:half]}) > 10  # the domains changed under the readers


def test_the_chunk_pool_reuses_a_dropped_domains_slot_zeroed_and_follows_growth():
    pool = ChunkPool()
    small, big = SimDataset("s", 1 * GB, 8, 0), SimDataset("b", 1 * GB, 600, 1)
    a = pool.domain(small)
    a.cached[[1, 3]] = True
    pool.release(a)
    b = pool.domain(small)
    assert b.slot == a.slot and not b.cached.any()  # the slot again, emptied
    with pytest.raises(RuntimeError, match="not held by this domain"):
        pool.release(a)  # a dropped domain cannot give back a slot it no longer holds
    b.cached[5] = True
    others = [pool.domain(big) for _ in range(4)]  # past the first array: it grows
    assert len(pool.cached) > 1024
    assert np.shares_memory(b.cached, pool.cached) and b.cached[5] and b.cached.sum() == 1
    assert all(np.shares_memory(d.cached, pool.cached) and not d.cached.any() for d in others)
    assert len({d.slot for d in [b, *others]}) == 5


def _state(cache, jobs) -> tuple:
    return (cache.recency(), cache.evicted_bytes, tuple(j.unread_cached for j in jobs), tuple(j.moved for j in jobs),
            tuple(tuple(j.state[j.row].tolist()) for j in jobs), tuple(tuple(j.epoch_hit_ratios) for j in jobs),
            tuple(j.perm.tolist() for j in jobs), tuple(j.read_mask.tolist() for j in jobs))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_compiled_advance_makes_the_python_advances_steps(seed):
    runs = []
    for step in (advance, python_advance):
        cache, jobs = _lru_scenario(seed)
        rng = np.random.default_rng(seed + 7)
        calls = []
        for _ in range(400):
            job = jobs[int(rng.integers(len(jobs)))]
            if job.consumed >= job.total_bytes:
                continue
            cap = float(rng.choice([0.0, 20 * MB, 80 * MB, 1 * GB]))
            dt = float(rng.choice([0.5, 3.0, 40.0]))
            substeps = [None, 1, 3][int(rng.integers(3))]
            res = step(job, float(rng.random() * 100), dt, cap, cache, substeps)
            calls.append((res.bytes_read, res.remote_bytes, res.finished_at, res.elapsed))
        runs.append((calls, _state(cache, jobs)))
    assert runs[0] == runs[1]
    calls, state = runs[0]
    assert sum(c[2] is not None for c in calls) >= 3 and sum(len(h) for h in state[5]) >= 10  # finished jobs, ended epochs


def test_the_compiled_turns_advance_per_job_as_the_python_advance_does():
    """The engine's column advance hands AlluxioLRUCache.look_up_in_turn its columns
    (TurnAdvance) and the loop advances per job inside the kernel; SimCacheSystem's Python loop
    calls python_advance for the same jobs. Both must leave the same results and the same cache."""
    runs = []
    for compiled in (True, False):
        cache, jobs = _lru_scenario(3)
        rng = np.random.default_rng(4)
        n = len(jobs)
        table = np.zeros((n, jobs[0].state.shape[1]))
        for i, job in enumerate(jobs):  # the job table the engine keeps
            table[i] = job.state[job.row]
            job.state, job.row = table, i
        results = []
        for _ in range(60):
            live = [j for j in jobs if j.consumed < j.total_bytes]
            if not live:
                break
            crows = np.array([j.crow for j in live], dtype=np.int64)
            unread = np.array([j.unread_cached for j in live], dtype=np.int64)
            lo = np.array([j.looked for j in live], dtype=np.int64)
            hi = np.minimum(lo + rng.integers(0, 3, len(live)), [j.dataset.n_chunks for j in live]).astype(np.int64)
            simple = (rng.random(len(live)) < 0.6) & (lo < [j.dataset.n_chunks for j in live])
            turns = np.flatnonzero(~simple | (hi > lo))
            caps = rng.choice([0.0, 30 * MB, 300 * MB], len(live))
            now, dt = float(rng.random() * 1e3), float(rng.choice([1.0, 20.0]))
            out = np.zeros((4, len(live)))
            out[2] = np.nan
            applied = np.ones(len(live), dtype=bool)
            hits = np.full(len(live), -1, dtype=np.int64)

            def per_job(i: int) -> None:
                res = python_advance(live[i], now, dt, float(caps[i]), cache, 1)
                out[:, i] = (res.bytes_read, res.remote_bytes, np.nan if res.finished_at is None else res.finished_at, res.elapsed)
                applied[i] = False

            if compiled:
                k = np.array([j.dataset.n_chunks for j in live], dtype=float)
                step = TurnAdvance(np.array([j.job_id == "j2" for j in live]), np.array([j.row for j in live], dtype=np.int64),
                                   np.maximum((k * VOLATILE_SUBSTEP).astype(np.int64), 1), k,
                                   np.array([j.dataset.chunk_size for j in live]), np.array([j.ideal for j in live]),
                                   np.array([j.total_bytes for j in live]), caps, now, dt, 1, table, out[0], out[1], out[2], out[3],
                                   applied)
                AlluxioLook(cache, live, crows, turns, simple, unread, lo, hi, False, hits, per_job, step)
            else:
                SimCacheSystem.look_up_in_turn(cache, live, crows, turns, simple, unread, lo, hi, False, hits, per_job)
            for i in np.flatnonzero(hits >= 0).tolist():
                live[i].looked = int(hi[i])
            results.append((hits.tolist(), applied.tolist(), np.where(np.isnan(out), -1.0, out).tolist()))  # NaN != NaN
        runs.append((results, _state(cache, jobs)))
    assert runs[0] == runs[1]
    assert sum(not a for r in runs[0][0] for a in r[1]) > 30  # jobs went through the per-job advance
    assert sum(len(h) for h in runs[0][1][5]) >= 5  # and through epoch ends


def test_the_compiled_link_split_is_max_min_share_to_the_bit():
    """link_kernel.max_min (the engine's) against policies.storage.max_min_share on random
    splits: uncontended and contended, ties, zeros of both signs, infinite and NaN demands, a
    capacity of -0.0: the same values and the same signs of zero."""
    rng = np.random.default_rng(1)
    contended = 0
    for trial in range(20000):
        n = int(rng.integers(0, 40)) if trial % 10 else int(rng.integers(0, 400))
        kind = trial % 5
        if kind == 0:
            d = rng.random(n) * 1e8
        elif kind == 1:
            d = rng.integers(0, 5, n).astype(float) * 1e7  # ties and zeros
        elif kind == 2:
            d = np.where(rng.random(n) < 0.1, np.inf, rng.random(n) * 1e9)
        elif kind == 3:
            d = np.where(rng.random(n) < 0.05, np.nan, rng.random(n) * 1e9)
        else:
            d = rng.choice([0.0, -0.0, 1e-300, 5e8, 5e8 + 1e-7], n)
        cap = float(rng.choice([0.0, -0.0, d.sum() * rng.random() if n else 1.0, 4e9, 1e-300]))
        if n and not np.isfinite(d.sum()):
            cap = float(rng.random() * 1e9)
        want, got = max_min_share(d, cap), max_min(d, cap)
        contended += bool(n) and bool(d.sum() > cap)
        assert want.shape == got.shape and np.array_equal(want, got, equal_nan=True), (d, cap)
        assert np.array_equal(np.signbit(want), np.signbit(got)), (d, cap)
    assert contended > 10000


def test_the_kernels_min_and_max_are_numpys():
    """np_min and np_max (inlined in the kernels) as np.minimum and np.maximum: a NaN wins, and
    of two equal values (0.0 and -0.0) the second is taken."""
    from itertools import product

    from policies.compiled import np_max, np_min

    values = [0.0, -0.0, 1.0, -1.0, np.nan, np.inf, -np.inf]
    for a, b in product(values, values):
        for mine, theirs in ((np_min, np.minimum), (np_max, np.maximum)):
            got, want = mine(a, b), float(theirs(a, b))
            assert (np.isnan(got) and np.isnan(want)) or (got == want and np.signbit(got) == np.signbit(want)), (mine, a, b)


def test_kernels_are_cached_per_version_of_their_sources(tmp_path, monkeypatch):
    """numba checks only a kernel's own file; the cache directory follows every source of the
    packages that hold kernels (a helper or constant inlined from another module: the
    simulator's and Gavel's), under NUMBA_CACHE_DIR if set."""
    from policies import compiled

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    here = compiled._cache_dir()
    assert here is not None and Path(here).parent == tmp_path
    sources = {p.parent.name + "/" + p.name for p in compiled.kernel_sources()}
    assert {"sim/position.py", "sim/lru_kernel.py", "policies/gavel_kernel.py", "policies/compiled.py"} <= sources
    real = Path.read_bytes
    for edited in ("position.py", "gavel_kernel.py"):
        monkeypatch.setattr(Path, "read_bytes", lambda p, edited=edited: real(p) + (b"# edited" if p.name == edited else b""))
        assert compiled._cache_dir() != here  # one module edited: another directory
    monkeypatch.setattr(Path, "read_bytes", real)
    assert compiled._cache_dir() == here
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    monkeypatch.setenv("HOME", "~")  # no home to resolve: numba's own default (next to the modules)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert compiled._cache_dir() is None


def test_the_kernels_compile_in_memory_where_numba_cannot_cache():
    """A read-only install with no writable home: numba finds no cache location and refuses to
    cache; the kernels then compile in memory in every process instead of failing the import."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from numba.core import caching\n"
        "impl = getattr(caching, 'CacheImpl', None) or caching._CacheImpl  # numba's name differs by version\n"
        "impl._locator_classes = []  # as numba finds it when no directory can be written\n"
        "from scheduler.sim import column_kernel, lru_kernel\n"
        "print('ok', type(lru_kernel.lru_turns._cache).__name__, type(column_kernel.column_step._cache).__name__)\n"
    )
    # silod's own locator (policies/compiled.py) is tried first: its directory cannot be made
    # either (a path under a file), as on a read-only install.
    env = {**os.environ, "NUMBA_CACHE_DIR": "/dev/null/silod-numba"}
    out = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ok", "NullCache", "NullCache"]


def _numpy_claims(caps, evicting, total):
    """engine._claimable's arithmetic in numpy (before it was compiled): None where no job claims."""
    level = float(caps.max())
    below = caps < level * (1 - 1e-9)
    at_level = int(np.count_nonzero(~below))
    if not below.any() or not at_level:
        return None
    mask = below & evicting
    if not mask.any():
        return None
    claim = (total - (float(caps[below].sum()) - caps)) / (at_level + 1)
    return np.where(mask, np.maximum(caps, claim), caps), mask, ~below


def test_the_claimers_caps_are_numpys():
    """link_kernel.below_level and claimed_caps give the numpy form's caps, masks and levels to
    the bit, on caps with ties at the level, all at it, none evicting, and long columns."""
    from scheduler.sim.link_kernel import below_level, claimed_caps

    rng = np.random.default_rng(5)
    claimed = 0
    for trial in range(5000):
        n = int(rng.integers(1, 400 if trial % 10 == 0 else 20))
        caps = rng.random(n) * 10.0 ** rng.integers(5, 10)
        if rng.random() < 0.4:
            caps[rng.random(n) < 0.5] = caps.max()  # several at the level
        if rng.random() < 0.05:
            caps[:] = caps[0]  # all at it
        evicting = rng.random(n) < rng.random()
        total = float(caps.sum() * rng.uniform(0.5, 1.0))
        want = _numpy_claims(caps, evicting, total)
        below, at_level = below_level(caps)
        got = None
        if at_level and at_level != n:
            mask = below & evicting
            if mask.any():
                got = (claimed_caps(caps, below, mask, total, at_level), mask, ~below)
        assert (want is None) == (got is None), trial
        if want is not None:
            claimed += 1
            assert want[0].tobytes() == got[0].tobytes() and (want[1] == got[1]).all() and (want[2] == got[2]).all(), trial
    assert claimed > 1000


def _python_clock(self, jobs, crows, left, t0, step, tol, per_job):
    """Simulator._interleave's clock as the Python loop every other cache system runs."""
    from scheduler.sim.engine import python_clock

    python_clock(jobs, self, t0, left, step.now, step.dt, step.caps, tol, step.read, step.remote, step.finished_at)


def test_the_compiled_clock_makes_the_python_clocks_runs(monkeypatch):
    # Five epoch readers of three datasets and a curriculum reader on one full LRU, on a link
    # they contend for at times: the interleaved sub-steps (lru_kernel.lru_clock) hand epoch ends and
    # the curriculum reader's sub-steps back to Python. Every job's JCT, the remote bytes and
    # the cache's evictions are the Python loop's, to the bit.
    from estimator.access import AccessPattern
    from policies import ClusterCapacity, get_policy
    from policies.registry import estimator_for
    from scheduler.sim import lru_kernel
    from scheduler.sim.cache_systems import AlluxioLRUCache
    from scheduler.sim.engine import SimConfig, Simulator
    from traces.model import Trace

    jobs = [TraceJob(f"j{i}", 40.0 * i, 1, "m", f"d{i % 3}", (60 + 25 * i) * MB, 3.0) for i in range(5)]
    jobs.append(TraceJob("c", 10.0, 1, "m", "d3", 100 * MB, 2.0, AccessPattern.curriculum_learning(0.2, 2.0, 50, 64)))
    trace = Trace(tuple(jobs), {"d0": 6 * GB, "d1": 9 * GB, "d2": 4 * GB, "d3": 5 * GB}, item_sizes={"d3": 1e6})
    cap = ClusterCapacity(gpus=6, cache=10 * GB, remote_io=400 * MB, gpus_per_node=6)

    def run():
        sim = Simulator(trace, cap, get_policy("fifo"), estimator_for("alluxio"), "alluxio", SimConfig(resolution=8))  # epochs end inside steps
        result = sim.run()
        return {r.job_id: r.jct_s for r in result.jobs}, result.remote_bytes, sim.cache.evicted_bytes, result.steps

    seen = {"clock": 0, "python": 0, "epoch": 0}
    kernel = lru_kernel.lru_clock

    def counting(*args):
        out = kernel(*args)
        seen["clock"] += 1
        if out[0] >= 0:
            seen["python" if out[3] < 0 else "epoch"] += 1
        return out

    monkeypatch.setattr("scheduler.sim.cache_systems.lru_clock", counting)
    compiled = run()
    assert seen["clock"] > 0 and seen["python"] > 0 and seen["epoch"] > 0, seen  # every path taken
    monkeypatch.setattr(AlluxioLRUCache, "advance_clock", _python_clock)
    python = run()
    assert compiled == python
    assert len(compiled[0]) == 6 and compiled[2] > 0
