"""Gavel's loops compiled (numba): the cache knapsack and miss ratios of the max-min solve, the
water-filling levels and the bisection that spreads GPU time. Each does what its numpy form in
gavel.py's history did, float for float: the same elementwise operations, numpy's summation
order (compiled.pairwise_sum), numpy's min, max and clip semantics and a stable sort, so every
allocation is bit-identical to it (tests/test_gavel_kernel.py holds the numpy forms and compares
them on random problems). At ~10 levels and 60 bisection steps a decision, each a few numpy
calls over ~300 jobs and datasets, the numpy forms were a fifth of a Gavel simulation.

gavel.py imports this module on first use, so a process that never runs Gavel (the service's
API workers) does not load numba.
"""

from __future__ import annotations

import numpy as np

from policies.compiled import kernel, np_max, np_min, pairwise_sum

#: Steps of the bisection on the common factor (its result defines spread_gpu_time's).
BISECTION_STEPS = 60

#: Relative tolerance of the water-filling levels: a job at (1 - TOL) of its GPU-limited
#: throughput is at its cap; a resource with at most TOL of it left is used up.
TOL = 1e-9


@kernel()
def water_fill_levels(target: np.ndarray, ref: np.ndarray, f: np.ndarray, g: np.ndarray, miss: np.ndarray, per_core: np.ndarray,
                      total_gpus: float, total_io: float, total_cpus: float, storage: bool, cpu: bool) -> None:
    """Raise `target` (in place, from t* ref) level by level as gavel.water_fill describes:
    all unfrozen jobs grow at the same ratio of their reference `ref` until a resource binds
    (GPUs: stop; remote IO: jobs with misses freeze; cores: CPU-bound jobs freeze) or a job
    reaches its GPU-limited throughput `f` (it freezes). `storage`: IO is a resource; `cpu`: some
    job is CPU-bound (without, the CPU sums are exactly 0 and skipped)."""
    n = ref.size
    frozen = np.empty(n, dtype=np.bool_)
    top = np.empty(n)  # a job's cap, within TOL
    gpu_per_ref = np.empty(n)  # GPUs, IO and cores per unit of the ratio, per job
    io_per_ref = np.empty(n)
    cpu_per_ref = np.empty(n)
    for j in range(n):
        frozen[j] = ref[j] <= 0
        top[j] = f[j] * (1 - TOL)
        gpu_per_ref[j] = g[j] * ref[j] / f[j]
        io_per_ref[j] = ref[j] * miss[j]
        cpu_per_ref[j] = ref[j] * per_core[j]
    terms = np.empty(n)  # one sum's terms
    grow = np.empty(n, dtype=np.int64)
    for _ in range(n + 2):  # each level freezes a job or ends
        for j in range(n):
            terms[j] = g[j] * target[j] / f[j]
        gpu_left = total_gpus - pairwise_sum(terms, n)
        io_left = np.inf
        if storage:
            for j in range(n):
                terms[j] = target[j] * miss[j]
            io_left = total_io - pairwise_sum(terms, n)
        cpu_used = 0.0
        if cpu:
            for j in range(n):
                terms[j] = target[j] * per_core[j]
            cpu_used = pairwise_sum(terms, n)
        cpu_left = total_cpus - cpu_used
        for j in range(n):
            if target[j] >= top[j]:
                frozen[j] = True
        if gpu_left <= TOL * total_gpus:
            break
        if io_left <= TOL * max(total_io, 1.0):
            for j in range(n):
                if miss[j] > 0:
                    frozen[j] = True
        if cpu_left <= TOL * max(total_cpus, 1.0):
            for j in range(n):
                if per_core[j] > 0:
                    frozen[j] = True
        m = 0
        for j in range(n):
            if not frozen[j]:
                grow[m] = j
                m += 1
        if m == 0:
            break
        # The step: the least of the growing jobs' room to their caps (numpy's min: a NaN
        # wins), the GPUs, IO and cores left over the growing jobs' use per unit; Python's
        # min over those bounds in that order (a later bound replaces only a smaller one).
        step = (f[grow[0]] - target[grow[0]]) / ref[grow[0]]
        for k in range(1, m):
            if step != step:
                break
            j = grow[k]
            room = (f[j] - target[j]) / ref[j]
            if room != room or room < step:
                step = room
        for k in range(m):
            terms[k] = gpu_per_ref[grow[k]]
        bound = gpu_left / pairwise_sum(terms, m)
        if bound < step:
            step = bound
        for k in range(m):
            terms[k] = io_per_ref[grow[k]]
        io_rate = pairwise_sum(terms, m)
        if io_rate > 0:
            bound = io_left / io_rate
            if bound < step:
                step = bound
        if cpu:
            for k in range(m):
                terms[k] = cpu_per_ref[grow[k]]
            cpu_rate = pairwise_sum(terms, m)
            if cpu_rate > 0 and np.isfinite(cpu_left):
                bound = cpu_left / cpu_rate
                if bound < step:
                    step = bound
        if 0.0 > step:  # max(step, 0.0)
            step = 0.0
        for k in range(m):
            j = grow[k]
            target[j] = np_min(target[j] + step * ref[j], f[j])


