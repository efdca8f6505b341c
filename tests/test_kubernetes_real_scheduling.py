"""Issue 44, Build items 4, 5 and 8 on the REAL control plane (tests/k8s_testenv.py: etcd,
"kube-apiserver v1.24.0-alpha snapshot" with the ExtendedResourceToleration admission plugin on,
its Job controller and kube-scheduler, RBAC and deploy/base applied, the webhook called by URL).

- a job whose admitted pods kube-scheduler marks Unschedulable (a resource no node offers, which
  silod's fit check does not model) goes back to the queue with kube-scheduler's reason,
  holds no GPUs, is retried when the nodes change, and fails after the timeout counted from the
  first refusal; memory is part of silod's own fit check, as kube-scheduler counts it;
- the webhook refuses a workload whose nodeSelector no GPU node matches, naming it;
- REST templates carry tolerations and node affinity, and silod's placement agrees with
  kube-scheduler's binding (taints, affinity, the ExtendedResourceToleration plugin);
- capacity follows the cluster's Nodes (added, NotReady, deleted), the flags only cap it.

Waits are on conditions (generous: a loaded 2-core machine), the backend's clock is the test's.
"""

from __future__ import annotations

import types
import uuid

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from k8s_testenv import SILOD_SA, wait
from scheduler.backends.base import DatasetInfo, JobSpec
from scheduler.backends.kubernetes import PodTemplate

try:
    from test_kubernetes_real import alloc, backend_for, node_of_affinity, tenant  # noqa: F401 - fixture
except ImportError:
    from tests.test_kubernetes_real import alloc, backend_for, node_of_affinity, tenant  # noqa: F401

pytestmark = [pytest.mark.slow]

# A resource silod's fit check does not model (it models GPUs, CPU, memory, cache, remote IO):
# kube-scheduler finds no node offering it.
FPGA = {"requests": {"example.com/fpga": "1"}, "limits": {"example.com/fpga": "1"}}
SAFE = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}}


def submit(backend, ns: str, job_id: str, gpus: int, template: PodTemplate) -> JobSpec:  # type: ignore[no-untyped-def]
    rec = types.SimpleNamespace(id=job_id, name=f"job-{job_id}", owner=ns, gpus=gpus, dataset="ds")
    backend.create_workload(rec, template)
    return JobSpec(job_id, rec.name, ns, gpus, DatasetInfo("ds", "s3://b/ds", 1e9), 1e8, 1e9, 0.0)


def refused_pods(cp, ns: str) -> list[dict]:  # type: ignore[no-untyped-def]
    """Pods kube-scheduler marked PodScheduled=False, reason Unschedulable."""
    return [p for p in cp.pods(ns) if not p["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
        for c in (p.get("status") or {}).get("conditions") or [])]


def admit(backend, cp, ns: str, spec: JobSpec) -> list[str]:  # type: ignore[no-untyped-def]
    """start() as a round does, then polls (a deferred admission is retried there) until the Job
    carries silod's placement and is unsuspended."""
    backend.refresh()
    backend.start(spec, alloc(spec))

    def admitted():
        backend.poll()
        job = cp.job(ns, f"silod-{spec.job_id}")
        return job["spec"].get("suspend") is False and node_of_affinity(job)
    return wait(admitted, 90, lambda: f"admission of silod-{spec.job_id}: {list(backend._reported.problems.values())[-3:]}",
                interval=0.3)


