"""The Python SDK (silod_client) against a real `silod serve`: every public route of its OpenAPI
document has a client method, every response field a typed one; a tenant's whole round trip;
errors carry the API's status, message and field; retries keep to the retry-safe calls (under
one Idempotency-Key) and honour Retry-After; the CLI's REST commands go through it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from silod_client import Client, models as m
from silod_client.client import ROUTES
from silod_client.errors import BadRequest, Conflict, Forbidden, NotFound, ServerError, TransportError, Unauthorized

try:
    from sdk_helpers import ADMIN_TOKEN, Misbehaving, Served, free_port, jbody
except ImportError:  # run from the repository root as tests.test_sdk
    from tests.sdk_helpers import ADMIN_TOKEN, Misbehaving, Served, free_port, jbody


@pytest.fixture(scope="module")
def served(tmp_path_factory):  # type: ignore[no-untyped-def]
    s = Served(tmp_path_factory.mktemp("sdk"))
    yield s
    s.stop()


#: The server's response schemas and the client's models for them.
MODELS = {
    "JobOut": m.Job, "DatasetOut": m.Dataset, "MeasuredParamsOut": m.MeasuredParameters, "MeasuredOut": m.Measured,
    "BottleneckOut": m.Bottleneck, "AccessOut": m.Access, "CredentialOut": m.Credential, "TokenOut": m.Token,
    "NewTokenOut": m.NewToken, "QuotaOut": m.Quota, "ClusterOut": m.Cluster, "NodeOut": m.Node, "UsageOut": m.Usage,
    "AllocationsOut": m.Allocations, "JobAllocationOut": m.JobAllocation, "CacheAllocationOut": m.CacheAllocation,
    "ChangeOut": m.Change, "PolicyOut": m.Policy, "RoundOut": m.Round, "ConsumptionOut": m.ConsumptionResult,
    "IgnoredOut": m.IgnoredPod, "HealthOut": m.Health, "ReadyOut": m.Ready, "Overview": m.Overview,
    "QueuedJob": m.QueuedJob, "RunningJob": m.RunningJob, "DatasetRow": m.DatasetCache,
}


def test_every_route_of_a_real_server_has_a_client_method(served: Served) -> None:
    doc = httpx.get(f"{served.url}/openapi.json", timeout=30).json()
    routes = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    assert len(routes) >= 30, sorted(routes)
    missing = sorted(r for r in routes if r not in ROUTES)
    assert not missing, f"routes without a client method: {missing}"
    stale = sorted(r for r in ROUTES if r not in routes)
    assert not stale, f"client methods for routes the server does not have: {stale}"
    # Every response field the server declares is a typed field of the client's model.
    schemas = doc["components"]["schemas"]
    for name, model in MODELS.items():
        assert name in schemas, f"{name} is not in the server's schema any more"
        declared = set(schemas[name].get("properties", {}))
        untyped = declared - set(model.model_fields)
        assert not untyped, f"{model.__name__} lacks {sorted(untyped)} of the server's {name}"
    # Every field a request body may carry is a parameter of the method that sends it.
    import inspect

    from silod_client.client import Credentials, Datasets, Jobs, Quotas, Tokens

    for schema, method in (("JobIn", Jobs.submit), ("DatasetIn", Datasets.register), ("QuotaIn", Quotas.set),
                           ("CredentialIn", Credentials.add), ("TokenIn", Tokens.create),
                           ("ClientReportIn", Jobs.report), ("PolicyIn", m_policy_set())):
        fields = set(schemas[schema].get("properties", {}))
        params = set(inspect.signature(method).parameters)
        assert fields <= params, f"{method.__qualname__} cannot send {sorted(fields - params)} of {schema}"
    # Request bodies nested in those (a job's pod template and its scheduling fields): every field
    # the server takes is a field of the client's model of it.
    for schema, model in (("PodTemplateIn", m.PodTemplate), ("TolerationIn", m.Toleration),
                          ("AffinityIn", m.Affinity), ("ResourcesIn", m.Resources)):
        assert schema in schemas, f"{schema} is not in the server's schema any more"
        missing_fields = set(schemas[schema].get("properties", {})) - set(model.model_fields)
        assert not missing_fields, f"silod_client.models.{model.__name__} lacks {sorted(missing_fields)} of {schema}"
    answered = {r.split("/")[-1] for ops in doc["paths"].values() for op in ops.values()
                for resp in op.get("responses", {}).values()
                for r in [json.dumps(resp.get("content", {}))] if "#/components/schemas/" in r}
    assert answered  # the document does name its response models


def m_policy_set():  # type: ignore[no-untyped-def]
    from silod_client.client import PolicyApi

    return PolicyApi.set


def test_a_tenants_round_trip(served: Served) -> None:
    alice = Client(served.url, served.tokens["alice"])
    admin = Client(served.url, ADMIN_TOKEN)
    with alice, admin:
        assert alice.health().status == "ok"
        assert "silod_" in alice.metrics()
        with pytest.raises(Forbidden):
            alice.metrics(per_job=True)
        assert "silod_" in admin.metrics(per_job=True)
        ds = alice.datasets.register("imagenet", "s3://bucket/imagenet", "143GB", item_count=1000)
        assert isinstance(ds, m.Dataset) and ds.size == 143e9 and ds.owner == "alice"
        assert alice.datasets.register("imagenet", "s3://bucket/imagenet", "143GB", item_count=1000) == ds  # idempotent
        for i in range(3):
            alice.datasets.register(f"extra-{i}", f"s3://bucket/extra-{i}", 1e9)
        assert alice.datasets.get("imagenet") == ds
        assert [d.name for d in alice.datasets.list(limit=2, offset=1)] == ["extra-1", "extra-2"]
        assert [d.name for d in alice.datasets.iter(page_size=3)] == ["extra-0", "extra-1", "extra-2", "imagenet"]
        assert alice.datasets.grant("imagenet", "bob").shared_with == ["bob"]
        assert alice.datasets.revoke("imagenet", "bob").shared_with == []

        job = alice.jobs.submit("r50", gpus=2, dataset="imagenet", epochs=2, ideal_throughput="200MB/s",
                                access={"kind": "curriculum", "starting_percent": 0.1, "alpha": 2.0, "step": 100,
                                        "batch": 32},
                                cpu_rate="50MB/s", autocache_expansion=2.0, post_cpu_rate="400MB/s", priority=-1)
        assert isinstance(job, m.Job) and job.state in ("queued", "running") and job.access.kind == "curriculum"
        assert job.ideal_throughput == 200e6 and job.cpu_rate == 50e6 and job.priority == -1
        same = alice.jobs.submit("r50b", gpus=1, dataset="imagenet", steps=100, step_bytes="1MB",
                                 ideal_throughput=1e8, idempotency_key="k-1")
        again = alice.jobs.submit("r50b", gpus=1, dataset="imagenet", steps=100, step_bytes="1MB",
                                  ideal_throughput=1e8, idempotency_key="k-1")
        assert again.id == same.id
        with pytest.raises(Conflict) as exc:
            alice.jobs.submit("other", gpus=1, dataset="imagenet", epochs=1, ideal_throughput=1e8, idempotency_key="k-1")
        assert exc.value.status == 409 and exc.value.field == "Idempotency-Key"
        assert [j.id for j in alice.jobs.list(limit=1, offset=1)] == [same.id]
        assert {j.id for j in alice.jobs.iter(page_size=1)} == {job.id, same.id}

        running = alice.jobs.wait(job.id, states={"running"}, timeout=30, interval=0.2)
        assert running.state == "running" and running.allocated_gpus == 2
        params = alice.jobs.report(job.id, step_seconds=0.5, batch_bytes=50e6)
        assert params.client_ideal_throughput == pytest.approx(100e6)
        seen = []
        for j in alice.jobs.watch(same.id, interval=0.2):
            seen.append(j.state)
            if j.state == "running":
                alice.jobs.cancel(same.id)
        assert seen[-1] == "cancelled"
        assert alice.jobs.cancel(job.id).state == "cancelled"
        with pytest.raises(Conflict):
            alice.jobs.cancel(job.id)
        assert alice.jobs.wait(job.id, timeout=5).done

        ov = alice.overview()
        assert isinstance(ov, m.Overview) and ov.gpus_total == 8
        assert alice.cluster().gpus.total == 8
        assert alice.allocations().policy
        assert alice.policy.get().name in alice.policy.get().available
        assert alice.quotas.get("alice").tenant == "alice"
        cred = alice.credentials.add("minio", access_key_id="AKIA", secret_access_key="s3cr3t",
                                     endpoint_url="https://s3.example.com", region="us-east-1")
        assert cred.name == "minio" and "secret" not in cred.model_dump()
        assert [c.name for c in alice.credentials.list()] == ["minio"]
        alice.credentials.delete("minio")
        assert alice.credentials.list() == []

        # admin routes
        new = admin.tokens.create("carol", label="sdk test", expires_in_s=3600)
        assert new.token and new.owner == "carol"
        assert any(t.id == new.id for t in admin.tokens.list())
        assert admin.tokens.revoke(new.id).revoked_at is not None
        q = admin.quotas.set("alice", gpus=6, cache_bytes="1TB", ideal_per_gpu="2GB/s")
        assert q.gpus == 6 and q.ideal_per_gpu == 2e9
        assert admin.policy.set("sjf").name == "sjf"
        assert admin.run_round().round_id >= 1
        assert admin.allocation_history(limit=5)
        assert admin.ready().status == "ready"
        with pytest.raises(Forbidden) as exc:
            alice.run_round()
        assert exc.value.status == 403 and "admin" in exc.value.detail
        with pytest.raises(Forbidden):
            admin.agents.report_consumption("node-1", [])


def test_errors_carry_status_message_and_field(served: Served) -> None:
    with Client(served.url, served.tokens["bob"]) as bob:
        with pytest.raises(NotFound) as exc:
            bob.jobs.get("999999")
        assert exc.value.status == 404 and "999999" in exc.value.detail and exc.value.field == "job_id"
        with pytest.raises(BadRequest) as exc:
            bob.jobs.submit("x", gpus=1, dataset="nope", epochs=1)  # neither ideal_throughput nor model
        assert exc.value.status == 422 and "ideal_throughput" in exc.value.detail
        with pytest.raises(BadRequest) as exc:
            bob.jobs.submit("x", gpus=1, dataset="nope", epochs=1, ideal_throughput="1GB/s", program={"command": []})
        assert exc.value.status == 422 and "program" in str(exc.value)
        with pytest.raises(NotFound) as exc:
            bob.datasets.get("a/../b")  # one path segment: never resolved to another route
        assert exc.value.status == 404
    with Client(served.url, "not-a-token-at-all") as nobody, pytest.raises(Unauthorized) as exc:
        nobody.jobs.list()
    assert exc.value.status == 401
    port = free_port()  # nothing listens there
    with Client(f"http://127.0.0.1:{port}", "t", retries=1, backoff=0.01) as gone, pytest.raises(TransportError):
        gone.jobs.list()
    for bad in ("localhost:8080", "ftp://x", "http://"):
        with pytest.raises(ValueError, match="url"):
            Client(bad, "t")
    with pytest.raises(ValueError, match="token"):
        Client(served.url, "bad\ntoken")


JOB = {"id": "7", "name": "j", "owner": "alice", "gpus": 1, "dataset": "d", "dataset_owner": "alice",
       "ideal_throughput": 1.0, "total_bytes": 1.0, "consumed_bytes": 0.0, "remaining_bytes": 1.0, "priority": 0,
       "state": "queued", "submit_time": 0.0, "allocated_gpus": 0, "gpu_share": 0.0, "access": {"kind": "epoch"}}


def test_retries_are_for_retry_safe_calls_under_one_idempotency_key() -> None:
    answers = iter([(503, {"Retry-After": "0"}, jbody({"detail": "database unavailable"}), 0.0),
                    (201, {}, jbody(JOB), 0.0)])
    srv = Misbehaving(lambda *_: next(answers))
    try:
        with Client(srv.url, "t", backoff=0.01) as c:
            assert c.jobs.submit("j", gpus=1, dataset="d", epochs=1, ideal_throughput=1).id == "7"
        keys = [h.get("idempotency-key") for _m, _p, h, _b in srv.requests]
        assert len(keys) == 2 and keys[0] and keys[0] == keys[1]
        assert json.loads(srv.requests[0][3]) == json.loads(srv.requests[1][3])
    finally:
        srv.close()

    srv = Misbehaving(lambda *_: (503, {"Retry-After": "0"}, jbody({"detail": "database unavailable"}), 0.0))
    try:
        with Client(srv.url, "t", retries=2, backoff=0.01) as c:
            with pytest.raises(ServerError) as exc:
                c.jobs.cancel("7")  # not retry-safe: one request only
            assert exc.value.status == 503 and exc.value.retry_after == 0 and len(srv.requests) == 1
            with pytest.raises(ServerError):
                c.jobs.get("7")  # retry-safe: 1 + 2 retries
            assert len(srv.requests) == 4
    finally:
        srv.close()

    srv = Misbehaving(lambda *_: (200, {}, jbody(JOB), 2.0))  # answers after 2 s
    try:
        with Client(srv.url, "t", timeout=0.3, retries=0) as c:
            t0 = time.monotonic()
            with pytest.raises(TransportError, match="in time"):
                c.jobs.get("7")
            assert time.monotonic() - t0 < 1.5
    finally:
        srv.close()


def test_the_cli_rest_commands_use_the_sdk(served: Served, tmp_path: Path) -> None:
    import subprocess

    try:
        from sdk_helpers import SILOD, clean_env
    except ImportError:
        from tests.sdk_helpers import SILOD, clean_env

    env = clean_env(SILOD_SERVER=served.url, SILOD_TOKEN=served.tokens["bob"])
    run = lambda *a: subprocess.run([*SILOD, *a], env=env, capture_output=True, text=True, timeout=60)  # noqa: E731
    r = run("dataset-add", "bobs", "--uri", "s3://b/bobs", "--size", "10GB")
    assert r.returncode == 0 and r.stdout.strip() == "bobs 10000000000 bytes", r.stderr
    r = run("submit", "--name", "p", "--gpus", "1", "--dataset", "bobs", "--epochs", "1", "--ideal-throughput", "1GB/s",
            "--program", "python train.py --epochs 1")
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    rows = json.loads(run("jobs", "--json").stdout)
    assert [j["id"] for j in rows] == [job_id]
    assert run("cancel", job_id).stdout.strip() == f"{job_id} cancelled"
    r = run("cancel", job_id)
    assert r.returncode == 2 and "HTTP 409" in r.stderr
    r = run("submit", "--name", "p", "--gpus", "1", "--dataset", "bobs", "--epochs", "1", "--ideal-throughput", "1GB/s",
            "--program", "'unclosed")
    assert r.returncode == 2 and "--program" in r.stderr