@kernel()
def common_factor(share: np.ndarray, gpus: np.ndarray, total_gpus: float) -> float:
    """The largest of BISECTION_STEPS midpoints between 1 and 1 / (least positive share) at
    which sum(gpus x min(share x c, 1)) <= total_gpus, the sum as numpy computes it (the
    bisection spread_gpu_time is defined by)."""
    n = share.size
    least = np.inf
    for j in range(n):
        if share[j] > 0 and share[j] < least:
            least = share[j]
    lo, hi = 1.0, 1.0 / least
    use = np.empty(n)
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        for j in range(n):
            use[j] = gpus[j] * np_min(share[j] * mid, 1.0)
        if pairwise_sum(use, n) <= total_gpus:
            lo = mid
        else:
            hi = mid
    return lo


@kernel()
def knapsack_fill(sizes: np.ndarray, efficiency: np.ndarray, capacity: float) -> np.ndarray:
    """policies.storage.fill_in_order compiled: `capacity` to the items in descending
    efficiency (a stable sort: ties in index order), each up to its size; the running total
    summed in order, as np.cumsum does, and each grant clipped as ndarray.clip does."""
    order = np.argsort(-efficiency, kind="mergesort")
    granted = np.empty(sizes.size)
    before = 0.0
    for i in order:
        granted[i] = np_min(np_max(capacity - before, 0.0), sizes[i])
        before += sizes[i]
    return granted


@kernel()
def cache_and_misses(ref: np.ndarray, ref_eq: np.ndarray, dataset_index: np.ndarray, dataset_size: np.ndarray, total_cache: float,
                     reuse: np.ndarray, dataset_cached: np.ndarray, hit_now: np.ndarray, by_reuse: bool, has_cached: bool,
                     has_hit: bool) -> tuple[np.ndarray, np.ndarray, float, float]:
    """The storage half of gavel.solve_max_min: Eq. 9's cache knapsack, each job's miss ratio
    now, and the IO bound's terms. Returns (cache per dataset, miss per job, sum of ref x miss,
    sum of ref).

    The knapsack takes the datasets by efficiency e_k = (sum of their readers' ref) / d_k, the
    exact order for the max-min ratio. `by_reuse` (the cache state and remaining work known):
    the bytes cached now at e_k and the rest at the reuse-weighted rate (sum of ref_eq x reuse
    over the readers / d_k; see policies.storage.greedy_cache for why). A job's hit ratio is
    its dataset's filled cache over its size (`has_cached`: only what is cached counts), no more
    than the hit ratio it measures on the rest of its epoch (`hit_now`, NaN where unknown)."""
    n, n_ds = ref.size, dataset_size.size
    per_ds = np.zeros(n_ds)  # np.bincount with weights: summed in job order
    for j in range(n):
        per_ds[dataset_index[j]] += ref[j]
    efficiency = per_ds / dataset_size
    if by_reuse:
        fresh = np.zeros(n_ds)
        for j in range(n):
            fresh[dataset_index[j]] += ref_eq[j] * reuse[j]
        filled = np.empty(n_ds)
        for k in range(n_ds):
            fresh[k] = fresh[k] / dataset_size[k]
            filled[k] = np_min(dataset_cached[k], dataset_size[k])
        granted = knapsack_fill(np.concatenate((filled, dataset_size - filled)), np.concatenate((efficiency, fresh)), total_cache)
        cache = granted[:n_ds] + granted[n_ds:]
    else:
        cache = knapsack_fill(dataset_size, efficiency, total_cache)
    usable = np.empty(n_ds)
    for k in range(n_ds):
        usable[k] = np_min(cache[k], dataset_cached[k]) if has_cached else cache[k]
    miss = np.empty(n)
    terms = np.empty(n)
    for j in range(n):
        k = dataset_index[j]
        hit = np_min(usable[k] / dataset_size[k], 1.0)
        if has_hit and hit_now[j] == hit_now[j]:
            hit = np_min(hit, hit_now[j])
        miss[j] = np_max(1.0 - hit, 0.0)
        terms[j] = ref[j] * miss[j]
    return cache, miss, pairwise_sum(terms, n), pairwise_sum(ref, n)


