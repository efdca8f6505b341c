"""Autocaching applied (issue 22, Cachew): every policy's plan chooses per dataset between
caching source bytes and caching the preprocessed output of its readers' deterministic stage;
the simulator caches e x bytes per item and charges post_cpu_rate per core on hits."""

from __future__ import annotations

import pytest

from estimator.pipeline import InputPipeline
from policies.autocache import SWITCH_MARGIN, eligible_expansions, plan_autocache
from policies.registry import estimator_for, get_policy
from policies.types import Allocation, ClusterCapacity, DatasetView, JobView, Snapshot
from scheduler.sim.engine import SimConfig, Simulator
from traces.model import Trace, TraceJob

GB, MB = 1e9, 1e6
POLICIES = ("fifo", "sjf", "gavel", "greedy")


def _run(pipeline, policy="fifo", system="silod", remote_io=1 * GB, cache=100 * GB):
    trace = Trace((TraceJob("a", 0.0, 1, "resnet50", "d", 200 * MB, 3.0, pipeline=pipeline),), {"d": 10 * GB})
    cap = ClusterCapacity(gpus=1, cache=cache, remote_io=remote_io, gpus_per_node=1, cpus_per_node=4)
    return Simulator(trace, cap, get_policy(policy), estimator_for(system), system, SimConfig()).run().jobs[0]


@pytest.mark.parametrize("policy", POLICIES)
def test_cpu_bound_job_caches_preprocessed_data_by_hand(policy):
    # f* 200 MB/s, 4 cores, 20 MB/s per core for the whole pipeline (CPU bound 80 MB/s), 100 MB/s
    # per core after the autocache point, 2 bytes cached per source byte; 10 GB dataset, 3 epochs.
    # Source caching: 30 GB at 80 MB/s = 375 s. Preprocessed (20 GB fits the 100 GB cache):
    # epoch 1 decodes everything at 80 MB/s (125 s), epochs 2-3 read cached decoded items at
    # min(f*, 4 x 100) = 200 MB/s (100 s): 225 s.
    on = _run(InputPipeline(20 * MB, 2.0, 100 * MB), policy)
    off = _run(InputPipeline(20 * MB), policy)
    assert off.jct_s == pytest.approx(375.0, rel=1e-6)
    assert on.jct_s == pytest.approx(225.0, rel=1e-6)
    assert on.epoch_hit_ratios == pytest.approx((0.0, 1.0, 1.0))
    assert dict(on.bound_s) == pytest.approx({"cpu": 125.0, "gpu": 100.0})


def test_source_kept_when_preprocessed_data_would_cost_io():
    # 100 MB/s per core x 4 = 400 MB/s: never CPU-bound. A 50 MB/s link and a 10 GB cache that
    # holds the source (hit 1 from epoch 2) but only 1/6 of 6x-larger decoded data: source wins,
    # and the run is exactly the run without an autocache point.
    kw = dict(remote_io=50 * MB, cache=10 * GB)
    on = _run(InputPipeline(100 * MB, 6.0, 200 * MB), **kw)
    off = _run(InputPipeline(100 * MB), **kw)
    assert on.jct_s == pytest.approx(off.jct_s, rel=1e-9)
    assert on.remote_bytes == pytest.approx(off.remote_bytes, rel=1e-9)


def test_baseline_cache_systems_cache_source_bytes():
    on = _run(InputPipeline(20 * MB, 2.0, 100 * MB), system="alluxio")
    assert on.jct_s == pytest.approx(375.0, rel=1e-6)  # no autocaching without a planned cache


def _snapshot(*jobs, cap=None):
    cap = cap or ClusterCapacity(gpus=8, cache=100 * GB, remote_io=1 * GB, gpus_per_node=8, cpus_per_node=8)
    views = tuple(JobView(j, 1, ds, 200 * MB, 30 * GB, float(i), pipeline=p) for i, (j, ds, p) in enumerate(jobs))
    return Snapshot(0.0, views, {d: DatasetView(d, 10 * GB) for d in {ds for _, ds, _ in jobs}}, cap)


