"""A job's data loader (issue 49): declared at submission (`loader`: workers, item_bytes; the SDK's
`loader=`, `silod submit --loader-workers/--loader-item-bytes`), stored (migration 0013), and with
the mount's measured per-miss service time L it adds the loader's miss term m = W s / L to the
job's diagnosis (estimator.loader_perf) and keeps that term out of the measured f*. On a real
SQLite file and a real PostgreSQL server; the data plane's figures are fed to the service as the
data manager's status gives them (overview.measurements_from_datamanager)."""

from __future__ import annotations

import math

import pytest
from fastapi.testclient import TestClient

from estimator import loader_perf
from scheduler.service.types import Principal

ADMIN_P = Principal("admin", is_admin=True)

try:
    from test_api import H_ALICE, make_app
    from pg_fixture import _pg_session, db_url, pg_url  # noqa: F401 - fixtures: SQLite and a real PostgreSQL
except ImportError:  # tests/ imported as a package
    from tests.test_api import H_ALICE, make_app
    from tests.pg_fixture import _pg_session, db_url, pg_url  # noqa: F401

MB = 1e6
# 100 TB dataset, 200 GB of cache in the cluster (c/d = 0.002): the round caps the job's remote IO
# at about its demand, f* (1 - c/d), which a job reading at 1/2 hit ratio below f* does not reach.
DS = {"name": "jpegs", "uri": "s3://datasets/jpegs", "size": "100TB"}
JOB = {"name": "cnn", "gpus": 1, "dataset": "jpegs", "epochs": 100, "ideal_throughput": "100MB/s"}


@pytest.fixture
def svc(tmp_path, db_url):
    app, service = make_app(db_url, tmp_path, run_loop=False)
    with TestClient(app) as c:
        assert c.post("/v1/datasets", json=DS, headers=H_ALICE).status_code == 201
        yield c, service
    service.close()


def test_a_declared_loader_is_stored_and_shown(svc):
    c, _ = svc
    r = c.post("/v1/jobs", json={**JOB, "loader": {"workers": 4, "item_bytes": "110KB"}}, headers=H_ALICE)
    assert r.status_code == 201, r.text
    assert r.json()["loader"] == {"workers": 4, "item_bytes": 110e3}
    got = c.get(f"/v1/jobs/{r.json()['id']}", headers=H_ALICE).json()
    assert got["loader"] == {"workers": 4, "item_bytes": 110e3}
    listed = {j["id"]: j for j in c.get("/v1/jobs", headers=H_ALICE).json()}
    assert listed[got["id"]]["loader"] == {"workers": 4, "item_bytes": 110e3}
    # item_bytes is optional (the mount measures it); no loader: null, the paper's model
    r = c.post("/v1/jobs", json={**JOB, "name": "w", "loader": {"workers": 2}}, headers=H_ALICE)
    assert r.status_code == 201 and r.json()["loader"] == {"workers": 2, "item_bytes": None}
    r = c.post("/v1/jobs", json={**JOB, "name": "plain"}, headers=H_ALICE)
    assert r.status_code == 201 and r.json()["loader"] is None


@pytest.mark.parametrize("loader,fragment", [
    ({"workers": 0}, "workers"),
    ({"workers": -2}, "workers"),
    ({"workers": 1025}, "workers"),
    ({"workers": 2.5}, "workers"),
    ({"workers": "4"}, "workers"),
    ({"workers": True}, "workers"),
    ({"workers": None}, "workers"),
    ({"item_bytes": "9KB"}, "workers"),
    ({"workers": 2, "item_bytes": 0}, "item_bytes"),
    ({"workers": 2, "item_bytes": "-9KB"}, "item_bytes"),
    ({"workers": 2, "item_bytes": "big"}, "item_bytes"),
    ({"workers": 2, "item_bytes": "2TiB"}, "item_bytes"),
    ({"workers": 2, "item_bytes": "NaN"}, "item_bytes"),
    ({"workers": 2, "threads": 4}, "threads"),
    ("4", "loader"),
])
def test_bad_loader_fields_are_422_naming_the_field(svc, loader, fragment):
    c, _ = svc
    r = c.post("/v1/jobs", json={**JOB, "loader": loader}, headers=H_ALICE)
    assert r.status_code == 422, r.text
    assert fragment in r.text
    assert c.get("/v1/jobs", headers=H_ALICE).json() == []  # nothing recorded


