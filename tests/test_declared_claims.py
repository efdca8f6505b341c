"""Declarations are claims, not facts (issue 47, Build 1).

A job's declared f* and declared work order the SJF queue before anything is measured. These
tests attack that from a tenant's side: a 10 TB/s declaration must not preempt another tenant's
job; once a job has run, the data plane's measurement replaces an overstated declaration
without a factor that protects the declarer; a Kubernetes job that runs past its declared work
must not stay first in SJF. Real service, real SQLite file, real REST API (TestClient); the null
backend (no cluster: nothing here needs pods) for the first, and the emulated API server of
tests/k8s_emulator.py (no real control plane is needed for this property) for the last.
"""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from scheduler.service.api.app import create_app
from scheduler.service.cli import build_service, make_token_store
from scheduler.service.db.models import Job
from scheduler.service.round_jobs import remaining_work
from scheduler.service.types import Principal

MB, GB, TB = 1e6, 1e9, 1e12
ADMIN_TOKEN = "admin-token-0123456789"
TOKENS = {"alice": "alice-token-0001", "bob": "bob-token-00002", "carol": "carol-token-003"}
H = {u: {"Authorization": f"Bearer {t}"} for u, t in TOKENS.items()}
H_ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ROOT = Principal("admin", is_admin=True)


@pytest.fixture
def sjf16(tmp_path, monkeypatch):
    """`silod serve --backend null --policy sjf` on 16 GPUs (2 x 8)."""
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("".join(f"{u}:{t}\n" for u, t in TOKENS.items()))
    service = build_service(db=f"sqlite:///{tmp_path / 'sjf.db'}", backend="null", policy="sjf", round_s=360,
                            gpus="16", gpus_per_node="8", cache="200GB", remote_io="10GB/s",
                            state_dir=tmp_path / "state")
    monkeypatch.setenv("SILOD_ADMIN_TOKEN", ADMIN_TOKEN)
    tokens = make_token_store(service.engine, tmp_path / "state", tokens_file)
    app = create_app(service, tokens, run_loop=False)
    with TestClient(app) as c:
        for user in TOKENS:
            r = c.post("/v1/datasets", json={"name": "web", "uri": "s3://d/web", "size": "1TB"}, headers=H[user])
            assert r.status_code == 201, r.text
        yield c, service
    service.close()


def _job(name: str, rate: str) -> dict:
    return {"name": name, "gpus": 8, "dataset": "web", "epochs": 1, "ideal_throughput": rate}


def _state(c: TestClient, user: str, job: dict) -> str:
    return c.get(f"/v1/jobs/{job['id']}", headers=H[user]).json()["state"]


def test_a_10tb_declaration_does_not_preempt_another_tenant(sjf16):
    c, service = sjf16
    bob = c.post("/v1/jobs", json=_job("train", "200MB/s"), headers=H["bob"]).json()
    carol = c.post("/v1/jobs", json=_job("train", "200MB/s"), headers=H["carol"]).json()
    service.run_round("test")
    assert (_state(c, "bob", bob), _state(c, "carol", carol)) == ("running", "running")
    # The probe: the same job declared at 10 TB/s. On main it was queued and preempted
    # carol at the next round; now the claim is bounded by the tenant's ceiling (default
    # 1 GB/s per GPU) and refused, naming the limit and how to raise it.
    r = c.post("/v1/jobs", json=_job("train", "10TB/s"), headers=H["alice"])
    assert r.status_code == 403, r.text
    assert "ideal_per_gpu" in r.text and "PUT /v1/quotas/alice" in r.text
    service.run_round("test")
    assert (_state(c, "bob", bob), _state(c, "carol", carol)) == ("running", "running")
    # A catalog model is what the catalog allows: 8 x resnet50's 114 MB/s is accepted.
    r = c.post("/v1/jobs", json={**_job("r50", "1MB/s"), "ideal_throughput": None, "model": "resnet50"},
               headers=H["alice"])
    assert r.status_code == 201, r.text
    c.delete(f"/v1/jobs/{r.json()['id']}", headers=H["alice"])


