"""Cluster state as the scheduler sees it: nodes, pods, GPU accounting, jobs, gang placement.

Built from the official client's models (V1Node, V1Pod) in one place (`ClusterState.build`), then
pure: no API calls, so accounting and placement are unit-tested without a server.

GPU accounting follows the default scheduler: a node offers `status.allocatable[nvidia.com/gpu]`
(or, on clusters without the device plugin, the node annotation silod.io/gpus); every pod that is
bound to the node and not terminated (Succeeded/Failed) holds the GPUs it requests, whichever
scheduler placed it. A pod's request is the sum over its containers, or the largest init
container's if that is more (init containers run one at a time, before the app containers).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from estimator.errors import UserError
from scheduler.backends.kubernetes.contract import (
    ANN_GPUS, ANN_PODS, GPU_RESOURCE, LABEL_JOB, NODE_ANN_CACHE, NODE_ANN_GPUS, SCHEDULER_NAME,
    AnnotationError, JobRequest, SchedulerState, parse_count, parse_gpu_quantity, parse_job_request,
    parse_scheduler_state,
)
from estimator.units import UnitError, parse_size

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str
    effect: str


@dataclass(frozen=True, slots=True)
class Toleration:
    key: str
    operator: str  # Equal | Exists
    value: str
    effect: str  # "" = all effects

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.operator == "Exists":
            return not self.key or self.key == taint.key
        return self.key == taint.key and self.value == taint.value


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    gpus: int  # allocatable
    cache: float | None  # bytes of local cache disk (node annotation), None = not declared
    labels: Mapping[str, str]
    taints: tuple[Taint, ...] = ()
    schedulable: bool = True  # Ready and not cordoned
    error: str | None = None  # a bad silod node annotation (reported, node then offers 0 GPUs)

    def admits(self, selector: Mapping[str, str], tolerations: Sequence[Toleration]) -> bool:
        """nodeSelector and NoSchedule/NoExecute taints; affinity is not evaluated (docs say so)."""
        if not self.schedulable:
            return False
        if any(self.labels.get(k) != v for k, v in selector.items()):
            return False
        for taint in self.taints:
            if taint.effect in ("NoSchedule", "NoExecute") and not any(t.tolerates(taint) for t in tolerations):
                return False
        return True


@dataclass(frozen=True, slots=True)
class PodView:
    namespace: str
    name: str
    uid: str
    scheduler_name: str
    node_name: str | None
    phase: str
    gpus: int  # GPUs this pod holds/asks for (requests, or the job's silod.io/gpus split)
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    deleting: bool = False
    error: str | None = None  # an unreadable GPU request
    created: float | None = None  # creationTimestamp, unix seconds

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def bound(self) -> bool:
        return bool(self.node_name)

    @property
    def terminated(self) -> bool:
        return self.phase in TERMINAL_PHASES

    @property
    def is_silod(self) -> bool:
        return self.scheduler_name == SCHEDULER_NAME and bool(self.labels.get(LABEL_JOB))


@dataclass(frozen=True, slots=True)
class JobGroup:
    """The pods of one silod job (label silod.io/job, one namespace)."""

    job_id: str  # "<namespace>/<label value>"
    namespace: str
    pods: tuple[PodView, ...]
    request: JobRequest | None  # None when an annotation is bad (see errors)
    errors: tuple[tuple[str, str], ...]  # (pod key, message) for every unreadable pod
    states: Mapping[str, SchedulerState]  # pod key -> what the scheduler wrote

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.pods)

    @property
    def created(self) -> float | None:
        return min((p.created for p in self.pods if p.created is not None), default=None)

    @property
    def expected_pods(self) -> int:
        return self.request.pods if self.request else len(self.pods)

    @property
    def complete(self) -> bool:
        """All the gang's pods exist (none terminated): only then can the gang be placed."""
        live = [p for p in self.pods if not p.terminated and not p.deleting]
        return len(live) >= self.expected_pods

    @property
    def finished(self) -> bool:
        return bool(self.pods) and all(p.phase == "Succeeded" for p in self.pods)

    @property
    def failed(self) -> bool:
        return any(p.phase == "Failed" for p in self.pods)

    @property
    def bound_pods(self) -> tuple[PodView, ...]:
        return tuple(p for p in self.pods if p.bound)

    @property
    def unbound_pods(self) -> tuple[PodView, ...]:
        return tuple(p for p in self.pods if not p.bound and not p.terminated and not p.deleting)

    @property
    def running(self) -> bool:
        """Holds its GPUs: every pod bound (some may already have finished)."""
        return bool(self.pods) and not self.unbound_pods and not self.finished and not self.failed

    @property
    def partially_bound(self) -> bool:
        return bool(self.bound_pods) and bool(self.unbound_pods)

    @property
    def pending(self) -> bool:
        return not self.bound_pods and not self.finished and not self.failed


