"""Measured, self-correcting f* and per-core rate in the service (issue 22, Build 3).

Hand cases of the estimator (estimator.measured.observe_job), then the service end to end: a
real SQLite database, real rounds, the REST API; the data plane's figures for each interval are
those of a job whose real f* is half what it declared, reading with the allocation the round gave it
(X = min(real f*, b / (1 - h))), fed in as the data manager's or a backend's measurements are."""

from __future__ import annotations

import math

import pytest
from fastapi.testclient import TestClient

from estimator.measured import JobMeasurement, observe_job

try:
    from test_api import H_ADMIN, H_ALICE, H_BOB, make_app
except ImportError:  # tests/ imported as a package
    from tests.test_api import H_ADMIN, H_ALICE, H_BOB, make_app

MB = 1e6

from scheduler.service.types import Principal

ADMIN_P = Principal("admin", is_admin=True)


# --- the estimator, by hand ---------------------------------------------------------------------


def test_gpu_bound_job_declared_2x_converges_to_its_rate():
    m = JobMeasurement.start(100 * MB)
    for _ in range(5):  # IO allows 100 MB/s, it reads 50: only its GPUs held it
        m = observe_job(m, 50 * MB, 2.0, io_bound=100 * MB)
    assert m.fstar.estimate == pytest.approx(50 * MB)
    assert m.bound == "gpu"


def test_io_bound_interval_only_raises():
    m = JobMeasurement.start(100 * MB)
    m = observe_job(m, 40 * MB, 2.0, io_bound=40 * MB)  # at the IO bound: f* >= 40, nothing more
    assert (m.fstar.estimate, m.bound) == (100 * MB, "remote_io")
    m = observe_job(m, 150 * MB, 2.0, io_bound=150 * MB)  # faster than declared: f* >= 150
    assert m.fstar.estimate == pytest.approx(150 * MB)


def test_cpu_bound_interval_raises_the_per_core_rate():
    m = JobMeasurement.start(100 * MB, 20 * MB)
    m = observe_job(m, 60 * MB, 2.0, cores=2)  # 2 cores x 20 = 40 allowed, it read 60: rate >= 30
    assert (m.bound, m.cpu.estimate) == ("cpu", pytest.approx(30 * MB))


def test_client_report_tells_a_slow_pipeline_from_a_slow_gpu():
    # Declared 35 MB/s per core, really 20: on 2 cores it reads 40 while its GPUs could do 100.
    m = JobMeasurement.start(100 * MB, 35 * MB)
    for _ in range(3):
        m = observe_job(m, 40 * MB, 2.0, cores=2, client_fstar=None)
    assert m.bound == "unknown" and m.cpu.estimate == 35 * MB  # without the client: no guess
    m = JobMeasurement(m.fstar, m.cpu, max_observed=100 * MB)  # it once read at 100 (e.g. from cache, more cores)
    for _ in range(3):
        m = observe_job(m, 40 * MB, 2.0, cores=2, client_fstar=100 * MB)
    assert m.bound == "cpu" and m.cpu.estimate == pytest.approx(20 * MB)
    assert m.fstar.estimate == 100 * MB


def test_a_client_lying_upward_gains_nothing():
    """A GPU-bound job (real f* 50) claims 10x: f* is what the data plane saw, and the per-core
    rate does not fall as it is given more cores."""
    honest = liar = JobMeasurement.start(100 * MB, 35 * MB)
    for cores in (2, 3, 4, 6):  # whatever it is given, its GPUs read 50 MB/s
        honest = observe_job(honest, 50 * MB, 2.0, cores=cores, client_fstar=50 * MB)
        liar = observe_job(liar, 50 * MB, 2.0, cores=cores, client_fstar=500 * MB)
    assert liar.used_fstar(500 * MB) <= honest.used_fstar(50 * MB) * 1.0001
    assert liar.used_fstar(500 * MB) == pytest.approx(50 * MB)
    # Its rate per core may be learnt lower than declared, but never below 50 / 2 (what it read
    # per core when it held 2): cores needed for 50 MB/s stay at 2 however many it was given.
    assert liar.cpu.estimate >= 25 * MB * 0.999
    assert 50 * MB / liar.cpu.estimate <= 2.0001


def test_used_fstar_is_only_lowered_by_the_client():
    m = JobMeasurement.start(100 * MB)
    assert m.used_fstar(400 * MB) == 100 * MB
    assert m.used_fstar(60 * MB) == 60 * MB
    # No floor at declared / 4 (issue 47): a client's own word may make its job look as slow as
    # it likes; that only costs the job (it is ranked longer and given less).
    assert m.used_fstar(1.0) == 1.0
    assert m.used_fstar(math.nan) == 100 * MB


# --- the service end to end ------------------------------------------------------------------------

