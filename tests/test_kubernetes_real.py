"""silod's Kubernetes backend against a REAL control plane (tests/k8s_testenv.py): etcd, the
kube-apiserver, the upstream Job controller and kube-scheduler, all "kube-apiserver v1.24.0-alpha
snapshot" (Kubernetes master of 2021-12-23), RBAC on, deploy/base applied, silod authenticated as
its own service account. The test plays the kubelet (tests/k8s_testenv.py, Kubelet).

What is checked here is real API-server behaviour: validation of Job template changes
(spec.template is immutable except node affinity/selectors/tolerations/labels/annotations while
the Job is suspended and has no status.startTime), the Job controller's suspension (it deletes
active pods and keeps status.startTime until 1.35; Kubernetes 1.36 clears it on suspend),
kube-scheduler's taints and tolerations, RBAC of deploy/base, the webhook called by URL.
"""

from __future__ import annotations

import time
import types
import uuid
from collections.abc import Iterator

import pytest
from kubernetes.client.exceptions import ApiException

from k8s_testenv import SILOD_SA, ControlPlane, Kubelet, wait
from policies.types import ClusterCapacity
from scheduler.backends.base import DatasetInfo, JobAllocation, JobSpec
from scheduler.backends.kubernetes import KubernetesBackend, PodTemplate, load_api_client

pytestmark = [pytest.mark.slow]

RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}


@pytest.fixture
def tenant(control_plane: ControlPlane) -> Iterator[tuple[ControlPlane, str, list[str]]]:
    """A fresh tenant namespace and a list the test appends its node names to (deleted after)."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    control_plane.add_namespace(ns, RESTRICTED)
    nodes: list[str] = []
    try:
        yield control_plane, ns, nodes
    finally:
        control_plane.cleanup_namespace(ns)
        control_plane.delete_nodes(nodes)


def backend_for(cp: ControlPlane, gpus: int = 16) -> KubernetesBackend:
    """silod's backend as `silod serve --backend kubernetes --backend-opt kubeconfig=...` makes it,
    authenticated as the scheduler's service account."""
    api = load_api_client(kubeconfig=str(cp.kubeconfig(SILOD_SA)))
    return KubernetesBackend(api, capacity=ClusterCapacity(gpus=gpus, cache=1e12, remote_io=1e9, gpus_per_node=8))


def rest_job(backend: KubernetesBackend, ns: str, job_id: str, gpus: int) -> JobSpec:
    """A REST submission's Job, created by silod (`create_workload`) in the tenant's namespace."""
    rec = types.SimpleNamespace(id=job_id, name=f"job-{job_id}", owner=ns, gpus=gpus, dataset="ds")
    backend.create_workload(rec, PodTemplate(image="trainer:1"))
    return JobSpec(job_id, rec.name, ns, gpus, DatasetInfo("ds", "s3://b/ds", 1e9), 1e8, 1e9, 0.0)


def alloc(spec: JobSpec) -> JobAllocation:
    return JobAllocation(spec.job_id, spec.gpus, 1.0, 1e8, 1e8)


