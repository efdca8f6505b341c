"""A node agent gets a tenant's dataset source credential only when its node has a reason to mount
that dataset (issue 20, Build 1; "never read data with more rights than the data's owner has"):
an active silod job using the dataset has a pod bound to the agent's node, in the scheduling
leader's own record (`workload_pods`, from the API server). Another node's dataset, another
tenant's dataset, a finished job's dataset and an agent token bound to no node: 403. Real SQLite
file, the real app over HTTP semantics (TestClient)."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from scheduler.service.api.app import create_app
from scheduler.service.cli import build_service, make_token_store
from scheduler.service.consumption import AdmittedPod, ConsumptionStore

ADMIN = "admin-token-0123456789"
TOKENS = {"alice": "alice-token-0001", "bob": "bob-token-00002", "agent-a": "agent-a-token-0001",
          "agent-b": "agent-b-token-0002", "lookup": "lookup-agent-token"}
H = {u: {"Authorization": f"Bearer {t}"} for u, t in TOKENS.items()}


@pytest.fixture
def world(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    (tmp_path / "tokens").write_text("".join(f"{u}:{t}\n" for u, t in TOKENS.items()))
    service = build_service(db=f"sqlite:///{tmp_path / 'scope.db'}", backend="null", policy="fifo", round_s=360,
                            gpus="8", gpus_per_node="4", cache="200GB", remote_io="1GB/s", state_dir=tmp_path / "state",
                            node_agents=["agent-a=node-a", "agent-b=node-b", "lookup"])
    monkeypatch.setenv("SILOD_ADMIN_TOKEN", ADMIN)
    tokens = make_token_store(service.engine, tmp_path / "state", tmp_path / "tokens")
    app = create_app(service, tokens, run_loop=False, max_body=64 * 1024)
    try:
        with TestClient(app) as c:
            c.silod_service = service  # type: ignore[attr-defined]
            for tenant in ("alice", "bob"):
                cred = {"name": "prod", "access_key_id": f"AKIA{tenant.upper()}", "secret_access_key": f"{tenant}-secret"}
                assert c.post("/v1/credentials", json=cred, headers=H[tenant]).status_code == 201
                for ds in ("on-a", "on-b"):
                    r = c.post("/v1/datasets", json={"name": ds, "uri": f"s3://b/{tenant}/{ds}", "size": "10GB",
                                                     "credential": "prod"}, headers=H[tenant])
                    assert r.status_code == 201, r.text
            jobs = {}
            for ds in ("on-a", "on-b"):
                r = c.post("/v1/jobs", json={"name": f"j-{ds}", "gpus": 1, "dataset": ds, "epochs": 1,
                                             "ideal_throughput": "100MB/s"}, headers=H["alice"])
                assert r.status_code == 201, r.text
                jobs[ds] = r.json()["id"]
            # The scheduling leader's record: alice's job on `on-a` has a pod on node-a, the one on
            # `on-b` a pod on node-b. bob's datasets are used nowhere.
            ConsumptionStore(service.sessions).record_pods([
                AdmittedPod(str(uuid.uuid4()), jobs["on-a"], "node-a", "alice", "j-on-a-0"),
                AdmittedPod(str(uuid.uuid4()), jobs["on-b"], "node-b", "alice", "j-on-b-0")])
            yield c, jobs
    finally:
        service.close()


def cred(c: TestClient, agent: str, owner: str, ds: str):  # type: ignore[no-untyped-def]
    return c.get(f"/v1/datasets/{ds}/source-credential", params={"owner": owner}, headers=H[agent])


def test_an_agent_gets_the_credential_of_a_dataset_its_node_mounts(world):
    c, _ = world
    r = cred(c, "agent-a", "alice", "on-a")
    assert r.status_code == 200 and r.json()["credential"]["secret_access_key"] == "alice-secret"
    r = cred(c, "agent-b", "alice", "on-b")
    assert r.status_code == 200 and r.json()["credential"]["access_key_id"] == "AKIAALICE"


def test_an_agent_gets_403_for_a_dataset_used_only_on_another_node(world):
    c, _ = world
    r = cred(c, "agent-a", "alice", "on-b")
    assert r.status_code == 403 and "node-a has no reason to mount" in r.json()["detail"]
    assert "secret" not in r.text.replace("no reason", "")
    assert cred(c, "agent-b", "alice", "on-a").status_code == 403


def test_an_agent_gets_403_for_another_tenants_dataset_of_the_same_name(world):
    c, _ = world
    # alice's `on-a` is mounted on node-a; bob's dataset of the same name is not.
    r = cred(c, "agent-a", "bob", "on-a")
    assert r.status_code == 403 and "bob-secret" not in r.text


def test_an_agent_token_bound_to_no_node_gets_no_credential(world):
    c, _ = world
    r = cred(c, "lookup", "alice", "on-a")
    assert r.status_code == 403 and "bound to no node" in r.json()["detail"]
    # It may still look the dataset record up (no secret in it), as before.
    assert c.get("/v1/datasets/on-a", params={"owner": "alice"}, headers=H["lookup"]).status_code == 200


def test_a_finished_job_no_longer_gives_its_node_a_reason(world):
    c, jobs = world
    assert cred(c, "agent-a", "alice", "on-a").status_code == 200
    assert c.delete(f"/v1/jobs/{jobs['on-a']}", headers=H["alice"]).status_code in (200, 202, 204)
    assert cred(c, "agent-a", "alice", "on-a").status_code == 403


def test_tenants_still_never_read_a_credential(world):
    c, _ = world
    assert cred(c, "alice", "alice", "on-a").status_code == 403


def test_the_agents_resolver_says_why_it_got_no_credential(world):
    from estimator.errors import UserError
    from fuse_client.agent.datasets import SchedulerResolver

    c, _ = world
    resolver = SchedulerResolver(str(c.base_url), TOKENS["agent-b"], client=c)
    with pytest.raises(UserError, match="node-b has no reason to mount"):
        resolver.resolve("alice", "on-a")
    assert resolver.resolve("alice", "on-b").credential.secret_access_key == "alice-secret"


def test_an_api_server_that_cannot_answer_is_a_503_not_a_credential(world, tmp_path):
    """With agent pods' tokens checked at the API server, a node with no recorded job asks it for
    the node's pods; when it cannot answer, the look-up is a 503 (retry), never the secret."""
    import dataclasses

    import httpx

    from http_guard.agent_identity import AgentReviewer, KubeAPI

    c, _ = world
    token = tmp_path / "kube-token"
    token.write_text("t")
    down = AgentReviewer(KubeAPI("https://127.0.0.1:1", token, None), frozenset({"system:serviceaccount:ns:sa"}),
                         transport=httpx.MockTransport(lambda req: httpx.Response(500, text="down")))
    service = c.silod_service  # type: ignore[attr-defined]
    service.catalogue.config = dataclasses.replace(service.catalogue.config, agent_reviewer=down)
    r = cred(c, "agent-a", "alice", "on-b")  # node-a has no job of on-b: the API server is asked
    assert r.status_code == 503 and "alice-secret" not in r.text, r.text
    assert cred(c, "agent-a", "alice", "on-a").status_code == 200  # the record suffices: not asked


