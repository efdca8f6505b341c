"""Gavel's compiled loops (policies/gavel_kernel.py) against their numpy forms, bit for bit.

The numpy forms below are gavel.py's water-filling and spreading as they were before they were
compiled; the kernels must give the same floats (every Fig. 12 cell's summary stayed
bit-identical). Also numpy's summation order (policies.compiled.pairwise_sum) on arrays of many
lengths and magnitudes, which every compiled sum relies on.
"""

from __future__ import annotations

import numpy as np
import pytest

from policies.compiled import pairwise_sum
from policies.gavel import GavelProblem, equal_share_throughput, solve_max_min, spread_gpu_time, water_fill
from policies.storage import fill_in_order


def job_miss_ratio(p: GavelProblem, cache: np.ndarray) -> np.ndarray:
    """gavel.job_miss_ratio in numpy (before it was compiled)."""
    filled = cache if p.dataset_cached is None else np.minimum(cache, p.dataset_cached)
    hit = np.minimum(filled[p.dataset_index] / p.dataset_size[p.dataset_index], 1.0)
    if p.hit_now is not None:
        hit = np.where(np.isnan(p.hit_now), hit, np.minimum(hit, p.hit_now))
    return np.maximum(1.0 - hit, 0.0)


def numpy_solve_max_min(p: GavelProblem):
    """gavel.solve_max_min's ratio, cache, misses and time-averaged IO in numpy (before its
    storage half was compiled)."""
    n_ds = len(p.dataset_names)
    ref = np.where(p.gpus <= p.total_gpus, equal_share_throughput(p), 0.0)
    counted = ref > 0
    if not counted.any():
        return 0.0, np.zeros(n_ds), np.zeros(p.n), np.zeros(p.n)
    f = p.gpu_ideal
    bounds = [float((f[counted] / ref[counted]).min()), p.total_gpus / float((p.gpus * ref / f).sum())]
    cpu_per_t = float((ref * p.cpu_per_throughput()).sum())
    if np.isfinite(p.total_cpus) and cpu_per_t > 0:
        bounds.append(p.total_cpus / cpu_per_t)
    cache, miss = np.zeros(n_ds), np.zeros(p.n)
    if p.manages_storage:
        efficiency = np.bincount(p.dataset_index, weights=ref, minlength=n_ds) / p.dataset_size
        if p.reuse is None or p.dataset_cached is None:
            cache = fill_in_order(p.dataset_size, efficiency, p.total_cache)
        else:
            fresh = np.bincount(p.dataset_index, weights=equal_share_throughput(p) * p.reuse, minlength=n_ds) / p.dataset_size
            filled = np.minimum(p.dataset_cached, p.dataset_size)
            granted = fill_in_order(np.concatenate([filled, p.dataset_size - filled]), np.concatenate([efficiency, fresh]), p.total_cache)
            cache = granted[:n_ds] + granted[n_ds:]
        miss = job_miss_ratio(p, cache)
        io_per_unit_t = float((ref * miss).sum())
        if io_per_unit_t > 1e-12 * float(ref.sum()):
            bounds.append(p.total_io / io_per_unit_t)
    t = min(bounds)
    return t, cache, miss, t * ref * miss if p.manages_storage else np.zeros(p.n)


def numpy_water_fill(p: GavelProblem, sol) -> np.ndarray:
    """gavel.water_fill in numpy (before it was compiled)."""
    ref, f, g = sol.reference, p.gpu_ideal, p.gpus
    target = sol.ratio * ref
    if p.n == 0 or sol.ratio <= 0:
        return target
    miss = job_miss_ratio(p, sol.cache) if p.manages_storage else np.zeros(p.n)
    per_core = p.cpu_per_throughput()
    cpu = bool(per_core.any())
    tol = 1e-9
    frozen = ref <= 0
    top = f * (1 - tol)
    gpu_per_ref, io_per_ref, cpu_per_ref = g * ref / f, ref * miss, ref * per_core
    for _ in range(p.n + 2):
        gpu_left = p.total_gpus - float((g * target / f).sum())
        io_left = p.total_io - float((target * miss).sum()) if p.manages_storage else np.inf
        cpu_left = p.total_cpus - (float((target * per_core).sum()) if cpu else 0.0)
        frozen |= target >= top
        if gpu_left <= tol * p.total_gpus:
            break
        if io_left <= tol * max(p.total_io, 1.0):
            frozen |= miss > 0
        if cpu_left <= tol * max(p.total_cpus, 1.0):
            frozen |= per_core > 0
        grow = (~frozen).nonzero()[0]
        if not grow.size:
            break
        f_g, t_g, r_g = f[grow], target[grow], ref[grow]
        bounds = [float(((f_g - t_g) / r_g).min()), gpu_left / float(gpu_per_ref[grow].sum())]
        io_rate = float(io_per_ref[grow].sum())
        if io_rate > 0:
            bounds.append(io_left / io_rate)
        cpu_rate = float(cpu_per_ref[grow].sum()) if cpu else 0.0
        if cpu_rate > 0 and np.isfinite(cpu_left):
            bounds.append(cpu_left / cpu_rate)
        step = max(min(bounds), 0.0)
        target[grow] = np.minimum(t_g + step * r_g, f_g)
    return target


