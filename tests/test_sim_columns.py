"""The simulator's job columns and its exact-charge rule, and decision coalescing.

- One SiloD job alone on a half-cached dataset, by hand: 8,000 s exactly at any seed and
  resolution (the engine used to charge each epoch at a miss ratio that random-walked with its
  own look-ups: 7,900-8,100 s by seed at 128 chunks).
- The columns the engine hands to policies (policies.types.JobColumns) equal the ones built
  from its JobViews, and every column path (the Gavel problem, the round planner's choice, the
  allocation check) answers as the per-view path does, on every decision of a real run.
- --decision-interval: off by default; on, decisions while jobs run are that far apart.
- The job table's rows equal what the running jobs hold at every step: with cores, time
  sharing and reused slots, and when autocaching drops an LRU dataset's domain.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from policies import ClusterCapacity, get_policy
from policies.gavel import GavelProblem, _equal_share_throughput, equal_share_throughput
from policies.registry import estimator_for
from policies.types import JobColumns
from policies.validation import _clearly_valid, allocation_violations
from scheduler.core.planner import RoundPlanner
from scheduler.sim import engine as engine_module
from scheduler.sim.engine import SimConfig, Simulator
from traces.model import Trace, TraceJob
from traces.synthetic import generate_trace

GB = 1e9
MB = 1e6


@pytest.mark.parametrize("resolution", [100, 128, 1000])
@pytest.mark.parametrize("seed", [0, 1, 6])
def test_one_silod_job_on_a_half_cached_dataset_takes_8000_s_exactly(resolution, seed):
    # f* = 100 MB/s, d = 100 GB, c = 50 GB, b = 25 MB/s, 3 epochs. Epoch 1: nothing cached,
    # 100 GB / 25 MB/s = 4,000 s, admitting the first 50 GB read. Epochs 2 and 3: exactly half
    # of the chunks are cached whatever the order they are read in, so half the bytes cross
    # the link, which bounds the job: 50 GB / 25 MB/s = 2,000 s each. Total 8,000 s.
    trace = Trace((TraceJob("a", 0.0, 1, "m", "ds", 100 * MB, 3.0),), {"ds": 100 * GB})
    cap = ClusterCapacity(gpus=1, cache=50 * GB, remote_io=25 * MB, gpus_per_node=1)
    result = Simulator(trace, cap, get_policy("fifo"), estimator_for("silod"), "silod",
                       SimConfig(resolution=resolution, seed=seed)).run()
    job = result.jobs[0]
    assert job.jct_s == pytest.approx(8000.0, rel=1e-9)
    assert job.epoch_hit_ratios == pytest.approx((0.0, 0.5, 0.5), abs=1e-9)
    assert result.remote_bytes == pytest.approx(200 * GB, rel=1e-9)


class CheckingSimulator(Simulator):
    """Checks every snapshot's columns and the column paths against the per-view ones."""

    checked = 0

    def _snapshot(self, now, active, slots):
        snap = super()._snapshot(now, active, slots)
        cols = snap.job_columns()
        assert cols is not None
        ref = JobColumns.of(snap.jobs)
        for name in ("gpus", "ideal", "remaining", "running", "submit"):
            np.testing.assert_array_equal(getattr(cols, name), getattr(ref, name))
        # The engine's ranks are among all the trace's jobs: the same order as the ids'.
        np.testing.assert_array_equal(np.argsort(cols.id_rank, kind="stable"), np.argsort(ref.id_rank, kind="stable"))
        # Dataset ranks among all the trace's datasets: the same grouping and order as the names'.
        np.testing.assert_array_equal(np.unique(cols.dataset_rank, return_inverse=True)[1], ref.dataset_rank)
        if ref.hit_now is None:
            assert cols.hit_now is None
        else:
            np.testing.assert_array_equal(cols.hit_now, ref.hit_now)
        assert cols.all_regular == ref.all_regular
        assert cols.ids == ref.ids and cols.datasets == ref.datasets
        bare = replace(snap, columns=None)  # the per-view paths
        for storage in (True, False):
            a, b = GavelProblem._build(snap, storage), GavelProblem._build(bare, storage)
            for field in ("gpus", "ideal", "dataset_index", "dataset_size", "reuse"):
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
            assert a.job_ids == b.job_ids and a.dataset_names == b.dataset_names
            for field in ("hit_now", "dataset_cached"):
                x, y = getattr(a, field), getattr(b, field)
                assert (x is None) == (y is None)
                if x is not None:
                    np.testing.assert_array_equal(x, y)
        policy, estimator = self.core.policy, self.core.estimator
        got, want = policy.allocate(snap, estimator), policy.allocate(bare, estimator)
        for field in ("gpu_share", "cache", "remote_io", "cpu"):
            x, y = getattr(got, field), getattr(want, field)
            assert (None if x is None else list(x.items())) == (None if y is None else list(y.items())), field
        self.checked += 1
        self._last_snapshots = (snap, bare)
        return snap