def node_of_affinity(job: dict) -> list[str]:
    """The nodes silod's admission wrote into the Job's required node affinity ([] if none)."""
    terms = (((job["spec"]["template"]["spec"].get("affinity") or {}).get("nodeAffinity") or {})
             .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
    return [v for t in terms for e in t.get("matchExpressions", []) if e["key"] == "kubernetes.io/hostname"
            for v in e["values"]]


def running_pods(cp: ControlPlane, ns: str) -> list[dict]:
    return [p for p in cp.pods(ns) if not p["metadata"].get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") == "Running"]


def test_readmission_after_preemption_moves_the_job_to_other_nodes(tenant):
    """Finding 1: a preempted Job re-admitted onto OTHER nodes. The real Job controller keeps
    status.startTime on suspension (through 1.35), and the API server accepts the new node
    affinity only once startTime is cleared, so silod clears it through jobs/status once
    status.active == 0 (as Kueue does) and then writes the new placement."""
    cp, ns, nodes = tenant
    cp.start_kube_scheduler()
    a, b = f"{ns}-a", f"{ns}-b"
    nodes += [a, b]
    cp.add_node(a, 4)
    cp.add_node(b, 4)
    kubelet = Kubelet(cp, nodes)
    backend = backend_for(cp)
    backend.refresh()
    spec = rest_job(backend, ns, "901", 4)
    backend.refresh()

    def step_until(cond, what, timeout=60.0):
        def once():
            kubelet.step(ns)
            backend.poll()
            return cond()
        return wait(once, timeout=timeout, what=what, interval=0.2)

    # start() may defer an admission it cannot write yet; poll() retries it, as the service's loop does.
    backend.start(spec, alloc(spec))
    first = step_until(lambda: node_of_affinity(cp.job(ns, "silod-901")),
                       lambda: f"the first admission of silod-901: deferred {backend._deferred}, awaiting "
                               f"{backend._awaiting}, problems {backend._reported.problems}", timeout=30)
    assert len(first) == 1 and first[0] in (a, b), first
    other = b if first[0] == a else a

    step_until(lambda: [p for p in running_pods(cp, ns) if p["spec"]["nodeName"] == first[0]],
               f"the Job's pod running on {first[0]}")
    step_until(lambda: (cp.job(ns, "silod-901").get("status") or {}).get("startTime"), "the Job controller's startTime")

    # Preempted by suspension; meanwhile the first node is cordoned, so the next admission moves.
    backend.stop("901")
    cp.core.patch_node(first[0], {"spec": {"unschedulable": True}})
    step_until(lambda: not cp.pods(ns), "the Job controller to remove the pod (kubelet finishing it)")
    # The Job controller does not rewrite a settled suspended Job (the emulator, tests/k8s_emulator.py,
    # models this: an unchanged condition keeps its lastTransitionTime).
    wait(lambda: not (cp.job(ns, "silod-901").get("status") or {}).get("active"), timeout=30,
         what="the Job controller to count no active pod", interval=0.2)
    settled = cp.job(ns, "silod-901")["metadata"]["resourceVersion"]
    time.sleep(3.0)
    assert cp.job(ns, "silod-901")["metadata"]["resourceVersion"] == settled
    backend.refresh()
    backend.start(spec, alloc(spec))
    job = step_until(lambda: (j := cp.job(ns, "silod-901"))["spec"].get("suspend") is False and j,
                     f"re-admission of silod-901 onto {other}: {backend._deferred}", timeout=30)
    assert node_of_affinity(job) == [other]
    pods = step_until(lambda: running_pods(cp, ns), f"the Job's pod running on {other}")
    assert [p["spec"]["nodeName"] for p in pods] == [other]
    assert backend.running_jobs() == {"901"}
    # silod wrote as itself: server-side field ownership names the manager "silod".
    managers = {m["manager"] for m in cp.job(ns, "silod-901")["metadata"]["managedFields"]}
    assert "silod" in managers and "OpenAPI-Generator" not in managers


def test_placement_honours_taints_tolerations_and_node_readiness(tenant):
    """Finding 4: a GPU node tainted nvidia.com/gpu:NoSchedule is not chosen for a Job that does
    not tolerate it (kube-scheduler would leave its pods Pending while silod holds the GPUs); a
    Job that tolerates it may go there. Nodes that are NotReady, cordoned, or still carry the
    node.kubernetes.io/not-ready taint are never chosen."""
    cp, ns, nodes = tenant
    cp.start_kube_scheduler()
    tainted, free, notready, cordoned, still_tainted = (f"{ns}-{s}" for s in ("gpu", "big", "nr", "cord", "nrt"))
    nodes += [tainted, free, notready, cordoned, still_tainted]
    # Best fit would pick the tightest nodes (4 GPUs) first: every one of them is unusable.
    cp.add_node(tainted, 4, taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}])
    cp.add_node(notready, 4, ready=False)
    cp.add_node(cordoned, 4, unschedulable=True)
    cp.add_node(still_tainted, 4, taints=[{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}])
    cp.add_node(free, 6)
    kubelet = Kubelet(cp, nodes)
    backend = backend_for(cp)
    backend.refresh()
    spec = rest_job(backend, ns, "902", 4)
    backend.refresh()
    backend.start(spec, alloc(spec))
    assert node_of_affinity(cp.job(ns, "silod-902")) == [free], backend._reported.problems

    def scheduled():
        kubelet.step(ns)
        return [p["spec"]["nodeName"] for p in cp.pods(ns) if p["spec"].get("nodeName")]
    assert wait(scheduled, 60, "kube-scheduler to bind the pod") == [free]

    # A workload that tolerates the GPU taint may use that node (the only one left with 4 free).
    job = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "tolerant", "namespace": ns, "labels": {"silod.io/queue": "default"},
                     "annotations": {"silod.io/epochs": "1", "silod.io/ideal-throughput": "100MB/s"}},
        "spec": {"suspend": True, "template": {"spec": {
            "restartPolicy": "Never",
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "t", "image": "busybox", "resources": {"limits": {"nvidia.com/gpu": "4"}},
                            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
            "volumes": [{"name": "data", "csi": {"driver": "silod.io", "readOnly": True,
                                                 "volumeAttributes": {"dataset": "ds"}}}]}}},
    }
    from kubernetes import client

    client.CustomObjectsApi(cp.api_client()).create_namespaced_custom_object("batch", "v1", ns, "jobs", job)
    backend.refresh()
    wl = next(w for w in backend.workloads.values() if w.name == "tolerant")
    backend._remember("903", wl)
    tol = JobSpec("903", "tolerant", ns, 4, DatasetInfo("ds", "s3://b/ds", 1e9), 1e8, 1e9, 0.0)
    backend.start(tol, alloc(tol))
    assert node_of_affinity(cp.job(ns, "tolerant")) == [tainted], backend._reported.problems
    wait(lambda: sorted(scheduled()) == sorted([free, tainted]), 60, "kube-scheduler to bind the tolerant pod")


