"""Issue 20 item 8 (a faster API path): what made requests slow, each checked without timing."""

from __future__ import annotations

import socket

from fastapi import FastAPI

from scheduler.service.api.server import ServerThread


def test_accepted_connections_have_nagle_off() -> None:
    """A listening socket made with socket.socket(AF_INET) (uvicorn's for --workers N, and
    ServerThread's) has proto 0, so asyncio left Nagle on for the connections it accepted: h11
    writes a response's head and body separately, and the body waited for the client's delayed
    ACK (~40 ms on Linux) on every request. The protocol turns Nagle off itself."""
    app = FastAPI()

    @app.get("/x")
    def x() -> dict:
        return {"ok": True}

    with ServerThread(app) as server:
        assert server.sock.proto == 0  # the case asyncio does not cover
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as c:
            c.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while not data.endswith(b'{"ok":true}'):
                chunk = c.recv(65536)
                assert chunk, data
                data += chunk
            connections = list(server.server.server_state.connections)
            assert len(connections) == 1
            sock = connections[0].transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_a_grant_revoked_while_a_submission_is_checked_refuses_it(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The submission reads the dataset and quota before its write transaction (so the database's
    write lock is held only for the insert); a job through another tenant's grant is still
    refused when the grant is revoked between those reads and the insert."""
    from fastapi.testclient import TestClient

    from scheduler.service.catalogue import Catalogue
    from scheduler.service.types import Principal

    try:
        from test_api import H_ALICE, H_BOB, IMAGENET, JOB, make_app
    except ImportError:
        from tests.test_api import H_ALICE, H_BOB, IMAGENET, JOB, make_app

    app, service = make_app(f"sqlite:///{tmp_path / 'g.db'}", tmp_path, run_loop=False)
    try:
        with TestClient(app) as client:
            assert client.post("/v1/datasets", json=IMAGENET, headers=H_ALICE).status_code == 201
            assert client.put("/v1/datasets/imagenet/grants/bob", headers=H_ALICE).status_code == 200
            shared = {**JOB, "dataset_owner": "alice"}
            assert client.post("/v1/jobs", json=shared, headers=H_BOB).status_code == 201
            work_range = Catalogue.work_range

            def revoke_then_check_work(self, q):  # type: ignore[no-untyped-def]
                # Between the submission's reads and its write transaction.
                self.revoke_grant(Principal("alice"), "imagenet", "bob")
                return work_range(self, q)

            monkeypatch.setattr(Catalogue, "work_range", revoke_then_check_work)
            r = client.post("/v1/jobs", json=shared, headers=H_BOB)
            assert r.status_code == 404 and r.json()["field"] == "dataset", r.text
            assert len(client.get("/v1/jobs", headers=H_BOB).json()) == 1
    finally:
        service.close()


def test_job_json_is_asdicts_for_every_kind_of_field() -> None:
    """GET /v1/jobs/{id} and the listings serialise a JobRecord field by field (asdict's
    recursive copy was a third of the handler). The result must be exactly asdict's, with the
    access pattern flattened, for a record whose every dataclass-valued field is set."""
    from dataclasses import asdict, fields, is_dataclass

    from estimator.access import AccessPattern
    from scheduler.service.api.app import _JOB_NESTED, _record_dict
    from scheduler.service.measured_params import MeasuredParams
    from scheduler.service.types import Bottleneck, JobLoader, JobRecord

    access = AccessPattern.curriculum_learning(0.04, 1.9, 50_000, 256)
    record = JobRecord(
        id="7", name="r50", owner="alice", gpus=4, dataset="imagenet", dataset_owner="alice", model=None,
        ideal_throughput=4e8, epochs=2.0, steps=None, step_bytes=None, total_bytes=2.8e11, consumed_bytes=1e9,
        remaining_bytes=2.79e11, priority=0, state="running", submit_time=1.0, start_time=2.0, finish_time=None,
        message="", allocated_gpus=4, gpu_share=1.0, remote_io=2e8, access=access, cpu_rate=5e7,
        autocache_expansion=None, post_cpu_rate=None, allocated_cpus=8.0,
        bottleneck=Bottleneck("remote_io", 2e8, 1.0, 1.0, 1.05, 1.1),
        cache_mode="source", cache_expansion=None,
        measured_parameters=MeasuredParams(4e8, 3.5e8, 60.0, 5e7, 5e7, 0.0, 3.4e8, 3.6e8, "remote_io", None, None, 9.0,
                                           0.002, 110e3),
        loader=JobLoader(4, 110e3),
    )
    nested = {f.name for f in fields(JobRecord) if f.name != "access" and is_dataclass(getattr(record, f.name))}
    assert nested == set(_JOB_NESTED)  # a new dataclass-valued field must be added to _JOB_NESTED
    expected = asdict(record)
    flat = access.fields()
    expected["access"] = {"kind": flat.pop("access"), **flat}
    got = _record_dict(record)
    assert got == expected and list(got) == list(expected)
    queued = JobRecord(**{**{f.name: getattr(record, f.name) for f in fields(JobRecord)},
                          "bottleneck": None, "measured_parameters": None, "loader": None, "access": AccessPattern()})
    assert _record_dict(queued)["bottleneck"] is None and _record_dict(queued)["access"]["kind"] == "epoch"


def test_a_submission_holds_sqlites_write_lock_for_one_statement(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Issue 47, round 3: every submission of every API worker waits for SQLite's one write lock,
    so what runs while a submission holds it sets the service's submissions per second. The
    write transaction used to run three statements before its commit (take the lock, count the
    tenant's jobs, insert), and the submission five in all on two pooled connections; the bare
    FastAPI insert the benchmark compares with runs one. Now: the dataset and quota in one read,
    then the checked insert alone in the write transaction. Counted with SQLAlchemy's statement
    hooks (no timing), for a plain submission, one through a grant and one with a queued quota."""
    from fastapi.testclient import TestClient
    from sqlalchemy import event

    from scheduler.service.types import TenantQuota

    try:
        from test_api import H_ALICE, H_BOB, IMAGENET, JOB, make_app
    except ImportError:
        from tests.test_api import H_ALICE, H_BOB, IMAGENET, JOB, make_app

    app, service = make_app(f"sqlite:///{tmp_path / 's.db'}", tmp_path, run_loop=False,
                            default_quota=TenantQuota(queued_jobs=100))
    seen: list[str] = []

    @event.listens_for(service.engine, "before_cursor_execute")
    def _statement(conn, cursor, statement, params, context, executemany):  # type: ignore[no-untyped-def]
        seen.append(" ".join(statement.split()))

    try:
        with TestClient(app) as client:
            assert client.post("/v1/datasets", json=IMAGENET, headers=H_ALICE).status_code == 201
            assert client.put("/v1/datasets/imagenet/grants/bob", headers=H_ALICE).status_code == 200
            for body, headers in ((JOB, H_ALICE), ({**JOB, "dataset_owner": "alice"}, H_BOB)):
                for _ in range(2):  # the second: every cache warm
                    seen.clear()
                    assert client.post("/v1/jobs", json=body, headers=headers).status_code == 201
                statements = list(seen)
                # Reads: the dataset with the quota (+ the grant for bob's); then the insert.
                expected = 3 if headers is H_BOB else 2
                assert len(statements) == expected, statements
                assert statements[0].startswith("SELECT datasets.id") and "quotas" in statements[0], statements
                assert statements[-1].startswith("INSERT INTO jobs") and "tenant_job_counts" in statements[-1], statements
                # Nothing between taking the write lock and the insert: no statement before it
                # writes (the old `UPDATE settings` took the lock first) and none reads after it.
                assert not any(s.startswith(("UPDATE", "DELETE")) for s in statements), statements
    finally:
        service.close()
