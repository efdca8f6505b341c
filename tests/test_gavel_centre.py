"""Gavel's split of spare GPU time (policies.gavel.centre_gpu_time, gavel_kernel.central_shares).

With GPU time the only resource and fewer jobs than GPUs, max-min has many optimal allocations;
Gavel's interior-point solver returns one near the analytic centre of the optimal face, and so
does ours. The centre is defined by its stationarity conditions (the barrier is strictly
concave), which these tests check directly on random faces, with the cases where the face is a
single point. tests/test_gavel_parity.py holds the trace-level consequence (e13805 at interval 0).
"""

from __future__ import annotations

import numpy as np
import pytest

from policies import ClusterCapacity, DatasetView, JobView, SiloDEstimator, Snapshot, VanillaEstimator
from policies.gavel import GavelPolicy
from policies.gavel_kernel import central_shares


def _stationarity(x: np.ndarray, lower: np.ndarray, g: np.ndarray, total: float) -> np.ndarray:
    """Per free job, the barrier's gradient over g: 0 at the centre."""
    free = (lower > 0) & (lower < 1)
    slack = total - float(g @ x)
    xf, lf = x[free], lower[free]
    return (1 / (xf - lf) + 1 / xf - 1 / (1 - xf)) / g[free] - 1 / slack


@pytest.mark.parametrize("seed", range(20))
def test_the_shares_are_the_faces_analytic_centre(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    g = rng.choice([1.0, 2.0, 4.0, 8.0], size=n)
    lower = np.where(rng.random(n) < 0.3, 1.0, 1.0 / g * rng.uniform(0.2, 1.0, n))
    lower[g == 1] = 1.0  # (as max-min pins a 1-GPU job at t* = 1)
    total = float(g @ lower) + float(rng.uniform(0.5, 8.0))  # room left: the face is not a point
    x = central_shares(lower, g, total)
    free = lower < 1
    assert np.all(x[~free] == 1.0)
    assert np.all(x[free] > lower[free]) and np.all(x[free] < 1)
    assert float(g @ x) < total
    if free.any():
        np.testing.assert_allclose(_stationarity(x, lower, g, total), 0.0, atol=1e-7 * (1 / (total - float(g @ x))))


def test_a_face_that_is_one_point_keeps_the_lower_bounds():
    g = np.array([8.0, 4.0, 4.0, 1.0])
    lower = np.array([0.5, 0.5, 0.5, 0.0])  # 8 GPUs used by the bounds: nothing left over
    np.testing.assert_array_equal(central_shares(lower, g, 8.0), lower)
    # a job left out (0) and a pinned one (1) keep theirs while the others are centred
    x = central_shares(np.array([0.0, 1.0, 0.25]), np.array([32.0, 1.0, 4.0]), 16.0)
    assert x[0] == 0.0 and x[1] == 1.0 and 0.25 < x[2] < 1.0


def _snapshot(gpus_per_job, total_gpus):
    jobs = tuple(JobView(job_id=f"j{i}", gpus=g, dataset="d", ideal_throughput=1e9, remaining_bytes=1e15, submit_time=float(i), running=False)
                 for i, g in enumerate(gpus_per_job))
    return Snapshot(time=0.0, jobs=jobs, datasets={"d": DatasetView("d", 1e9)},
                    capacity=ClusterCapacity(gpus=total_gpus, cache=1e21, remote_io=1e13, gpus_per_node=1))


def test_gavel_without_storage_centres_spare_gpu_time_instead_of_filling_the_gpus():
    # e13805's busiest stretch in small: five 1-GPU jobs, two 8-GPU gangs, a 4-GPU gang on 16
    # GPUs. Max-min pins the 1-GPU jobs at 1; the gangs cannot all run at once.
    snapshot = _snapshot([1, 1, 1, 1, 1, 8, 8, 4], 16)
    share = GavelPolicy().allocate(snapshot, VanillaEstimator()).gpu_share
    x = np.array([share[f"j{i}"] for i in range(8)])
    g = np.array([1, 1, 1, 1, 1, 8, 8, 4], dtype=float)
    assert np.all(x[:5] == 1.0)
    # Eq. 8's max-min shares are 1/4 (8 GPUs) and 1/2 (4 GPUs); the centre lies above them and
    # leaves GPU time unallocated, as Gavel's solver does (water-filling + spreading filled 16)
    lower = np.array([1, 1, 1, 1, 1, 0.25, 0.25, 0.5])
    assert np.all(x[5:] > lower[5:]) and float(g @ x) < 16 - 1
    np.testing.assert_allclose(_stationarity(x, lower, g, 16.0), 0.0, atol=1e-6)
    # with more jobs than GPUs the optimum is one point, the equal GPU time of max-min
    crowded = GavelPolicy().allocate(_snapshot([1] * 20 + [4, 8], 16), VanillaEstimator()).gpu_share
    np.testing.assert_allclose([crowded["j0"], crowded["j20"], crowded["j21"]], [16 / 22, 16 / 22 / 4, 16 / 22 / 8])


def test_gavel_with_storage_still_spreads_spare_gpu_time():
    # SiloD's Gavel (cache and IO allocated too) keeps water-filling and spreading: the split
    # above is Gavel's GPU-only LP's, and a longer share lowers a job's IO while it runs.
    snapshot = _snapshot([1, 1, 1, 1, 1, 8, 8, 4], 16)
    share = GavelPolicy().allocate(snapshot, SiloDEstimator()).gpu_share
    g = np.array([1, 1, 1, 1, 1, 8, 8, 4], dtype=float)
    assert float(g @ np.array([share[f"j{i}"] for i in range(8)])) == pytest.approx(16.0)
