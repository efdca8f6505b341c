"""Attacks on the REST service, each a test: bodies without a token, oversized bodies, revoked
and expired tokens, tokens at rest, cross-tenant access to every object, dataset URIs that would
make the data path a confused deputy, quota abuse, idempotency-key reuse.

Fast tests use TestClient; the body tests use a real uvicorn server on 127.0.0.1 and a raw
socket, because only there can one send headers and withhold the body."""

from __future__ import annotations

import hashlib
import json
import socket
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from scheduler.service.api.server import ServerThread
from scheduler.service.db.models import ApiToken

try:
    from test_api import ADMIN_TOKEN, H_ADMIN, H_ALICE, H_BOB, IMAGENET, JOB, TOKENS, make_app
except ImportError:
    from tests.test_api import ADMIN_TOKEN, H_ADMIN, H_ALICE, H_BOB, IMAGENET, JOB, TOKENS, make_app


@pytest.fixture
def app_service(tmp_path):  # type: ignore[no-untyped-def]
    app, service = make_app(f"sqlite:///{tmp_path / 'sec.db'}", tmp_path, run_loop=False)
    yield app, service
    service.close()


@pytest.fixture
def client(app_service) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    with TestClient(app_service[0]) as c:
        yield c


def _raw(port: int, head: str, body: bytes = b"", read_timeout: float = 5.0) -> tuple[int, bytes, float]:
    """Send `head` (and `body`), return (status, response bytes, seconds to the answer)."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as sock:
        sock.sendall(head.encode() + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        elapsed = time.perf_counter() - t0
        with_body = data
        try:
            sock.settimeout(1.0)
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                with_body += chunk
        except OSError:
            pass
    return int(data.split(b" ", 2)[1]), with_body, elapsed


# ------------------------------------------------------------------ authentication before the body


def test_200mb_body_without_token_is_401_before_the_body_is_read(app_service) -> None:  # type: ignore[no-untyped-def]
    app, _service = app_service
    with ServerThread(app) as server:
        # Headers announce 200 MB; we send none of it. The answer must come anyway: the server
        # decided from the headers alone and never waited for (or buffered) the body.
        head = ("POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {200 * 1024 * 1024}\r\n\r\n")
        status, data, elapsed = _raw(server.port, head)
        assert status == 401 and b"bearer" in data.lower() and elapsed < 3
        # The same with a valid token: 413 from the Content-Length, still without the body.
        head = head.replace("Host: x\r\n", f"Host: x\r\nAuthorization: Bearer {TOKENS['alice']}\r\n")
        status, data, elapsed = _raw(server.port, head)
        assert status == 413 and b"larger than" in data and elapsed < 3


def test_streamed_body_over_the_cap_is_413_without_buffering_it(app_service) -> None:  # type: ignore[no-untyped-def]
    app, _service = app_service
    with ServerThread(app) as server:
        # Chunked: no Content-Length to refuse up front; the guard counts and stops at the cap.
        chunk = b"x" * 65536
        body = b"".join(b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(32)) + b"0\r\n\r\n"  # 2 MiB
        head = ("POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {TOKENS['alice']}\r\nTransfer-Encoding: chunked\r\n\r\n")
        status, data, _ = _raw(server.port, head, body)
        assert status == 413, data[:300]
        # Under the cap, a chunked body is read normally (here: invalid JSON -> 4xx, not 413).
        small = b"%x\r\n" % 5 + b"{bad}" + b"\r\n0\r\n\r\n"
        status, _, _ = _raw(server.port, head, small)
        assert status in (400, 422)


def test_bad_token_401_good_token_without_the_right_403(client: TestClient) -> None:
    for headers in ({}, {"Authorization": "Bearer nope-nope-nope"}, {"Authorization": "Basic YWxpY2U6eA=="},
                    {"Authorization": "Bearer"}):
        r = client.post("/v1/rounds", headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert client.get("/v1/no-such-route", headers=headers).status_code == 401  # routes are not probed anonymously
    for path, method in (("/v1/rounds", "POST"), ("/v1/tokens", "GET"), ("/v1/allocations/history", "GET")):
        assert client.request(method, path, headers=H_ALICE).status_code == 403
    assert client.put("/v1/quotas/alice", json={"gpus": 100}, headers=H_ALICE).status_code == 403
    assert client.post("/v1/tokens", json={"owner": "alice", "admin": True}, headers=H_ALICE).status_code == 403


def test_tokens_are_stored_hashed_with_a_server_key(client: TestClient, app_service) -> None:  # type: ignore[no-untyped-def]
    _, service = app_service
    created = client.post("/v1/tokens", json={"owner": "carol", "label": "ci"}, headers=H_ADMIN)
    assert created.status_code == 201
    token = created.json()["token"]
    with service.engine.connect() as conn:
        rows = conn.execute(sa.select(ApiToken.digest, ApiToken.owner, ApiToken.label)).all()
    stored = {d for d, *_ in rows}
    everything = repr(rows)
    for plain in (token, *TOKENS.values()):
        assert plain not in everything
        assert hashlib.sha256(plain.encode()).hexdigest() not in stored  # keyed HMAC, not a bare hash
    assert "token" not in client.get("/v1/tokens", headers=H_ADMIN).json()[0]


def test_token_created_revoked_and_expired_without_restart(client: TestClient) -> None:
    r = client.post("/v1/tokens", json={"owner": "carol"}, headers=H_ADMIN).json()
    h_carol = {"Authorization": f"Bearer {r['token']}"}
    assert client.post("/v1/datasets", json=IMAGENET, headers=h_carol).json()["owner"] == "carol"
    assert client.delete(f"/v1/tokens/{r['id']}", headers=H_ADMIN).json()["revoked_at"] is not None
    assert client.get("/v1/jobs", headers=h_carol).status_code == 401  # at once in the revoking process
    # A file token revoked through the API stays revoked.
    listed = client.get("/v1/tokens", headers=H_ADMIN).json()
    bob_id = next(t["id"] for t in listed if t["owner"] == "bob")
    client.delete(f"/v1/tokens/{bob_id}", headers=H_ADMIN)
    assert client.get("/v1/jobs", headers=H_BOB).status_code == 401
    # Expiry.
    r = client.post("/v1/tokens", json={"owner": "dave", "expires_in_s": 1}, headers=H_ADMIN).json()
    h_dave = {"Authorization": f"Bearer {r['token']}"}
    assert client.get("/v1/jobs", headers=h_dave).status_code == 200
    time.sleep(1.1)
    assert client.get("/v1/jobs", headers=h_dave).status_code == 401
    # An admin token from the API is an admin.
    r = client.post("/v1/tokens", json={"owner": "ops", "admin": True}, headers=H_ADMIN).json()
    assert client.get("/v1/tokens", headers={"Authorization": f"Bearer {r['token']}"}).status_code == 200


def test_revoked_file_token_stays_revoked_after_restart(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    app, service = make_app(url, tmp_path, run_loop=False)
    with TestClient(app) as c:
        bob_id = next(t["id"] for t in c.get("/v1/tokens", headers=H_ADMIN).json() if t["owner"] == "bob")
        c.delete(f"/v1/tokens/{bob_id}", headers=H_ADMIN)
    service.close()
    app, service = make_app(url, tmp_path, run_loop=False)  # imports the same tokens file again
    with TestClient(app) as c:
        assert c.get("/v1/jobs", headers=H_BOB).status_code == 401
        assert c.get("/v1/jobs", headers=H_ALICE).status_code == 200
    service.close()


def test_revocation_reaches_another_process_within_the_cache_ttl(tmp_path) -> None:
    """Two API workers on one database: a token revoked through one stops working on the other
    within the token cache's TTL, without a restart."""
    url = f"sqlite:///{tmp_path / 'two.db'}"
    app1, s1 = make_app(url, tmp_path, run_loop=False)
    app2, s2 = make_app(url, tmp_path, run_loop=False)
    app2.state.tokens.cache_ttl_s = 0.2
    with TestClient(app1) as c1, TestClient(app2) as c2:
        tok = c1.post("/v1/tokens", json={"owner": "erin"}, headers=H_ADMIN).json()
        h = {"Authorization": f"Bearer {tok['token']}"}
        assert c2.get("/v1/jobs", headers=h).status_code == 200
        c1.delete(f"/v1/tokens/{tok['id']}", headers=H_ADMIN)
        time.sleep(0.3)
        assert c2.get("/v1/jobs", headers=h).status_code == 401
    s1.close()
    s2.close()


