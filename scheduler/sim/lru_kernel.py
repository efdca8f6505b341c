"""Alluxio's cluster-wide LRU, compiled (numba): its look-up, a step's look-ups job by job,
and a job's advance through its sub-steps.

Every chunk every job reads is looked up at the time the job starts reading it, and on a full
LRU every miss evicts the least recently used chunk and moves the counts of that chunk's
dataset's readers: in a Fig. 12 run 3.2 million chunks in 1.6 million look-ups, and 290,000
per-job advances of a sub-step each. As Python (an OrderedDict, reader.advance) that was a third
of an Alluxio run; here a step's look-ups and advances are one compiled call, which returns to
Python only where a job's epoch ends (a new permutation: the job's numpy Generator) or the job
needs the Python advance (curriculum draws, preprocessed data).

The LRU order is a doubly linked list over the cache's chunk keys (`nxt`, `prv`; key 0 is the
list's head, so an empty list is nxt[0] == prv[0] == 0): a chunk's key is its dataset's offset
plus its index. Sums are taken in the same order as the loop they replace, so results are
bit-identical to it.
"""

from __future__ import annotations

import numba
import numpy as np

from policies.compiled import kernel
from scheduler.sim.position import CONSUMED, EPOCH_READ, EPOCH_REMOTE, EXPECTED, HIT, LOOKED, POS, REMOTE, SYNCED, TAIL_MISS
from scheduler.sim.reader_rows import MOVED, UNREAD


@kernel()
def _unlink(nxt: np.ndarray, prv: np.ndarray, key: int) -> None:
    before, after = prv[key], nxt[key]
    nxt[before] = after
    prv[after] = before


@kernel()
def _append(nxt: np.ndarray, prv: np.ndarray, key: int) -> None:
    last = prv[0]
    nxt[last] = key
    prv[key] = last
    nxt[key] = 0
    prv[0] = key


F, B, I = numba.float64[:], numba.boolean[:], numba.int64[:]
B2, I2, F2, i8, f8, b1 = numba.boolean[:, :], numba.int64[:, :], numba.float64[:, :], numba.int64, numba.float64, numba.boolean
#: The LRU's state (AlluxioLRUCache.kernel_state): the reader rows' read masks, counts and
#: permutations, then per chunk key cached, next, previous and dataset, then per dataset its
#: cached chunks, first key, chunk bytes and whether it fits the cache at all, then the cached
#: and evicted bytes, the readers' rows per dataset (CSR) and the byte level that evicts.
LRU = numba.types.Tuple((B2, I2, I2, B, I, I, I, I, I, F, B, F, I, I, f8))

#: What lru_advance returns: done; an epoch ended (the job draws its next permutation, then goes
#: on); finished; finished at the end of an epoch (which the job records).
DONE, EPOCH, FINISHED, FINISHED_EPOCH = 0, 1, 2, 3


@kernel(i8(I, i8, i8, LRU))
def lru_access(chunks: np.ndarray, row: int, ds: int, lru: tuple) -> int:
    """The reader in row `row` (reader_rows.py) of dataset `ds` starts reading `chunks`, in this
    order: mark them read, refresh the hits' recency, admit the misses (if the dataset's chunk
    fits the cache) and evict least recently used chunks while the cache holds more than its
    size. Other readers' counts follow every admission and eviction. Returns the hits."""
    (reads, counts, _, cached, nxt, prv, key_ds, ds_counts, offsets, ds_size, admit, totals, reader_ptr, reader_rows,
     full) = lru
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
        if not admit[ds]:
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


