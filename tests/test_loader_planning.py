"""The policies plan with the data loader's miss term (policies/loader.py, issue 49): a job whose
loader makes misses expensive (m = W s / L) gets the cache first, is given the link its loader can
use (X(h) (1 - h), X(h) = 1 / (1/f* + (1-h)/m)), and is ranked and time-shared at X(h); in the
service (RoundJobs' views) and in the simulator (one scheduling core), where a trace job may carry
its loader in three CSV columns. Jobs without a loader term are planned exactly as before (the
simulator's tests and the Fig. 12 cell in docs/results.md check that bit for bit)."""

from __future__ import annotations

import math

import pytest

from estimator import loader_perf
from estimator.errors import UserError
from policies import ClusterCapacity, DatasetView, JobView, SiloDEstimator, Snapshot, get_policy
from policies.types import JobColumns
from scheduler.sim.engine import SimConfig, Simulator
from traces.csv_trace import load_csv_trace, write_csv_trace
from traces.model import Trace, TraceJob

MB, GB = 1e6, 1e9
F, M = 100 * MB, 100 * MB  # both jobs' f*; the loader job's miss rate (X(0) = f*/2)


def _snapshot(m_b: float, *, cache: float = 50 * GB, io: float = 10 * GB, gpus: int = 2, columns: bool = False,
              work_b: float = 200 * GB) -> Snapshot:
    """Jobs a (dataset da) and b (db, loader miss rate m_b), the same f* and dataset size; the
    cache holds one dataset. Dataset names sort a first: the paper's tie goes to da."""
    jobs = (JobView("a", 1, "da", F, 200 * GB, 0.0, running=True),
            JobView("b", 1, "db", F, work_b, 1.0, running=True, loader_miss_rate=m_b))
    ds = {n: DatasetView(n, 50 * GB) for n in ("da", "db")}
    cap = ClusterCapacity(gpus=gpus, cache=cache, remote_io=io, gpus_per_node=8)
    return Snapshot(0.0, jobs, ds, cap, JobColumns.of(jobs) if columns else None)


@pytest.mark.parametrize("policy", ["fifo", "greedy", "sjf"])
@pytest.mark.parametrize("columns", [False, True])
def test_the_cache_goes_to_the_job_whose_loader_makes_misses_expensive(policy, columns):
    alloc = get_policy(policy).allocate(_snapshot(M, columns=columns), SiloDEstimator())
    assert alloc.cache.get("db", 0.0) == pytest.approx(50 * GB) and alloc.cache.get("da", 0.0) == 0.0
    # Without the term the two jobs are the same to Algorithm 2: the tie goes to da, as before.
    plain = get_policy(policy).allocate(_snapshot(math.inf, columns=columns), SiloDEstimator())
    assert plain.cache.get("da", 0.0) == pytest.approx(50 * GB) and plain.cache.get("db", 0.0) == 0.0


@pytest.mark.parametrize("policy", ["fifo", "sjf", "gavel"])
@pytest.mark.parametrize("columns", [False, True])
def test_a_loader_job_is_given_the_link_its_loader_can_use(policy, columns):
    """No cache: job b's loader lets it read X(0) = f*/2, so the link it is given is that, not f*."""
    alloc = get_policy(policy).allocate(_snapshot(M, cache=0.0, columns=columns), SiloDEstimator())
    assert alloc.remote_io["b"] == pytest.approx(float(loader_perf(F, 0.0, M)), rel=1e-9)
    assert alloc.remote_io["a"] == pytest.approx(F, rel=1e-9)


def test_sjf_ranks_a_loader_job_by_the_time_its_loader_takes():
    """One GPU, no cache: b has less work than a (150 GB vs 200 GB) but at X(0) = f*/2 it takes
    3,000 s against a's 2,000 s; SJF runs a."""
    for columns in (False, True):
        snap = _snapshot(M, cache=0.0, gpus=1, work_b=150 * GB, columns=columns)
        assert get_policy("sjf").allocate(snap, SiloDEstimator()).gpu_share == {"a": 1.0, "b": 0.0}
        plain = _snapshot(math.inf, cache=0.0, gpus=1, work_b=150 * GB, columns=columns)
        assert get_policy("sjf").allocate(plain, SiloDEstimator()).gpu_share == {"a": 0.0, "b": 1.0}


