"""Measured progress on Kubernetes: the scheduler attributes pods to jobs from the API server's
record (controller chain, namespace, node of the admission) and uses the node agents' reports
instead of its estimate once one exists; nothing a workload's owner writes moves it.

Runs against tests/k8s_emulator.py, an EMULATED API server (no real cluster can run here)."""

from __future__ import annotations

import copy

import pytest

from scheduler.service.consumption import ConsumptionStore, PodReport
from scheduler.service.db.models import WorkloadPod

try:
    from test_kubernetes_admission import ROOT, cluster, create, job_named, kubectl_job, stack, step  # noqa: F401
except ImportError:
    from tests.test_kubernetes_admission import ROOT, cluster, create, job_named, kubectl_job, stack, step  # noqa: F401


def attributed(service) -> dict[str, str]:  # type: ignore[no-untyped-def]
    with service.sessions() as s:
        return {w.pod_uid: str(w.job_id) for w in s.query(WorkloadPod)}


def progress_of(events, job_id: str) -> float | None:  # type: ignore[no-untyped-def]
    got = [e.consumed_bytes for e in events if e.job_id == job_id and e.kind == "progress"]
    return got[-1] if got else None


def report(service, node: str, uid: str, read: int) -> None:  # type: ignore[no-untyped-def]
    res = ConsumptionStore(service.sessions).record_report(
        node, f"agent-{node}", [PodReport(uid, read, read // 2, read - read // 2, 3, 3)])
    assert res.accepted == 1, res


def test_reports_replace_the_estimate_and_owner_edits_change_nothing(cluster, stack):
    service, _ = stack
    create(cluster, kubectl_job("m", epochs="1"))
    step(service)
    rec = job_named(service, "job.m.")
    assert service.get_job(ROOT, rec.id).state == "running"
    pods = cluster.wait(lambda: [p for p in cluster.pods_of("alice", "m") if p["spec"].get("nodeName")],
                        what="bound pods")
    events = service.backend.poll()
    estimate = progress_of(events, rec.id)
    assert estimate is not None and estimate < 1e9  # the estimate: SiloDPerf x a fraction of a second
    uid, node = pods[0]["metadata"]["uid"], pods[0]["spec"]["nodeName"]
    assert attributed(service) == {uid: rec.id}

    report(service, node, uid, 3_000_000_000)
    assert progress_of(service.backend.poll(), rec.id) == 3e9

    # The owner rewrites what it may write: pod labels and annotations, the Job's annotations.
    def edit(em):  # type: ignore[no-untyped-def]
        res = em.resources[("", "pods")]
        pod = copy.deepcopy(em.get(res, "alice", pods[0]["metadata"]["name"]))
        pod["metadata"]["labels"]["job-name"] = "other"
        pod["metadata"]["annotations"] = {"silod.io/consumed-bytes": "1e20", "silod.io/job-id": "999"}
        em.replace(res, "alice", pod["metadata"]["name"], pod)
        em.patch(em.resources[("batch", "jobs")], "alice", "m",
                 {"metadata": {"annotations": {"silod.io/consumed-bytes": "9e99", "silod.io/epochs": "0.001"}}},
                 "application/merge-patch+json")
    cluster.call(edit)
    events = service.backend.poll()
    assert progress_of(events, rec.id) == 3e9
    service.apply_events(events)
    assert service.get_job(ROOT, rec.id).total_bytes == rec.total_bytes


def test_pods_silod_did_not_admit_are_not_attributed(cluster, stack):
    """Forged pods: in another namespace with the Job's uid as owner, with the Job's labels but no
    controller reference, or owned by the Job but on a node outside the admission."""
    service, _ = stack
    create(cluster, kubectl_job("victim", gpus=4, epochs="1"))
    step(service)
    rec = job_named(service, "job.victim.")
    job = cluster.obj("jobs", "alice", "victim", group="batch")
    juid = job["metadata"]["uid"]
    cluster.wait(lambda: [p for p in cluster.pods_of("alice", "victim") if p["spec"].get("nodeName")], what="bound")
    admitted_node = cluster.pods_of("alice", "victim")[0]["spec"]["nodeName"]
    other_node = "n2" if admitted_node == "n1" else "n1"
    owner = [{"apiVersion": "batch/v1", "kind": "Job", "name": "victim", "uid": juid, "controller": True}]
    labels = {"job-name": "victim", "controller-uid": juid, "batch.kubernetes.io/controller-uid": juid}
    spec = {"containers": [{"name": "c", "image": "busybox", "securityContext": {
        "allowPrivilegeEscalation": False, "runAsNonRoot": True, "runAsUser": 1000,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}}]}
    forged = {
        "bob-owned": ("bob", {"name": "f1", "ownerReferences": owner}, admitted_node),
        "labels-only": ("alice", {"name": "f2", "labels": labels}, admitted_node),
        "wrong-node": ("alice", {"name": "f3", "ownerReferences": owner, "labels": labels}, other_node),
    }
    uids = {}
    for what, (ns, meta, node) in forged.items():
        body = {"metadata": meta, "spec": {**spec, "nodeName": node}}
        uids[what] = cluster.call(lambda em, ns=ns, body=body: em.create(em.resources[("", "pods")], ns, body))[
            "metadata"]["uid"]
    service.backend.poll()
    got = attributed(service)
    assert not set(uids.values()) & set(got), {k: v in got for k, v in uids.items()}
    assert set(got.values()) == {rec.id}
    # Their reports are ignored with a reason, the job's measured consumption stays empty.
    res = ConsumptionStore(service.sessions).record_report(
        admitted_node, "agent", [PodReport(u, 10**12, 0, 10**12, 0, 1) for u in uids.values()])
    assert res.accepted == 0 and len(res.ignored) == 3
    assert ConsumptionStore(service.sessions).measured([rec.id]) == {}


def test_without_reports_the_estimate_stays(cluster, stack):
    service, _ = stack
    create(cluster, kubectl_job("est"))
    step(service)
    rec = job_named(service, "job.est.")
    cluster.wait(lambda: [p for p in cluster.pods_of("alice", "est") if p["spec"].get("nodeName")], what="bound")
    first = progress_of(service.backend.poll(), rec.id)
    import time

    time.sleep(0.2)
    second = progress_of(service.backend.poll(), rec.id)
    assert first is not None and second is not None and second > first