class _Mount:
    """A job's mount as the data manager's status gives it: cumulative read and miss bytes, and the
    per-miss service counters (missed items delivered whole, their service seconds, their bytes)."""

    def __init__(self, service, job_id: str, t: float = 1000.0):
        self.service, self.job_id, self.t = service, job_id, t
        self.read = self.miss = self.served = self.service_s = self.served_bytes = 0.0

    def interval(self, rate: float, hit: float, service_s: float, item: float, seconds: float = 2.0) -> None:
        read = rate * seconds
        self.read += read
        self.miss += read * (1 - hit)
        n = read * (1 - hit) / item
        self.served += n
        self.service_s += n * service_s
        self.served_bytes += n * item
        self.t += seconds
        self.service.self_correct({self.job_id: {
            "throughput": rate, "hit_ratio": hit, "read_bytes": self.read, "miss_bytes": self.miss, "age_s": 0.0,
            "miss_service_count": self.served, "miss_service_s": self.service_s,
            "miss_service_bytes": self.served_bytes}}, self.t)


def _run(c, service, body: dict, *, real: float, hit: float, service_s: float, item: float):
    """Submit `body`, run it, and feed intervals of a job whose GPUs consume `real` bytes/s and
    whose loader (2 workers) spends `service_s` per missed item of `item` bytes, at hit ratio `hit`:
    it reads at loader_perf(real, hit, m), m = 2 item / service_s. Returns its GET record."""
    job = c.post("/v1/jobs", json=body, headers=H_ALICE).json()
    service.run_round("test")
    m = 2 * item / service_s
    rate = float(loader_perf(real, hit, m))
    mount = _Mount(service, job["id"])
    mount.interval(0.0, 0.0, service_s, item)  # first sight
    for _ in range(12):  # past the warm-up: GPU-held intervals (the link is not capped here)
        mount.interval(rate, hit, service_s, item)
        service.run_round("test")
    return c.get(f"/v1/jobs/{job['id']}", headers=H_ALICE).json(), rate, m


def test_the_loader_term_enters_the_diagnosis_and_stays_out_of_the_measured_fstar(svc):
    """A job with a declared loader whose misses (hit ratio 0.5) slow it to loader_perf(f*, h, m):
    the service measures L and s from the mount, keeps f* at the GPUs' rate (not the slower read
    rate), and predicts the job's speed with the loader term at the cache it is allocated. The
    same figures without a declared loader: f* learns the slower rate (the paper's model)."""
    c, service = svc
    real, hit, service_s, item = 80 * MB, 0.5, 0.004, 110e3
    with_loader, rate, m = _run(c, service, {**JOB, "loader": {"workers": 2}}, real=real, hit=hit,
                                service_s=service_s, item=item)
    assert rate < 0.7 * real  # the misses cost: 1 / (1/80 + 0.5 / 55) MB/s
    mp = with_loader["measured_parameters"]
    assert mp["miss_service_s"] == pytest.approx(service_s, rel=1e-6)
    assert mp["miss_item_bytes"] == pytest.approx(item, rel=1e-6)
    assert mp["ideal_throughput"] == pytest.approx(real, rel=0.03)  # the GPUs' rate, not the read rate
    # Predicted at the hit ratio of its allocation (c/d = 0.002): the loader's misses bind it.
    alloc = service.allocations(ADMIN_P)
    h = sum(x.bytes for x in alloc.cache) / 100e12
    cap = next(j for j in alloc.jobs if j.job_id == with_loader["id"]).remote_io
    b = with_loader["bottleneck"]
    expected = min(float(loader_perf(mp["ideal_throughput"], h, m)), cap / (1 - h))
    assert b["throughput"] == pytest.approx(expected, rel=1e-6)
    assert b["throughput"] < 0.5 * real and b["bound"] == "cache"
    c.delete(f"/v1/jobs/{with_loader['id']}", headers=H_ALICE)

    without, _, _ = _run(c, service, {**JOB, "name": "plain"}, real=real, hit=hit, service_s=service_s, item=item)
    assert without["measured_parameters"]["ideal_throughput"] == pytest.approx(rate, rel=0.03)
    assert without["bottleneck"]["bound"] == "gpu"


def test_diagnosis_with_a_loader_at_a_partial_cache():
    """The one diagnosis (scheduler/service/diagnosis.py) with the loader's columns: at c/d = 0.5 a
    job with W = 2 workers and L = 4 ms per 110 kB miss runs at loader_perf(f*, 0.5, m), labelled
    cache (a larger hit ratio relieves it); without a measured L, or without a declared loader,
    the paper's model."""
    from scheduler.service.diagnosis import diagnose_jobs, diagnosis_input

    f, d = 80 * MB, 3e9

    def diag(workers, item, service_s, measured_item):
        i = diagnosis_input(f, None, 1, 1e12, None, 0.5 * d, d, None, None, None, None, None, None, None, None,
                            workers, item, service_s, measured_item, 0.0)
        return i.loader_miss_rate, diagnose_jobs([i], 1e12)[0]

    m, b = diag(2, 110e3, 0.004, None)
    assert m == pytest.approx(2 * 110e3 / 0.004)
    assert b.throughput == pytest.approx(float(loader_perf(f, 0.5, m)))
    assert b.bound == "cache" and b.speedup_cache > 1.0
    m2, b2 = diag(2, None, 0.004, 55e3)  # s from the mount when not declared
    assert m2 == pytest.approx(2 * 55e3 / 0.004) and b2.throughput < f
    for args in ((2, 110e3, None, None), (None, None, 0.004, 110e3)):
        m3, b3 = diag(*args)
        assert math.isinf(m3) and b3.bound == "gpu" and b3.throughput == pytest.approx(f)


