"""Cache-aware staggering (HiPC'23): the paper's model (estimator/stagger.py) by hand, its search,
and the paper's setting simulated item by item (scheduler/sim/stagger.py)."""

from __future__ import annotations

import pytest

from estimator.stagger import StaggerJob, jobs_from_rates, makespan, optimal_stagger, pair_times
from scheduler.sim.stagger import PAPER_ITEMS, PAPER_PAIR, PagecacheJob, calibrate, simulate_pair

# A: I 1, W 1 (cold iteration 2 s), W_conc 3 (4 s); B: I 0.5, W 1, W_conc 3.5 (4 s); cached: no
# wait; 100 iterations, 2 epochs each.
A = StaggerJob(1.0, 1.0, 0.0, 3.0, 2.0)
B = StaggerJob(0.5, 1.0, 0.0, 3.5, 2.0)


def test_eqs_by_hand():
    # t_B = 50: B (0.5 s cached) catches A (2 s cold) at t_C = 50 / (1 - 0.5/2) = 66.67 s, N =
    # 33.3 iterations in; then both at 4 s per iteration for the 66.67 left: T_A1 = 66.67 +
    # 266.67 = 333.3, plus 100 x 1 s: 433.3; T_B1 = 16.67 + 266.67 = 283.3, plus 50: 333.3;
    # makespan max(433.3, 50 + 333.3) = 433.3.
    t = pair_times(A, B, 100, 50.0)
    assert t.caught_up_at == pytest.approx(200 / 3)
    assert t.total_a == pytest.approx(200 / 3 + (100 - 100 / 3) * 4 + 100)
    assert t.total_b == pytest.approx(200 / 3 - 50 + (100 - 100 / 3) * 4 + 50)
    assert t.makespan == pytest.approx(t.total_a)
    # Simultaneous: both at 4 s for the whole first epoch: A 400 + 100, B 400 + 50.
    assert makespan(A, B, 100, 0.0) == pytest.approx(500.0)
    # At or past A's first epoch (200 s) B reads the cache only: 200 + 2 x 100 x 0.5 = 300 s;
    # A alone 200 + 100 = 300: makespan max(300, 200 + 100) = 300.
    assert makespan(A, B, 100, 200.0) == pytest.approx(300.0)
    # B catching up exactly at A's first epoch end: t_B = 200 x 0.75 = 150: A alone (300),
    # B 150 + 100 = 250: makespan 300 -- from there on, later is worse.
    assert makespan(A, B, 100, 150.0) == pytest.approx(300.0)
    assert makespan(A, B, 100, 250.0) == pytest.approx(350.0)


def test_search_finds_the_interior_optimum():
    best, m = optimal_stagger(A, B, 100)
    # M falls from 500 at 0 to 300 where B catches up at A's epoch end (150 s), and is 300 up
    # to 200 s, then rises: the search lands in [150, 200].
    assert m == pytest.approx(300.0, rel=1e-3)  # within the search tolerance (0.1% of the range)
    assert 150.0 - 1 <= best <= 200.0 + 1
    # No penalty for concurrency (W_conc = W): a simultaneous start is best.
    a0 = StaggerJob(1.0, 1.0, 0.0, 1.0, 2.0)
    b0 = StaggerJob(0.5, 1.0, 0.0, 1.0, 2.0)
    assert optimal_stagger(a0, b0, 100)[0] == 0.0


def test_parameters_from_rates():
    # 64 MB batches, f* 200 and 320 MB/s, a 100 MB/s link: I = 0.32 / 0.2 s, cold 0.64 s.
    a, b = jobs_from_rates(64e6, 200e6, 320e6, 100e6, 2, 3)
    assert (a.iteration, a.wait, a.wait_conc) == pytest.approx((0.32, 0.32, 0.96))
    assert (b.iteration, b.wait, b.wait_conc, b.epochs) == pytest.approx((0.2, 0.44, 1.08, 3))
    a1, _ = jobs_from_rates(64e6, 200e6, 320e6, 100e6, 2, 3, duplicate_fetches=False)
    assert a1.wait_conc == pytest.approx(a1.wait)
    with pytest.raises(ValueError):
        StaggerJob(-1.0, 0, 0, 0, 1)


def test_pagecache_simulation_by_hand():
    # Alone, cold: with 2 fetches in flight sharing the link, one item per `io` seconds; the GPU
    # (0.1 s) waits: 10 items x 1 s; then warm: 10 x 0.1 s.
    a = PagecacheJob("a", 0.1, 1.0, 2.0)
    assert simulate_pair(a, None, 10)["a"] == pytest.approx(10 * 1.0 + 10 * 0.1, rel=0.02)
    assert simulate_pair(a, None, 10, warm=True)["a"] == pytest.approx(20 * 0.1, rel=1e-6)
    # Together from a cold cache, same order, nothing shared in flight: each item fetched twice
    # at half the link -> 2 s per item in epoch 1.
    both = simulate_pair(a, PagecacheJob("b", 0.1, 1.0, 2.0), 10)
    assert both["a"] == pytest.approx(10 * 2.0 + 10 * 0.1, rel=0.05)


