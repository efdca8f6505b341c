"""The data manager's trust boundary: who may set allocations (the scheduler's token), what a
node agent's token may do (its own clients only), bodies before authentication, and the CLI's
refusal to listen beyond loopback without tokens."""

from __future__ import annotations

import subprocess

import pytest
from fastapi.testclient import TestClient

from datamanager.app import create_app
from datamanager.auth import DataManagerAuth
from datamanager.client import DataManagerClient, DataManagerError

from dataplane_helpers import free_port, silod_cmd  # noqa: I001 - sibling test helper

SCHED = "scheduler-token-0123456789"
AGENT = "agent-token-0123456789abc"
H_SCHED = {"Authorization": f"Bearer {SCHED}"}
H_AGENT = {"Authorization": f"Bearer {AGENT}"}
REG = {"client_id": "n1-j1-1", "node": "n1", "dataset": "coco", "job": "j1"}


@pytest.fixture
def client(tmp_path):  # type: ignore[no-untyped-def]
    (tmp_path / "state").mkdir()
    app = create_app(tmp_path / "state", DataManagerAuth.from_tokens(SCHED, AGENT))
    with TestClient(app) as c:
        yield c


def test_allocations_need_the_scheduler_token(client: TestClient) -> None:
    for headers in ({}, {"Authorization": "Bearer guess-guess-guess"}, H_AGENT):
        r = client.put("/v1/datasets/coco/cache", json={"bytes": 1e9}, headers=headers)
        assert r.status_code in (401, 403), (headers, r.status_code)
        r = client.put("/v1/jobs/j1/remote-io", json={"bytes_per_s": 1e9}, headers=headers)
        assert r.status_code in (401, 403)
        assert client.get("/v1/status", headers=headers).status_code in (401, 403)
    assert client.put("/v1/datasets/coco/cache", json={"bytes": 1e9}, headers=H_AGENT).status_code == 403
    assert client.put("/v1/datasets/coco", json={}, headers=H_SCHED).status_code == 200
    assert client.put("/v1/datasets/coco/cache", json={"bytes": 1e9}, headers=H_SCHED).status_code == 200
    assert client.get("/v1/status", headers=H_SCHED).json()["datasets"]["coco"]["allocated_bytes"] == 1e9
    assert client.get("/healthz").status_code == 200


def test_agent_token_registers_and_heartbeats_its_clients_only(client: TestClient) -> None:
    client.put("/v1/datasets/coco", json={}, headers=H_SCHED)
    assert client.put("/v1/datasets/coco/cache", json={"bytes": 5e9}, headers=H_SCHED).status_code == 200
    r = client.post("/v1/clients", json=REG, headers=H_AGENT)
    assert r.status_code == 200 and r.json()["allocation"]["cache_bytes"] == 5e9
    assert client.put("/v1/clients/n1-j1-1/heartbeat", json={"stats": {}}, headers=H_AGENT).status_code == 200
    assert client.post("/v1/clients", json=REG).status_code == 401
    assert client.delete("/v1/jobs/j1", headers=H_AGENT).status_code == 403
    assert client.delete("/v1/clients/n1-j1-1", headers=H_AGENT).status_code == 200


def test_big_body_without_token_is_401_and_with_token_413(client: TestClient) -> None:
    big = b"x" * (2 << 20)
    r = client.put("/v1/datasets/coco/cache", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 401
    r = client.put("/v1/datasets/coco/cache", content=big, headers={**H_SCHED, "Content-Type": "application/json"})
    assert r.status_code == 413


def test_typed_client_sends_its_token(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "state").mkdir()
    app = create_app(tmp_path / "state", DataManagerAuth.from_tokens(SCHED, AGENT))
    with TestClient(app, base_url="http://dm") as tc:
        dm = DataManagerClient("http://dm", transport=tc._transport, token=SCHED)
        assert dm.allocate_cache_size("imagenet", 1e9).cache_bytes == 1e9
        monkeypatch.setenv("SILOD_DM_TOKEN", AGENT)
        agent = DataManagerClient("http://dm", transport=tc._transport)
        with pytest.raises(DataManagerError):
            agent.allocate_cache_size("imagenet", 2e9)


def test_cli_refuses_unauthenticated_non_loopback(tmp_path) -> None:
    env_cmd = [*silod_cmd(), "datamanager", "--listen", "0.0.0.0:7999", "--state", str(tmp_path / "s")]
    proc = subprocess.run(env_cmd, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in __import__("os").environ.items() if not k.startswith("SILOD_DM_")})
    assert proc.returncode == 2 and "loopback" in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------ issue 20, finding 1: node-bound agents