def _sim(loader: float | None, policy: str = "fifo"):
    jobs = (TraceJob("a", 0.0, 1, "m", "da", F, 4.0), TraceJob("b", 0.0, 1, "m", "db", F, 4.0, loader_miss_rate=loader))
    trace = Trace(jobs, {"da": 50 * GB, "db": 50 * GB})
    cap = ClusterCapacity(gpus=2, cache=50 * GB, remote_io=10 * GB, gpus_per_node=2)
    return {j.job_id: j.jct_s for j in Simulator(trace, cap, get_policy(policy), SiloDEstimator(), "silod", SimConfig()).run().jobs}


@pytest.mark.parametrize("policy", ["fifo", "sjf"])
def test_the_simulator_plans_with_the_loader_term(policy):
    """The cache to b, whose misses cost its loader: its first epoch at X(0) = 50 MB/s fills it,
    the next three run at f*; a, which the link keeps at f*, loses nothing. Planned with f* alone
    (before), the cache went to da and b ran all four epochs at 50 MB/s (4,000 s)."""
    jct = _sim(M, policy)
    assert jct["b"] == pytest.approx(50 * GB / (50 * MB) + 3 * 50 * GB / F, rel=1e-2)
    assert jct["a"] == pytest.approx(4 * 50 * GB / F, rel=1e-3)