def test_paper_setting_has_its_optimum_inside_and_the_model_finds_it():
    a, b = PAPER_PAIR
    alone = simulate_pair(a, None, PAPER_ITEMS)[a.name]
    ms = []
    for pct in range(0, 101, 10):
        t = simulate_pair(a, b, PAPER_ITEMS, stagger=pct / 100 * alone)
        ms.append(max(t[a.name], pct / 100 * alone + t[b.name]))
    best = min(range(11), key=lambda i: ms[i])
    assert 2 <= best <= 6  # 20-60%: falls to an interior optimum (paper: near 40%) ...
    assert all(ms[i] > ms[i + 1] for i in range(best)) and all(ms[i] < ms[i + 1] for i in range(best, 10))  # ... then rises
    assert ms[0] > 1.3 * ms[best]
    pa, pb = calibrate(a, b, PAPER_ITEMS)
    t_best, predicted = optimal_stagger(pa, pb, PAPER_ITEMS)
    t = simulate_pair(a, b, PAPER_ITEMS, stagger=t_best)
    simulated = max(t[a.name], t_best + t[b.name])
    assert simulated == pytest.approx(ms[best], rel=0.03)  # the model's choice is as good as the sweep's best
    assert predicted == pytest.approx(simulated, rel=0.03)


# ---------------------------------------------------------------- the scheduler's option
GB, MB = 1e9, 1e6


def _two_jobs(cached_gb: float, a_left_gb: float):
    from policies.types import ClusterCapacity, DatasetView, JobView, Snapshot

    # Per 100 MB iteration (1,000 per 100 GB epoch): A trains in 1 s (100 MB/s), B in 0.5 s; the
    # 50 MB/s link brings an item in 2 s alone, 4 s when both fetch it (duplicate fetches).
    jobs = (JobView("a", 1, "d", 100 * MB, a_left_gb * GB, 0.0, running=True),
            JobView("b", 1, "d", 200 * MB, 200 * GB, 1.0))
    cap = ClusterCapacity(gpus=2, cache=200 * GB, remote_io=50 * MB, gpus_per_node=2)
    return Snapshot(0.0, jobs, {"d": DatasetView("d", 100 * GB, cached=cached_gb * GB)}, cap)


def test_scheduler_holds_the_second_job_by_hand():
    from policies.registry import estimator_for, get_policy
    from scheduler.core.planner import SchedulingCore

    # By hand (module test above, in these units): A's first epoch alone takes 2,000 s; B (0.5 s
    # per cached item) catches up at 4/3 t_B, at A's epoch end for t_B = 1,500 s. Starting B at
    # 0: both at 4 s per item for the whole epoch: 4,000 + 1,000 = 5,000 s; at 1,500 s or later
    # (up to 2,000): A alone 3,000 s. A is 25% into its first epoch (500 s): wait 1,000 s.
    snap = _two_jobs(cached_gb=25, a_left_gb=175)
    core = SchedulingCore(get_policy("fifo"), estimator_for("silod"), stagger=True)
    alloc = core.decide(snap)
    assert alloc.gpu_share["b"] == 0.0 and alloc.gpu_share["a"] == 1.0
    assert core.stagger_held["b"] == pytest.approx(1000.0, abs=5.0)
    assert core.stagger_recheck_at == pytest.approx(1000.0, abs=5.0)
    # Off (the default): B starts now.
    assert SchedulingCore(get_policy("fifo"), estimator_for("silod")).decide(snap).gpu_share["b"] == 1.0
    # A past the point where B would catch up at its epoch's end (80% in, 1,600 s > 1,500): start now.
    late = SchedulingCore(get_policy("fifo"), estimator_for("silod"), stagger=True)
    assert late.decide(_two_jobs(cached_gb=80, a_left_gb=120)).gpu_share["b"] == 1.0
    # A data path that shares fetches in flight: a simultaneous start costs nothing; never held.
    from policies.stagger import stagger_holds

    assert stagger_holds(snap, alloc.__class__({"a": 1.0, "b": 1.0}), duplicate_fetches=False) == {}


def test_simulator_starts_the_held_job_when_the_model_says():
    from policies.registry import estimator_for, get_policy
    from policies.types import ClusterCapacity
    from scheduler.sim.engine import SimConfig, Simulator
    from traces.model import Trace, TraceJob

    # B arrives 10 s after A (A has cached 10 s x 50 MB/s = 0.5 GB): held for ~1,490 s.
    trace = Trace((TraceJob("a", 0.0, 1, "m", "d", 100 * MB, 2.0), TraceJob("b", 10.0, 1, "m", "d", 200 * MB, 2.0)), {"d": 100 * GB})
    cap = ClusterCapacity(gpus=2, cache=200 * GB, remote_io=50 * MB, gpus_per_node=2)
    runs = {on: Simulator(trace, cap, get_policy("fifo"), estimator_for("silod"), "silod", SimConfig(stagger=on)).run() for on in (True, False)}
    start = {on: {j.job_id: j.start_s for j in r.jobs} for on, r in runs.items()}
    assert start[False]["b"] == pytest.approx(10.0)
    assert start[True]["b"] == pytest.approx(1500.0, rel=0.01)