class LateReadingSimulator(Simulator):
    """Reads each snapshot's views only once the next one was taken (the engine then builds
    them apart from the views it keeps between decisions: `Simulator._views`), and checks them
    against that snapshot's columns, taken with it. Gavel and FIFO read no views themselves."""

    checked = 0
    _previous = None

    def _snapshot(self, now, active, slots):
        snap = super()._snapshot(now, active, slots)
        old, self._previous = self._previous, snap
        if old is not None:
            ref = JobColumns.of(old.jobs)
            for name in ("gpus", "ideal", "remaining", "running", "submit"):
                np.testing.assert_array_equal(getattr(old.columns, name), getattr(ref, name))
            assert (old.columns.hit_now is None) == (ref.hit_now is None)
            if ref.hit_now is not None:
                np.testing.assert_array_equal(old.columns.hit_now, ref.hit_now)
            assert old.columns.ids == ref.ids
            self.checked += 1
        return snap


@pytest.mark.parametrize("policy", ["gavel", "fifo"])
def test_views_read_after_the_next_snapshot_are_the_ones_of_their_own(policy):
    trace = generate_trace(40, mean_interarrival_s=300.0, seed=5)
    cap = ClusterCapacity(gpus=16, cache=trace_cache(trace), remote_io=2 * GB, gpus_per_node=4)
    sim = LateReadingSimulator(trace, cap, get_policy(policy), estimator_for("silod"), "silod", SimConfig())
    assert not sim.run().unfinished
    assert sim.checked > 20


@pytest.mark.parametrize("policy,system", [("gavel", "silod"), ("fifo", "silod"), ("sjf", "silod"), ("sjf", "quiver"), ("gavel", "alluxio")])
def test_columns_answer_as_the_job_views_do(policy, system, monkeypatch):
    planner_pairs = []
    original_choose = RoundPlanner.choose

    def choose(self, snapshot, allocation):
        got = original_choose(self, snapshot, allocation)
        bare = replace(snapshot, columns=None)
        assert got == original_choose(self, bare, allocation)
        assert _clearly_valid(snapshot, allocation) <= (allocation_violations(bare, allocation) == [])
        planner_pairs.append(got)
        return got

    monkeypatch.setattr(RoundPlanner, "choose", choose)
    trace = generate_trace(60, mean_interarrival_s=300.0, seed=4)
    cap = ClusterCapacity(gpus=16, cache=trace_cache(trace), remote_io=2 * GB, gpus_per_node=4)
    sim = CheckingSimulator(trace, cap, get_policy(policy), estimator_for(system), system, SimConfig())
    result = sim.run()
    assert not result.unfinished
    assert sim.checked > 20 and len(planner_pairs) > 20


def trace_cache(trace: Trace) -> float:
    return 0.3 * sum(trace.dataset_sizes.values())


