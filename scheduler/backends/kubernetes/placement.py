"""Where an admitted workload's pods go: GPUs, node-local cache and the node's share of remote IO.

Pure (no API calls). The policy decides *whether* a job runs and with how much cache and remote
IO; this module decides *where*, and refuses a placement that a node cannot honour:

- GPUs: a node's allocatable `nvidia.com/gpu` minus what bound pods hold and what silod has
  already promised to admitted workloads whose pods are not bound yet;
- cache: the job's dataset cache allocation must fit on every node it runs on (each node's FUSE
  client caches the dataset on that node's disk), next to the allocations of the other datasets
  already admitted on the node (a dataset already there needs only the difference);
- remote IO: each pod gets an equal share of the job's remote IO, and the pods placed on a node
  must fit in that node's share of the cluster's remote link (its NIC, or the link split evenly);
- CPU: a pod's CPU request (resources.requests.cpu) must fit in the node's allocatable cpu
  minus what bound pods request and what silod promised to admitted pods not bound yet (the
  cores the scheduler allocates a job's input pipeline are not pushed into its pods: a Job's pod
  resources cannot change once it exists, so the pods' own requests are what the node must hold);
- nodeSelector and required node affinity: by kube-scheduler's rules (nodematch.py);
- memory: the same, from the pods' memory requests and the node's allocatable memory;
- taints: a node whose NoSchedule/NoExecute taints the pod does not tolerate is never chosen
  (kube-scheduler would leave the pod Pending while silod holds the node's GPUs). Nodes that are
  not Ready or are cordoned never reach this module (backend.py leaves them out), and a node
  still tainted node.kubernetes.io/not-ready is refused here like any other taint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.backends.kubernetes.nodematch import node_selected

EPS = 1e-6


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"


@dataclass(frozen=True, slots=True)
class Toleration:
    key: str = ""  # empty with operator Exists: tolerates every taint
    operator: str = "Equal"  # Equal | Exists
    value: str = ""
    effect: str = ""  # empty: every effect

    def tolerates(self, taint: Taint) -> bool:
        """Kubernetes' rule (k8s.io/api/core/v1 Toleration.ToleratesTaint)."""
        if self.effect and self.effect != taint.effect:
            return False
        if self.key and self.key != taint.key:
            return False
        if self.operator == "Exists":
            return True
        return self.operator in ("Equal", "") and self.value == taint.value


# PreferNoSchedule is a preference: kube-scheduler may still bind there.
BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


@dataclass(frozen=True, slots=True)
class NodeState:
    name: str
    hostname: str  # the node's kubernetes.io/hostname label (what the affinity selects on)
    gpus_free: int
    cache_capacity: float  # bytes of local disk for the dataset cache
    cache_used: Mapping[str, float] = field(default_factory=dict)  # dataset -> bytes admitted here
    io_capacity: float = float("inf")  # bytes/s: this node's share of the remote link
    io_used: float = 0.0
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    cpus_free: float = float("inf")  # cores: allocatable minus requests of bound and promised pods
    memory_free: float = float("inf")  # bytes, counted as cpus_free
    cache_source: str = "share"  # where cache_capacity comes from: "agent" | "annotation" | "share"

    def cache_free_for(self, dataset: str) -> float:
        return self.cache_capacity - sum(v for k, v in self.cache_used.items() if k != dataset)

    def admits(self, selector: Mapping[str, str], tolerations: Sequence[Toleration] = (),
               affinity_terms: Sequence[Mapping[str, Any]] | None = None) -> bool:
        """The node's labels satisfy the pod's nodeSelector and required node affinity
        (nodematch: kube-scheduler's rules), and the pod tolerates every taint that keeps pods
        off the node."""
        return (node_selected(self.name, self.labels, selector, affinity_terms)
                and all(any(t.tolerates(taint) for t in tolerations)
                        for taint in self.taints if taint.effect in BLOCKING_EFFECTS))


@dataclass(frozen=True, slots=True)
class PodRequest:
    key: str
    gpus: int
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    cpus: float = 0.0  # cores the pod requests
    affinity_terms: tuple[Mapping[str, Any], ...] | None = None  # required node affinity (None: none)
    memory: float = 0.0  # bytes of memory the pod requests


