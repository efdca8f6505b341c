"""CPU cores as the policies' fourth resource (policies/cpu.py, gavel.py, sjf.py, validation.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator.pipeline import InputPipeline
from policies.estimators import SiloDEstimator, VanillaEstimator
from policies.fifo import FifoPolicy, GreedyPolicy
from policies.gavel import GavelPolicy, GavelProblem, solve_max_min, water_fill
from policies.gavel_reference import reference_equal_share, solve_max_min_reference
from policies.sjf import SjfPolicy, sjf_scores
from policies.types import Allocation, ClusterCapacity, DatasetView, JobView, Snapshot
from policies.validation import allocation_violations, validate_allocation

MB = 1e6
GB = 1e9
TB = 1e12


def job(job_id, gpus, f, dataset, cpu=None, work=1e12, submit=0.0):
    return JobView(job_id, gpus, dataset, f, work, submit, pipeline=None if cpu is None else InputPipeline(cpu))


def snap(jobs, gpus=4, cpus_per_node=None, rule="model", cache=10 * TB, io=10 * GB, gpus_per_node=4, sizes=None):
    names = {j.dataset for j in jobs}
    return Snapshot(0.0, tuple(jobs), {n: DatasetView(n, (sizes or {}).get(n, 1 * TB)) for n in names},
                    ClusterCapacity(gpus=gpus, cache=cache, remote_io=io, gpus_per_node=gpus_per_node,
                                    cpus_per_node=cpus_per_node, cpu_allocation=rule))


IMAGE_A = job("a", 1, 100 * MB, "d1", cpu=35 * MB)  # needs 100/35 = 2.857 cores
IMAGE_B = job("b", 1, 69 * MB, "d2", cpu=35 * MB, submit=1.0)  # needs 1.971
TEXT = job("c", 1, 8 * MB, "d3", submit=2.0)  # not CPU-bound


@pytest.mark.parametrize("policy", [FifoPolicy(), GreedyPolicy(), SjfPolicy()])
def test_cores_by_marginal_speedup_hand_computed(policy):
    # 4 cores: b buys 35/69 of its speed per core, a 35/100: b first (1.971), a gets the rest.
    s = snap([IMAGE_A, IMAGE_B, TEXT], gpus=4, cpus_per_node=4)
    alloc = validate_allocation(s, policy.allocate(s, SiloDEstimator()))
    assert alloc.cpu["b"] == pytest.approx(69 / 35)
    assert alloc.cpu["a"] == pytest.approx(4 - 69 / 35)
    assert alloc.cpu["c"] == 0.0  # not CPU-bound: the model gives it none
    # IO is planned for the speed the cores allow: a reads at (4 - 1.971) x 35 = 71 MB/s, uncached
    # share (1 - c/d): the cache (10 TB) holds every dataset, so no job needs IO at all here.
    assert sum(alloc.remote_io.values()) == pytest.approx(0.0, abs=1e-6)


def test_cpu_bound_job_asks_for_less_io():
    s = snap([IMAGE_A], gpus=1, cpus_per_node=2, cache=0.0, io=1 * GB, gpus_per_node=1)
    alloc = FifoPolicy().allocate(s, SiloDEstimator())
    assert alloc.cpu["a"] == pytest.approx(2.0)  # capped by its node's 2 cores (needs 2.857)
    assert alloc.remote_io["a"] == pytest.approx(70 * MB)  # 2 x 35, not f* = 100


def test_gpu_proportional_baseline():
    s = snap([IMAGE_A, IMAGE_B, TEXT], gpus=4, cpus_per_node=4, rule="gpu-proportional")
    for policy in (FifoPolicy(), SjfPolicy(), GavelPolicy()):
        alloc = validate_allocation(s, policy.allocate(s, SiloDEstimator()))
        assert {k: round(v, 9) for k, v in alloc.cpu.items()} == {"a": 1.0, "b": 1.0, "c": 1.0}


def test_no_cpus_per_node_means_no_cpu_allocation_and_unchanged_results():
    with_pipe = snap([IMAGE_A, IMAGE_B, TEXT], gpus=2, cache=1 * TB, io=100 * MB)
    without = snap([dataclasses.replace(j, pipeline=None) for j in with_pipe.jobs], gpus=2, cache=1 * TB, io=100 * MB)
    for policy in (FifoPolicy(), GreedyPolicy(), SjfPolicy(), GavelPolicy()):
        a = policy.allocate(with_pipe, SiloDEstimator())
        b = policy.allocate(without, SiloDEstimator())
        assert a.cpu is None
        assert a == b


def test_gavel_cpu_bound_by_hand():
    # Two 1-GPU image jobs, 2 GPUs, 2 cores in all (cap 2 per job, one node), storage ample.
    # Equal share: 1 core each -> ref = 35 MB/s each. CPU bound: t <= 2 / (35/35 + 35/35) = 1,
    # GPU bound: t <= 2 / (35/100 + 35/69) > 1. So t* = 1: each job 1 core, 35 MB/s.
    a = job("a", 1, 100 * MB, "d1", cpu=35 * MB)
    b = job("b", 1, 69 * MB, "d2", cpu=35 * MB)
    s = snap([a, b], gpus=2, cpus_per_node=2, gpus_per_node=2)
    p = GavelProblem.from_snapshot(s, True)
    sol = solve_max_min(p)
    assert sol.reference == pytest.approx([35 * MB, 35 * MB])
    assert sol.ratio == pytest.approx(1.0)
    alloc = validate_allocation(s, GavelPolicy().allocate(s, SiloDEstimator()))
    assert sum(alloc.cpu[j] * alloc.gpu_share[j] for j in "ab") <= 2 + 1e-9
    assert alloc.cpu["a"] * 35 * MB * alloc.gpu_share["a"] == pytest.approx(35 * MB)


def test_gavel_water_fill_gives_spare_cores_to_the_job_that_can_use_them():
    # a needs 2.857 cores, b (text) none: the 4 cores all serve a; b is not held back by CPU.
    s = snap([IMAGE_A, TEXT], gpus=2, cpus_per_node=4, gpus_per_node=2)
    p = GavelProblem.from_snapshot(s, True)
    target = water_fill(p, solve_max_min(p))
    assert target == pytest.approx([100 * MB, 8 * MB])


def test_sjf_score_counts_cpu():
    # Work 1 TB; CPU term W / (r K) = 1e12 / (35e6 * 4).
    s_cpu = snap([IMAGE_A], gpus=4, cpus_per_node=4)
    s_no = snap([IMAGE_A], gpus=4)
    extra = sjf_scores(list(s_cpu.jobs), s_cpu, VanillaEstimator()) - sjf_scores(list(s_no.jobs), s_no, VanillaEstimator())
    assert extra[0] == pytest.approx(1e12 / (35e6 * 4))


@st.composite
def cpu_problems(draw):
    n = draw(st.integers(1, 10))
    m = draw(st.integers(1, n))
    idx = np.array([draw(st.integers(0, m - 1)) for _ in range(n)])
    used = np.unique(idx)
    idx = np.searchsorted(used, idx)
    total_gpus = draw(st.integers(1, 32))
    per_node = draw(st.sampled_from([g for g in (1, 2, 4, 8) if g <= total_gpus]))
    cpn = draw(st.floats(0.5, 16.0))  # few cores, so that the pool binds often
    rule = draw(st.sampled_from(["model", "gpu-proportional"]))
    cap = ClusterCapacity(gpus=total_gpus, cache=draw(st.floats(0.0, 40 * TB)), remote_io=draw(st.floats(1 * MB, 5 * GB)),
                          gpus_per_node=per_node, cpus_per_node=cpn, cpu_allocation=rule)
    gangs = [g for g in (1, 2, 4, 8) if g <= total_gpus]
    jobs = []
    all_cpu = draw(st.booleans())  # every job CPU-bound: the case where the pool bound decides t*
    for i in range(n):
        cpu = draw(st.floats(1 * MB, 100 * MB) if all_cpu else st.one_of(st.none(), st.floats(1 * MB, 200 * MB)))
        jobs.append(job(f"j{i}", draw(st.sampled_from(gangs)), draw(st.floats(2 * MB, 900 * MB)), f"d{idx[i]}", cpu=cpu,
                        work=draw(st.floats(1 * TB, 50 * TB))))
    sizes = {f"d{k}": draw(st.floats(100 * GB, 20 * TB)) for k in range(len(used))}
    s = Snapshot(0.0, tuple(jobs), {k: DatasetView(k, v) for k, v in sizes.items()}, cap)
    return s, draw(st.booleans())


@settings(max_examples=50, deadline=None)
@given(case=cpu_problems())
def test_gavel_closed_form_with_cpu_matches_cvxpy_reference(case):
    s, storage = case
    p = GavelProblem.from_snapshot(s, storage)
    exact = solve_max_min(p)
    ref = solve_max_min_reference(p)
    np.testing.assert_allclose(exact.reference, reference_equal_share(p), rtol=1e-9)
    assert exact.ratio == pytest.approx(ref.ratio, rel=1e-4)


@settings(max_examples=40, deadline=None)
@given(case=cpu_problems())
def test_every_policy_respects_cpu_capacity(case):
    s, storage = case
    est = SiloDEstimator() if storage else VanillaEstimator()
    for policy in (FifoPolicy(), GreedyPolicy(), SjfPolicy(), GavelPolicy()):
        alloc = policy.allocate(s, est)
        assert alloc.cpu is not None
        assert allocation_violations(s, alloc) == []


def test_validator_rejects_cpu_over_capacity():
    s = snap([IMAGE_A, IMAGE_B], gpus=2, cpus_per_node=4, gpus_per_node=2)
    base = dict(gpu_share={"a": 1.0, "b": 1.0}, cache={"d1": 0.0, "d2": 0.0}, remote_io={"a": 0.0, "b": 0.0})
    assert allocation_violations(s, Allocation(**base, cpu={"a": 2.0, "b": 2.0})) == []
    assert any("CPU: 5" in p for p in allocation_violations(s, Allocation(**base, cpu={"a": 3.0, "b": 2.0})))
    assert any("cores >" in p for p in allocation_violations(s, Allocation(**base, cpu={"a": 4.5, "b": 0.0})))
    assert any("not a non-negative" in p for p in allocation_violations(s, Allocation(**base, cpu={"a": -1.0, "b": 0.0})))
    no_cpu = snap([IMAGE_A, IMAGE_B], gpus=2, gpus_per_node=2)
    assert any("without cpus_per_node" in p for p in allocation_violations(no_cpu, Allocation(**base, cpu={"a": 1.0})))


def test_cores_the_link_cannot_feed_go_to_the_next_job():
    """policies.fifo.running_allocation: a job the whole link can feed at 20 MB/s with nothing of
    its dataset cached keeps 20 / 25 = 0.8 cores, not the 4 its f* asks; b gets the rest, and the
    cache goes to b's dataset (planned for b's speed with them)."""
    from policies.cpu import cores_the_link_can_feed
    from policies.estimators import SiloDEstimator
    from policies.fifo import FifoPolicy
    from policies.types import ClusterCapacity, DatasetView, JobView, Snapshot
    from estimator.pipeline import InputPipeline

    cap = ClusterCapacity(gpus=2, cache=1e9, remote_io=20e6, gpus_per_node=2, cpus_per_node=4)
    jobs = (JobView("a", 1, "dsa", 100e6, 10e9, 0.0, pipeline=InputPipeline(25e6)),
            JobView("b", 1, "dsb", 100e6, 10e9, 1.0, pipeline=InputPipeline(20e6)))
    datasets = {"dsa": DatasetView("dsa", 10e9), "dsb": DatasetView("dsb", 1e9)}
    alloc = FifoPolicy().allocate(Snapshot(0.0, jobs, datasets, cap), SiloDEstimator())
    assert alloc.cpu == pytest.approx({"a": 0.8, "b": 3.2})
    assert alloc.cache["dsb"] == pytest.approx(1e9) and not alloc.cache.get("dsa")
    # The bound itself: the whole link over the least miss ratio the cache allows, per core.
    fed = cores_the_link_can_feed(jobs, {"dsa": 5e9}, datasets, cap)
    assert fed.tolist() == pytest.approx([20e6 / 0.5 / 25e6, 20e6 / 1.0 / 20e6])  # b's dataset: nothing allocated
    # Unmanaged storage: the cluster's cache is the most any dataset can hold (1 GB of a's 10).
    assert cores_the_link_can_feed(jobs, None, datasets, cap).tolist() == pytest.approx([20e6 / 0.9 / 25e6, float("inf")])
