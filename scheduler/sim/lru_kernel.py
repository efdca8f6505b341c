"""Alluxio's cluster-wide LRU look-up, compiled (numba).

Every chunk every job reads is looked up at the time the job starts reading it, and on a full
LRU every miss evicts the least recently used chunk and moves the counts of that chunk's
dataset's readers: in a Fig. 12 run 3.2 million chunks in 1.6 million look-ups. As a Python loop
over an OrderedDict this was a fifth of an Alluxio run; here it is one compiled call per look-up.

The LRU order is a doubly linked list over the cache's chunk keys (`nxt`, `prv`; key 0 is the
list's head, so an empty list is nxt[0] == prv[0] == 0): a chunk's key is its dataset's offset
plus its index. Sums are taken in the same order as the loop they replace, so results are
bit-identical to it.
"""

from __future__ import annotations

import numba
import numpy as np

from scheduler.sim.reader_rows import MOVED, UNREAD


@numba.njit(cache=True, error_model="numpy")
def _unlink(nxt: np.ndarray, prv: np.ndarray, key: int) -> None:
    before, after = prv[key], nxt[key]
    nxt[before] = after
    prv[after] = before


@numba.njit(cache=True, error_model="numpy")
def _append(nxt: np.ndarray, prv: np.ndarray, key: int) -> None:
    last = prv[0]
    nxt[last] = key
    prv[key] = last
    nxt[key] = 0
    prv[0] = key


F, B, I = numba.float64[:], numba.boolean[:], numba.int64[:]
B2, I2, i8 = numba.boolean[:, :], numba.int64[:, :], numba.int64


# The signatures compile (or load from numba's cache) at import, not inside a run's first step.
@numba.njit(i8(I, i8, i8, numba.boolean, numba.float64, B2, I2, B, I, I, I, I, I, F, F, I, I), cache=True, error_model="numpy")
def lru_access(chunks: np.ndarray, row: int, ds: int, admit: bool, full: float, reads: np.ndarray, counts: np.ndarray,
               cached: np.ndarray, ds_counts: np.ndarray, nxt: np.ndarray, prv: np.ndarray, key_ds: np.ndarray,
               offsets: np.ndarray, ds_size: np.ndarray, totals: np.ndarray, reader_ptr: np.ndarray, reader_rows: np.ndarray) -> int:
    """The reader in row `row` (reader_rows.py) of dataset `ds` starts reading `chunks`, in this
    order: mark them read, refresh the hits' recency, admit the misses (if `admit`) and evict
    least recently used chunks while the cache holds more than `full` bytes. Other readers'
    counts follow every admission and eviction (`reader_ptr`/`reader_rows`: each dataset's
    readers' rows, CSR). `totals` holds the cached and evicted bytes. Returns the hits."""
    hits = 0
    total, evicted = totals[0], totals[1]
    key0, size = offsets[ds], ds_size[ds]
    for c in chunks:
        reads[row, c] = True
        key = key0 + c
        if cached[key]:
            hits += 1
            counts[row, UNREAD] -= 1
            _unlink(nxt, prv, key)
            _append(nxt, prv, key)
            continue
        if not admit:
            continue
        cached[key] = True
        ds_counts[ds] += 1
        _append(nxt, prv, key)
        total += size
        for j in range(reader_ptr[ds], reader_ptr[ds + 1]):
            other = reader_rows[j]
            if other != row and not reads[other, c]:
                counts[other, UNREAD] += 1
                counts[other, MOVED] += 1
        while total > full and nxt[0] != 0:
            victim = nxt[0]
            _unlink(nxt, prv, victim)
            vds = key_ds[victim]
            vc = victim - offsets[vds]
            cached[victim] = False
            ds_counts[vds] -= 1
            vsize = ds_size[vds]
            total -= vsize
            evicted += vsize
            for j in range(reader_ptr[vds], reader_ptr[vds + 1]):
                reader = reader_rows[j]
                if not reads[reader, vc]:
                    counts[reader, UNREAD] -= 1
                    counts[reader, MOVED] += 1
    totals[0], totals[1] = total, evicted
    return hits


@numba.njit(numba.types.UniTuple(i8, 3)(I, i8, i8, numba.boolean, B, I, I, I, I, I, B, numba.float64, I, I2, B2, I2, B, I, I, I, I,
                                          I, F, F, I, I), cache=True, error_model="numpy")
def lru_turns(turns: np.ndarray, at: int, prev: int, changed: bool, simple: np.ndarray, unread: np.ndarray, crows: np.ndarray,
              lo: np.ndarray, hi: np.ndarray, ds_of: np.ndarray, admit: np.ndarray, full: float, hits: np.ndarray,
              perms: np.ndarray, reads: np.ndarray, counts: np.ndarray, cached: np.ndarray, ds_counts: np.ndarray,
              nxt: np.ndarray, prv: np.ndarray, key_ds: np.ndarray, offsets: np.ndarray, ds_size: np.ndarray,
              totals: np.ndarray, reader_ptr: np.ndarray, reader_rows: np.ndarray) -> tuple[int, int, int]:
    """SimCacheSystem.look_up_in_turn's loop from turn `at` (`turns` ends with len(simple)),
    with `lru_access` for the look-ups, until a job must be advanced by the per-job `advance`:
    returns (that job's position or -1 at the end, the turn to go on from, `prev`)."""
    n = len(simple)
    while True:
        q = turns[at]
        if changed:
            for i in range(prev, q):
                if counts[crows[i], UNREAD] != unread[i]:
                    return i, at, i + 1
        if q == n:
            return -1, at, prev
        prev = q + 1
        changed = True
        row = crows[q]
        if not simple[q] or counts[row, UNREAD] != unread[q]:
            return q, at + 1, prev
        ds = ds_of[q]
        hits[q] = lru_access(perms[row, lo[q]:hi[q]], row, ds, admit[ds], full, reads, counts, cached, ds_counts, nxt, prv,
                             key_ds, offsets, ds_size, totals, reader_ptr, reader_rows)
        at += 1
