"""Policies: capacities on random instances, hand-computed optima, the validator, Gavel's closed
form against the cvxpy reference, and the plug-in registry (real entry-point discovery)."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from estimator import silod_perf
from estimator.errors import UserError
from policies import (
    Allocation,
    ClusterCapacity,
    DatasetView,
    JobView,
    Policy,
    SiloDEstimator,
    Snapshot,
    VanillaEstimator,
    allocation_violations,
    available_policies,
    get_policy,
    validate_allocation,
)
from policies.gavel import GavelPolicy, GavelProblem, equal_share_throughput, solve_max_min
from policies.gavel_reference import reference_equal_share, solve_max_min_reference
from policies.registry import BUILTIN_POLICIES, ENTRY_POINT_GROUP
from policies.sjf import sjf_scores
from policies.storage import demands_at_full_speed
from policies.validation import AllocationError

MB, GB, TB = 1e6, 1e9, 1e12
POLICIES = ["fifo", "sjf", "gavel", "greedy"]
ESTIMATORS = [SiloDEstimator(), VanillaEstimator()]


def job(job_id, gpus, f, dataset, work=1e12, submit=0.0, running=False):
    return JobView(job_id=job_id, gpus=gpus, dataset=dataset, ideal_throughput=f, remaining_bytes=work, submit_time=submit, running=running)


def snap(jobs, sizes, gpus, cache, io, gpus_per_node=8):
    return Snapshot(
        time=0.0,
        jobs=tuple(jobs),
        datasets={n: DatasetView(n, s) for n, s in sizes.items()},
        capacity=ClusterCapacity(gpus=gpus, cache=cache, remote_io=io, gpus_per_node=gpus_per_node),
    )


# ---------------------------------------------------------------------------------------------
# Random instances


@st.composite
def snapshots(draw, max_jobs=12, min_io=0.0):
    n = draw(st.integers(1, max_jobs))
    m = draw(st.integers(1, n))
    total_gpus = draw(st.integers(1, 64))
    # The scheduler refuses gangs larger than the cluster at admission, so none appear here.
    gang_sizes = [g for g in (1, 1, 2, 4, 8) if g <= total_gpus]
    sizes = {f"ds{k}": draw(st.floats(1 * GB, 20 * TB)) for k in range(m)}
    jobs = []
    for i in range(n):
        jobs.append(
            job(
                f"j{i}",
                gpus=draw(st.sampled_from(gang_sizes)),
                f=draw(st.floats(2 * MB, 900 * MB)),
                dataset=f"ds{draw(st.integers(0, m - 1))}",
                work=draw(st.floats(1 * GB, 1e14)),
                submit=float(draw(st.integers(0, 1000))),
                running=draw(st.booleans()),
            )
        )
    used = {j.dataset for j in jobs}
    sizes = {k: v for k, v in sizes.items() if k in used or draw(st.booleans())}  # sometimes idle datasets
    return snap(
        jobs,
        sizes,
        gpus=total_gpus,
        cache=draw(st.one_of(st.just(0.0), st.floats(0.0, 40 * TB))),
        io=draw(st.one_of(st.just(max(min_io, 0.0)), st.floats(max(min_io, 0.0), 5 * GB))),
    )


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: e.name)
@pytest.mark.parametrize("policy_name", POLICIES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=snapshots(min_io=1.0))
def test_capacities_respected_on_random_instances(policy_name, estimator, s):
    policy = get_policy(policy_name)
    alloc = policy.allocate(s, estimator)
    assert allocation_violations(s, alloc) == []
    assert set(alloc.gpu_share) == {j.job_id for j in s.jobs}
    assert alloc.manages_storage == estimator.manages_storage
    if estimator.manages_storage:
        assert set(alloc.remote_io) <= {j.job_id for j in s.jobs}
        assert all(np.isfinite(v) for v in alloc.remote_io.values())
    if not policy.time_sharing:
        # Gang scheduling: shares are 0/1 and the chosen jobs fit on the GPUs at the same time.
        assert set(alloc.gpu_share.values()) <= {0.0, 1.0}
        gpus = {j.job_id: j.gpus for j in s.jobs}
        assert sum(gpus[k] for k, v in alloc.gpu_share.items() if v == 1.0) <= s.capacity.gpus


@settings(max_examples=40, deadline=None)
@given(s=snapshots(min_io=1.0))
def test_gavel_allocation_achieves_its_objective(s):
    """Every job's time-averaged SiloDPerf under the returned allocation is >= objective * ref."""
    alloc = GavelPolicy().allocate(s, SiloDEstimator())
    problem = GavelProblem.from_snapshot(s, True)
    ref = equal_share_throughput(problem)
    for j, r in zip(s.jobs, ref, strict=True):
        d = s.datasets[j.dataset].size
        got = alloc.gpu_share[j.job_id] * silod_perf(j.ideal_throughput, alloc.remote_io[j.job_id], alloc.cache[j.dataset], d)
        assert got >= alloc.objective * r * (1 - 1e-9) - 1e-9
    assert alloc.objective >= 1 - 1e-12  # the equal share itself is feasible