def test_eligibility_needs_every_reader_with_the_same_autocache_point():
    pre, pre3, none = InputPipeline(20 * MB, 2.0, 100 * MB), InputPipeline(20 * MB, 3.0, 100 * MB), InputPipeline(20 * MB)
    snap = _snapshot(("a", "d1", pre), ("b", "d1", pre), ("c", "d2", pre), ("d", "d2", none), ("e", "d3", pre), ("f", "d3", pre3))
    assert eligible_expansions(snap) == {"d1": 2.0}


def test_switch_margin_keeps_a_mode_on_a_small_gain():
    # One job on 4 cores, cache c of a 10 GB dataset, e = 2, unconstrained IO. Source: 4 x 20 =
    # 80 MB/s. Preprocessed: h = c / 20 GB, rate 4 / (h/100 + (1-h)/20) MB/s. With c = 0.3 GB the
    # gain is (4 / (0.015/100 + 0.985/20) - 80) / 200 = 0.0020: below the margin.
    pipe = InputPipeline(20 * MB, 2.0, 100 * MB)
    snap = _snapshot(("a", "d", pipe))

    def alloc(c):
        return Allocation({"a": 1.0}, cache={"d": c}, remote_io={"a": 1 * GB}, cpu={"a": 4.0})

    gain = (4 / (0.015 / 100 + 0.985 / 20) - 80) / 200
    assert 0 < gain < SWITCH_MARGIN
    assert plan_autocache(snap, alloc(0.3 * GB)) == {}  # source now: too small a gain to switch
    assert plan_autocache(snap, alloc(0.3 * GB), {"d": 2.0}) == {"d": 2.0}  # preprocessed now: kept
    assert plan_autocache(snap, alloc(20 * GB)) == {"d": 2.0}  # whole decoded set fits: switch
    assert plan_autocache(snap, Allocation({"a": 1.0})) == {}  # storage left to the cache system


class _ProportionalCache:
    """A plug-in-like policy: every job runs; cache split in proportion to the sizes it sees;
    each job gets the IO its f* needs on what is not cached, in arrival order."""

    name = "proportional-cache"
    time_sharing = False

    def allocate(self, snapshot, estimator):
        sizes = {n: d.size for n, d in snapshot.datasets.items()}
        total = sum(sizes.values())
        cache = {n: snapshot.capacity.cache * s / total for n, s in sizes.items()}
        io, left = {}, snapshot.capacity.remote_io
        for j in snapshot.jobs:
            want = j.ideal_throughput * max(0.0, 1 - cache[j.dataset] / sizes[j.dataset])
            io[j.job_id] = min(want, left)
            left -= io[j.job_id]
        return Allocation({j.job_id: 1.0 for j in snapshot.jobs}, cache=cache, remote_io=io, cpu={j.job_id: 4.0 for j in snapshot.jobs})


def test_a_switch_that_costs_other_jobs_more_is_refused():
    from policies.autocache import allocation_score
    from scheduler.core.planner import SchedulingCore, with_autocache_sizes

    # a: CPU-bound (4 cores x 20 MB/s = 80 MB/s of its 200), autocache point e = 2, 1,000 MB/s
    # per core after it. b: 300 MB/s, no CPU stage. Datasets 50 GB each, 100 GB cache, 100 MB/s.
    # Source: 50 GB each, all cached: a 80 (0.4 of its f*), b 300 (1.0): score 1.4.
    # a's readers' comparison on its 50 GB and half the link no cap holds (50 MB/s): h = 1/2,
    # min(4 / (0.5/1000 + 0.5/20) = 157, 50 / 0.5 = 100) = 100 MB/s: +0.10 of its f*, it asks.
    # Planned again with a at 100 GB, the cache splits 66.7 / 33.3 GB (h = 2/3 for both); a
    # (first in arrival order) takes the 66.7 MB/s it needs, b gets 33.3 and reads at
    # 33.3 / (1/3) = 100 MB/s: a 1.0 + b 0.33 = 1.33 < 1.4 + 0.05: refused.
    def snapshot(link):
        cap = ClusterCapacity(gpus=2, cache=100 * GB, remote_io=link, gpus_per_node=1, cpus_per_node=4)
        a = JobView("a", 1, "da", 200 * MB, 100 * GB, 0.0, running=True, pipeline=InputPipeline(20 * MB, 2.0, 1000 * MB))
        b = JobView("b", 1, "db", 300 * MB, 100 * GB, 1.0, running=True)
        return Snapshot(0.0, (a, b), {"da": DatasetView("da", 50 * GB), "db": DatasetView("db", 50 * GB)}, cap)

    snap = snapshot(100 * MB)
    policy = _ProportionalCache()
    src = policy.allocate(snap, None)
    assert plan_autocache(snap, src) == {"da": 2.0}  # a alone would switch
    pre = policy.allocate(with_autocache_sizes(snap, {"da": 2.0}), None)
    assert allocation_score(snap, src, {}) == pytest.approx(1.4)
    assert allocation_score(snap, pre, {"da": 2.0}) == pytest.approx(1.0 + 1 / 3)
    alloc = SchedulingCore(policy, estimator_for("silod")).decide(snap)
    assert dict(alloc.autocache) == {} and dict(alloc.cache) == pytest.approx({"da": 50 * GB, "db": 50 * GB})
    # A 120 MB/s link: b gets 53.3 MB/s, reads at 160 (0.53): 1.53 > 1.45, accepted.
    assert dict(SchedulingCore(policy, estimator_for("silod")).decide(snapshot(120 * MB)).autocache) == {"da": 2.0}