N1_TOKEN, N2_TOKEN = "node-n1-agent-token-0001", "node-n2-agent-token-0002"


@pytest.fixture
def bound(tmp_path):  # type: ignore[no-untyped-def]
    (tmp_path / "state").mkdir()
    (tmp_path / "agents").write_text(f"# node:token\nn1:{N1_TOKEN}\nn2:{N2_TOKEN}\n")
    import os

    old = os.environ.get("SILOD_DM_AGENT_TOKENS_FILE")
    os.environ["SILOD_DM_AGENT_TOKENS_FILE"] = str(tmp_path / "agents")
    os.environ["SILOD_DM_SCHEDULER_TOKEN"] = SCHED
    try:
        auth = DataManagerAuth.from_env()
    finally:
        del os.environ["SILOD_DM_SCHEDULER_TOKEN"]
        if old is None:
            del os.environ["SILOD_DM_AGENT_TOKENS_FILE"]
        else:
            os.environ["SILOD_DM_AGENT_TOKENS_FILE"] = old
    with TestClient(create_app(tmp_path / "state", auth)) as c:
        # What the scheduler pushes (scheduler_process.push_placements): both nodes run d1-coco.
        assert c.put("/v1/placements", json={"nodes": {"n1": ["d1-coco"], "n2": ["d1-coco"]}},
                     headers=H_SCHED).status_code == 200
        yield c


def test_a_node_bound_agent_acts_only_on_its_own_nodes_clients(bound) -> None:
    """Issue 20: with the one shared agent token, one node's agent took over and deleted another
    node's client and reported cached_bytes = 1e15 for another tenant's dataset."""
    c = bound
    h1, h2 = {"Authorization": f"Bearer {N1_TOKEN}"}, {"Authorization": f"Bearer {N2_TOKEN}"}
    assert c.put("/v1/datasets/d1-coco/cache", json={"bytes": "10GB"}, headers=h1).status_code == 403
    assert c.put("/v1/datasets/d1-coco", json={}, headers=H_SCHED).status_code == 200
    assert c.put("/v1/datasets/d1-coco/cache", json={"bytes": "10GB"}, headers=H_SCHED).status_code == 200
    reg = {**REG, "dataset": "d1-coco", "job": "node-n1_d1-coco"}  # a node mount (contract.names.node_mount_job)
    reg2 = {**reg, "node": "n2", "job": "node-n2_d1-coco"}
    assert c.post("/v1/clients", json=reg, headers=h1).status_code == 200
    # n2's agent may not register a client as n1, nor heartbeat, take over or delete n1's client.
    r = c.post("/v1/clients", json={**reg, "client_id": "n1-j1-2"}, headers=h2)
    assert r.status_code == 403 and "n2" in r.json()["detail"]
    assert c.put(f"/v1/clients/{REG['client_id']}/heartbeat", json={"stats": {"cached_bytes": 10**15}},
                 headers=h2).status_code == 403
    # Nor take n1's client over by registering its id as a client of n2.
    assert c.post("/v1/clients", json=reg2, headers=h2).status_code == 403
    assert c.delete(f"/v1/clients/{REG['client_id']}", headers=h2).status_code == 403
    assert c.post("/v1/clients", json={**reg2, "client_id": "n2-j1-1"}, headers=h2).status_code == 200
    # Its own client's figures are believed only up to the dataset's allocation.
    assert c.put("/v1/clients/n2-j1-1/heartbeat", json={"stats": {"cached_bytes": 10**15}}, headers=h2).status_code == 200
    status = c.get("/v1/status", headers=H_SCHED).json()
    assert status["nodes"]["n2"]["datasets"]["d1-coco"]["cached_bytes"] == 10 * 10**9
    assert [cl["node"] for cl in status["clients"] if cl["client_id"] == REG["client_id"]] == ["n1"]
    assert c.delete(f"/v1/clients/{REG['client_id']}", headers=h1).status_code == 200


