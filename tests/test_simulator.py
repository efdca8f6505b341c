"""The simulator against hand-computed small cases, and chunk level against item level."""

from __future__ import annotations

import numpy as np
import pytest

from policies import ClusterCapacity, get_policy
from policies.registry import estimator_for
from scheduler.sim.engine import SimConfig, Simulator
from traces.model import Trace, TraceJob

GB = 1e9
MB = 1e6


def run(jobs, sizes, *, gpus=1, cache=0.0, io=1e12, policy="fifo", system="silod", resolution=1000, round_s=360.0, seed=0):
    trace = Trace(tuple(jobs), sizes)
    cap = ClusterCapacity(gpus=gpus, cache=cache, remote_io=io, gpus_per_node=gpus)
    config = SimConfig(resolution=resolution, round_s=round_s, seed=seed)
    return Simulator(trace, cap, get_policy(policy), estimator_for(system), system, config).run()


def one_job(epochs=3.0, f=100 * MB, gpus=1, dataset="ds", job_id="a", submit=0.0):
    return TraceJob(job_id, submit, gpus, "m", dataset, f, epochs)


# The reader re-measures a job's miss ratio on the chunks left in its epoch at every step, so
# the order in which 1,000 chunks happen to be read moves results by a few tenths of a percent
# around the hand-computed values: 0.5% is that sampling noise, far below the effects tested.
REL = 5e-3


def jct(result, job_id="a"):
    return {r.job_id: r.jct_s for r in result.jobs}[job_id]


def test_one_job_alone_fills_cache_in_epoch_one_then_runs_at_io_perf():
    # f* = 100 MB/s, d = 100 GB, c = 50 GB, b = 20 MB/s, 3 epochs.
    # Epoch 1: nothing is cached yet, every byte is remote: 100 GB / 20 MB/s = 5000 s, and the
    # first 50 GB read are cached (uniform caching). Epochs 2 and 3: hit ratio c/d = 0.5, so
    # IOPerf = b / (1 - c/d) = 40 MB/s < f*: 100 GB / 40 MB/s = 2500 s each. Total 10000 s.
    result = run([one_job()], {"ds": 100 * GB}, cache=50 * GB, io=20 * MB)
    assert jct(result) == pytest.approx(10_000, rel=REL)
    assert result.remote_bytes == pytest.approx(200 * GB, rel=REL)  # 100 + 50 + 50


def test_one_job_not_io_bound_runs_at_ideal_speed():
    # b = 200 MB/s >= f* (1 - 0) = 100 MB/s: 3 epochs x 100 GB / 100 MB/s = 3000 s.
    result = run([one_job()], {"ds": 100 * GB}, cache=50 * GB, io=200 * MB)
    assert jct(result) == pytest.approx(3000, rel=REL)
    assert result.remote_bytes == pytest.approx(200 * GB, rel=REL)


def test_whole_dataset_cached_reads_nothing_remote_after_epoch_one():
    # c >= d: epoch 1 remote-bound at 20 MB/s (5000 s), then IOPerf is unbounded: 2 x 1000 s.
    result = run([one_job()], {"ds": 100 * GB}, cache=500 * GB, io=20 * MB)
    assert jct(result) == pytest.approx(7000, rel=1e-6)
    assert result.remote_bytes == pytest.approx(100 * GB, rel=1e-6)


