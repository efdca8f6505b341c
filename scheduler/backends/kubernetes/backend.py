"""The Kubernetes backend: a secondary scheduler for pods with `schedulerName: silod`.

Two layers:

- `KubernetesBackend` implements `scheduler.backends.base.ClusterBackend` on the official
  `kubernetes` client: it reads nodes and pods, accounts `nvidia.com/gpu`, places a job's pods as
  a gang (all or none), records its decision in pod annotations *before* binding (a write-ahead
  intent), binds through the pods/binding subresource, keeps the cache/IO annotations current and
  reports finished/failed pods through `poll()`.
- `KubernetesScheduler` is the pod-driven loop (`python -m scheduler.backends.kubernetes`): it
  builds a `policies.types.Snapshot` from the pods each round, asks the shared
  `scheduler.core.SchedulingCore` for the plan and executes it through the backend. There is no
  Kubernetes-specific policy.

All durable state lives in pod annotations (SiloD §6, "Fault tolerance"); a restarted scheduler
reads them back: bound pods keep their allocation, a gang whose binding was interrupted is
completed on the nodes it was promised, and nothing is bound twice.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from estimator import silod_perf
from estimator.errors import UserError
from policies.base import Policy
from policies.estimators import Estimator
from policies.types import ClusterCapacity, DatasetView, JobView, Snapshot
from scheduler.backends.base import (
    ClusterBackend, ClusterDescription, DatasetInfo, JobAllocation, JobEvent, JobSpec, NodeInfo,
)
from scheduler.backends.kubernetes.contract import (
    ANN_CACHE, ANN_IO, ANN_JOB_IO, ANN_NODE, ANN_SCHEDULED_AT, LABEL_JOB, SCHEDULER_NAME,
    AnnotationError, allocation_annotations,
)
from scheduler.backends.kubernetes.cluster import ClusterState, JobGroup, PodView, place_gang
from scheduler.core import RoundPlan, SchedulingCore

log = logging.getLogger("silod.kubernetes")

COMPONENT = "silod-scheduler"


@dataclass(frozen=True, slots=True)
class PodAllocation:
    """What the annotations of one pod say the scheduler decided."""

    node: str | None
    cache_bytes: float | None
    remote_io: float | None


@dataclass(frozen=True, slots=True)
class JobPlacement:
    """A job's recorded decision, read back from its pods (the state a restart recovers)."""

    job_id: str
    pods: Mapping[str, PodAllocation]  # pod key -> allocation
    job_remote_io: float | None
    scheduled_at: float | None

    @property
    def nodes(self) -> dict[str, str | None]:
        return {k: v.node for k, v in self.pods.items()}