def test_pods_kube_scheduler_cannot_bind_send_the_job_back_to_the_queue_and_fail_after_the_timeout(tenant):
    """Finding 4 after admission: a pod asking for a resource no node has that silod's fit check
    does not model (example.com/fpga). silod admits it; kube-scheduler marks the pod Unschedulable
    ("Insufficient example.com/fpga"). Before: the job stayed `running`, holding its GPUs for ever. Now, after the grace period: suspended, back in the queue with kube-scheduler's reason,
    no GPUs held; a change of the nodes releases it to the policy; it fails once the timeout has
    passed since the FIRST refusal."""
    cp, ns, nodes = tenant
    cp.start_kube_scheduler()
    a = f"{ns}-a"
    nodes.append(a)
    cp.add_node(a, 4)
    t = [10_000.0]
    backend = backend_for(cp)
    backend.clock = lambda: t[0]
    backend.pending_grace_s, backend.unschedulable_timeout_s = 60, 600
    backend.refresh()
    spec = submit(backend, ns, "951", 4, PodTemplate(image="trainer:1", resources=FPGA))
    assert admit(backend, cp, ns, spec) == [a]
    assert [n.gpus_free for n in backend.nodes if n.name == a] == [0]
    wait(lambda: refused_pods(cp, ns), 120, "kube-scheduler to mark the pod Unschedulable", interval=0.5)
    # First sighting: within the grace period nothing changes (pods of a preempted job may still be leaving).
    assert not [e for e in backend.poll() if e.job_id == "951" and e.kind != "progress"]
    assert "951" in backend._admitted
    t[0] += 61
    events = [e for e in backend.poll() if e.job_id == "951"]
    assert events and events[-1].kind == "unschedulable", events
    reason = events[-1].message
    assert reason.startswith("unschedulable: kube-scheduler cannot bind its pods") and "Insufficient example.com/fpga" in reason
    assert backend.unschedulable_jobs() == {"951"} and "951" not in backend._admitted
    assert cp.job(ns, "silod-951")["spec"]["suspend"] is True
    assert [n.gpus_free for n in backend.nodes if n.name == a] == [4]  # its GPUs are free for others
    warnings = [e for e in cp.core.list_namespaced_event(ns).items
                if e.involved_object.name == "silod-951" and e.reason == "SiloDUnschedulable"]
    assert warnings and "Insufficient example.com/fpga" in warnings[-1].message
    # The reason is repeated while it lasts (the service keeps it as the job's message).
    t[0] += 30
    again = [e for e in backend.poll() if e.job_id == "951"]
    assert again and again[-1].kind == "unschedulable" and again[-1].message == reason
    # A node joins: released to the policy (kube-scheduler may now bind it)...
    b = f"{ns}-b"
    nodes.append(b)
    cp.add_node(b, 4)
    t[0] += 30
    events = [e for e in backend.poll() if e.job_id == "951"]
    assert backend.unschedulable_jobs() == set() and "nodes changed" in events[-1].message, events
    # ... admitted again, refused again (the new node has no FPGA either), held again. Between
    # the re-admission and the Job controller's new pods the job has no pods at all: that is not
    # "every pod bound, it runs" (which once forgot the first refusal and restarted the timeout).
    admit(backend, cp, ns, spec)
    assert backend._refused_first.get("951") == 10_000.0
    wait(lambda: refused_pods(cp, ns), 120, "kube-scheduler to refuse the new pod too", interval=0.5)
    backend.poll()
    t[0] += 61
    assert [e.kind for e in backend.poll() if e.job_id == "951"][-1:] == ["unschedulable"]
    assert backend.unschedulable_jobs() == {"951"}
    # The timeout counts from the first refusal (t=10,000), not from this one (t=10,182).
    t[0] += 430
    failed = [e for e in backend.poll() if e.job_id == "951" and e.kind == "failed"]
    assert failed and "Insufficient example.com/fpga" in failed[0].message and "unschedulable-timeout" in failed[0].message, failed
    assert backend.unschedulable_jobs() == set()


def test_the_webhook_refuses_a_node_selector_no_gpu_node_matches(tenant):
    """Finding 4 at admission: the owner's nodeSelector matches no GPU node of the cluster.
    Before: queued, "admitted", never started. Now the real API server refuses the create with
    the webhook's reason; once a node with the label exists the same Job is accepted."""
    cp, ns, nodes = tenant
    gpu = f"{ns}-gpu"
    nodes.append(gpu)
    cp.add_node(gpu, 2)
    pool = f"p{uuid.uuid4().hex[:8]}"
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"name": "picky", "labels": {"silod.io/queue": "default"},
                        "annotations": {"silod.io/epochs": "1", "silod.io/ideal-throughput": "100MB/s"}},
           "spec": {"template": {"spec": {
               "restartPolicy": "Never", "securityContext": POD_SECURITY, "nodeSelector": {"pool": pool},
               "containers": [{"name": "t", "image": "busybox", "securityContext": SAFE,
                               "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}}
    with pytest.raises(ApiException) as err:
        cp.batch.create_namespaced_job(ns, job)
    assert err.value.status == 422, err.value.body
    assert f"no node of the cluster matches its nodeSelector pool={pool}" in err.value.body, err.value.body
    labelled = f"{ns}-lab"
    nodes.append(labelled)
    cp.add_node(labelled, 2, labels={"pool": pool})
    created = cp.batch.create_namespaced_job(ns, job)
    assert created.spec.suspend is True


def test_rest_templates_carry_tolerations_and_affinity_and_placement_agrees_with_kube_scheduler(tenant):
    """Finding 5: REST jobs could not carry tolerations or affinity, so they never ran on tainted
    GPU nodes. Now the template's fields reach the Job; silod places the pod on the node the
    affinity asks for and the toleration allows; kube-scheduler binds it there. A template whose
    affinity no node matches is refused before any Job is created, by the webhook's check."""
    cp, ns, nodes = tenant
    cp.start_kube_scheduler()
    a, b = f"{ns}-a", f"{ns}-b"
    nodes += [a, b]
    zone = f"z{uuid.uuid4().hex[:6]}"
    cp.add_node(a, 4, labels={"zone": f"{zone}-a"})
    cp.add_node(b, 4, labels={"zone": f"{zone}-b"}, taints=[{"key": "dedicated", "value": "train", "effect": "NoSchedule"}])
    backend = backend_for(cp)
    backend.refresh()
    template = PodTemplate(
        image="trainer:1", tolerations=({"key": "dedicated", "operator": "Equal", "value": "train", "effect": "NoSchedule"},),
        affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": [f"{zone}-b"]}]}]}}})
    spec = submit(backend, ns, "971", 4, template)
    assert admit(backend, cp, ns, spec) == [b]

    def bound():
        return [p["spec"]["nodeName"] for p in cp.pods(ns) if p["spec"].get("nodeName")]
    assert wait(bound, 120, "kube-scheduler to bind the pod", interval=0.5) == [b]
    from estimator.errors import UserError

    with pytest.raises(UserError, match=f"no node of the cluster matches its required node affinity"):
        submit(backend, ns, "972", 4, PodTemplate(image="trainer:1", affinity={"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": [f"{zone}-c"]}]}]}}}))
    with pytest.raises(ApiException) as err:
        cp.job(ns, "silod-972")
    assert err.value.status == 404