@pytest.mark.parametrize("system", ["silod", "alluxio"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("epochs", [(3.0, 2.5 + 0.7 / 128), (1.0, 0.5 + 0.3 / 128)])
def test_two_readers_of_a_dataset_that_fits_fetch_it_exactly_once(system, seed, epochs):
    # Two jobs start together on one 100 GB dataset (128 chunks), a 200 GB cache, a 50 MB/s
    # link: every chunk is fetched by whichever reader reaches it first and then served to
    # both, so remote bytes are 100 GB exactly. The second job stops inside a chunk: if it
    # fetched that chunk, the cache holds the whole chunk and the first job reads it from there,
    # so the whole chunk counts once. (Summing the jobs' expected misses gave 96.9-100.4 GB in
    # the first setting; per job they stay expected misses.)
    jobs = [one_job(job_id="a", epochs=epochs[0]), one_job(job_id="b", epochs=epochs[1])]
    result = run(jobs, {"ds": 100 * GB}, gpus=2, cache=200 * GB, io=50 * MB, system=system, resolution=128, seed=seed)
    assert result.remote_bytes == pytest.approx(100 * GB, rel=1e-9)
    assert sum(r.remote_bytes + r.hit_bytes for r in result.jobs) == pytest.approx(sum(epochs) * 100 * GB, rel=1e-9)


@pytest.mark.parametrize("system", ["silod", "alluxio", "coordl", "quiver"])
def test_no_cache_at_all_runs_at_the_links_share(system):
    # --cache 0: nothing is ever cached. Two 100 MB/s jobs on a 50 MB/s link read 2 epochs of
    # 20 GB each at 25 MB/s: 1,600 s. Alluxio's turnover bound (tolerance x its 0 bytes / link)
    # made 1-ms steps here: 1.6 million of them.
    jobs = [one_job(2.0, dataset="d1", job_id="a"), one_job(2.0, dataset="d2", job_id="b")]
    result = run(jobs, {"d1": 20 * GB, "d2": 20 * GB}, gpus=2, cache=0.0, io=50 * MB, system=system)
    assert jct(result, "a") == pytest.approx(1600, rel=1e-9)
    assert jct(result, "b") == pytest.approx(1600, rel=1e-9)
    assert result.steps <= 10, result.steps


@pytest.mark.parametrize("system", ["silod", "quiver"])
def test_the_rest_of_an_epochs_last_chunk_is_read_at_its_own_miss_ratio(system):
    # One 256 MB/s job reads a cold 60 GB dataset once on a 36 MB/s link: 60 GB / 36 MB/s =
    # 1,666.7 s, whatever the steps. A second reader queued at 572 s cuts the steps (drift
    # bounds), and one ends inside the epoch's last chunk (seed 0). Every chunk has been looked up
    # there; the engine charged the rest of that chunk at the next epoch's miss ratio (0: the
    # dataset is cached by then), read it at f* and finished at 1,656.9 s. The queued job then
    # reads the cached dataset at its f*: 1,666.7 - 572 + 60 GB / 212 MB/s.
    jobs = [one_job(1.0, f=256 * MB, dataset="d1", job_id="j0"), one_job(1.0, f=212 * MB, dataset="d1", job_id="j2", submit=572.0)]
    result = run(jobs, {"d1": 60 * GB, "d0": 66 * GB}, gpus=1, cache=115 * GB, io=36 * MB, system=system, resolution=128)
    assert jct(result, "j0") == pytest.approx(60 * GB / (36 * MB), rel=1e-9)
    assert jct(result, "j2") == pytest.approx(60 * GB / (36 * MB) - 572 + 60 * GB / (212 * MB), rel=1e-9)
    assert result.steps > 2  # the steps really were cut (else this checks nothing)


def test_a_step_never_counts_negative_remote_bytes():
    # One job on an uncached 10-chunk dataset reads 5.5 chunks over two steps that end inside
    # chunks: each step counts the chunks it looks up, never less than zero, and the total is
    # the 6 chunks fetched (the last one whole: a fetch is a chunk's worth of items here).
    from scheduler.sim.cache_systems import SiloDCache
    from scheduler.sim.reader import SimJob, advance
    from scheduler.sim.types import SimDataset

    ds = SimDataset("ds", 10 * GB, 10, 0)
    cache = SiloDCache(0.0, 1, 0)
    job = SimJob(one_job(epochs=0.55), ds, 100 * MB, 5.5 * GB, np.random.default_rng(0))
    cache.register(job)
    job.start_epoch_view(cache)
    first = advance(job, 0.0, 53.0, 100 * MB, cache)
    second = advance(job, 53.0, 100.0, 100 * MB, cache)
    assert first.remote_bytes == pytest.approx(6 * GB) and second.remote_bytes == 0.0
    assert second.finished_at == pytest.approx(55.0)


def test_quiver_caches_whole_datasets_only():
    # 50 GB of cache cannot hold the 100 GB dataset: Quiver caches nothing, every epoch is
    # remote-bound: 3 x 5000 s. SiloD caches half of it (10000 s, above).
    result = run([one_job()], {"ds": 100 * GB}, cache=50 * GB, io=20 * MB, system="quiver")
    assert jct(result) == pytest.approx(15_000, rel=1e-6)
    fits = run([one_job()], {"ds": 100 * GB}, cache=100 * GB, io=20 * MB, system="quiver")
    assert jct(fits) == pytest.approx(7000, rel=1e-6)


def test_coordl_static_share_per_gpu_and_no_sharing():
    # Two 1-GPU jobs on one shared 100 GB dataset, 2 GPUs, 100 GB cache: CoorDL gives each job
    # 50 GB of its own (its GPU's share) and they cannot use each other's items. Each job: epoch
    # 1 remote-bound at 10 MB/s (link split max-min): 10000 s; epoch 2 half cached: demand
    # 50 MB/s each > 10 MB/s each, IOPerf = 20 MB/s: 5000 s. Total 15000 s.
    jobs = [one_job(2.0, job_id="a"), one_job(2.0, job_id="b")]
    coordl = run(jobs, {"ds": 100 * GB}, gpus=2, cache=100 * GB, io=20 * MB, system="coordl")
    assert jct(coordl, "a") == pytest.approx(15_000, rel=2 * REL)
    assert jct(coordl, "b") == pytest.approx(15_000, rel=2 * REL)
    # SiloD caches the dataset once for both: 100 GB fills during epoch 1 from both jobs' misses.
    silod = run(jobs, {"ds": 100 * GB}, gpus=2, cache=100 * GB, io=20 * MB, system="silod")
    assert max(jct(silod, "a"), jct(silod, "b")) < 12_000


def test_lru_thrashes_under_shuffled_epochs():
    # With half the dataset cached, uniform caching hits c/d = 50% from epoch 2 on; LRU evicts
    # items that the current epoch has not read yet and hits less (SiloD §2.2, §7.1.1).
    jobs = [one_job(6.0)]
    silod = run(jobs, {"ds": 100 * GB}, cache=50 * GB, io=20 * MB, resolution=500)
    lru = run(jobs, {"ds": 100 * GB}, cache=50 * GB, io=20 * MB, system="alluxio", resolution=500)
    silod_hit = 1 - silod.jobs[0].remote_bytes / (600 * GB)
    lru_hit = 1 - lru.jobs[0].remote_bytes / (600 * GB)
    assert silod_hit == pytest.approx(5 / 6 * 0.5, abs=0.01)  # epochs 2..6 hit 50%
    assert lru_hit < silod_hit - 0.05
    assert jct(lru) > jct(silod)


def test_fifo_gangs_wait_for_all_their_gpus():
    # 2 GPUs. A (2 GPUs, 1000 s) arrives first, B (1 GPU, 1000 s) at t=10 must wait for A.
    a = TraceJob("a", 0.0, 2, "m", "d1", 100 * MB, 1.0)
    b = TraceJob("b", 10.0, 1, "m", "d2", 100 * MB, 1.0)
    result = run([a, b], {"d1": 100 * GB, "d2": 100 * GB}, gpus=2, io=1e12)
    starts = {r.job_id: r.start_s for r in result.jobs}
    assert starts["a"] == 0.0
    assert starts["b"] == pytest.approx(1000.0, rel=1e-6)
    assert jct(result, "b") == pytest.approx(1990.0, rel=1e-6)


def test_gavel_time_shares_one_gpu_between_two_jobs():
    # Two identical 1000 s jobs on one GPU: max-min gives each half the GPU; with 100 s rounds
    # they alternate and both finish close to 2000 s (the last round decides which first).
    jobs = [one_job(1.0, job_id="a"), one_job(1.0, job_id="b")]
    result = run(jobs, {"ds": 100 * GB}, cache=0.0, io=1e12, policy="gavel", round_s=100.0)
    finishes = sorted(r.finish_s for r in result.jobs)
    assert finishes[0] == pytest.approx(1900, abs=101)
    assert finishes[1] == pytest.approx(2000, rel=1e-6)


def test_every_policy_and_cache_system_finishes_every_job():
    rng = np.random.default_rng(3)
    jobs = [TraceJob(f"j{i}", float(i * 200), int(rng.choice([1, 2])), "m", f"d{i % 3}", float(rng.uniform(20, 120)) * MB, 2.0) for i in range(8)]
    sizes = {f"d{k}": 50 * GB for k in range(3)}
    for policy in ("fifo", "sjf", "gavel", "greedy"):
        for system in ("silod", "alluxio", "coordl", "quiver"):
            result = run(jobs, sizes, gpus=3, cache=60 * GB, io=100 * MB, policy=policy, system=system, resolution=64)
            assert len(result.jobs) == 8 and not result.unfinished, (policy, system)
            for r in result.jobs:
                ideal = 2.0 * 50 * GB / next(j.ideal_throughput for j in jobs if j.job_id == r.job_id)
                assert r.jct_s >= ideal * (1 - 1e-6), (policy, system, r)


@pytest.mark.parametrize("system, second_jct", [("silod", 1500.0), ("quiver", 1500.0), ("coordl", 1500.0), ("alluxio", 1000.0)])
def test_idle_gap_applies_the_plan_at_the_last_completion(system, second_jct):
    # f* = 100 MB/s, b = 50 MB/s, a 50 GB dataset, 60 GB of cache, 2 epochs. Job a alone:
    # epoch 1 remote-bound, 50 GB / 50 MB/s = 1000 s, caching all of it; epoch 2 all hits at
    # f*: 500 s; JCT 1500 s. It finishes at 1500 s, the cluster is idle until b (same dataset)
    # arrives at 5000 s. The plan for no jobs holds no dataset: silod and quiver drop it (as
    # they would with any other job still active), CoorDL's cache was a's own, so b reads cold
    # again: 1500 s. Alluxio's LRU takes no plan and keeps it: 500 + 500 = 1000 s.
    jobs = [one_job(2.0, job_id="a"), one_job(2.0, job_id="b", submit=5000.0)]
    result = run(jobs, {"ds": 50 * GB}, cache=60 * GB, io=50 * MB, system=system)
    assert jct(result, "a") == pytest.approx(1500.0, rel=REL)
    assert jct(result, "b") == pytest.approx(second_jct, rel=REL)


def test_quiver_keeps_a_paused_jobs_dataset_under_time_sharing():
    # One GPU shared by Gavel in 100 s rounds between a (d1) and b (d2), 50 GB each, a 100 GB
    # cache that holds both, f* = 100 MB/s, b = 50 MB/s, 2 epochs each. Quiver ranks every
    # started job's dataset, running or paused, so each dataset is fetched once: 100 GB remote
    # in all; GPU time 2 x (1000 s cold epoch + 500 s cached epoch) = 3000 s, the makespan.
    # (Following only the running job, each pause evicted the other dataset and every round
    # refetched it.)
    jobs = [one_job(2.0, job_id="a", dataset="d1"), one_job(2.0, job_id="b", dataset="d2")]
    result = run(jobs, {"d1": 50 * GB, "d2": 50 * GB}, cache=100 * GB, io=50 * MB, policy="gavel", system="quiver", round_s=100.0)
    assert result.remote_bytes == pytest.approx(100 * GB, rel=REL)
    assert result.makespan_s == pytest.approx(3000.0, rel=REL)


def test_quiver_profile_is_kept_until_reprofiled_and_noise_defaults_to_zero():
    from scheduler.sim.cache_systems import QuiverCache, make_cache_system

    assert make_cache_system("quiver", 1e12, 4)._profile("ds", 0.0) == 1.0  # default: exact profiles
    cache = QuiverCache(1e12, 4, seed=0, profile_noise=0.25)
    first = cache._profile("ds", 0.0)
    assert first != 1.0
    assert cache._profile("ds", 3600.0) == first  # a pause or a new round does not re-measure
    cache.jobs_stopped([object()])
    assert cache._profile("ds", 12 * 3600.0 - 1) == first
    assert cache._profile("ds", 12 * 3600.0) != first  # re-profiled after 12 h
    with pytest.raises(Exception, match="--profile-noise"):
        make_cache_system("alluxio", 1e12, 4, profile_noise=0.1)


def test_timeline_splits_cache_and_io_by_partition():
    # A regular job and a curriculum job on their own datasets under silod: the curriculum
    # job's dataset is the irregular partition's (LRU), its remote reads the irregular IO.
    from estimator.access import AccessPattern

    regular = one_job(2.0, job_id="r", dataset="d1")
    curriculum = TraceJob("c", 0.0, 1, "m", "d2", 100 * MB, 2.0, AccessPattern.curriculum_learning(0.2, 2.0, 50, 64))
    trace = Trace((regular, curriculum), {"d1": 50 * GB, "d2": 50 * GB}, item_sizes={"d2": 1e6})
    cap = ClusterCapacity(gpus=2, cache=60 * GB, remote_io=80 * MB, gpus_per_node=2)
    result = Simulator(trace, cap, get_policy("fifo"), estimator_for("silod"), "silod", SimConfig(timeline_interval_s=200.0)).run()
    rows = result.timeline
    assert max(r.cache_cached_irregular for r in rows) > 0 and max(r.cache_cached_regular for r in rows) > 0
    assert max(r.remote_io_irregular for r in rows) > 0 and max(r.remote_io_regular for r in rows) > 0
    for r in rows:
        assert r.cache_cached_regular + r.cache_cached_irregular == pytest.approx(r.cache_cached, rel=1e-9, abs=1.0)
        assert r.remote_io_regular + r.remote_io_irregular == pytest.approx(r.remote_io_used, rel=1e-9, abs=1e-6)
    # Alluxio has no partitions: all its cache counts as regular, the curriculum job's IO still irregular.
    lru = Simulator(trace, cap, get_policy("fifo"), estimator_for("alluxio"), "alluxio", SimConfig(timeline_interval_s=200.0)).run()
    assert all(r.cache_cached_irregular == 0 for r in lru.timeline)
    assert max(r.remote_io_irregular for r in lru.timeline) > 0


@pytest.mark.parametrize("system", ["silod", "alluxio", "coordl", "quiver"])
@pytest.mark.parametrize("policy", ["fifo", "gavel"])
def test_the_column_advance_is_exactly_the_per_job_advance(system, policy, monkeypatch):
    # The engine advances most jobs on numpy columns (`Simulator._advance_vector`) and says the
    # result is exactly the per-job `advance`'s. Four jobs on three datasets with staggered
    # arrivals, run both ways: the same steps and JCTs. (The column path once left
    # `SimJob.tail_miss` behind; a step ending inside an epoch's last chunk then read the rest at
    # a stale miss ratio: Alluxio 0.9% apart, 273 steps against 260.)
    from scheduler.sim import engine
    from scheduler.sim.reader import advance

    jobs = [one_job(3.0, f=100 * MB, dataset="d1", job_id="a"), one_job(2.0, f=150 * MB, dataset="d2", job_id="b", submit=700.0),
            one_job(2.0, f=60 * MB, dataset="d1", job_id="c", submit=1500.0), one_job(1.0, f=200 * MB, dataset="d3", job_id="d", submit=2600.0)]
    sizes = {"d1": 60 * GB, "d2": 40 * GB, "d3": 30 * GB}
    columns = run(jobs, sizes, gpus=3, cache=70 * GB, io=60 * MB, system=system, policy=policy, resolution=128)

    def per_job(self, running, st, m0, caps_arr, now, dt, pre=(), first_substep=False, fresh=True):
        out = engine.Outcome.empty(len(running), dt)
        for i, (job, cap) in enumerate(zip(running, caps_arr.tolist())):
            out.put(i, advance(job, now, dt, cap, self.cache, 1 if first_substep else None))
        return out

    monkeypatch.setattr(engine.Simulator, "_advance_vector", per_job)
    scalar = run(jobs, sizes, gpus=3, cache=70 * GB, io=60 * MB, system=system, policy=policy, resolution=128)
    assert columns.steps == scalar.steps
    for job in ("a", "b", "c", "d"):
        assert jct(columns, job) == pytest.approx(jct(scalar, job), rel=1e-12), job


@pytest.mark.parametrize("policy", ["sjf", "fifo"])
def test_a_waiting_jobs_cached_dataset_is_kept_while_there_is_room(policy):
    # a: 100 GB, f* 100 MB/s, 3 epochs, link 25 MB/s, cache 200 GB (room for both datasets).
    # Epoch 1 is cold: 4,000 s, and d1 is then cached whole. b (10 GB, 1 epoch) arrives at
    # 4,500 s. SJF preempts a for b: b reads cold at 25 MB/s, 400 s; a resumes at 4,900 s with
    # 1,500 s of cached work left (the rest of epoch 2 and epoch 3 at f*): JCT 6,400 s.
    # FIFO keeps a running, b waits: a ends at 6,000 s, b reads 400 s: 6,400 - 4,500 = 1,900 s.
    # SiloD's SJF planned cache for the running jobs only, so d1 got no allocation while a was
    # paused and was evicted with 190 of 200 GB free: a resumed cold, 8,900 s.
    a = one_job(epochs=3, job_id="a")
    b = TraceJob("b", 4500.0, 1, "m", "d2", 100 * MB, 1.0)
    result = run([a, b], {"ds": 100 * GB, "d2": 10 * GB}, cache=200 * GB, io=25 * MB, policy=policy)
    expected = {"sjf": (6400, 400), "fifo": (6000, 1900)}[policy]
    assert (jct(result, "a"), jct(result, "b")) == pytest.approx(expected, rel=1e-6)
    assert result.remote_bytes == pytest.approx(110 * GB, rel=1e-6)  # each dataset fetched once