def test_placement_fits_the_pods_cpu_requests(tenant):
    """Issue 22: CPU is part of the fit check, from the pods' CPU requests (a Job's pod resources
    cannot change at admission, so silod does not resize them to the cores it allocates). The
    tightest node by GPUs has too few cores for the pod: silod places it where kube-scheduler
    can bind it; a second job no node has the cores for waits, and says so."""
    cp, ns, nodes = tenant
    cp.start_kube_scheduler()
    small, big = f"{ns}-small", f"{ns}-big"
    nodes += [small, big]
    cp.add_node(small, 4, cpu="4")  # best fit by GPUs, but 4 cores
    cp.add_node(big, 8, cpu="32")
    kubelet = Kubelet(cp, nodes)
    backend = backend_for(cp)
    backend.refresh()
    rec = types.SimpleNamespace(id="905", name="job-905", owner=ns, gpus=4, dataset="ds")
    backend.create_workload(rec, PodTemplate(image="trainer:1", cpu="16"))
    spec = JobSpec("905", rec.name, ns, 4, DatasetInfo("ds", "s3://b/ds", 1e9), 1e8, 1e9, 0.0)
    backend.refresh()
    backend.start(spec, alloc(spec))
    wait(lambda: (backend.poll(), node_of_affinity(cp.job(ns, "silod-905")))[1], 30,
         lambda: f"admission of silod-905: {backend._reported.problems}")
    assert node_of_affinity(cp.job(ns, "silod-905")) == [big], backend._reported.problems

    def scheduled():
        kubelet.step(ns)
        return [p["spec"]["nodeName"] for p in cp.pods(ns) if p["spec"].get("nodeName")]
    assert wait(scheduled, 60, "kube-scheduler to bind the pod") == [big]
    backend.refresh()

    # 4 GPUs are free on each node, but 32 - 16 = 16 cores on big and 4 on small: 20 fit nowhere.
    rec2 = types.SimpleNamespace(id="906", name="job-906", owner=ns, gpus=4, dataset="ds")
    backend.create_workload(rec2, PodTemplate(image="trainer:1", cpu="20"))
    spec2 = JobSpec("906", rec2.name, ns, 4, DatasetInfo("ds", "s3://b/ds", 1e9), 1e8, 1e9, 0.0)
    backend.refresh()
    backend.start(spec2, alloc(spec2))
    backend.poll()
    assert node_of_affinity(cp.job(ns, "silod-906")) == []
    assert cp.job(ns, "silod-906")["spec"]["suspend"] is True
    problems = " ".join(backend._reported.problems.values())
    assert "requests 20 CPU cores, no node has more than 16 free" in problems, problems


def test_silod_creates_rest_jobs_only_in_tenant_namespaces(tenant):
    """Least privilege (deploy/base): the ClusterRole does not grant Job creation; each tenant's
    namespace has a RoleBinding that does. kube-system (no such binding) is refused by RBAC."""
    cp, ns, _ = tenant
    backend = backend_for(cp)
    rest_job(backend, ns, "904", 1)  # the tenant's namespace: allowed
    from estimator.errors import UserError

    rec = types.SimpleNamespace(id="905", name="job-905", owner="kube-system", gpus=1, dataset="ds")
    with pytest.raises(UserError, match="HTTP 403"):
        backend.create_workload(rec, PodTemplate(image="trainer:1"))