def test_clearly_valid_refuses_what_the_full_check_refuses():
    trace = generate_trace(12, mean_interarrival_s=10.0, seed=1)
    cap = ClusterCapacity(gpus=8, cache=1e12, remote_io=1e9, gpus_per_node=4)
    sim = CheckingSimulator(trace, cap, get_policy("gavel"), estimator_for("silod"), "silod", SimConfig())
    sim.run()
    snap, bare = sim._last_snapshots
    from policies.types import Allocation

    ids = [j.job_id for j in snap.jobs]
    for bad in (
        Allocation(gpu_share={i: 1.0 for i in ids} | {ids[0]: 1.5}),
        Allocation(gpu_share={i: 1.0 for i in ids}, remote_io={i: 1e12 for i in ids}),
        Allocation(gpu_share={i: 0.0 for i in ids}, cache={snap.jobs[0].dataset: 1e15}),
        Allocation(gpu_share={i: 0.0 for i in ids[1:]}),  # a job missing
    ):
        if allocation_violations(bare, bad):
            assert not _clearly_valid(snap, bad)


class CountingSimulator(Simulator):
    def run(self):
        self.decisions: list[float] = []
        decide = self.core.decide

        def counted(snapshot):
            self.decisions.append(snapshot.time)
            return decide(snapshot)

        self.core.decide = counted
        return super().run()


def test_decision_interval_is_off_by_default_and_spaces_decisions_when_on():
    trace = generate_trace(80, mean_interarrival_s=200.0, seed=2)
    cap = ClusterCapacity(gpus=24, cache=trace_cache(trace), remote_io=2 * GB, gpus_per_node=4)

    def sim(**cfg):
        s = CountingSimulator(trace, cap, get_policy("fifo"), estimator_for("silod"), "silod", SimConfig(**cfg))
        return s, s.run()

    s0, r0 = sim()
    s_zero, r_zero = sim(decision_interval_s=0.0)
    assert [j.jct_s for j in r0.jobs] == [j.jct_s for j in r_zero.jobs]
    gaps0 = np.diff(s0.decisions)
    assert (gaps0 < 600).sum() > 10  # events closer than the interval below do happen
    s1, r1 = sim(decision_interval_s=1920.0)
    assert not r1.unfinished and len(r1.jobs) == len(r0.jobs)
    assert len(s1.decisions) < len(s0.decisions)
    # While jobs run, consecutive decisions are at least the interval apart; a closer one only
    # follows a moment with nothing running (due at once).
    busy_gaps = [b - a for a, b in zip(s1.decisions, s1.decisions[1:]) if b - a < 1920.0 - 1e-6]
    assert len(busy_gaps) < len(s1.decisions) / 4


def test_decision_interval_must_not_be_negative():
    from estimator.errors import UserError

    with pytest.raises(UserError, match="decision interval"):
        SimConfig(decision_interval_s=-1.0)


class TableCheckingSimulator(Simulator):
    """Checks at every step that the job table's columns (scheduler/sim/job_table.py) are what
    the running jobs hold now: the engine writes rows only when it thinks they changed."""

    steps_checked = 0
    cores_changed = 0

    def _step_state(self, running, prev=None):
        st = super()._step_state(running, prev)
        if prev is None and running:
            expect = np.array([(j.dataset.n_chunks, j.dataset.chunk_size, j.total_bytes, j.ideal, j.gpu_ideal,
                                np.inf if j.trace.pipeline is None else j.cores * j.trace.pipeline.cpu_rate,
                                j.pacing is not None, self.cache.volatile_for(j)) for j in running], dtype=float).T
            got = np.array([st.k, st.chunk, st.total, st.ideal, st.gpu_ideal, st.cpu_bound, st.curriculum, st.scalar], dtype=float)
            expect[7] = np.logical_or(expect[6], expect[7])  # scalar: curriculum or a volatile cache
            assert np.array_equal(got, expect), "the job table's rows are stale"
            assert st.ids == [j.job_id for j in running]
            assert [int(s) for s in st.slots] == [j.slot for j in running]
            assert st.crows.tolist() == [j.crow for j in running]  # kept with the static columns
            assert st.gpus.tolist() == [j.gpus for j in running]
            assert st.irregular.tolist() == [not j.regular for j in running]
            assert st.fstar.tolist() == [j.fstar is not None for j in running]
            # Each job reads and writes its position in its own table row (after the table grew too).
            assert all(j.state is self._table.state and j.row == j.slot for j in running)
            self.steps_checked += 1
        return st