@kernel(numba.types.Tuple((i8, f8, i8))(i8, i8, i8, i8, i8, f8, f8, f8, f8, f8, f8, f8, i8, b1, F, F2, LRU))
def lru_advance(row: int, crow: int, ds: int, k: int, substep: int, s: float, ideal: float, total: float, io_cap: float,
                now: float, dt: float, t: float, substeps: int, decrement: bool, res: np.ndarray, state: np.ndarray,
                lru: tuple) -> tuple[int, float, int]:
    """reader.advance for an epoch reader of this LRU (every chunk is volatile; not curriculum,
    not preprocessed): its position is row `row` of the job table's `state`, its reader row
    `crow`; `substeps` -1 for no limit, `substep` its chunks per sub-step. Goes on from `t`
    seconds into the step and adds to `res` (bytes read, bytes fetched, finished at, elapsed),
    as advance's StepResult. Returns (DONE/EPOCH/FINISHED/FINISHED_EPOCH, t, substeps left);
    after EPOCH the caller starts the job's next epoch and calls again with `decrement` False
    (the sub-step it was in has been counted)."""
    counts, perms = lru[1], lru[2]
    consumed, pos, remote, hit = state[row, CONSUMED], state[row, POS], state[row, REMOTE], state[row, HIT]
    epoch_read, epoch_remote, tail_miss = state[row, EPOCH_READ], state[row, EPOCH_REMOTE], state[row, TAIL_MISS]
    looked = np.int64(state[row, LOOKED])
    code = DONE
    while dt - t > 1e-9 * max(dt, 1.0) and total > consumed:
        if substeps >= 0 and decrement:
            if substeps <= 0:
                break
            substeps -= 1
        decrement = True
        if pos >= k - 1e-9:
            code = EPOCH
            break
        p = pos
        left = k - looked
        if left > 0:
            unread = float(counts[crow, UNREAD])  # SimJob.unread_expected(volatile=True)
            state[row, EXPECTED] = unread
            state[row, SYNCED] = unread
            m = 1.0 - unread / left
        else:
            m = tail_miss
        reach = np.floor(p + 1e-9) + substep
        m = 0.0 if m < 1e-12 else (1.0 if m > 1.0 else m)
        tail_miss = m
        if m == 0.0:
            rate = ideal
        elif io_cap > 0:
            rate = min(ideal, io_cap / m)
        else:
            rate = 0.0
        if rate <= 0:
            t = dt
            break
        x_need = p + (total - consumed) / s
        x = min(min(min(p + rate * (dt - t) / s, x_need), float(k)), reach)
        if x <= p:
            t = dt
            break
        finishing = x >= x_need - 1e-9
        last = min(k, np.int64(np.ceil(x - (1e-12 if finishing else 1e-9))))
        done = (x - p) * s
        missed = m * done
        if last > looked:
            unread = float(counts[crow, UNREAD])
            state[row, EXPECTED] = unread
            state[row, SYNCED] = unread
            n_hits = lru_access(perms[crow, looked:last], crow, ds, lru)
            state[row, SYNCED] = float(np.int64(state[row, SYNCED]) - n_hits)  # SimJob.looked_up
            before = k - looked
            state[row, EXPECTED] = state[row, EXPECTED] * (k - last) / before if before > 0 else 0.0
            fetched = float((last - looked) - n_hits) * s  # SimJob.fetched
            looked = last
            state[row, LOOKED] = last
        else:
            fetched = 0.0  # inside a chunk looked up (and counted) before
        consumed += done
        remote += missed
        hit += done - missed
        epoch_read += done
        epoch_remote += missed
        res[0] += done
        res[1] += fetched
        pos = x
        t += done / rate
        if finishing or total - consumed <= 1e-9 * total:
            consumed = total
            code = FINISHED_EPOCH if pos >= k - 1e-6 else FINISHED
            res[2] = now + t
            break
    state[row, CONSUMED], state[row, POS], state[row, REMOTE], state[row, HIT] = consumed, pos, remote, hit
    state[row, EPOCH_READ], state[row, EPOCH_REMOTE], state[row, TAIL_MISS] = epoch_read, epoch_remote, tail_miss
    res[3] = t
    return code, t, substeps


@kernel(numba.types.Tuple((i8, i8, i8, i8, f8, i8))(
    I, i8, i8, b1, B, I, I, I, I, I, I, LRU, B, I, F, F, F, F, I, F, f8, f8, i8, F2, F, F, F, F, B, F))
def lru_turns(turns: np.ndarray, at: int, prev: int, changed: bool, simple: np.ndarray, unread: np.ndarray, crows: np.ndarray,
              lo: np.ndarray, hi: np.ndarray, ds_of: np.ndarray, hits: np.ndarray, lru: tuple, python: np.ndarray,
              slots: np.ndarray, k: np.ndarray, s: np.ndarray, ideal: np.ndarray, total: np.ndarray, substep: np.ndarray,
              caps: np.ndarray, now: float, dt: float, substeps: int, state: np.ndarray, read: np.ndarray,
              remote: np.ndarray, finished_at: np.ndarray, elapsed: np.ndarray, applied: np.ndarray,
              res: np.ndarray) -> tuple[int, int, int, int, float, int]:
    """SimCacheSystem.look_up_in_turn's loop from turn `at` (`turns` ends with len(simple)),
    with `lru_access` for the look-ups and `lru_advance` for the jobs the per-job advance takes
    (their results into `read`/`remote`/`finished_at`/`elapsed`, `applied` cleared), until a job
    needs Python: returns (its position or -1 at the end, the turn to go on from, `prev`, and
    what it needs: -1 the per-job `advance` (`python` jobs), else lru_advance's EPOCH or
    FINISHED_EPOCH with its t and substeps left, `res` holding its results so far)."""
    n = len(simple)
    counts, perms = lru[1], lru[2]
    while True:
        q = turns[at]
        i = -1
        if changed:
            for j in range(prev, q):
                if counts[crows[j], UNREAD] != unread[j]:
                    i = j
                    break
        if i >= 0:
            prev = i + 1
        else:
            if q == n:
                return -1, at, prev, DONE, 0.0, 0
            prev = q + 1
            changed = True
            at += 1
            row = crows[q]
            if simple[q] and counts[row, UNREAD] == unread[q]:
                hits[q] = lru_access(perms[row, lo[q]:hi[q]], row, ds_of[q], lru)
                continue
            i = q
        applied[i] = False
        if python[i]:
            return i, at, prev, -1, 0.0, 0
        res[0], res[1], res[2], res[3] = 0.0, 0.0, np.nan, 0.0
        code, t, left = lru_advance(slots[i], crows[i], ds_of[i], np.int64(k[i]), substep[i], s[i], ideal[i], total[i], caps[i],
                                    now, dt, 0.0, substeps, True, res, state, lru)
        if code == EPOCH or code == FINISHED_EPOCH:
            return i, at, prev, code, t, left
        read[i], remote[i], finished_at[i], elapsed[i] = res[0], res[1], res[2], res[3]