class KubernetesBackend(ClusterBackend):
    """ClusterBackend over a `kubernetes.client.CoreV1Api`. One instance per scheduler process."""

    name = "kubernetes"

    def __init__(
        self,
        api: Any,
        *,
        capacity: ClusterCapacity | None = None,
        namespace: str | None = None,
        clock: Callable[[], float] = time.time,
        request_timeout: float = 30.0,
    ):
        self.api = api
        self.capacity = capacity
        self.namespace = namespace  # None: silod pods of every namespace
        self.clock = clock
        self.request_timeout = request_timeout
        self.state: ClusterState = ClusterState(nodes={}, pods=(), jobs={})
        self._free: dict[str, int] = {}  # free GPUs per node, decremented as gangs are placed
        self._tracked: dict[str, JobAllocation | None] = {}  # jobs we run (None = recovered)
        self._deferred: dict[str, JobAllocation] = {}  # started, but the gang did not fit yet
        self._progress: dict[str, float] = {}
        self._events: list[JobEvent] = []
        self._reported: set[tuple[str, str]] = set()  # (pod key, message) already sent as Events
        self._recovered = False
        self.bindings = 0  # successful binding calls by this instance (observability, tests)

    # --- reading the cluster -------------------------------------------------------------------

    def refresh(self) -> ClusterState:
        """List nodes and pods (a consistent, level-triggered view; the watcher only wakes us)."""
        t = self.request_timeout
        nodes = self.api.list_node(_request_timeout=t).items
        # Every pod bound to a node holds GPUs there, whichever scheduler placed it.
        bound = self.api.list_pod_for_all_namespaces(
            field_selector="spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed", _request_timeout=t
        ).items
        # Our pods in every phase (finished ones tell us a job ended), with or without the job
        # label (a pod without it gets an Event saying what is missing).
        mine = f"spec.schedulerName={SCHEDULER_NAME}"
        if self.namespace:
            ours = self.api.list_namespaced_pod(self.namespace, field_selector=mine, _request_timeout=t).items
        else:
            ours = self.api.list_pod_for_all_namespaces(field_selector=mine, _request_timeout=t).items
        # Re-check the selectors here: they are an optimisation, not something we rely on.
        bound = [p for p in bound if p.spec and p.spec.node_name and (p.status is None or p.status.phase
                                                                       not in ("Succeeded", "Failed"))]
        ours = [p for p in ours if p.spec and p.spec.scheduler_name == SCHEDULER_NAME]
        if self.namespace:
            ours = [p for p in ours if p.metadata.namespace == self.namespace]
        self.state = ClusterState.build(nodes, [*bound, *ours])
        self._free = self.state.free_gpus()
        self._report_problems(self.state)
        if not self._recovered:
            self._recover(self.state)
        return self.state

    def _report_problems(self, state: ClusterState) -> None:
        for job in state.jobs.values():
            for pod_key, message in job.errors:
                self.report(pod_key, "SiloDInvalidSpec", message)
        for pod_key in state.ignored:
            self.report(pod_key, "SiloDNoJobLabel",
                        f"pod {pod_key} has schedulerName {SCHEDULER_NAME} but no {LABEL_JOB} label; label it with"
                        f" the job id (pods sharing the label are scheduled together)")
        for node in state.nodes.values():
            if node.error:
                log.warning("node %s ignored for GPUs: %s", node.name, node.error)

    def _recover(self, state: ClusterState) -> None:
        """After a (re)start: adopt every job the annotations say we placed."""
        self._recovered = True
        for job_id, job in state.jobs.items():
            if any(s.node for s in job.states.values()) and not job.finished and not job.failed:
                self._tracked.setdefault(job_id, None)
                log.info("recovered job %s from pod annotations: %s", job_id, self.placement(job_id))

    def placement(self, job_id: str) -> JobPlacement | None:
        """The decision recorded on the job's pods, or None if nothing was recorded."""
        job = self.state.jobs.get(job_id)
        if job is None or not any(s.node for s in job.states.values()):
            return None
        pods = {k: PodAllocation(s.node, s.cache_bytes, s.remote_io) for k, s in job.states.items()}
        job_io = next((s.job_remote_io for s in job.states.values() if s.job_remote_io is not None), None)
        at = min((s.scheduled_at for s in job.states.values() if s.scheduled_at is not None), default=None)
        return JobPlacement(job_id=job_id, pods=pods, job_remote_io=job_io, scheduled_at=at)

    def placements(self) -> dict[str, JobPlacement]:
        out = {}
        for job_id in self.state.jobs:
            p = self.placement(job_id)
            if p is not None:
                out[job_id] = p
        return out

    # --- ClusterBackend ------------------------------------------------------------------------

    def describe(self) -> ClusterDescription:
        if not self.state.nodes:
            self.refresh()
        gpu_nodes = [n for n in self.state.nodes.values() if n.schedulable and n.gpus > 0]
        default_cache = (self.capacity.cache / len(gpu_nodes)) if (self.capacity and gpu_nodes) else 0.0
        nodes = tuple(
            NodeInfo(name=n.name, gpus=n.gpus, cache=n.cache if n.cache is not None else default_cache,
                     labels=dict(n.labels))
            for n in gpu_nodes
        )
        return ClusterDescription(nodes=nodes, remote_io=self.capacity.remote_io if self.capacity else 0.0)

    def start(self, job: JobSpec, allocation: JobAllocation) -> None:
        """Place and bind the job's pods (all or none). A gang that does not fit now (fragmented
        nodes, pods not all created yet) is retried on every poll(); that is not a failure."""
        job_id = self._resolve(job.job_id)
        group = self.state.jobs.get(job_id)
        if group is None:
            self.refresh()
            group = self.state.jobs.get(job_id)
        if group is None:
            raise UserError(
                f"job {job.job_id}: no pods labelled {LABEL_JOB}={job_id.split('/', 1)[-1]} with schedulerName"
                f" {SCHEDULER_NAME}; create the job's pods (see docs/kubernetes.md)"
            )
        self._tracked[job_id] = allocation
        if not self._place_and_bind(group, allocation):
            self._deferred[job_id] = allocation

    def stop(self, job_id: str) -> None:
        """Delete the job's pods (their controller, e.g. a batch Job, recreates them pending)."""
        job_id = self._resolve(job_id)
        self._tracked.pop(job_id, None)
        self._deferred.pop(job_id, None)
        job = self.state.jobs.get(job_id)
        if job is None:
            return
        from kubernetes.client.exceptions import ApiException

        for pod in job.pods:
            if pod.terminated or pod.deleting:
                continue
            try:
                self.api.delete_namespaced_pod(pod.name, pod.namespace, _request_timeout=self.request_timeout)
            except ApiException as exc:
                if exc.status != 404:
                    log.warning("could not delete pod %s of job %s: %s", pod.key, job_id, exc.reason)
            else:
                if pod.bound:
                    self._free[pod.node_name] = self._free.get(pod.node_name, 0) + pod.gpus  # type: ignore[index]

    def poll(self) -> list[JobEvent]:
        self.refresh()
        now = self.clock()
        for job_id, allocation in list(self._deferred.items()):
            group = self.state.jobs.get(job_id)
            if group is None or group.failed or group.finished:
                self._deferred.pop(job_id)
            elif group.running or self._place_and_bind(group, allocation):
                self._deferred.pop(job_id)
        for job_id in list(self._tracked):
            group = self.state.jobs.get(job_id)
            if group is None:
                self._tracked.pop(job_id)
                self._events.append(JobEvent(job_id, "failed", time=now, message="all pods of the job were deleted"))
                continue
            consumed = max((s.consumed_bytes for s in group.states.values() if s.consumed_bytes is not None),
                           default=None)
            if group.failed:
                bad = next(p for p in group.pods if p.phase == "Failed")
                self._tracked.pop(job_id)
                self._events.append(JobEvent(job_id, "failed", consumed, now, f"pod {bad.key} failed"))
            elif group.finished:
                self._tracked.pop(job_id)
                self._events.append(JobEvent(job_id, "finished", consumed, now, "all pods succeeded"))
            elif group.partially_bound and job_id not in self._deferred:
                # A gang whose binding was interrupted (scheduler crash): finish it where promised.
                if not self._place_and_bind(group, self._tracked[job_id]):
                    self._deferred[job_id] = self._tracked[job_id] or _recorded_allocation(group)
            elif consumed is not None and consumed != self._progress.get(job_id):
                self._progress[job_id] = consumed
                self._events.append(JobEvent(job_id, "progress", consumed, now))
        events, self._events = self._events, []
        return events

    def running_jobs(self) -> set[str]:
        """Jobs we placed whose pods still run, including jobs recovered from pod annotations
        after a restart, by the ids the service gave `start` (namespace prefix of `_resolve`
        removed)."""
        if not self._recovered:
            self.refresh()
        prefix = f"{self.namespace or 'default'}/"
        out = set()
        for job_id in self._tracked:
            group = self.state.jobs.get(job_id)
            if job_id in self._deferred or group is None or group.finished or group.failed:
                continue
            out.add(job_id[len(prefix):] if job_id.startswith(prefix) else job_id)
        return out

    # --- extras the scheduler loop uses ----------------------------------------------------------

    def update_allocation(self, job_id: str, allocation: JobAllocation) -> bool:
        """Rewrite a running job's cache/IO annotations if they changed. True when patched."""
        job = self.state.jobs.get(self._resolve(job_id))
        if job is None or not job.bound_pods:
            return False
        changed = False
        for pod in job.pods:
            if pod.terminated or not pod.bound:
                continue
            state = job.states.get(pod.key)
            want = self._allocation_patch(job, pod, allocation, node=pod.node_name,
                                          scheduled_at=state.scheduled_at if state else None)
            have = {k: pod.annotations.get(k) for k in want}
            if want != have:
                self._patch_annotations(pod, want)
                changed = True
        return changed

    def report(self, pod_key: str, reason: str, message: str, *, warning: bool = True) -> None:
        """Log and send a Kubernetes Event about a pod, once per distinct message."""
        if (pod_key, message) in self._reported:
            return
        self._reported.add((pod_key, message))
        (log.warning if warning else log.info)("%s: %s", reason, message)
        namespace, name = pod_key.split("/", 1)
        pod = next((p for p in self.state.pods if p.key == pod_key), None)
        from kubernetes import client

        now = datetime.now(UTC)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(name=f"{name}.{uuid.uuid4().hex[:12]}", namespace=namespace),
            involved_object=client.V1ObjectReference(api_version="v1", kind="Pod", name=name, namespace=namespace,
                                                     uid=(pod.uid if pod and pod.uid else None)),
            reason=reason, message=message[:1024], type="Warning" if warning else "Normal",
            source=client.V1EventSource(component=COMPONENT), reporting_component=COMPONENT,
            reporting_instance=COMPONENT, first_timestamp=now, last_timestamp=now, count=1,
        )
        try:
            self.api.create_namespaced_event(namespace, event, _request_timeout=self.request_timeout)
        except Exception as exc:  # noqa: BLE001 - an Event is best effort; the log line stays
            log.warning("could not record event for %s: %s", pod_key, exc)

    # --- placement and binding -------------------------------------------------------------------

    def _resolve(self, job_id: str) -> str:
        if "/" in job_id:
            return job_id
        return f"{self.namespace or 'default'}/{job_id}"

    def _intended_nodes(self, group: JobGroup) -> dict[str, str] | None:
        """Nodes recorded on unbound pods by an interrupted binding, if they are still valid."""
        intent = {p.key: s.node for p in group.unbound_pods if (s := group.states.get(p.key)) and s.node}
        if not intent:
            return None
        if len(intent) != len(group.unbound_pods):
            return None
        free = dict(self._free)
        for pod in group.unbound_pods:
            node = self.state.nodes.get(intent[pod.key])
            if node is None or not node.admits(pod.node_selector, pod.tolerations) or free.get(node.name, 0) < pod.gpus:
                log.warning("job %s: recorded node %s for pod %s is no longer usable; placing again",
                            group.job_id, intent[pod.key], pod.key)
                return None
            free[node.name] -= pod.gpus
        return intent  # type: ignore[return-value]

    def _place_and_bind(self, group: JobGroup, allocation: JobAllocation | None) -> bool:
        if group.errors or group.request is None or not group.complete or group.failed or group.finished:
            return False
        todo = group.unbound_pods
        if not todo:
            return True
        placement = self._intended_nodes(group)
        if placement is None:
            placement = place_gang(todo, self.state.nodes, self._free)
        if placement is None:
            need = sum(p.gpus for p in todo)
            self.report(todo[0].key, "SiloDWaitingForGPUs",
                        f"job {group.job_id}: its {len(todo)} pod(s) need {need} GPUs that do not fit on the free"
                        f" nodes now; it stays pending", warning=False)
            return False
        at = self.clock()
        existing = [s.scheduled_at for s in group.states.values() if s.scheduled_at is not None]
        at = min(existing) if existing else at
        if allocation is None:
            allocation = _recorded_allocation(group)
        # 1) intent first: if we crash between the bindings, a restart finishes the same gang.
        for pod in todo:
            self._patch_annotations(pod, self._allocation_patch(group, pod, allocation, node=placement[pod.key],
                                                                scheduled_at=at))
        # 2) bind every pod of the gang.
        for pod in todo:
            self._bind(pod, placement[pod.key])
            self._free[placement[pod.key]] -= pod.gpus
        log.info("job %s: bound %d pod(s): %s", group.job_id, len(todo), placement)
        return True

    def _allocation_patch(self, group: JobGroup, pod: PodView, allocation: JobAllocation | None, *,
                          node: str | None, scheduled_at: float | None) -> dict[str, str | None]:
        cache = allocation.cache_bytes if allocation else None
        job_io = allocation.remote_io if allocation else None
        pod_io = None
        if job_io is not None:
            live = [p for p in group.pods if not p.terminated] or list(group.pods)
            total_gpus = sum(p.gpus for p in live)
            # The paper splits a job's remote IO over its pods proportionally; by GPUs, so that a
            # pod's share follows the data it consumes (equal shares for equal pods).
            pod_io = job_io * (pod.gpus / total_gpus if total_gpus else 1 / len(live))
        return allocation_annotations(node=node, cache_bytes=cache, pod_io=pod_io, job_io=job_io,
                                      scheduled_at=scheduled_at)

    def _patch_annotations(self, pod: PodView, annotations: Mapping[str, str | None]) -> None:
        body = {"metadata": {"annotations": dict(annotations)}}
        self.api.patch_namespaced_pod(pod.name, pod.namespace, body, _content_type="application/merge-patch+json",
                                      _request_timeout=self.request_timeout)

    def _bind(self, pod: PodView, node: str) -> None:
        """POST pods/{name}/binding.

        The API server answers a binding with a `Status`, not a `Binding`, and the generated client
        fails to deserialise it as V1Binding even though the pod *was* bound (kubernetes-client/
        python#547, #825). We therefore skip deserialisation (`_preload_content=False`): a 2xx
        is success, and errors still arrive as ApiException. A 409 means the pod is already bound:
        fine if it is bound where we wanted (a retried call), an error otherwise.
        """
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        body = client.V1Binding(
            api_version="v1", kind="Binding",
            metadata=client.V1ObjectMeta(name=pod.name, namespace=pod.namespace),
            target=client.V1ObjectReference(api_version="v1", kind="Node", name=node),
        )
        try:
            resp = self.api.create_namespaced_pod_binding(pod.name, pod.namespace, body, _preload_content=False,
                                                          _request_timeout=self.request_timeout)
            resp.release_conn() if hasattr(resp, "release_conn") else None
            self.bindings += 1
        except ApiException as exc:
            if exc.status != 409:
                raise
            current = self.api.read_namespaced_pod(pod.name, pod.namespace, _request_timeout=self.request_timeout)
            where = current.spec.node_name if current.spec else None
            if where != node:
                self.report(pod.key, "SiloDBindConflict",
                            f"pod {pod.key} is already bound to {where}, not {node}; leaving it there")


