"""The access pattern through the REST API and the service: accepted, stored (SQLite file and,
under CI, PostgreSQL), returned, handed to the policy in the snapshot; bad values are 422s
naming the field and store nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from estimator.access import EPOCH, IRREGULAR, AccessPattern
from scheduler.service.api.app import create_app
from scheduler.service.api.auth import TokenStore, load_token_key
from scheduler.service.scheduler_process import NewJob, Principal
from scheduler.service.cli import build_service

try:
    from pg_fixture import _pg_session, db_url, pg_url  # noqa: F401
except ImportError:
    from tests.pg_fixture import _pg_session, db_url, pg_url  # noqa: F401

ADMIN_TOKEN = "admin-token-access-0123"
H_ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
DATASET = {"name": "imagenet", "uri": "s3://datasets/imagenet", "size": "143GB"}
JOB = {"name": "r50", "gpus": 1, "dataset": "imagenet", "epochs": 2, "ideal_throughput": "100MB/s"}
CURRICULUM = {"kind": "curriculum", "starting_percent": 0.04, "alpha": 1.9, "step": 50000, "batch": 256}


def _service(url: str, tmp_path):
    return build_service(db=url, backend="null", policy="fifo", round_s=360, gpus="8", gpus_per_node="4",
                         cache="200GB", remote_io="1GB/s", state_dir=tmp_path / "state")


@pytest.fixture
def app_client(db_url, tmp_path) -> Iterator[tuple[TestClient, object]]:
    service = _service(db_url, tmp_path)
    tokens = TokenStore(service.engine, load_token_key(tmp_path / "state"), admin_token=ADMIN_TOKEN)
    with TestClient(create_app(service, tokens, run_loop=False)) as client:
        assert client.post("/v1/datasets", json=DATASET, headers=H_ADMIN).status_code == 201
        yield client, service
    service.close()


def test_access_is_stored_returned_and_in_the_snapshot(app_client) -> None:
    client, service = app_client
    ids = {}
    for name, access in (("plain", None), ("epoch", "epoch"), ("irr", "irregular"), ("cl", CURRICULUM)):
        body = {**JOB, "name": name} | ({} if access is None else {"access": access})
        r = client.post("/v1/jobs", json=body, headers=H_ADMIN)
        assert r.status_code == 201, r.text
        ids[name] = r.json()["id"]
    got = {j["name"]: j["access"] for j in client.get("/v1/jobs", headers=H_ADMIN).json()}
    blank = {"starting_percent": None, "alpha": None, "step": None, "batch": None}
    assert got == {"plain": {"kind": "epoch", **blank}, "epoch": {"kind": "epoch", **blank},
                   "irr": {"kind": "irregular", **blank}, "cl": CURRICULUM}
    assert client.get(f"/v1/jobs/{ids['cl']}", headers=H_ADMIN).json()["access"] == CURRICULUM
    views = {j.job_id: j.access for j in service.build_snapshot().jobs}
    assert views == {ids["plain"]: EPOCH, ids["epoch"]: EPOCH, ids["irr"]: IRREGULAR,
                     ids["cl"]: AccessPattern.curriculum_learning(0.04, 1.9, 50000, 256)}


@pytest.mark.parametrize(
    "access",
    [
        "sometimes",
        {"kind": "curriculum", "starting_percent": 0.04, "alpha": 1.9, "step": 50000},  # no batch
        {**CURRICULUM, "starting_percent": 0},
        {**CURRICULUM, "starting_percent": 1.5},
        {**CURRICULUM, "alpha": 1.0},  # start < 1 never reaches the whole set
        {**CURRICULUM, "alpha": 0.5, "starting_percent": 1.0},
        {**CURRICULUM, "step": 0},
        {**CURRICULUM, "batch": 0},
        {**CURRICULUM, "step": 2.5},
        {"kind": "epoch", "alpha": 2.0},
        {"kind": "irregular", "steps": 3},  # unknown field
        {**CURRICULUM, "alpha": "NaN"},
        7,
    ],
)
def test_bad_access_is_422_naming_access_and_stores_nothing(app_client, access) -> None:
    client, _ = app_client
    r = client.post("/v1/jobs", json={**JOB, "access": access}, headers=H_ADMIN)
    assert r.status_code == 422, r.text
    assert "access" in r.json()["detail"][0]["loc"], r.text
    assert client.get("/v1/jobs", headers=H_ADMIN).json() == []


def test_python_api_takes_the_typed_pattern(db_url, tmp_path) -> None:
    service = _service(db_url, tmp_path)
    try:
        from scheduler.service.scheduler_process import NewDataset

        # Datasets belong to a tenant: the tenant submitting the jobs registers them.
        d, _ = service.register_dataset(Principal("u"), NewDataset("d", "s3://b/d", 1e9))
        service.register_dataset(Principal("u"), NewDataset("d2", "s3://b/d2", 1e9))
        cl = AccessPattern.curriculum_learning(0.25, 2.0, 10, 32)
        record = service.submit_job(Principal("u"), NewJob("j", 1, "d", epochs=1.0, ideal_throughput=1e8, access=cl))
        assert record.access == cl
        assert service.get_job(Principal("u"), record.id).access == cl
        assert [j.access for j in service.build_snapshot().jobs] == [cl]
        plain = service.submit_job(Principal("u"), NewJob("r", 1, "d2", epochs=1.0, ideal_throughput=1e8))
        result = service.run_round("test")
        partition = result.plan.allocation.partition
        assert partition is not None and partition.irregular_jobs == {record.id} and partition.regular_jobs == {plain.id}
        # The snapshot names datasets by their storage key (d<id>-<name>), as the data manager does.
        assert partition.lru_datasets == {d.key} and partition.irregular_share == 0.5
    finally:
        service.close()


def test_round_pushes_lru_mode_for_irregular_only_datasets(tmp_path) -> None:
    """The service tells a real data manager (its ASGI app, with tokens) which datasets' caches
    turn LRU: those only irregular jobs read, named by their storage key."""
    from datamanager.app import create_app as create_dm_app
    from datamanager.auth import DataManagerAuth
    from datamanager.client import DataManagerClient
    from scheduler.service.scheduler_process import NewDataset

    sched_token, agent_token = "dm-scheduler-token-0123", "dm-agent-token-0123"
    (tmp_path / "dm").mkdir()
    dm_app = create_dm_app(tmp_path / "dm", DataManagerAuth.from_tokens(sched_token, agent_token))
    service = _service(f"sqlite:///{tmp_path / 's.db'}", tmp_path)
    with TestClient(dm_app, base_url="http://dm") as dm:
        service.pusher = DataManagerClient("http://dm", transport=dm._transport, token=sched_token)
        try:
            u = Principal("u")
            irr, _ = service.register_dataset(u, NewDataset("irr", "s3://b/irr", 1e9))
            reg, _ = service.register_dataset(u, NewDataset("reg", "s3://b/reg", 1e9))
            service.submit_job(u, NewJob("i", 1, "irr", epochs=1.0, ideal_throughput=1e8, access=IRREGULAR))
            service.submit_job(u, NewJob("r", 1, "reg", epochs=1.0, ideal_throughput=1e8))
            service.run_round("test")
            assert service.last_push_error is None
            status = dm.get("/v1/status", headers={"Authorization": f"Bearer {sched_token}"}).json()
            modes = {name: ds["cache_mode"] for name, ds in status["datasets"].items()}
            assert modes[irr.key] == "lru" and modes[reg.key] == "uniform", status
        finally:
            service.close()