def test_the_csi_controller_provisions_a_credentialed_dataset_without_reading_its_credential(world, tmp_path):
    """The CSI controller's shared look-up token (deploy/base: --node-agent agent, bound to no node)
    provisions a PVC of alice's dataset that names a credential. Provisioning reads no data, so it
    never asks for the credential: before, it did, got 403, and every such PVC stayed Pending."""
    import grpc

    from fuse_client.agent.csi import csi_pb2, csi_pb2_grpc
    from fuse_client.agent.datasets import SchedulerResolver
    from fuse_client.agent.server import ControllerServer

    c, _ = world
    asked: list[str] = []
    c.event_hooks["request"].append(lambda request: asked.append(request.url.path))
    server = ControllerServer(tmp_path / "controller.sock", SchedulerResolver("http://testserver", TOKENS["lookup"], client=c))
    server.start()
    try:
        with grpc.insecure_channel(f"unix://{tmp_path / 'controller.sock'}") as ch:
            mode = csi_pb2.VolumeCapability.AccessMode(mode=csi_pb2.VolumeCapability.AccessMode.MULTI_NODE_READER_ONLY)
            cap = csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(), access_mode=mode)
            got = csi_pb2_grpc.ControllerStub(ch).CreateVolume(csi_pb2.CreateVolumeRequest(
                name="pvc-1", volume_capabilities=[cap], parameters={
                    "csi.storage.k8s.io/pvc/name": "on-a", "csi.storage.k8s.io/pvc/namespace": "alice"}), timeout=30)
    finally:
        server.stop()
    assert got.volume.volume_context["dataset"] == "on-a"
    assert asked == ["/v1/datasets/on-a"], asked  # never /source-credential