def test_the_cli_and_the_sdk_send_the_loader_and_bad_flags_are_refused(tmp_path, capsys):
    """`silod submit --loader-workers/--loader-item-bytes` and the SDK's `loader=` against a real
    `silod serve`; bad values fail before any call (exit 2, "error: ..." naming the flag)."""
    from scheduler.cli import main
    from silod_client import Client
    from silod_client.models import Loader

    try:
        from sdk_helpers import Served
    except ImportError:
        from tests.sdk_helpers import Served

    def silod(*argv: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as exc:
            main(list(argv))
        out, err = capsys.readouterr()
        return int(exc.value.code or 0), out, err

    submit = ["submit", "--name", "x", "--gpus", "1", "--dataset", "d", "--epochs", "1", "--ideal-throughput", "10MB/s"]
    for args, flag in ((["--loader-workers", "0"], "--loader-workers"),
                       (["--loader-workers", "5000"], "--loader-workers"),
                       (["--loader-workers", "2", "--loader-item-bytes", "0"], "--loader-item-bytes"),
                       (["--loader-workers", "2", "--loader-item-bytes", "lots"], "--loader-item-bytes"),
                       (["--loader-item-bytes", "9KB"], "--loader-workers")):
        code, _, err = silod(*submit, *args, "--server", "http://127.0.0.1:9", "--token", "t")
        assert code == 2 and err.startswith("error: ") and flag in err, (args, err)
        assert "Traceback" not in err
    served = Served(tmp_path)
    try:
        token = served.tokens["alice"]
        with Client(served.url, token) as client:
            client.datasets.register("d", "s3://b/d", "1GB")
            code, out, err = silod(*submit, "--loader-workers", "3", "--loader-item-bytes", "9KB",
                                   "--server", served.url, "--token", token)
            assert code == 0, err
            job = client.jobs.get(out.strip())
            assert job.loader is not None and (job.loader.workers, job.loader.item_bytes) == (3, 9e3)
            # the SDK's own declaration, typed
            job = client.jobs.submit("y", gpus=1, dataset="d", epochs=1, ideal_throughput="10MB/s",
                                     loader=Loader(workers=2))
            assert job.loader == Loader(workers=2, item_bytes=None)
    finally:
        served.stop()


def test_misses_timed_while_the_link_held_the_job_do_not_become_its_loader_term(svc):
    """At a binding remote-IO cap a miss also waits for the token bucket: L grows to
    W s (1/b - 1/((1-h) f*)) (estimator.loader_miss_time), the cap's figure, not the loader's.
    Folded into the L planning uses, m = W s / L would make the job's planned rate the old cap's
    b / (1-h) whatever link it is offered next. The service folds only intervals the link did not
    hold (their rate below the IO bound, as f*'s samples are judged): the stored L stays the free
    one (1 ms here) through intervals at the cap whose misses took 20 ms."""
    c, service = svc
    job = c.post("/v1/jobs", json={**JOB, "loader": {"workers": 2, "item_bytes": "110KB"}}, headers=H_ALICE).json()
    service.run_round("test")
    h = 0.0  # c/d = 0.002 of a 100 TB dataset: every read misses
    mount = _Mount(service, job["id"])
    mount.interval(0.0, h, 0.001, 110e3)  # first sight
    for _ in range(8):  # GPU-held: half the cap's rate, misses at 1 ms
        mount.interval(0.5 * _cap(service, job["id"]), h, 0.001, 110e3)
        service.run_round("test")
    got = lambda: c.get(f"/v1/jobs/{job['id']}", headers=H_ALICE).json()["measured_parameters"]["miss_service_s"]  # noqa: E731
    assert got() == pytest.approx(0.001, rel=1e-6)
    for _ in range(6):  # held by the link: at the cap, each miss waited for tokens (20 ms)
        mount.interval(_cap(service, job["id"]), h, 0.020, 110e3)
        assert got() == pytest.approx(0.001, rel=1e-6)
    mount.interval(0.5 * _cap(service, job["id"]), h, 0.003, 110e3)  # free again: folded
    assert got() > 0.001


def _cap(service, job_id: str) -> float:
    """The remote-IO cap the last round gave the job."""
    return next(j for j in service.allocations(ADMIN_P).jobs if j.job_id == job_id).remote_io