def test_placement_agrees_with_the_extended_resource_toleration_plugin(tenant):
    """Finding 5: with the ExtendedResourceToleration admission plugin (on in this control plane)
    the API server makes every pod requesting nvidia.com/gpu tolerate nvidia.com/gpu taints, and
    kube-scheduler binds it to a GPU node tainted so. silod refused that node (the job waited for
    ever); with --backend-opt extended-resource-toleration=true it places the pod there, and
    kube-scheduler binds it."""
    cp, ns, nodes = tenant
    cp.start_kube_scheduler()
    g = f"{ns}-g"
    nodes.append(g)
    cp.add_node(g, 4, taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}])
    told = backend_for(cp)
    told.extended_resource_toleration = True
    told.refresh()
    spec = submit(told, ns, "981", 4, PodTemplate(image="trainer:1"))
    assert admit(told, cp, ns, spec) == [g]

    def bound():
        return [p for p in cp.pods(ns) if p["spec"].get("nodeName")]
    pod = wait(bound, 120, "kube-scheduler to bind the pod to the tainted GPU node", interval=0.5)[0]
    assert pod["spec"]["nodeName"] == g
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    # Without the option silod does not assume the plugin: the node is refused, with the reason.
    untold = backend_for(cp)
    untold.refresh()
    assert untold._never_fits(untold._pod_requests(untold.workloads[told._refs["981"].uid]), "ds", 0.0, 0.0) \
        == "no node matches its pods' nodeSelector, node affinity and tolerations (nodes tainted nvidia.com/gpu: add a" \
           " toleration if the pods may run there)"


def test_capacity_follows_the_clusters_nodes_and_the_flags_cap_it(tenant, tmp_path):
    """Finding 8: capacity was the flags, and the node list was read once at start. Now each round
    plans with the Ready, schedulable GPU nodes of the last poll (capped by --gpus and the other
    flags): a node added is in the next round's capacity, one NotReady or deleted leaves it."""
    cp, ns, nodes = tenant
    from scheduler.service.cli import build_service

    service = build_service(db=f"sqlite:///{tmp_path / 'silod.db'}", backend="kubernetes", policy="fifo", round_s=60,
                            gpus="12", gpus_per_node="8", cache="1TB", remote_io="1GB/s", state_dir=tmp_path / "state",
                            backend_opts={"kubeconfig": str(cp.kubeconfig(SILOD_SA))})
    try:
        def gpus() -> int:
            service.backend.poll()
            return service.build_snapshot().capacity.gpus
        base = service.backend.cluster_capacity()
        assert base is None, f"another test left GPU nodes behind: {base}"
        a, b, c = f"{ns}-a", f"{ns}-b", f"{ns}-c"
        nodes += [a, b, c]
        cp.add_node(a, 4)
        wait(lambda: gpus() == 4, 60, "the first node in the round's capacity")
        cp.add_node(b, 4)
        wait(lambda: gpus() == 8, 60, "the added node in the round's capacity")
        cp.add_node(c, 8)
        wait(lambda: gpus() == 12, 60, "capacity capped by --gpus 12 (16 GPUs in the nodes)")
        assert service.build_snapshot().capacity.gpus_per_node == 8
        cp.set_ready(c, False)
        wait(lambda: gpus() == 8, 60, "the NotReady node out of the capacity")
        cp.core.delete_node(b)
        wait(lambda: gpus() == 4, 60, "the deleted node out of the capacity")
        # /v1/cluster's node list follows too (the round refreshes it).
        assert {n.name for n in service._status().description.nodes} == {a}
    finally:
        service.close()


