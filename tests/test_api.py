"""REST API: auth, per-user visibility, validation (4xx naming the field, never 5xx), policy,
cluster and allocations views, metrics. Fast tests use TestClient; the concurrency test runs a
real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from scheduler.service.api.app import create_app
from scheduler.service.api.server import ServerThread
from scheduler.service.cli import build_service, make_token_store

try:
    from pg_fixture import _pg_session, db_url, pg_url  # noqa: F401
except ImportError:
    from tests.pg_fixture import _pg_session, db_url, pg_url  # noqa: F401

ADMIN_TOKEN = "admin-token-0123456789"
TOKENS = {"alice": "alice-token-0001", "bob": "bob-token-00002"}
H_ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
H_ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}
H_BOB = {"Authorization": f"Bearer {TOKENS['bob']}"}
IMAGENET = {"name": "imagenet", "uri": "s3://datasets/imagenet", "size": "143GB", "item_count": 1281167}
JOB = {"name": "r50", "gpus": 4, "dataset": "imagenet", "epochs": 2, "ideal_throughput": "456MB/s"}


def make_app(url: str, tmp_path, run_loop: bool = True, monkeypatch=None, **kw):  # type: ignore[no-untyped-def]
    """The API over a fresh service; the admin token through the environment, as `silod serve` has it."""
    import os

    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("# user:token\n" + "".join(f"{u}:{t}\n" for u, t in TOKENS.items()))
    max_body = kw.pop("max_body", 1 << 20)
    service = build_service(db=url, backend="null", policy="fifo", round_s=360, gpus="8", gpus_per_node="4",
                            cache="200GB", remote_io="1GB/s", state_dir=tmp_path / "state", **kw)
    old = os.environ.get("SILOD_ADMIN_TOKEN")
    os.environ["SILOD_ADMIN_TOKEN"] = ADMIN_TOKEN
    try:
        tokens = make_token_store(service.engine, tmp_path / "state", tokens_file)
    finally:
        if old is None:
            del os.environ["SILOD_ADMIN_TOKEN"]
        else:
            os.environ["SILOD_ADMIN_TOKEN"] = old
    return create_app(service, tokens, run_loop=run_loop, max_body=max_body), service


@pytest.fixture
def client(tmp_path) -> Iterator[TestClient]:
    app, service = make_app(f"sqlite:///{tmp_path / 'api.db'}", tmp_path)
    with TestClient(app) as c:
        # Dataset names are per tenant: alice and bob each register their own "imagenet".
        assert c.post("/v1/datasets", json=IMAGENET, headers=H_ALICE).status_code == 201
        assert c.post("/v1/datasets", json=IMAGENET, headers=H_BOB).status_code == 201
        yield c
    service.close()


def test_auth_required(client: TestClient) -> None:
    for method, path in [("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/jobs/1"), ("DELETE", "/v1/jobs/1"),
                         ("GET", "/v1/datasets"), ("POST", "/v1/datasets"), ("GET", "/v1/cluster"),
                         ("GET", "/v1/allocations"), ("GET", "/v1/policy"), ("PUT", "/v1/policy")]:
        for headers in ({}, {"Authorization": "Bearer wrong-token-xyz"}, {"Authorization": "Basic YTpi"}):
            r = client.request(method, path, headers=headers, json={})
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.headers["www-authenticate"] == "Bearer"
    assert client.get("/healthz").json() == {"status": "ok", "database": "ok"}
    assert client.get("/docs").status_code == 200
    assert "/v1/jobs" in client.get("/openapi.json").json()["paths"]


def test_submit_list_get_cancel_with_user_isolation(client: TestClient) -> None:
    r = client.post("/v1/jobs", json=JOB, headers=H_ALICE)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["owner"] == "alice" and job["ideal_throughput"] == 456e6 and job["total_bytes"] == 286e9
    bob_job = client.post("/v1/jobs", json={**JOB, "name": "bert", "ideal_throughput": None, "model": "bert"}, headers=H_BOB).json()
    assert bob_job["ideal_throughput"] == 4 * 2e6  # catalog f* per GPU x gpus

    assert [j["id"] for j in client.get("/v1/jobs", headers=H_ALICE).json()] == [job["id"]]
    assert [j["id"] for j in client.get("/v1/jobs", headers=H_BOB).json()] == [bob_job["id"]]
    assert len(client.get("/v1/jobs", headers=H_ADMIN).json()) == 2
    assert [j["id"] for j in client.get("/v1/jobs", params={"owner": "bob"}, headers=H_ADMIN).json()] == [bob_job["id"]]
    # Another user's job does not exist for you: 404 on get and cancel, and it is not cancelled.
    assert client.get(f"/v1/jobs/{job['id']}", headers=H_BOB).status_code == 404
    assert client.delete(f"/v1/jobs/{job['id']}", headers=H_BOB).status_code == 404
    assert client.get(f"/v1/jobs/{job['id']}", headers=H_ALICE).json()["state"] in ("queued", "running")
    r = client.delete(f"/v1/jobs/{job['id']}", headers=H_ALICE)
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    r = client.delete(f"/v1/jobs/{job['id']}", headers=H_ALICE)
    assert r.status_code == 409 and r.json()["field"] == "job_id"
    assert client.delete(f"/v1/jobs/{bob_job['id']}", headers=H_ADMIN).json()["state"] == "cancelled"
    assert client.get("/v1/jobs", params={"state": "cancelled"}, headers=H_ADMIN).json().__len__() == 2
    assert client.get("/v1/jobs", params={"state": "bogus"}, headers=H_ADMIN).status_code == 422
    for missing in ("999", "abc", "-1", "..", "1.0"):
        assert client.get(f"/v1/jobs/{missing}", headers=H_ADMIN).status_code == 404


def test_steps_and_step_bytes(client: TestClient) -> None:
    body = {"name": "s", "gpus": 1, "dataset": "imagenet", "steps": 1000, "step_bytes": "32MB", "ideal_throughput": 1e8}
    r = client.post("/v1/jobs", json=body, headers=H_ALICE)
    assert r.status_code == 201 and r.json()["total_bytes"] == 32e9


def _fields(response: httpx.Response) -> set[str]:
    detail = response.json()["detail"]
    if isinstance(detail, list):
        return {str(e["loc"][-1]) if e["loc"][-1] != "body" or len(e["loc"]) == 1 else "body" for e in detail}
    return {response.json()["field"]}


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"gpus": 10**30}, "gpus"),
        ({"gpus": 0}, "gpus"),
        ({"gpus": "four"}, "gpus"),
        ({"gpus": 9}, "gpus"),  # more than the cluster has
        ({"gpus": 2.5}, "gpus"),
        ({"dataset": "unknown"}, "dataset"),
        ({"dataset": "../etc"}, "dataset"),
        ({"name": ""}, "name"),
        ({"name": "a/b"}, "name"),
        ({"name": "a..b"}, "name"),
        ({"name": "x" * 200}, "name"),
        ({"epochs": -1}, "epochs"),
        ({"epochs": 1e300}, "epochs"),
        ({"epochs": None}, "body"),
        ({"ideal_throughput": "-5MB/s"}, "ideal_throughput"),
        ({"ideal_throughput": "fast"}, "ideal_throughput"),
        ({"ideal_throughput": 1e22}, "ideal_throughput"),
        ({"ideal_throughput": None}, "body"),
        ({"ideal_throughput": None, "model": "gpt-17"}, "model"),
        ({"priority": 10**9}, "priority"),
        ({"gpu": 4}, "gpu"),  # a typo is an error, not an ignored field
    ],
)
def test_bad_job_is_4xx_naming_the_field(client: TestClient, patch: dict, field: str) -> None:
    body = {**JOB, **patch}
    r = client.post("/v1/jobs", json=body, headers=H_ALICE)
    assert 400 <= r.status_code < 500, r.text
    assert field in _fields(r), r.text
    assert client.get("/v1/jobs", headers=H_ADMIN).json() == []


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"size": -1}, "size"),
        ({"size": "-1GB"}, "size"),
        ({"size": "2e21"}, "size"),
        ({"size": 1e30}, "size"),
        ({"size": "143 parsecs"}, "size"),
        ({"size": "200MB/s"}, "size"),
        ({"size": True}, "size"),
        ({"name": "a/b"}, "name"),
        ({"name": ".."}, "name"),
        ({"name": ""}, "name"),
        ({"item_count": 0}, "item_count"),
        ({"item_count": 10**30}, "item_count"),
    ],
)
def test_bad_dataset_is_422_naming_the_field(client: TestClient, patch: dict, field: str) -> None:
    r = client.post("/v1/datasets", json={**IMAGENET, "name": "other", **patch}, headers=H_ALICE)
    assert r.status_code == 422, r.text
    assert field in _fields(r), r.text


def test_a_size_or_rate_with_a_lower_case_b_is_refused_with_both_readings(client: TestClient) -> None:
    """`{"size": "10tb"}` stored 1.25 TB (terabits), silently; now it is a 422 that spells out
    both readings, and nothing is stored."""
    r = client.post("/v1/datasets", json={**IMAGENET, "name": "big", "size": "10tb"}, headers=H_ALICE)
    assert r.status_code == 422, r.text
    assert "size" in _fields(r)
    assert "10TB for 10 terabytes" in r.text and "10Tbit for 10 terabits (1.25TB)" in r.text, r.text
    assert "big" not in [d["name"] for d in client.get("/v1/datasets", headers=H_ALICE).json()]
    r = client.post("/v1/jobs", json={**JOB, "ideal_throughput": "100mb/s"}, headers=H_ALICE)
    assert r.status_code == 422 and "100MB/s for 100 megabytes/s" in r.text and "100Mbps" in r.text, r.text
    ok = client.post("/v1/datasets", json={**IMAGENET, "name": "bits", "size": "80Tbit"}, headers=H_ALICE)
    assert ok.status_code == 201, ok.text
    assert client.get("/v1/datasets/bits", headers=H_ALICE).json()["size"] == 10e12


@pytest.mark.parametrize("uri", ["/data/imagenet", "no-scheme", "./imagenet"])
def test_a_local_path_uri_is_a_400_naming_the_rule(client: TestClient, uri: str) -> None:
    """A local path got a raw regex 422 (`string should match pattern ...`) where the docs
    promise a 400 naming the rule (docs/service.md)."""
    r = client.post("/v1/datasets", json={**IMAGENET, "name": "local", "uri": uri}, headers=H_ALICE)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "uri" and "local paths are not allowed" in r.json()["detail"], r.text
    assert "pattern" not in r.text


def test_malformed_bodies_are_4xx(client: TestClient) -> None:
    for content in (b"{", b"[]", b"null", b"\xff\xfe", b'{"name": NaN}', b"1" * 10000):
        for path in ("/v1/jobs", "/v1/datasets"):
            r = client.post(path, content=content, headers={**H_ALICE, "Content-Type": "application/json"})
            assert r.status_code in (400, 422), (path, content[:20], r.status_code, r.text)


def test_datasets_register_idempotently(client: TestClient) -> None:
    assert client.post("/v1/datasets", json=IMAGENET, headers=H_BOB).status_code == 200  # bob's own, again
    r = client.post("/v1/datasets", json={**IMAGENET, "size": "144GB"}, headers=H_BOB)
    assert r.status_code == 409 and r.json()["field"] == "name"
    assert [d["name"] for d in client.get("/v1/datasets", headers=H_BOB).json()] == ["imagenet"]
    assert client.get("/v1/datasets/imagenet", headers=H_BOB).json()["size"] == 143e9
    assert client.get("/v1/datasets/nope", headers=H_BOB).status_code == 404


def test_policy_get_set(client: TestClient) -> None:
    got = client.get("/v1/policy", headers=H_ALICE).json()
    assert got["name"] == "fifo" and {"fifo", "sjf", "gavel", "greedy"} <= set(got["available"])
    assert client.put("/v1/policy", json={"name": "sjf"}, headers=H_ALICE).status_code == 403
    r = client.put("/v1/policy", json={"name": "lottery"}, headers=H_ADMIN)
    assert r.status_code == 422 and "fifo" in r.json()["detail"] and "gavel" in r.json()["detail"]
    assert client.put("/v1/policy", json={"name": "gavel"}, headers=H_ADMIN).json()["name"] == "gavel"
    assert client.get("/v1/policy", headers=H_BOB).json()["name"] == "gavel"
    # the commands' rule: case does not matter, and a typo gets the closest name
    assert client.put("/v1/policy", json={"name": "SJF"}, headers=H_ADMIN).json()["name"] == "sjf"
    r = client.put("/v1/policy", json={"name": "gavell"}, headers=H_ADMIN)
    assert r.status_code == 422 and "did you mean 'gavel'" in r.json()["detail"] and r.json()["field"] == "name"


def test_fifo_keeps_submission_order_when_the_wall_clock_steps_back(client: TestClient, monkeypatch) -> None:
    """A wall clock stepped back (NTP) between two submissions: the later job must not get the
    earlier submission time, or FIFO runs it (and the third job) instead of the first one."""
    import types

    from scheduler.service import catalogue

    clock = iter([1_000_000.0, 999_990.0, 999_995.0])  # the second submission sees the clock 10 s back
    monkeypatch.setattr(catalogue, "time", types.SimpleNamespace(time=lambda: next(clock)))  # the catalogue's clock only
    ids = [client.post("/v1/jobs", json={**JOB, "name": f"j{i}"}, headers=H_ALICE).json()["id"] for i in range(3)]
    monkeypatch.undo()
    jobs = {j["id"]: j for j in client.get("/v1/jobs", headers=H_ALICE).json()}
    times = [jobs[i]["submit_time"] for i in ids]
    assert times == sorted(times) and times[0] == 1_000_000.0
    r = client.post("/v1/rounds", headers=H_ADMIN).json()
    # Which jobs run, not their order: the service's own loop may run a round between the
    # submissions, and a job that already ran then comes after a fresh one in the round
    # planner's order (its time-sharing priority, for FIFO's full shares too). Seen in CI as
    # ['2', '1'] for ['1', '2'], about one run in 30.
    assert sorted(r["running"]) == sorted(ids[:2])


def test_cluster_allocations_and_metrics(client: TestClient) -> None:
    ids = [client.post("/v1/jobs", json={**JOB, "name": f"j{i}"}, headers=H_ALICE).json()["id"] for i in range(3)]
    bob = client.post("/v1/jobs", json={**JOB, "name": "b", "gpus": 1}, headers=H_BOB).json()["id"]
    r = client.post("/v1/rounds", headers=H_ADMIN).json()
    # FIFO: j0 and j1 fill the 8 GPUs, the rest wait (in either order: see the test above)
    assert r["active"] == 4 and sorted(r["running"]) == sorted(ids[:2])
    assert client.post("/v1/rounds", headers=H_ALICE).status_code == 403
    cluster = client.get("/v1/cluster", headers=H_ALICE).json()
    assert cluster["gpus"] == {"total": 8, "used": 8}
    assert len(cluster["nodes"]) == 2 and sum(n["gpus"] for n in cluster["nodes"]) == 8
    assert cluster["cache"]["used"] == 143e9 and cluster["cache"]["total"] == 200e9
    assert cluster["jobs"] == {"running": 2, "queued": 2}
    alice_alloc = client.get("/v1/allocations", headers=H_ALICE).json()
    assert {a["job_id"] for a in alice_alloc["jobs"]} == set(ids)  # bob's job is not shown to alice
    admin_alloc = client.get("/v1/allocations", headers=H_ADMIN).json()
    assert {a["job_id"] for a in admin_alloc["jobs"]} == {*ids, bob}
    alice_ds = client.get("/v1/datasets/imagenet", headers=H_ALICE).json()
    bob_ds = client.get("/v1/datasets/imagenet", headers=H_BOB).json()
    assert alice_ds["key"] != bob_ds["key"]  # two tenants' "imagenet" never share a cache
    assert [(c["owner"], c["key"]) for c in admin_alloc["cache"]] == [("alice", alice_ds["key"]), ("bob", bob_ds["key"])]
    assert sum(c["bytes"] for c in admin_alloc["cache"]) <= 200e9
    assert [c["owner"] for c in alice_alloc["cache"]] == ["alice"]  # bob's dataset is not alice's to see
    assert client.get("/v1/allocations/history", headers=H_ALICE).status_code == 403
    hist = client.get("/v1/allocations/history", params={"subject": alice_ds["key"]}, headers=H_ADMIN).json()
    alice_cache = next(c["bytes"] for c in admin_alloc["cache"] if c["owner"] == "alice")
    assert hist[0]["resource"] == "cache" and hist[0]["new_value"] == alice_cache
    metrics = client.get("/metrics").text
    assert 'silod_jobs{state="running"} 2.0' in metrics
    assert "silod_gpus_allocated 8.0" in metrics and "silod_gpus_total 8.0" in metrics


def test_concurrent_submissions_over_http(db_url, tmp_path) -> None:
    app, service = make_app(db_url, tmp_path)
    with ServerThread(app) as server:
        for h in (H_ALICE, H_BOB):
            assert httpx.post(f"{server.url}/v1/datasets", json=IMAGENET, headers=h).status_code == 201
        results: list[int] = []
        ids: list[str] = []
        lock = threading.Lock()

        def worker(w: int) -> None:
            with httpx.Client(base_url=server.url, headers=H_ALICE if w % 2 else H_BOB, timeout=60) as c:
                for i in range(20):
                    r = c.post("/v1/jobs", json={**JOB, "name": f"w{w}-{i}", "gpus": 1})
                    with lock:
                        results.append(r.status_code)
                        if r.status_code == 201:
                            ids.append(r.json()["id"])

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert results.count(201) == 200, sorted(set(results))
        with httpx.Client(base_url=server.url, headers=H_ADMIN) as c:
            listed = c.get("/v1/jobs", params={"limit": 10_000}).json()
            assert sorted(j["id"] for j in listed) == sorted(ids) and len(set(ids)) == 200
            assert len(httpx.get(f"{server.url}/v1/jobs", headers=H_ALICE).json()) == 100
    service.close()


def test_overview_says_a_job_waits_for_its_tenants_quota(tmp_path) -> None:
    """GPUs are free, but alice's quota allows 4: her second 4-GPU job waits, and the overview
    (web view, silod top) says it is her quota, not the cluster, that holds it."""
    from scheduler.service.overview import QUOTA_REASON

    app, service = make_app(f"sqlite:///{tmp_path / 'api.db'}", tmp_path, run_loop=False)
    with TestClient(app) as c:
        assert c.post("/v1/datasets", json=IMAGENET, headers=H_ALICE).status_code == 201
        assert c.put("/v1/quotas/alice", json={"gpus": 4}, headers=H_ADMIN).status_code == 200
        ids = [c.post("/v1/jobs", json={**JOB, "name": f"j{i}"}, headers=H_ALICE).json()["id"] for i in range(2)]
        assert c.post("/v1/rounds", headers=H_ADMIN).status_code == 200
        o = c.get("/v1/overview", headers=H_ALICE).json()
        assert [j["id"] for j in o["running"]] == ids[:1]
        assert [(q["id"], q["position"], q["reason"]) for q in o["queue"]] == [(ids[1], 1, QUOTA_REASON)]
        assert o["gpus_total"] - o["gpus_used"] >= 4  # the cluster had room
    service.close()