@pytest.mark.parametrize("policy,system", [("gavel", "silod"), ("fifo", "coordl"), ("sjf", "alluxio")])
def test_the_job_table_follows_cores_time_sharing_and_reused_slots(policy, system, monkeypatch):
    """CPU modelled (cores change from plan to plan), Gavel's time sharing (the running set
    changes every round) and jobs finishing and arriving (slots freed and reused)."""
    from estimator.pipeline import InputPipeline
    from scheduler.sim.job_table import JobTable

    base = generate_trace(40, mean_interarrival_s=900.0, seed=5)
    jobs = tuple(replace(j, pipeline=InputPipeline(cpu_rate=j.ideal_throughput / (1 + i % 4))) if i % 3 else j
                 for i, j in enumerate(base.jobs))
    trace = Trace(jobs, base.dataset_sizes)
    cap = ClusterCapacity(gpus=8, cache=trace_cache(trace), remote_io=1 * GB, gpus_per_node=4, cpus_per_node=3)
    sim = TableCheckingSimulator(trace, cap, get_policy(policy), estimator_for(system), system, SimConfig())
    seen_cores: dict[str, set] = {}
    original = JobTable.set_cores

    def counting(table, job, cores):
        seen_cores.setdefault(job.job_id, set()).add(cores)
        return original(table, job, cores)

    monkeypatch.setattr(JobTable, "set_cores", counting)
    result = sim.run()
    assert not result.unfinished
    assert sim.steps_checked > 50
    assert sum(len(c) > 1 for c in seen_cores.values()) >= 3, "cores never changed: the test would not see a stale row"
    assert sim._table._next < len(trace.jobs), "no slot was reused"


def test_the_job_table_follows_an_lru_dataset_that_autocaching_drops():
    """An irregular job alone caches its dataset preprocessed in the irregular partition's LRU;
    a regular reader without its autocache point arrives, so the dataset goes back to source
    caching (its LRU domain dropped) and, with the partition pinned to the irregular jobs, the
    regular partition gives it no cache: no new domain, so nothing else said the layout
    changed, and both readers' rows called their cache volatile."""
    from estimator.access import AccessPattern
    from estimator.pipeline import InputPipeline
    from scheduler.sim.cache_systems import LruDomain

    jobs = (TraceJob("a", 0.0, 1, "resnet50", "d", 200 * MB, 3.0, access=AccessPattern.irregular(),
                     pipeline=InputPipeline(20 * MB, 2.0, 100 * MB)),
            TraceJob("r", 50.0, 1, "resnet50", "d", 200 * MB, 3.0, pipeline=InputPipeline(20 * MB)))
    trace = Trace(jobs, {"d": 10 * GB})
    cap = ClusterCapacity(gpus=2, cache=100 * GB, remote_io=1 * GB, gpus_per_node=2, cpus_per_node=8, irregular_share=1.0)
    seen = []

    class Watching(TableCheckingSimulator):
        def _step_state(self, running, prev=None):
            if prev is None:
                dom = self.cache.domains.get("d")
                seen.append((len(running), type(dom), self.datasets["d"].expansion))
            return super()._step_state(running, prev)

    sim = Watching(trace, cap, get_policy("fifo"), estimator_for("silod"), "silod", SimConfig())
    result = sim.run()
    assert not result.unfinished
    # The path itself, so that a change of policy cannot make this test pass without it.
    lru_preprocessed = seen.index((1, LruDomain, 2.0))
    assert (2, type(None), 1.0) in seen[lru_preprocessed:], "the LRU domain was never dropped while both ran"