def test_the_service_shows_kube_schedulers_refusal_and_plans_no_gpus_for_it(tenant, tmp_path):
    """The same refusal through the whole service (REST submission path, rounds, events): the
    job is `queued` with kube-scheduler's reason as its message (what GET /v1/jobs/{id} and
    `silod jobs` print), /ui's queue gives that reason (not "held back by the tenant's quota"),
    and the next round plans it no GPUs."""
    cp, ns, nodes = tenant
    cp.start_kube_scheduler()
    a = f"{ns}-a"
    nodes.append(a)
    cp.add_node(a, 4)
    from scheduler.service.cli import build_service
    from scheduler.service.types import NewDataset, NewJob, Principal

    service = build_service(db=f"sqlite:///{tmp_path / 'silod.db'}", backend="kubernetes", policy="fifo", round_s=60,
                            gpus="4", gpus_per_node="4", cache="1TB", remote_io="1GB/s", state_dir=tmp_path / "state",
                            backend_opts={"kubeconfig": str(cp.kubeconfig(SILOD_SA))})
    try:
        t = [50_000.0]
        service.backend.clock = lambda: t[0]
        who = Principal(ns)
        service.register_dataset(who, NewDataset("ds", "s3://bucket/ds", 1e9))
        rec = service.submit_job(who, NewJob("needs-fpga", 4, "ds", epochs=1, ideal_throughput=1e8,
                                             pod_template=PodTemplate(image="trainer:1", resources=FPGA)))
        service.backend.poll()
        service.run_round("test")
        wait(lambda: (service.apply_events(service.backend.poll()),
                      cp.job(ns, f"silod-{rec.id}")["spec"].get("suspend") is False)[1], 90, "the admission", interval=0.3)
        assert service.get_job(who, rec.id).state == "running"
        wait(lambda: refused_pods(cp, ns), 120, "kube-scheduler to mark the pod Unschedulable", interval=0.5)
        service.apply_events(service.backend.poll())
        t[0] += service.backend.pending_grace_s + 1
        assert service.apply_events(service.backend.poll())  # a running job became unschedulable: a round follows
        service.run_round("test")
        job = service.get_job(who, rec.id)
        assert job.state == "queued" and job.allocated_gpus == 0, (job.state, job.allocated_gpus, job.message)
        assert job.message.startswith("unschedulable: kube-scheduler cannot bind its pods"), job.message
        assert "Insufficient example.com/fpga" in job.message
        queue = service.overview(who).queue
        assert [q.reason for q in queue if q.id == rec.id] == [job.message]
        assert rec.id not in {v.job_id for v in service.build_snapshot().jobs}
        assert cp.job(ns, f"silod-{rec.id}")["spec"]["suspend"] is True
    finally:
        service.close()


def test_silods_fit_check_counts_memory_as_kube_scheduler_does(tenant):
    """Finding 4's example: a pod asking for more memory than any node has was admitted and
    never bound. Memory is now in silod's fit check (requests, limits implying requests, as
    kube-scheduler counts them): 128Gi goes to the node that has it, where kube-scheduler binds
    it; 512Gi never fits and goes back to the queue before admission, with the reason."""
    cp, ns, nodes = tenant
    cp.start_kube_scheduler()
    small, big = f"{ns}-a-small", f"{ns}-b-big"
    nodes += [small, big]
    cp.add_node(small, 4, memory="64Gi")  # first by name, and as tight by GPUs as the other
    cp.add_node(big, 4, memory="256Gi")
    backend = backend_for(cp)
    backend.refresh()
    spec = submit(backend, ns, "991", 4, PodTemplate(image="trainer:1", memory="128Gi"))
    assert admit(backend, cp, ns, spec) == [big]

    def bound():
        return [p["spec"]["nodeName"] for p in cp.pods(ns) if p["spec"].get("nodeName")]
    assert wait(bound, 120, "kube-scheduler to bind the pod", interval=0.5) == [big]
    huge = submit(backend, ns, "992", 4, PodTemplate(image="trainer:1", memory="512Gi"))
    backend.refresh()
    backend.start(huge, alloc(huge))
    assert backend.unschedulable_jobs() == {"992"}
    events = [e for e in backend.poll() if e.job_id == "992"]
    assert events and "a pod requests 512Gi of memory, no node has more than 256Gi free" in events[-1].message, events
    assert cp.job(ns, "silod-992")["spec"]["suspend"] is True