def test_the_owner_cannot_drop_the_queue_label_from_a_queued_job(tenant):
    """The webhook is called for an UPDATE whose OLD object matches its objectSelector: removing
    silod.io/queue from a suspended Job is denied (it would leave the queue and the webhook's
    reach, and could then be unsuspended with no review)."""
    cp, ns, _ = tenant
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    rbac = client.RbacAuthorizationV1Api(cp.api_client())
    # (The built-in "edit" role is aggregated by a controller that does not run here.)
    rbac.create_namespaced_role(ns, {"metadata": {"name": "jobs-owner"}, "rules": [
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "create", "update", "patch"]}]})
    rbac.create_namespaced_role_binding(ns, {
        "metadata": {"name": "alice-edit"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                         "name": "jobs-owner"},
        "subjects": [{"kind": "User", "name": "alice", "apiGroup": "rbac.authorization.k8s.io"}]})
    alice = client.BatchV1Api(cp.api_client("alice"))
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"name": "mine", "labels": {"silod.io/queue": "default"}},
           "spec": {"template": {"spec": {
               "restartPolicy": "Never",
               "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
               "containers": [{"name": "t", "image": "busybox", "securityContext": {
                   "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}]}}}}
    created = wait(lambda: _try_create(alice, ns, job), 20, "alice's RoleBinding to take effect")
    assert created.spec.suspend is True  # the webhook suspended it at creation
    with pytest.raises(ApiException) as err:
        alice.patch_namespaced_job("mine", ns, {"metadata": {"labels": {"silod.io/queue": None}}})
    assert err.value.status == 403 and "cannot be removed" in err.value.body
    with pytest.raises(ApiException) as err:
        alice.patch_namespaced_job("mine", ns, {"spec": {"suspend": False}})
    assert err.value.status == 403
    assert alice.read_namespaced_job("mine", ns).spec.suspend is True


def _try_create(api, ns, job):  # type: ignore[no-untyped-def]
    from kubernetes.client.exceptions import ApiException

    try:
        return api.create_namespaced_job(ns, job)
    except ApiException as exc:
        if exc.status == 403 and "forbidden" in exc.body and "webhook" not in exc.body:
            return None  # RBAC cache not refreshed yet
        raise


def test_silods_events_carry_timestamps_and_its_field_manager(tenant):
    """A Warning Event silod writes (a job that cannot be placed) has first/last timestamps (kubectl
    shows its age) and is written as field manager silod."""
    cp, ns, nodes = tenant
    node = f"{ns}-small"
    nodes.append(node)
    cp.add_node(node, 1)
    backend = backend_for(cp)
    backend.refresh()
    spec = rest_job(backend, ns, "906", 64)
    backend.refresh()
    backend.start(spec, alloc(spec))
    events = wait(lambda: [e for e in cp.core.list_namespaced_event(ns).items if e.reason == "SiloDUnschedulable"],
                  20, "silod's Event")
    e = events[0]
    assert e.first_timestamp is not None and e.last_timestamp is not None and e.count == 1
    assert e.source.component == "silod" and e.involved_object.name == "silod-906"
    assert {m.manager for m in e.metadata.managed_fields} == {"silod"}


def test_the_real_csi_provisioner_provisions_and_deletes_a_pv_with_deploy_bases_rbac(tenant, tmp_path):
    """Finding 5: the real csi-provisioner sidecar (v5.0.1), authenticated as the
    silod-csi-controller service account (deploy/base's ClusterRole is all it may do), talks to
    the real `silod csi-controller`. A PVC of class silod gets its PV; once the PVC is deleted and
    the PV Released, the sidecar deletes the PV, removing its finalizer by PATCH (without `patch`
    on persistentvolumes the PV stays forever). The test plays the controllers that do not run
    here: the PV controller (the PVC's provisioner annotation, the PV's Released phase) and the
    pvc/pv-protection controllers (their finalizers)."""
    import subprocess


    from k8s_testenv import CSI_SA, binary
    from dataplane_helpers import silod_cmd

    cp, ns, _ = tenant
    catalog = tmp_path / "datasets.yaml"
    catalog.write_text(f"datasets:\n  - {{tenant: {ns}, name: ds, uri: '{tmp_path}'}}\n")
    sock = tmp_path / "csi" / "csi.sock"
    log = open(tmp_path / "csi.log", "ab")
    procs = [subprocess.Popen([*silod_cmd(), "csi-controller", "--socket", str(sock), "--datasets", str(catalog)],
                              stdout=log, stderr=subprocess.STDOUT)]
    try:
        wait(sock.exists, 60, "the csi-controller's socket")
        procs.append(subprocess.Popen(
            [str(binary("csi-provisioner")), f"--csi-address={sock}", f"--kubeconfig={cp.kubeconfig(CSI_SA)}",
             "--extra-create-metadata", "--v=3", "--timeout=30s"], stdout=log, stderr=subprocess.STDOUT))
        core = cp.core
        core.create_namespaced_persistent_volume_claim(ns, {
            "metadata": {"name": "ds", "annotations": {"volume.kubernetes.io/storage-provisioner": "silod.io",
                                                        "volume.beta.kubernetes.io/storage-provisioner": "silod.io"}},
            "spec": {"storageClassName": "silod", "accessModes": ["ReadOnlyMany"],
                     "resources": {"requests": {"storage": "1Gi"}}}})

        def pv_of_claim():
            return next((pv for pv in core.list_persistent_volume().items
                         if pv.spec.claim_ref and pv.spec.claim_ref.namespace == ns), None)
        pv = wait(pv_of_claim, 90, lambda: f"the provisioned PV: {(tmp_path / 'csi.log').read_text()[-1500:]}")
        assert pv.spec.csi.driver == "silod.io" and pv.spec.csi.volume_attributes["dataset"] == "ds"
        assert pv.spec.csi.volume_attributes["silod.io/namespace"] == ns
        assert pv.spec.persistent_volume_reclaim_policy == "Delete"

        core.delete_namespaced_persistent_volume_claim("ds", ns)
        core.patch_namespaced_persistent_volume_claim("ds", ns, {"metadata": {"finalizers": None}})  # pvc-protection
        try:
            core.patch_persistent_volume_status(pv.metadata.name, {"status": {"phase": "Released"}})  # the PV controller
        except ApiException as exc:
            if exc.status != 404:  # 404: the sidecar already deleted it
                raise

        def gone():
            try:
                cur = core.read_persistent_volume(pv.metadata.name)
            except Exception:  # noqa: BLE001 - 404: deleted
                return True
            if cur.metadata.deletion_timestamp and "kubernetes.io/pv-protection" in (cur.metadata.finalizers or []):
                # pv-protection (not running here) removes its own finalizer from a PV no pod uses.
                try:
                    core.patch_persistent_volume(pv.metadata.name, {"metadata": {"finalizers": [
                        f for f in cur.metadata.finalizers if f != "kubernetes.io/pv-protection"]}})
                except ApiException as exc:
                    if exc.status == 404:  # the sidecar deleted it between the read and this patch
                        return True
                    raise
            return False
        wait(gone, 90, lambda: f"the PV to be deleted: {(tmp_path / 'csi.log').read_text()[-2500:]}", interval=0.5)
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(30)



def test_a_rest_job_started_before_its_job_exists_is_admitted_once_it_does(tenant):
    """The REST handler commits the job, then creates its Job: a round may start the job in
    between (seen in the real-control-plane end-to-end run: the job was failed with "no Kubernetes
    workload" while its Job appeared a moment later). start() waits a grace period instead."""
    cp, ns, nodes = tenant
    node = f"{ns}-n"
    nodes.append(node)
    cp.add_node(node, 4)
    t = [1000.0]
    backend = backend_for(cp)
    backend.clock = lambda: t[0]
    backend.refresh()
    early = JobSpec("907", "job-907", ns, 1, DatasetInfo("ds", "s3://b/ds", 1e9), 1e8, 1e9, 0.0)
    backend.start(early, alloc(early))  # no Job yet: was UserError, the job failed
    rest_job(backend, ns, "907", 1)
    assert not [e for e in backend.poll() if e.kind == "failed"]
    assert cp.job(ns, "silod-907")["spec"]["suspend"] is False
    assert node_of_affinity(cp.job(ns, "silod-907")) == [node]
    # A job whose Job never appears fails after the grace period, with the reason.
    never = JobSpec("908", "job-908", ns, 1, DatasetInfo("ds", "s3://b/ds", 1e9), 1e8, 1e9, 0.0)
    backend.start(never, alloc(never))
    assert not [e for e in backend.poll() if e.job_id == "908"]
    t[0] += 31
    failed = [e for e in backend.poll() if e.job_id == "908"]
    assert failed and failed[0].kind == "failed" and "no Kubernetes workload" in failed[0].message


def test_deleting_a_workload_ends_its_silod_job_within_one_poll(tenant):
    """A Job deleted by its owner (or with its namespace) ends its silod job on the next poll,
    whatever silod held for it: a place in the queue, or a placement it was waiting for (no node
    fits it). Before, only an admitted job was failed; a queued one, or one waiting for placement
    (the GPUs the policy gave it stayed given), stayed queued/running until a REST DELETE."""
    cp, ns, nodes = tenant
    backend = backend_for(cp)
    backend.refresh()
    queued = rest_job(backend, ns, "931", 1)
    waiting = rest_job(backend, ns, "932", 2)  # no node at all: it cannot be placed
    backend.start(waiting, alloc(waiting))
    assert not [e for e in backend.poll() if e.kind == "failed"]
    assert cp.job(ns, "silod-932")["spec"]["suspend"] is True  # not admitted: waits for placement
    for name in ("silod-931", "silod-932"):
        cp.batch.delete_namespaced_job(name, ns, propagation_policy="Background")
    failed = {e.job_id: e.message for e in backend.poll() if e.kind == "failed"}
    assert set(failed) == {queued.job_id, waiting.job_id}, failed
    assert all("was deleted" in m for m in failed.values()), failed
    assert not [e for e in backend.poll() if e.kind == "failed"]  # once


def test_a_job_no_node_can_take_goes_back_to_the_queue_holds_no_gpus_and_fails_after_the_timeout(tenant):
    """Its pods need more GPUs each than any node has, or a nodeSelector no GPU node matches: silod's
    fit check on the cluster as if empty says it never fits. The job is not left "started"
    (before: deferred for ever, the policy's GPUs held, Gavel preempting placeable jobs for it): an
    "unschedulable" event with the reason (the service keeps it as the job's message and holds the
    job back from the policy), a Warning Event on the Job, the Job stays suspended; once a node that
    fits is added it is released to the policy; without one it fails after the timeout."""
    cp, ns, nodes = tenant
    node = f"{ns}-small"
    nodes.append(node)
    cp.add_node(node, 2)
    t = [5000.0]
    backend = backend_for(cp)
    backend.clock = lambda: t[0]
    backend.unschedulable_timeout_s = 600
    backend.refresh()
    big = rest_job(backend, ns, "941", 4)  # one pod of 4 GPUs; the only node has 2
    backend.start(big, alloc(big))
    events = [e for e in backend.poll() if e.job_id == "941"]
    assert events and {e.kind for e in events} == {"unschedulable"}, events
    assert "needs 4 GPUs, 2 free" in events[-1].message, events
    assert backend.unschedulable_jobs() == {"941"} and "941" not in backend._deferred
    assert cp.job(ns, "silod-941")["spec"]["suspend"] is True
    reasons = [e.reason for e in cp.core.list_namespaced_event(ns).items if e.involved_object.name == "silod-941"]
    assert "SiloDUnschedulable" in reasons, reasons
    # A node that fits arrives: released to the policy on the next poll.
    bigger = f"{ns}-big"
    nodes.append(bigger)
    cp.add_node(bigger, 8)
    t[0] += 30
    events = [e for e in backend.poll() if e.job_id == "941"]
    assert backend.unschedulable_jobs() == set() and "schedulable again" in events[-1].message, events
    backend.start(big, alloc(big))
    assert cp.job(ns, "silod-941")["spec"]["suspend"] is False and node_of_affinity(cp.job(ns, "silod-941")) == [bigger]
    # A nodeSelector no GPU node matches: held, then failed after the timeout with the reason.
    picky = rest_job(backend, ns, "942", 1)
    cp.batch.patch_namespaced_job("silod-942", ns, {"spec": {"template": {"spec": {"nodeSelector": {"gpu": "h100"}}}}})
    backend.refresh()
    backend.start(picky, alloc(picky))
    assert backend.unschedulable_jobs() == {"942"}
    t[0] += 601
    failed = [e for e in backend.poll() if e.job_id == "942" and e.kind == "failed"]
    assert failed and "nodeSelector" in failed[0].message and "unschedulable-timeout" in failed[0].message, failed
    assert backend.unschedulable_jobs() == set()
