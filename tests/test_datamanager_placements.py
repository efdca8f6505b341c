"""A node's agent registers with the data manager only mounts of datasets its node has a reason to
mount (issue 20, Build 1): the scheduler pushes, from its own record of where admitted jobs' pods
run (`workload_pods`), node -> storage keys (PUT /v1/placements, the scheduler's token only); a
node-bound agent registering any other dataset's mount gets 403."""

from __future__ import annotations

import uuid

from fastapi.testclient import TestClient
from sqlalchemy.orm import sessionmaker

from contract.names import node_mount_job, storage_key
from datamanager.app import create_app
from datamanager.auth import DataManagerAuth
from scheduler.service.consumption import AdmittedPod, ConsumptionStore

SCHED = "scheduler-token-0123456789"
NODE_TOKENS = {"node-a": "agent-a-token-0123456789", "node-b": "agent-b-token-0123456789"}
H_SCHED = {"Authorization": f"Bearer {SCHED}"}
H = {n: {"Authorization": f"Bearer {t}"} for n, t in NODE_TOKENS.items()}


def register(c: TestClient, node: str, key: str, headers: dict[str, str]):  # type: ignore[no-untyped-def]
    body = {"client_id": f"{node}-{key}", "node": node, "dataset": key, "job": node_mount_job(node, key)}
    return c.post("/v1/clients", json=body, headers=headers)


def placements_from_the_schedulers_record(tmp_path) -> tuple[dict[str, list[str]], str, str]:
    """The scheduler's side: alice's `files` read by a job with a pod on node-a; bob's `files` by
    a finished job whose pod was on node-a, and by nothing else."""
    from scheduler.service.db import open_database
    from scheduler.service.db.models import Dataset, Job, JobState

    sessions = sessionmaker(open_database(f"sqlite:///{tmp_path / 's.db'}"), expire_on_commit=False)
    with sessions.begin() as s:
        ds = {}
        for owner in ("alice", "bob"):
            ds[owner] = Dataset(name="files", uri=f"s3://b/{owner}", size=1e9, owner=owner, created_at=0.0)
            s.add(ds[owner])
        s.flush()
        for i, (owner, state) in enumerate((("alice", JobState.RUNNING), ("bob", JobState.FINISHED)), start=1):
            s.add(Job(id=i, name=f"j{i}", owner=owner, gpus=1, dataset_id=ds[owner].id, ideal_throughput=1e8,
                      epochs=1.0, total_bytes=1e9, consumed_bytes=0.0, state=state, submit_time=1.0, message=""))
        keys = {o: storage_key(d.id, d.name) for o, d in ds.items()}
    store = ConsumptionStore(sessions)
    store.record_pods([AdmittedPod(str(uuid.uuid4()), "1", "node-a", "alice", "j1-0"),
                       AdmittedPod(str(uuid.uuid4()), "2", "node-a", "bob", "j2-0")])
    return store.placements(), keys["alice"], keys["bob"]


def test_a_node_agent_registers_only_mounts_its_node_has_a_reason_for(tmp_path):
    placements, alice_key, bob_key = placements_from_the_schedulers_record(tmp_path)
    assert placements == {"node-a": [alice_key]}  # the finished job gives no reason
    (tmp_path / "dm").mkdir()
    app = create_app(tmp_path / "dm", DataManagerAuth.from_tokens(SCHED, None, node_agents=NODE_TOKENS))
    with TestClient(app) as c:
        # Before the scheduler's first push a node's agent registers nothing (it registered any
        # dataset on its own node until 2026-11-28): 503, retried at the next heartbeat.
        r = register(c, "node-a", bob_key, H["node-a"])
        assert r.status_code == 503 and "PUT /v1/placements" in r.json()["detail"] and r.headers["retry-after"], r.text
        # Only the scheduler sets placements.
        assert c.put("/v1/placements", json={"nodes": placements}, headers=H["node-a"]).status_code == 403
        assert c.put("/v1/placements", json={"nodes": placements}, headers=H_SCHED).status_code == 200
        assert register(c, "node-a", alice_key, H["node-a"]).status_code == 200
        # bob's dataset of the same name: no active job of it on node-a.
        r = register(c, "node-a", bob_key, H["node-a"])
        assert r.status_code == 403 and "no reason to mount" in r.json()["detail"]
        # alice's dataset is used on node-a only: node-b's agent may not register it.
        assert register(c, "node-b", alice_key, H["node-b"]).status_code == 403
        # Once the scheduler places it on node-b, it may; placements survive a restart.
        assert c.put("/v1/placements", json={"nodes": {**placements, "node-b": [alice_key]}},
                     headers=H_SCHED).status_code == 200
        assert register(c, "node-b", alice_key, H["node-b"]).status_code == 200
        assert c.put("/v1/placements", json={"nodes": {"Bad Node!": []}}, headers=H_SCHED).status_code in (400, 422)
    app = create_app(tmp_path / "dm", DataManagerAuth.from_tokens(SCHED, None, node_agents=NODE_TOKENS))
    with TestClient(app) as c:
        assert register(c, "node-a", bob_key, H["node-a"]).status_code == 403


def test_the_scheduler_pushes_placements_when_they_change_and_only_with_a_pod_record(tmp_path):
    from types import SimpleNamespace

    from scheduler.service.scheduler_process import SchedulerService

    placements, alice_key, _ = placements_from_the_schedulers_record(tmp_path)
    pushed: list[dict] = []

    class Pusher:
        def set_placements(self, nodes):  # type: ignore[no-untyped-def]
            pushed.append(nodes)

    class Store:
        def placements(self):  # type: ignore[no-untyped-def]
            return placements

    svc = SimpleNamespace(backend=SimpleNamespace(consumption=Store()), pusher=Pusher(), _pushed_placements=None)
    SchedulerService.push_placements(svc)  # type: ignore[arg-type]
    SchedulerService.push_placements(svc)  # type: ignore[arg-type]
    assert pushed == [{"node-a": [alice_key]}]  # once: unchanged maps are not pushed again
    # A backend without a record of pods (local, null): nothing pushed, so nothing is refused.
    svc = SimpleNamespace(backend=SimpleNamespace(), pusher=Pusher(), _pushed_placements=None)
    SchedulerService.push_placements(svc)  # type: ignore[arg-type]
    assert len(pushed) == 1