@dataclass(frozen=True)
class ClusterState:
    nodes: Mapping[str, NodeView]
    pods: tuple[PodView, ...]  # every non-terminal bound pod plus every silod pod
    jobs: Mapping[str, JobGroup]
    ignored: tuple[str, ...] = ()  # silod-scheduled pods without the job label (reported)

    def used_gpus(self) -> dict[str, int]:
        used: dict[str, int] = defaultdict(int)
        seen: set[str] = set()
        for pod in self.pods:
            if pod.key in seen or not pod.bound or pod.terminated:
                continue
            seen.add(pod.key)
            used[pod.node_name] += pod.gpus  # type: ignore[index]
        return dict(used)

    def free_gpus(self) -> dict[str, int]:
        used = self.used_gpus()
        return {name: max(node.gpus - used.get(name, 0), 0) for name, node in self.nodes.items()
                if node.schedulable}

    def foreign_gpus(self) -> int:
        """GPUs held by pods that silod does not schedule (on schedulable nodes)."""
        return sum(p.gpus for p in self.pods if p.bound and not p.terminated and not p.is_silod
                   and p.node_name in self.nodes and self.nodes[p.node_name].schedulable)

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes.values() if n.schedulable)

    @staticmethod
    def build(nodes: Iterable[Any], pods: Iterable[Any]) -> ClusterState:
        node_views = {v.name: v for v in (node_view(n) for n in nodes)}
        pod_views: dict[str, PodView] = {}
        ignored: list[str] = []
        for pod in pods:
            view = pod_view(pod)
            pod_views[view.key] = view
            if view.scheduler_name == SCHEDULER_NAME and not view.labels.get(LABEL_JOB):
                ignored.append(view.key)
        return ClusterState(nodes=MappingProxyType(node_views), pods=tuple(pod_views.values()),
                            jobs=MappingProxyType(group_jobs(pod_views.values())), ignored=tuple(ignored))


# --- model -> view ---------------------------------------------------------------------------

def _gpu_of(resources: Any, what: str) -> int:
    if resources is None:
        return 0
    for source in (resources.requests, resources.limits):  # requests win; limits imply requests
        if source and GPU_RESOURCE in source:
            return parse_gpu_quantity(str(source[GPU_RESOURCE]), what)
    return 0


def pod_gpu_request(pod: Any) -> int:
    """GPUs a V1Pod asks for: sum over containers, or the largest init container if larger."""
    spec = pod.spec
    name = f"pod {pod.metadata.namespace}/{pod.metadata.name}"
    if spec is None:
        return 0
    app = sum(_gpu_of(c.resources, f"{name} container {c.name} {GPU_RESOURCE}") for c in spec.containers or [])
    init = max((_gpu_of(c.resources, f"{name} init container {c.name} {GPU_RESOURCE}")
                for c in spec.init_containers or []), default=0)
    return max(app, init)


def pod_view(pod: Any) -> PodView:
    meta, spec, status = pod.metadata, pod.spec, pod.status
    labels = dict(meta.labels or {})
    annotations = dict(meta.annotations or {})
    error = None
    try:
        gpus = pod_gpu_request(pod)
    except AnnotationError as exc:
        gpus, error = 0, str(exc)
    if gpus == 0 and error is None and labels.get(LABEL_JOB) and annotations.get(ANN_GPUS):
        # No device plugin requests: the job's silod.io/gpus is split evenly over its pods.
        key = f"pod {meta.namespace}/{meta.name}"
        try:
            total = parse_count(annotations[ANN_GPUS], f"{key}: annotation {ANN_GPUS}={annotations[ANN_GPUS]!r}", minimum=1)
            npods = parse_count(annotations.get(ANN_PODS, "1") or "1",
                                f"{key}: annotation {ANN_PODS}={annotations.get(ANN_PODS)!r}", minimum=1)
            if total % npods:
                raise AnnotationError(f"{key}: {ANN_GPUS}={total} does not split evenly over {ANN_PODS}={npods} pods;"
                                      f" request {GPU_RESOURCE} per pod instead")
            gpus = total // npods
        except AnnotationError as exc:
            error = str(exc)
    tolerations = tuple(
        Toleration(key=t.key or "", operator=t.operator or "Equal", value=t.value or "", effect=t.effect or "")
        for t in (spec.tolerations or [] if spec else [])
    )
    return PodView(
        namespace=meta.namespace or "default",
        name=meta.name,
        uid=meta.uid or "",
        scheduler_name=(spec.scheduler_name if spec else None) or "default-scheduler",
        node_name=(spec.node_name if spec else None) or None,
        phase=(status.phase if status else None) or "Pending",
        gpus=gpus,
        labels=MappingProxyType(labels),
        annotations=MappingProxyType(annotations),
        node_selector=MappingProxyType(dict((spec.node_selector if spec else None) or {})),
        tolerations=tolerations,
        deleting=meta.deletion_timestamp is not None,
        error=error,
        created=meta.creation_timestamp.timestamp() if meta.creation_timestamp else None,
    )