def numpy_spread(share, gpus, total_gpus):
    """spread_gpu_time's definition: 60 bisection steps, each summing the GPU use."""
    active = share > 0
    if not active.any():
        return share
    if float(np.sum(gpus[active])) <= total_gpus:
        return np.where(active, 1.0, 0.0)
    lo, hi = 1.0, 1.0 / float(share[active].min())
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if float(np.sum(gpus * np.minimum(share * mid, 1.0))) <= total_gpus:
            lo = mid
        else:
            hi = mid
    return np.minimum(share * lo, 1.0)


def same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def random_problem(rng: np.random.Generator, storage: bool, cpu: bool) -> GavelProblem:
    n = int(rng.integers(1, 400))
    k = int(rng.integers(1, max(2, n // 2)))
    index = rng.integers(0, k, n)
    used = np.unique(index)
    index = np.searchsorted(used, index)
    k = used.size
    gpus = rng.choice([1.0, 2.0, 4.0, 8.0, 16.0], n)
    ideal = rng.choice([2e7, 5e7, 1e8, 3e8], n) * rng.uniform(0.5, 1.5, n)
    size = rng.uniform(1e11, 5e12, k)
    hit_now = None
    if storage and rng.random() < 0.7:
        hit_now = rng.random(n)
        hit_now[rng.random(n) < 0.3] = np.nan
    cpu_rate = cpu_cap = None
    total_cpus = float("inf")
    if cpu:
        cpu_rate = rng.choice([np.inf, 2e7, 3.5e7, 8e7], n)
        cpu_cap = gpus * rng.choice([2.0, 4.0, 8.0])
        total_cpus = float(rng.uniform(0.2, 1.0) * cpu_cap.sum())
    return GavelProblem(
        job_ids=tuple(f"j{i}" for i in range(n)), gpus=gpus, ideal=ideal, dataset_index=index,
        dataset_names=tuple(f"d{i}" for i in range(k)), dataset_size=size,
        total_gpus=float(rng.integers(1, max(2, int(gpus.sum())))), total_cache=float(rng.uniform(0.1, 1.0) * size.sum()),
        total_io=float(rng.uniform(1e8, 2e10)), manages_storage=storage,
        dataset_cached=rng.uniform(0.0, 1.0, k) * size if storage and rng.random() < 0.7 else None,
        reuse=(rng.random(n) < 0.8).astype(float) if storage else None, hit_now=hit_now,
        cpu_rate=cpu_rate, cpu_cap=cpu_cap, total_cpus=total_cpus,
    )


@pytest.mark.parametrize("storage,cpu", [(False, False), (True, False), (False, True), (True, True)])
def test_solve_is_its_numpy_form_bit_for_bit(storage, cpu):
    """The max-min ratio, the cache knapsack (by efficiency, and by reuse when the cached bytes
    are known), the misses and the IO: the same floats as the numpy form."""
    rng = np.random.default_rng(21 + 2 * storage + cpu)
    io_bound = 0
    for _ in range(300):
        p = random_problem(rng, storage, cpu)
        sol = solve_max_min(p)
        ratio, cache, miss, avg_io = numpy_solve_max_min(p)
        assert sol.ratio == ratio
        assert same_floats(sol.cache, cache) and same_floats(sol.miss, miss) and same_floats(sol.avg_io, avg_io)
        io_rate = float((sol.reference * miss).sum())
        io_bound += storage and io_rate > 0 and ratio == p.total_io / io_rate
    assert not storage or io_bound > 30  # the IO bound binds in some cases


@pytest.mark.parametrize("storage,cpu", [(False, False), (True, False), (False, True), (True, True)])
def test_water_fill_is_its_numpy_form_bit_for_bit(storage, cpu):
    rng = np.random.default_rng(11 + 2 * storage + cpu)
    levels = 0
    for _ in range(300):
        p = random_problem(rng, storage, cpu)
        sol = solve_max_min(p)
        want = numpy_water_fill(p, sol)
        assert same_floats(water_fill(p, sol), want)
        levels += int((want > sol.ratio * sol.reference).sum())
    assert levels > 300  # the cases do raise jobs above the max-min level


def test_water_fill_of_nothing_and_of_a_zero_ratio():
    rng = np.random.default_rng(5)
    p = random_problem(rng, True, False)
    sol = solve_max_min(p)
    zero = type(sol)(0.0, sol.share, sol.avg_io, sol.cache, sol.reference)
    assert same_floats(water_fill(p, zero), numpy_water_fill(p, zero))


def test_spread_is_its_bisection_bit_for_bit():
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(3000):
        n = int(rng.integers(1, 300))
        share = rng.random(n) ** int(rng.integers(1, 6))
        share[rng.random(n) < 0.2] = 0.0
        if rng.random() < 0.3:
            share = np.round(share, 2)  # many equal shares: caps coincide
        if rng.random() < 0.1:
            share[rng.random(n) < 0.5] = 1.0
        gpus = rng.choice([1.0, 2.0, 4.0, 8.0, 16.0], n)
        total = float(rng.integers(1, max(2, int(gpus.sum()))))
        assert same_floats(spread_gpu_time(share, gpus, total), numpy_spread(share, gpus, total))
        checked += bool((share > 0).any() and float(np.sum(gpus[share > 0])) > total)
    assert checked > 1000
    # A root exactly on a cap, and an end one ulp from the start's value (found by an outside
    # review of an earlier shortcut of this bisection).
    for share, gpus, total in ((np.array([0.5, 0.25]), np.array([1.0, 1.0]), 1.5),
                               (np.array([0.5019083405080652, 0.16620589396668428]), np.array([1.0, 3.0]), 3.9999999999999996)):
        assert same_floats(spread_gpu_time(share, gpus, total), numpy_spread(share, gpus, total))


def test_pairwise_sum_is_numpys_sum():
    """numpy sums a contiguous float64 array pairwise (blocks of 128, eight running sums in a
    block); the kernel's sum is the same float, zero's sign included."""
    rng = np.random.default_rng(1)
    for trial in range(20000):
        n = int(rng.integers(0, 5000)) if trial % 3 else int(rng.integers(0, 300))
        kind = trial % 4
        if kind == 0:
            a = rng.random(n)
        elif kind == 1:
            a = rng.standard_normal(n) * 10.0 ** rng.integers(-10, 10, n)  # cancellations
        elif kind == 2:
            a = rng.random(n) * 1e12
            a[rng.random(n) < 0.5] = 0.0
        else:
            a = rng.standard_normal(n) * 1e8
            a[rng.random(n) < 0.3] = -0.0
        want, got = float(a.sum()), pairwise_sum(a, n)
        assert got == want and np.signbit(got) == np.signbit(want), (trial, n)
    for a in (np.zeros(0), np.array([-0.0]), np.full(5, -0.0), np.full(300, -0.0), np.array([np.inf, -np.inf]), np.array([1.0, np.nan])):
        with np.errstate(invalid="ignore"):  # inf - inf is NaN, as it should be
            want = float(a.sum())
        got = pairwise_sum(a, a.size)
        assert (np.isnan(want) and np.isnan(got)) or (got == want and np.signbit(got) == np.signbit(want))


def test_a_sequential_sum_would_not_do():
    """The check above can fail: summing in order (what a plain loop in a kernel does) differs
    from numpy's sum on long arrays."""
    rng = np.random.default_rng(2)
    differs = 0
    for _ in range(200):
        a = rng.standard_normal(1000) * 10.0 ** rng.integers(-8, 8, 1000)
        total = 0.0
        for x in a.tolist():
            total += x
        differs += total != float(a.sum())
    assert differs > 100