@settings(max_examples=40, deadline=None)
@given(s=snapshots())
def test_vanilla_gavel_ratio_is_one(s):
    """With GPUs only (one GPU type), the equal share is already max-min optimal: either some job
    has its whole gang (x_eq = 1, and x <= 1), or the equal share uses every GPU."""
    assert GavelPolicy().allocate(s, VanillaEstimator()).objective == pytest.approx(1.0, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# The paper's 8-V100 micro-benchmark (§7.1.1)


def micro_benchmark(io=200 * MB):
    jobs = [
        job("resnet-a", 1, 114 * MB, "imgs-a", submit=0),
        job("resnet-b", 1, 114 * MB, "imgs-b", submit=1),
        job("effnet-a", 1, 69 * MB, "imgs-c", submit=2),
        job("effnet-b", 1, 69 * MB, "imgs-d", submit=3),
        job("bert", 4, 8 * MB, "web", submit=4),
    ]
    sizes = {"imgs-a": 1.3 * TB, "imgs-b": 1.3 * TB, "imgs-c": 1.3 * TB, "imgs-d": 1.3 * TB, "web": 20.9 * TB}
    return snap(jobs, sizes, gpus=8, cache=2 * TB, io=io, gpus_per_node=4)


@pytest.mark.parametrize("policy_name", ["greedy", "fifo"])
def test_micro_benchmark_algorithm2(policy_name):
    # Cache efficiency f*/d: ResNet 114/1.3 = 87.7 MB/s per TB > EfficientNet 69/1.3 = 53.1 > BERT
    # 8/20.9 = 0.38. 2 TB of cache: the first ResNet dataset takes 1.3 TB, the second the remaining
    # 0.7 TB, nothing else. All 1+1+1+1+4 = 8 GPUs are used.
    # Remote demand (Eq. 2): 0; 114 (1 - 0.7/1.3) = 114 * 6/13 = 52.615; 69; 69; 8 -> 198.6 MB/s <= 200,
    # so every job gets its whole demand and runs at f*.
    s = micro_benchmark()
    alloc = get_policy(policy_name).allocate(s, SiloDEstimator())
    assert allocation_violations(s, alloc) == []
    assert dict(alloc.gpu_share) == {"resnet-a": 1.0, "resnet-b": 1.0, "effnet-a": 1.0, "effnet-b": 1.0, "bert": 1.0}
    assert alloc.cache["imgs-a"] == pytest.approx(1.3 * TB)  # tie broken by dataset name
    assert alloc.cache["imgs-b"] == pytest.approx(0.7 * TB)
    assert alloc.cache.get("imgs-c", 0.0) == 0.0
    assert alloc.cache.get("imgs-d", 0.0) == 0.0
    assert alloc.cache.get("web", 0.0) == 0.0
    expected_io = {"resnet-a": 0.0, "resnet-b": 114 * MB * 6 / 13, "effnet-a": 69 * MB, "effnet-b": 69 * MB, "bert": 8 * MB}
    assert dict(alloc.remote_io) == pytest.approx(expected_io)
    for j in s.jobs:  # every job at its ideal speed
        perf = silod_perf(j.ideal_throughput, alloc.remote_io[j.job_id], alloc.cache.get(j.dataset, 0.0), s.datasets[j.dataset].size)
        assert perf == pytest.approx(j.ideal_throughput)


@pytest.mark.parametrize("policy_name", ["greedy", "fifo"])
def test_micro_benchmark_tight_link_shares_fairly(policy_name):
    # Same cluster with a 150 MB/s link. Demands 0, 52.615, 69, 69, 8 (sum 198.6 > 150).
    # Max-min water-filling: sorted 0, 8, 52.615, 69, 69. 0 and 8 are below any level; the rest
    # share 150 - 8 = 142 equally: 47.33 each (< 52.615, so all three are capped).
    # FIFO too: SiloD §5.3 runs FIFO (a scheduler without an estimator) with the greedy policy,
    # which ranks no job for IO. (FIFO used to serve the link in arrival order: 0, 52.615, 69,
    # 28.385, 0, starving the last image job and BERT.)
    s = micro_benchmark(io=150 * MB)
    alloc = get_policy(policy_name).allocate(s, SiloDEstimator())
    level = 142 * MB / 3
    assert dict(alloc.remote_io) == pytest.approx({"resnet-a": 0.0, "resnet-b": level, "effnet-a": level, "effnet-b": level, "bert": 8 * MB})
    assert sum(alloc.remote_io.values()) == pytest.approx(150 * MB)


def test_fifo_keeps_running_jobs_and_backfills():
    # 4 GPUs. "old" (submitted first, 2 GPUs) is queued, "mid" (3 GPUs) is running: FIFO does not
    # preempt "mid", so "old" cannot fit (3 + 2 > 4); "late" (1 GPU) backfills the free GPU.
    s = snap(
        [job("old", 2, 10.0, "d", submit=0), job("mid", 3, 10.0, "d", submit=1, running=True), job("late", 1, 10.0, "d", submit=2)],
        {"d": 100.0},
        gpus=4,
        cache=0.0,
        io=100.0,
    )
    alloc = get_policy("fifo").allocate(s, VanillaEstimator())
    assert dict(alloc.gpu_share) == {"old": 0.0, "mid": 1.0, "late": 1.0}


# ---------------------------------------------------------------------------------------------
# SJF (Eq. 7) by hand


def sjf_case():
    # 4 GPUs, 100 B cache, 10 B/s link. (abstract units)
    jobs = [
        job("X", 1, 10.0, "big", work=900.0, submit=0),
        job("Y", 1, 10.0, "small", work=1000.0, submit=1),
        job("Z", 4, 40.0, "tiny", work=2000.0, submit=2),
    ]
    return snap(jobs, {"big": 1000.0, "small": 50.0, "tiny": 10.0}, gpus=4, cache=100.0, io=10.0)


def test_sjf_scores_by_hand():
    s = sjf_case()
    # Vanilla: W/f * g/G.  X: 90 * 1/4 = 22.5;  Y: 100 * 1/4 = 25;  Z: 50 * 4/4 = 50.
    np.testing.assert_allclose(sjf_scores(list(s.jobs), s, VanillaEstimator()), [22.5, 25.0, 50.0])
    # SiloD: min(no cache, full cache) with  W/f (g/G + c/C) + W (1 - c/d) / B.
    # X: no cache 22.5 + 900/10 = 112.5;  c = 100: 90 (0.25 + 1) + 900 * 0.9 / 10 = 112.5 + 81 -> 112.5
    # Y: no cache 25 + 100 = 125;          c = 50: 100 (0.25 + 0.5) + 0 = 75                  -> 75
    # Z: no cache 50 + 200 = 250;          c = 10: 50 (1 + 0.1) + 0 = 55                       -> 55
    np.testing.assert_allclose(sjf_scores(list(s.jobs), s, SiloDEstimator()), [112.5, 75.0, 55.0])


def test_sjf_order_changes_with_storage():
    s = sjf_case()
    # Vanilla order X, Y, Z: X and Y take 2 of 4 GPUs; Z (4 GPUs) does not fit.
    vanilla = get_policy("sjf").allocate(s, VanillaEstimator())
    assert dict(vanilla.gpu_share) == {"X": 1.0, "Y": 1.0, "Z": 0.0}
    # SiloD order Z, Y, X: Z takes all 4 GPUs; its 10 B dataset is fully cached, so it needs no IO.
    silod = get_policy("sjf").allocate(s, SiloDEstimator())
    assert dict(silod.gpu_share) == {"X": 0.0, "Y": 0.0, "Z": 1.0}
    assert dict(silod.cache) == {"tiny": 10.0}
    assert dict(silod.remote_io) == {"Z": 0.0}


def test_sjf_paper_example_small_dataset_first():
    # §5.1: two ResNet-50 jobs, same GPUs and steps, ImageNet-1k (143 GB) vs ImageNet-22k (1.3 TB):
    # the former should be scheduled first. Only one GPU, so only the first one runs.
    jobs = [job("in22k", 1, 114 * MB, "in22k", work=10 * TB, submit=0), job("in1k", 1, 114 * MB, "in1k", work=10 * TB, submit=1)]
    s = snap(jobs, {"in22k": 1.3 * TB, "in1k": 143 * GB}, gpus=1, cache=2 * TB, io=50 * MB)
    assert dict(get_policy("sjf").allocate(s, SiloDEstimator()).gpu_share) == {"in22k": 0.0, "in1k": 1.0}


# ---------------------------------------------------------------------------------------------
# Gavel by hand


def gavel_two_jobs():
    # 2 GPUs, 100 B cache, 40 B/s link; A and B: 1 GPU, f* = 100; d_A = 100, d_B = 400.
    return snap([job("A", 1, 100.0, "dA"), job("B", 1, 100.0, "dB")], {"dA": 100.0, "dB": 400.0}, gpus=2, cache=100.0, io=40.0)


def test_gavel_two_jobs_by_hand():
    # Equal share: x = 1 each, 20 B/s IO each, 50 B cache each.
    #   ref_A = min(100, 20 / (1 - 50/100)) = 40;  ref_B = min(100, 20 / (1 - 50/400)) = 20/0.875 = 160/7.
    # Optimum: cache efficiency per unit of t: A 40/100 = 0.4 > B (160/7)/400 = 0.057, so all 100 B
    # of cache go to A (fully cached, needs no IO). IO then needed = t * ref_B = t * 160/7 <= 40
    # -> t <= 1.75. Other bounds: x_A = t 40/100 <= 1 -> t <= 2.5; GPUs t (0.4 + 0.2286) <= 2 -> 3.18.
    # t* = 1.75: A gets 70 B/s (x_A = 0.7), B gets 40 B/s all from remote (x_B = 0.4).
    s = gavel_two_jobs()
    p = GavelProblem.from_snapshot(s, True)
    np.testing.assert_allclose(equal_share_throughput(p), [40.0, 160 / 7])
    sol = solve_max_min(p)
    assert sol.ratio == pytest.approx(1.75)
    np.testing.assert_allclose(sol.share, [0.7, 0.4])
    np.testing.assert_allclose(sol.cache, [100.0, 0.0])
    np.testing.assert_allclose(sol.avg_io, [0.0, 40.0], atol=1e-12)
    ref = solve_max_min_reference(p)
    assert ref.ratio == pytest.approx(1.75, rel=1e-7)

    # Water-filling above the max-min level: the IO is used up, so B (all misses) freezes at
    # 40 B/s; A needs no IO and grows on GPUs alone until its gang is full: x_A = 1 (100 B/s).
    # Both 1-GPU gangs fit in the 2 GPUs at once, so the idle GPU time is spread: x_B = 1 and B
    # reads steadily at its time-averaged 40 B/s instead of 100 B/s in 40% of the rounds.
    alloc = GavelPolicy().allocate(s, SiloDEstimator())
    validate_allocation(s, alloc)
    assert alloc.objective == pytest.approx(1.75)
    assert dict(alloc.gpu_share) == pytest.approx({"A": 1.0, "B": 1.0})
    assert dict(alloc.remote_io) == pytest.approx({"A": 0.0, "B": 40.0})


def test_gavel_three_jobs_shared_dataset_by_hand():
    # 3 GPUs, 200 B cache, 60 B/s. A and B (1 GPU, f* 100) share D1 (200 B); C (1 GPU, f* 100) reads D2 (200 B).
    # Equal share: IO 20 each; cache D1 gets its two readers' shares 2 * 200/3 = 133.3, D2 66.7.
    #   ref_A = ref_B = 20 / (1 - 133.3/200) = 20 / (1/3) = 60;  ref_C = 20 / (1 - 66.7/200) = 30.
    # Per unit of t, cache saves e_D1 = (60 + 60)/200 = 0.6 vs e_D2 = 30/200 = 0.15: all 200 B to D1.
    # IO needed = t (60 + 60 + 30 - 200 * 0.6) = 30 t <= 60 -> t <= 2.
    # x_A = t 60/100 <= 1 -> t <= 5/3 (binding); GPUs t (0.6 + 0.6 + 0.3) <= 3 -> t <= 2.
    # t* = 5/3: A, B at 100 (fully cached, no IO), C at 50 from 50 B/s of remote IO.
    s = snap(
        [job("A", 1, 100.0, "D1"), job("B", 1, 100.0, "D1"), job("C", 1, 100.0, "D2")],
        {"D1": 200.0, "D2": 200.0},
        gpus=3,
        cache=200.0,
        io=60.0,
    )
    p = GavelProblem.from_snapshot(s, True)
    np.testing.assert_allclose(equal_share_throughput(p), [60.0, 60.0, 30.0])
    sol = solve_max_min(p)
    assert sol.ratio == pytest.approx(5 / 3)
    np.testing.assert_allclose(sol.cache, [200.0, 0.0])
    np.testing.assert_allclose(sol.avg_io, [0.0, 0.0, 50.0], atol=1e-12)
    assert solve_max_min_reference(p).ratio == pytest.approx(5 / 3, rel=1e-7)
    assert solve_max_min_reference(p, method="bisection").ratio == pytest.approx(5 / 3, rel=1e-7)


def test_gavel_paper_figure4_equal_split_is_optimal():
    # Fig. 4: 2 GPUs, two ResNet-50 (114 MB/s) on 1.36 TB each, 1.4 TB cache, 50 MB/s.
    # Equal share: 0.7 TB cache and 25 MB/s each -> ref = 25 / (1 - 0.7/1.36) = 25 * 1.36/0.66 = 51.5 MB/s.
    # Both datasets are equally efficient, so any split of the whole cache needs the same IO:
    # t ref (2 - 1.4/1.36) = t * 25 * 1.36/0.66 * 1.32/1.36 = 50 t <= 50 -> t* = 1.
    s = snap(
        [job("j0", 1, 114 * MB, "in22k-0"), job("j1", 1, 114 * MB, "in22k-1")],
        {"in22k-0": 1.36 * TB, "in22k-1": 1.36 * TB},
        gpus=2,
        cache=1.4 * TB,
        io=50 * MB,
    )
    p = GavelProblem.from_snapshot(s, True)
    np.testing.assert_allclose(equal_share_throughput(p), 25 * MB * 1.36 / 0.66)
    assert solve_max_min(p).ratio == pytest.approx(1.0)
    assert solve_max_min_reference(p).ratio == pytest.approx(1.0, rel=1e-7)


# ---------------------------------------------------------------------------------------------
# Gavel exact vs the cvxpy reference


@st.composite
def gavel_problems(draw):
    n = draw(st.integers(1, 12))
    m = draw(st.integers(1, n))
    idx = np.array([draw(st.integers(0, m - 1)) for _ in range(n)])
    used = np.unique(idx)  # drop datasets nobody reads, as from_snapshot does
    idx = np.searchsorted(used, idx)
    m = len(used)
    total_gpus = draw(st.integers(1, 64))
    gang_sizes = [g for g in (1, 2, 4, 8) if g <= total_gpus]
    return GavelProblem(
        job_ids=tuple(f"j{i}" for i in range(n)),
        gpus=np.array([draw(st.sampled_from(gang_sizes)) for _ in range(n)], dtype=float),
        ideal=np.array([draw(st.floats(2 * MB, 900 * MB)) for _ in range(n)]),
        dataset_index=idx.astype(np.int64),
        dataset_names=tuple(f"d{k}" for k in range(m)),
        dataset_size=np.array([draw(st.floats(100 * GB, 20 * TB)) for _ in range(m)]),
        total_gpus=float(total_gpus),
        total_cache=draw(st.one_of(st.just(0.0), st.floats(0.0, 40 * TB))),
        total_io=draw(st.floats(1 * MB, 5 * GB)),
        manages_storage=draw(st.booleans()),
    )


@settings(max_examples=60, deadline=None)
@given(p=gavel_problems())
def test_gavel_exact_matches_cvxpy_reference(p):
    exact = solve_max_min(p)
    ref = solve_max_min_reference(p)
    np.testing.assert_allclose(exact.reference, reference_equal_share(p), rtol=1e-12)
    assert exact.ratio == pytest.approx(ref.ratio, rel=1e-4)
    # The closed-form allocation itself is feasible and achieves its ratio.
    assert float(p.gpus @ exact.share) <= p.total_gpus * (1 + 1e-9)
    assert exact.share.max() <= 1 + 1e-9
    if p.manages_storage:
        assert exact.avg_io.sum() <= p.total_io * (1 + 1e-9)
        assert exact.cache.sum() <= p.total_cache * (1 + 1e-9) + 1e-6
        assert (exact.cache <= p.dataset_size * (1 + 1e-12)).all()
        k = p.dataset_index
        miss = 1 - exact.cache[k] / p.dataset_size[k]
        with np.errstate(divide="ignore"):
            io_tp = np.where(miss > 1e-15, exact.avg_io / np.maximum(miss, 1e-300), np.inf)
        tput = np.minimum(exact.share * p.ideal, io_tp)
    else:
        tput = exact.share * p.ideal
    assert (tput >= exact.ratio * exact.reference * (1 - 1e-9)).all()


@settings(max_examples=15, deadline=None)
@given(p=gavel_problems())
def test_gavel_reference_bisection_agrees_with_single_lp(p):
    a = solve_max_min_reference(p)
    b = solve_max_min_reference(p, method="bisection")
    assert a.ratio == pytest.approx(b.ratio, rel=1e-6)


def test_gavel_with_no_remote_io_does_not_crash():
    # A cluster with --remote-io 0 and no cache: every job's equal-share throughput is 0, so
    # sum_j g_j ref_j / f*_j = 0 and `p.total_gpus / 0.0` raises. ClusterCapacity accepts
    # remote_io = 0, so the policy must not crash (the ratio is undefined; any feasible answer).
    s = snap([job("A", 1, 100.0, "d")], {"d": 100.0}, gpus=1, cache=0.0, io=0.0)
    alloc = GavelPolicy().allocate(s, SiloDEstimator())
    assert allocation_violations(s, alloc) == []


# ---------------------------------------------------------------------------------------------
# The validator rejects every kind of violation


def validator_case():
    return snap([job("a", 2, 10.0, "d1"), job("b", 2, 10.0, "d2")], {"d1": 100.0, "d2": 50.0}, gpus=4, cache=120.0, io=10.0)


GOOD = dict(gpu_share={"a": 1.0, "b": 1.0}, cache={"d1": 100.0, "d2": 20.0}, remote_io={"a": 5.0, "b": 5.0})


def test_validator_accepts_a_full_allocation():
    s = validator_case()
    assert allocation_violations(s, Allocation(**GOOD)) == []
    # Time-averaged IO: 8 B/s at half the time plus 6 B/s all the time = 10.
    assert allocation_violations(s, Allocation({"a": 0.5, "b": 1.0}, GOOD["cache"], {"a": 8.0, "b": 6.0})) == []


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"gpu_share": {"a": 1.0, "b": 1.0, "ghost": 1.0}}, "unknown jobs"),
        ({"gpu_share": {"a": 1.5, "b": 0.0}}, "outside"),
        ({"gpu_share": {"a": -0.5, "b": 1.0}}, "outside"),
        ({"gpu_share": {"a": 1.0, "b": 1.0}, "cache": None, "remote_io": None}, None),
        ({"cache": {"d1": 100.0, "d2": 50.0}}, "cache: 150 B allocated > 120"),
        ({"cache": {"d1": 101.0, "d2": 0.0}}, "dataset d1: cache 101 B > dataset size 100"),
        ({"cache": {"d1": -1.0, "d2": 0.0}}, "cache -1.0 is not a non-negative"),
        ({"cache": {"d1": 10.0, "nope": 1.0}}, "unknown dataset 'nope'"),
        ({"remote_io": {"a": 6.0, "b": 5.0}}, "remote IO: 11 B/s"),
        ({"remote_io": {"a": -1.0, "b": 5.0}}, "remote IO -1.0 is not a non-negative"),
        ({"remote_io": {"a": 1.0, "ghost": 1.0}}, "unknown job 'ghost'"),
    ],
)
def test_validator_rejects(change, fragment):
    s = validator_case()
    alloc = Allocation(**{**GOOD, **change})
    problems = allocation_violations(s, alloc)
    if fragment is None:
        assert problems == []
        return
    assert any(fragment in p for p in problems), problems
    with pytest.raises(AllocationError, match="invalid allocation"):
        validate_allocation(s, alloc)