def test_a_trace_job_carries_its_loader_in_three_columns(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("job_id,submit_time,num_gpus,model,dataset,dataset_size,ideal_throughput,epochs,"
                    "loader_workers,loader_item_bytes,loader_miss_s\n"
                    "a,0,1,m,da,50GB,100MB/s,4,,,\n"
                    "b,0,1,m,db,50GB,100MB/s,4,4,110KB,0.0044\n")
    trace = load_csv_trace(path)
    a, b = trace.jobs
    assert a.loader_miss_rate is None
    assert b.loader_miss_rate == pytest.approx(4 * 110e3 / 0.0044)  # m = W s / L = 100 MB/s
    out = tmp_path / "out.csv"
    write_csv_trace(trace, out)  # the same m back
    assert [j.loader_miss_rate for j in load_csv_trace(out).jobs] == [j.loader_miss_rate for j in trace.jobs]


@pytest.mark.parametrize("cells,column", [
    ("4,110KB,", "loader_miss_s"),
    (",110KB,0.004", "loader_workers"),
    ("0,110KB,0.004", "loader_workers"),
    ("2000,110KB,0.004", "loader_workers"),
    ("2.5,110KB,0.004", "loader_workers"),
    ("4,lots,0.004", "loader_item_bytes"),
    ("4,0,0.004", "loader_item_bytes"),
    ("4,2TiB,0.004", "loader_item_bytes"),
    ("4,110KB,0", "loader_miss_s"),
    ("4,110KB,-1", "loader_miss_s"),
    ("4,110KB,7200", "loader_miss_s"),
    ("4,110KB,nan", "loader_miss_s"),
])
def test_bad_loader_columns_name_the_column(tmp_path, cells, column):
    path = tmp_path / "t.csv"
    path.write_text("job_id,submit_time,num_gpus,model,dataset,dataset_size,ideal_throughput,epochs,"
                    f"loader_workers,loader_item_bytes,loader_miss_s\nb,0,1,m,db,50GB,100MB/s,4,{cells}\n")
    with pytest.raises(UserError, match=f"line 2, column '{column}'"):
        load_csv_trace(path)


def test_the_service_plans_a_declared_loader_with_its_measured_service_time(tmp_path):
    """RoundJobs' view of a job that declared its loader and whose mount measured L carries m =
    W s / L (the diagnosis's figure), so the service's policy plans with it; without a measured
    L, or without a declaration, the view has none."""
    from sqlalchemy import update

    from scheduler.service.db.models import JobMeasurementRow
    from scheduler.service.round_jobs import RoundJobs
    from tests.test_api import H_ALICE, make_app
    from fastapi.testclient import TestClient

    app, service = make_app(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path, run_loop=False)
    try:
        with TestClient(app) as c:
            assert c.post("/v1/datasets", json={"name": "d", "uri": "s3://b/d", "size": "1TB"}, headers=H_ALICE).status_code == 201
            body = {"name": "j", "gpus": 1, "dataset": "d", "epochs": 2, "ideal_throughput": "100MB/s"}
            declared = c.post("/v1/jobs", json={**body, "loader": {"workers": 4, "item_bytes": "110KB"}}, headers=H_ALICE).json()["id"]
            plain = c.post("/v1/jobs", json={**body, "name": "p"}, headers=H_ALICE).json()["id"]
            engine = service.engine
            with engine.begin() as conn:
                views = {j.view.job_id: j.view for j in RoundJobs().read(conn, 0.0)[0]}
            assert views[str(declared)].loader_miss_rate == math.inf  # no L measured yet
            with engine.begin() as conn:
                for jid in (declared, plain):
                    if conn.execute(JobMeasurementRow.__table__.select().where(JobMeasurementRow.job_id == jid)).first() is None:
                        conn.execute(JobMeasurementRow.__table__.insert().values(job_id=jid))
                    conn.execute(update(JobMeasurementRow).where(JobMeasurementRow.job_id == jid)
                                 .values(miss_service_s=0.0044, miss_item_bytes=90e3, miss_service_n=100.0))
                views = {j.view.job_id: j.view for j in RoundJobs().read(conn, 0.0)[0]}
            assert views[str(declared)].loader_miss_rate == pytest.approx(4 * 110e3 / 0.0044)  # s as declared
            assert views[str(plain)].loader_miss_rate == math.inf
    finally:
        service.close()


def test_gavel_caches_by_its_io_knapsack_not_the_loader_weight():
    """Gavel keeps Eq. 9's order e_k = (sum of readers' ref) / d_k with a loader job (docs/policies.md,
    "The loader term in the policies"): its GPU bound takes a loader job's rate at the cache filled
    now, X(h now), and so does its equal share ref, so the cache granted this round enters only the
    IO bound, for which e_k is exact. Here Algorithm 2's weight f* (1 + f*/m) / d puts db (the
    loader job's, 60 GB) first (2 F / 60 GB > F / 50 GB); Gavel caches da, and the LP over the same
    problem (gavel_reference, cvxpy) finds the same ratio and cache: 7/6, where caching db would
    need t (ref_a + ref_b / 6) <= 20 MB/s of IO, t = 0.875."""
    import numpy as np

    from policies.gavel import GavelProblem, solve_max_min
    from policies.gavel_reference import solve_max_min_reference
    from policies.loader import cache_weight

    jobs = (JobView("a", 1, "da", F, 200 * GB, 0.0, running=True),
            JobView("b", 1, "db", F, 200 * GB, 1.0, running=True, loader_miss_rate=M))
    ds = {"da": DatasetView("da", 50 * GB), "db": DatasetView("db", 60 * GB)}
    snap = Snapshot(0.0, jobs, ds, ClusterCapacity(gpus=2, cache=50 * GB, remote_io=20 * MB, gpus_per_node=8))
    w = cache_weight(np.array([F, F]), np.array([math.inf, M])) / np.array([50 * GB, 60 * GB])
    assert w[1] > w[0]  # the loader weight's order: db first
    p = GavelProblem.from_snapshot(snap, True)
    got, lp = solve_max_min(p), solve_max_min_reference(p)
    assert list(got.cache) == pytest.approx([50 * GB, 0.0]) and list(lp.cache) == pytest.approx([50 * GB, 0.0], abs=1e3)
    assert got.ratio == pytest.approx(7 / 6) and lp.ratio == pytest.approx(got.ratio, rel=1e-6)
    ref_a, ref_b = got.reference
    assert 20 * MB / (ref_a + ref_b / 6) == pytest.approx(0.875)  # the ratio with db cached instead
    assert get_policy("gavel").allocate(snap, SiloDEstimator()).cache == pytest.approx({"da": 50 * GB, "db": 0.0})