BIG = {"name": "huge", "uri": "s3://datasets/huge", "size": "100TB"}  # 200 GB of cache: h = 0.002
JOB = {"name": "r50", "gpus": 1, "dataset": "huge", "epochs": 1, "ideal_throughput": "100MB/s"}
REAL_FSTAR = 50 * MB


def _drive(service, job_id: str, t: float, steps: int, real: float = REAL_FSTAR) -> float:
    """Rounds and 2 s intervals of a job whose GPUs read `real` bytes/s at most: each interval the
    data plane measures min(real, b / (1 - h)) for the cap b the round gave it."""
    size, cache = 100e12, 200e9
    h = cache / size
    for _ in range(steps):
        service.run_round("test")
        alloc = next(j for j in service.allocations(ADMIN_P).jobs if j.job_id == job_id)
        x = min(real, alloc.remote_io / (1 - h))
        service.self_correct({job_id: {"throughput": x, "hit_ratio": h}}, t)
        t += 2.0
    service.run_round("test")
    return t


def _cap(service, job_id: str) -> float:
    return next(j for j in service.allocations(ADMIN_P).jobs if j.job_id == job_id).remote_io


try:
    from pg_fixture import _pg_session, db_url, pg_url  # noqa: F401 - fixtures: SQLite and a real PostgreSQL
except ImportError:  # tests/ imported as a package
    from tests.pg_fixture import _pg_session, db_url, pg_url  # noqa: F401


@pytest.fixture
def svc(tmp_path, db_url):
    app, service = make_app(db_url, tmp_path, run_loop=False)
    with TestClient(app) as c:
        assert c.post("/v1/datasets", json=BIG, headers=H_ALICE).status_code == 201
        yield c, service
    service.close()


def test_declared_2x_wrong_converges_in_the_service_and_planning_follows(svc):
    c, service = svc
    job = c.post("/v1/jobs", json=JOB, headers=H_ALICE).json()
    service.run_round("test")
    assert _cap(service, job["id"]) == pytest.approx(100 * MB * (1 - 0.002))  # planned on the declared f*
    assert c.get(f"/v1/jobs/{job['id']}", headers=H_ALICE).json()["measured_parameters"] is None
    _drive(service, job["id"], 1000.0, 8)
    body = c.get(f"/v1/jobs/{job['id']}", headers=H_ALICE).json()
    mp = body["measured_parameters"]
    assert mp["declared_ideal_throughput"] == 100 * MB
    assert mp["ideal_throughput"] == pytest.approx(REAL_FSTAR, rel=0.02)
    assert mp["observed_throughput"] == pytest.approx(REAL_FSTAR, rel=0.02)
    assert body["ideal_throughput"] == 100 * MB  # the declaration itself is kept
    # Planning uses the measured f*: the remote-IO cap halves (b = f* (1 - h)).
    assert _cap(service, job["id"]) == pytest.approx(REAL_FSTAR * (1 - 0.002), rel=0.02)
    assert service.build_snapshot().jobs[0].ideal_throughput == pytest.approx(REAL_FSTAR, rel=0.02)
    # The list (what `silod jobs` prints) carries it too, with the bottleneck.
    listed = c.get("/v1/jobs", headers=H_ALICE).json()[0]
    assert listed["measured_parameters"]["ideal_throughput"] == pytest.approx(REAL_FSTAR, rel=0.02)
    assert listed["bottleneck"]["bound"] in ("gpu", "remote_io")


def test_a_client_that_lies_upward_gains_nothing_in_the_service(svc):
    c, service = svc
    honest = c.post("/v1/jobs", json=JOB, headers=H_ALICE).json()
    liar = c.post("/v1/jobs", json={**JOB, "name": "liar"}, headers=H_ALICE).json()
    service.run_round("test")
    t = 1000.0
    for _ in range(8):
        for j, claim in ((honest, REAL_FSTAR), (liar, 10 * 100 * MB)):
            # 1 MB per step; the liar says its GPUs take a tenth of what the declared f* would.
            r = c.post(f"/v1/jobs/{j['id']}/report", json={"step_seconds": 1 * MB / claim, "batch_bytes": 1 * MB},
                       headers=H_ALICE)
            assert r.status_code == 202, r.text
        service.run_round("test")
        allocs = {a.job_id: a for a in service.allocations(ADMIN_P).jobs}
        h = 200e9 / 100e12
        service.self_correct({j["id"]: {"throughput": min(REAL_FSTAR, allocs[j["id"]].remote_io / (1 - h)), "hit_ratio": h}
                              for j in (honest, liar)}, t)
        t += 2.0
    service.run_round("test")
    got = {j["id"]: c.get(f"/v1/jobs/{j['id']}", headers=H_ALICE).json()["measured_parameters"] for j in (honest, liar)}
    assert got[liar["id"]]["client_ideal_throughput"] == pytest.approx(1000 * MB)
    assert got[liar["id"]]["ideal_throughput"] <= got[honest["id"]]["ideal_throughput"] * 1.0001
    assert _cap(service, liar["id"]) <= _cap(service, honest["id"]) * 1.0001
    assert got[honest["id"]]["ideal_throughput"] == pytest.approx(REAL_FSTAR, rel=0.02)