@kernel()
def _before(ta: float, ia: int, tb: float, ib: int) -> bool:
    return ta < tb or (ta == tb and ia < ib)


@kernel()
def _push(heap_t: np.ndarray, heap_i: np.ndarray, size: int, t: float, i: int) -> int:
    at = size
    while at > 0:
        up = (at - 1) >> 1
        if not _before(t, i, heap_t[up], heap_i[up]):
            break
        heap_t[at], heap_i[at] = heap_t[up], heap_i[up]
        at = up
    heap_t[at], heap_i[at] = t, i
    return size + 1


@kernel()
def _pop(heap_t: np.ndarray, heap_i: np.ndarray, size: int) -> int:
    """Removes the heap's least (t, i), which the caller read from heap_t[0], heap_i[0]; returns the new size."""
    size -= 1
    t, i = heap_t[size], heap_i[size]
    at = 0
    while True:
        child = 2 * at + 1
        if child >= size:
            break
        if child + 1 < size and _before(heap_t[child + 1], heap_i[child + 1], heap_t[child], heap_i[child]):
            child += 1
        if not _before(heap_t[child], heap_i[child], t, i):
            break
        heap_t[at], heap_i[at] = heap_t[child], heap_i[child]
        at = child
    if size > 0:
        heap_t[at], heap_i[at] = t, i
    return size


@kernel()
def _settle(heap_t: np.ndarray, heap_i: np.ndarray, size: int, i: int, t: float, dt: float, tol: float, read: np.ndarray,
            remote: np.ndarray, finished_at: np.ndarray, res: np.ndarray) -> int:
    """A sub-step's results (`res`) into the step's; the job back on the clock if it has step left."""
    read[i] += res[0]
    remote[i] += res[1]
    t += max(res[3], 0.0)
    if not np.isnan(res[2]):
        finished_at[i] = res[2]
    elif dt - t > tol and res[3] > 0:
        size = _push(heap_t, heap_i, size, t, i)
    return size


@kernel(numba.types.Tuple((i8, i8, f8, i8, f8, i8))(
    F, I, i8, i8, f8, B, I, I, I, F, I, F, F, F, F, f8, f8, f8, F2, F, F, F, F, LRU))
def lru_clock(heap_t: np.ndarray, heap_i: np.ndarray, size: int, pending: int, pending_t: float, python: np.ndarray,
              slots: np.ndarray, crows: np.ndarray, ds_of: np.ndarray, k: np.ndarray, substep: np.ndarray, s: np.ndarray,
              ideal: np.ndarray, total: np.ndarray, caps: np.ndarray, now: float, dt: float, tol: float, state: np.ndarray,
              read: np.ndarray, remote: np.ndarray, finished_at: np.ndarray, res: np.ndarray,
              lru: tuple) -> tuple[int, int, float, int, float, int]:
    """Simulator._interleave's clock: the jobs' later sub-steps, earliest (t, position) first,
    each `advance(job, now + t, dt - t, cap, substeps=1)` (`lru_advance` for epoch readers),
    its results added to `read`/`remote`/`finished_at`, the job back on the clock while it has
    step left. The clock is a binary heap in `heap_t`/`heap_i` (`size` entries): a heap pops
    the same least (t, position) whatever its layout, so the order is heapq's.

    Returns to Python where a job needs it: (its position or -1 once the clock is empty, the
    heap's size, the job's t, what it needs: -1 the per-job `advance` (`python` jobs), else
    lru_advance's EPOCH or FINISHED_EPOCH with its t within the call and substeps left, `res`
    holding its results so far). The caller finishes that sub-step into `res` and calls again
    with `pending` its position and `pending_t` its t."""
    if pending >= 0:
        size = _settle(heap_t, heap_i, size, pending, pending_t, dt, tol, read, remote, finished_at, res)
    while size > 0:
        t, i = heap_t[0], heap_i[0]
        size = _pop(heap_t, heap_i, size)
        res[0], res[1], res[2], res[3] = 0.0, 0.0, np.nan, 0.0
        if python[i]:
            return i, size, t, -1, 0.0, 0
        code, t_in, left = lru_advance(slots[i], crows[i], ds_of[i], np.int64(k[i]), substep[i], s[i], ideal[i], total[i],
                                       caps[i], now + t, dt - t, 0.0, 1, True, res, state, lru)
        if code == EPOCH or code == FINISHED_EPOCH:
            return i, size, t, code, t_in, left
        size = _settle(heap_t, heap_i, size, i, t, dt, tol, read, remote, finished_at, res)
    return -1, 0, 0.0, DONE, 0.0, 0