def test_measurement_replaces_an_overstated_declaration_without_a_floor(sjf16):
    """An admin lets alice declare up to 2 TB/s per GPU; she declares 10 TB/s for a job that reads
    200 MB/s. Her claim wins the first round (that is what a ceiling allows), but once the data
    plane has measured the job, planning uses what it reads: on main the estimate stayed at
    declared / 4 = 2.5 TB/s, 12,500x the truth, and her job kept carol's GPUs."""
    c, service = sjf16
    bob = c.post("/v1/jobs", json=_job("train", "200MB/s"), headers=H["bob"]).json()
    carol = c.post("/v1/jobs", json=_job("train", "200MB/s"), headers=H["carol"]).json()
    service.run_round("test")
    r = c.put("/v1/quotas/alice", json={"ideal_per_gpu": "2TB/s"}, headers=H_ADMIN)
    assert r.status_code == 200 and r.json()["ideal_per_gpu"] == 2 * TB, r.text
    alice = c.post("/v1/jobs", json=_job("train", "10TB/s"), headers=H["alice"])
    assert alice.status_code == 201, alice.text
    alice = alice.json()
    service.run_round("test")
    assert _state(c, "alice", alice) == "running" and _state(c, "carol", carol) == "queued"
    t = 1000.0
    for _ in range(8):  # 2 s intervals after the warm-up: every job reads 200 MB/s, GPU-bound
        service.self_correct({j["id"]: {"throughput": 200 * MB, "hit_ratio": 0.0} for j in (alice, bob, carol)}, t)
        t += 2.0
    mp = c.get(f"/v1/jobs/{alice['id']}", headers=H["alice"]).json()["measured_parameters"]
    assert mp["declared_ideal_throughput"] == 10 * TB
    assert mp["ideal_throughput"] == pytest.approx(200 * MB)
    service.run_round("test")
    # The same job as carol's, submitted later: carol's runs again, alice's waits.
    assert (_state(c, "bob", bob), _state(c, "carol", carol), _state(c, "alice", alice)) == (
        "running", "running", "queued")


def test_the_ceiling_is_a_quota_field_and_a_default_quota_key(sjf16, tmp_path):
    from estimator.errors import UserError
    from scheduler.service.cli import parse_quota

    c, _ = sjf16
    assert parse_quota("fstar=2GB/s").ideal_per_gpu == 2 * GB
    with pytest.raises(UserError, match="--default-quota fstar"):
        parse_quota("fstar=fast")
    r = c.put("/v1/quotas/bob", json={"ideal_per_gpu": "100MB/s"}, headers=H_ADMIN)
    assert r.status_code == 200
    assert c.post("/v1/jobs", json=_job("ok", "800MB/s"), headers=H["bob"]).status_code == 201
    r = c.post("/v1/jobs", json=_job("no", "801MB/s"), headers=H["bob"])
    assert r.status_code == 403 and "1e+08 B/s per GPU x 8 GPUs" in r.text, r.text
    assert c.get("/v1/quotas/bob", headers=H["bob"]).json()["ideal_per_gpu"] == 100 * MB
    assert c.put("/v1/quotas/bob", json={"ideal_per_gpu": "1TB/s"}, headers=H["bob"]).status_code == 403


def test_remaining_work_at_the_declared_total_is_unknown_not_zero():
    now = 10_000.0
    # Not at its total: what is left.
    assert remaining_work(100 * GB, 40 * GB, 1 * GB, now - 40, now) == 60 * GB
    # At its total, on time (100 s at 1 GB/s): about nothing left.
    assert remaining_work(100 * GB, 99 * GB, 1 * GB, now - 100, now) == pytest.approx(1 * GB)
    # 1,000 s past a 100 s declaration: as much again as it has overrun (running or preempted).
    assert remaining_work(100 * GB, 99 * GB, 1 * GB, now - 1100, now) == pytest.approx(1000 * GB)
    # Never started: nothing is known to be past anything.
    assert remaining_work(100 * GB, 99 * GB, 1 * GB, None, now) == pytest.approx(1 * GB)


def test_every_backends_cap_at_the_declared_total_reads_as_unknown_work():
    """The rule reads only the job's row, so it holds wherever progress stops: Kubernetes holds a
    running job at 0.99 of its total (test below), the local worker at the total (a program
    reading past its declaration: local_worker.py caps what the mount served there)."""
    now = 10_000.0
    for consumed in (0.99 * 100 * GB, 100 * GB):
        assert remaining_work(100 * GB, consumed, 1 * GB, now - 1100, now) == pytest.approx(1000 * GB)