def test_metrics_can_be_protected(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SILOD_METRICS_TOKEN", "scrape-token-123")
    app, service = make_app(f"sqlite:///{tmp_path / 'm.db'}", tmp_path, run_loop=False)
    with TestClient(app) as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers=H_ALICE).status_code == 403  # a user token is not a scrape token
        assert c.get("/metrics", headers={"Authorization": "Bearer scrape-token-123"}).status_code == 200
        assert c.get("/v1/jobs", headers={"Authorization": "Bearer scrape-token-123"}).status_code == 401
        assert c.get("/metrics", headers=H_ADMIN).status_code == 200
        assert c.get("/healthz").status_code == 200
    service.close()


def test_an_anonymous_scrape_gets_cluster_totals_and_no_tenant_names(client: TestClient) -> None:
    """Issue 20 review: with SILOD_METRICS_TOKEN unset an anonymous GET /metrics listed every
    tenant's name, job names, dataset names and storage keys (what /v1/cluster hides from other
    tenants). Now the totals only; the per-job series need the admin's (or the metrics) token."""
    assert client.post("/v1/datasets", json=IMAGENET, headers=H_ALICE).status_code == 201
    assert client.post("/v1/jobs", json={**JOB, "name": "secret-project-x"}, headers=H_ALICE).status_code == 201
    anonymous = client.get("/metrics")
    assert anonymous.status_code == 200
    for name in ("alice", "secret-project-x", "imagenet", "silod_job_", "silod_dataset_"):
        assert name not in anonymous.text, name
    assert "silod_queue_length 1.0" in anonymous.text and "silod_gpus_total" in anonymous.text
    full = client.get("/metrics", headers=H_ADMIN).text
    assert 'name="secret-project-x"' in full and 'tenant="alice"' in full and "silod_queue_length 1.0" in full
    refused = client.get("/metrics", headers=H_BOB)  # a tenant's token does not open the others' series
    assert refused.status_code == 403 and "admin" in refused.json()["detail"]
    assert client.get("/metrics", headers={"Authorization": "Bearer not-a-token"}).status_code == 401