def test_a_filled_source_cache_is_not_thrown_away():
    # The same job whose decoded set fits (a clear gain) but whose dataset already holds 5 GB of
    # source bytes (half of it): it keeps caching source bytes; with nothing cached it switches.
    pipe = InputPipeline(20 * MB, 2.0, 100 * MB)
    alloc = Allocation({"a": 1.0}, cache={"d": 20 * GB}, remote_io={"a": 1 * GB}, cpu={"a": 4.0})
    cap = ClusterCapacity(gpus=8, cache=100 * GB, remote_io=1 * GB, gpus_per_node=8, cpus_per_node=8)

    def snap(cached):
        return Snapshot(0.0, (JobView("a", 1, "d", 200 * MB, 30 * GB, 0.0, pipeline=pipe),), {"d": DatasetView("d", 10 * GB, cached=cached)}, cap)

    assert plan_autocache(snap(5 * GB), alloc) == {}
    assert plan_autocache(snap(0.0), alloc) == {"d": 2.0}
    assert plan_autocache(snap(5 * GB), alloc, {"d": 2.0}) == {"d": 2.0}  # already decoded: kept


def test_a_switch_that_takes_cache_another_dataset_holds_is_refused():
    from policies.autocache import takes_filled_cache
    from scheduler.core.planner import SchedulingCore, with_autocache_sizes

    # The 120 MB/s case above, whose filled-cache score accepts the switch (1.53 > 1.45): planned
    # again with da at 100 GB, db's cache goes from 50 GB to 33.3 GB. If db holds its 50 GB now,
    # the switch drops 16.7 GB of it at once, to be refilled over the link, while da's decoded
    # copy starts empty: refused. Holding 30 GB (< 33.3 GB, nothing taken) it is accepted.
    def snapshot(db_cached):
        cap = ClusterCapacity(gpus=2, cache=100 * GB, remote_io=120 * MB, gpus_per_node=1, cpus_per_node=4)
        a = JobView("a", 1, "da", 200 * MB, 100 * GB, 0.0, running=True, pipeline=InputPipeline(20 * MB, 2.0, 1000 * MB))
        b = JobView("b", 1, "db", 300 * MB, 100 * GB, 1.0, running=True)
        return Snapshot(0.0, (a, b), {"da": DatasetView("da", 50 * GB, cached=0.0), "db": DatasetView("db", 50 * GB, cached=db_cached)}, cap)

    policy = _ProportionalCache()
    snap = snapshot(50 * GB)
    src = policy.allocate(snap, None)
    pre = policy.allocate(with_autocache_sizes(snap, {"da": 2.0}), None)
    assert takes_filled_cache(snap, src, pre, {"da"}) == pytest.approx(50 * GB - 100 * GB / 3)
    assert takes_filled_cache(snapshot(30 * GB), src, pre, {"da"}) == 0.0
    alloc = SchedulingCore(policy, estimator_for("silod")).decide(snap)
    assert dict(alloc.autocache) == {} and dict(alloc.cache) == pytest.approx({"da": 50 * GB, "db": 50 * GB})
    assert dict(SchedulingCore(policy, estimator_for("silod")).decide(snapshot(30 * GB)).autocache) == {"da": 2.0}