def test_a_node_bound_agent_registers_only_its_nodes_mounts(bound) -> None:
    """Issue 20 audit: a node's agent joined a tenant's job (or another node's mount) as one more
    live worker, which divides that job's remote IO by one more: it registers only clients of its
    own node's mount jobs, `node-<node>_<dataset key>`."""
    c = bound
    h1 = {"Authorization": f"Bearer {N1_TOKEN}"}
    assert c.put("/v1/jobs/j1/remote-io", json={"bytes_per_s": "100MB/s", "workers": 1}, headers=H_SCHED).status_code == 404
    assert c.put("/v1/datasets/d1-coco", json={}, headers=H_SCHED).status_code == 200
    assert c.put("/v1/jobs/j1", json={"dataset": "d1-coco", "workers": 1}, headers=H_SCHED).status_code == 200
    assert c.put("/v1/jobs/j1/remote-io", json={"bytes_per_s": "100MB/s"}, headers=H_SCHED).status_code == 200
    for job in ("j1", "node-n2_d1-coco", "node-n1_d2-other"):
        r = c.post("/v1/clients", json={"client_id": f"x-{job}", "node": "n1", "dataset": "d1-coco", "job": job}, headers=h1)
        assert r.status_code == 403 and "node-n1_d1-coco" in r.json()["detail"], r.text
    assert c.get("/v1/jobs/j1", headers=H_SCHED).json()["bytes_per_s"] == 100e6
    assert c.get("/v1/status", headers=H_SCHED).json()["jobs"]["j1"]["live_clients"] == 0
    ok = c.post("/v1/clients", json={"client_id": "m1", "node": "n1", "dataset": "d1-coco", "job": "node-n1_d1-coco"},
                headers=h1)
    assert ok.status_code == 200, ok.text


def test_node_agent_tokens_file_errors_name_the_line(tmp_path) -> None:
    from datamanager.auth import parse_node_tokens

    with pytest.raises(ValueError, match="agents:2"):
        parse_node_tokens("n1:node-n1-agent-token-0001\nN1 bad:x\n", "agents")
    with pytest.raises(ValueError, match="twice"):
        parse_node_tokens("n1:node-n1-agent-token-0001\nn1:node-n1-agent-token-0002\n", "agents")
    with pytest.raises(ValueError, match="shorter"):
        parse_node_tokens("n1:short\n", "agents")


def test_expensive_bodies_and_two_authorization_headers_are_refused(client) -> None:  # type: ignore[no-untyped-def]
    """The data manager's share of issue 20's findings 4 and 6."""
    assert client.post("/v1/clients", json=REG, headers=H_AGENT).status_code == 200
    huge = b'{"stats": {"x": [' + b",".join([b"1"] * 20_000) + b"]}}"
    r = client.put(f"/v1/clients/{REG['client_id']}/heartbeat", content=huge,
                   headers={**H_AGENT, "content-type": "application/json"})
    assert r.status_code == 422 and "list of 20000 items" in r.json()["detail"], r.text[:300]
    both = [("Authorization", f"Bearer {AGENT}"), ("Authorization", f"Bearer {SCHED}")]
    assert client.get("/v1/status", headers=both).status_code == 400


def test_the_shared_agent_token_is_warned_about(tmp_path) -> None:
    """Issue 20 review: SILOD_DM_AGENT_TOKEN, one token for every node, was accepted without a word."""
    import os
    import signal

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SILOD_DM_")},
           "SILOD_DM_SCHEDULER_TOKEN": SCHED, "SILOD_DM_AGENT_TOKEN": AGENT}
    proc = subprocess.Popen([*silod_cmd(), "datamanager", "--listen", f"127.0.0.1:{free_port()}", "--state", str(tmp_path / "s")],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stderr.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert "SILOD_DM_AGENT_TOKEN is one token for every node" in line and "SILOD_DM_AGENT_TOKENS_FILE" in line, line