def why_not(pods: Sequence[PodRequest], nodes: Sequence[NodeState], *, dataset: str, cache_bytes: float,
            io_per_pod: float) -> str:
    """One sentence for an operator: which resource no node offers."""
    gpus = sum(p.gpus for p in pods)
    if pods and not [n for n in nodes if all(n.admits(p.node_selector, p.tolerations, p.affinity_terms) for p in pods)]:
        tainted = sorted({t.key for n in nodes for t in n.taints if t.effect in BLOCKING_EFFECTS})
        return ("no node matches its pods' nodeSelector, node affinity and tolerations"
                + (f" (nodes tainted {', '.join(tainted)}: add a toleration if the pods may run there)" if tainted else ""))
    free = sum(n.gpus_free for n in nodes)
    if gpus > free:
        return f"needs {gpus} GPUs, {free} free"
    if not any(n.cache_free_for(dataset) + EPS >= cache_bytes for n in nodes):
        return f"no node has {cache_bytes:.0f} bytes of cache free for dataset {dataset}"
    if not any(n.io_capacity - n.io_used + EPS >= io_per_pod for n in nodes):
        return f"no node has {io_per_pod:.0f} bytes/s of remote IO free"
    need = max((p.cpus for p in pods), default=0.0)
    if need > 0 and not any(n.cpus_free + EPS >= need for n in nodes):
        best = max((n.cpus_free for n in nodes), default=0.0)
        return f"a pod requests {need:g} CPU cores, no node has more than {best:g} free"
    need = max((p.memory for p in pods), default=0.0)
    if need > 0 and not any(n.memory_free + EPS >= need for n in nodes):
        best = max((n.memory_free for n in nodes), default=0.0)
        return f"a pod requests {need / 2**30:.4g}Gi of memory, no node has more than {best / 2**30:.4g}Gi free"
    return "the pods do not fit on the free GPUs of the nodes that have the cache and IO"


def place(pods: Sequence[PodRequest], nodes: Sequence[NodeState], *, dataset: str, cache_bytes: float,
          io_per_pod: float, max_steps: int = 20000) -> dict[str, str] | None:
    """Node for every pod (pod key -> node name), or None when they do not all fit.

    Best-fit decreasing (biggest pod onto the node it fills most tightly, keeping whole nodes
    free for big gangs), then a bounded exhaustive search so a gang that fits is not refused
    because of the heuristic's order."""
    order = sorted(pods, key=lambda p: (-p.gpus, p.key))
    eligible = {
        p.key: [n.name for n in sorted(nodes, key=lambda n: n.name)
                if n.admits(p.node_selector, p.tolerations, p.affinity_terms) and n.cache_free_for(dataset) + EPS >= cache_bytes]
        for p in order
    }
    if any(not eligible[p.key] for p in order):
        return None
    gpus = {n.name: n.gpus_free for n in nodes}
    io = {n.name: n.io_capacity - n.io_used for n in nodes}
    cpus = {n.name: n.cpus_free for n in nodes}
    mem = {n.name: n.memory_free for n in nodes}

    def fits(p: PodRequest, n: str) -> bool:
        return gpus[n] >= p.gpus and io[n] + EPS >= io_per_pod and cpus[n] + EPS >= p.cpus and mem[n] + EPS >= p.memory

    chosen: dict[str, str] = {}
    for p in order:
        options = [n for n in eligible[p.key] if fits(p, n)]
        if not options:
            break
        best = min(options, key=lambda n: (gpus[n] - p.gpus, n))
        chosen[p.key] = best
        gpus[best] -= p.gpus
        io[best] -= io_per_pod
        cpus[best] -= p.cpus
        mem[best] -= p.memory
    else:
        return chosen

    gpus = {n.name: n.gpus_free for n in nodes}
    io = {n.name: n.io_capacity - n.io_used for n in nodes}
    cpus = {n.name: n.cpus_free for n in nodes}
    mem = {n.name: n.memory_free for n in nodes}
    chosen = {}
    steps = 0

    def search(i: int) -> bool:
        nonlocal steps
        if i == len(order):
            return True
        p = order[i]
        tried: set[tuple[int, float]] = set()
        for n in eligible[p.key]:
            steps += 1
            if steps > max_steps:
                return False
            sig = (gpus[n], round(io[n], 3), round(cpus[n], 3), round(mem[n], -3))
            if not fits(p, n) or sig in tried:
                continue
            tried.add(sig)
            gpus[n] -= p.gpus
            io[n] -= io_per_pod
            cpus[n] -= p.cpus
            mem[n] -= p.memory
            chosen[p.key] = n
            if search(i + 1):
                return True
            gpus[n] += p.gpus
            io[n] += io_per_pod
            cpus[n] += p.cpus
            mem[n] += p.memory
            del chosen[p.key]
        return False

    return dict(chosen) if search(0) else None


def by_name_hostnames(nodes: Sequence[NodeState], names: Sequence[str]) -> list[str]:
    """The hostname labels of the named nodes (what the admission's affinity selects on)."""
    host = {n.name: n.hostname for n in nodes}
    return sorted({host[n] for n in names})


__all__ = ["NodeState", "PodRequest", "Taint", "Toleration", "by_name_hostnames", "place", "why_not"]
