"""The regular/irregular partitions around the policy (scheduler/core/partition.py): hand-computed
splits, the capacities on random instances for every policy (plug-ins included), and the
cluster settings that pin the split."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from estimator.access import EPOCH, IRREGULAR, AccessPattern
from estimator.errors import UserError
from policies import ClusterCapacity, DatasetView, JobView, SiloDEstimator, Snapshot, VanillaEstimator, allocation_violations, get_policy
from policies.registry import BUILTIN_POLICIES
from scheduler.core.cluster import load_cluster
from scheduler.core.planner import SchedulingCore
from scheduler.core.partition import allocate_partitioned, lru_datasets, partition_share, partition_violations, proportional_fill

try:
    from test_policies import installed_plugin  # noqa: F401  (fixture)
except ImportError:
    from tests.test_policies import installed_plugin  # noqa: F401

MB, GB, TB = 1e6, 1e9, 1e12
CURRICULUM = AccessPattern.curriculum_learning(0.04, 1.9, 50_000, 256)
SILOD = SiloDEstimator()


def job(job_id, gpus, f, dataset, access=EPOCH, work=1e13, submit=0.0, running=False):
    return JobView(job_id=job_id, gpus=gpus, dataset=dataset, ideal_throughput=f, remaining_bytes=work,
                   submit_time=submit, running=running, access=access)


def snap(jobs, sizes, gpus, cache, io, pin=None, cached=None):
    cached = cached or {}
    return Snapshot(
        time=0.0, jobs=tuple(jobs),
        datasets={n: DatasetView(n, s, cached=cached.get(n)) for n, s in sizes.items()},
        capacity=ClusterCapacity(gpus=gpus, cache=cache, remote_io=io, gpus_per_node=8, irregular_share=pin),
    )


# --- hand-computed rounds ---


def test_equal_demand_splits_storage_in_half_by_hand():
    # One regular and one curriculum job, same f*: s = 100/(100+100) = 0.5 of 1 TB and 100 MB/s.
    s = snap([job("r", 1, 100 * MB, "A"), job("c", 1, 100 * MB, "B", CURRICULUM)], {"A": 1 * TB, "B": 1 * TB},
             gpus=2, cache=1 * TB, io=100 * MB)
    a = allocate_partitioned(s, get_policy("fifo"), SILOD)
    p = a.partition
    assert p is not None and not p.pinned and p.irregular_share == pytest.approx(0.5)
    assert (p.regular_cache, p.irregular_cache) == pytest.approx((0.5 * TB, 0.5 * TB))
    assert (p.regular_io, p.irregular_io) == pytest.approx((50 * MB, 50 * MB))
    assert p.lru_datasets == {"B"} and p.regular_jobs == {"r"} and p.irregular_jobs == {"c"}
    assert dict(a.gpu_share) == {"r": 1.0, "c": 1.0}
    # Regular: Algorithm 2 fills A with its 0.5 TB; Eq. 2 demand 100 (1 - 0.5) = 50 MB/s.
    # Irregular: the LRU pool (0.5 TB) to B; demand 100 (1 - 0.5) = 50 MB/s, all of its link.
    assert dict(a.cache) == pytest.approx({"A": 0.5 * TB, "B": 0.5 * TB})
    assert dict(a.remote_io) == pytest.approx({"r": 50 * MB, "c": 50 * MB})
    assert partition_violations(s, a) == [] and allocation_violations(s, a) == []


def test_operator_pin_by_hand():
    # Pin 0.2: irregular 200 GB and 20 MB/s; regular 800 GB and 80 MB/s, of which the regular
    # job needs 100 (1 - 0.8) = 20 MB/s. The irregular job's demand 100 (1 - 0.2) = 80 is capped at 20.
    s = snap([job("r", 1, 100 * MB, "A"), job("c", 1, 100 * MB, "B", IRREGULAR)], {"A": 1 * TB, "B": 1 * TB},
             gpus=2, cache=1 * TB, io=100 * MB, pin=0.2)
    a = allocate_partitioned(s, get_policy("greedy"), SILOD)
    assert a.partition.pinned and a.partition.irregular_share == 0.2
    assert dict(a.cache) == pytest.approx({"A": 0.8 * TB, "B": 0.2 * TB})
    assert dict(a.remote_io) == pytest.approx({"r": 20 * MB, "c": 20 * MB})


def test_default_share_follows_demand_of_jobs_holding_gpus():
    # 2 GPUs; FIFO runs r1 (300 MB/s) and i1 (100 MB/s); i2 waits. s = 100 / 400 = 0.25.
    jobs = [job("r1", 1, 300 * MB, "A", submit=0), job("i1", 1, 100 * MB, "B", IRREGULAR, submit=1),
            job("i2", 1, 900 * MB, "C", IRREGULAR, submit=2)]
    s = snap(jobs, {"A": 1 * TB, "B": 1 * TB, "C": 1 * TB}, gpus=2, cache=1 * TB, io=1 * GB)
    share, pinned = partition_share(s, {"r1": 1.0, "i1": 1.0, "i2": 0.0})
    assert share == pytest.approx(0.25) and not pinned
    a = allocate_partitioned(s, get_policy("fifo"), SILOD)
    assert a.partition.irregular_share == pytest.approx(0.25)
    assert dict(a.gpu_share) == {"r1": 1.0, "i1": 1.0, "i2": 0.0}
    # Nobody holds GPUs: the active jobs' f* decide: (100 + 900) / 1300.
    assert partition_share(s, {})[0] == pytest.approx(1000 / 1300)


def test_only_irregular_jobs_get_the_whole_cluster_even_when_pinned():
    s = snap([job("c", 1, 100 * MB, "B", CURRICULUM)], {"B": 1 * TB}, gpus=1, cache=300 * GB, io=50 * MB, pin=0.1)
    a = allocate_partitioned(s, get_policy("sjf"), SILOD)
    assert a.partition.irregular_share == 1.0 and not a.partition.pinned
    assert dict(a.cache) == pytest.approx({"B": 300 * GB})
    assert dict(a.remote_io) == pytest.approx({"c": 50 * MB})  # demand 70 MB/s, link 50


@pytest.mark.parametrize("policy_name", sorted(BUILTIN_POLICIES))
def test_without_irregular_jobs_it_is_the_plain_policy_call(policy_name):
    s = snap([job("a", 1, 100 * MB, "A"), job("b", 2, 50 * MB, "B", submit=1)], {"A": 1 * TB, "B": 2 * TB},
             gpus=2, cache=1 * TB, io=100 * MB, pin=0.3)
    policy = get_policy(policy_name)
    assert allocate_partitioned(s, policy, SILOD) == policy.allocate(s, SILOD)
    assert allocate_partitioned(s, policy, SILOD).partition is None


def test_a_queued_regular_reader_does_not_keep_a_running_curriculum_jobs_dataset_uniform():
    # One GPU: the curriculum job holds it (it came first), a regular job on the same dataset
    # waits. The regular partition plans cache only for the jobs it runs (none), so with the
    # dataset kept uniform there the curriculum job had no cache at all. It is the LRU
    # partition's now: s = 1 (no regular job holds GPUs), all 20 GB of the cache to "shared".
    c = job("c", 1, 100 * MB, "shared", CURRICULUM, submit=0.0, running=True)
    r = job("r", 1, 100 * MB, "shared", submit=10.0)
    s = snap([c, r], {"shared": 40 * GB}, gpus=1, cache=20 * GB, io=30 * MB)
    a = allocate_partitioned(s, get_policy("fifo"), SILOD)
    assert dict(a.gpu_share) == {"c": 1.0, "r": 0.0}
    assert a.partition.lru_datasets == {"shared"}
    assert dict(a.cache) == pytest.approx({"shared": 20 * GB})
    assert partition_violations(s, a) == []
    # Once the regular reader holds GPUs, the dataset is uniform again, whoever else reads it.
    assert lru_datasets([c, r], {"c": 1.0, "r": 1.0}) == set()
    assert lru_datasets([c, r], {"c": 1.0, "r": 0.0}) == {"shared"}


def test_storage_unaware_estimator_is_one_plain_call():
    s = snap([job("a", 1, 100 * MB, "A"), job("c", 1, 100 * MB, "B", IRREGULAR)], {"A": 1 * TB, "B": 1 * TB},
             gpus=2, cache=1 * TB, io=100 * MB)
    a = allocate_partitioned(s, get_policy("fifo"), VanillaEstimator())
    assert a.cache is None and a.remote_io is None and a.partition is None


def test_dataset_read_by_both_kinds_stays_uniform_in_the_regular_partition():
    jobs = [job("r", 1, 100 * MB, "shared"), job("c", 1, 100 * MB, "shared", CURRICULUM), job("c2", 1, 100 * MB, "own", CURRICULUM)]
    assert lru_datasets(jobs) == {"own"}
    s = snap(jobs, {"shared": 1 * TB, "own": 1 * TB}, gpus=3, cache=900 * GB, io=300 * MB)
    a = allocate_partitioned(s, get_policy("fifo"), SILOD)
    # s = 200/300; regular partition 300 GB all to "shared"; LRU pool 600 GB to "own".
    assert a.partition.lru_datasets == {"own"}
    assert dict(a.cache) == pytest.approx({"shared": 300 * GB, "own": 600 * GB})
    # The curriculum reader of "shared" is in the irregular partition's link, with the uniform
    # cache of "shared" counted: demand 100 (1 - 0.3) = 70; c2: 100 (1 - 0.6) = 40; link 200.
    assert a.remote_io["c"] == pytest.approx(70 * MB) and a.remote_io["c2"] == pytest.approx(40 * MB)


def test_lru_pool_is_split_by_read_rate_and_capped_at_dataset_size():
    # Read rates 300 and 100 MB/s; pool 1 TB -> 750/250 GB, but "small" holds only 100 GB,
    # so it gets 100 GB and "big" the remaining 900 GB.
    jobs = [job("r", 1, 10 * MB, "R"), job("x", 1, 300 * MB, "big", IRREGULAR), job("y", 1, 100 * MB, "small", IRREGULAR)]
    s = snap(jobs, {"R": 1 * TB, "big": 5 * TB, "small": 100 * GB}, gpus=3, cache=2 * TB, io=1 * GB, pin=0.5)
    a = allocate_partitioned(s, get_policy("fifo"), SILOD)
    assert a.cache["big"] == pytest.approx(900 * GB) and a.cache["small"] == pytest.approx(100 * GB)
    assert proportional_fill(__import__("numpy").array([3.0, 1.0]), __import__("numpy").array([10.0, 10.0]), 4.0).tolist() == [3.0, 1.0]


def test_gavel_fractional_budgets_keep_the_one_pool():
    # One GPU, three jobs: Gavel time-shares it; the partitions together never exceed it.
    jobs = [job("r1", 1, 100 * MB, "A"), job("r2", 1, 100 * MB, "B"), job("c", 1, 100 * MB, "C", CURRICULUM)]
    s = snap(jobs, {"A": 1 * TB, "B": 1 * TB, "C": 1 * TB}, gpus=1, cache=1 * TB, io=300 * MB)
    a = allocate_partitioned(s, get_policy("gavel"), SILOD)
    used = sum(a.gpu_share.values())
    assert used <= 1.0 + 1e-9
    assert a.partition.regular_gpus + a.partition.irregular_gpus <= 1.0 + 1e-9
    assert all(v > 0 for v in a.gpu_share.values())
    assert partition_violations(s, a) == [] and allocation_violations(s, a) == []


def test_scheduling_core_applies_the_partition():
    s = snap([job("r", 1, 100 * MB, "A"), job("c", 1, 100 * MB, "B", CURRICULUM)], {"A": 1 * TB, "B": 1 * TB},
             gpus=2, cache=1 * TB, io=100 * MB)
    core = SchedulingCore(get_policy("sjf"), SILOD)
    plan = core.plan(s)
    assert plan.allocation.partition is not None and set(plan.running) == {"r", "c"}
    assert dict(plan.cache) == pytest.approx({"A": 0.5 * TB, "B": 0.5 * TB})


def test_partition_violations_catches_a_partition_overrun():
    from dataclasses import replace

    s = snap([job("r", 1, 100 * MB, "A"), job("c", 1, 100 * MB, "B", IRREGULAR)], {"A": 1 * TB, "B": 1 * TB},
             gpus=2, cache=1 * TB, io=100 * MB, pin=0.2)
    a = allocate_partitioned(s, get_policy("fifo"), SILOD)
    bad = replace(a, cache={"A": 0.5 * TB, "B": 0.5 * TB})  # the LRU pool is 0.2 TB
    assert any("irregular partition: cache" in p for p in partition_violations(s, bad))
    bad = replace(a, remote_io={"r": 10 * MB, "c": 60 * MB})  # its link is 20 MB/s
    assert any("irregular partition: remote IO" in p for p in partition_violations(s, bad))
    bad = replace(a, partition=replace(a.partition, lru_datasets=frozenset({"A", "B"})))
    assert any("must stay uniform" in p for p in partition_violations(s, bad))


# --- random instances: every policy, the capacities of both partitions and of the cluster ---


@st.composite
def mixed_snapshots(draw, max_jobs=10):
    n = draw(st.integers(1, max_jobs))
    m = draw(st.integers(1, n))
    total_gpus = draw(st.integers(1, 32))
    gangs = [g for g in (1, 1, 2, 4, 8) if g <= total_gpus]
    sizes = {f"ds{k}": draw(st.floats(1 * GB, 20 * TB)) for k in range(m)}
    access = st.sampled_from([EPOCH, EPOCH, IRREGULAR, CURRICULUM])
    jobs = [
        job(f"j{i}", draw(st.sampled_from(gangs)), draw(st.floats(2 * MB, 900 * MB)), f"ds{draw(st.integers(0, m - 1))}",
            access=draw(access), work=draw(st.floats(1 * GB, 1e14)), submit=float(draw(st.integers(0, 1000))),
            running=draw(st.booleans()))
        for i in range(n)
    ]
    used = {j.dataset for j in jobs}
    cached = {k: draw(st.one_of(st.none(), st.floats(0.0, v))) for k, v in sizes.items() if k in used}
    return snap(
        jobs, {k: v for k, v in sizes.items() if k in used}, gpus=total_gpus,
        cache=draw(st.one_of(st.just(0.0), st.floats(0.0, 40 * TB))),
        io=draw(st.floats(1.0, 5 * GB)),
        pin=draw(st.one_of(st.none(), st.floats(0.0, 1.0))),
        cached=cached,
    )


def _check(s: Snapshot, policy_name: str) -> None:
    policy = get_policy(policy_name)
    a = allocate_partitioned(s, policy, SILOD)
    assert allocation_violations(s, a) == []  # the sum never exceeds the cluster
    assert set(a.gpu_share) == {j.job_id for j in s.jobs}
    if all(j.access.regular for j in s.jobs):
        assert a.partition is None
        return
    p = a.partition
    assert partition_violations(s, a) == []  # no partition exceeds its share
    assert 0.0 <= p.irregular_share <= 1.0
    assert p.irregular_cache == pytest.approx(p.irregular_share * s.capacity.cache)
    assert p.regular_cache + p.irregular_cache <= s.capacity.cache * (1 + 1e-9) + 1e-6
    assert p.regular_io + p.irregular_io <= s.capacity.remote_io * (1 + 1e-9) + 1e-6
    if s.capacity.irregular_share is not None and not all(not j.access.regular for j in s.jobs):
        assert p.pinned and p.irregular_share == s.capacity.irregular_share
    if not policy.time_sharing:
        assert set(a.gpu_share.values()) <= {0.0, 1.0}
        gpus = {j.job_id: j.gpus for j in s.jobs}
        assert sum(gpus[k] for k, v in a.gpu_share.items() if v == 1.0) <= s.capacity.gpus


@pytest.mark.parametrize("policy_name", sorted(BUILTIN_POLICIES))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=mixed_snapshots())
def test_partitions_respected_on_random_instances(policy_name, s):
    _check(s, policy_name)


def test_plugin_policy_works_unchanged_inside_the_partitions(installed_plugin):
    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(s=mixed_snapshots())
    def run(s):
        _check(s, "largest-efficiency")

    run()


# --- the operator's pin: ClusterCapacity, the cluster YAML and the flags ---


def test_capacity_rejects_a_share_outside_0_1():
    for bad in (-0.1, 1.5):
        with pytest.raises(UserError, match="irregular_share"):
            ClusterCapacity(gpus=1, cache=1.0, remote_io=1.0, irregular_share=bad)


def test_cluster_yaml_and_flag_set_the_pin(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("gpus: 8\ncache: 1TB\nremote_io: 1GB/s\nirregular_share: 0.2\n")
    cap, _ = load_cluster(f)
    assert cap.irregular_share == 0.2
    cap, _ = load_cluster(f, irregular_share="0.35")
    assert cap.irregular_share == 0.35
    cap, _ = load_cluster(None, gpus=8, cache="1TB", remote_io="1GB/s")
    assert cap.irregular_share is None
    for bad in ("2", "x", "nan", True):
        with pytest.raises(UserError, match="irregular.share"):
            load_cluster(None, gpus=8, cache="1TB", remote_io="1GB/s", irregular_share=bad)


MIXED_TRACE = """job_id,submit_time,num_gpus,model,dataset,dataset_size,ideal_throughput,epochs,access,starting_percent,alpha,step,batch
a,0,1,resnet50,d1,200GB,114MB/s,3,,,,,
b,10,2,resnet50,d2,300GB,228MB/s,2,curriculum,0.04,1.9,50000,256
c,20,1,vlad,d3,100GB,10MB/s,2,irregular,,,,
d,30,1,resnet50,d1,200GB,114MB/s,2,irregular,,,,
"""


def test_simulate_takes_the_flag_and_a_mixed_trace(tmp_path):
    import json
    import subprocess
    import sys

    trace = tmp_path / "mixed.csv"
    trace.write_text(MIXED_TRACE)
    base = [sys.executable, "-m", "scheduler", "simulate", "--trace", str(trace), "--gpus", "4", "--cache", "300GB",
            "--remote-io", "200MB/s", "--quiet"]
    # Curriculum job b reads a dataset outside the catalog: its item size is needed, and asked for.
    refused = subprocess.run([*base, "--policy", "gavel", "--irregular-share", "0.3", "--out", str(tmp_path / "o")],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr
    assert "job b is a curriculum job on dataset 'd2'" in refused.stderr and "item_size" in refused.stderr
    sized = tmp_path / "sized.csv"
    lines = MIXED_TRACE.strip().splitlines()
    sized.write_text("\n".join([lines[0] + ",item_size"] + [line + ("," + "110KB" if line.startswith("b,") else ",") for line in lines[1:]]) + "\n")
    for extra in ([], ["--no-irregular-partition"]):
        ok = subprocess.run([*base[:5], str(sized), *base[6:], "--policy", "gavel", "--irregular-share", "0.3", *extra,
                             "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300)
        assert ok.returncode == 0, ok.stderr
        assert json.loads((tmp_path / "o" / "summary.json").read_text())["jobs"] == 4
    bad = subprocess.run([*base, "--irregular-share", "1.5", "--out", str(tmp_path / "b")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--irregular-share 1.5 must be in [0, 1]" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_serve_builds_its_cluster_with_the_pin(tmp_path):
    from scheduler.service.cli import build_service

    service = build_service(db=f"sqlite:///{tmp_path / 's.db'}", backend="null", policy="fifo", round_s=360, gpus="8",
                            cache="1TB", remote_io="1GB/s", irregular_share="0.25", state_dir=tmp_path / "state")
    try:
        assert service.config.capacity.irregular_share == 0.25
    finally:
        service.close()
