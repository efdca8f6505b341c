"""A step's column arithmetic, compiled (numba): the column advance and its results
(engine._advance_vector), the miss ratios, the next event, the step bound from drift, the job
table's sync of expected cached unread chunks, and what a step leaves in the job table.

Under an LRU the engine advances jobs in interleaved sub-steps, about two column advances per
step and 36,000 in a Fig. 12 Alluxio run, each over ~80 jobs: as some fifty numpy operations on
short columns, their per-call cost was a tenth of the run. Here each is one pass over the jobs.
Each value is computed with the same operations in the same order as the numpy expressions it
replaces (`np_min` and `np_max` are np.minimum and np.maximum: a NaN wins; a sum adds left to
right where the numpy one did), so results are bit-identical.
"""

from __future__ import annotations

import numba
import numpy as np

from policies.compiled import kernel, np_max, np_min
from scheduler.sim.reader_rows import MOVED
from scheduler.sim.position import (BOUND, CONSUMED, DRIFT_M, DRIFT_T, EPOCH_READ, EPOCH_REMOTE, EXPECTED, HIT, LOOKED, POS, REMOTE, SYNCED,
                                    TAIL_MISS)


F, B, I = numba.float64[:], numba.boolean[:], numba.int64[:]  # any layout: positions are strided columns of the job table


@kernel(numba.int64(F, F, F, F, F, F, F, F, F, numba.float64, numba.float64, numba.float64, B, B, F, F, B, I, F, F, F, B, B, B,
                    F, F, F, F, B, I, I, F, I, I))
def column_step(k: np.ndarray, s: np.ndarray, ideal: np.ndarray, p: np.ndarray, looked: np.ndarray, unread: np.ndarray,
                total: np.ndarray, consumed: np.ndarray, caps: np.ndarray, dt: float, tol: float, sub_step: float,
                reach_sub: np.ndarray, scalar: np.ndarray, m: np.ndarray, x: np.ndarray, finishing: np.ndarray,
                last: np.ndarray, done: np.ndarray, missed: np.ndarray, t: np.ndarray, simple: np.ndarray,
                stalled: np.ndarray, looks: np.ndarray, read: np.ndarray, remote: np.ndarray, finished_at: np.ndarray,
                elapsed: np.ndarray, applied: np.ndarray, hits: np.ndarray, visit: np.ndarray, unread_real: np.ndarray,
                looked_i: np.ndarray, unread_i: np.ndarray) -> int:
    """One stretch of every job's epoch at its miss ratio now, as reader.advance reads it
    (see engine._advance_vector for what each output is). `sub_step` > 0: each job's first
    sub-step only, `reach_sub` the jobs whose stretch ends after sub_step of an epoch.

    Also the step's starting results (the columns' stretch for the jobs it is `applied` to,
    nothing yet for the others), `hits` cleared (-1), the positions of the jobs to `visit` in
    turn (those that look chunks up or need the per-job advance; returns how many), and the
    looked-up and cached-unread counts as integers, as the turn loop takes them."""
    n_visit = 0
    for i in range(len(k)):
        left = k[i] - looked[i]
        mi = 1.0 - unread[i] / left
        mi = 0.0 if mi < 1e-12 else (1.0 if mi > 1.0 else mi)
        if mi == 0.0:
            rate = ideal[i]
        elif caps[i] > 0:
            rate = np_min(ideal[i], caps[i] / mi)
        else:
            rate = 0.0
        pi = p[i]
        x_need = pi + (total[i] - consumed[i]) / s[i]
        xi = np_min(np_min(pi + rate * dt / s[i], x_need), k[i])
        if sub_step > 0:
            xi = np_min(xi, np.floor(pi + 1e-9) + (max(1.0, np.floor(k[i] * sub_step)) if reach_sub[i] else k[i]))
        fin = xi >= x_need - 1e-9
        lst = np_min(k[i], np.ceil(xi - (1e-12 if fin else 1e-9)))
        d = (xi - pi) * s[i]
        ti = d / rate
        open_ = not scalar[i] and left > 0 and pi < k[i] - 1e-9
        simp = open_ and rate > 0 and xi > pi and (fin or not (dt - ti > tol))
        m[i], x[i], finishing[i], done[i], missed[i], t[i] = mi, xi, fin, d, mi * d, ti
        simple[i] = simp
        stalled[i] = open_ and (rate <= 0 or xi <= pi)
        last[i] = np.int64(lst) if simp else 0
        looks[i] = simp and last[i] > looked[i]
        read[i] = d if simp else 0.0
        remote[i] = 0.0
        finished_at[i] = np.nan
        elapsed[i] = ti if simp else dt
        applied[i] = simp
        hits[i] = -1
        if looks[i] or not (simp or stalled[i]):
            visit[n_visit] = i
            n_visit += 1
        looked_i[i] = np.int64(looked[i])
        unread_i[i] = np.int64(unread_real[i])
    return n_visit