def test_report_endpoint_trust_and_bounds(svc):
    c, service = svc
    job = c.post("/v1/jobs", json=JOB, headers=H_ALICE).json()
    url = f"/v1/jobs/{job['id']}/report"
    ok = {"step_seconds": 0.1, "batch_bytes": 5 * MB}
    assert c.post(url, json=ok, headers=H_ALICE).status_code == 409  # queued: nothing to report yet
    service.run_round("test")
    assert c.post(url, json=ok, headers=H_BOB).status_code == 404  # another tenant's job does not exist for bob
    assert c.post("/v1/jobs/999/report", json=ok, headers=H_ALICE).status_code == 404
    for bad in ({"step_seconds": 0, "batch_bytes": 1}, {"step_seconds": 1e9, "batch_bytes": 1},
                {"step_seconds": 0.1, "batch_bytes": -5}, {"step_seconds": 0.1, "batch_bytes": 1e300},
                {"step_seconds": 0.1}, {"step_seconds": 0.1, "batch_bytes": 1, "extra": 1},
                # each in range, their ratio not: 2^50 B per 0.1 ms would be stored as 1.1e19 B/s
                {"step_seconds": 1e-4, "batch_bytes": 2.0**50}, {"step_seconds": 86_400, "batch_bytes": 1e-300},
                {"step_seconds": True, "batch_bytes": 1}, {"step_seconds": "0.5", "batch_bytes": 1}):
        r = c.post(url, json=bad, headers=H_ALICE)
        assert r.status_code == 422, (bad, r.text)
    r = c.post(url, content=b'{"step_seconds": NaN, "batch_bytes": 1}', headers={**H_ALICE, "Content-Type": "application/json"})
    assert r.status_code == 422 and "finite" in r.text, r.text  # not "should be <= 86400"
    r = c.post(url, json=ok, headers=H_ALICE)
    assert r.status_code == 202 and r.json()["client_ideal_throughput"] == pytest.approx(50 * MB)
    # The client may lower what planning uses (50 < 100 declared), before any measurement.
    assert r.json()["ideal_throughput"] == pytest.approx(50 * MB)
    assert c.post(url, json=ok, headers=H_ADMIN).status_code == 202


def test_on_kubernetes_the_node_agents_counters_give_the_rate(svc):
    """A job with no figure from the data manager or the backend: the rate of its pods' read
    counters, as the node agents report them (trusted consumption), is its observed rate."""
    from scheduler.service.consumption import AdmittedPod, ConsumptionStore, PodReport

    c, service = svc
    job = c.post("/v1/jobs", json=JOB, headers=H_ALICE).json()
    service.run_round("test")
    store = ConsumptionStore(service.sessions)
    uid = "0b7f8c1e-1111-2222-3333-444455556666"
    store.record_pods([AdmittedPod(uid, job["id"], "node-a", "t-alice", "r50-0")])
    read = 0
    for i in range(8):
        store.record_report("node-a", "agent-a", [PodReport(uid, read, 0, read, 0, 1)])
        service.self_correct({}, 1000.0 + 2 * i)
        read += int(REAL_FSTAR * 2)  # 50 MB/s while it holds a 100 MB/s cap: GPU-bound
    mp = c.get(f"/v1/jobs/{job['id']}", headers=H_ALICE).json()["measured_parameters"]
    assert mp["observed_throughput"] == pytest.approx(REAL_FSTAR)
    assert mp["ideal_throughput"] == pytest.approx(REAL_FSTAR)


# --- which intervals are evidence (issue 49: a real PyTorch job; issue 48: an IO-held interval) ------

SMALL = {"name": "small", "uri": "s3://datasets/small", "size": "1GB"}  # fits the 200 GB cache


class _Mount:
    """A job's mount as the data manager reports it: cumulative read and miss bytes, the smoothed
    read rate and the whole-run hit ratio (what the service had before issue 49), fed interval by
    interval to `service.self_correct`."""

    def __init__(self, service, job_id: str, t: float):
        self.service, self.job_id, self.t = service, job_id, t
        self.read = self.miss = 0.0

    def interval(self, rate: float, miss_share: float = 0.0, seconds: float = 2.0) -> None:
        self.read += rate * seconds
        self.miss += rate * miss_share * seconds
        self.t += seconds
        hit = 1.0 - self.miss / self.read if self.read else None
        self.service.self_correct({self.job_id: {"throughput": rate, "hit_ratio": hit, "read_bytes": self.read,
                                                 "miss_bytes": self.miss, "age_s": 0.0}}, self.t)

    def fstar(self, c) -> float:
        return c.get(f"/v1/jobs/{self.job_id}", headers=H_ALICE).json()["measured_parameters"]["ideal_throughput"]


