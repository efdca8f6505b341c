"""Trusted consumption reports (POST /v1/agents/{node}/consumption), as attacks and on both
databases: only a node agent whose token is bound to the node may report, only for pods silod
attributed to a job on that node, and counters only ever rise. A real SQLite file and a real
PostgreSQL server (tests/pg_fixture.py)."""

from __future__ import annotations

import os
import uuid

import pytest
from fastapi.testclient import TestClient

from scheduler.service.api.app import create_app
from scheduler.service.consumption import AdmittedPod, ConsumptionStore
from scheduler.service.cli import build_service, make_token_store

try:
    from pg_fixture import _pg_session, db_url, pg_url  # noqa: F401
except ImportError:
    from tests.pg_fixture import _pg_session, db_url, pg_url  # noqa: F401

ADMIN = "admin-token-0123456789"
TOKENS = {"alice": "alice-token-0001", "bob": "bob-token-00002", "agent-n1": "agent-n1-token-01",
          "agent-n2": "agent-n2-token-02", "lookup": "lookup-agent-token"}
H = {u: {"Authorization": f"Bearer {t}"} for u, t in TOKENS.items()}


def counters(read: int, hit: int | None = None, hits: int = 1, misses: int = 1) -> dict[str, int]:
    hit = read // 2 if hit is None else hit
    return {"read_bytes": read, "hit_bytes": hit, "miss_bytes": read - hit, "hits": hits, "misses": misses}