def test_a_jobs_position_moves_into_the_table_and_back_out_with_it():
    """A SimJob keeps its reading position in a row of its own until the job table takes it
    (job_table.py); the table grows past its first 64 rows without losing any job's row, and a
    job that leaves takes its position with it (the engine reads its counters after removal)."""
    from scheduler.sim.cache_systems import make_cache_system
    from scheduler.sim.job_table import JobTable
    from scheduler.sim.reader import SimJob
    from scheduler.sim.types import SimDataset

    ds = SimDataset("d", 10 * GB, 128, 0)
    cache = make_cache_system("silod", 0.0, 8)
    jobs = [SimJob(TraceJob(f"j{i}", 0.0, 1, "m", "d", 100 * MB, 1.0), ds, 100 * MB, 10 * GB, np.random.default_rng(i))
            for i in range(100)]
    for i, job in enumerate(jobs):
        assert job.tail_miss == 1.0 and job.consumed == 0.0  # a fresh job's position
        job.consumed, job.remote_bytes = float(i), 2.0 * i
    table = JobTable()
    for job in jobs:
        table.add(job, cache, 0)
    assert len(table.state) >= 100
    for i, job in enumerate(jobs):
        assert job.state is table.state and job.row == job.slot
        assert (job.consumed, job.remote_bytes, job.tail_miss) == (float(i), 2.0 * i, 1.0)
    table.state[jobs[70].slot, 0] += 5.0  # a step's column update is the job's
    assert jobs[70].consumed == 75.0
    gone = jobs[3]
    table.remove(gone)
    table.state[:] = -1.0  # what reuses the row does not touch the job that left
    assert gone.slot == -1 and gone.consumed == 3.0 and gone.remote_bytes == 6.0


@pytest.mark.parametrize("system", ["coordl", "silod", "alluxio", "quiver"])
def test_every_readers_count_is_its_cached_unread_chunks(system, monkeypatch):
    """A reader's count of cached unread chunks (SimJob.unread_cached, which its miss ratio and
    CoorDL's pause read) equals what its read mask and its cache say, at every pause and every
    step of a time-shared run."""
    from scheduler.sim import engine as engine_mod

    checked = [0]

    def check(sim):
        for job in sim._by_id.values():
            if job.pacing is None:
                mask = sim.cache.cached_mask(job)
                assert job.unread_cached == int(np.count_nonzero(mask & ~job.read_mask)), job.job_id
                checked[0] += 1

    trace = generate_trace(40, seed=3)
    sim = Simulator(trace, ClusterCapacity(8, 200 * GB, 2 * GB), get_policy("gavel"), estimator_for(system), system,
                    SimConfig(resolution=64, round_s=360.0))
    stopped = type(sim.cache).jobs_stopped

    def jobs_stopped(cache, jobs):
        stopped(cache, jobs)
        check(sim)

    monkeypatch.setattr(type(sim.cache), "jobs_stopped", jobs_stopped)
    real_step_state = engine_mod.Simulator._step_state

    def step_state(self, running, prev=None):
        if prev is None:
            check(self)
        return real_step_state(self, running, prev)

    monkeypatch.setattr(engine_mod.Simulator, "_step_state", step_state)
    result = sim.run()
    assert not result.unfinished and checked[0] > 200