# --- Kubernetes: a job that runs past its declared work -----------------------------------------

try:
    from test_kubernetes_admission import RESTRICTED, create, kubectl_job, step
    from test_kubernetes_admission import TOKENS as K8S_TOKENS
    from test_kubernetes_admission import _token_store
    from k8s_emulator import EmulatedCluster
except ImportError:  # tests/ imported as a package
    from tests.test_kubernetes_admission import RESTRICTED, create, kubectl_job, step
    from tests.test_kubernetes_admission import TOKENS as K8S_TOKENS
    from tests.test_kubernetes_admission import _token_store
    from tests.k8s_emulator import EmulatedCluster


def test_an_overrunning_kubernetes_job_does_not_stay_first_in_sjf(tmp_path):
    """Alice's kubectl Job declares 1 epoch of 10 GB at 500 MB/s (20 s) and runs for 1,000 s: the
    backend's progress estimate stops at 0.99 of the total (only the Job controller says done),
    so on main its remaining work was 0.1 GB and SJF kept it ahead of bob's 30 GB job for ever."""
    with EmulatedCluster() as cluster:
        for ns in ("alice", "bob"):
            cluster.add_namespace(ns, RESTRICTED)
        cluster.add_namespace("silod-system")
        cluster.add_node("n1", 4, cache="100GB", remote_io="500MB/s")
        tokens_file = tmp_path / "tokens"
        tokens_file.write_text("".join(f"{u}:{t}\n" for u, t in K8S_TOKENS.items()))
        service = build_service(db=f"sqlite:///{tmp_path / 'k8s.db'}", backend="kubernetes", policy="sjf",
                                round_s=360, gpus="4", gpus_per_node="4", cache="100GB", remote_io="500MB/s",
                                state_dir=tmp_path / "state", backend_opts={"server": cluster.url})
        try:
            app = create_app(service, _token_store(service, tokens_file), run_loop=False)
            with TestClient(app) as client:
                for user in ("alice", "bob"):
                    r = client.post("/v1/datasets", json={"name": "imagenet", "uri": "s3://d/imagenet", "size": "10GB"},
                                    headers={"Authorization": f"Bearer {K8S_TOKENS[user]}"})
                    assert r.status_code == 201, r.text
                create(cluster, kubectl_job("short", "alice", gpus=4, epochs="1"))
                step(service)
                short = next(j for j in service.list_jobs(ROOT) if j.name.startswith("job.short."))
                assert service.get_job(ROOT, short.id).state == "running"
                create(cluster, kubectl_job("long", "bob", gpus=4, epochs="3"))
                service.apply_events(service.backend.poll())
                long = next(j for j in service.list_jobs(ROOT) if j.name.startswith("job.long."))
                # 1,000 s later (the backend's clock and the job's recorded start), it still runs.
                later = time.time() + 1000.0
                service.backend.clock = lambda: later
                with service.sessions.begin() as s:
                    s.execute(update(Job).where(Job.id == int(short.id)).values(start_time=time.time() - 1000.0))
                service._progress_seen.pop(int(short.id), None)
                service.apply_events(service.backend.poll())
                assert service.get_job(ROOT, short.id).consumed_bytes == pytest.approx(0.99 * 10 * GB)
                step(service)
                assert service.get_job(ROOT, long.id).state == "running"
                assert service.get_job(ROOT, short.id).state == "queued"
                step(service)  # and preempted, it does not jump back ahead
                assert service.get_job(ROOT, long.id).state == "running"
        finally:
            service.close()


def test_an_overstated_declaration_is_replaced_by_the_measurement():
    """The estimator alone: 10 TB/s declared, 200 MB/s read while GPU-bound (on main: 2.5 TB/s)."""
    from estimator.measured import JobMeasurement, observe_job

    m = JobMeasurement.start(10 * TB)
    for _ in range(5):
        m = observe_job(m, 200 * MB, 2.0, io_bound=10 * GB)
    assert m.fstar.estimate == pytest.approx(200 * MB)
    # Understated, it is raised by what is read at most to declared x 4: lying low only loses.
    m = JobMeasurement.start(100 * MB)
    m = observe_job(m, 1 * GB, 2.0, io_bound=1 * GB)
    assert m.fstar.estimate == pytest.approx(400 * MB)