@kernel(numba.void(I, I, F, F, I, F, B, F, F, F, F, B, F, numba.float64[:, :], F, B))
def column_apply(hits: np.ndarray, slots: np.ndarray, k: np.ndarray, looked: np.ndarray, last: np.ndarray, s: np.ndarray,
                 applied: np.ndarray, done: np.ndarray, missed: np.ndarray, x: np.ndarray, m: np.ndarray, finishing: np.ndarray,
                 total: np.ndarray, state: np.ndarray, remote: np.ndarray, ending: np.ndarray) -> None:
    """The column advance's results in the job table's `state`: for each job that looked
    chunks up (`hits` >= 0), SimJob.looked_up and SimJob.fetched (into `remote`); for each job
    whose step was the columns' (`applied`), its position as advance() moves it, and whether it
    finished (`ending`)."""
    for i in range(len(hits)):
        row = slots[i]
        if hits[i] >= 0:
            n_hits, hi = float(hits[i]), float(last[i])
            state[row, SYNCED] -= n_hits
            state[row, EXPECTED] = state[row, EXPECTED] * (k[i] - hi) / (k[i] - looked[i])
            state[row, LOOKED] = hi
            remote[i] = (hi - looked[i] - n_hits) * s[i]
        ending[i] = False
        if applied[i]:
            d, miss = done[i], missed[i]
            state[row, CONSUMED] += d
            state[row, REMOTE] += miss
            state[row, HIT] += d - miss
            state[row, EPOCH_READ] += d
            state[row, EPOCH_REMOTE] += miss
            state[row, POS] = x[i]
            state[row, TAIL_MISS] = m[i]
            ending[i] = finishing[i] or total[i] - state[row, CONSUMED] <= 1e-9 * total[i]


@kernel(numba.void(numba.float64[:, :], I, F, B, F, F, F))
def sync_expected(state: np.ndarray, slots: np.ndarray, unread: np.ndarray, volatile: np.ndarray, k: np.ndarray,
                  looked: np.ndarray, expected: np.ndarray) -> None:
    """JobTable.sync on the job table's `state`: each job's expected cached unread chunks take in
    what its count `unread` moved since it was last synced (bounded by its unread chunks), or
    are the count itself where `volatile`; `looked` and `expected` get each job's."""
    for i in range(len(slots)):
        row = slots[i]
        lk, exp, u = state[row, LOOKED], state[row, EXPECTED], unread[i]
        delta = u - state[row, SYNCED]
        if volatile[i]:
            exp = u
        elif delta != 0:
            exp = np_min(np_max(exp + delta, 0.0), np_max(k[i] - lk, 0.0))
        state[row, EXPECTED] = exp
        state[row, SYNCED] = u
        looked[i], expected[i] = lk, exp


@kernel(numba.int64(F, F, F, B, F, I))
def miss_ratios(k: np.ndarray, looked: np.ndarray, unread: np.ndarray, curriculum: np.ndarray, m: np.ndarray,
                ask: np.ndarray) -> int:
    """Each job's miss ratio on the rest of its epoch into `m`, 1 - unread / (chunks left),
    within [0, 1]; the positions of the jobs whose job must answer instead (at the epoch's very
    end, or curriculum reads) into `ask`; returns how many."""
    n_ask = 0
    for i in range(len(k)):
        left = k[i] - looked[i]
        m[i] = np_min(np_max(1.0 - unread[i] / left, 0.0), 1.0)
        if left <= 0 or curriculum[i]:
            ask[n_ask] = i
            n_ask += 1
    return n_ask