#: Bisection steps on log(mu) in central_shares (from 1e-12 to 1e12: 2^-70 of the bracket).
CENTRE_STEPS = 70


@kernel()
def _centre_share(lower: float, g: float, mu: float, x: float) -> float:
    """The share x in (lower, 1) where 1/(x - lower) + 1/x - 1/(1 - x) = g mu (the left side
    falls from +inf to -inf on the interval): Newton from `x`, kept inside the bracket."""
    lo, hi = lower, 1.0
    if not (lo < x < hi):
        x = 0.5 * (lo + hi)
    for _ in range(60):
        d_low, d_one = x - lower, 1.0 - x
        phi = 1.0 / d_low + 1.0 / x - 1.0 / d_one - g * mu
        if phi > 0:
            lo = x
        else:
            hi = x
        slope = -1.0 / (d_low * d_low) - 1.0 / (x * x) - 1.0 / (d_one * d_one)
        step = x - phi / slope
        if not (lo < step < hi):
            step = 0.5 * (lo + hi)
        if abs(step - x) <= 1e-15 * x or hi - lo <= 1e-15:
            return step
        x = step
    return x


@kernel()
def central_shares(lower: np.ndarray, gpus: np.ndarray, total_gpus: float) -> np.ndarray:
    """The analytic centre of {lower_j <= x_j <= 1, sum_j g_j x_j <= G} over the jobs with
    0 < lower_j < 1 (the others keep their lower bound, 0 or 1): the x maximising
    sum_j [log(x_j - lower_j) + log(x_j) + log(1 - x_j)] + log(G - sum_j g_j x_j).

    Stationarity: each free share solves 1/(x - l) + 1/x - 1/(1 - x) = g mu, one common
    mu = 1 / (G - sum g x); the shares fall as mu grows, so mu is found by bisection (on its
    log) where mu (G - sum g x(mu)) = 1. If the lower bounds already use the GPUs, the face is
    the one point x = lower."""
    n = lower.size
    x = lower.copy()
    left = total_gpus
    free = 0
    for j in range(n):
        if lower[j] >= 1.0 or lower[j] <= 0.0 or not (gpus[j] > 0):
            left -= gpus[j] * x[j]
        else:
            free += 1
    floor = 0.0
    for j in range(n):
        if 0.0 < lower[j] < 1.0 and gpus[j] > 0:
            floor += gpus[j] * lower[j]
    if free == 0 or floor >= left * (1.0 - 1e-12):
        return x
    guess = np.empty(n)
    for j in range(n):
        guess[j] = 0.5 * (lower[j] + 1.0)
    lo, hi = -12.0 * np.log(10.0), 12.0 * np.log(10.0)
    for _ in range(CENTRE_STEPS):
        mid = 0.5 * (lo + hi)
        mu = np.exp(mid)
        used = 0.0
        for j in range(n):
            if 0.0 < lower[j] < 1.0 and gpus[j] > 0:
                guess[j] = _centre_share(lower[j], gpus[j], mu, guess[j])
                used += gpus[j] * guess[j]
        if mu * (left - used) < 1.0:
            lo = mid
        else:
            hi = mid
    mu = np.exp(hi)  # the side where the GPUs fit
    for j in range(n):
        if 0.0 < lower[j] < 1.0 and gpus[j] > 0:
            x[j] = _centre_share(lower[j], gpus[j], mu, guess[j])
    return x