@pytest.fixture
def world(db_url, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    (tmp_path / "tokens").write_text("".join(f"{u}:{t}\n" for u, t in TOKENS.items()))
    service = build_service(db=db_url, backend="null", policy="fifo", round_s=360, gpus="8", gpus_per_node="4",
                            cache="200GB", remote_io="1GB/s", state_dir=tmp_path / "state",
                            node_agents=["agent-n1=n1", "agent-n2=n2", "lookup"])
    monkeypatch.setenv("SILOD_ADMIN_TOKEN", ADMIN)
    tokens = make_token_store(service.engine, tmp_path / "state", tmp_path / "tokens")
    app = create_app(service, tokens, run_loop=False, max_body=64 * 1024)
    with TestClient(app) as client:
        r = client.post("/v1/datasets", json={"name": "ds", "uri": "s3://b/ds", "size": "10GB"}, headers=H["alice"])
        assert r.status_code == 201, r.text
        r = client.post("/v1/jobs", json={"name": "j", "gpus": 1, "dataset": "ds", "epochs": 1,
                                          "ideal_throughput": "100MB/s"}, headers=H["alice"])
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        # The scheduling leader's record, from the API server: which pods belong to the job, where.
        store = ConsumptionStore(service.sessions)
        pods = {"a": str(uuid.uuid4()), "b": str(uuid.uuid4())}
        store.record_pods([AdmittedPod(pods["a"], job_id, "n1", "alice", "j-0"),
                           AdmittedPod(pods["b"], job_id, "n2", "alice", "j-1")])
        yield client, job_id, pods, store
    service.close()


def report(client, node: str, who: str, pods: dict[str, dict[str, int]]):  # type: ignore[no-untyped-def]
    return client.post(f"/v1/agents/{node}/consumption", headers=H[who],
                       json={"pods": [{"pod_uid": u, **c} for u, c in pods.items()]})


def measured(client, job_id: str, who: str = "alice"):  # type: ignore[no-untyped-def]
    r = client.get(f"/v1/jobs/{job_id}", headers=H[who])
    assert r.status_code == 200, r.text
    return r.json()["measured"]


def test_reports_raise_counters_monotonically_and_get_job_shows_them(world):
    client, job_id, pods, _ = world
    assert measured(client, job_id) is None
    r = report(client, "n1", "agent-n1", {pods["a"]: counters(1000, hits=3, misses=2)})
    assert r.status_code == 200 and r.json() == {"accepted": 1, "ignored": []}, r.text
    m = measured(client, job_id)
    assert (m["read_bytes"], m["hit_bytes"], m["miss_bytes"], m["hits"], m["misses"], m["pods"]) == (1000, 500, 500, 3, 2, 1)
    # A replayed or lower report (e.g. an old one re-sent, or a restarted mount) moves nothing back.
    assert report(client, "n1", "agent-n1", {pods["a"]: counters(400, hits=1, misses=1)}).status_code == 200
    assert measured(client, job_id)["read_bytes"] == 1000
    assert report(client, "n1", "agent-n1", {pods["a"]: counters(3000, hits=9, misses=2)}).status_code == 200
    assert report(client, "n2", "agent-n2", {pods["b"]: counters(500)}).status_code == 200
    m = measured(client, job_id)
    assert (m["read_bytes"], m["hits"], m["pods"]) == (3500, 10, 2)
    # Another tenant does not see the job at all.
    assert client.get(f"/v1/jobs/{job_id}", headers=H["bob"]).status_code == 404


def test_pods_miss_service_counters_reach_the_job_and_its_measured_service_time(world):
    """An agent's per-pod miss-service counters (misses delivered whole, their service time in us,
    their bytes) are raised like the others, summed per job in GET /v1/jobs/{id}, and the
    scheduling process reads them as the job's interval figures (_agent_rates), from which the
    measurement store learns the loader term's L and s (a Kubernetes pod's job has no data
    manager figure)."""
    client, job_id, pods, _ = world
    served = {"miss_service_count": 2, "miss_service_us": 8000, "miss_service_bytes": 400}
    assert report(client, "n1", "agent-n1", {pods["a"]: {**counters(1000, hits=3, misses=2), **served}}).status_code == 200
    assert report(client, "n2", "agent-n2", {pods["b"]: {**counters(500, hits=1, misses=1), "miss_service_count": 1,
                                                          "miss_service_us": 1000, "miss_service_bytes": 250}}).status_code == 200
    # lower counters (a replay) move nothing back
    assert report(client, "n1", "agent-n1", {pods["a"]: {**counters(1000, hits=3, misses=2), "miss_service_count": 1,
                                                          "miss_service_us": 10, "miss_service_bytes": 100}}).status_code == 200
    m = measured(client, job_id)
    assert (m["miss_service_count"], m["miss_service_us"], m["miss_service_bytes"]) == (3, 9000, 650)
    # An agent from before these counters: they read 0.
    assert report(client, "n1", "agent-n1", {pods["a"]: counters(2000, hits=5, misses=3)}).status_code == 200
    assert measured(client, job_id)["miss_service_count"] == 3

    from scheduler.service.scheduler_process import _service_counters

    sp = _Sched(world[3].sessions)  # the scheduling process's reader, on the same database
    sp._agent_rates([job_id], 100.0)
    out = sp._agent_rates([job_id], 110.0)[job_id]
    assert _service_counters(out) == (3.0, 0.009, 650.0)


class _Sched:
    """The scheduling process's agent reader alone (SchedulerService._agent_rates on its store)."""

    def __init__(self, sessions) -> None:  # type: ignore[no-untyped-def]
        import threading

        self.sessions, self._write_lock, self._consumed_seen = sessions, threading.RLock(), {}

    from scheduler.service.scheduler_process import SchedulerService as _S

    _agent_rates = _S._agent_rates


@pytest.mark.parametrize("extra", [
    {"miss_service_count": 3, "miss_service_us": 10, "miss_service_bytes": 10},  # more served than misses (1)
    {"miss_service_count": 1, "miss_service_us": 10, "miss_service_bytes": 10**6},  # more bytes than missed
    {"miss_service_count": 1, "miss_service_us": 3600 * 10**6 + 1, "miss_service_bytes": 10},  # over an hour a miss
    {"miss_service_count": 1, "miss_service_us": 10, "miss_service_bytes": 0},  # a served miss has bytes
    {"miss_service_count": 0, "miss_service_us": 0, "miss_service_bytes": 10},
    {"miss_service_count": -1, "miss_service_us": 0, "miss_service_bytes": 0},
    {"miss_service_count": 1, "miss_service_us": 1.5, "miss_service_bytes": 10},
])
def test_malformed_miss_service_counters_are_422(world, extra):
    client, job_id, pods, _ = world
    r = report(client, "n1", "agent-n1", {pods["a"]: {**counters(1000, hits=1, misses=1), **extra}})
    assert r.status_code == 422, r.text
    assert "miss_service" in r.text
    assert measured(client, job_id) is None


@pytest.mark.parametrize("who", ["alice", "bob", "lookup"])
def test_tenants_and_unbound_agents_get_403(world, who):
    client, job_id, pods, _ = world
    r = report(client, "n1", who, {pods["a"]: counters(10**12)})
    assert r.status_code == 403, r.text
    assert measured(client, job_id) is None


def test_admin_may_not_forge_measurements_either(world):
    client, job_id, pods, _ = world
    r = client.post("/v1/agents/n1/consumption", headers={"Authorization": f"Bearer {ADMIN}"},
                    json={"pods": [{"pod_uid": pods["a"], **counters(10**12)}]})
    assert r.status_code == 403


def test_an_agent_cannot_inflate_another_nodes_counters(world):
    client, job_id, pods, _ = world
    assert report(client, "n2", "agent-n2", {pods["b"]: counters(100)}).status_code == 200
    # Posting as the other node: refused outright.
    assert report(client, "n2", "agent-n1", {pods["b"]: counters(10**12)}).status_code == 403
    # Reporting the other node's pod as its own: ignored, with the reason.
    r = report(client, "n1", "agent-n1", {pods["b"]: counters(10**12)})
    assert r.status_code == 200 and r.json()["accepted"] == 0
    assert "runs on node n2, not n1" in r.json()["ignored"][0]["reason"]
    assert measured(client, job_id)["read_bytes"] == 100


def test_unknown_pods_are_ignored_with_a_reason(world):
    client, job_id, pods, _ = world
    stranger = str(uuid.uuid4())
    r = report(client, "n1", "agent-n1", {stranger: counters(10**9), pods["a"]: counters(10)})
    assert r.status_code == 200
    assert r.json()["accepted"] == 1
    assert r.json()["ignored"][0]["pod_uid"] == stranger
    assert "not a pod of a workload silod admitted" in r.json()["ignored"][0]["reason"]
    assert measured(client, job_id)["read_bytes"] == 10


def test_a_pod_keeps_its_first_job(world):
    client, job_id, pods, store = world
    assert store.record_pods([AdmittedPod(pods["a"], "999", "n2", "bob", "evil")]) == 0
    assert report(client, "n1", "agent-n1", {pods["a"]: counters(10)}).json()["accepted"] == 1


@pytest.mark.parametrize("body", [
    {"pods": [{"pod_uid": "not-a-uid", **counters(1)}]},
    {"pods": [{"pod_uid": str(uuid.uuid4()), "read_bytes": 10, "hit_bytes": 1, "miss_bytes": 1, "hits": 0, "misses": 0}]},
    {"pods": [{"pod_uid": str(uuid.uuid4()), **counters(-5, hit=0)}]},
    {"pods": [{"pod_uid": str(uuid.uuid4()), **counters(2**63, hit=0)}]},
    {"pods": [{"pod_uid": str(uuid.uuid4()), **counters(1), "node": "n2"}]},
    {"pods": [{"pod_uid": str(uuid.uuid4()), **counters(1)}] * 1001},
    {"pod": []},
])
def test_malformed_reports_are_422(world, body):
    client, job_id, _, _ = world
    r = client.post("/v1/agents/n1/consumption", headers=H["agent-n1"], json=body)
    assert r.status_code in (413, 422), r.text
    assert measured(client, job_id) is None


def test_body_cap_and_no_body_read_before_authorisation(world):
    client, _, _, _ = world
    big = b'{"pods": [' + b" " * (70 * 1024) + b"]}"
    r = client.post("/v1/agents/n1/consumption", headers={**H["agent-n1"], "content-type": "application/json"},
                    content=big)
    assert r.status_code == 413
    # A tenant is refused from the headers alone, whatever the body is.
    r = client.post("/v1/agents/n1/consumption", headers={**H["alice"], "content-type": "application/json"},
                    content=b"{not json")
    assert r.status_code == 403


def test_node_agent_binding_is_checked():
    from scheduler.service.types import ServiceError, parse_node_agents

    assert parse_node_agents(["a=n1", "b"]) == (frozenset({"a", "b"}), (("a", "n1"),))
    with pytest.raises(ServiceError, match="two nodes"):
        parse_node_agents(["a=n1", "a=n2"])
    with pytest.raises(ServiceError, match="USER=NODE"):
        parse_node_agents(["a="])


# ------------------------------------------------------------------ issue 20, finding 5: overflow


def test_counters_beyond_a_physical_bound_are_422(world):
    """2^62 bytes (4.6 EB) is no pod's read: refused at the API, naming the bound."""
    client, job_id, pods, _ = world
    r = report(client, "n1", "agent-n1", {pods["a"]: counters(2**62, hit=0)})
    assert r.status_code == 422, r.text
    assert measured(client, job_id) is None
    from scheduler.service.consumption import MAX_COUNTER

    assert MAX_COUNTER <= 2**53
    r = report(client, "n1", "agent-n1", {pods["a"]: counters(MAX_COUNTER, hit=0)})
    assert r.status_code == 200, r.text


def test_summing_huge_stored_counters_never_overflows_into_a_503(world):
    """Rows stored before the bound (or by a bug) whose SUM passes 2^63: the job's GET still
    answers 200 with the figures (SQLite's SUM raised 'integer overflow', which the service took
    for a database outage: a permanent 503 while /healthz said ok)."""
    client, job_id, pods, store = world
    from scheduler.service.consumption import PodReport

    for node, pod in (("n1", pods["a"]), ("n2", pods["b"])):
        store._raise_counters(node, "agent", int(job_id), PodReport(pod, 2**62, 0, 2**62, 2**62, 2**62), 1.0)
    r = client.get(f"/v1/jobs/{job_id}", headers=H["alice"])
    assert r.status_code == 200, r.text
    m = r.json()["measured"]
    assert m["pods"] == 2 and m["read_bytes"] >= 2**62


def test_a_query_error_on_one_row_is_not_reported_as_an_outage(world, monkeypatch):
    """A database error that concerns one request (not the connection) answers that request
    with a 500, never the 503 'database unavailable' that tells clients to retry forever."""
    client, job_id, _, store = world
    import sqlalchemy.exc

    from scheduler.service.consumption import ConsumptionStore

    def broken(self, job_ids, connection=None):  # type: ignore[no-untyped-def]
        raise sqlalchemy.exc.OperationalError("SELECT sum(...)", {}, Exception("integer overflow"))

    monkeypatch.setattr(ConsumptionStore, "measured", broken)
    r = client.get(f"/v1/jobs/{job_id}", headers=H["alice"])
    assert r.status_code == 500, r.text
    assert "unavailable" not in r.text
    monkeypatch.undo()
    assert client.get(f"/v1/jobs/{job_id}", headers=H["alice"]).status_code == 200