def test_validator_rejects_too_many_gpus():
    # 3 jobs x 2 GPUs on 4 GPUs; time-shared 2/3 each is fine, full shares are not.
    s = snap([job(x, 2, 10.0, "d") for x in "abc"], {"d": 1.0}, gpus=4, cache=0.0, io=0.0)
    assert allocation_violations(s, Allocation({x: 2 / 3 for x in "abc"})) == []
    problems = allocation_violations(s, Allocation({x: 1.0 for x in "abc"}))
    assert problems == ["GPUs: 6 allocated (time-averaged) > 4 in the cluster"]


def test_snapshot_rejects_unknown_dataset():
    with pytest.raises(UserError, match="unknown dataset"):
        snap([job("a", 1, 1.0, "missing")], {"d": 1.0}, gpus=1, cache=0.0, io=0.0)


# ---------------------------------------------------------------------------------------------
# Plug-in registry


FIXTURE = Path(__file__).parent / "plugin_fixture"


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """Install tests/plugin_fixture the way pip would: the package plus a .dist-info with
    entry_points.txt, in a directory on sys.path; importlib.metadata discovers it from there."""
    site = tmp_path / "site-packages"
    shutil.copytree(FIXTURE / "silod_example_plugin", site / "silod_example_plugin")
    info = site / "silod_example_plugin-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: silod-example-plugin\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n"
        "largest-efficiency = silod_example_plugin:LargestCacheEfficiencyFirst\n"
        "not-a-policy = silod_example_plugin:NotAPolicy\n"
        "broken = silod_example_plugin_missing:Nothing\n"
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "silod_example_plugin", raising=False)
    yield site
    sys.modules.pop("silod_example_plugin", None)