def _recorded_allocation(group: JobGroup) -> JobAllocation:
    cache = next((s.cache_bytes for s in group.states.values() if s.cache_bytes is not None), None)
    job_io = next((s.job_remote_io for s in group.states.values() if s.job_remote_io is not None), None)
    return JobAllocation(job_id=group.job_id, gpus=group.gpus, gpu_share=1.0, cache_bytes=cache, remote_io=job_io)


# --- the pod-driven scheduling loop ----------------------------------------------------------------

DatasetResolver = Callable[[str], float]  # dataset name -> bytes (catalog); raises UserError
ModelResolver = Callable[[str, int], float]  # (model, gpus) -> f* bytes/s; raises UserError


def _catalog_dataset_size(name: str) -> float:
    try:
        from traces.catalog import lookup_dataset
    except ImportError:
        raise UserError(f"dataset {name!r} has no silod.io/dataset-size and no catalog is installed") from None
    return lookup_dataset(name).size


def _catalog_ideal(model: str, gpus: int) -> float:
    try:
        from traces.catalog import ideal_throughput
    except ImportError:
        raise UserError(f"model {model!r} needs a catalog; give silod.io/ideal-throughput instead") from None
    return ideal_throughput(model, gpus)


@dataclass
class RoundReport:
    time: float
    plan: RoundPlan | None
    started: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    events: list[JobEvent] = field(default_factory=list)
    skipped: str = ""  # why no plan was made this round


