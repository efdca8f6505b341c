"""Suspend-based admission of Kubernetes workloads by `silod serve --backend kubernetes`.

Runs against tests/k8s_emulator.py, an EMULATED API server (no real cluster can run here) that
enforces Job suspend semantics, resourceVersion conflicts, label selectors and Pod Security
admission; see its docstring for what is and is not emulated. The service, database, REST API
and Kubernetes client are the real ones.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from k8s_emulator import JOBSET, EmulatedCluster
from scheduler.service.api.app import create_app
from scheduler.backends.base import DatasetInfo, JobAllocation, JobSpec
from scheduler.service.api.auth import TokenStore, load_token_key
from scheduler.service.scheduler_process import ADMIN, Principal
from scheduler.service.cli import build_service

ADMIN_TOKEN = "admin-token-0123456789"
TOKENS = {"alice": "alice-token-0001", "bob": "bob-token-00002"}
H_ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}
H_BOB = {"Authorization": f"Bearer {TOKENS['bob']}"}
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}
ROOT = Principal(ADMIN, is_admin=True)

SAFE_CONTAINER = {
    "name": "train", "image": "busybox", "command": ["true"],
    "resources": {"limits": {"nvidia.com/gpu": "2"}},
    "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "runAsUser": 1000,
                        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}},
    "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
}

def _token_store(service, tokens_file):  # type: ignore[no-untyped-def]
    """The admin token and the tenants' tokens file, stored hashed in the service's database."""
    store = TokenStore(service.engine, load_token_key(tokens_file.parent / "token-key"), admin_token=ADMIN_TOKEN)
    store.import_file(tokens_file)
    return store



def kubectl_job(name: str, ns: str = "alice", *, gpus: int = 2, suspend: bool = True, dataset: str = "imagenet",
                epochs: str = "1", container: dict | None = None, queue: str = "default") -> dict:
    c = copy.deepcopy(container or SAFE_CONTAINER)
    c["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": ns, "labels": {"silod.io/queue": queue},
                     "annotations": {"silod.io/epochs": epochs, "silod.io/ideal-throughput": "500MB/s"}},
        "spec": {"suspend": suspend, "template": {"spec": {
            "restartPolicy": "Never", "containers": [c],
            "volumes": [{"name": "data", "csi": {"driver": "silod.io", "readOnly": True,
                                                 "volumeAttributes": {"dataset": dataset}}}]}}},
    }


@pytest.fixture
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster(crds=(JOBSET,)) as c:
        c.add_namespace("alice", RESTRICTED)
        c.add_namespace("bob", RESTRICTED)
        c.add_namespace("silod-system")
        c.add_node("n1", 4, cache="100GB", remote_io="500MB/s")
        c.add_node("n2", 4, cache="100GB", remote_io="500MB/s")
        yield c


@pytest.fixture
def stack(cluster, tmp_path):
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("".join(f"{u}:{t}\n" for u, t in TOKENS.items()))
    service = build_service(db=f"sqlite:///{tmp_path / 'k8s.db'}", backend="kubernetes", policy="fifo", round_s=360,
                            gpus="8", gpus_per_node="4", cache="200GB", remote_io="1GB/s",
                            state_dir=tmp_path / "state", backend_opts={"server": cluster.url})
    app = create_app(service, _token_store(service, tokens_file), run_loop=False)
    with TestClient(app) as client:
        for h in (H_ALICE, H_BOB):
            r = client.post("/v1/datasets", json={"name": "imagenet", "uri": "s3://d/imagenet", "size": "10GB"},
                            headers=h)
            assert r.status_code in (200, 201), r.text
        yield service, client
    service.close()


def create(cluster: EmulatedCluster, obj: dict, plural: str = "jobs", group: str = "batch") -> dict:
    ns = obj["metadata"]["namespace"]
    return cluster.call(lambda em: copy.deepcopy(em.create(em.resources[(group, plural)], ns, obj)))


def step(service) -> None:
    """One turn of the service loop, as `_loop` does it: events, then a round."""
    service.apply_events(service.backend.poll())
    service.run_round("test")
    service.apply_events(service.backend.poll())


def spec_of(rec) -> JobSpec:
    return JobSpec(rec.id, rec.name, rec.owner, rec.gpus, DatasetInfo(rec.dataset, "s3://d", 10e9),
                   rec.ideal_throughput, rec.total_bytes, 0.0)


def job_named(service, prefix: str):
    return next(j for j in service.list_jobs(ROOT) if j.name.startswith(prefix))


def test_a_kubectl_job_is_queued_admitted_on_chosen_nodes_and_finishes(cluster, stack):
    service, _ = stack
    create(cluster, kubectl_job("train-a"))
    service.apply_events(service.backend.poll())
    rec = job_named(service, "job.train-a.")
    assert rec.owner == "alice" and rec.gpus == 2 and rec.state == "queued"
    step(service)
    job = cluster.obj("jobs", "alice", "train-a", group="batch")
    assert job["spec"]["suspend"] is False
    terms = job["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    chosen = terms[0]["matchExpressions"][0]["values"]
    assert terms[0]["matchExpressions"][0]["key"] == "kubernetes.io/hostname" and len(chosen) == 1
    pods = cluster.wait(lambda: [p for p in cluster.pods_of("alice", "train-a") if p["spec"].get("nodeName")],
                        what="the Job controller's pod, scheduled")
    assert pods[0]["spec"]["nodeName"] in chosen
    assert service.get_job(ROOT, rec.id).state == "running"
    cluster.finish_pod("alice", pods[0]["metadata"]["name"])
    cluster.wait(lambda: any(c["type"] == "Complete" for c in
                             (cluster.obj("jobs", "alice", "train-a", group="batch").get("status") or {})
                             .get("conditions", [])), what="Complete")
    service.apply_events(service.backend.poll())
    assert service.get_job(ROOT, rec.id).state == "finished"
    # silod never deleted a pod or a workload: every DELETE came from the emulated controllers.
    assert not [r for r in cluster.em.requests if r[0] == "DELETE"]


def test_a_job_created_running_is_suspended_until_admitted(cluster, stack):
    service, _ = stack
    service.backend.poll()  # nothing yet
    cluster.paused.set()  # keep the Job controller from starting pods before silod sees it
    create(cluster, kubectl_job("eager", suspend=False))
    service.backend.poll()
    assert cluster.obj("jobs", "alice", "eager", group="batch")["spec"]["suspend"] is True
    cluster.paused.clear()
    assert service.backend.suspensions == 1


def test_preemption_suspends_and_readmission_resumes_without_deleting_pods(cluster, stack):
    service, _ = stack
    create(cluster, kubectl_job("long"))
    step(service)
    rec = job_named(service, "job.long.")
    cluster.wait(lambda: cluster.pods_of("alice", "long"), what="pods")
    service.backend.stop(rec.id)  # what a round does to a job the policy no longer chooses
    job = cluster.obj("jobs", "alice", "long", group="batch")
    assert job["spec"]["suspend"] is True
    cluster.wait(lambda: not cluster.pods_of("alice", "long"), what="the Job controller to remove the pods")
    # silod re-admits only once the Job's status counts no active pod (the controller writes that
    # after the pods are gone; until then start() defers to the next poll).
    cluster.wait(lambda: not (cluster.obj("jobs", "alice", "long", group="batch").get("status") or {}).get("active"),
                 what="the Job controller to count no active pod")
    # The Job controller keeps startTime on suspension (Kubernetes <= 1.35): silod clears it
    # through the status subresource before it re-admits (tests/test_kubernetes_real.py checks
    # the same against the real API server and Job controller).
    assert cluster.obj("jobs", "alice", "long", group="batch")["status"].get("startTime")
    assert not [r for r in cluster.em.requests if r[0] == "DELETE"]
    # Re-admission (a later round) may choose other nodes: the old expression is replaced, not added to.
    service.backend.start(spec_of(rec), JobAllocation(rec.id, 2, 1.0, cache_bytes=1e9, remote_io=1e8))
    # A write that races the Job controller's is a 409 and start() defers to the next poll
    # (as on the real control plane); the Job must be resumed within a few polls either way.
    def resumed() -> bool:
        service.apply_events(service.backend.poll())
        return cluster.obj("jobs", "alice", "long", group="batch")["spec"]["suspend"] is False
    cluster.wait(resumed, what="re-admission")
    job = cluster.obj("jobs", "alice", "long", group="batch")
    terms = job["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(terms) == 1 and len(terms[0]["matchExpressions"]) == 1
    cluster.wait(lambda: cluster.pods_of("alice", "long"), what="pods again")
    assert service.get_job(ROOT, rec.id).state == "running"
    assert not cluster.controller_errors


def test_owner_edits_do_not_change_what_silod_accounts(cluster, stack):
    """The attack from the issue: an owner rewrites annotations to look almost done. silod's
    remaining work comes from its own database, so the queue order does not move."""
    service, _ = stack
    create(cluster, kubectl_job("honest", epochs="10"))
    service.apply_events(service.backend.poll())
    rec = job_named(service, "job.honest.")
    before = service.get_job(ROOT, rec.id)
    patch = {"metadata": {"annotations": {"silod.io/epochs": "0.0001", "silod.io/consumed-bytes": "1e20",
                                          "silod.io/ideal-throughput": "1TB/s"}}}
    cluster.call(lambda em: em.patch(em.resources[("batch", "jobs")], "alice", "honest", patch,
                                     "application/merge-patch+json"))
    service.apply_events(service.backend.poll())
    after = service.get_job(ROOT, rec.id)
    assert (after.total_bytes, after.remaining_bytes, after.ideal_throughput) == \
        (before.total_bytes, before.remaining_bytes, before.ideal_throughput)
    assert len([j for j in service.list_jobs(ROOT) if j.name.startswith("job.honest.")]) == 1


def test_a_stale_write_is_a_conflict_and_admission_retries(cluster, stack, monkeypatch):
    service, _ = stack
    create(cluster, kubectl_job("racy"))
    service.apply_events(service.backend.poll())
    real_replace = service.backend.custom.replace_namespaced_custom_object
    raced = []

    def owner_writes_first(*args, **kwargs):  # another writer changes the Job between silod's read and write
        if not raced:
            raced.append(1)
            cluster.call(lambda em: em.patch(em.resources[("batch", "jobs")], "alice", "racy",
                                             {"metadata": {"labels": {"team": "x"}}}, "application/merge-patch+json"))
        return real_replace(*args, **kwargs)

    monkeypatch.setattr(service.backend.custom, "replace_namespaced_custom_object", owner_writes_first)
    service.run_round("test")
    job = cluster.obj("jobs", "alice", "racy", group="batch")
    assert raced and job["spec"]["suspend"] is True  # 409 Conflict: the owner's change was not overwritten
    service.apply_events(service.backend.poll())  # deferred admission retried with fresh state
    job = cluster.obj("jobs", "alice", "racy", group="batch")
    assert job["spec"]["suspend"] is False and job["metadata"]["labels"]["team"] == "x"


def test_rest_job_with_pod_template_creates_a_restricted_job_in_the_callers_namespace(cluster, stack):
    service, client = stack
    body = {"name": "r1", "gpus": 2, "dataset": "imagenet", "epochs": 1, "ideal_throughput": "500MB/s",
            "pod_template": {"image": "ghcr.io/me/train:1", "command": ["python", "train.py"], "env": {"A": "1"}}}
    r = client.post("/v1/jobs", json=body, headers=H_ALICE)
    assert r.status_code == 201, r.text
    jid = r.json()["id"]
    job = cluster.obj("jobs", "alice", f"silod-{jid}", group="batch")
    assert job["spec"]["suspend"] is True
    assert job["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "silod"
    assert job["metadata"]["labels"]["silod.io/job-id"] == jid
    step(service)
    pods = cluster.wait(lambda: cluster.pods_of("alice", f"silod-{jid}"), what="pods past Pod Security restricted")
    assert pods[0]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    # Bob cannot see or cancel it: ids are per tenant; Alice can, and her Job goes away.
    assert client.get(f"/v1/jobs/{jid}", headers=H_BOB).status_code == 404
    assert client.delete(f"/v1/jobs/{jid}", headers=H_BOB).status_code == 404
    assert client.delete(f"/v1/jobs/{jid}", headers=H_ALICE).status_code == 200
    service.run_round("cancel")
    assert not [j for j in cluster.objects("jobs", group="batch", namespace="alice") if j["metadata"]["name"] == f"silod-{jid}"]


def test_rest_pod_template_cannot_ask_for_privilege_and_is_size_capped(stack):
    _, client = stack
    base = {"name": "r2", "gpus": 1, "dataset": "imagenet", "epochs": 1, "ideal_throughput": "500MB/s"}
    for bad in ({"image": "x", "privileged": True}, {"image": "x", "run_as_user": 0},
                {"image": "x", "env": {f"V{i}": "x" for i in range(65)}}, {"image": "x", "args": ["a" * 5000]}):
        r = client.post("/v1/jobs", json={**base, "pod_template": bad}, headers=H_ALICE)
        assert r.status_code == 422, (bad, r.text)


def test_a_namespace_that_is_no_tenants_is_reported_not_queued(cluster, stack):
    service, _ = stack
    service.backend.namespace_prefix = "team-"
    create(cluster, kubectl_job("stray"))
    service.apply_events(service.backend.poll())
    assert not [j for j in service.list_jobs(ROOT) if j.name.startswith("job.stray.")]
    events = cluster.objects("events", namespace="alice")
    assert any("does not belong to a silod tenant" in e["message"] for e in events)


def test_a_privileged_workload_never_gets_pods_in_a_restricted_namespace(cluster, stack):
    service, _ = stack
    bad = copy.deepcopy(SAFE_CONTAINER)
    bad["securityContext"] = {"privileged": True}
    create(cluster, kubectl_job("priv", container=bad))
    step(service)
    cluster.wait(lambda: any(e["reason"] == "FailedCreate" and "violates PodSecurity" in e["message"]
                             for e in cluster.objects("events", namespace="alice")), what="FailedCreate")
    assert not cluster.pods_of("alice", "priv")


def test_jobset_is_admitted_when_its_crd_exists(cluster, stack):
    service, _ = stack
    tmpl = kubectl_job("x")["spec"]["template"]
    jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
              "metadata": {"name": "js", "namespace": "bob", "labels": {"silod.io/queue": "default"},
                           "annotations": {"silod.io/epochs": "1", "silod.io/ideal-throughput": "1GB/s"}},
              "spec": {"suspend": True, "replicatedJobs": [
                  {"name": "workers", "replicas": 2, "template": {"spec": {"parallelism": 1, "template": tmpl}}}]}}
    create(cluster, jobset, plural="jobsets", group="jobset.x-k8s.io")
    step(service)
    rec = job_named(service, "jobset.js.")
    assert rec.owner == "bob" and rec.gpus == 4 and rec.state == "running"
    got = cluster.obj("jobsets", "bob", "js", group="jobset.x-k8s.io")
    assert got["spec"]["suspend"] is False
    pod_spec = got["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]


def test_a_dataset_cache_bigger_than_every_nodes_disk_waits_for_placement(cluster, stack):
    service, _ = stack
    backend = service.backend
    create(cluster, kubectl_job("big"))
    service.apply_events(backend.poll())
    rec = job_named(service, "job.big.")
    spec = spec_of(rec)
    backend.start(spec, JobAllocation(rec.id, 2, 1.0, cache_bytes=150e9, remote_io=1e8))  # nodes have 100GB
    assert cluster.obj("jobs", "alice", "big", group="batch")["spec"]["suspend"] is True
    assert any("cache free" in e["message"] for e in cluster.objects("events", namespace="alice"))
    backend.start(spec, JobAllocation(rec.id, 2, 1.0, cache_bytes=50e9, remote_io=1e8))
    assert cluster.obj("jobs", "alice", "big", group="batch")["spec"]["suspend"] is False


def test_priority_class_orders_admission_within_the_queue(cluster, stack):
    """Two 8-GPU jobs on an 8-GPU cluster: the later one has a higher PriorityClass (an object
    only operators write) and is admitted first; the earlier one waits, suspended."""
    service, _ = stack
    cluster.call(lambda em: em.create(em.resources[("scheduling.k8s.io", "priorityclasses")], None,
                                      {"metadata": {"name": "high"}, "value": 1000}))
    low = kubectl_job("low", gpus=4)
    low["spec"]["parallelism"] = 2
    high = copy.deepcopy(low)
    high["metadata"]["name"] = "high"
    high["spec"]["template"]["spec"]["priorityClassName"] = "high"
    create(cluster, low)
    service.apply_events(service.backend.poll())
    create(cluster, high)
    step(service)
    assert job_named(service, "job.high.").priority == 1000 and job_named(service, "job.low.").priority == 0
    assert cluster.obj("jobs", "alice", "high", group="batch")["spec"]["suspend"] is False
    assert cluster.obj("jobs", "alice", "low", group="batch")["spec"]["suspend"] is True
    # Its two 4-GPU pods need both nodes: the admission spans them.
    job = cluster.obj("jobs", "alice", "high", group="batch")
    expr = job["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"][0]
    assert expr["values"] == ["n1", "n2"]


def test_a_restarted_scheduler_keeps_admitted_workloads_running_and_queues_nothing_twice(cluster, stack, tmp_path):
    service, client = stack
    create(cluster, kubectl_job("survivor"))
    r = client.post("/v1/jobs", json={"name": "rest", "gpus": 2, "dataset": "imagenet", "epochs": 1,
                                      "ideal_throughput": "500MB/s", "pod_template": {"image": "img"}}, headers=H_ALICE)
    assert r.status_code == 201, r.text
    step(service)
    before = {j.id: j.state for j in service.list_jobs(ROOT)}
    assert sorted(before.values()) == ["running", "running"]
    suspensions = service.backend.suspensions
    # A new process: new backend object, same database, same cluster.
    again = build_service(db=f"sqlite:///{tmp_path / 'k8s.db'}", backend="kubernetes", policy="fifo", round_s=360,
                          gpus="8", gpus_per_node="4", cache="200GB", remote_io="1GB/s",
                          state_dir=tmp_path / "state2", backend_opts={"server": cluster.url})
    try:
        again.recover()
        step(again)
        assert {j.id: j.state for j in again.list_jobs(ROOT)} == before  # nothing requeued or duplicated
        assert again.backend.suspensions == 0 and again.backend.admissions == 0
        for name in ("survivor", f"silod-{r.json()['id']}"):
            assert cluster.obj("jobs", "alice", name, group="batch")["spec"]["suspend"] is False
        assert service.backend.suspensions == suspensions
    finally:
        again.close()


def test_node_mount_remote_io_is_pushed_to_a_real_data_manager(cluster, tmp_path):
    """The agents' node mounts are data-manager jobs `node-<node>_<storage key>`: admission
    gives them the IO of the pods placed there, suspension takes it back."""
    from datamanager.client import DataManagerClient
    from dataplane_helpers import start_datamanager
    from fuse_client.agent.volumes import mount_job_id
    from scheduler.backends.kubernetes.backend import node_mount_job

    assert mount_job_id("n1", "d3-imagenet") == node_mount_job("n1", "d3-imagenet") == "node-n1_d3-imagenet"
    dm = start_datamanager(tmp_path / "dm")
    try:
        service = build_service(db=f"sqlite:///{tmp_path / 'io.db'}", backend="kubernetes", policy="fifo",
                                round_s=360, gpus="8", gpus_per_node="4", cache="200GB", remote_io="1GB/s",
                                state_dir=tmp_path / "s", datamanager=dm.url, backend_opts={"server": cluster.url})
        from scheduler.service.scheduler_process import NewDataset

        ds, _ = service.register_dataset(Principal("alice"), NewDataset("imagenet", "s3://d/i", 10e9))
        create(cluster, kubectl_job("io", gpus=2))
        step(service)
        rec = job_named(service, "job.io.")
        node = cluster.obj("jobs", "alice", "io", group="batch")["metadata"]["annotations"]["silod.io/admitted-nodes"]
        key = f"node-{node}_{ds.key}"
        with DataManagerClient(dm.url) as dmc:
            jobs = dmc.status()["jobs"]
            assert jobs[key]["remote_io_bytes_per_s"] == pytest.approx(service.get_job(ROOT, rec.id).remote_io)
            assert jobs[key]["remote_io_bytes_per_s"] > 0
            service.backend.stop(rec.id)
            service.apply_events(service.backend.poll())
            assert dmc.status()["jobs"][key]["remote_io_bytes_per_s"] == 0
        service.close()
    finally:
        dm.kill()


def test_a_pod_template_needs_the_kubernetes_backend(tmp_path):
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(f"alice:{TOKENS['alice']}\n")
    service = build_service(db=f"sqlite:///{tmp_path / 'n.db'}", backend="null", policy="fifo", round_s=360,
                            gpus="8", gpus_per_node="4", cache="200GB", remote_io="1GB/s", state_dir=tmp_path / "s")
    with TestClient(create_app(service, _token_store(service, tokens_file), run_loop=False)) as client:
        client.post("/v1/datasets", json={"name": "imagenet", "uri": "s3://d/i", "size": "1GB"}, headers=H_ALICE)
        r = client.post("/v1/jobs", json={"name": "x", "gpus": 1, "dataset": "imagenet", "epochs": 1,
                                          "ideal_throughput": "1MB/s", "pod_template": {"image": "i"}}, headers=H_ALICE)
        assert r.status_code == 422 and "pod_template" in r.text and "kubernetes" in r.text
        assert client.get("/v1/jobs", headers=H_ALICE).json() == []  # nothing was recorded
    service.close()


def test_a_rest_job_in_a_missing_namespace_fails_with_the_reason(cluster, stack):
    service, client = stack
    service.backend.namespace_prefix = "team-"  # alice's namespace would be team-alice: absent
    r = client.post("/v1/jobs", json={"name": "nowhere", "gpus": 1, "dataset": "imagenet", "epochs": 1,
                                      "ideal_throughput": "1MB/s", "pod_template": {"image": "i"}}, headers=H_ALICE)
    assert r.status_code == 422 and "namespace team-alice does not exist" in r.text
    assert [j.state for j in service.list_jobs(ROOT) if j.name == "nowhere"] == ["failed"]


def test_users_cannot_raise_their_own_priority(stack):
    """Priority now orders admission, so a user who sets 1000 would jump everyone's queue."""
    _, client = stack
    body = {"name": "vip", "gpus": 1, "dataset": "imagenet", "epochs": 1, "ideal_throughput": "1MB/s"}
    assert client.post("/v1/jobs", json={**body, "priority": 1000}, headers=H_ALICE).status_code == 403
    assert client.post("/v1/jobs", json={**body, "priority": -5}, headers=H_ALICE).status_code == 201