def test_entry_point_plugin_is_discovered_and_runs(installed_plugin):
    assert "largest-efficiency" in available_policies()
    assert set(BUILTIN_POLICIES) <= set(available_policies())
    policy = get_policy("largest-efficiency")
    assert isinstance(policy, Policy)
    assert type(policy).__module__ == "silod_example_plugin"
    # The example ranks by f*/d: effnet on a small dataset (69/0.1) before resnet (114/1.3) before BERT.
    s = snap(
        [job("resnet", 1, 114 * MB, "in22k", submit=0), job("bert", 4, 8 * MB, "web", submit=1), job("effnet", 1, 69 * MB, "small", submit=2)],
        {"in22k": 1.3 * TB, "web": 20.9 * TB, "small": 0.1 * TB},
        gpus=2,
        cache=1 * TB,
        io=50 * MB,
    )
    alloc = policy.allocate(s, SiloDEstimator())
    validate_allocation(s, alloc)
    assert dict(alloc.gpu_share) == {"resnet": 1.0, "bert": 0.0, "effnet": 1.0}
    # Algorithm 2 cache: "small" whole (0.1 TB), the rest 0.9 TB to in22k.
    assert dict(alloc.cache) == pytest.approx({"small": 0.1 * TB, "in22k": 0.9 * TB})


