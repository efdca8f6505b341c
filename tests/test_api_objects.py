"""Issue 20's review, what a tenant could still make the service hold or read: objects without
bound (datasets, credentials, grants) and listings without pages, an admin route that read a
tenant's body before refusing it, an integer too long to convert whose 400 named no field, and
one beyond a float's range that was a 500 in a size or rate field.

Each test fails on 3d77954 (every dataset a 201, a tenant's malformed body to an admin route a
422, a waiting one held until its timeout, a 400 "There was an error parsing the body")."""

from __future__ import annotations

import json
import pytest
from fastapi.testclient import TestClient

from scheduler.service.api.server import ServerThread

try:
    from test_api import H_ADMIN, H_ALICE, H_BOB, IMAGENET, JOB, TOKENS, make_app
    from test_api_security import _raw
except ImportError:
    from tests.test_api import H_ADMIN, H_ALICE, H_BOB, IMAGENET, JOB, TOKENS, make_app
    from tests.test_api_security import _raw


@pytest.fixture
def small(tmp_path):  # type: ignore[no-untyped-def]
    """A service whose tenants may hold 3 datasets and 1 credential, each dataset shared with 1 tenant."""
    app, service = make_app(f"sqlite:///{tmp_path / 'objects.db'}", tmp_path, run_loop=False,
                            object_limits="datasets=3,credentials=1,grants=1")
    with TestClient(app) as c:
        yield c
    service.close()


def _dataset(i: int) -> dict:
    return {**IMAGENET, "name": f"ds{i}"}


def test_a_tenant_holds_at_most_its_object_limits(small: TestClient) -> None:
    c = small
    for i in range(3):
        assert c.post("/v1/datasets", json=_dataset(i), headers=H_ALICE).status_code == 201
    r = c.post("/v1/datasets", json=_dataset(3), headers=H_ALICE)
    assert r.status_code == 403 and "3 of at most 3" in r.json()["detail"] and r.json()["field"] == "name", r.text
    # Re-registering one she has is still the idempotent 200; another tenant has her own room.
    assert c.post("/v1/datasets", json=_dataset(0), headers=H_ALICE).status_code == 200
    assert c.post("/v1/datasets", json=_dataset(3), headers=H_BOB).status_code == 201
    assert len(c.get("/v1/datasets", headers=H_ALICE).json()) == 3

    assert c.put("/v1/datasets/ds0/grants/bob", headers=H_ALICE).status_code == 200
    assert c.put("/v1/datasets/ds0/grants/bob", headers=H_ALICE).status_code == 200  # the same grant again
    r = c.put("/v1/datasets/ds0/grants/carol", headers=H_ALICE)
    assert r.status_code == 403 and "shared with as many tenants" in r.json()["detail"], r.text
    assert c.delete("/v1/datasets/ds0/grants/bob", headers=H_ALICE).status_code == 200
    assert c.put("/v1/datasets/ds0/grants/carol", headers=H_ALICE).status_code == 200  # room again

    cred = {"name": "c0", "access_key_id": "AKIA0", "secret_access_key": "s0"}
    assert c.post("/v1/credentials", json=cred, headers=H_ALICE).status_code == 201
    r = c.post("/v1/credentials", json={**cred, "name": "c1"}, headers=H_ALICE)
    assert r.status_code == 403 and "credentials" in r.json()["detail"], r.text
    assert c.delete("/v1/credentials/c0", headers=H_ALICE).status_code == 204
    assert c.post("/v1/credentials", json={**cred, "name": "c1"}, headers=H_ALICE).status_code == 201


def test_listings_answer_a_page_at_a_time(small: TestClient) -> None:
    c = small
    for i in range(3):
        assert c.post("/v1/datasets", json=_dataset(i), headers=H_ALICE).status_code == 201
    names = [d["name"] for d in c.get("/v1/datasets", params={"limit": 2}, headers=H_ALICE).json()]
    rest = [d["name"] for d in c.get("/v1/datasets", params={"limit": 2, "offset": 2}, headers=H_ALICE).json()]
    assert (names, rest) == (["ds0", "ds1"], ["ds2"])
    for bad in ({"limit": 0}, {"limit": 1001}, {"offset": -1}, {"limit": "x"}):
        assert c.get("/v1/datasets", params=bad, headers=H_ALICE).status_code == 422, bad
        assert c.get("/v1/credentials", params=bad, headers=H_ALICE).status_code == 422, bad


@pytest.mark.parametrize("method, path", [("POST", "/v1/tokens"), ("PUT", "/v1/quotas/alice"), ("PUT", "/v1/policy"),
                                          ("POST", "/v1/rounds")])
