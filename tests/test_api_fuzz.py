"""Fuzz the REST API from its own OpenAPI schema against a real uvicorn server on 127.0.0.1:
valid and invalid inputs (schemathesis positive + negative generation), as admin and as a
user, must never produce a 5xx. Bounded to ~25 examples per operation to stay under ~2 min."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from scheduler.service.api.app import openapi_document
from scheduler.service.api.server import ServerThread

from test_api import H_ADMIN, H_ALICE, IMAGENET, JOB, make_app  # noqa: I001 - sibling test module

MAX_EXAMPLES = 25


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("fuzz")
    app, service = make_app(f"sqlite:///{tmp / 'fuzz.db'}", tmp)
    with ServerThread(app) as server:
        with httpx.Client(base_url=server.url, headers=H_ADMIN) as c:
            # Some state for the fuzzer to hit: a dataset, a job of alice's, one of admin's.
            assert c.post("/v1/datasets", json=IMAGENET).status_code == 201
            assert c.post("/v1/datasets", json=IMAGENET, headers=H_ALICE).status_code == 201  # names are per tenant
            assert c.post("/v1/jobs", json=JOB, headers=H_ALICE).status_code == 201
            assert c.post("/v1/jobs", json={**JOB, "name": "admins"}).status_code == 201
        yield server.url
    service.close()


# The same document the server serves at /openapi.json (built without a service).
schema = schemathesis.openapi.from_dict(openapi_document())
schema.config.generation.update(modes=["positive", "negative"], max_examples=MAX_EXAMPLES, database="none")


STATUSES: list[int] = []


def _check(case, base_url: str, headers: dict) -> None:  # type: ignore[no-untyped-def]
    response = case.call(base_url=base_url, headers=headers, timeout=30)
    STATUSES.append(response.status_code)
    assert response.status_code < 500, f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}"
    case.validate_response(response, checks=[not_a_server_error])


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_no_server_errors_as_admin(case, live_server: str) -> None:  # type: ignore[no-untyped-def]
    _check(case, live_server, H_ADMIN)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES // 2, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_no_server_errors_as_user(case, live_server: str) -> None:  # type: ignore[no-untyped-def]
    _check(case, live_server, H_ALICE)


@pytest.mark.slow
def test_fuzzer_exercised_the_api() -> None:
    """Guards the two tests above against passing vacuously (e.g. no examples generated)."""
    if not STATUSES:
        pytest.skip("run together with the fuzz tests")
    assert len(STATUSES) >= 200
    assert any(200 <= s < 300 for s in STATUSES) and any(s == 422 for s in STATUSES)
    assert max(STATUSES) < 500