class KubernetesScheduler:
    """One scheduling loop for pods with schedulerName silod, driven by the shared core."""

    def __init__(
        self,
        backend: KubernetesBackend,
        policy: Policy,
        estimator: Estimator,
        *,
        cache: float,
        remote_io: float,
        preempt: bool = False,
        dataset_size: DatasetResolver = _catalog_dataset_size,
        ideal_throughput: ModelResolver = _catalog_ideal,
    ):
        self.backend = backend
        self.core = SchedulingCore(policy, estimator)
        self.cache = cache
        self.remote_io = remote_io
        self.preempt = preempt
        self._dataset_size = dataset_size
        self._ideal = ideal_throughput
        self._last_round: float | None = None
        self._recovered_planner = False
        self.wake = threading.Event()

    def _cluster_capacity(self, state: ClusterState) -> ClusterCapacity | None:
        gpus = state.total_gpus - state.foreign_gpus()
        if gpus < 1:
            return None
        per_node = max((n.gpus for n in state.nodes.values() if n.schedulable), default=1) or 1
        declared = [n.cache for n in state.nodes.values() if n.schedulable and n.gpus > 0 and n.cache is not None]
        cache = sum(declared) if declared else self.cache  # node annotations win over the flag
        return ClusterCapacity(gpus=gpus, cache=cache, remote_io=self.remote_io, gpus_per_node=per_node)

    def _job_view(self, job: JobGroup, now: float) -> tuple[JobView, DatasetView, JobSpec]:
        req = job.request
        assert req is not None
        size = req.dataset_size if req.dataset_size is not None else self._dataset_size(req.dataset)
        ideal = req.ideal_throughput if req.ideal_throughput is not None else self._ideal(req.model or "", job.gpus)
        total = req.epochs * size
        placement = self.backend.placement(job.job_id)
        consumed = max((s.consumed_bytes for s in job.states.values() if s.consumed_bytes is not None), default=None)
        if consumed is None and placement is not None and placement.scheduled_at is not None and job.running:
            # No progress reported by the data plane: estimate it from the recorded allocation.
            alloc = next(iter(placement.pods.values()))
            io = placement.job_remote_io
            rate = ideal if io is None or alloc.cache_bytes is None else float(
                silod_perf(ideal, io, alloc.cache_bytes, size))
            consumed = max(now - placement.scheduled_at, 0.0) * rate
        consumed = min(consumed or 0.0, total)
        remaining = max(total - consumed, 1.0)
        view = JobView(
            job_id=job.job_id, gpus=max(job.gpus, 1), dataset=req.dataset, ideal_throughput=ideal,
            remaining_bytes=remaining, submit_time=0.0, running=job.running or job.partially_bound,
            priority=req.priority,
        )
        spec = JobSpec(
            job_id=job.job_id, name=job.job_id.split("/", 1)[1], owner=job.namespace, gpus=job.gpus,
            dataset=DatasetInfo(name=req.dataset, uri=req.dataset_uri, size=size), ideal_throughput=ideal,
            total_bytes=total, consumed_bytes=consumed, model=req.model, epochs=req.epochs,
        )
        return view, DatasetView(req.dataset, size), spec

    def snapshot(self, state: ClusterState, now: float) -> tuple[Snapshot | None, dict[str, JobSpec], str]:
        capacity = self._cluster_capacity(state)
        if capacity is None:
            return None, {}, "no schedulable GPUs (no node offers nvidia.com/gpu that other pods do not hold)"
        views: list[JobView] = []
        datasets: dict[str, DatasetView] = {}
        specs: dict[str, JobSpec] = {}
        for job in state.jobs.values():
            if job.errors or job.request is None or job.finished or job.failed:
                continue
            if job.pending and not job.complete:
                continue  # the gang is not all there yet
            try:
                view, dataset, spec = self._job_view(job, now)
            except UserError as exc:
                self.backend.report(job.pods[0].key, "SiloDInvalidSpec", str(exc))
                continue
            if job.pending and view.gpus > state.total_gpus:
                self.backend.report(job.pods[0].key, "SiloDTooLarge",
                                    f"job {job.job_id} asks for {view.gpus} GPUs; the cluster has {state.total_gpus}")
                continue
            if job.pending and view.gpus > capacity.gpus:
                self.backend.report(job.pods[0].key, "SiloDWaitingForGPUs",
                                    f"job {job.job_id}: {view.gpus} GPUs requested, {capacity.gpus} not held by other"
                                    f" schedulers' pods; it stays pending", warning=False)
                continue
            views.append(view)
            datasets.setdefault(dataset.name, dataset)
            specs[job.job_id] = spec
        # Arrival order: the job's oldest pod creationTimestamp (durable across restarts), then id.
        created = {j.job_id: j.created for j in state.jobs.values()}
        views.sort(key=lambda v: (created.get(v.job_id) is None, created.get(v.job_id) or 0.0, v.job_id))
        views = [_with_submit(v, i) for i, v in enumerate(views)]
        return Snapshot(time=now, jobs=tuple(views), datasets=datasets, capacity=capacity), specs, ""

    def _recover_planner(self, snapshot: Snapshot, now: float) -> None:
        """Give recovered running jobs the GPU time the annotations say they already had."""
        self._recovered_planner = True
        for job in snapshot.jobs:
            placement = self.backend.placement(job.job_id)
            if job.running and placement and placement.scheduled_at is not None:
                held = max(now - placement.scheduled_at, 0.0)
                self.core.planner.received[job.job_id] = held
                self.core.planner.active[job.job_id] = held

    def run_once(self) -> RoundReport:
        backend = self.backend
        events = backend.poll()  # refreshes the state, finishes interrupted gangs, reports
        now = backend.clock()
        for ev in events:
            if ev.kind in ("finished", "failed"):
                self.core.forget(ev.job_id)
            log.info("job %s %s %s", ev.job_id, ev.kind, ev.message)
        state = backend.state
        snapshot, specs, why = self.snapshot(state, now)
        report = RoundReport(time=now, plan=None, events=events, skipped=why)
        if snapshot is None or not snapshot.jobs:
            report.skipped = why or "no jobs"
            self._last_round = now
            return report
        if not self._recovered_planner:
            self._recover_planner(snapshot, now)
        plan = self.core.plan(snapshot)
        report.plan = plan
        running = {j.job_id for j in snapshot.jobs if j.running}
        chosen = set(plan.running)
        for job in snapshot.jobs:
            allocation = JobAllocation(
                job_id=job.job_id, gpus=job.gpus, gpu_share=plan.allocation.gpu_share.get(job.job_id, 0.0),
                cache_bytes=None if plan.cache is None else plan.cache.get(job.dataset, 0.0),
                remote_io=None if plan.remote_io is None else plan.remote_io.get(job.job_id, 0.0),
            )
            if job.job_id in running and job.job_id not in chosen and self.preempt:
                backend.stop(job.job_id)
                report.stopped.append(job.job_id)
            elif job.job_id in running:
                if plan.remote_io is not None and job.job_id not in plan.remote_io:
                    # Kept running without preemption although not chosen: keep its recorded IO.
                    continue
                if backend.update_allocation(job.job_id, allocation):
                    report.updated.append(job.job_id)
            elif job.job_id in chosen:
                before = backend.bindings
                backend.start(specs[job.job_id], allocation)
                if backend.bindings > before:
                    report.started.append(job.job_id)
        if self._last_round is not None:
            self.core.record(snapshot, plan, max(now - self._last_round, 0.0))
        self._last_round = now
        return report

    def run_forever(self, interval: float, stop: threading.Event, min_gap: float = 1.0) -> None:
        """Rounds every `interval` seconds, or sooner (but at most one per `min_gap` seconds) when
        the watcher sees a pod or node change. API errors are logged and retried next round;
        they never end the loop."""
        while not stop.is_set():
            began = time.monotonic()
            try:
                report = self.run_once()
                if report.started or report.stopped:
                    log.info("round: started %s stopped %s", report.started, report.stopped)
            except Exception:  # noqa: BLE001 - keep scheduling through transient API failures
                log.exception("scheduling round failed; retrying")
            self.wake.wait(max(interval - (time.monotonic() - began), 0.0))
            self.wake.clear()
            # Coalesce bursts of changes (a gang's pods are created together; busy clusters churn).
            stop.wait(max(min_gap - (time.monotonic() - began), 0.2))


