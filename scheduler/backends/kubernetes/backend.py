"""The Kubernetes backend: admission of Job/JobSet/PyTorchJob workloads by suspension.

`silod serve --backend kubernetes` is one program: the REST API, the database, the policy loop
(`scheduler.service.scheduler_process.SchedulerService`) and this admission controller. Workloads reach the one
queue two ways:

- `POST /v1/jobs` with a `pod_template`: the service records the job and calls
  `create_workload`, which creates a suspended batch/v1 Job named `silod-<id>` in the caller's
  namespace (`<namespace-prefix><user>`), labelled `app.kubernetes.io/managed-by: silod`;
- `kubectl apply` of a Job, JobSet or PyTorchJob labelled `silod.io/queue`: `poll()` finds it
  and submits it to the service as a job of the namespace's tenant (its id is the service's id;
  its name `<kind>.<name>.<uid>` ties it to that one object, so a re-created object with the
  same name is a new job).

The service's rounds decide which jobs run; `start` places a job's pods (GPUs, node-local cache,
the node's share of remote IO: `placement.place`) and admits the workload by writing a required
node affinity into its pod templates and unsuspending it; `stop` suspends it again (its
controller removes the pods; silod never deletes a user's pods or workloads). Whether a workload
finished or failed comes from its controller's `status`; how far it got is what the node agents
measured its pods read (scheduler/service/consumption.py: pods attributed by silod from the API
server's controller chain, counters from node-bound agent tokens) once a report exists, and
silod's own estimate (SiloDPerf at its allocation x admitted time) before; never a number from an
object the workload's owner can write.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from estimator import silod_perf
from contract.names import node_mount_job
from estimator.errors import UserError
from estimator.units import UnitError, parse_rate, parse_size
from policies.types import ClusterCapacity
from scheduler.backends.base import (
    ClusterBackend, ClusterDescription, JobAllocation, JobEvent, JobSpec, NodeInfo,
)
from scheduler.backends.kubernetes.placement import NodeState, PodRequest, Taint, Toleration, place, why_not
from scheduler.backends.kubernetes.workloads import (
    GPU_RESOURCE, HOSTNAME_LABEL, JOB, JOB_ID_LABEL, KINDS, MANAGED_BY, MANAGED_BY_LABEL, QUEUE_LABEL, Kind, PodTemplate,
    Workload, WorkloadError, parse_cpu_quantity, PYTORCHJOB, admission_problems, admitted_object, parse_memory_quantity,
    parse_workload, report_secret_name, rest_job_object,
)
from scheduler.backends.kubernetes.nodematch import NodeLabels

log = logging.getLogger("silod.kubernetes")

NODE_ANN_CACHE = "silod.io/cache-capacity"  # bytes of local disk a node gives the dataset cache
NODE_ANN_IO = "silod.io/remote-io"  # the node's share of the remote link (e.g. its NIC), bytes/s
# A node agent's report of its cache disk counts this long (agents report every 10 s by default):
# an older one may be of an agent that is gone or a disk that was replaced.
AGENT_DISK_FRESH_S = 120.0
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
INTAKE_NAME = re.compile(r"^(job|jobset|pytorchjob)\.(.+)\.([0-9a-f-]{36})$")
REST_NAME = re.compile(r"^silod-([0-9]+)$")
AWAIT_WORKLOAD_S = 30.0  # how long a started job may wait for its REST-created Job to appear
# Every write names silod as its field manager (managedFields, server-side apply conflicts),
# not the client library's default "OpenAPI-Generator".
FIELD_MANAGER = "silod"


@dataclass
class Admission:
    """What silod granted an admitted workload (its own record; rebuilt from bound pods after a
    restart)."""

    nodes: dict[str, int]  # node -> GPUs placed there
    dataset: str  # the storage key (contract.names.storage_key): the node mount's and cache's name
    cache_bytes: float
    io_per_pod: float
    pods_per_node: dict[str, int]
    since: float
    base_consumed: float
    rate: float  # bytes/s the job progresses at under this allocation (SiloDPerf)
    total: float
    tenant: str = ""
    cpus: dict[str, float] = field(default_factory=dict)  # node -> CPU cores its pods there request
    memory: dict[str, float] = field(default_factory=dict)  # node -> bytes of memory its pods there request


@dataclass
class _Ref:
    kind: Kind
    namespace: str
    name: str
    uid: str


@dataclass
class _Seen:
    problems: dict[str, str] = field(default_factory=dict)  # uid -> resourceVersion already reported


def _api_exception() -> type[Exception]:
    from kubernetes.client.exceptions import ApiException

    return ApiException


class KubernetesBackend(ClusterBackend):
    name = "kubernetes"

    def __init__(
        self,
        api_client: Any,
        *,
        capacity: ClusterCapacity,
        namespace_prefix: str = "",
        default_queue: str = "default",
        clock: Callable[[], float] = time.time,
        request_timeout: float = 30.0,
        unschedulable_timeout_s: float = 3600.0,
        extended_resource_toleration: bool = False,
        pending_grace_s: float = 120.0,
        api_url: str | None = None,
    ):
        from kubernetes import client

        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.capacity = capacity
        self.namespace_prefix = namespace_prefix
        self.default_queue = default_queue
        self.clock = clock
        self.timeout = request_timeout
        self.service: Any = None  # the SchedulerService this backend feeds (attach)
        self._lock = threading.RLock()
        self._refs: dict[str, _Ref] = {}  # service job id -> workload
        self._by_uid: dict[str, str] = {}  # workload uid -> service job id
        self._admitted: dict[str, Admission] = {}
        self._deferred: dict[str, tuple[JobSpec, JobAllocation]] = {}
        self._to_suspend: set[str] = set()  # stopped jobs whose suspension is still to be written
        self._awaiting: dict[str, tuple[JobSpec, JobAllocation, float]] = {}  # started before their Job existed
        self._events: list[JobEvent] = []
        self._reported = _Seen()
        self._kinds: dict[str, bool] = {}
        self._kinds_checked = 0.0
        self.workloads: dict[str, Workload] = {}  # uid -> parsed
        self._objects: dict[str, dict[str, Any]] = {}  # uid -> raw object
        self.nodes: list[NodeState] = []
        self._bound: list[dict[str, Any]] = []  # pods bound to a node that hold resources (not ended)
        self._placed: list[dict[str, Any]] = []  # every pod bound to a node, ended ones included
        self._recovered = False
        self.storage: Any = None  # a data manager client: remote IO of the agents' node mounts
        self._pushed_io: dict[str, float] = {}
        self.elector: Any = None  # a LeaderElector when several replicas run (create_backend)
        self.consumption: Any = None  # ConsumptionStore over the service's database (attach)
        self._job_parents: dict[str, str] = {}  # a JobSet's child Job uid -> its controller's uid
        # Jobs no node could take even with the cluster empty: job id -> (reason, since). Held
        # back from the policy (unschedulable_jobs), failed after unschedulable_timeout_s.
        self._unschedulable: dict[str, tuple[str, float]] = {}
        self._unschedulable_specs: dict[str, tuple[JobSpec, JobAllocation]] = {}
        self.unschedulable_timeout_s = unschedulable_timeout_s
        self.extended_resource_toleration = extended_resource_toleration
        # Pods of an admitted workload that kube-scheduler keeps Unschedulable for this long send
        # the job back to the queue (a shorter wait would catch pods waiting for preempted pods
        # to leave). Their first sighting per job, on silod's clock:
        self.pending_grace_s = pending_grace_s
        self._pending_since: dict[str, float] = {}
        self._refused_first: dict[str, float] = {}  # job id -> kube-scheduler's first refusal (timeout)
        # When kube-scheduler refused a job (its reason is one silod's fit check does not model):
        # job id -> the nodes' signature then; released when the nodes change.
        self._refused_on: dict[str, tuple[str, str]] = {}  # ... -> (nodes' signature, kube-scheduler's reason)
        self._unbound: list[dict[str, Any]] = []  # pods no scheduler bound yet (not ended)
        self._raw_nodes: list[Any] = []
        self._raw_nodes_at = -1e18  # time.monotonic() of the last node list
        self._agent_disks: dict[str, float] = {}  # node -> cache bytes its agent reported (fresh)
        # Where pods' step reporters reach the API (--backend-opt api-url): with it, each admitted
        # job gets a report token (the service mints it: `report_tokens`) in a per-job Secret.
        self.api_url = api_url
        self.report_tokens = api_url is not None
        self.admissions = 0  # successful admissions (observability, tests)
        self.suspensions = 0

    # --- wiring ------------------------------------------------------------------------------

    def attach(self, service: Any) -> None:
        """Feed kubectl-created workloads into `service` (one queue for REST and kubectl)."""
        self.service = service
        sessions = getattr(service, "sessions", None)
        if sessions is not None:
            from scheduler.service.consumption import ConsumptionStore

            self.consumption = ConsumptionStore(sessions, getattr(service, "_write_lock", None))

    def _admitted_pods(self) -> list[Any]:
        """The bound pods of admitted workloads, attributed by the API server's record alone: the
        pod's controller chain ends at the workload's uid, the pod is in the workload's namespace
        and on a node of the admission (docs/kubernetes.md, "Trusted consumption")."""
        from scheduler.service.consumption import AdmittedPod

        out = []
        for job_id, adm in self._admitted.items():
            ref = self._refs.get(job_id)
            if ref is None:
                continue
            for pod in self._placed:
                meta = pod.get("metadata") or {}
                node = (pod.get("spec") or {}).get("nodeName")
                if meta.get("namespace") != ref.namespace or node not in adm.nodes or not meta.get("uid"):
                    continue
                if self._controlled_by(meta, ref):
                    out.append(AdmittedPod(str(meta["uid"]), job_id, node, ref.namespace, str(meta.get("name") or "")))
        return out

    def _controlled_by(self, meta: dict[str, Any], ref: _Ref) -> bool:
        owner = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
        if owner is None:
            return False
        if owner.get("uid") == ref.uid:
            return True  # Job -> pods, PyTorchJob -> pods
        if ref.kind.kind != "JobSet" or owner.get("kind") != "Job" or owner.get("apiVersion") != "batch/v1":
            return False
        parent = self._job_parents.get(str(owner.get("uid")))
        if parent is None:  # a JobSet's child Job: its own controller must be the JobSet
            try:
                job = self.custom.get_namespaced_custom_object("batch", "v1", ref.namespace, "jobs", owner.get("name"),
                                                               _request_timeout=self.timeout)
            except _api_exception():
                return False
            if job["metadata"].get("uid") != owner.get("uid"):
                return False
            ctl = next((o for o in job["metadata"].get("ownerReferences") or [] if o.get("controller")), {})
            parent = self._job_parents[str(owner.get("uid"))] = str(ctl.get("uid") or "")
        return parent == ref.uid

    def _measured_progress(self) -> dict[str, float]:
        """Measured bytes read per admitted job (jobs with at least one accepted report)."""
        if self.consumption is None or not self._admitted:
            return {}
        try:
            self.consumption.record_pods(self._admitted_pods())
            return {j: float(m.read_bytes) for j, m in self.consumption.measured(self._admitted).items()}
        except Exception as exc:  # noqa: BLE001 - a database hiccup: fall back to the estimate this poll
            log.warning("consumption reports not read this poll: %s", exc)
            return {}

    def tenant_namespace(self, user: str) -> str:
        ns = f"{self.namespace_prefix}{user}"
        if not DNS_LABEL.match(ns):
            raise UserError(f"user {user!r} has no valid Kubernetes namespace ({ns!r} is not a DNS label); use user"
                            f" names of lowercase letters, digits and '-'")
        return ns

    def namespace_tenant(self, namespace: str) -> str | None:
        if not namespace.startswith(self.namespace_prefix):
            return None
        return namespace[len(self.namespace_prefix):] or None

    # --- reading the cluster -------------------------------------------------------------------

    def _available_kinds(self) -> list[Kind]:
        """Job always; JobSet and PyTorchJob when their CRDs answer (re-checked every 5 minutes)."""
        now = time.monotonic()
        if not self._kinds or now - self._kinds_checked > 300:
            self._kinds_checked = now
            for kind in KINDS:
                if kind == JOB:
                    self._kinds[kind.kind] = True
                    continue
                try:
                    self.custom.list_cluster_custom_object(kind.group, kind.version, kind.plural, limit=1,
                                                           _request_timeout=self.timeout)
                    self._kinds[kind.kind] = True
                except _api_exception() as exc:
                    if exc.status != 404:
                        raise
                    self._kinds[kind.kind] = False
        return [k for k in KINDS if self._kinds.get(k.kind)]

    def refresh(self) -> None:
        t = self.timeout
        nodes = self.core.list_node(_request_timeout=t).items
        # Every pod. Bound ones, ended ones included: those hold no GPUs (_bound leaves them out)
        # but a pod that read data and finished between two polls must still be attributed to its
        # job. Pending unbound ones say whether kube-scheduler can bind an admitted workload's pods
        # at all (_check_refused).
        pods = self.api_client.sanitize_for_serialization(self.core.list_pod_for_all_namespaces(
            _request_timeout=t).items)
        workloads: dict[str, Workload] = {}
        objects: dict[str, dict[str, Any]] = {}
        for kind in self._available_kinds():
            listed = self.custom.list_cluster_custom_object(kind.group, kind.version, kind.plural,
                                                            label_selector=QUEUE_LABEL, _request_timeout=t)
            for obj in listed.get("items") or []:
                obj.setdefault("apiVersion", kind.api_version)
                obj.setdefault("kind", kind.kind)
                uid = obj["metadata"]["uid"]
                try:
                    wl = parse_workload(kind, obj)
                except WorkloadError as exc:
                    self._report(obj, kind, str(exc))
                    continue
                workloads[uid] = wl
                objects[uid] = obj
        with self._lock:
            self._placed = [p for p in pods if (p.get("spec") or {}).get("nodeName")]
            self._unbound = [p for p in pods if not (p.get("spec") or {}).get("nodeName")
                             and (p.get("status") or {}).get("phase") in (None, "Pending")]
            self._bound = [p for p in self._placed
                           if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
            self.workloads, self._objects = workloads, objects
            self._raw_nodes, self._raw_nodes_at = nodes, time.monotonic()
            self._agent_disks = self._read_agent_disks()
            self.nodes = self._node_states(nodes)
            if not self._recovered:
                self._recover()

    def _node_states(self, nodes: list[Any]) -> list[NodeState]:
        ready = []
        for n in nodes:
            conds = {c.type: c.status for c in (n.status.conditions or [])} if n.status else {}
            if (n.spec and n.spec.unschedulable) or conds.get("Ready") != "True":
                continue
            alloc = (n.status.allocatable or {}) if n.status else {}
            try:
                gpus = int(str(alloc.get(GPU_RESOURCE, "0")))
            except ValueError:
                gpus = 0
            if gpus > 0:
                ready.append(n)
        count = max(len(ready), 1)
        used: dict[str, int] = {}
        cpu_used: dict[str, float] = {}
        mem_used: dict[str, float] = {}
        for p in self._bound:
            used[p["spec"]["nodeName"]] = used.get(p["spec"]["nodeName"], 0) + _pod_gpus(p)
            cpu_used[p["spec"]["nodeName"]] = cpu_used.get(p["spec"]["nodeName"], 0.0) + _pod_cpus(p)
            mem_used[p["spec"]["nodeName"]] = mem_used.get(p["spec"]["nodeName"], 0.0) + _pod_memory(p)
        cache_used: dict[str, dict[str, float]] = {}
        io_used: dict[str, float] = {}
        reserved: dict[str, int] = {}
        cpu_reserved: dict[str, float] = {}
        mem_reserved: dict[str, float] = {}
        for job_id, adm in self._admitted.items():
            bound_here = self._bound_gpus_of(job_id)
            bound_cpus = self._bound_cpus_of(job_id) if adm.cpus else {}
            bound_mem = self._bound_memory_of(job_id) if adm.memory else {}
            for node, g in adm.nodes.items():
                reserved[node] = reserved.get(node, 0) + max(g - bound_here.get(node, 0), 0)
                cpu_reserved[node] = cpu_reserved.get(node, 0.0) + max(adm.cpus.get(node, 0.0) - bound_cpus.get(node, 0.0), 0.0)
                mem_reserved[node] = mem_reserved.get(node, 0.0) + max(adm.memory.get(node, 0.0) - bound_mem.get(node, 0.0), 0.0)
                per = cache_used.setdefault(node, {})
                per[adm.dataset] = max(per.get(adm.dataset, 0.0), adm.cache_bytes)
                io_used[node] = io_used.get(node, 0.0) + adm.io_per_pod * adm.pods_per_node.get(node, 0)
        out = []
        for n in ready:
            name = n.metadata.name
            ann = n.metadata.annotations or {}
            try:
                # The node agent's own measure of its cache disk while fresh; else the operator's
                # annotation; else an even share of --cache.
                if name in self._agent_disks:
                    cache, source = self._agent_disks[name], "agent"
                elif ann.get(NODE_ANN_CACHE):
                    cache, source = parse_size(ann[NODE_ANN_CACHE], f"node {name} annotation {NODE_ANN_CACHE}"), "annotation"
                else:
                    cache, source = self.capacity.cache / count, "share"
                io = (parse_rate(ann[NODE_ANN_IO], f"node {name} annotation {NODE_ANN_IO}")
                      if ann.get(NODE_ANN_IO) else self.capacity.remote_io / count)
            except UnitError as exc:
                log.warning("node %s ignored: %s", name, exc)
                continue
            gpus = int(str((n.status.allocatable or {}).get(GPU_RESOURCE, "0")))
            try:
                cpus = parse_cpu_quantity((n.status.allocatable or {}).get("cpu", "0"), f"node {name} allocatable cpu")
                memory = parse_memory_quantity((n.status.allocatable or {}).get("memory", "0"),
                                               f"node {name} allocatable memory")
            except WorkloadError as exc:
                log.warning("node %s ignored: %s", name, exc)
                continue
            out.append(NodeState(
                name=name, hostname=(n.metadata.labels or {}).get(HOSTNAME_LABEL, name),
                gpus_free=max(gpus - used.get(name, 0) - reserved.get(name, 0), 0), cache_capacity=cache,
                cache_used=cache_used.get(name, {}), io_capacity=io, io_used=io_used.get(name, 0.0),
                labels=dict(n.metadata.labels or {}),
                taints=tuple(Taint(t.key or "", t.value or "", t.effect or "")
                             for t in ((n.spec.taints if n.spec else None) or [])),
                # A node that does not publish allocatable cpu is not CPU-limited here.
                cpus_free=(max(cpus - cpu_used.get(name, 0.0) - cpu_reserved.get(name, 0.0), 0.0)
                           if "cpu" in (n.status.allocatable or {}) else float("inf")),
                memory_free=(max(memory - mem_used.get(name, 0.0) - mem_reserved.get(name, 0.0), 0.0)
                             if "memory" in (n.status.allocatable or {}) else float("inf")),
                cache_source=source,
            ))
        return out

    def _read_agent_disks(self) -> dict[str, float]:
        """node -> the cache bytes its agent reported within AGENT_DISK_FRESH_S (the consumption
        store over the service's database: the agents report to the API workers)."""
        if self.consumption is None:
            return {}
        try:
            return self.consumption.cache_disks(AGENT_DISK_FRESH_S)
        except Exception as exc:  # noqa: BLE001 - a database hiccup: the last reading stays this poll
            log.warning("agents' cache disks not read this poll: %s", exc)
            return self._agent_disks

    def _pods_of(self, job_id: str, pods: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        ref = self._refs.get(job_id)
        if ref is None:
            return []
        out = []
        for p in self._bound if pods is None else pods:
            meta = p["metadata"]
            if meta.get("namespace") != ref.namespace:
                continue
            owners = {o.get("uid") for o in meta.get("ownerReferences") or []}
            labels = meta.get("labels") or {}
            if ref.uid in owners or labels.get("jobset.sigs.k8s.io/jobset-name") == ref.name and ref.kind.kind == "JobSet" \
                    or labels.get("training.kubeflow.org/job-name") == ref.name and ref.kind.kind == "PyTorchJob":
                out.append(p)
        return out

    def _bound_cpus_of(self, job_id: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for p in self._pods_of(job_id):
            out[p["spec"]["nodeName"]] = out.get(p["spec"]["nodeName"], 0.0) + _pod_cpus(p)
        return out

    def _bound_memory_of(self, job_id: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for p in self._pods_of(job_id):
            out[p["spec"]["nodeName"]] = out.get(p["spec"]["nodeName"], 0.0) + _pod_memory(p)
        return out

    def _bound_gpus_of(self, job_id: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self._pods_of(job_id):
            out[p["spec"]["nodeName"]] = out.get(p["spec"]["nodeName"], 0) + _pod_gpus(p)
        return out

    def _recover(self) -> None:
        """After a (re)start: which service job is which workload, and what runs where."""
        if self.service is None:
            return  # not attached yet (the service describes the cluster before attach): later
        self._recovered = True
        from scheduler.service.types import ADMIN, Principal

        admin = Principal(ADMIN, is_admin=True)
        by_uid = {uid: wl for uid, wl in self.workloads.items()}
        by_name = {(wl.namespace, wl.name, wl.kind.kind): wl for wl in self.workloads.values()}
        for rec in self.service.list_jobs(admin, limit=1_000_000):
            m = INTAKE_NAME.match(rec.name)
            wl = None
            if m and m.group(3) in by_uid:
                wl = by_uid[m.group(3)]
            elif rec.name and (ns := self._safe_namespace(rec.owner)):
                wl = by_name.get((ns, f"silod-{rec.id}", "Job"))
                if wl is not None and wl.rest_job_id != rec.id:
                    wl = None
            if wl is None:
                continue
            self._remember(rec.id, wl)
            if rec.state == "running" and not wl.suspended and wl.phase == "active":
                self._admitted[rec.id] = self._recovered_admission(rec, wl)

    def _recovered_admission(self, rec: Any, wl: Workload) -> Admission:
        nodes: dict[str, int] = {}
        pods: dict[str, int] = {}
        for p in self._pods_of(rec.id):
            nodes[p["spec"]["nodeName"]] = nodes.get(p["spec"]["nodeName"], 0) + _pod_gpus(p)
            pods[p["spec"]["nodeName"]] = pods.get(p["spec"]["nodeName"], 0) + 1
        io = (rec.remote_io or 0.0) / max(wl.pods, 1)
        # The cache this job's dataset holds is not in the record: estimate progress as if cold
        # (min(f*, b)), which can only under-state it until the next admission.
        rate = min(rec.ideal_throughput, rec.remote_io) if rec.remote_io else rec.ideal_throughput
        return Admission(nodes=nodes, dataset=self._storage_key(rec), cache_bytes=0.0, io_per_pod=io, pods_per_node=pods,
                         since=self.clock(), base_consumed=rec.consumed_bytes, rate=rate, total=rec.total_bytes,
                         tenant=self.namespace_tenant(wl.namespace) or "")  # its pods are bound: their CPU counts as used

    def _storage_key(self, rec: Any) -> str:
        """The storage key of a job record's dataset (the record names it by the tenant's name)."""
        from scheduler.service.types import ADMIN, Principal

        try:
            return self.service.get_dataset(Principal(ADMIN, is_admin=True), rec.dataset, rec.dataset_owner).key
        except Exception as exc:  # noqa: BLE001 - deleted meanwhile: its mounts get no IO until re-admitted
            log.warning("job %s: dataset %s/%s not found (%s); its node mounts get no remote IO", rec.id,
                        rec.dataset_owner, rec.dataset, exc)
            return ""

    def _safe_namespace(self, user: str) -> str | None:
        try:
            return self.tenant_namespace(user)
        except UserError:
            return None

    def _remember(self, job_id: str, wl: Workload) -> None:
        self._refs[job_id] = _Ref(wl.kind, wl.namespace, wl.name, wl.uid)
        self._by_uid[wl.uid] = job_id

    # --- reporting -----------------------------------------------------------------------------

    def _report(self, obj: dict[str, Any], kind: Kind, message: str, reason: str = "SiloDInvalidWorkload") -> None:
        """A Warning Event on the workload, once per (object version, message)."""
        meta = obj.get("metadata") or {}
        key = f"{meta.get('uid')}:{meta.get('resourceVersion')}:{message}"
        if key in self._reported.problems:
            return
        if len(self._reported.problems) > 10_000:  # bounded: old versions' reports are forgotten
            self._reported.problems.clear()
        self._reported.problems[key] = message
        log.warning("%s %s/%s: %s", kind.kind, meta.get("namespace"), meta.get("name"), message)
        from kubernetes import client

        now = datetime.now(timezone.utc)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{meta.get('name')}.", namespace=meta.get("namespace")),
            # kubectl get events sorts and ages by these; without them an Event shows "<unknown>".
            first_timestamp=now, last_timestamp=now, count=1, reporting_component="silod",
            reporting_instance=os.environ.get("POD_NAME") or os.uname().nodename,
            involved_object=client.V1ObjectReference(api_version=kind.api_version, kind=kind.kind,
                                                     name=meta.get("name"), namespace=meta.get("namespace"),
                                                     uid=meta.get("uid")),
            reason=reason, message=message[:1024], type="Warning", source=client.V1EventSource(component="silod"),
        )
        try:
            self.core.create_namespaced_event(meta.get("namespace") or "default", event, field_manager=FIELD_MANAGER,
                                              _request_timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - an Event is best effort; the log line stays
            log.debug("could not record an Event: %s", exc)

    # --- intake of kubectl workloads -------------------------------------------------------------

    def _intake(self) -> None:
        if self.service is None:
            return
        from scheduler.service.types import NewJob, Principal, ServiceError

        for uid, wl in list(self.workloads.items()):
            if uid in self._by_uid or wl.phase != "active":
                continue
            if wl.rest_job_id is not None and REST_NAME.match(wl.name) and wl.kind == JOB:
                continue  # a Job silod created for a REST job (mapped when created or recovered)
            obj = self._objects[uid]
            if not wl.suspended:
                # Created running (no webhook): hold it until it is admitted, as Kueue does. Its
                # controller removes the pods it already started; silod deletes nothing.
                if not self._suspend(wl):
                    continue
            tenant = self.namespace_tenant(wl.namespace)
            problem = None
            if tenant is None:
                problem = f"namespace {wl.namespace} does not belong to a silod tenant (prefix {self.namespace_prefix!r})"
            elif wl.dataset is None:
                problem = ("no dataset: add a volume `csi: {driver: silod.io, volumeAttributes: {dataset: NAME}}`"
                           " to the pod template (or the annotation silod.io/dataset)")
            elif wl.epochs is None:
                problem = "missing annotation silod.io/epochs (passes over the dataset, e.g. \"3\")"
            elif wl.ideal_throughput is None and wl.model is None:
                problem = "give the annotation silod.io/ideal-throughput (e.g. 900MB/s) or silod.io/model"
            elif wl.gpus < 1:
                problem = f"its pods request no {GPU_RESOURCE}; silod schedules GPU workloads"
            if problem:
                self._report(obj, wl.kind, f"{wl.key}: {problem}")
                continue
            req = NewJob(name=f"{wl.kind.kind.lower()}.{wl.name[:63]}.{wl.uid}", gpus=wl.gpus, dataset=wl.dataset or "",
                         epochs=wl.epochs, ideal_throughput=wl.ideal_throughput,
                         model=None if wl.ideal_throughput is not None else wl.model,
                         priority=self._priority(wl.priority_class))
            try:
                rec = self.service.submit_job(Principal(tenant or ""), req)
            except ServiceError as exc:
                self._report(obj, wl.kind, f"{wl.key}: {exc}")
                continue
            log.info("queued %s as job %s of %s", wl.key, rec.id, tenant)
            self._remember(rec.id, wl)

    def _priority(self, class_name: str | None) -> int:
        """A PriorityClass's value (cluster-scoped, written by operators, not by workload
        owners), scaled into the service's -1000..1000. Unknown or absent: 0."""
        if not class_name:
            return 0
        try:
            from kubernetes import client

            pc = client.SchedulingV1Api(self.api_client).read_priority_class(class_name, _request_timeout=self.timeout)
        except Exception:  # noqa: BLE001 - a missing class is the default priority, as for the kube-scheduler
            return 0
        value = int(pc.value or 0)
        return max(-1000, min(1000, value // 1_000_000 if abs(value) >= 1_000_000 else value))

    # --- REST-created Jobs ---------------------------------------------------------------------

    def create_workload(self, job: Any, template: PodTemplate) -> None:
        """Create the suspended Job for a REST submission `job` (a JobRecord) in its owner's
        namespace. UserError (the job is then failed) when Kubernetes refuses it."""
        body = self.check_workload(job.owner, job.name, job.gpus, job.dataset, template, job_id=job.id)
        ns = body["metadata"]["namespace"]
        try:
            obj = self.custom.create_namespaced_custom_object("batch", "v1", ns, "jobs", body,
                                                              field_manager=FIELD_MANAGER, _request_timeout=self.timeout)
        except _api_exception() as exc:
            if exc.status == 404:
                raise UserError(f"namespace {ns} does not exist; an operator creates one namespace per tenant"
                                f" (docs/kubernetes.md)") from None
            if exc.status == 409:
                raise UserError(f"a Job named silod-{job.id} already exists in namespace {ns}; delete it") from None
            raise UserError(f"Kubernetes refused the Job for job {job.id}: HTTP {exc.status} {exc.reason}") from None
        with self._lock:
            wl = parse_workload(JOB, obj)
            self.workloads[wl.uid] = wl
            self._objects[wl.uid] = obj
            self._remember(job.id, wl)

    def check_workload(self, owner: str, name: str, gpus: int, dataset: str, template: PodTemplate,
                       job_id: str = "0") -> dict[str, Any]:
        """The Job a REST submission would create, checked as the admission webhook checks a
        kubectl workload (workloads.admission_problems: one validation for both). WorkloadError
        (a UserError naming the field and the fix) when silod would never admit it."""
        ns = self.tenant_namespace(owner)
        body = rest_job_object(job_id=job_id, name=name, namespace=ns, queue=self.default_queue, gpus=gpus,
                               dataset=dataset, template=template)
        problems = admission_problems(JOB, body, self.node_labels())
        if problems:
            raise WorkloadError("; ".join(p.replace(f"Job silod-{job_id} spec.template", "pod_template")
                                          for p in problems))
        return body

    def node_labels(self) -> list[NodeLabels]:
        """Every node's name, labels and GPUs (for admission's selector check), read at most
        every 10 s (this process may not poll: the API workers create REST Jobs)."""
        now = time.monotonic()
        if self._raw_nodes and now - self._raw_nodes_at < 10:
            nodes = self._raw_nodes
        else:
            nodes = self.core.list_node(_request_timeout=self.timeout).items
            with self._lock:
                self._raw_nodes, self._raw_nodes_at = nodes, now
        out = []
        for n in nodes:
            try:
                gpus = int(str(((n.status.allocatable or {}) if n.status else {}).get(GPU_RESOURCE, "0")))
            except ValueError:
                gpus = 0
            out.append(NodeLabels(n.metadata.name, dict(n.metadata.labels or {}), gpus))
        return out

    # --- ClusterBackend --------------------------------------------------------------------------

    def describe(self) -> ClusterDescription:
        if not self.nodes:
            try:
                self.refresh()
            except Exception as exc:  # noqa: BLE001 - at startup every failure is the operator's to fix
                host = getattr(getattr(self.api_client, "configuration", None), "host", "?")
                raise UserError(f"cannot read the cluster from the Kubernetes API at {host}: "
                                f"{type(exc).__name__}: {str(exc)[:300]}") from None
        return ClusterDescription(
            nodes=tuple(NodeInfo(name=n.name, gpus=n.gpus_free, cache=n.cache_capacity, labels=dict(n.labels),
                                 cache_source=n.cache_source)
                        for n in self.nodes),
            remote_io=self.capacity.remote_io,
        )

    def _workload_of(self, job_id: str) -> tuple[Workload, dict[str, Any]] | None:
        ref = self._refs.get(job_id)
        if ref is None or ref.uid not in self.workloads:
            return None
        return self.workloads[ref.uid], self._objects[ref.uid]

    def start(self, job: JobSpec, allocation: JobAllocation) -> None:
        with self._lock:
            self._to_suspend.discard(job.job_id)
            if self._workload_of(job.job_id) is None:
                self.refresh()
                self._adopt_rest_job(job)
            if self._workload_of(job.job_id) is None:
                # A REST job is committed to the database before its Job is created (the API
                # handler creates it next): a round may start it in between. Wait a grace period
                # before failing it (poll() checks again).
                self._awaiting[job.job_id] = (job, allocation, self.clock() + AWAIT_WORKLOAD_S)
                return
            if not self._admit(job, allocation) and job.job_id not in self._unschedulable:
                self._deferred[job.job_id] = (job, allocation)

    def _pod_requests(self, wl: Workload) -> list[PodRequest]:
        """The workload's pods as placement sees them. With `extended-resource-toleration` (the API
        server runs the ExtendedResourceToleration admission plugin) a pod requesting GPUs
        tolerates `nvidia.com/gpu` NoSchedule taints as that plugin makes it, so silod offers
        the nodes kube-scheduler will bind it to."""
        out = []
        for ps in wl.pod_sets:
            tols = tuple(Toleration(*t) for t in ps.tolerations)
            if self.extended_resource_toleration and ps.gpus > 0:
                tols += (Toleration(GPU_RESOURCE, "Exists", "", "NoSchedule"),)
            out += [PodRequest(f"{wl.key}/{ps.name}-{i}", ps.gpus, ps.node_selector, tols, ps.cpus, ps.affinity_terms,
                               ps.memory) for i in range(ps.count)]
        return out

    def unschedulable_jobs(self) -> set[str]:
        """Jobs whose pods fit on no node even with the cluster empty (the service holds them
        back from the policy: they get no GPUs while this lasts)."""
        with self._lock:
            return set(self._unschedulable)

    def _empty_cluster(self) -> list[NodeState]:
        """The ready nodes as if nothing ran on them: what a job could ever get today."""
        bound, admitted = self._bound, self._admitted
        try:
            self._bound, self._admitted = [], {}
            return self._node_states(self._raw_nodes)
        finally:
            self._bound, self._admitted = bound, admitted

    def cluster_capacity(self) -> ClusterCapacity | None:
        """What the cluster's Ready, schedulable GPU nodes offer (as of the last poll), capped by
        the flags (`--gpus`, `--cache`, `--remote-io`, `--gpus-per-node`): nodes added or removed
        reach the next round. None when no such node has a GPU (the service then plans nothing)."""
        with self._lock:
            nodes = self._empty_cluster()
        cap = self.capacity
        gpus = sum(n.gpus_free for n in nodes)
        if gpus < 1:
            return None
        return ClusterCapacity(
            gpus=min(cap.gpus, gpus), cache=min(cap.cache, sum(n.cache_capacity for n in nodes)),
            remote_io=min(cap.remote_io, sum(n.io_capacity for n in nodes)),
            gpus_per_node=max(min(cap.gpus_per_node, max(n.gpus_free for n in nodes)), 1),
            irregular_share=cap.irregular_share, cpus_per_node=cap.cpus_per_node, cpu_allocation=cap.cpu_allocation)

    def _never_fits(self, pods: list[PodRequest], ds_key: str, cache: float, io_per_pod: float) -> str | None:
        """Why the pods fit on no node of the empty cluster, or None when they would fit there
        (then they only wait for room)."""
        empty = self._empty_cluster()
        if place(pods, empty, dataset=ds_key, cache_bytes=cache, io_per_pod=io_per_pod) is not None:
            return None
        return why_not(pods, empty, dataset=ds_key, cache_bytes=cache, io_per_pod=io_per_pod)

    def _fresh(self, wl: Workload) -> tuple[Workload, dict[str, Any]] | None:
        """The workload as the API server has it now (its controller and owner change it)."""
        try:
            obj = self.custom.get_namespaced_custom_object(wl.kind.group, wl.kind.version, wl.namespace,
                                                           wl.kind.plural, wl.name, _request_timeout=self.timeout)
        except _api_exception() as exc:
            if exc.status == 404:
                return None
            raise
        if obj["metadata"].get("uid") != wl.uid:
            return None  # deleted and re-created under the same name: another workload
        try:
            parsed = parse_workload(wl.kind, obj)
        except WorkloadError as exc:
            self._report(obj, wl.kind, str(exc))
            return None
        self.workloads[wl.uid], self._objects[wl.uid] = parsed, obj
        return parsed, obj

    def _adopt_rest_job(self, job: JobSpec) -> None:
        """The Job of a REST submission that another replica (or an earlier process) created: it
        is `silod-<id>` in the owner's namespace, labelled with the id; the name and namespace
        are what make it ours (an owner can copy labels, not take a name in another namespace)."""
        ns = self._safe_namespace(job.owner)
        for wl in self.workloads.values():
            if (wl.kind == JOB and wl.namespace == ns and wl.name == f"silod-{job.job_id}"
                    and wl.rest_job_id == job.job_id):
                self._remember(job.job_id, wl)

    def _admit(self, job: JobSpec, allocation: JobAllocation) -> bool:
        found = self._workload_of(job.job_id)
        if found is None or (fresh := self._fresh(found[0])) is None:
            return False
        wl, obj = fresh
        if wl.phase != "active":
            return True  # finished already; poll() reports it
        if wl.kind == JOB and wl.suspended and (obj.get("status") or {}).get("startTime"):
            cleared = self._clear_start_time(wl, obj)
            if cleared is None:
                return False  # its pods are still stopping (or a conflict): the next poll retries
            wl, obj = cleared
        cache = float(allocation.cache_bytes or 0.0)
        io_total = float(allocation.remote_io or 0.0)
        io_per_pod = io_total / max(wl.pods, 1)
        pod_cpus = wl.pod_cpus()
        pods = self._pod_requests(wl)
        # Cache on a node is per storage key: two tenants' `files` are two caches (issue 20).
        ds_key = job.dataset.name
        where = place(pods, self.nodes, dataset=ds_key, cache_bytes=cache, io_per_pod=io_per_pod)
        if where is None:
            never = self._never_fits(pods, ds_key, cache, io_per_pod)
            if never is not None:
                first = self._unschedulable.get(job.job_id, ("", self.clock()))[1]
                reason = (f"unschedulable: {never}; back in the queue without GPUs until a node can take it, failed"
                          f" after {self.unschedulable_timeout_s:g} s")
                self._unschedulable[job.job_id] = (reason, first)
                self._unschedulable_specs[job.job_id] = (job, allocation)
                self._report(obj, wl.kind, f"{wl.key} is {reason}", reason="SiloDUnschedulable")
                self._events.append(JobEvent(job.job_id, "unschedulable", time=self.clock(), message=reason))
                return False
            self._report(obj, wl.kind, f"{wl.key} waits for placement: "
                         + why_not(pods, self.nodes, dataset=ds_key, cache_bytes=cache, io_per_pod=io_per_pod),
                         reason="SiloDWaitingForPlacement")
            return False
        self._drop_unschedulable(job.job_id)
        host = {n.name: n.hostname for n in self.nodes}
        hostnames = sorted({host[n] for n in where.values()})
        if job.report_token:  # before the pods exist: they read it when their containers start
            self._write_report_secret(job.job_id, wl, job.report_token)
        if not self._write(wl, admitted_object(wl.kind, obj, hostnames)):
            return False
        nodes: dict[str, int] = {}
        per_node: dict[str, int] = {}
        gpus_of = {p.key: p.gpus for p in pods}
        cpus_on: dict[str, float] = {}
        mem_on: dict[str, float] = {}
        mem_of = {p.key: p.memory for p in pods}
        for key, n in where.items():
            nodes[n] = nodes.get(n, 0) + gpus_of[key]
            per_node[n] = per_node.get(n, 0) + 1
            cpus_on[n] = cpus_on.get(n, 0.0) + pod_cpus.get(key, 0.0)
            mem_on[n] = mem_on.get(n, 0.0) + mem_of[key]
        rate = job.ideal_throughput
        if allocation.remote_io is not None and allocation.cache_bytes is not None:
            rate = float(silod_perf(job.ideal_throughput, allocation.remote_io, allocation.cache_bytes,
                                    job.dataset.size))
        self._admitted[job.job_id] = Admission(
            nodes=nodes, dataset=ds_key, cache_bytes=cache, io_per_pod=io_per_pod, pods_per_node=per_node,
            since=self.clock(), base_consumed=job.consumed_bytes, rate=rate, total=job.total_bytes,
            tenant=self.namespace_tenant(wl.namespace) or "", cpus={n: c for n, c in cpus_on.items() if c > 0},
            memory={n: m for n, m in mem_on.items() if m > 0})
        self.admissions += 1
        self.nodes = self._node_states_from_cache()
        log.info("admitted %s (job %s) on %s", wl.key, job.job_id, ", ".join(hostnames))
        return True

    def _write_report_secret(self, job_id: str, wl: Workload, token: str) -> bool:
        """The job's report Secret (workloads.report_secret_name) in the workload's own namespace:
        its report token, the API's URL and its id, which its pods' env reads (the webhook's
        report_env_patch, rest_job_object). Owned by the workload, so deleting the workload
        deletes it (garbage collector); silod deletes it when the job ends. Written over an
        existing one (each admission mints a new token and revokes the last). Best effort: a pod
        without it trains, it does not report (an Event says why)."""
        from kubernetes import client

        name = report_secret_name(wl.kind, wl.name)
        body = client.V1Secret(
            metadata=client.V1ObjectMeta(
                name=name, namespace=wl.namespace,
                labels={MANAGED_BY_LABEL: MANAGED_BY, JOB_ID_LABEL: job_id},
                owner_references=[client.V1OwnerReference(api_version=wl.kind.api_version, kind=wl.kind.kind,
                                                          name=wl.name, uid=wl.uid)]),
            type="Opaque", string_data={"token": token, "server": self.api_url or "", "job-id": job_id})
        try:
            try:
                self.core.create_namespaced_secret(wl.namespace, body, field_manager=FIELD_MANAGER,
                                                   _request_timeout=self.timeout)
            except _api_exception() as exc:
                if exc.status != 409:
                    raise
                self.core.replace_namespaced_secret(name, wl.namespace, body, field_manager=FIELD_MANAGER,
                                                    _request_timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - the job runs without step reports
            status = getattr(exc, "status", None)
            hint = (" (bind ClusterRole silod-scheduler-jobs in this namespace: deploy/base/workloads-namespace.yaml)"
                    if status == 403 else "")
            self._report(self._objects.get(wl.uid) or {"metadata": {"name": wl.name, "namespace": wl.namespace,
                                                                    "uid": wl.uid}}, wl.kind,
                         f"{wl.key}: silod could not write Secret {name} (HTTP {status or type(exc).__name__}){hint};"
                         f" its pods run without SILOD_TOKEN, so their step reports are not sent",
                         reason="SiloDNoReportToken")
            return False
        return True

    def _delete_report_secret(self, job_id: str) -> None:
        """The ended job's report Secret (its token is revoked already: the service revokes a
        job's report tokens when it ends). Best effort: the garbage collector removes it with
        its workload, and a leftover token is refused anyway."""
        ref = self._refs.get(job_id)
        if ref is None or not self.report_tokens:
            return
        try:
            self.core.delete_namespaced_secret(report_secret_name(ref.kind, ref.name), ref.namespace,
                                               _request_timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - already gone (404) or the API server is away
            if getattr(exc, "status", None) != 404:
                log.warning("job %s: its report Secret was not deleted: %s", job_id, exc)

    def _clear_start_time(self, wl: Workload, obj: dict[str, Any]) -> tuple[Workload, dict[str, Any]] | None:
        """Clear a suspended Job's status.startTime through the jobs/status subresource, once its
        controller reports no active pod (Kueue does the same). The API server accepts a change
        of the pod template's node affinity only while the Job is suspended *and* has no
        startTime; the Job controller keeps startTime on suspension through Kubernetes 1.35
        (1.36 clears it itself, and then this never runs). Checked against the "kube-apiserver
        v1.24.0-alpha snapshot" and its Job controller (tests/test_kubernetes_real.py)."""
        status = obj.get("status") or {}
        if int(status.get("active") or 0) > 0:
            log.info("%s: waiting for its %s active pods to stop before re-admission", wl.key, status.get("active"))
            return None
        new = copy.deepcopy(obj)
        new["status"].pop("startTime", None)
        try:
            got = self.custom.replace_namespaced_custom_object_status(
                "batch", "v1", wl.namespace, "jobs", wl.name, new, field_manager=FIELD_MANAGER,
                _request_timeout=self.timeout)
        except _api_exception() as exc:
            if exc.status in (404, 409):
                return None  # changed meanwhile: fresh state on the next poll
            if exc.status == 403:
                self._report(obj, wl.kind, f"{wl.key}: silod may not update jobs/status (deploy/base's ClusterRole"
                                           f" grants it); it cannot re-admit this Job onto other nodes")
                return None
            raise
        parsed = parse_workload(wl.kind, got)
        self.workloads[parsed.uid], self._objects[parsed.uid] = parsed, got
        return parsed, got

    def _node_states_from_cache(self) -> list[NodeState]:
        nodes = self.core.list_node(_request_timeout=self.timeout).items
        return self._node_states(nodes)

    def _write(self, wl: Workload, new: dict[str, Any]) -> bool:
        """Replace the workload with `new` (carrying the resourceVersion we read: a concurrent
        change is a 409 and we retry with fresh state next poll, never overwrite it)."""
        try:
            got = self.custom.replace_namespaced_custom_object(
                wl.kind.group, wl.kind.version, wl.namespace, wl.kind.plural, wl.name, new,
                field_manager=FIELD_MANAGER, _request_timeout=self.timeout)
        except _api_exception() as exc:
            if exc.status in (404, 409):
                log.info("%s changed or vanished while being updated (%s); retrying with fresh state", wl.key, exc.status)
                return False
            if exc.status == 422:
                self._report(new, wl.kind, f"{wl.key}: Kubernetes refused silod's update: {exc.body!s:.500}")
                return False
            if exc.status == 403:
                self._report(new, wl.kind, _unbound(wl))
                return False
            raise
        parsed = parse_workload(wl.kind, got)
        self.workloads[parsed.uid] = parsed
        self._objects[parsed.uid] = got
        return True

    def stop(self, job_id: str) -> None:
        with self._lock:
            self._awaiting.pop(job_id, None)
            self._deferred.pop(job_id, None)
            self._admitted.pop(job_id, None)
            self._pending_since.pop(job_id, None)
            found = self._workload_of(job_id)
            if found is None:
                return
            wl, obj = found
            if wl.phase != "active":
                return
            if self._job_state(job_id) == "cancelled":
                self._delete_report_secret(job_id)
            if self._cancelled_rest_job(job_id, wl):
                try:  # silod's own Job for a cancelled REST job: remove it (and, by GC, its pods)
                    self.custom.delete_namespaced_custom_object("batch", "v1", wl.namespace, "jobs", wl.name,
                                                                body={"propagationPolicy": "Background"},
                                                                _request_timeout=self.timeout)
                except _api_exception() as exc:
                    if exc.status != 404:
                        raise
                return
            if not wl.suspended:
                if self._suspend(wl):
                    log.info("suspended %s (job %s)", wl.key, job_id)
                else:  # the API server did not answer: retried on every poll until it does
                    self._to_suspend.add(job_id)

    def _suspend(self, wl: Workload) -> bool:
        """Set the workload's suspend flag by a JSON merge patch. A patch carries no
        resourceVersion, so it cannot lose to the controller's concurrent status writes (which
        change the resourceVersion of the whole object: on a real API server a replace of a
        running Job can conflict with its Job controller, and the old replace-then-retry-once
        could give up silently, leaving the Job running while the service counted it stopped).
        Suspending is
        idempotent and depends on no other field, so nothing is overwritten."""
        patch: dict[str, Any] = ({"spec": {"runPolicy": {"suspend": True}}} if wl.kind == PYTORCHJOB
                                 else {"spec": {"suspend": True}})
        try:
            got = self.custom.patch_namespaced_custom_object(
                wl.kind.group, wl.kind.version, wl.namespace, wl.kind.plural, wl.name, patch,
                field_manager=FIELD_MANAGER, _request_timeout=self.timeout)
        except _api_exception() as exc:
            if exc.status == 404:
                return True  # gone: nothing to suspend (poll() reports the deletion)
            if exc.status == 403:
                self._report(self._objects.get(wl.uid) or {"metadata": {"name": wl.name, "namespace": wl.namespace,
                                                                        "uid": wl.uid}}, wl.kind, _unbound(wl))
            log.warning("%s: suspension not written (HTTP %s); retrying on the next poll", wl.key, exc.status)
            return False
        except Exception as exc:  # noqa: BLE001 - the API server is unreachable: retry on the next poll
            log.warning("%s: suspension not written (%s); retrying on the next poll", wl.key, exc)
            return False
        if got.get("metadata", {}).get("uid") == wl.uid:
            parsed = parse_workload(wl.kind, got)
            self.workloads[parsed.uid], self._objects[parsed.uid] = parsed, got
        self.suspensions += 1
        return True

    def _drop_unschedulable(self, job_id: str) -> None:
        self._unschedulable.pop(job_id, None)
        self._unschedulable_specs.pop(job_id, None)
        self._refused_on.pop(job_id, None)

    def _recheck_unschedulable(self, now: float) -> None:
        """Each poll: a held job that would fit now (a node was added or changed) is released to
        the policy; one held longer than unschedulable_timeout_s fails with its reason; the others
        repeat their reason (the service keeps it as the job's message)."""
        for job_id, (reason, since) in list(self._unschedulable.items()):
            found = self._workload_of(job_id)
            if job_id in self._refused_on:  # kube-scheduler's refusal: retried when the nodes change
                if found is None or found[0].phase != "active":
                    self._drop_unschedulable(job_id)
                elif self._refused_on[job_id][0] != self._nodes_signature():
                    log.info("%s (job %s): the nodes changed: back to the policy", found[0].key, job_id)
                    self._drop_unschedulable(job_id)
                    self._events.append(JobEvent(job_id, "unschedulable", time=now,
                                                 message="the cluster's nodes changed: waits for the policy"))
                elif now - since > self.unschedulable_timeout_s:
                    why = self._refused_on[job_id][1]
                    self._drop_unschedulable(job_id)
                    self._refused_first.pop(job_id, None)
                    self._events.append(JobEvent(job_id, "failed", time=now, message=(
                        f"unschedulable: kube-scheduler could not bind its pods for {now - since:.0f} s"
                        f" ({why}; --backend-opt unschedulable-timeout)")))
                else:
                    self._events.append(JobEvent(job_id, "unschedulable", time=now, message=reason))
                continue
            spec_alloc = self._unschedulable_specs.get(job_id)
            if found is None or found[0].phase != "active" or spec_alloc is None:
                self._unschedulable.pop(job_id, None)
                self._unschedulable_specs.pop(job_id, None)
                continue
            wl, _ = found
            spec, alloc = spec_alloc
            cache = float(alloc.cache_bytes or 0.0)
            io_per_pod = float(alloc.remote_io or 0.0) / max(wl.pods, 1)
            pods = self._pod_requests(wl)
            if self._never_fits(pods, spec.dataset.name, cache, io_per_pod) is None:
                log.info("%s (job %s) fits a node now: back to the policy", wl.key, job_id)
                self._unschedulable.pop(job_id, None)
                self._unschedulable_specs.pop(job_id, None)
                self._events.append(JobEvent(job_id, "unschedulable", time=now,
                                             message="schedulable again: waits for the policy"))
            elif now - since > self.unschedulable_timeout_s:
                self._unschedulable.pop(job_id, None)
                self._unschedulable_specs.pop(job_id, None)
                self._events.append(JobEvent(job_id, "failed", time=now, message=(
                    f"{reason.split(';')[0]} for {now - since:.0f} s (--backend-opt unschedulable-timeout)")))
            else:
                self._events.append(JobEvent(job_id, "unschedulable", time=now, message=reason))

    def _refusal(self, job_id: str) -> str | None:
        """kube-scheduler's reason when a pod of the job is unbound and marked Unschedulable
        (condition PodScheduled=False, reason Unschedulable: what it also reports as a
        FailedScheduling Event), else None."""
        for pod in self._pods_of(job_id, self._unbound):
            if (pod.get("metadata") or {}).get("deletionTimestamp"):
                continue
            for cond in (pod.get("status") or {}).get("conditions") or []:
                if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                        and cond.get("reason") == "Unschedulable":
                    return str(cond.get("message") or "Unschedulable").strip()
        return None

    def _nodes_signature(self) -> str:
        """What kube-scheduler's answer depends on among the nodes: their names, labels, taints,
        allocatable resources, readiness. A job kube-scheduler refused is retried when it changes."""
        import json

        return json.dumps(sorted(
            [n.metadata.name, n.metadata.labels or {}, self.api_client.sanitize_for_serialization(n.spec.taints or []
                                                                                                  if n.spec else []),
             (n.status.allocatable or {}) if n.status else {},
             sorted((c.type, c.status) for c in ((n.status.conditions or []) if n.status else []))]
            for n in self._raw_nodes), sort_keys=True, default=str)

    def _check_refused(self, now: float) -> None:
        """Admitted jobs whose pods kube-scheduler cannot bind (it knows what silod's fit check
        does not model: memory, other extended resources, pod affinity, ports, volumes). After
        `pending_grace_s` of Unschedulable pods (counted only while no pod on the job's nodes is
        still terminating: pods of a job silod preempted for it hold their resources until they
        are gone), the workload is suspended and the job goes back to the queue with
        kube-scheduler's reason, held back from the policy (no GPUs) until the nodes change,
        and failed once `unschedulable_timeout_s` have passed since the first refusal."""
        for job_id in list(self._admitted):
            reason = self._refusal(job_id)
            adm = self._admitted[job_id]
            leaving = any((p.get("metadata") or {}).get("deletionTimestamp") and p["spec"]["nodeName"] in adm.nodes
                          for p in self._bound)
            if reason is None or leaving:
                self._pending_since.pop(job_id, None)
                # Every pod bound: it runs, and a later refusal starts a new timeout. Right after
                # a re-admission the Job has no pods yet (or only the old ones, leaving): that is
                # not "runs", the first refusal holds.
                if reason is None and job_id in self._refused_first and not self._pods_of(job_id, self._unbound) \
                        and any(not (p.get("metadata") or {}).get("deletionTimestamp") for p in self._pods_of(job_id)):
                    self._refused_first.pop(job_id, None)
                continue
            first = self._pending_since.setdefault(job_id, now)
            found = self._workload_of(job_id)
            if now - first < self.pending_grace_s or found is None:
                continue
            if not self._suspend(found[0]):
                continue  # the API server did not take it: the next poll retries
            since = self._refused_first.setdefault(job_id, first)
            self._admitted.pop(job_id, None)
            self._pending_since.pop(job_id, None)
            message = (f"unschedulable: kube-scheduler cannot bind its pods ({reason[:400]}); back in the queue without"
                       f" GPUs until the cluster's nodes change, failed {self.unschedulable_timeout_s:g} s after the first"
                       f" refusal")
            self._unschedulable[job_id] = (message, since)
            self._refused_on[job_id] = (self._nodes_signature(), reason[:400])
            self._report(found[1], found[0].kind, f"{found[0].key} is {message}", reason="SiloDUnschedulable")
            self._events.append(JobEvent(job_id, "unschedulable", time=now, message=message))
            log.info("%s (job %s): kube-scheduler cannot bind its pods: %s", found[0].key, job_id, reason)
            self.nodes = self._node_states(self._raw_nodes)  # its GPUs are free for the others

    def _job_state(self, job_id: str) -> str | None:
        """The service's state of the job (None: no service, or no such job)."""
        if self.service is None:
            return None
        from scheduler.service.types import ADMIN, Principal

        try:
            return str(self.service.get_job(Principal(ADMIN, is_admin=True), job_id).state)
        except UserError:
            return None

    def _cancelled_rest_job(self, job_id: str, wl: Workload) -> bool:
        if self.service is None or wl.kind != JOB or wl.rest_job_id != job_id or wl.name != f"silod-{job_id}":
            return False
        return self._job_state(job_id) == "cancelled"

    def poll(self) -> list[JobEvent]:
        with self._lock:
            self.refresh()
            self._intake()
            now = self.clock()
            for job_id, (spec, alloc, deadline) in list(self._awaiting.items()):
                if self._workload_of(job_id) is None:
                    self._adopt_rest_job(spec)
                if self._workload_of(job_id) is not None:
                    del self._awaiting[job_id]
                    if not self._admit(spec, alloc):
                        self._deferred[job_id] = (spec, alloc)
                elif now > deadline:
                    del self._awaiting[job_id]
                    self._events.append(JobEvent(job_id, "failed", time=now, message=(
                        f"job {job_id} has no Kubernetes workload (it was deleted, or it was submitted without a"
                        f" pod_template); nothing to run")))
            for job_id in sorted(self._to_suspend):  # preemptions the API server did not take yet
                found = self._workload_of(job_id)
                if found is None or found[0].suspended or found[0].phase != "active" or job_id in self._admitted:
                    self._to_suspend.discard(job_id)
                elif self._suspend(found[0]):
                    self._to_suspend.discard(job_id)
            self._check_refused(now)
            self._recheck_unschedulable(now)
            for job_id, (spec, alloc) in list(self._deferred.items()):
                found = self._workload_of(job_id)
                if found is None or found[0].phase != "active" or self._admit(spec, alloc):
                    self._deferred.pop(job_id, None)
            now = self.clock()
            measured = self._measured_progress()
            for job_id, ref in list(self._refs.items()):
                wl = self.workloads.get(ref.uid)
                adm = self._admitted.get(job_id)
                if wl is None:
                    # Deleted (by its owner, or with its namespace): whatever silod held for it, an
                    # admission, a placement it waits for or a place in the queue, ends this round.
                    # (The deferred loop above has already dropped it from _deferred.)
                    self._events.append(JobEvent(job_id, "failed", time=now,
                                                 message=f"{ref.kind.kind} {ref.namespace}/{ref.name} was deleted"))
                    self._delete_report_secret(job_id)
                    self._admitted.pop(job_id, None)
                    self._deferred.pop(job_id, None)
                    self._drop_unschedulable(job_id)
                    self._pending_since.pop(job_id, None)
                    self._refused_first.pop(job_id, None)
                    self._forget(job_id)
                    continue
                if wl.phase != "active":
                    self._refused_first.pop(job_id, None)
                if wl.phase == "finished":
                    self._events.append(JobEvent(job_id, "finished", None, now, wl.message))
                    self._delete_report_secret(job_id)
                    self._admitted.pop(job_id, None)
                    self._forget(job_id)
                elif wl.phase == "failed":
                    self._events.append(JobEvent(job_id, "failed", None, now, f"{wl.key}: {wl.message}"))
                    self._delete_report_secret(job_id)
                    self._admitted.pop(job_id, None)
                    self._forget(job_id)
                elif adm is not None and job_id in measured:
                    # What the agents measured its pods read; below the total: only the controller says "done".
                    self._events.append(JobEvent(job_id, "progress", min(measured[job_id], 0.99 * adm.total), now))
                elif adm is not None and adm.rate > 0:
                    # silod's own estimate; capped below the total: only the controller says "done".
                    done = min(adm.base_consumed + adm.rate * max(now - adm.since, 0.0), 0.99 * adm.total)
                    self._events.append(JobEvent(job_id, "progress", done, now))
            self._push_node_io()
            events, self._events = self._events, []
            for ev in events:  # ended for a reason of silod's own (e.g. unschedulable for too long)
                if ev.kind == "failed" and ev.job_id in self._refs:
                    self._delete_report_secret(ev.job_id)
            return events

    def close(self) -> None:
        _close_quietly(self.storage)
        _close_quietly(self.api_client)

    def node_cache_capacity(self) -> dict[str, float]:
        """Bytes of cache disk of each ready node (its agent's fresh report, else its
        silod.io/cache-capacity annotation, else an even share): the scheduler believes no node's
        agent reporting more cached than this."""
        return {n.name: float(n.cache_capacity) for n in self.nodes}

    def node_io(self) -> dict[str, float]:
        """Remote IO each node mount may use: the sum, over the jobs admitted on the node that
        read the dataset, of their per-pod IO times their pods there."""
        out: dict[str, float] = {}
        for adm in self._admitted.values():
            if not adm.dataset:
                continue  # its dataset is gone (_storage_key)
            for node, pods in adm.pods_per_node.items():
                key = node_mount_job(node, adm.dataset)
                out[key] = out.get(key, 0.0) + adm.io_per_pod * pods
        return out

    def _push_node_io(self) -> None:
        """Send changed node-mount IO to the data manager (0 for mounts no admitted job uses).
        A failure is retried on the next poll; the scheduling carries on."""
        if self.storage is None:
            return
        want = self.node_io()
        for key in set(self._pushed_io) - set(want):
            want[key] = 0.0
        for key, rate in sorted(want.items()):
            if self._pushed_io.get(key) == rate:
                continue
            try:
                self.storage.allocate_remote_io(key, rate)
            except Exception as exc:  # noqa: BLE001 - the data manager may be down; retry next poll
                log.warning("data manager: remote IO of %s not pushed: %s", key, exc)
                continue
            if rate == 0.0:
                self._pushed_io.pop(key, None)
            else:
                self._pushed_io[key] = rate

    def _forget(self, job_id: str) -> None:
        ref = self._refs.pop(job_id, None)
        if ref is not None:
            self._by_uid[ref.uid] = job_id  # keep: a finished workload is never queued again

    def running_jobs(self) -> set[str]:
        with self._lock:
            if not self._recovered:
                self.refresh()
            return {job_id for job_id, ref in self._refs.items()
                    if (wl := self.workloads.get(ref.uid)) is not None and not wl.suspended and wl.phase == "active"}


def _unbound(wl: Workload) -> str:
    return (f"{wl.key}: silod may not change workloads in namespace {wl.namespace}: bind ClusterRole"
            f" silod-scheduler-jobs to silod's service account there (the RoleBinding of"
            f" deploy/base/workloads-namespace.yaml); silod writes to tenant namespaces only")


def _close_quietly(obj: Any) -> None:
    closer = getattr(obj, "close", None)
    if callable(closer):
        try:
            closer()
        except Exception:  # noqa: BLE001 - shutting down
            log.debug("close failed", exc_info=True)


def _pod_cpus(pod: dict[str, Any]) -> float:
    from scheduler.backends.kubernetes.workloads import pod_cpus

    try:
        return pod_cpus((pod.get("spec") or {}), "pod")
    except WorkloadError:
        return 0.0


def _pod_memory(pod: dict[str, Any]) -> float:
    from scheduler.backends.kubernetes.workloads import pod_memory

    try:
        return pod_memory((pod.get("spec") or {}), "pod")
    except WorkloadError:
        return 0.0


def _pod_gpus(pod: dict[str, Any]) -> int:
    from scheduler.backends.kubernetes.workloads import pod_gpus

    try:
        return pod_gpus((pod.get("spec") or {}), "pod")
    except WorkloadError:
        return 0