def test_a_cached_job_with_no_remote_io_converges_from_its_intervals_not_its_whole_run(svc):
    """The real PyTorch job's finding: its dataset fits the cache, so the round gives it no remote
    IO (b = f* (1 - c/d) = 0). Its first epoch missed everything, so the whole-run hit ratio stays
    below 1 for the rest of the run, and b / (1 - h) = 0 called every later interval IO-bound:
    f* was only ever raised and planning stayed at the declaration. Each interval's own hit ratio
    (all hits once the cache is full) says the GPUs held it: a sample of f*."""
    c, service = svc
    assert c.post("/v1/datasets", json=SMALL, headers=H_ALICE).status_code == 201
    for declared, real in ((100 * MB, 50 * MB), (100 * MB, 200 * MB)):  # 2x too high, 2x too low
        job = c.post("/v1/jobs", json={**JOB, "dataset": "small", "epochs": 1000, "ideal_throughput": declared},
                     headers=H_ALICE).json()
        service.run_round("test")
        assert _cap(service, job["id"]) == 0.0  # cached in full: planned to need no remote IO
        mount = _Mount(service, job["id"], 1000.0)
        mount.interval(0.0)  # first sight
        for _ in range(4):  # the first epoch: every read a miss, at the rate the spare link lent
            mount.interval(20 * MB, miss_share=1.0)
        for _ in range(5):  # cached: at the GPUs' speed
            mount.interval(real)
            service.run_round("test")
        assert mount.fstar(c) == pytest.approx(real, rel=0.02), (declared, real)
        c.delete(f"/v1/jobs/{job['id']}", headers=H_ALICE)
        service.run_round("test")


def test_an_interval_held_by_remote_io_never_lowers_fstar(svc):
    """Issue 48: the link held the job (every read of the interval missed, at its cap) while the
    whole-run hit ratio said most reads hit; judged against b / (1 - whole-run h) the interval
    looked GPU-bound and its IO-limited rate became f*. An IO-held interval only says f* >= rate."""
    c, service = svc
    job = c.post("/v1/jobs", json={**JOB, "gpus": 8, "ideal_throughput": "4GB/s"}, headers=H_ALICE).json()
    service.run_round("test")
    cap = _cap(service, job["id"])
    assert 0 < cap <= 1000 * MB  # the link (1 GB/s) binds
    mount = _Mount(service, job["id"], 1000.0)
    mount.interval(0.0)
    for _ in range(5):  # earlier reads hit (say another job had cached them)...
        mount.interval(4000 * MB, miss_share=0.0)
    before = mount.fstar(c)
    for _ in range(4):  # ...then the cache was taken away: every read misses, at the cap
        mount.interval(cap, miss_share=1.0)
        assert mount.fstar(c) >= before * 0.999
    mp = c.get(f"/v1/jobs/{job['id']}", headers=H_ALICE).json()["measured_parameters"]
    assert mp["bound"] == "remote_io"


def test_warm_up_counts_from_the_first_read(svc):
    """A framework takes seconds to start before its first read (torch's import, the DataLoader's
    worker processes): a warm-up counted from the first sight of the job was over by then, and the
    pipeline's slow first seconds of reading became samples of f*."""
    c, service = svc
    job = c.post("/v1/jobs", json=JOB, headers=H_ALICE).json()
    service.run_round("test")
    mount = _Mount(service, job["id"], 1000.0)
    mount.interval(0.0)
    for _ in range(4):  # 8 s of start-up: nothing read
        mount.interval(0.0)
    mount.interval(10 * MB)  # the loader's workers start, caches are cold
    mount.interval(30 * MB)
    for _ in range(4):
        mount.interval(REAL_FSTAR)
    assert mount.fstar(c) == pytest.approx(REAL_FSTAR, rel=0.02)


def test_a_client_word_below_what_the_job_just_read_is_contradicted():
    """A job consumes at least what it reads: a step-time report taken over a slow second (the
    real PyTorch job on a loaded machine: 1.1 MB/s reported while it read 3 MB/s) lowers the f*
    planning uses no further than the data plane's last interval."""
    m = JobMeasurement.start(100 * MB)
    assert m.used_fstar(10 * MB, observed=40 * MB) == 40 * MB
    assert m.used_fstar(60 * MB, observed=40 * MB) == 60 * MB
    assert m.used_fstar(10 * MB, observed=400 * MB) == 100 * MB  # never above the estimate
    from scheduler.service.measured_params import planned

    assert planned(100 * MB, None, 80 * MB, None, 0.1, 1 * MB, 1000.0, 1000.0, 40 * MB)[0] == 40 * MB
