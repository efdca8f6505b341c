"""The node agent mounts a tenant's dataset with that tenant's credential, or anonymously, never
with the node's own cloud keys (issue 18). The scheduler hands the dataset owner's credential to
node agents only (`GET /v1/datasets/{name}/source-credential`, `--node-agent` tokens); the agent
puts it into the environment of that one `silod mount` process (fuse_client/agent/volumes.py)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fuse_client.agent.datasets import DatasetSource, SchedulerResolver
from fuse_client.agent.volumes import mount_env

try:
    from test_api import H_ALICE, H_BOB, IMAGENET, TOKENS, make_app
except ImportError:
    from tests.test_api import H_ALICE, H_BOB, IMAGENET, TOKENS, make_app


@pytest.fixture
def api(tmp_path):  # type: ignore[no-untyped-def]
    app, service = make_app(f"sqlite:///{tmp_path / 'agent.db'}", tmp_path, run_loop=False, node_agents=["bob=n1"])
    try:
        with TestClient(app) as c:
            c.service = service  # type: ignore[attr-defined]
            yield c
    finally:
        service.close()


def test_only_a_node_agent_reads_a_datasets_source_credential(api):
    cred = {"name": "prod", "access_key_id": "AKIAALICE", "secret_access_key": "alice-secret-key"}
    assert api.post("/v1/credentials", json=cred, headers=H_ALICE).status_code == 201
    assert api.post("/v1/datasets", json={**IMAGENET, "credential": "prod"}, headers=H_ALICE).status_code == 201
    assert api.post("/v1/datasets", json={**IMAGENET, "name": "open"}, headers=H_ALICE).status_code == 201
    path = f"/v1/datasets/{IMAGENET['name']}/source-credential"
    # bob's node n1 gets the credential only once a job reading the dataset has a pod there
    # (tests/test_agent_credential_scope.py covers the refusals).
    assert api.get(path, params={"owner": "alice"}, headers=H_BOB).status_code == 403
    import uuid

    from scheduler.service.consumption import AdmittedPod, ConsumptionStore

    pods = []
    for ds in (IMAGENET["name"], "open"):
        r = api.post("/v1/jobs", json={"name": f"j-{ds}", "gpus": 1, "dataset": ds, "epochs": 1,
                                       "ideal_throughput": "100MB/s"}, headers=H_ALICE)
        assert r.status_code == 201, r.text
        pods.append(AdmittedPod(str(uuid.uuid4()), r.json()["id"], "n1", "alice", f"j-{ds}-0"))
    ConsumptionStore(api.service.sessions).record_pods(pods)
    # The tenant herself never gets the secret back from the API; nor does anyone but an agent.
    assert api.get(path, params={"owner": "alice"}, headers=H_ALICE).status_code == 403
    r = api.get(path, params={"owner": "alice"}, headers=H_BOB)  # bob's token is a node agent's here
    assert r.status_code == 200 and r.json()["credential"]["secret_access_key"] == "alice-secret-key"
    assert api.get("/v1/datasets/open/source-credential", params={"owner": "alice"},
                   headers=H_BOB).json() == {"credential": None}
    assert api.get("/v1/datasets/nope/source-credential", params={"owner": "alice"}, headers=H_BOB).status_code == 404

    # The agent's resolver: the owner's credential for a credentialed dataset, none (anonymous) otherwise.
    resolver = SchedulerResolver(str(api.base_url), TOKENS["bob"], client=api)
    src = resolver.resolve("alice", IMAGENET["name"])
    assert src.credential is not None and src.credential.access_key_id == "AKIAALICE"
    assert "alice-secret-key" not in repr(src)
    assert resolver.resolve("alice", "open").credential is None


def test_a_mount_gets_the_tenants_credential_or_anonymous_and_never_the_nodes_keys(monkeypatch):
    from contract.credentials import SourceCredential

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "NODE-KEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "node-secret")
    monkeypatch.setenv("SILOD_SOURCE_ACCESS_KEY_ID", "LEFTOVER")
    monkeypatch.setenv("SILOD_AGENT_TOKEN", "agent-token")
    anon = mount_env(DatasetSource("alice", "ds", "s3://b/ds"))
    assert anon["SILOD_SOURCE_ANONYMOUS"] == "1"
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "SILOD_SOURCE_ACCESS_KEY_ID", "SILOD_AGENT_TOKEN"} & set(anon)
    owned = mount_env(DatasetSource("alice", "ds", "s3://b/ds", credential=SourceCredential("AKIAALICE", "s3cr3t")))
    assert owned["SILOD_SOURCE_ACCESS_KEY_ID"] == "AKIAALICE" and owned["SILOD_SOURCE_SECRET_ACCESS_KEY"] == "s3cr3t"
    assert "SILOD_SOURCE_ANONYMOUS" not in owned and "AWS_ACCESS_KEY_ID" not in owned