class EventCheckingSimulator(Simulator):
    """Checks at every step that the compiled miss ratios and next event (column_kernel's
    miss_ratios and seconds_to_event) are what the numpy columns and each job's own
    SimJob.seconds_to_event say."""

    events_checked = 0
    contended_checked = 0

    def _miss_vector(self, running, st):
        m = super()._miss_vector(running, st)
        left = st.k - st.looked
        with np.errstate(divide="ignore", invalid="ignore"):
            plain = np.minimum(np.maximum(1.0 - st.unread / left, 0.0), 1.0)
        ask = (left <= 0) | st.curriculum
        assert np.array_equal(m[~ask], plain[~ask])
        return m

    def _seconds_to_event(self, running, st, caps, m, contended, ideal_m):
        got = super()._seconds_to_event(running, st, caps, m, contended, ideal_m)
        want = min((j.seconds_to_event(float(caps[i]), self.cache, contended, float(m[i])) for i, j in enumerate(running)),
                   default=np.inf)
        assert got == want or (np.isnan(got) and np.isnan(want)), (got, want)
        self.events_checked += 1
        self.contended_checked += contended
        return got


@pytest.mark.parametrize("policy,system", [("gavel", "alluxio"), ("fifo", "silod"), ("sjf", "coordl")])
def test_the_compiled_step_columns_answer_as_each_job_does(policy, system):
    """Contended links (a tight remote IO and cache), curriculum readers (their growth is an
    event) and epoch readers: at every step the compiled next event equals the minimum of the
    jobs' own, and the compiled miss ratios the numpy columns'."""
    from estimator.access import AccessPattern

    base = generate_trace(30, mean_interarrival_s=600.0, seed=9)
    jobs = tuple(replace(j, access=AccessPattern.curriculum_learning(0.1, 2.0, 2_000, 64)) if i % 4 == 1 else j
                 for i, j in enumerate(base.jobs))
    trace = Trace(jobs, base.dataset_sizes, item_sizes={n: 1e6 for n in base.dataset_sizes})
    # A link and cache this tight make the epoch boundary the earliest event often enough that a
    # wrong demand-change test in the kernel is caught (under Gavel/Alluxio).
    cap = ClusterCapacity(gpus=8, cache=0.3 * trace_cache(trace), remote_io=0.1 * GB, gpus_per_node=4)
    sim = EventCheckingSimulator(trace, cap, get_policy(policy), estimator_for(system), system, SimConfig())
    result = sim.run()
    assert not result.unfinished
    assert sim.events_checked > 50 and sim.contended_checked > 20


class ReferenceCountingSimulator(Simulator):
    """After every decision, the Eq. 8 references the engine holds for the active jobs equal
    ones computed afresh from the snapshot; counts the decisions."""

    decisions = 0

    def _references(self, snapshot, slots):
        super()._references(snapshot, slots)
        if slots.size:
            fresh = _equal_share_throughput(GavelProblem.from_snapshot(snapshot, manages_storage=True))
            np.testing.assert_array_equal(self._table.reference[slots], fresh)
            self.decisions += 1


@pytest.mark.parametrize("policy", ["fifo", "sjf"])
def test_the_references_are_rebuilt_only_when_the_jobs_or_their_fstar_change(policy, monkeypatch):
    # FIFO and SJF decide at nearly every step; Eq. 8's references depend only on the active
    # jobs, their GPUs and f*, so between arrivals and completions the engine keeps them. Half
    # the jobs declare an f* the engine corrects as they run (their references move with it).
    built = []

    def counted(problem):
        built.append(problem.n)
        return equal_share_throughput(problem)

    monkeypatch.setattr(engine_module, "equal_share_throughput", counted)
    trace = generate_trace(40, mean_interarrival_s=300.0, seed=5)
    jobs = [replace(j, declared_throughput=j.ideal_throughput * 0.5) if k % 2 else j for k, j in enumerate(trace.jobs)]
    trace = replace(trace, jobs=jobs)
    cap = ClusterCapacity(gpus=16, cache=trace_cache(trace), remote_io=2 * GB, gpus_per_node=4)
    sim = ReferenceCountingSimulator(trace, cap, get_policy(policy), estimator_for("silod"), "silod", SimConfig())
    assert not sim.run().unfinished
    assert sim.decisions > 40
    assert 0 < len(built) < sim.decisions