# --- declared work: a bounded claim too ---------------------------------------------------------

def test_understated_work_is_refused_below_the_tenants_floor(sjf16):
    """The same hole as f*'s, for work: SJF runs the shortest declared job first and preempts. With
    bob's and carol's 10-epoch jobs running, alice declared a millionth of an epoch (1 MB of the
    1 TB dataset): on main any declaration was taken and hers preempted carol's at the next round.
    An admin's floor (quota min_work; `--default-quota min_work=` for every tenant) refuses it,
    naming the quota and how to change it; a job within the range runs as before."""
    c, service = sjf16
    long = {**_job("train", "200MB/s"), "epochs": 10}
    bob = c.post("/v1/jobs", json=long, headers=H["bob"]).json()
    carol = c.post("/v1/jobs", json=long, headers=H["carol"]).json()
    service.run_round("test")
    assert (_state(c, "bob", bob), _state(c, "carol", carol)) == ("running", "running")
    r = c.put("/v1/quotas/alice", json={"min_work": "100GB", "max_work": "100TB"}, headers=H_ADMIN)
    assert r.status_code == 200 and (r.json()["min_work"], r.json()["max_work"]) == (100 * GB, 100 * TB), r.text
    for tiny in ({"epochs": 1e-6}, {"epochs": None, "steps": 1, "step_bytes": "1MB"}):
        r = c.post("/v1/jobs", json={**long, **tiny}, headers=H["alice"])
        assert r.status_code == 403 and r.json()["field"] == "epochs", r.text
        assert "min_work" in r.text and "PUT /v1/quotas/alice" in r.text
    r = c.post("/v1/jobs", json={**long, "epochs": 101}, headers=H["alice"])  # 101 TB
    assert r.status_code == 403 and "max_work" in r.text, r.text
    service.run_round("test")
    assert (_state(c, "bob", bob), _state(c, "carol", carol)) == ("running", "running")
    ok = c.post("/v1/jobs", json={**long, "epochs": 0.1}, headers=H["alice"])  # 100 GB: within the range
    assert ok.status_code == 201, ok.text
    # The tenant reads its range; it cannot set it; a range upside down is a 422 naming it.
    assert c.get("/v1/quotas/alice", headers=H["alice"]).json()["min_work"] == 100 * GB
    assert c.put("/v1/quotas/alice", json={"min_work": "1GB"}, headers=H["alice"]).status_code == 403
    r = c.put("/v1/quotas/bob", json={"min_work": "2GB", "max_work": "1GB"}, headers=H_ADMIN)
    assert r.status_code == 422 and "min_work" in r.text, r.text


def test_the_work_range_is_a_default_quota_key(tmp_path):
    from estimator.errors import UserError
    from scheduler.service.cli import parse_quota

    q = parse_quota("min_work=50GB,max_work=1PB")
    assert (q.min_work, q.max_work) == (50 * GB, 1e15)
    with pytest.raises(UserError, match="min_work is above max_work"):
        parse_quota("min_work=2GB,max_work=1GB")
    with pytest.raises(UserError, match="--default-quota min_work"):
        parse_quota("min_work=lots")
    # The default quota's floor applies to a tenant whose own quota leaves it unset.
    service = build_service(db=f"sqlite:///{tmp_path / 'w.db'}", backend="null", policy="sjf", round_s=360,
                            gpus="8", gpus_per_node="8", cache="1GB", remote_io="1GB/s", state_dir=tmp_path / "s",
                            default_quota=q)
    try:
        from scheduler.service.types import ForbiddenError, NewDataset, NewJob

        alice = Principal("alice")
        service.register_dataset(alice, NewDataset("web", "s3://d/web", 1e12))
        with pytest.raises(ForbiddenError, match="min_work"):
            service.submit_job(alice, NewJob("tiny", 1, "web", epochs=0.01, ideal_throughput=1e8))
        assert service.submit_job(alice, NewJob("ok", 1, "web", epochs=0.05, ideal_throughput=1e8)).state == "queued"
    finally:
        service.close()