def node_view(node: Any) -> NodeView:
    meta, spec, status = node.metadata, node.spec, node.status
    annotations = dict(meta.annotations or {})
    error = None
    gpus = 0
    try:
        allocatable = (status.allocatable if status else None) or {}
        if GPU_RESOURCE in allocatable:
            gpus = parse_gpu_quantity(str(allocatable[GPU_RESOURCE]), f"node {meta.name} allocatable {GPU_RESOURCE}")
        elif annotations.get(NODE_ANN_GPUS):
            gpus = parse_count(annotations[NODE_ANN_GPUS], f"node {meta.name}: annotation {NODE_ANN_GPUS}")
    except AnnotationError as exc:
        gpus, error = 0, str(exc)
    cache = None
    if annotations.get(NODE_ANN_CACHE):
        try:
            cache = parse_size(annotations[NODE_ANN_CACHE], f"node {meta.name}: annotation {NODE_ANN_CACHE}")
        except UnitError as exc:
            error = str(exc)
    ready = True
    for cond in (status.conditions if status else None) or []:
        if cond.type == "Ready":
            ready = cond.status == "True"
    taints = tuple(Taint(t.key or "", t.value or "", t.effect or "") for t in (spec.taints if spec else None) or [])
    return NodeView(
        name=meta.name, gpus=gpus, cache=cache, labels=MappingProxyType(dict(meta.labels or {})),
        taints=taints, schedulable=ready and not bool(spec and spec.unschedulable), error=error,
    )


def group_jobs(pods: Iterable[PodView]) -> dict[str, JobGroup]:
    members: dict[str, list[PodView]] = defaultdict(list)
    for pod in pods:
        if pod.is_silod:
            members[f"{pod.namespace}/{pod.labels[LABEL_JOB]}"].append(pod)
    jobs = {}
    for job_id, group in members.items():
        group.sort(key=lambda p: p.name)
        errors: list[tuple[str, str]] = []
        requests: dict[str, JobRequest] = {}
        states: dict[str, SchedulerState] = {}
        for pod in group:
            if pod.error:
                errors.append((pod.key, pod.error))
            try:
                requests[pod.key] = parse_job_request(pod.key, pod.annotations)
            except UserError as exc:
                errors.append((pod.key, str(exc)))
            try:
                states[pod.key] = parse_scheduler_state(pod.key, pod.annotations)
            except UserError as exc:
                errors.append((pod.key, str(exc)))
        request = None
        if requests and not errors:
            first_key, request = next(iter(requests.items()))
            for key, other in requests.items():
                if other != request:
                    errors.append((key, f"pod {key}: its silod.io/* annotations differ from pod {first_key} of the"
                                        f" same job {job_id}; every pod of a job must carry the same ones"))
                    request = None
                    break
        if request is not None and request.gpus is not None:
            requested = sum(p.gpus for p in group)
            live = [p for p in group if not p.terminated]
            if len(live) >= request.pods and requested != request.gpus:
                errors.append((group[0].key, f"job {job_id}: {ANN_GPUS}={request.gpus} but its pods request"
                                             f" {requested} {GPU_RESOURCE} in total; make them agree"))
                request = None
        jobs[job_id] = JobGroup(
            job_id=job_id, namespace=group[0].namespace, pods=tuple(group), request=request,
            errors=tuple(errors), states=MappingProxyType(states),
        )
    return jobs


# --- gang placement --------------------------------------------------------------------------

def place_gang(
    pods: Sequence[PodView], nodes: Mapping[str, NodeView], free: Mapping[str, int], *, max_steps: int = 20000
) -> dict[str, str] | None:
    """Nodes for *all* of `pods` (pod key -> node name), or None when they do not all fit.

    Best-fit decreasing first (biggest pod onto the node it fills most tightly, which keeps whole
    nodes free for big gangs); if that fails, a bounded exhaustive search, so a gang that fits is
    not refused because of the heuristic's order.
    """
    order = sorted(pods, key=lambda p: (-p.gpus, p.key))
    eligible = {p.key: [n for n in sorted(free) if n in nodes and nodes[n].admits(p.node_selector, p.tolerations)]
                for p in order}
    if any(not eligible[p.key] for p in order):
        return None

    remaining = dict(free)
    greedy: dict[str, str] = {}
    for pod in order:
        fits = [n for n in eligible[pod.key] if remaining[n] >= pod.gpus]
        if not fits:
            break
        best = min(fits, key=lambda n: (remaining[n] - pod.gpus, n))
        greedy[pod.key] = best
        remaining[best] -= pod.gpus
    else:
        return greedy

    remaining = dict(free)
    chosen: dict[str, str] = {}
    steps = 0
    # Two nodes are interchangeable when they have the same free GPUs and admit the same pods.
    signature = {n: tuple(n in eligible[p.key] for p in order) for n in free}

    def search(i: int) -> bool:
        nonlocal steps
        if i == len(order):
            return True
        pod = order[i]
        tried: set[tuple[int, tuple[bool, ...]]] = set()
        for n in eligible[pod.key]:
            steps += 1
            if steps > max_steps:
                return False
            if remaining[n] < pod.gpus or (remaining[n], signature[n]) in tried:
                continue
            tried.add((remaining[n], signature[n]))
            remaining[n] -= pod.gpus
            chosen[pod.key] = n
            if search(i + 1):
                return True
            remaining[n] += pod.gpus
            del chosen[pod.key]
        return False

    return dict(chosen) if search(0) else None