@kernel(numba.float64(F, F, F, F, F, numba.boolean, F, F, F, F, F, F, F, B, F, numba.float64))
def seconds_to_event(m: np.ndarray, ideal: np.ndarray, caps: np.ndarray, total: np.ndarray, consumed: np.ndarray, contended: bool,
                     visible: np.ndarray, room: np.ndarray, k: np.ndarray, looked: np.ndarray, unread: np.ndarray, pos: np.ndarray,
                     chunk: np.ndarray, curriculum: np.ndarray, growth: np.ndarray, demand_change: float) -> float:
    """The earliest SimJob.seconds_to_event over the jobs (engine._seconds_to_event): each
    job's bytes to its next event at the rate it reads now. Where the link is `contended`, an
    event is also where a job's miss ratio would move by `demand_change` once its room is
    taken (`visible` cached chunks, `room` it may still add, `unread` cached unread chunks),
    and a curriculum job's next growth of its eligible set (`growth`, bytes). A NaN anywhere
    makes the minimum NaN, as numpy's does."""
    best = np.inf
    for i in range(len(m)):
        mi = m[i]
        if mi <= 1e-12:
            rate = ideal[i]
        elif caps[i] > 0:
            rate = np_min(ideal[i], caps[i] / mi)
        else:
            rate = 0.0
        left = total[i] - consumed[i]
        if contended:
            ki = k[i]
            misses_left = (ki - looked[i]) - unread[i]
            next_miss = 1.0 - (visible[i] + np_min(room[i], misses_left)) / ki
            if abs(next_miss - mi) > demand_change:
                left = np_min(left, (ki - pos[i]) * chunk[i])
            if curriculum[i]:
                whole = total[i] - consumed[i]
                left = growth[i] if growth[i] < whole else whole  # Python's min
        seconds = np_max(left, 0.0) / rate if rate > 0 else np.inf
        if seconds != seconds:
            return seconds
        if seconds < best:
            best = seconds
    return best


@kernel(numba.float64(numba.float64[:, :], I, F, F, F, B, numba.boolean, numba.float64, numba.float64, numba.float64))
def drift_bound(state: np.ndarray, slots: np.ndarray, k: np.ndarray, looked: np.ndarray, chunk: np.ndarray, moves: np.ndarray,
                measured: bool, tol: float, link: float, floor: float) -> float:
    """engine._step_limit's bound from drift, over the jobs that `moves` (inf: none): a job
    whose drift was `measured` (a step before, with time counted) may move its miss ratio by
    `tol` at its drift's rate; one without, by `tol` x its unread bytes (at least `floor` of
    an epoch) over the link. A NaN anywhere makes the minimum NaN, as numpy's does."""
    best = np.inf
    for i in range(len(slots)):
        if not moves[i]:
            continue
        row = slots[i]
        drift_t = state[row, DRIFT_T]
        if measured and drift_t > 0:
            drift = state[row, DRIFT_M] / drift_t
            bound = tol / drift if drift > tol * 1e-12 else np.inf
        else:
            bound = tol * (np_max(k[i] - looked[i], k[i] * floor) * chunk[i]) / link
        if bound != bound:
            return bound
        if bound < best:
            best = bound
    return best


@kernel(numba.types.UniTuple(numba.float64, 3)(F, numba.float64, numba.float64, F, F, B, I, I, numba.float64[:, :], numba.int64[:, :], I,
                                               F, F, numba.float64, numba.float64, F, F, F))
def step_results(finished_at: np.ndarray, now: float, dt: float, read: np.ndarray, remote: np.ndarray, irregular: np.ndarray,
                 slots: np.ndarray, bounds: np.ndarray, state: np.ndarray, counts: np.ndarray, crows: np.ndarray, k: np.ndarray,
                 looked: np.ndarray, floor: float, memory: float, ran: np.ndarray, rates: np.ndarray,
                 last_rate: np.ndarray) -> tuple[float, float, float]:
    """What a step leaves in the job table (engine.run): each job's time run (`ran`, to its
    finish within the step) and rate, counted against its bound resource (`bounds`: the
    BOUND column's offset), the drift of its miss ratio (the changes others made to its count,
    per unread chunk at the step's start: at least `floor` of an epoch), averaged with weight
    `memory` on the past. Returns the bytes read, fetched, and fetched by irregular jobs, each
    summed left to right as a loop over the jobs adds them (as np.add.accumulate, not np.sum's
    pairwise sum)."""
    step_bytes = step_remote = step_irregular = 0.0
    first_irregular = True
    for i in range(len(slots)):
        fa = finished_at[i]
        r = np_max(fa - now, 1e-9) if fa == fa else dt
        ran[i] = r
        rates[i] = read[i] / r
        row = slots[i]
        state[row, BOUND + bounds[i]] += r
        unread0 = np_max(k[i] - looked[i], k[i] * floor)
        state[row, DRIFT_M] = memory * state[row, DRIFT_M] + float(counts[crows[i], MOVED]) / unread0
        state[row, DRIFT_T] = memory * state[row, DRIFT_T] + dt
        last_rate[row] = rates[i]
        if i == 0:
            step_bytes, step_remote = read[0], remote[0]  # np.add.accumulate starts from the first element
        else:
            step_bytes += read[i]
            step_remote += remote[i]
        if irregular[i]:
            if first_irregular:
                step_irregular, first_irregular = remote[i], False
            else:
                step_irregular += remote[i]
    return step_bytes, step_remote, step_irregular