def test_broken_plugins_give_user_errors(installed_plugin):
    with pytest.raises(UserError, match="'not-a-policy' is .*not a subclass of policies.base.Policy"):
        get_policy("not-a-policy")
    with pytest.raises(UserError, match="'broken' failed to load"):
        get_policy("broken")


def test_plugin_not_visible_without_installation():
    assert "largest-efficiency" not in available_policies()


def test_unknown_policy_lists_valid_names(installed_plugin):
    with pytest.raises(UserError) as info:
        get_policy("round-robin")
    message = str(info.value)
    assert "'round-robin'" in message
    for name in [*POLICIES, "largest-efficiency"]:
        assert name in message


@pytest.mark.parametrize("name", POLICIES)
def test_builtin_policies_by_name(name):
    policy = get_policy(name)
    assert policy.name == name
    assert policy.time_sharing == (name == "gavel")


@pytest.mark.parametrize(
    "change",
    [
        {"cache": {"d1": float("nan"), "d2": 0.0}},
        {"remote_io": {"a": float("nan"), "b": 5.0}},
    ],
    ids=["nan-cache", "nan-io"],
)
def test_validator_rejects_nan(change):
    s = validator_case()
    assert allocation_violations(s, Allocation(**{**GOOD, **change})) != []


def test_gavel_gives_no_share_to_a_gang_that_cannot_fit():
    # 4 GPUs; "big" needs 8. Gavel's equal share is x = 4 / (2 * 8) = 0.25 and it keeps that, but
    # no round can ever hold 8 GPUs, so the job never runs while its ratio counts as met.
    s = snap([job("big", 8, 100.0, "d"), job("small", 1, 100.0, "d")], {"d": 100.0}, gpus=4, cache=100.0, io=100.0)
    alloc = GavelPolicy().allocate(s, SiloDEstimator())
    assert alloc.gpu_share["big"] == 0.0


