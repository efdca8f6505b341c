"""The uniform caches' look-ups (SiloD's and Quiver's per-dataset domains, CoorDL's per-job
ones), compiled (numba): a step's look-ups job by job, as SimCacheSystem.look_up_in_turn makes
them in Python.

A uniform domain admits a missed chunk while it holds fewer than its limit and never evicts at a
look-up, so a look-up only marks chunks read, counts hits, admits misses and moves the counts of
the domain's other readers whose epoch has not read an admitted chunk yet. In a Fig. 12 run that
is 450,000-970,000 look-ups; as Python (SiloDCache.access, `_changed`) a tenth of a uniform run.

The domains' cached chunks are regions of one array (cache_systems.ChunkPool): a domain is a
slot with an offset into it, and its count and limit, which the caller copies in from the domain
objects before the loop and back out after it (the objects stay the truth outside a step). The
loop returns to Python where a job needs the per-job advance or a look-up in an LRU domain.
"""

from __future__ import annotations

import numba
import numpy as np

from policies.compiled import kernel
from scheduler.sim.reader_rows import MOVED, UNREAD

#: A reader's domain code where it has no slot: no domain (its look-ups only mark chunks read),
#: or a domain the loop leaves to Python (an LRU domain: SiloDCache._access_lru).
NO_DOMAIN, PYTHON_DOMAIN = -1, -2
#: What uniform_turns hands back to Python for a job: its per-job advance, or its look-up.
PER_JOB, LOOK_UP = 0, 1

B, I = numba.boolean[:], numba.int64[:]
B2, I2, i8, b1 = numba.boolean[:, :], numba.int64[:, :], numba.int64, numba.boolean


@kernel(i8(I, i8, i8, B2, I2, B, I, I, I, I, I))
def uniform_access(chunks: np.ndarray, row: int, d: int, reads: np.ndarray, counts: np.ndarray, cached: np.ndarray,
                   offset: np.ndarray, count: np.ndarray, limit: np.ndarray, r_ptr: np.ndarray, r_rows: np.ndarray) -> int:
    """The reader in row `row` of domain slot `d` (NO_DOMAIN: none) starts reading `chunks` (distinct, in
    this order): mark them read, count the hits, admit the misses while the domain is under its
    limit, and move the counts of the domain's readers (`r_rows[r_ptr[d]:r_ptr[d + 1]]`) that have
    not read an admitted chunk. Returns the hits. One chunk at a time gives what
    `_access_uniform` and `_changed` give for the whole look-up: its chunks are distinct, so an
    admission changes no later chunk's hit, and only the reader itself marks chunks read."""
    hits = 0
    for c in chunks:
        reads[row, c] = True
        if d < 0:
            continue
        key = offset[d] + c
        if cached[key]:
            hits += 1
            counts[row, UNREAD] -= 1
        elif count[d] < limit[d]:
            cached[key] = True
            count[d] += 1
            for j in range(r_ptr[d], r_ptr[d + 1]):
                r = r_rows[j]
                if not reads[r, c]:
                    counts[r, UNREAD] += 1
                    counts[r, MOVED] += 1
    return hits


@kernel(numba.types.Tuple((i8, i8, i8, i8))(I, i8, i8, b1, B, I, I, I, I, I, I, B2, I2, I2, B, I, I, I, I, I))
def uniform_turns(turns: np.ndarray, at: int, prev: int, changed: bool, simple: np.ndarray, unread: np.ndarray, crows: np.ndarray,
                  lo: np.ndarray, hi: np.ndarray, dom_of: np.ndarray, hits: np.ndarray, reads: np.ndarray, counts: np.ndarray,
                  perms: np.ndarray, cached: np.ndarray, offset: np.ndarray, count: np.ndarray, limit: np.ndarray, r_ptr: np.ndarray,
                  r_rows: np.ndarray) -> tuple[int, int, int, int]:
    """SimCacheSystem.look_up_in_turn's loop from turn `at` (`turns` ends with len(simple)), with
    `uniform_access` for the look-ups, until a job needs Python: returns (its position or -1 at
    the end, the turn to go on from, `prev`, PER_JOB or LOOK_UP). `dom_of`: each job's domain
    slot or code."""
    n = len(simple)
    while True:
        q = turns[at]
        if changed:
            for j in range(prev, q):
                if counts[crows[j], UNREAD] != unread[j]:
                    return j, at, j + 1, PER_JOB
        if q == n:
            return -1, at, prev, PER_JOB
        prev = q + 1
        changed = True
        at += 1
        row = crows[q]
        if not simple[q] or counts[row, UNREAD] != unread[q]:
            return q, at, prev, PER_JOB
        d = dom_of[q]
        if d == PYTHON_DOMAIN:
            return q, at, prev, LOOK_UP
        hits[q] = uniform_access(perms[row, lo[q]:hi[q]], row, d, reads, counts, cached, offset, count, limit, r_ptr, r_rows)
