"""Workloads silod admits on Kubernetes: batch/v1 Job, JobSet and Kubeflow PyTorchJob.

Kueue's pattern: a workload opts in with the label `silod.io/queue` and is created suspended
(by its owner, or by a mutating webhook); silod admits it by writing its placement into the pod
templates (a required node affinity on the chosen nodes) and unsuspending it, and preempts it by
suspending it again. The workload's own controller (the Job controller, the JobSet or training
operator) then creates or deletes the pods; silod never deletes a user's pods.

Everything here is pure: objects are the API server's JSON (dicts) in, typed `Workload`s and new
object bodies out, so parsing and patching are tested without a server.

What silod reads from a workload is the owner's *request* (GPUs in the pod templates, the
dataset in the CSI volume, f*/epochs annotations), exactly as it reads a REST body. It never
reads *state* from it: progress, consumption and the admission record live in silod's database
and memory, and `status` (written only by the workload's controller) is the only source of
"finished" and "failed".
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from estimator.errors import UserError
from estimator.units import UnitError, parse_rate
from scheduler.backends.kubernetes.nodematch import NodeLabels, pod_spec_problems, required_terms

PREFIX = "silod.io/"
QUEUE_LABEL = PREFIX + "queue"  # opt-in: the queue a workload waits in
JOB_ID_LABEL = PREFIX + "job-id"  # on Jobs silod created for REST submissions: the REST job id
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "silod"
ANN_IDEAL = PREFIX + "ideal-throughput"  # f* at the workload's GPUs, e.g. 900MB/s
ANN_MODEL = PREFIX + "model"  # catalog model instead of f*
ANN_EPOCHS = PREFIX + "epochs"  # passes over the dataset
ANN_DATASET = PREFIX + "dataset"  # when the data comes through a PVC rather than an inline volume
ANN_ADMITTED = PREFIX + "admitted-nodes"  # written by silod: the nodes of the current admission
CSI_DRIVER = "silod.io"
GPU_RESOURCE = "nvidia.com/gpu"
HOSTNAME_LABEL = "kubernetes.io/hostname"


class WorkloadError(UserError):
    """A workload silod cannot admit as written; the message names the object, field and fix."""


@dataclass(frozen=True, slots=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


JOB = Kind("batch", "v1", "jobs", "Job")
JOBSET = Kind("jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet")
PYTORCHJOB = Kind("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob")
KINDS = (JOB, JOBSET, PYTORCHJOB)
KIND_BY_NAME = {k.kind: k for k in KINDS}


@dataclass(frozen=True, slots=True)
class PodSet:
    """Pods made from one template: `count` pods of `gpus` GPUs each."""

    name: str
    count: int
    gpus: int
    node_selector: Mapping[str, str]
    path: tuple[str | int, ...]  # where the pod template (with .spec) sits in the object
    tolerations: tuple[tuple[str, str, str, str], ...] = ()  # (key, operator, value, effect)
    cpus: float = 0.0  # CPU cores each pod requests (resources.requests.cpu; limits imply requests)
    memory: float = 0.0  # bytes of memory each pod requests
    # The required node affinity's nodeSelectorTerms (nodematch.required_terms), None without one.
    affinity_terms: tuple[Mapping[str, Any], ...] | None = None


@dataclass(frozen=True, slots=True)
class Workload:
    kind: Kind
    namespace: str
    name: str
    uid: str
    resource_version: str
    queue: str
    suspended: bool
    pod_sets: tuple[PodSet, ...]
    dataset: str | None
    ideal_throughput: float | None
    model: str | None
    epochs: float | None
    priority_class: str | None
    created: float
    phase: str  # active | finished | failed
    message: str  # why it finished or failed, from its controller's status
    rest_job_id: str | None  # set on Jobs silod created for a REST submission
    admitted_nodes: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"{self.kind.kind}/{self.namespace}/{self.name}"

    @property
    def gpus(self) -> int:
        return sum(p.count * p.gpus for p in self.pod_sets)

    @property
    def pods(self) -> int:
        return sum(p.count for p in self.pod_sets)

    def pod_list(self) -> list[tuple[str, int, Mapping[str, str], tuple[tuple[str, str, str, str], ...]]]:
        """One (pod name, GPUs, nodeSelector, tolerations) per pod, for placement."""
        return [(f"{self.key}/{ps.name}-{i}", ps.gpus, ps.node_selector, ps.tolerations)
                for ps in self.pod_sets for i in range(ps.count)]

    def pod_cpus(self) -> dict[str, float]:
        """CPU cores each pod requests, keyed as pod_list names them (for placement's CPU fit)."""
        return {f"{self.key}/{ps.name}-{i}": ps.cpus for ps in self.pod_sets for i in range(ps.count)}


# --- reading -----------------------------------------------------------------------------------

def _get(obj: Any, *path: str | int, default: Any = None) -> Any:
    for p in path:
        if isinstance(p, int):
            if not isinstance(obj, list) or p >= len(obj):
                return default
            obj = obj[p]
        else:
            if not isinstance(obj, Mapping) or p not in obj:
                return default
            obj = obj[p]
    return obj


def _quantity_gpus(value: Any, where: str) -> int:
    text = str(value).strip()
    if text.endswith("m") and text[:-1].isdigit():
        milli = int(text[:-1])
        if milli % 1000:
            raise WorkloadError(f"{where} = {text!r}: GPUs are whole devices")
        return milli // 1000
    if not text.isdigit():
        raise WorkloadError(f"{where} = {text!r} is not a whole number of GPUs")
    return int(text)


def pod_gpus(pod_spec: Mapping[str, Any], where: str) -> int:
    """GPUs one pod asks for: the containers' sum, or the largest init container if larger."""
    def of(c: Mapping[str, Any], what: str) -> int:
        res = c.get("resources") or {}
        for source in ("requests", "limits"):  # requests win; limits imply requests
            if GPU_RESOURCE in (res.get(source) or {}):
                return _quantity_gpus(res[source][GPU_RESOURCE], f"{where} {what} {c.get('name')} {GPU_RESOURCE}")
        return 0
    app = sum(of(c, "container") for c in pod_spec.get("containers") or [])
    init = max((of(c, "init container") for c in pod_spec.get("initContainers") or []), default=0)
    return max(app, init)


def parse_cpu_quantity(value: Any, where: str) -> float:
    """A Kubernetes CPU quantity in cores: "2", "1.5", "500m" (millicores)."""
    text = str(value).strip()
    try:
        cores = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        raise WorkloadError(f"{where} = {text!r} is not a CPU quantity (e.g. 4, 1.5 or 500m)") from None
    if not (cores >= 0 and cores < 1e7):
        raise WorkloadError(f"{where} = {text!r} is not a CPU quantity (e.g. 4, 1.5 or 500m)")
    return cores


def pod_cpus(pod_spec: Mapping[str, Any], where: str) -> float:
    """CPU cores one pod requests, as kube-scheduler counts them: the containers' sum, or the
    largest init container if larger; a container with a limit but no request requests its limit."""
    def of(c: Mapping[str, Any], what: str) -> float:
        res = c.get("resources") or {}
        for source in ("requests", "limits"):
            if "cpu" in (res.get(source) or {}):
                return parse_cpu_quantity(res[source]["cpu"], f"{where} {what} {c.get('name')} cpu")
        return 0.0
    app = sum(of(c, "container") for c in pod_spec.get("containers") or [])
    init = max((of(c, "init container") for c in pod_spec.get("initContainers") or []), default=0.0)
    return max(app, init)


_MEMORY_SUFFIX = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "m": 1e-3,
                  "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def parse_memory_quantity(value: Any, where: str) -> float:
    """A Kubernetes memory quantity in bytes: "512Gi", "64G", "1e9", "128974848"."""
    text = str(value).strip()
    import re

    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?", text)
    if not m:
        raise WorkloadError(f"{where} = {text!r} is not a memory quantity (e.g. 64Gi or 500M)")
    return float(m.group(1)) * _MEMORY_SUFFIX[m.group(2) or ""]


def pod_memory(pod_spec: Mapping[str, Any], where: str) -> float:
    """Bytes of memory one pod requests, counted as pod_cpus counts cores."""
    def of(c: Mapping[str, Any], what: str) -> float:
        res = c.get("resources") or {}
        for source in ("requests", "limits"):
            if "memory" in (res.get(source) or {}):
                return parse_memory_quantity(res[source]["memory"], f"{where} {what} {c.get('name')} memory")
        return 0.0
    app = sum(of(c, "container") for c in pod_spec.get("containers") or [])
    init = max((of(c, "init container") for c in pod_spec.get("initContainers") or []), default=0.0)
    return max(app, init)


def template_datasets(pod_spec: Mapping[str, Any]) -> list[str]:
    """Datasets named by silod CSI inline volumes in a pod spec."""
    out = []
    for v in pod_spec.get("volumes") or []:
        csi = v.get("csi") if isinstance(v, Mapping) else None
        if isinstance(csi, Mapping) and csi.get("driver") == CSI_DRIVER:
            name = (csi.get("volumeAttributes") or {}).get("dataset")
            if name:
                out.append(str(name))
    return out


PROPAGATION = "HostToContainer"


def template_paths(kind: Kind, obj: Mapping[str, Any]) -> list[tuple[str | int, ...]]:
    """Where each pod template sits in a workload (tolerant of any shape: the admission webhook
    sees objects nothing has validated yet)."""
    spec = obj.get("spec") if isinstance(obj.get("spec"), Mapping) else {}
    if kind == JOB:
        return [("spec", "template")]
    if kind == JOBSET:
        rjs = spec.get("replicatedJobs")
        return [("spec", "replicatedJobs", i, "template", "spec", "template")
                for i in range(len(rjs))] if isinstance(rjs, list) else []
    if kind == PYTORCHJOB:
        specs = spec.get("pytorchReplicaSpecs")
        return [("spec", "pytorchReplicaSpecs", role, "template") for role in specs] if isinstance(specs, Mapping) else []
    return []


def propagation_patch(kind: Kind, obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    """JSONPatch ops giving every container mount of a silod volume `mountPropagation:
    HostToContainer` (where the owner set none). A node agent that restarts (rolling update,
    OOM kill) re-creates its FUSE mount and re-binds the pods' target paths on the host; with
    HostToContainer (rslave) the container sees the new mount, with the default (rprivate) it
    keeps the dead one and every read fails with ENOTCONN until the pod is deleted."""
    ops: list[dict[str, Any]] = []
    for path in template_paths(kind, obj):
        pod_spec = _get(obj, *path, "spec")
        if not isinstance(pod_spec, Mapping):
            continue
        ours = {v.get("name") for v in pod_spec.get("volumes") or [] if isinstance(v, Mapping)
                and isinstance(v.get("csi"), Mapping) and v["csi"].get("driver") == CSI_DRIVER}
        for field_name in ("initContainers", "containers"):
            for i, c in enumerate(pod_spec.get(field_name) or []):
                for j, m in enumerate((c.get("volumeMounts") or []) if isinstance(c, Mapping) else []):
                    if isinstance(m, Mapping) and m.get("name") in ours and "mountPropagation" not in m:
                        pointer = "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in path)
                        ops.append({"op": "add", "value": PROPAGATION,
                                    "path": f"/{pointer}/spec/{field_name}/{i}/volumeMounts/{j}/mountPropagation"})
    return ops


# --- the step reporter's environment (silod_client.reporter) ----------------------------------

#: The per-job Secret silod writes into the workload's namespace when it admits the workload:
#: the job's report token (api.auth.TokenStore.mint_job_token: it may post that job's step
#: reports and nothing else), the API's URL and the job's id. Its name follows from the
#: workload alone, so a pod template can refer to it before silod knows the job's id.
REPORT_SECRET_PREFIX = "silod-report-"
REPORT_ENV = (("SILOD_JOB_ID", "job-id"), ("SILOD_SERVER", "server"), ("SILOD_TOKEN", "token"))


def report_secret_name(kind: Kind, name: str) -> str:
    """The report Secret of workload `kind`/`name` (a DNS subdomain: both parts are DNS names)."""
    return f"{REPORT_SECRET_PREFIX}{kind.kind.lower()}-{name}"


def report_env(secret: str, skip: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Env entries reading the reporter's variables from the report Secret. `optional`: a pod
    starts without them when silod could not write the Secret (the reporter then does nothing);
    silod writes it before it unsuspends the workload, so its pods find it."""
    return [{"name": var, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}
            for var, key in REPORT_ENV if var not in skip]


def report_env_patch(kind: Kind, obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    """JSONPatch ops giving every container of the workload's pod templates the reporter's
    variables from its report Secret (the webhook adds them at CREATE: a Job's pod template is
    immutable afterwards). A variable the owner set is left as the owner set it."""
    name = (obj.get("metadata") or {}).get("name") if isinstance(obj.get("metadata"), Mapping) else None
    if not isinstance(name, str) or not name:
        return []  # generateName: no name to refer to yet; the pods get no report token
    secret = report_secret_name(kind, name)
    ops: list[dict[str, Any]] = []
    for path in template_paths(kind, obj):
        containers = _get(obj, *path, "spec", "containers")
        pointer = "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in path)
        for i, c in enumerate(containers if isinstance(containers, list) else []):
            if not isinstance(c, Mapping):
                continue
            env = c.get("env")
            have = [e.get("name") for e in env if isinstance(e, Mapping)] if isinstance(env, list) else []
            entries = report_env(secret, skip=have)
            if not entries:
                continue
            if not isinstance(env, list):
                ops.append({"op": "add", "path": f"/{pointer}/spec/containers/{i}/env", "value": entries})
            else:
                ops += [{"op": "add", "path": f"/{pointer}/spec/containers/{i}/env/-", "value": e} for e in entries]
    return ops


def writable_silod_volumes(kind: Kind, obj: Mapping[str, Any]) -> list[str]:
    """Names of silod CSI volumes in the workload's pod templates without `readOnly: true`: the
    node agent publishes datasets read-only only, so their pods could never start."""
    out = []
    for path in template_paths(kind, obj):
        for v in (_get(obj, *path, "spec", "volumes") or []):
            csi = v.get("csi") if isinstance(v, Mapping) else None
            if isinstance(csi, Mapping) and csi.get("driver") == CSI_DRIVER and csi.get("readOnly") is not True:
                out.append(str(v.get("name")))
    return out


def admission_problems(kind: Kind, obj: Mapping[str, Any], nodes: Sequence[NodeLabels] | None = None) -> list[str]:
    """Why silod would never admit this workload as written, one sentence each (empty: fine).

    The one validation of a workload's pods: the admission webhook refuses a labelled workload
    with these reasons (webhook.py), and a REST submission's Job is checked by the same call
    before it is created (backend.create_workload). Read-only silod volumes; well-formed
    tolerations and node affinity; a nodeSelector / required node affinity some node of the
    cluster matches (`nodes`; None: not checked)."""
    problems: list[str] = []
    writable = writable_silod_volumes(kind, obj)
    if writable:
        problems.append(f"silod volumes are read-only datasets: set `readOnly: true` on the csi volume(s)"
                        f" {', '.join(sorted(set(writable)))} (driver {CSI_DRIVER})")
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    for path in template_paths(kind, obj):
        pod_spec = _get(obj, *path, "spec")
        if not isinstance(pod_spec, Mapping):
            continue
        where = f"{kind.kind} {meta.get('name') or meta.get('generateName') or ''} {'.'.join(map(str, path))}"
        try:
            gpus = pod_gpus(pod_spec, where)
        except WorkloadError as exc:
            problems.append(str(exc))
            gpus = 0
        except (AttributeError, TypeError):  # not a pod spec at all: the API server says why
            continue
        problems += pod_spec_problems(pod_spec, where, nodes, gpus)
    return problems


def _tolerations(value: Any, where: str) -> tuple[tuple[str, str, str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, Mapping) for t in value):
        raise WorkloadError(f"{where} must be a list of tolerations")
    return tuple((str(t.get("key") or ""), str(t.get("operator") or "Equal"), str(t.get("value") or ""),
                  str(t.get("effect") or "")) for t in value)


def _count(value: Any, where: str, default: int = 1) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WorkloadError(f"{where} = {value!r} must be a whole number >= 0")
    return value


def _owners_terms(pod_spec: Mapping[str, Any], admitted: Sequence[str]) -> tuple[Mapping[str, Any], ...] | None:
    """The owner's required node affinity: without the expression silod's admission added."""
    if admitted and required_terms(pod_spec) is not None:
        pod_spec = copy.deepcopy(dict(pod_spec))
        _strip_ours(pod_spec, admitted)
    terms = required_terms(pod_spec)
    return None if terms is None else tuple(terms)


def _pod_sets(kind: Kind, obj: Mapping[str, Any], where: str, admitted: Sequence[str] = ()) -> list[PodSet]:
    spec = obj.get("spec") or {}
    sets: list[PodSet] = []

    def add(name: str, count: int, path: tuple[str | int, ...]) -> None:
        template = _get(obj, *path) or {}
        pod_spec = template.get("spec") or {}
        sets.append(PodSet(name=name, count=count, gpus=pod_gpus(pod_spec, f"{where} {name}"),
                           node_selector=dict(pod_spec.get("nodeSelector") or {}), path=path,
                           tolerations=_tolerations(pod_spec.get("tolerations"), f"{where} {name} tolerations"),
                           cpus=pod_cpus(pod_spec, f"{where} {name}"),
                           affinity_terms=_owners_terms(pod_spec, admitted),
                           memory=pod_memory(pod_spec, f"{where} {name}")))

    if kind == JOB:
        add("main", _count(spec.get("parallelism"), f"{where} spec.parallelism"), ("spec", "template"))
    elif kind == JOBSET:
        for i, rj in enumerate(spec.get("replicatedJobs") or []):
            replicas = _count(rj.get("replicas"), f"{where} replicatedJobs[{i}].replicas")
            par = _count(_get(rj, "template", "spec", "parallelism"), f"{where} replicatedJobs[{i}] parallelism")
            add(str(rj.get("name") or i), replicas * par, ("spec", "replicatedJobs", i, "template", "spec", "template"))
    elif kind == PYTORCHJOB:
        for role in sorted((spec.get("pytorchReplicaSpecs") or {})):
            rs = spec["pytorchReplicaSpecs"][role] or {}
            add(role, _count(rs.get("replicas"), f"{where} {role}.replicas"), ("spec", "pytorchReplicaSpecs", role, "template"))
    else:  # pragma: no cover - KINDS is closed
        raise WorkloadError(f"{where}: kind {kind.kind} is not supported")
    return sets


def _suspend_path(kind: Kind) -> tuple[str, ...]:
    return ("spec", "runPolicy", "suspend") if kind == PYTORCHJOB else ("spec", "suspend")


def _phase(kind: Kind, obj: Mapping[str, Any]) -> tuple[str, str]:
    done = {"Job": ("Complete", "Failed"), "JobSet": ("Completed", "Failed"),
            "PyTorchJob": ("Succeeded", "Failed")}[kind.kind]
    for cond in _get(obj, "status", "conditions", default=[]) or []:
        if cond.get("status") != "True":
            continue
        if cond.get("type") == done[0]:
            return "finished", str(cond.get("message") or cond.get("reason") or "completed")
        if cond.get("type") == done[1]:
            return "failed", str(cond.get("message") or cond.get("reason") or "failed")
    return "active", ""


def _timestamp(value: Any) -> float:
    if not value:
        return 0.0
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def parse_workload(kind: Kind, obj: Mapping[str, Any]) -> Workload:
    """A typed view of one workload object. WorkloadError when it cannot be admitted as written."""
    meta = obj.get("metadata") or {}
    ns, name = meta.get("namespace") or "default", meta.get("name") or ""
    where = f"{kind.kind} {ns}/{name}"
    labels = meta.get("labels") or {}
    ann = meta.get("annotations") or {}
    admitted = tuple(n for n in str(ann.get(ANN_ADMITTED) or "").split(",") if n)
    sets = _pod_sets(kind, obj, where, admitted)
    datasets: list[str] = []
    for ps in sets:
        for d in template_datasets(_get(obj, *ps.path, "spec") or {}):
            if d not in datasets:
                datasets.append(d)
    if not datasets and ann.get(ANN_DATASET):
        datasets = [str(ann[ANN_DATASET])]
    if len(datasets) > 1:
        raise WorkloadError(f"{where} reads datasets {datasets}; silod schedules one dataset per workload")
    ideal = None
    if ann.get(ANN_IDEAL):
        try:
            ideal = parse_rate(str(ann[ANN_IDEAL]), f"{where} annotation {ANN_IDEAL}")
        except UnitError as exc:
            raise WorkloadError(str(exc)) from None
    epochs = None
    if ann.get(ANN_EPOCHS):
        try:
            epochs = float(ann[ANN_EPOCHS])
        except ValueError:
            raise WorkloadError(f"{where} annotation {ANN_EPOCHS}={ann[ANN_EPOCHS]!r} is not a number") from None
        if not math.isfinite(epochs) or epochs <= 0:
            raise WorkloadError(f"{where} annotation {ANN_EPOCHS} must be > 0")
    first_spec = (_get(obj, *sets[0].path, "spec") or {}) if sets else {}
    phase, message = _phase(kind, obj)
    return Workload(
        kind=kind, namespace=ns, name=name, uid=str(meta.get("uid") or ""),
        resource_version=str(meta.get("resourceVersion") or ""), queue=str(labels.get(QUEUE_LABEL) or ""),
        suspended=bool(_get(obj, *_suspend_path(kind), default=False)), pod_sets=tuple(sets),
        dataset=datasets[0] if datasets else None, ideal_throughput=ideal, model=ann.get(ANN_MODEL) or None,
        epochs=epochs, priority_class=first_spec.get("priorityClassName") or None,
        created=_timestamp(meta.get("creationTimestamp")), phase=phase, message=message,
        rest_job_id=labels.get(JOB_ID_LABEL) if labels.get(MANAGED_BY_LABEL) == MANAGED_BY else None,
        admitted_nodes=admitted,
    )


# --- writing: admission and preemption ----------------------------------------------------------

def _set(obj: dict[str, Any], path: Sequence[str | int], value: Any) -> None:
    for p in path[:-1]:
        obj = obj[p] if isinstance(p, int) else obj.setdefault(p, {})
    obj[path[-1]] = value


def _our_expression(hostnames: Sequence[str]) -> dict[str, Any]:
    return {"key": HOSTNAME_LABEL, "operator": "In", "values": sorted(hostnames)}


def _strip_ours(pod_spec: dict[str, Any], hostnames: Sequence[str]) -> None:
    """Remove the node-affinity expression an earlier admission added (and nothing else)."""
    ours = _our_expression(hostnames)
    required = _get(pod_spec, "affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution")
    if not isinstance(required, dict):
        return
    terms = []
    for term in required.get("nodeSelectorTerms") or []:
        exprs = [e for e in term.get("matchExpressions") or [] if e != ours]
        if exprs or term.get("matchFields"):
            terms.append({**term, "matchExpressions": exprs} if exprs else {k: v for k, v in term.items()
                                                                             if k != "matchExpressions"})
    if terms:
        required["nodeSelectorTerms"] = terms
        return
    node_aff = pod_spec["affinity"]["nodeAffinity"]
    node_aff.pop("requiredDuringSchedulingIgnoredDuringExecution", None)
    if not node_aff:
        pod_spec["affinity"].pop("nodeAffinity")
    if not pod_spec["affinity"]:
        pod_spec.pop("affinity")


def admitted_object(kind: Kind, obj: Mapping[str, Any], hostnames: Sequence[str]) -> dict[str, Any]:
    """The workload, unsuspended, with every pod template required onto `hostnames`.

    The expression is ANDed into each of the owner's node-selector terms (the pods must satisfy
    the owner's constraints *and* land on the nodes silod chose); the nodes are recorded in an
    annotation so that a later suspension removes exactly this expression."""
    new = copy.deepcopy(dict(obj))
    wl = parse_workload(kind, new)
    for ps in wl.pod_sets:
        pod_spec = _get(new, *ps.path, "spec")
        if wl.admitted_nodes:
            _strip_ours(pod_spec, wl.admitted_nodes)
        required = (pod_spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
                    .setdefault("requiredDuringSchedulingIgnoredDuringExecution", {}))
        terms = required.get("nodeSelectorTerms") or [{}]
        required["nodeSelectorTerms"] = [
            {**t, "matchExpressions": [*(t.get("matchExpressions") or []), _our_expression(hostnames)]} for t in terms
        ]
    new.setdefault("metadata", {}).setdefault("annotations", {})[ANN_ADMITTED] = ",".join(sorted(hostnames))
    _set(new, _suspend_path(kind), False)
    return new


def suspended_object(kind: Kind, obj: Mapping[str, Any]) -> dict[str, Any]:
    """The workload suspended again (the object a merge patch of the suspend flag yields: the
    backend writes it as a patch, backend.py `_suspend`); its controller deletes the running pods
    (silod deletes nothing). The placement stays in the templates for now: Kubernetes accepts
    changes to a Job's scheduling directives only while it is *already* suspended and has no
    status.startTime (which silod clears before re-admitting, backend.py `_clear_start_time`),
    so the next admission replaces it (`admitted_object` strips the expression the annotation
    records)."""
    new = copy.deepcopy(dict(obj))
    _set(new, _suspend_path(kind), True)
    return new


# --- Jobs silod creates for REST submissions ---------------------------------------------------

RESTRICTED_CONTAINER_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


@dataclass(frozen=True, slots=True)
class PodTemplate:
    """What a REST caller may say about the pods of its job (nothing that grants privilege)."""

    image: str
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None
    cpu: str | None = None
    memory: str | None = None
    pods: int = 1
    data_path: str = "/data"
    run_as_user: int = 1000
    # Scheduling fields, as in a pod spec (JSON as the API server takes it); checked by
    # admission_problems, the webhook's check, before the Job is created.
    tolerations: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, str] | None = None
    affinity: Mapping[str, Any] | None = None
    resources: Mapping[str, Mapping[str, str]] | None = None  # {"requests": {...}, "limits": {...}}


def rest_job_object(*, job_id: str, name: str, namespace: str, queue: str, gpus: int, dataset: str,
                    template: PodTemplate, service_account: str | None = None) -> dict[str, Any]:
    """The batch/v1 Job silod creates for `POST /v1/jobs` with a pod template: created suspended,
    labelled and named by silod (`silod-<id>`), pods that pass Pod Security "restricted", the
    dataset mounted read-only through the silod CSI driver."""
    if gpus % template.pods:
        raise WorkloadError(f"gpus = {gpus} does not split evenly over pod_template.pods = {template.pods}")
    per_pod = gpus // template.pods
    resources: dict[str, dict[str, str]] = {"requests": {}, "limits": {}}
    for part in ("requests", "limits"):
        given = dict((template.resources or {}).get(part) or {})
        if GPU_RESOURCE in given and str(given[GPU_RESOURCE]) != str(per_pod):
            raise WorkloadError(f"pod_template.resources.{part}[{GPU_RESOURCE}] = {given[GPU_RESOURCE]!r}: silod sets it"
                                f" from gpus / pods ({per_pod}); leave it out")
        resources[part].update(given)
    if per_pod:
        resources["requests"][GPU_RESOURCE] = resources["limits"][GPU_RESOURCE] = str(per_pod)
    if template.cpu:
        resources["requests"]["cpu"] = template.cpu
    if template.memory:
        resources["requests"]["memory"] = resources["limits"]["memory"] = template.memory
    container: dict[str, Any] = {
        "name": "train", "image": template.image, "resources": {k: v for k, v in resources.items() if v},
        "securityContext": copy.deepcopy(RESTRICTED_CONTAINER_CONTEXT),
        # HostToContainer: the pod keeps its data across node agent restarts (propagation_patch).
        "volumeMounts": [{"name": "dataset", "mountPath": template.data_path, "readOnly": True,
                          "mountPropagation": PROPAGATION}],
        "env": [{"name": "SILOD_JOB_ID", "value": job_id}, {"name": "SILOD_DATA", "value": template.data_path},
                *({"name": k, "value": v} for k, v in sorted((template.env or {}).items())),
                # The step reporter's server and token, from the report Secret silod writes when
                # it admits the Job (unless the template sets them itself).
                *report_env(report_secret_name(JOB, f"silod-{job_id}"), skip=["SILOD_JOB_ID", *(template.env or {})])],
    }
    if template.command:
        container["command"] = list(template.command)
    if template.args:
        container["args"] = list(template.args)
    labels = {QUEUE_LABEL: queue, JOB_ID_LABEL: job_id, MANAGED_BY_LABEL: MANAGED_BY}
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "securityContext": {"runAsNonRoot": True, "runAsUser": template.run_as_user,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "dataset", "csi": {"driver": CSI_DRIVER, "readOnly": True,
                                                "volumeAttributes": {"dataset": dataset}}}],
    }
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    if template.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in template.tolerations]
    if template.node_selector:
        pod_spec["nodeSelector"] = dict(template.node_selector)
    if template.affinity:
        pod_spec["affinity"] = copy.deepcopy(dict(template.affinity))
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": f"silod-{job_id}", "namespace": namespace, "labels": labels,
                     "annotations": {PREFIX + "job-name": name}},
        "spec": {
            "suspend": True, "parallelism": template.pods, "completions": template.pods,
            "completionMode": "Indexed", "backoffLimit": 0,
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
        },
    }