def test_spread_gpu_time_fills_gpus_with_one_common_factor():
    from policies.gavel import spread_gpu_time

    # 4 GPUs, gangs of 2, 2, 1 and 1 (6 > 4, so not everyone runs all the time).
    # Shares 0.5, 0.25, 0.25, 0.1 use 1 + 0.5 + 0.25 + 0.1 = 1.85 GPUs. With factor s (below 2,
    # where the first share caps at 1): 2 * (0.5 s) + 2 * (0.25 s) + 0.25 s + 0.1 s = 1.85 s = 4
    # -> s = 2.162 > 2, so the first caps: 2 + 0.5 s + 0.25 s + 0.1 s = 4 -> s = 2 / 0.85.
    share = spread_gpu_time(np.array([0.5, 0.25, 0.25, 0.1]), np.array([2.0, 2.0, 1.0, 1.0]), 4.0)
    s = 2 / 0.85
    np.testing.assert_allclose(share, [1.0, 0.25 * s, 0.25 * s, 0.1 * s], rtol=1e-9)
    assert float(np.sum(share * np.array([2.0, 2.0, 1.0, 1.0]))) == pytest.approx(4.0)
    # Everyone fits: share 1 for every job that had any; a job with none keeps none.
    np.testing.assert_allclose(spread_gpu_time(np.array([0.2, 0.0, 0.5]), np.array([1.0, 1.0, 2.0]), 4.0), [1.0, 0.0, 1.0])