def test_an_admin_route_refuses_a_tenant_before_reading_its_body(small: TestClient, method: str, path: str) -> None:
    """A tenant's body to an admin route was read and validated before the 403 (a malformed one
    got the 422 that only the admin's body should get)."""
    r = small.request(method, path, content=b'{"owner": [[[[[', headers={**H_ALICE, "Content-Type": "application/json"})
    assert r.status_code == 403 and "admin" in r.json()["detail"], r.text
    # The admin's malformed body is still the 422 it was.
    if method != "POST" or path != "/v1/rounds":
        assert small.request(method, path, content=b'{"owner": [[[[[',
                             headers={**H_ADMIN, "Content-Type": "application/json"}).status_code == 422


def test_a_tenant_waiting_body_to_an_admin_route_is_refused_at_once(tmp_path) -> None:
    """Over a real socket: headers announce a body that never comes. The 403 comes from the
    headers alone (before: the server waited for the body, then timed out)."""
    app, service = make_app(f"sqlite:///{tmp_path / 'o.db'}", tmp_path, run_loop=False)
    try:
        with ServerThread(app) as server:
            head = ("POST /v1/tokens HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Authorization: Bearer {TOKENS['alice']}\r\nContent-Length: 1000\r\n\r\n")
            status, data, elapsed = _raw(server.port, head)
            assert status == 403 and elapsed < 3, (status, data)
    finally:
        service.close()


@pytest.mark.parametrize("digits", [4301, 100_000])
def test_an_integer_too_long_to_convert_is_a_422_naming_where(small: TestClient, digits: int) -> None:
    body = json.dumps({**JOB, "gpus": 0}).replace('"gpus": 0', '"gpus": ' + "9" * digits)
    r = small.post("/v1/jobs", content=body.encode(), headers={**H_ALICE, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert f"{digits} digits" in r.json()["detail"] and ".gpus" in r.json()["detail"], r.text
    # Within the bound, the field's own range check answers, as before.
    body = json.dumps({**JOB, "gpus": 0}).replace('"gpus": 0', '"gpus": ' + "9" * 4300)
    r = small.post("/v1/jobs", content=body.encode(), headers={**H_ALICE, "Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["field"] == "gpus", r.text


def test_object_limits_flag_errors_name_the_item() -> None:
    from estimator.errors import UserError
    from scheduler.service.cli import parse_object_limits

    assert parse_object_limits("datasets=5").datasets == 5 and parse_object_limits(None).grants == 256
    for bad, needle in (("files=3", "KEY one of"), ("datasets=0", "from 1"), ("grants=-1", "from 1"),
                        ("datasets=²", "whole number"), ("datasets", "KEY=N")):
        with pytest.raises(UserError, match=needle):
            parse_object_limits(bad)


def _body_fields(schema: dict, components: dict, depth: int = 0) -> list[tuple[str, ...]]:
    """Every property path of a request body's schema (nested models followed through $ref)."""
    if "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[1]]
    paths: list[tuple[str, ...]] = []
    for name, prop in schema.get("properties", {}).items():
        paths.append((name,))
        if depth < 3:
            for sub in [prop, *prop.get("anyOf", []), *prop.get("allOf", [])]:
                if "$ref" in sub:
                    paths += [(name, *p) for p in _body_fields(sub, components, depth + 1)]
    return paths


def _nested(path: tuple[str, ...], value: object) -> dict:
    return {path[0]: value} if len(path) == 1 else {path[0]: _nested(path[1:], value)}


@pytest.mark.parametrize("digits", [400, 4300])
def test_an_integer_beyond_a_floats_range_in_any_body_field_is_a_4xx(small: TestClient, digits: int) -> None:
    """Issue 20, outside review: a 310-4,300-digit integer (legal JSON, under the reader's digit
    bound) in a dataset's `size` or a job's `ideal_throughput` / `step_bytes` was a 500
    (OverflowError converting it to a float). Every field of every request body, as admin."""
    c = small
    spec = c.get("/openapi.json").json()
    components = spec["components"]["schemas"]
    big = "9" * digits
    tried = 0
    for route, methods in spec["paths"].items():
        for method, op in methods.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body is None:
                continue
            url = route.replace("{", "").replace("}", "")  # path parameters become literal names
            for field in _body_fields(body, components):
                payload = json.dumps(_nested(field, 0)).replace(": 0", ": " + big)
                r = c.request(method.upper(), url, content=payload.encode(),
                              headers={**H_ADMIN, "Content-Type": "application/json"})
                assert r.status_code < 500, (method, route, field, r.status_code, r.text[:300])
                tried += 1
    assert tried > 40, tried  # the walk reached the bodies (jobs, datasets, credentials, quotas, ...)