def test_a_control_character_in_the_path_is_a_400_not_a_way_around_the_guard(app_service) -> None:  # type: ignore[no-untyped-def]
    """Issue 20, outside review: GET /metrics%0a with a tenant's token answered 200 with every
    tenant's per-job series. The guard compared `path == "/metrics"`, while the route's regex
    `^/metrics$` also matches "/metrics\n" (Python's `$` matches before a trailing newline).
    Real server, raw request line, so the client library cannot normalise the path."""
    app, service = app_service
    with TestClient(app) as c:
        assert c.post("/v1/datasets", json=IMAGENET, headers=H_ALICE).status_code == 201
        assert c.post("/v1/jobs", json={**JOB, "name": "secret-project-x"}, headers=H_ALICE).status_code == 201
    with ServerThread(app) as server:
        def get(path: str, token: str) -> tuple[int, bytes]:
            status, data, _ = _raw(server.port, f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}"
                                                "\r\nConnection: close\r\n\r\n")
            return status, data

        assert get("/metrics", TOKENS["bob"])[0] == 403
        for path in ("/metrics%0a", "/metrics%0A", "/metrics%0d%0a", "/metrics%00", "/metrics%09", "/metrics%7f",
                     "/v1/tokens%0a", "/v1/jobs%0a"):
            status, data = get(path, TOKENS["bob"])
            assert status == 400, (path, status, data[-300:])
            assert b"secret-project-x" not in data and b"alice" not in data and b"control character" in data, path
        # Anonymous too: refused before the token is looked at.
        status, data, _ = _raw(server.port, "GET /healthz%0a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status == 400
        # Encoded characters that are not control characters still reach their routes.
        assert get("/v1/datasets/imagenet%20x", TOKENS["alice"])[0] == 404
        assert get("/metrics", ADMIN_TOKEN)[0] == 200


def test_a_trailing_slash_is_a_404_not_a_redirect_to_the_host_header(client: TestClient) -> None:
    """Issue 20 review: GET /v1/jobs/ answered 307 with Location http://evil.example/v1/jobs when
    sent with Host: evil.example (Starlette's slash redirect builds it from the Host header)."""
    r = client.get("/v1/jobs/", headers={**H_ALICE, "Host": "evil.example"}, follow_redirects=False)
    assert r.status_code == 404 and "location" not in r.headers, (r.status_code, r.headers)
    assert client.get("/v1/jobs", headers=H_ALICE).status_code == 200
    assert client.get("/ui/").status_code == 200  # the web view answers with and without the slash


# ------------------------------------------------------------------ tenancy: every object, two tenants


def test_cross_tenant_access_to_every_object(client: TestClient) -> None:
    assert client.post("/v1/datasets", json=IMAGENET, headers=H_ALICE).status_code == 201
    job = client.post("/v1/jobs", json=JOB, headers=H_ALICE).json()
    jid = job["id"]
    # Jobs: invisible, uncancellable.
    assert client.get(f"/v1/jobs/{jid}", headers=H_BOB).status_code == 404
    assert client.delete(f"/v1/jobs/{jid}", headers=H_BOB).status_code == 404
    assert client.get("/v1/jobs", headers=H_BOB).json() == []
    assert client.get("/v1/jobs", params={"owner": "alice"}, headers=H_BOB).json() == []  # owner= is admin only
    # Datasets: invisible, unusable, not grantable by someone else.
    assert client.get("/v1/datasets", headers=H_BOB).json() == []
    assert client.get("/v1/datasets/imagenet", headers=H_BOB).status_code == 404
    assert client.get("/v1/datasets/imagenet", params={"owner": "alice"}, headers=H_BOB).status_code == 404
    r = client.post("/v1/jobs", json={**JOB, "dataset_owner": "alice"}, headers=H_BOB)
    assert r.status_code == 404 and r.json()["field"] == "dataset"
    assert client.post("/v1/jobs", json=JOB, headers=H_BOB).status_code == 404  # bob has no "imagenet"
    assert client.put("/v1/datasets/imagenet/grants/bob", params={"owner": "alice"}, headers=H_BOB).status_code == 404
    # Allocations and quotas of another tenant.
    client.post("/v1/rounds", headers=H_ADMIN)
    bob_alloc = client.get("/v1/allocations", headers=H_BOB).json()
    assert bob_alloc["jobs"] == [] and bob_alloc["cache"] == []
    assert client.get("/v1/quotas/alice", headers=H_BOB).status_code == 404
    # Names are per tenant: bob registers his own "imagenet" with another URI; alice's is unchanged.
    mine = client.post("/v1/datasets", json={**IMAGENET, "uri": "s3://bob-bucket/imagenet"}, headers=H_BOB)
    assert mine.status_code == 201
    assert client.get("/v1/datasets/imagenet", headers=H_ALICE).json()["uri"] == IMAGENET["uri"]
    assert mine.json()["key"] != client.get("/v1/datasets/imagenet", headers=H_ALICE).json()["key"]
    # The admin sees all.
    assert client.get(f"/v1/jobs/{jid}", headers=H_ADMIN).status_code == 200
    assert len(client.get("/v1/datasets", headers=H_ADMIN).json()) == 2


def test_dataset_shared_only_by_explicit_grant(client: TestClient) -> None:
    client.post("/v1/datasets", json=IMAGENET, headers=H_ALICE)
    shared = {**JOB, "dataset_owner": "alice"}
    assert client.post("/v1/jobs", json=shared, headers=H_BOB).status_code == 404
    r = client.put("/v1/datasets/imagenet/grants/bob", headers=H_ALICE)
    assert r.status_code == 200 and r.json()["shared_with"] == ["bob"]
    assert client.get("/v1/datasets/imagenet", params={"owner": "alice"}, headers=H_BOB).status_code == 200
    assert [d["owner"] for d in client.get("/v1/datasets", headers=H_BOB).json()] == ["alice"]
    # Whom alice shares with is hers to see: bob, a grantee, sees his own grant only.
    assert client.put("/v1/datasets/imagenet/grants/carol", headers=H_ALICE).json()["shared_with"] == ["bob", "carol"]
    assert client.get("/v1/datasets/imagenet", params={"owner": "alice"}, headers=H_BOB).json()["shared_with"] == ["bob"]
    assert [d["shared_with"] for d in client.get("/v1/datasets", headers=H_BOB).json()] == [["bob"]]
    assert client.get("/v1/datasets/imagenet", params={"owner": "alice"}, headers=H_ADMIN).json()["shared_with"] == ["bob", "carol"]
    job = client.post("/v1/jobs", json=shared, headers=H_BOB)
    assert job.status_code == 201 and job.json()["owner"] == "bob" and job.json()["dataset_owner"] == "alice"
    # The grantee can neither re-share nor revoke.
    assert client.put("/v1/datasets/imagenet/grants/carol", params={"owner": "alice"}, headers=H_BOB).status_code == 404
    assert client.delete("/v1/datasets/imagenet/grants/bob", params={"owner": "alice"}, headers=H_BOB).status_code == 404
    assert client.delete("/v1/datasets/imagenet/grants/bob", headers=H_ALICE).status_code == 200
    assert client.post("/v1/jobs", json=shared, headers=H_BOB).status_code == 404
    # bob's job, queued and never started, fails: it would have started later and read alice's
    # data with her credential (it stayed queued; issue 20 review).
    failed = client.get(f"/v1/jobs/{job.json()['id']}", headers=H_BOB).json()
    assert failed["state"] == "failed" and "alice revoked the grant" in failed["message"], failed


def test_a_revoked_grant_fails_the_grantees_unstarted_jobs_and_keeps_the_started(app_service, client: TestClient) -> None:
    _app, service = app_service
    client.post("/v1/datasets", json=IMAGENET, headers=H_ALICE)
    client.put("/v1/datasets/imagenet/grants/bob", headers=H_ALICE)
    shared = {**JOB, "dataset_owner": "alice"}
    started = client.post("/v1/jobs", json=shared, headers=H_BOB).json()["id"]
    service.run_round("test")
    assert client.get(f"/v1/jobs/{started}", headers=H_BOB).json()["state"] == "running"
    waiting = client.post("/v1/jobs", json={**shared, "gpus": service.config.capacity.gpus}, headers=H_BOB).json()["id"]
    own = client.post("/v1/jobs", json={**JOB, "name": "alices"}, headers=H_ALICE).json()["id"]
    assert client.delete("/v1/datasets/imagenet/grants/bob", headers=H_ALICE).status_code == 200
    assert client.get(f"/v1/jobs/{started}", headers=H_BOB).json()["state"] == "running"
    assert client.get(f"/v1/jobs/{waiting}", headers=H_BOB).json()["state"] == "failed"
    assert client.get(f"/v1/jobs/{own}", headers=H_ALICE).json()["state"] == "queued"  # the owner's own jobs are hers
    service.run_round("test")
    assert client.get(f"/v1/jobs/{waiting}", headers=H_BOB).json()["state"] == "failed"


def test_credentials_are_per_tenant_and_never_returned(client: TestClient) -> None:
    cred = {"name": "prod", "access_key_id": "AKIAALICE", "secret_access_key": "alice-secret-key"}
    r = client.post("/v1/credentials", json=cred, headers=H_ALICE)
    assert r.status_code == 201 and "secret" not in r.text
    assert "alice-secret-key" not in client.get("/v1/credentials", headers=H_ALICE).text
    assert client.get("/v1/credentials", headers=H_BOB).json() == []
    # Bob cannot name alice's credential for his dataset.
    r = client.post("/v1/datasets", json={**IMAGENET, "credential": "prod"}, headers=H_BOB)
    assert r.status_code == 404 and r.json()["field"] == "credential"
    r = client.post("/v1/datasets", json={**IMAGENET, "credential": "prod"}, headers=H_ALICE)
    assert r.status_code == 201 and r.json()["credential"] == "prod"
    # Endpoints follow the URI allow-list: no loopback or metadata service.
    for endpoint in ("http://127.0.0.1:9000", "https://169.254.169.254", "http://example.com"):
        r = client.post("/v1/credentials", json={**cred, "name": "x", "endpoint_url": endpoint}, headers=H_ALICE)
        assert r.status_code == 400 and r.json()["field"] == "endpoint_url", endpoint
    # Keys become a job's environment variables and request headers: a NUL or a line break was
    # stored (201) and would only fail the job's start.
    for field, value in (("access_key_id", "AKIA\u0000X"), ("secret_access_key", "s\r\nX-Injected: y")):
        r = client.post("/v1/credentials", json={**cred, "name": "y", field: value}, headers=H_ALICE)
        assert r.status_code == 422 and field in r.text, (field, r.text)
    assert [c["name"] for c in client.get("/v1/credentials", headers=H_ALICE).json()] == ["prod"]


# ------------------------------------------------------------------ dataset URIs


@pytest.mark.parametrize(
    ("uri", "rule"),
    [
        ("file:///etc", "not allowed"),
        ("file:///etc/shadow", "not allowed"),
        ("/etc/passwd", "local path"),
        ("etc/passwd", "local path"),
        ("http://127.0.0.1:8080/", "loopback"),
        ("https://127.0.0.1/x", "loopback"),
        ("https://localhost/x", "loopback"),
        ("https://[::1]/x", "loopback"),
        ("https://[::ffff:127.0.0.1]/x", "loopback"),
        ("https://169.254.169.254/latest/meta-data/", "link-local"),
        ("https://0.0.0.0/x", "unspecified"),
        ("http://example.com/data/", "not allowed"),  # plain http is off by default
        ("s3://bucket/../other", "'..'"),
        ("s3://bucket/%2e%2e/other", "'..'"),
        ("https://user:pw@example.com/x", "credentials"),
        ("gs://bucket/x", "not allowed"),
        ("s3://[bucket", "not a valid URI"),  # found by the fuzzer: urlsplit raises on it
        ("https://example.com:99999/x", "not a valid URI"),
    ],
)
def test_dataset_uri_allow_list(client: TestClient, uri: str, rule: str) -> None:
    r = client.post("/v1/datasets", json={**IMAGENET, "uri": uri}, headers=H_ALICE)
    assert r.status_code in (400, 422), r.text
    if r.status_code == 400:
        assert r.json()["field"] == "uri" and rule in r.json()["detail"], r.text
    assert client.get("/v1/datasets", headers=H_ALICE).json() == []


def test_operator_widens_the_allow_list(tmp_path) -> None:
    app, service = make_app(f"sqlite:///{tmp_path / 'w.db'}", tmp_path, run_loop=False,
                            allowed_uris=["s3", "file:///srv/datasets/", "http://minio.local:9000/"])
    with TestClient(app) as c:
        ok = ["s3://b/x", "file:///srv/datasets/imagenet", "http://minio.local:9000/bucket/x"]
        for i, uri in enumerate(ok):
            assert c.post("/v1/datasets", json={**IMAGENET, "name": f"d{i}", "uri": uri}, headers=H_ALICE).status_code == 201
        for uri in ("file:///srv/datasets-other/x", "file:///srv/datasets/../../etc", "https://example.com/x"):
            assert c.post("/v1/datasets", json={**IMAGENET, "name": "bad", "uri": uri}, headers=H_ALICE).status_code == 400
    service.close()


# ------------------------------------------------------------------ quotas, priority, idempotency


def test_quota_at_submission_names_the_limit(client: TestClient) -> None:
    client.post("/v1/datasets", json=IMAGENET, headers=H_ALICE)
    assert client.put("/v1/quotas/alice", json={"gpus": 2, "queued_jobs": 5}, headers=H_ADMIN).status_code == 200
    r = client.post("/v1/jobs", json=JOB, headers=H_ALICE)  # 4 GPUs > 2
    assert r.status_code == 403 and r.json()["field"] == "gpus" and "quota" in r.json()["detail"]
    codes = [client.post("/v1/jobs", json={**JOB, "gpus": 1, "name": f"j{i}"}, headers=H_ALICE).status_code for i in range(8)]
    assert codes == [201] * 5 + [429] * 3
    r = client.post("/v1/jobs", json={**JOB, "gpus": 1, "name": "more"}, headers=H_ALICE)
    assert r.json()["field"] == "queued_jobs"
    assert len(client.get("/v1/jobs", headers=H_ALICE).json()) == 5
    # Bob is not limited by alice's quota.
    client.post("/v1/datasets", json=IMAGENET, headers=H_BOB)
    assert client.post("/v1/jobs", json=JOB, headers=H_BOB).status_code == 201


def test_10k_jobs_from_one_tenant_over_quota(tmp_path) -> None:
    from scheduler.service.types import TenantQuota

    app, service = make_app(f"sqlite:///{tmp_path / 'q.db'}", tmp_path, run_loop=False,
                            default_quota=TenantQuota(queued_jobs=100))
    with TestClient(app) as c:
        c.post("/v1/datasets", json=IMAGENET, headers=H_ALICE)
        codes: dict[int, int] = {}
        for i in range(10_000):
            code = c.post("/v1/jobs", json={**JOB, "gpus": 1, "name": f"j{i}"}, headers=H_ALICE).status_code
            codes[code] = codes.get(code, 0) + 1
            if i > 300 and codes.get(429, 0) > 200:
                break  # the pattern is established; the rest would only cost test time
        assert codes[201] == 100 and set(codes) == {201, 429}
        assert len(c.get("/v1/jobs", params={"limit": 10_000}, headers=H_ADMIN).json()) == 100
    service.close()


def test_round_keeps_each_tenant_within_its_quota_and_priority_orders_its_jobs(client: TestClient) -> None:
    for h in (H_ALICE, H_BOB):
        client.post("/v1/datasets", json=IMAGENET, headers=h)
    client.put("/v1/quotas/alice", json={"gpus": 3, "running_jobs": 2}, headers=H_ADMIN)
    # A user may lower a job's priority (above 0 is the admin's, docs/service.md): the newer job
    # at the default 0 goes before alice's older ones at -1.
    low = [client.post("/v1/jobs", json={**JOB, "gpus": 1, "name": f"a{i}", "priority": -1}, headers=H_ALICE).json()["id"] for i in range(3)]
    high = client.post("/v1/jobs", json={**JOB, "gpus": 1, "name": "urgent"}, headers=H_ALICE).json()["id"]
    r = client.post("/v1/rounds", headers=H_ADMIN).json()
    assert set(r["running"]) == {high, low[0]}  # 8 GPUs free, but alice may hold 2 jobs; priority first
    bob = client.post("/v1/jobs", json={**JOB, "gpus": 4, "name": "b"}, headers=H_BOB).json()["id"]
    r = client.post("/v1/rounds", headers=H_ADMIN).json()
    assert bob in r["running"] and sum(1 for j in r["running"] if j != bob) == 2
    # Lowering the quota preempts down to it.
    client.put("/v1/quotas/alice", json={"gpus": 1}, headers=H_ADMIN)
    r = client.post("/v1/rounds", headers=H_ADMIN).json()
    alice_running = [j for j in r["running"] if j != bob]
    assert len(alice_running) == 1
    jobs = {j["id"]: j for j in client.get("/v1/jobs", headers=H_ALICE).json()}
    assert sum(j["allocated_gpus"] for j in jobs.values()) == 1


def test_cache_quota_caps_a_tenants_cache(client: TestClient) -> None:
    client.post("/v1/datasets", json=IMAGENET, headers=H_ALICE)
    client.put("/v1/quotas/alice", json={"cache_bytes": "50GB"}, headers=H_ADMIN)
    client.post("/v1/jobs", json=JOB, headers=H_ALICE)
    client.post("/v1/rounds", headers=H_ADMIN)
    cache = client.get("/v1/allocations", headers=H_ALICE).json()["cache"]
    assert cache and sum(c["bytes"] for c in cache) <= 50e9 + 1


def test_idempotency_key(client: TestClient) -> None:
    client.post("/v1/datasets", json=IMAGENET, headers=H_ALICE)
    h = {**H_ALICE, "Idempotency-Key": "submit-7f3a"}
    first = client.post("/v1/jobs", json=JOB, headers=h)
    again = client.post("/v1/jobs", json=JOB, headers=h)
    assert first.status_code == 201 and again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other = client.post("/v1/jobs", json={**JOB, "epochs": 3}, headers=h)
    assert other.status_code == 409 and other.json()["field"] == "Idempotency-Key"
    # Keys are per tenant: bob's same key is his own.
    client.post("/v1/datasets", json=IMAGENET, headers=H_BOB)
    assert client.post("/v1/jobs", json=JOB, headers={**H_BOB, "Idempotency-Key": "submit-7f3a"}).status_code == 201
    assert len(client.get("/v1/jobs", headers=H_ALICE).json()) == 1
    assert client.post("/v1/jobs", json=JOB, headers={**H_ALICE, "Idempotency-Key": "x" * 200}).status_code == 422


def test_errors_do_not_echo_internal_paths(client: TestClient, app_service, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, service = app_service
    service.engine.dispose()
    (tmp_path / "sec.db").rename(tmp_path / "moved.db")  # the database file vanishes under the service
    (tmp_path / "sec.db").mkdir()  # and a directory takes its place: opening it fails
    r = client.get("/healthz")
    assert r.status_code == 503 and str(tmp_path) not in r.text
    r = client.get("/v1/jobs", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 503 and r.headers["retry-after"] and str(tmp_path) not in r.text
    assert r.json()["detail"].startswith("the database is unavailable")


# ------------------------------------------------------------------ database outage (real PostgreSQL)

try:
    from pg_fixture import private_pg  # noqa: F401
except ImportError:
    from tests.pg_fixture import private_pg  # noqa: F401


@pytest.mark.postgres
def test_database_stopped_and_restarted_gives_json_503_then_recovers(private_pg, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """PostgreSQL stops mid-traffic: every request is a JSON 503 with Retry-After (never another
    5xx, never a hang), nothing acknowledged before is lost, and once the server is back the
    service answers again by itself (no restart)."""
    import httpx

    app, service = make_app(private_pg.url, tmp_path, run_loop=True)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/v1/datasets", json=IMAGENET, headers=H_ALICE).status_code == 201
        acked = [c.post("/v1/jobs", json={**JOB, "name": f"j{i}"}, headers=H_ALICE).json()["id"] for i in range(5)]
        private_pg.stop()
        statuses = []
        for i in range(6):
            for method, path, kw in (("POST", "/v1/jobs", {"json": {**JOB, "name": f"down{i}"}}), ("GET", "/v1/jobs", {}),
                                     ("GET", f"/v1/jobs/{acked[0]}", {})):
                r = c.request(method, path, headers=H_ALICE, **kw)
                statuses.append(r.status_code)
                assert r.status_code == 503, (method, path, r.status_code, r.text)
                assert r.headers["retry-after"] and r.json()["detail"].startswith("the database is unavailable")
                assert "postgres" not in r.text.lower() and "127.0.0.1" not in r.text
        # A token never seen before needs the database: 503 as well, not 401.
        r = c.get("/v1/jobs", headers={"Authorization": "Bearer never-seen-token-123"})
        assert r.status_code == 503
        assert c.get("/healthz").status_code == 503
        private_pg.start()
        deadline = time.monotonic() + 30
        while c.get("/v1/jobs", headers=H_ALICE).status_code != 200:
            assert time.monotonic() < deadline, "the service did not recover after the database came back"
            time.sleep(0.2)
        listed = [j["id"] for j in c.get("/v1/jobs", headers=H_ALICE).json()]
        assert listed == acked  # nothing acknowledged was lost, nothing refused was created
        assert c.post("/v1/jobs", json={**JOB, "name": "after"}, headers=H_ALICE).status_code == 201
        assert c.get("/healthz").status_code == 200
    service.close()


def test_a_node_agent_looks_up_any_tenants_dataset_and_nothing_more(tmp_path) -> None:
    # bob's token belongs to a node agent here (`silod serve --node-agent bob`): he may read
    # alice's dataset record to mount it for her pods, but not run a job on it; alice may not
    # read bob's datasets.
    app, service = make_app(f"sqlite:///{tmp_path / 'agent.db'}", tmp_path, run_loop=False, node_agents=["bob"])
    try:
        with TestClient(app) as c:
            assert c.post("/v1/datasets", json=IMAGENET, headers=H_ALICE).status_code == 201
            name = IMAGENET["name"]
            assert c.get(f"/v1/datasets/{name}", params={"owner": "alice"}, headers=H_BOB).status_code == 200
            job = {**JOB, "dataset_owner": "alice"}
            assert c.post("/v1/jobs", json=job, headers=H_BOB).status_code == 404
            assert c.post("/v1/datasets", json=IMAGENET, headers=H_BOB).status_code == 201
            assert c.get(f"/v1/datasets/{name}", params={"owner": "bob"}, headers=H_ALICE).status_code == 404
    finally:
        service.close()


# ------------------------------------------------------------------ issue 20, finding 4: expensive bodies


def _cpu_of(client: TestClient, path: str, body: bytes, headers: dict[str, str]) -> tuple[float, "object"]:
    """CPU seconds this process (the app and the in-process client) spent on one request; the
    least of five, as CPU time, not wall-clock, on a shared machine (where one run in three can
    be slowed past the bound by the neighbours' cache and frequency)."""
    best, r = float("inf"), None
    for _ in range(5):
        t0 = time.process_time()
        r = client.post(path, content=body, headers={**headers, "content-type": "application/json"})
        best = min(best, time.process_time() - t0)
    return best, r


_MEGABYTE_OF_KEYS = json.dumps({f"field{i:05d}": 1 for i in range(60_000)}).encode()


def _cpu_bound() -> float:
    """The issue's bound, 50 ms of CPU, on the machine it was set on; on a slower one, 4x what
    parsing a 1 MB body once costs here (the work no server can skip; a refusal costs about one
    parse). These VMs differ by 2.5x in single-core speed, and the bodies this guards against
    took 4.5-6 s."""
    parse = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        json.loads(_MEGABYTE_OF_KEYS)
        parse = min(parse, time.process_time() - t0)
    return max(0.050, 4 * parse)


def test_a_megabyte_of_unknown_keys_is_refused_cheaply(client: TestClient) -> None:
    """Issue 20: 1 MB of 60,000 unknown keys took 4.5-6.1 s and answered a 5.4 MB 422."""
    body = _MEGABYTE_OF_KEYS
    assert 900_000 < len(body) < (1 << 20)
    client.post("/v1/jobs", json={"bogus": 1}, headers=H_ALICE)  # warm: lazy imports and caches
    cpu, r = _cpu_of(client, "/v1/jobs", body, H_ALICE)
    assert r.status_code == 422 and len(r.content) < 2000, (r.status_code, len(r.content))
    bound = _cpu_bound()
    assert cpu < bound, f"{cpu * 1000:.0f} ms of CPU for one refused body (bound {bound * 1000:.0f} ms)"


@pytest.mark.parametrize("name, body", [
    ("a list of 250k items", b'{"name": "x", "gpus": 1, "dataset": "d", "epochs": 1, "pod_template": {"image": "i", "args": ['
     + b",".join([b"1"] * 250_000) + b"]}}"),
    ("nesting 100k deep", b'{"name": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("nesting 20 deep", b'{"name": ' + b'{"a": ' * 20 + b"1" + b"}" * 20 + b"}"),
    ("a 1000-item list of 16-key objects", b'{"pods": [' + b",".join(
        [b"{" + b",".join(b'"k%d": 1' % i for i in range(16)) + b"}"] * 1000) + b"]}"),
])
def test_bodies_past_a_shape_bound_are_422_naming_it(client: TestClient, name: str, body: bytes) -> None:
    cpu, r = _cpu_of(client, "/v1/jobs", body, H_ALICE)
    assert r.status_code == 422, (name, r.text[:300])
    assert len(r.content) < 2000 and "request body" in r.json()["detail"], r.text[:300]
    bound = _cpu_bound()
    assert cpu < bound, f"{name}: {cpu * 1000:.0f} ms of CPU (bound {bound * 1000:.0f} ms)"


def test_unknown_fields_are_rejected_at_the_first_and_errors_are_capped(client: TestClient) -> None:
    r = client.post("/v1/jobs", json={**JOB, "gpu": 4, "zzz": 1, "yyy": 2}, headers=H_ALICE)
    assert r.status_code == 422 and r.json()["field"] == "gpu"
    assert [e["type"] for e in r.json()["detail"]] == ["extra_forbidden"], r.text
    # Many invalid values in a legal shape: the answer lists 20 and says how many more.
    pods = [{"pod_uid": "bad", "read_bytes": -1, "hit_bytes": -1, "miss_bytes": -1, "hits": -1, "misses": -1}] * 500
    r = client.post("/v1/agents/n1/consumption", json={"pods": pods}, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code in (403, 422)
    r = client.post("/v1/jobs", json={**JOB, "pod_template": {"image": "i", "args": [1] * 256, "command": [2] * 64}},
                    headers=H_ALICE)
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert len(detail) == 21 and detail[-1]["type"] == "truncated" and "300 more" in detail[-1]["msg"], detail[-1]


# ------------------------------------------------------------------ issue 20, finding 3: secrets at rest

SECRET = "alice-S3cret-Key-0123456789abcdef"


def _files(db) -> list:  # type: ignore[no-untyped-def]
    return [p for p in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")) if p.exists()]


def test_secrets_are_sealed_at_rest_and_the_database_files_are_private(tmp_path) -> None:
    """Issue 20: the secret was in plain text in the database, and user `nobody` read it from the
    world-readable -wal file. Now: sealed with a server key kept outside the database, files
    0600 (WAL and SHM too); the job's data path still gets the clear secret."""
    db = tmp_path / "sec.db"
    app, service = make_app(f"sqlite:///{db}", tmp_path, run_loop=False)
    try:
        with TestClient(app) as c:
            cred = {"name": "aws", "access_key_id": "AKIAALICE", "secret_access_key": SECRET}
            assert c.post("/v1/credentials", json=cred, headers=H_ALICE).status_code == 201
            assert c.post("/v1/datasets", json={**IMAGENET, "credential": "aws"}, headers=H_ALICE).status_code == 201
            assert c.post("/v1/jobs", json=JOB, headers=H_ALICE).status_code == 201
            for path in ("/v1/credentials", "/v1/datasets", "/v1/datasets/imagenet", "/v1/jobs", "/v1/cluster",
                         "/v1/allocations"):
                for h in (H_ALICE, {"Authorization": f"Bearer {ADMIN_TOKEN}"}):
                    assert SECRET not in c.get(path, headers=h).text, path
            assert c.post("/v1/rounds", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).status_code == 200
            spec = service.backend.started[0][0]
            assert spec.dataset.credential.secret_access_key == SECRET  # opened for the data path only
            files = _files(db)
            assert len(files) >= 2  # the WAL is there while the service runs
            for f in files:
                assert SECRET.encode() not in f.read_bytes(), f
                assert f.stat().st_mode & 0o077 == 0, (f, oct(f.stat().st_mode))
            with service.engine.connect() as conn:
                stored = conn.execute(sa.text("SELECT secret_access_key FROM credentials")).scalar_one()
            assert stored.startswith("fernet:") and SECRET not in stored
            keys = tmp_path / "state" / "secret.keys"
            assert keys.stat().st_mode & 0o077 == 0 and SECRET not in keys.read_text()
    finally:
        service.close()


def test_plaintext_secrets_of_an_older_database_are_sealed_at_start(tmp_path) -> None:
    from scheduler.service.sealed import load_secret_box

    db = tmp_path / "old.db"
    _app, service = make_app(f"sqlite:///{db}", tmp_path, run_loop=False)
    with service.engine.begin() as conn:  # a row as the previous version stored it
        conn.execute(sa.text("INSERT INTO credentials (owner, name, kind, access_key_id, secret_access_key, created_at)"
                             " VALUES ('alice', 'old', 's3', 'AKIAOLD', :s, 0)"), {"s": SECRET})
    service.close()
    db.chmod(0o644)  # as the previous version left it
    _app, service = make_app(f"sqlite:///{db}", tmp_path, run_loop=False)
    try:
        with service.engine.connect() as conn:
            stored = conn.execute(sa.text("SELECT secret_access_key FROM credentials")).scalar_one()
        assert stored.startswith("fernet:") and load_secret_box(tmp_path / "state").open(stored) == SECRET
        assert db.stat().st_mode & 0o077 == 0
    finally:
        service.close()


def test_the_secret_key_rotates_and_retires_without_losing_a_secret(tmp_path) -> None:
    from cryptography.fernet import Fernet
    from typer.testing import CliRunner

    from scheduler.cli import app as cli
    from scheduler.service.sealed import PREFIX, load_secret_box

    db = tmp_path / "rot.db"
    app, service = make_app(f"sqlite:///{db}", tmp_path, run_loop=False)
    try:
        with TestClient(app) as c:
            cred = {"name": "aws", "access_key_id": "AKIAALICE", "secret_access_key": SECRET}
            assert c.post("/v1/credentials", json=cred, headers=H_ALICE).status_code == 201
    finally:
        service.close()
    state = tmp_path / "state"
    first_key = load_secret_box(state).keys[0]
    runner = CliRunner()
    args = ["--db", f"sqlite:///{db}", "--state-dir", str(state)]
    r = runner.invoke(cli, ["secrets", "rotate", *args])
    assert r.exit_code == 0, r.output
    box = load_secret_box(state)
    assert len(box.keys) == 2 and box.keys[1] == first_key and box.keys[0] != first_key

    def stored() -> str:
        with sa.create_engine(f"sqlite:///{db}").connect() as conn:
            return conn.execute(sa.text("SELECT secret_access_key FROM credentials")).scalar_one()

    # Re-sealed under the new key alone: it opens without the old one.
    assert Fernet(box.keys[0]).decrypt(stored()[len(PREFIX):].encode()).decode() == SECRET
    r = runner.invoke(cli, ["secrets", "rotate", "--retire", *args])
    assert r.exit_code == 0, r.output
    box = load_secret_box(state)
    assert len(box.keys) == 1 and box.open(stored()) == SECRET
    assert (state / "secret.keys").stat().st_mode & 0o077 == 0
    # A secret no key opens fails its job with a clear message (not a crash, not an empty credential).
    (state / "secret.keys").write_text(Fernet.generate_key().decode() + "\n")
    app, service = make_app(f"sqlite:///{db}", tmp_path, run_loop=False)
    try:
        with TestClient(app) as c:
            assert c.post("/v1/datasets", json={**IMAGENET, "credential": "aws"}, headers=H_ALICE).status_code == 201
            job = c.post("/v1/jobs", json=JOB, headers=H_ALICE).json()
            assert c.post("/v1/rounds", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).status_code == 200
            got = c.get(f"/v1/jobs/{job['id']}", headers=H_ALICE).json()
            assert got["state"] == "failed" and "cannot be opened" in got["message"], got
            assert service.backend.started == []
    finally:
        service.close()


# ------------------------------------------------------------------ issue 20, finding 6: views, headers, owners, timeouts


def test_cluster_view_hides_the_data_manager_and_other_tenants_names_from_tenants(tmp_path) -> None:
    """A push that fails names datasets (all tenants') and the data manager's URL: only the
    admin sees them."""
    app, service = make_app(f"sqlite:///{tmp_path / 'c.db'}", tmp_path, run_loop=False,
                            datamanager="http://127.0.0.1:9")  # nothing listens there: every push fails
    try:
        with TestClient(app) as c:
            assert c.post("/v1/datasets", json={**IMAGENET, "name": "alice-secret-project"}, headers=H_ALICE).status_code == 201
            assert c.post("/v1/jobs", json={**JOB, "dataset": "alice-secret-project"}, headers=H_ALICE).status_code == 201
            assert c.post("/v1/rounds", headers=H_ADMIN).status_code == 200
            admin_view = c.get("/v1/cluster", headers=H_ADMIN).json()
            assert admin_view["datamanager"] == "http://127.0.0.1:9" and admin_view["last_push_error"]
            bob_view = c.get("/v1/cluster", headers=H_BOB)
            assert bob_view.status_code == 200
            assert "127.0.0.1:9" not in bob_view.text and "alice-secret-project" not in bob_view.text
            assert bob_view.json()["datamanager"] is None and "failed" in bob_view.json()["last_push_error"]
    finally:
        service.close()


def test_two_authorization_headers_are_400(client: TestClient) -> None:
    # The last one used to win: a proxy that checks the first would be bypassed.
    both = [("Authorization", f"Bearer {TOKENS['bob']}"), ("Authorization", f"Bearer {ADMIN_TOKEN}")]
    r = client.get("/v1/tokens", headers=both)
    assert r.status_code == 400 and "Authorization" in r.json()["detail"]
    assert client.get("/v1/tokens", headers=H_ADMIN).status_code == 200


def test_token_owners_are_validated_like_the_tokens_file(client: TestClient, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    r = client.post("/v1/tokens", json={"owner": "admin"}, headers=H_ADMIN)
    assert r.status_code == 422 and r.json()["field"] == "owner", r.text
    for variant in ("ADMIN", "Admin"):  # were 201: a tenant passing for the admin in every listing
        r = client.post("/v1/tokens", json={"owner": variant}, headers=H_ADMIN)
        assert r.status_code == 422 and r.json()["field"] == "owner", r.text
    bad = tmp_path / "tokens-admin-variant"
    bad.write_text("Admin:a-long-enough-token-01\n")
    from estimator.errors import UserError
    from scheduler.service.api.auth import parse_tokens_file

    with pytest.raises(UserError, match="reserved"):
        parse_tokens_file(bad)
    assert client.post("/v1/tokens", json={"owner": "admin", "admin": True}, headers=H_ADMIN).status_code == 201
    # A tenant that happens to be called "metrics" is not the scrape token.
    monkeypatch.setenv("SILOD_METRICS_TOKEN", "scrape-token-123")
    app, service = make_app(f"sqlite:///{tmp_path / 'm2.db'}", tmp_path, run_loop=False)
    try:
        with TestClient(app) as c:
            tok = c.post("/v1/tokens", json={"owner": "metrics"}, headers=H_ADMIN).json()["token"]
            assert c.get("/metrics", headers={"Authorization": f"Bearer {tok}"}).status_code == 403
            assert c.get("/metrics", headers={"Authorization": "Bearer scrape-token-123"}).status_code == 200
    finally:
        service.close()


def test_slow_headers_and_slow_bodies_are_cut_off(tmp_path) -> None:
    """Issue 20: slow-header and slow-body connections were held with no timeout."""
    from scheduler.service.api.app import create_app

    _app, service = make_app(f"sqlite:///{tmp_path / 't.db'}", tmp_path, run_loop=False)
    app = create_app(service, _app.state.tokens, run_loop=False, body_timeouts=(1.0, 3.0))
    try:
        with ServerThread(app, header_timeout_s=1.0) as server:
            # Half a header block, then nothing: the server closes the connection.
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                t0 = time.monotonic()
                sock.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n")
                assert sock.recv(65536) == b""  # closed (a timeout would raise instead)
                assert time.monotonic() - t0 < 5
            # Headers byte by byte, each within the keep-alive time: still cut off at 1 s in all.
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                t0 = time.monotonic()
                try:
                    for b in b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                        sock.sendall(bytes([b]))
                        time.sleep(0.1)
                except OSError:
                    pass
                assert sock.recv(65536) == b"" and time.monotonic() - t0 < 5
            head = ("POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Authorization: Bearer {TOKENS['alice']}\r\nContent-Length: 100\r\n\r\n")
            # A body that stalls: 408.
            status, data, elapsed = _raw(server.port, head, b'{"name": ')
            assert status == 408 and elapsed < 4, data[:200]
            # A body that trickles (a byte every 0.5 s, never idle for 1 s): 408 at the total bound.
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                t0 = time.monotonic()
                sock.sendall(head.encode())
                answer = b""
                try:
                    for _ in range(20):
                        sock.sendall(b" ")
                        sock.settimeout(0.5)
                        try:
                            answer += sock.recv(65536)
                        except TimeoutError:
                            continue
                        if answer:
                            break
                except OSError:
                    pass
                assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
                assert time.monotonic() - t0 < 6
            # A normal request on a fresh connection still works, and a keep-alive one too.
            status, _, _ = _raw(server.port, f"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKENS['alice']}\r\n\r\n")
            assert status == 200
    finally:
        service.close()


def test_processes_starting_together_agree_on_one_secret_key(tmp_path) -> None:
    """API workers and the scheduling process create STATE_DIR/secret.keys on first start: all
    must end up with the same key (a reader never sees a half-written file)."""
    import threading

    from scheduler.service.sealed import load_secret_box

    keys: list[bytes] = []
    start = threading.Barrier(8)

    def load() -> None:
        start.wait()
        keys.append(load_secret_box(tmp_path / "state").keys[0])

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(keys) == 8 and len(set(keys)) == 1
    assert (tmp_path / "state" / "secret.keys").stat().st_mode & 0o077 == 0
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["secret.keys"]  # no temporary file left


def test_a_self_grant_is_refused_with_a_message(client: TestClient) -> None:
    """A grant to the dataset's own owner answered 200 and did nothing, so a caller who typed
    their own name for another tenant's never learned that nobody got the grant."""
    client.post("/v1/datasets", json=IMAGENET, headers=H_ALICE)
    r = client.put("/v1/datasets/imagenet/grants/alice", headers=H_ALICE)
    assert r.status_code == 422 and r.json()["field"] == "tenant" and "needs no grant" in r.json()["detail"]
    assert client.get("/v1/datasets/imagenet", headers=H_ALICE).json()["shared_with"] == []


def test_a_body_that_is_not_sent_as_json_is_a_415_naming_the_header(client: TestClient) -> None:
    body = '{"name": "imagenet", "uri": "s3://bucket/imagenet", "size": "1GB"}'
    r = client.post("/v1/datasets", content=body, headers={**H_ALICE, "Content-Type": "text/plain"})
    assert r.status_code == 415, r.text
    assert "Content-Type: application/json" in r.json()["detail"] and "text/plain" in r.json()["detail"]
    assert client.get("/v1/datasets", headers=H_ALICE).json() == []
    # Authentication still comes first: without a token it is a 401, whatever the type.
    assert client.post("/v1/datasets", content=body, headers={"Content-Type": "text/plain"}).status_code == 401
    # JSON types with parameters or a +json suffix are JSON, as for FastAPI.
    for kind in ("application/json; charset=utf-8", "application/merge-patch+json"):
        r = client.post("/v1/datasets", content=body, headers={**H_ALICE, "Content-Type": kind})
        assert r.status_code in (200, 201), (kind, r.text)  # 200: the same dataset again


def test_error_messages_do_not_echo_long_input_whole(client: TestClient) -> None:
    """An id from the path was quoted whole in the 404 (10 kB in, 10 kB back)."""
    r = client.get("/v1/jobs/" + "x" * 10_000, headers=H_ALICE)
    assert r.status_code == 404 and len(r.json()["detail"]) < 1200 and "more characters" in r.json()["detail"]