def test_job_view_builds_the_same_view_as_the_constructor():
    """The simulator's positional builder sets every field JobView(...) does, in its order."""
    from estimator.access import AccessPattern
    from estimator.pipeline import InputPipeline
    from policies.types import JobView, job_view

    pipeline = InputPipeline(cpu_rate=50e6)
    access = AccessPattern.epoch()
    built = job_view("j", 4, "ds", 1e8, 5e11, 12.0, True, 3, 0.25, access, pipeline)
    assert built == JobView("j", 4, "ds", 1e8, 5e11, 12.0, True, priority=3, hit_ratio_now=0.25, access=access, pipeline=pipeline)
    assert type(built) is JobView and hash(built) == hash(JobView("j", 4, "ds", 1e8, 5e11, 12.0, True, 3, 0.25, access, pipeline))
    with pytest.raises(AttributeError):
        built.remaining_bytes = 0.0  # still frozen


def _demands_job_by_job(jobs, cache, datasets):
    """demands_at_full_speed as it was written before it ran on columns: the specification its
    columns must follow to the bit."""
    out = []
    for j in jobs:
        view = datasets[j.dataset]
        allocated = cache.get(j.dataset, 0.0)
        if j.hit_ratio_now is None:
            hit = min(view.filled(allocated) / view.size, 1.0)
        else:
            kept = 1.0 if not view.cached else min(allocated / view.cached, 1.0)
            hit = min(max(j.hit_ratio_now, 0.0) * kept, 1.0)
        out.append(j.ideal_throughput * (1.0 - hit))
    return np.array(out, dtype=float)