def _with_submit(view: JobView, index: int) -> JobView:
    """Policies only compare submit times; use the rank in arrival order (creationTimestamp)."""
    return JobView(job_id=view.job_id, gpus=view.gpus, dataset=view.dataset, ideal_throughput=view.ideal_throughput,
                   remaining_bytes=view.remaining_bytes, submit_time=float(index), running=view.running,
                   priority=view.priority)


class Watcher:
    """Watches pods and nodes and sets `wake` on every change, so a new gang or a finished pod is
    acted on without waiting for the next round. Correctness never depends on it: every round
    re-lists (level-triggered)."""

    def __init__(self, api: Any, wake: threading.Event, *, read_timeout: float = 60.0):
        self.api = api
        self.wake = wake
        self.read_timeout = read_timeout
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watches: list[Any] = []

    def start(self) -> None:
        for name, fn in (("pods", self.api.list_pod_for_all_namespaces), ("nodes", self.api.list_node)):
            t = threading.Thread(target=self._run, args=(fn,), name=f"silod-watch-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _run(self, fn: Callable[..., Any]) -> None:
        from kubernetes import watch

        while not self._stop.is_set():
            w = watch.Watch()
            self._watches.append(w)
            try:
                for _event in w.stream(fn, _request_timeout=(5, self.read_timeout)):
                    self.wake.set()
                    if self._stop.is_set():
                        break
            except Exception as exc:  # noqa: BLE001 - timeouts, 410 Gone, connection resets: re-watch
                if not self._stop.is_set():
                    log.debug("watch ended (%s); restarting", exc)
                    self._stop.wait(1.0)
            finally:
                w.stop()
                self._watches.remove(w)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        for w in list(self._watches):
            w.stop()
        for t in self._threads:
            t.join(timeout)


__all__ = [
    "ANN_CACHE", "ANN_IO", "ANN_JOB_IO", "ANN_NODE", "ANN_SCHEDULED_AT", "AnnotationError", "JobPlacement",
    "KubernetesBackend", "KubernetesScheduler", "PodAllocation", "RoundReport", "Watcher",
]