_ODD = st.sampled_from([0.0, -0.0, 1.0, 0.5, 1e-300, 2.0, -1.0, 7, math.inf, math.nan])


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.one_of(st.none(), _ODD), st.floats(0.0, 1e3) | _ODD),
                     min_size=0, max_size=8),
       sets=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.tuples(st.sampled_from([1.0, 3.0, 1e12]), st.one_of(st.none(), _ODD))),
       cache=st.dictionaries(st.sampled_from(["a", "b", "c"]), _ODD | st.floats(0.0, 1e12)))
def test_demands_on_columns_are_the_job_by_job_rule(rows, sets, cache):
    datasets = {n: DatasetView(n, *sets.get(n, (2.0, None))) for n in "abc"}
    jobs = [JobView(f"j{i}", 1, d, ideal, 1e9, 0.0, hit_ratio_now=h) for i, (d, h, ideal) in enumerate(rows)]
    got = demands_at_full_speed(jobs, cache, datasets)
    want = _demands_job_by_job(jobs, cache, datasets)
    np.testing.assert_array_equal(got, want)
    real = ~np.isnan(want)
    assert np.array_equal(np.signbit(got[real]), np.signbit(want[real]))


def test_demands_refuse_a_dataset_of_size_zero_as_the_job_by_job_rule_did():
    datasets = {"a": DatasetView("a", 0.0, None)}
    unmeasured = [JobView("j", 1, "a", 10.0, 1e9, 0.0)]
    for rule in (demands_at_full_speed, _demands_job_by_job):
        with pytest.raises(ZeroDivisionError):
            rule(unmeasured, {"a": 0.0}, datasets)
    measured = [JobView("j", 1, "a", 10.0, 1e9, 0.0, hit_ratio_now=0.5)]  # no division by the size
    np.testing.assert_array_equal(demands_at_full_speed(measured, {}, datasets), _demands_job_by_job(measured, {}, datasets))


def test_a_last_epoch_reader_counts_for_new_cache_only_on_a_shared_dataset():
    """Delayed effectiveness (issue 46): bytes not cached yet count a job in its last epoch only
    where a co-reader reads its dataset (the co-reader's admissions serve items it has not read
    yet, in this epoch); a last-epoch job reading its dataset alone cannot use them. SiloD's
    Algorithm 2 has no such rule (it counts every reader); main dropped the last-epoch reader in
    both cases and gave the cache to d2 here."""
    from policies.storage import greedy_cache

    def datasets():
        return {"d1": DatasetView("d1", 60 * GB, cached=0.0), "d2": DatasetView("d2", 60 * GB, cached=0.0)}

    last = job("a", 1, 100 * MB, "d1", work=30 * GB)  # half an epoch left: its last
    co = job("b", 1, 40 * MB, "d1", work=180 * GB)
    other = job("c", 1, 80 * MB, "d2", work=180 * GB)
    # shared: d1's new bytes save (100 + 40) / 60 GB, more than d2's 80 / 60 GB
    assert greedy_cache([last, co, other], datasets(), 60 * GB) == pytest.approx({"d1": 60 * GB, "d2": 0.0})
    # alone: d1's new bytes save nothing for it
    assert greedy_cache([last, other], datasets(), 60 * GB) == pytest.approx({"d1": 0.0, "d2": 60 * GB})
    # Gavel's knapsack weighs its readers the same way
    s = Snapshot(0.0, (last, co, other), datasets(), ClusterCapacity(gpus=3, cache=60 * GB, remote_io=50 * MB))
    assert GavelProblem.from_snapshot(s, True).reuse.tolist() == [1.0, 1.0, 1.0]
    s = Snapshot(0.0, (last, other), datasets(), ClusterCapacity(gpus=3, cache=60 * GB, remote_io=50 * MB))
    assert GavelProblem.from_snapshot(s, True).reuse.tolist() == [0.0, 1.0]
