"""An EMULATED Kubernetes API server (plus the controllers silod relies on) on 127.0.0.1.

Kept where it is faster or reaches further than the real control plane of tests/k8s_testenv.py
(which tests/test_kubernetes_real.py runs: etcd, "kube-apiserver v1.24.0-alpha snapshot", the
upstream Job controller and kube-scheduler): it starts in milliseconds per test, and it plays
what no binary here does (a kubelet calling the node agent's CSI socket for every pod, pods'
cgroups, JobSet/PyTorchJob CRDs, watch-history edge cases). It is a test double, and it says so.
The behaviour it models is that of Kubernetes 1.24 through 1.35 for the objects silod uses; where
a behaviour was checked against the real snapshot the docstring says so. It drives the real
`kubernetes` Python client (HTTP, JSON, watch streams) and enforces what the real API does, so
that the backend cannot pass by relying on something a cluster would refuse:

- REST verbs: list/get/create/replace/merge-patch/JSON-patch/delete, `status` subresources,
  404/409/422 Status bodies as the API server sends them; `generateName`; uids;
  creationTimestamp.
- resourceVersion: one cluster-wide counter; an update or patch carrying a stale
  `metadata.resourceVersion` is refused with 409 Conflict ("the object has been modified").
- label selectors (`=`, `==`, `!=`, `in`, `notin`, exists, `!key`) and the field selectors
  `metadata.name`, `metadata.namespace`, `spec.nodeName`, `status.phase`, on lists and watches.
- watches: ADDED/MODIFIED/DELETED events in resourceVersion order, resumable from a
  resourceVersion (410 Gone when it is older than the kept history), `timeoutSeconds`.
- batch/v1 Job semantics: defaulting (parallelism, completions, backoffLimit, selector and
  controller-uid/job-name labels); the pod template is immutable except its scheduling directives
  (nodeSelector, affinity, tolerations, schedulingGates, labels, annotations), and those only
  while the Job is suspended and has not started (status.startTime unset); a Job controller
  that creates pods when the Job runs, deletes its active pods when it is suspended and KEEPS
  status.startTime then (as the real Job controller does through Kubernetes 1.35, checked
  against the v1.24 snapshot; 1.36 clears it on suspend), so whoever changes a suspended Job's
  placement must clear startTime through the status subresource first (silod does, as Kueue),
  counts succeeded/failed pods, and sets Complete or Failed (backoffLimit).
- mutating admission webhooks: MutatingWebhookConfiguration objects are honoured on CREATE
  (rules, objectSelector, failurePolicy, timeoutSeconds): the emulator sends a real
  AdmissionReview v1 over HTTPS to the webhook Service (`webhook_services` maps a Service to an
  address; the server certificate is verified against caBundle for `<svc>.<ns>.svc`, and the
  emulator presents `webhook_client_cert` when set), applies the returned JSONPatch, and fails
  the create on a denial or error unless failurePolicy is Ignore; the same on UPDATE (replace and
  patch, not status), with oldObject. userInfo.username is the user of the request's bearer token
  (`users`; none: system:anonymous), or `acting_user` for a test's direct calls.
  namespaceSelector, reinvocation and validating webhooks are not emulated.
- Pod Security admission: pods in a namespace labelled `pod-security.kubernetes.io/enforce`
  = baseline|restricted are refused (403) when they break that level (privileged, host
  namespaces and ports, hostPath, added capabilities; for restricted also volume types,
  allowPrivilegeEscalation, runAsNonRoot, runAsUser 0, seccompProfile, dropping ALL
  capabilities). The Job controller's pod creation goes through it (FailedCreate Event).
- a default scheduler (nodeSelector, required node affinity, unschedulable nodes,
  `nvidia.com/gpu` allocatable minus what bound pods hold) and a kubelet per node that, for
  each CSI volume of driver silod.io, calls the node agent's real CSI Node service over its real
  unix socket (NodePublishVolume before the pod runs, NodeUnpublishVolume when it ends or is
  deleted), with the volume context kubelet sends (pod name, namespace, uid, ephemeral).

- the container runtime's cgroup placement, when a test runs a pod's "container" with
  `run_in_pod`: the process runs in `/sys/fs/cgroup/pids/kubepods/pod<uid>` (kubelet's cgroupfs
  layout), so the node agent's FUSE mounts attribute its reads to the pod as on a real node.

NOT emulated: containers (a test plays the container: it reads the published volume, directly
or through `run_in_pod`, and then sets the pod's phase with `finish_pod`), the JobSet and training-operator controllers (their
CRDs can be "installed" so that silod's admission of those objects is exercised, but nothing
creates their pods), RBAC and authentication (beyond the `users` token map admission reviews use), strategic-merge-patch list semantics (treated as
JSON merge patch), garbage collection other than a Job's pods, graceful deletion.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp.web

GPU = "nvidia.com/gpu"
CSI_DRIVER = "silod.io"


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


CORE = [
    Resource("", "v1", "namespaces", "Namespace", False),
    Resource("", "v1", "nodes", "Node", False),
    Resource("", "v1", "pods", "Pod", True),
    Resource("", "v1", "events", "Event", True),
    Resource("", "v1", "secrets", "Secret", True),
    Resource("batch", "v1", "jobs", "Job", True),
    Resource("scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", False),
    Resource("coordination.k8s.io", "v1", "leases", "Lease", True),
    Resource("admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations", "MutatingWebhookConfiguration",
             False),
]
JOBSET = Resource("jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet", True)
PYTORCHJOB = Resource("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob", True)


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def response(self) -> aiohttp.web.Response:
        return aiohttp.web.json_response(
            {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message,
             "reason": self.reason, "code": self.code}, status=self.code)


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(conds: list[dict[str, Any]], kind: str, status: str, reason: str) -> dict[str, Any]:
    """The condition as the real Job controller writes it: an unchanged condition keeps its
    lastTransitionTime, so a settled Job's status is not rewritten every second (a rewrite
    each tick made silod's own status and spec writes race it with 409s, which the real
    control plane does not do)."""
    for c in conds:
        if c["type"] == kind and c["status"] == status:
            return c
    return {"type": kind, "status": status, "reason": reason, "lastTransitionTime": now_iso()}


# --- selectors -------------------------------------------------------------------------------

def parse_label_selector(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """`a=b,c!=d,e in (x,y),f notin (z),g,!h` -> [(key, op, values)]."""
    out = []
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    for raw in parts:
        p = raw.strip()
        m = re.match(r"^(\S+)\s+(in|notin)\s+\((.*)\)$", p)
        if m:
            values = tuple(v.strip() for v in m.group(3).split(",") if v.strip())
            out.append((m.group(1), m.group(2), values))
        elif "!=" in p:
            k, v = p.split("!=", 1)
            out.append((k.strip(), "!=", (v.strip(),)))
        elif "==" in p or "=" in p:
            k, v = p.split("==", 1) if "==" in p else p.split("=", 1)
            out.append((k.strip(), "=", (v.strip(),)))
        elif p.startswith("!"):
            out.append((p[1:].strip(), "!exists", ()))
        else:
            out.append((p, "exists", ()))
    return out


def labels_match(labels: Mapping[str, str], selector: list[tuple[str, str, tuple[str, ...]]]) -> bool:
    for key, op, values in selector:
        have = labels.get(key)
        if op == "=" and have != values[0]:
            return False
        if op == "!=" and have == values[0]:
            return False
        if op == "in" and have not in values:
            return False
        if op == "notin" and have in values:
            return False
        if op == "exists" and have is None:
            return False
        if op == "!exists" and have is not None:
            return False
    return True


FIELDS: dict[str, Callable[[dict[str, Any]], str]] = {
    "metadata.name": lambda o: o["metadata"].get("name", ""),
    "metadata.namespace": lambda o: o["metadata"].get("namespace", ""),
    "spec.nodeName": lambda o: (o.get("spec") or {}).get("nodeName") or "",
    "status.phase": lambda o: (o.get("status") or {}).get("phase") or "",
    "spec.schedulerName": lambda o: (o.get("spec") or {}).get("schedulerName") or "",
}


def fields_match(obj: dict[str, Any], selector: str) -> bool:
    for part in [p for p in selector.split(",") if p.strip()]:
        neg = "!=" in part
        key, value = part.split("!=" if neg else ("==" if "==" in part else "="), 1)
        key = key.strip()
        if key not in FIELDS:
            raise ApiError(400, "BadRequest", f'"{key}" is not a known field selector')
        if (FIELDS[key](obj) == value.strip()) == neg:
            return False
    return True


# --- patches ---------------------------------------------------------------------------------

def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def json_patch(target: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 add/replace/remove/test (what clients send in practice)."""
    doc = copy.deepcopy(target)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        kind = op["op"]
        if kind == "test":
            have = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if have != op["value"]:
                raise ApiError(422, "Invalid", f"test operation failed at {op['path']}")
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                idx = len(parent) if last == "-" else int(last)
                if kind == "add":
                    parent.insert(idx, op["value"])
                else:
                    parent[idx] = op["value"]
            else:
                parent[last] = op["value"]
        elif kind == "remove":
            if isinstance(parent, list):
                parent.pop(int(last))
            else:
                parent.pop(last)
        else:
            raise ApiError(400, "BadRequest", f"unsupported JSON patch op {kind}")
    return doc


# --- Pod Security admission --------------------------------------------------------------------

BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                 "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def pod_security_violations(pod: dict[str, Any], level: str) -> list[str]:
    spec = pod.get("spec") or {}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    psc = spec.get("securityContext") or {}
    out: list[str] = []
    for c in containers:
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f'privileged (container "{c.get("name")}" must not set securityContext.privileged=true)')
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPS:
            out.append(f'non-default capabilities (container "{c.get("name")}" must not include '
                       f'{sorted(added - BASELINE_CAPS)} in securityContext.capabilities.add)')
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f'hostPort (container "{c.get("name")}" uses hostPort)')
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            out.append(f"host namespaces ({flag}=true)")
    for v in spec.get("volumes") or []:
        if "hostPath" in v:
            out.append(f'hostPath volumes (volume "{v.get("name")}")')
    if level != "restricted":
        return out
    for v in spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if kinds and not kinds <= RESTRICTED_VOLUMES and "hostPath" not in kinds:
            out.append(f'restricted volume types (volume "{v.get("name")}" uses {sorted(kinds)})')
    for c in containers:
        sc = c.get("securityContext") or {}
        name = c.get("name")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f'allowPrivilegeEscalation != false (container "{name}" must set '
                       f"securityContext.allowPrivilegeEscalation=false)")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f'unrestricted capabilities (container "{name}" must set securityContext.capabilities.drop=["ALL"])')
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f'unrestricted capabilities (container "{name}" must not add capabilities)')
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f'runAsNonRoot != true (container "{name}" must set securityContext.runAsNonRoot=true)')
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f'runAsUser=0 (container "{name}" must not set runAsUser=0)')
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f'seccompProfile (container "{name}" must set securityContext.seccompProfile.type to '
                       f'"RuntimeDefault" or "Localhost")')
    return out


# --- the server ------------------------------------------------------------------------------

SCHEDULING_DIRECTIVES = ("nodeSelector", "affinity", "tolerations", "schedulingGates")


@dataclass
class Published:
    node: str
    volume_id: str
    target: Path


@dataclass
class Emulator:
    """State and behaviour. All methods run on the emulator's event loop thread."""

    kubelet_root: Path | None = None  # where kubelets put pod volumes (target paths)
    csi_sockets: dict[str, str] = field(default_factory=dict)  # node -> agent socket path
    history_limit: int = 2000
    resources: dict[tuple[str, str], Resource] = field(default_factory=dict)
    objects: dict[tuple[str, str, str, str], dict[str, Any]] = field(default_factory=dict)
    rv: int = 1
    history: list[tuple[int, tuple[str, str], str, dict[str, Any]]] = field(default_factory=list)
    watchers: list[tuple[tuple[str, str], asyncio.Queue]] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    published: dict[tuple[str, str], Published] = field(default_factory=dict)  # (pod uid, volume) -> where
    csi_calls: list[tuple[str, str, str]] = field(default_factory=list)  # (rpc, node, volume_id)
    failed_mounts: dict[str, str] = field(default_factory=dict)  # pod uid -> last error
    changed: asyncio.Event | None = None
    # Mutating admission: where a webhook Service (namespace, name) answers (the stand-in for the
    # cluster's Service DNS and proxy), and the client certificate (cert, key) the API server
    # presents to webhooks (its AdmissionConfiguration kubeconfig), if any.
    webhook_services: dict[tuple[str, str], tuple[str, int]] = field(default_factory=dict)
    webhook_client_cert: tuple[str, str] | None = None
    webhook_calls: list[tuple[str, str, str, bool]] = field(default_factory=list)  # (webhook, op, object, patched)
    # Authentication, as far as admission needs it: bearer token -> user name for HTTP requests
    # (no token: system:anonymous); direct calls (a test playing kubectl) act as `acting_user`.
    users: dict[str, str] = field(default_factory=dict)
    acting_user: str = "kubectl-user"

    def __post_init__(self) -> None:
        for r in CORE:
            self.resources[(r.group, r.plural)] = r

    def install(self, res: Resource) -> None:
        self.resources[(res.group, res.plural)] = res

    # --- storage -----------------------------------------------------------------------------

    def _key(self, res: Resource, ns: str | None, name: str) -> tuple[str, str, str, str]:
        return (res.group, res.plural, ns or "" if res.namespaced else "", name)

    def _emit(self, res: Resource, kind: str, obj: dict[str, Any]) -> None:
        snap = copy.deepcopy(obj)
        rv = int(obj["metadata"]["resourceVersion"])
        self.history.append((rv, (res.group, res.plural), kind, snap))
        del self.history[: max(len(self.history) - self.history_limit, 0)]
        for key, q in list(self.watchers):
            if key == (res.group, res.plural):
                q.put_nowait((kind, snap))
        if self.changed is not None:
            self.changed.set()

    def _bump(self, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    def get(self, res: Resource, ns: str | None, name: str) -> dict[str, Any]:
        obj = self.objects.get(self._key(res, ns, name))
        if obj is None:
            group = f"{res.plural}.{res.group}" if res.group else res.plural
            raise ApiError(404, "NotFound", f'{group} "{name}" not found')
        return obj

    def list(self, res: Resource, ns: str | None, label_selector: str = "", field_selector: str = "") -> list[dict]:
        sel = parse_label_selector(label_selector) if label_selector else []
        out = []
        for (g, p, ons, _), obj in sorted(self.objects.items()):
            if (g, p) != (res.group, res.plural) or (ns and ons != ns):
                continue
            if sel and not labels_match(obj["metadata"].get("labels") or {}, sel):
                continue
            if field_selector and not fields_match(obj, field_selector):
                continue
            out.append(obj)
        return out

    def create(self, res: Resource, ns: str | None, body: dict[str, Any], *, controller: bool = False) -> dict:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if res.namespaced:
            ns = ns or meta.get("namespace") or "default"
            if meta.get("namespace") not in (None, ns):
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the namespace"
                                                  " sent on the request")
            if (("", "namespaces", "", ns)) not in self.objects:
                raise ApiError(404, "NotFound", f'namespaces "{ns}" not found')
            meta["namespace"] = ns
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", f"{res.kind} is invalid: metadata.name: Required value")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        key = self._key(res, ns, meta["name"])
        if key in self.objects:
            raise ApiError(409, "AlreadyExists", f'{res.plural} "{meta["name"]}" already exists')
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_iso()
        meta["generation"] = 1
        obj = self._mutating_admission(res, "CREATE", obj)
        meta = obj["metadata"]
        if res.kind == "Pod":
            self._admit_pod(obj)
            obj.setdefault("status", {}).setdefault("phase", "Pending")
            obj["spec"].setdefault("schedulerName", "default-scheduler")
        if res.kind == "Job":
            self._default_job(obj)
        self._bump(obj)
        self.objects[key] = obj
        self._emit(res, "ADDED", obj)
        return obj

    def replace(self, res: Resource, ns: str | None, name: str, body: dict[str, Any], *, status: bool = False) -> dict:
        old = self.get(res, ns, name)
        sent_rv = (body.get("metadata") or {}).get("resourceVersion")
        if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
            group = f"{res.plural}.{res.group}" if res.group else res.plural
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {group} "{name}": the object has been'
                                            f" modified; please apply your changes to the latest version and try again")
        new = copy.deepcopy(body)
        if status:  # the status subresource changes status only
            new = {**copy.deepcopy(old), "status": new.get("status") or {}}
        else:
            new["status"] = copy.deepcopy(old.get("status") or {})
            for k in ("uid", "creationTimestamp", "namespace", "name"):
                new.setdefault("metadata", {})[k] = old["metadata"].get(k)
            new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
            new = self._mutating_admission(res, "UPDATE", new, old)
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + (new.get("spec") != old.get("spec"))
            new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
            if res.kind == "Job":
                self._validate_job_update(old, new)
            if res.kind == "Pod":
                self._validate_pod_update(old, new)
        self._bump(new)
        self.objects[self._key(res, ns, name)] = new
        self._emit(res, "MODIFIED", new)
        return new

    def patch(self, res: Resource, ns: str | None, name: str, patch: Any, content_type: str, *,
              status: bool = False) -> dict:
        old = self.get(res, ns, name)
        if "json-patch" in content_type:
            new = json_patch(old, patch)
        else:
            new = merge_patch(old, patch)
        if not isinstance(patch, dict) or not (patch.get("metadata") or {}).get("resourceVersion"):
            new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        return self.replace(res, ns, name, new, status=status)

    def delete(self, res: Resource, ns: str | None, name: str) -> dict:
        obj = self.get(res, ns, name)
        del self.objects[self._key(res, ns, name)]
        self._bump(obj)
        self._emit(res, "DELETED", obj)
        if res.kind == "Job":  # background garbage collection of the Job's pods
            for pod in self._owned_pods(obj):
                self.delete(self.resources[("", "pods")], pod["metadata"]["namespace"], pod["metadata"]["name"])
        return obj

    # --- admission and validation -----------------------------------------------------------

    def _mutating_admission(self, res: Resource, operation: str, obj: dict[str, Any],
                            old: dict[str, Any] | None = None) -> dict[str, Any]:
        """As the API server: every webhook of every MutatingWebhookConfiguration whose rules and
        objectSelector match gets an AdmissionReview v1 over HTTPS (server certificate checked
        against its caBundle, for the Service's DNS name); its JSONPatch is applied; a denial, an
        error or a wrong answer fails the request unless failurePolicy is Ignore."""
        mwc = self.resources[("admissionregistration.k8s.io", "mutatingwebhookconfigurations")]
        for cfg in self.list(mwc, None):
            for wh in cfg.get("webhooks") or []:
                if not webhook_matches(wh, res, operation, obj):
                    continue
                uid = str(uuid.uuid4())
                review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
                    "uid": uid, "kind": {"group": res.group, "version": res.version, "kind": res.kind},
                    "resource": {"group": res.group, "version": res.version, "resource": res.plural},
                    "requestKind": {"group": res.group, "version": res.version, "kind": res.kind},
                    "name": obj["metadata"].get("name", ""), "namespace": obj["metadata"].get("namespace", ""),
                    "operation": operation, "userInfo": {"username": self.acting_user},
                    "object": obj, "oldObject": old, "dryRun": False}}
                name = str(wh.get("name"))
                try:
                    answer = self._call_webhook(wh, review)
                    resp = answer.get("response") or {}
                    if answer.get("apiVersion") != "admission.k8s.io/v1" or resp.get("uid") != uid:
                        raise ValueError("expected response.uid to match the request and apiVersion admission.k8s.io/v1")
                    if not resp.get("allowed"):
                        status = resp.get("status") or {}
                        raise ApiError(int(status.get("code") or 400), "BadRequest",
                                       f'admission webhook "{name}" denied the request: {status.get("message", "")}')
                    patched = False
                    if resp.get("patch"):
                        if resp.get("patchType") != "JSONPatch":
                            raise ValueError(f"unsupported patchType {resp.get('patchType')!r}")
                        import base64

                        obj = json_patch(obj, json.loads(base64.b64decode(resp["patch"])))
                        patched = True
                    self.webhook_calls.append((name, operation, f"{res.kind}/{obj['metadata'].get('name')}", patched))
                except ApiError:
                    raise
                except Exception as exc:  # noqa: BLE001 - as the API server: the failure policy decides
                    self.webhook_calls.append((name, operation, f"{res.kind}/{obj['metadata'].get('name')}", False))
                    if wh.get("failurePolicy", "Fail") == "Ignore":
                        continue
                    raise ApiError(500, "InternalError",
                                   f'Internal error occurred: failed calling webhook "{name}": {exc}') from None
        return obj

    def _call_webhook(self, wh: dict[str, Any], review: dict[str, Any]) -> dict[str, Any]:
        import base64
        import http.client
        import socket
        import ssl

        cc = wh.get("clientConfig") or {}
        svc = cc.get("service")
        if not svc:
            raise ValueError("only clientConfig.service is emulated")
        addr = self.webhook_services.get((svc.get("namespace"), svc.get("name")))
        if addr is None:
            raise ValueError(f"service {svc.get('namespace')}/{svc.get('name')} has no endpoints")
        ctx = ssl.create_default_context(cadata=base64.b64decode(cc.get("caBundle") or "").decode() or None)
        if self.webhook_client_cert:
            ctx.load_cert_chain(*self.webhook_client_cert)
        host = f"{svc['name']}.{svc['namespace']}.svc"  # the name the serving certificate must carry
        conn = http.client.HTTPSConnection(host, int(svc.get("port", 443)), context=ctx,
                                           timeout=float(wh.get("timeoutSeconds", 10)))
        conn._create_connection = lambda _addr, timeout=None, source=None: socket.create_connection(addr, timeout)  # type: ignore[attr-defined]
        try:
            conn.request("POST", svc.get("path") or "/", body=json.dumps(review).encode(),
                         headers={"Content-Type": "application/json", "Accept": "application/json"})
            r = conn.getresponse()
            body = r.read(4 << 20)
            if r.status != 200:
                raise ValueError(f"the server responded with HTTP {r.status}: {body[:200]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def _admit_pod(self, pod: dict[str, Any]) -> None:
        ns = self.objects.get(("", "namespaces", "", pod["metadata"]["namespace"])) or {}
        level = (ns.get("metadata", {}).get("labels") or {}).get("pod-security.kubernetes.io/enforce")
        if level in ("baseline", "restricted"):
            problems = pod_security_violations(pod, level)
            if problems:
                raise ApiError(403, "Forbidden", f'pods "{pod["metadata"]["name"]}" is forbidden: violates PodSecurity'
                                                 f' "{level}:latest": ' + ", ".join(problems))

    @staticmethod
    def _default_job(job: dict[str, Any]) -> None:
        spec = job.setdefault("spec", {})
        spec.setdefault("parallelism", 1)
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("suspend", False)
        spec.setdefault("completionMode", "NonIndexed")
        uid = job["metadata"]["uid"]
        labels = {"batch.kubernetes.io/controller-uid": uid, "batch.kubernetes.io/job-name": job["metadata"]["name"],
                  "controller-uid": uid, "job-name": job["metadata"]["name"]}
        spec.setdefault("selector", {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}})
        tmeta = spec.setdefault("template", {}).setdefault("metadata", {})
        tmeta["labels"] = {**(tmeta.get("labels") or {}), **labels}
        tspec = spec["template"].get("spec") or {}
        if tspec.get("restartPolicy") not in ("Never", "OnFailure"):
            raise ApiError(422, "Invalid", f'Job.batch "{job["metadata"]["name"]}" is invalid: spec.template.spec.'
                                           f'restartPolicy: Required value: valid values: "OnFailure", "Never"')

    @staticmethod
    def _validate_job_update(old: dict[str, Any], new: dict[str, Any]) -> None:
        name = old["metadata"]["name"]
        ot, nt = old["spec"].get("template") or {}, new["spec"].get("template") or {}
        if ot == nt:
            return

        def core(t: dict[str, Any]) -> dict[str, Any]:
            t = copy.deepcopy(t)
            t.get("metadata", {}).pop("labels", None)
            t.get("metadata", {}).pop("annotations", None)
            for k in SCHEDULING_DIRECTIVES:
                t.get("spec", {}).pop(k, None)
            return t

        if core(ot) != core(nt):
            raise ApiError(422, "Invalid", f'Job.batch "{name}" is invalid: spec.template: Invalid value: field is'
                                           f" immutable")
        if not (old["spec"].get("suspend") and not (old.get("status") or {}).get("startTime")):
            raise ApiError(422, "Invalid", f'Job.batch "{name}" is invalid: spec.template: Invalid value: the pod'
                                           f" template's scheduling directives may change only while the Job is"
                                           f" suspended and has not started")

    @staticmethod
    def _validate_pod_update(old: dict[str, Any], new: dict[str, Any]) -> None:
        # Pod specs are immutable except a few fields (image, activeDeadlineSeconds, tolerations).
        o, n = copy.deepcopy(old.get("spec") or {}), copy.deepcopy(new.get("spec") or {})
        for s in (o, n):
            s.pop("tolerations", None)
            s.pop("activeDeadlineSeconds", None)
            for c in s.get("containers") or []:
                c.pop("image", None)
        bound_now = {**o, **({"nodeName": n["nodeName"]} if n.get("nodeName") else {})}  # binding sets nodeName once
        if (o != n) if o.get("nodeName") else (bound_now != n):
            raise ApiError(422, "Invalid", f'Pod "{old["metadata"]["name"]}" is invalid: spec: Forbidden: pod updates'
                                           f" may not change fields other than image, activeDeadlineSeconds,"
                                           f" tolerations")

    # --- controllers ------------------------------------------------------------------------

    def _owned_pods(self, owner: dict[str, Any]) -> list[dict[str, Any]]:
        uid = owner["metadata"]["uid"]
        return [o for (g, p, _, _), o in list(self.objects.items()) if (g, p) == ("", "pods")
                and any(r.get("uid") == uid and r.get("controller") for r in o["metadata"].get("ownerReferences") or [])]

    def event(self, ns: str, kind: str, name: str, reason: str, message: str, warning: bool = True) -> None:
        res = self.resources[("", "events")]
        evt = {"metadata": {"generateName": f"{name}.", "namespace": ns},
               "involvedObject": {"kind": kind, "name": name, "namespace": ns}, "reason": reason,
               "message": message, "type": "Warning" if warning else "Normal"}
        if not any(o.get("reason") == reason and o.get("message") == message and o["involvedObject"]["name"] == name
                   for o in self.list(res, ns)):
            self.create(res, ns, evt)

    def reconcile_jobs(self) -> None:
        jobs = self.resources[("batch", "jobs")]
        pods = self.resources[("", "pods")]
        for job in [copy.deepcopy(o) for o in self.list(jobs, None)]:
            spec, status = job["spec"], copy.deepcopy(job.get("status") or {})
            conds = status.get("conditions") or []
            if any(c["type"] in ("Complete", "Failed") and c["status"] == "True" for c in conds):
                continue
            owned = self._owned_pods(job)
            active = [p for p in owned if p["status"].get("phase") not in ("Succeeded", "Failed")]
            succeeded = sum(p["status"].get("phase") == "Succeeded" for p in owned)
            failed = sum(p["status"].get("phase") == "Failed" for p in owned)
            completions = spec.get("completions") or spec.get("parallelism") or 1
            new_conds = [c for c in conds if c["type"] != "Suspended"]
            if spec.get("suspend"):
                for p in active:  # the Job controller, not silod, removes a suspended Job's pods
                    self.delete(pods, p["metadata"]["namespace"], p["metadata"]["name"])
                active = []
                # startTime stays (Kubernetes <= 1.35; see the module docstring).
                new_conds.append(_condition(conds, "Suspended", "True", "JobSuspended"))
            else:
                status.setdefault("startTime", now_iso())
                if any(c["type"] == "Suspended" for c in conds):
                    new_conds.append(_condition(conds, "Suspended", "False", "JobResumed"))
                if failed > spec.get("backoffLimit", 6):
                    for p in active:
                        self.delete(pods, p["metadata"]["namespace"], p["metadata"]["name"])
                    active = []
                    new_conds.append({"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                      "message": "Job has reached the specified backoff limit"})
                elif succeeded >= completions:
                    new_conds.append({"type": "Complete", "status": "True", "reason": "CompletionsReached",
                                      "message": "Reached expected number of succeeded pods"})
                    status["completionTime"] = now_iso()
                else:
                    want = min(spec.get("parallelism", 1), completions - succeeded) - len(active)
                    for _ in range(max(want, 0)):
                        if not self._create_job_pod(job):
                            break
                    active = [p for p in self._owned_pods(job) if p["status"].get("phase") not in ("Succeeded", "Failed")]
            status.update(active=len(active), succeeded=succeeded, failed=failed, conditions=new_conds)
            if status != (job.get("status") or {}):
                self.replace(jobs, job["metadata"]["namespace"], job["metadata"]["name"],
                             {**job, "status": status}, status=True)

    def _create_job_pod(self, job: dict[str, Any]) -> bool:
        t = copy.deepcopy(job["spec"]["template"])
        name = job["metadata"]["name"]
        pod = {"metadata": {"generateName": f"{name}-", "labels": t.get("metadata", {}).get("labels") or {},
                            "annotations": t.get("metadata", {}).get("annotations") or {},
                            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                                 "uid": job["metadata"]["uid"], "controller": True,
                                                 "blockOwnerDeletion": True}]},
               "spec": t.get("spec") or {}}
        try:
            self.create(self.resources[("", "pods")], job["metadata"]["namespace"], pod, controller=True)
            return True
        except ApiError as exc:
            self.event(job["metadata"]["namespace"], "Job", name, "FailedCreate", f"Error creating: {exc.message}")
            return False

    def schedule_pods(self) -> None:
        pods = self.resources[("", "pods")]
        nodes = self.list(self.resources[("", "nodes")], None)
        for pod in [copy.deepcopy(p) for p in self.list(pods, None)]:
            spec = pod["spec"]
            if spec.get("nodeName") or pod["status"].get("phase") != "Pending":
                continue
            if spec.get("schedulerName", "default-scheduler") != "default-scheduler":
                continue
            want = pod_gpus(spec)
            choice = None
            for node in nodes:
                if node.get("spec", {}).get("unschedulable") or not node_matches(pod, node):
                    continue
                alloc = int(str((node.get("status") or {}).get("allocatable", {}).get(GPU, "0")))
                used = sum(pod_gpus(p["spec"]) for p in self.list(pods, None)
                           if p["spec"].get("nodeName") == node["metadata"]["name"]
                           and p["status"].get("phase") not in ("Succeeded", "Failed"))
                if alloc - used >= want:
                    choice = node["metadata"]["name"]
                    break
            if choice is None:
                cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
                if cond not in (pod["status"].get("conditions") or []):
                    pod["status"]["conditions"] = [cond]
                    self.replace(pods, pod["metadata"]["namespace"], pod["metadata"]["name"], pod, status=True)
                continue
            pod["spec"]["nodeName"] = choice
            pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "True"}]
            self.replace(pods, pod["metadata"]["namespace"], pod["metadata"]["name"], pod)

    def kubelet_work(self) -> tuple[list[tuple[dict[str, Any], str, dict[str, Any]]], list[Published]]:
        """Volumes to publish (pod, volume name, csi source) and to unpublish."""
        pods = {p["metadata"]["uid"]: p for p in self.list(self.resources[("", "pods")], None)}
        publish = []
        for pod in pods.values():
            if not pod["spec"].get("nodeName") or pod["status"].get("phase") != "Pending":
                continue
            for v in pod["spec"].get("volumes") or []:
                csi = v.get("csi")
                if csi and csi.get("driver") == CSI_DRIVER and (pod["metadata"]["uid"], v["name"]) not in self.published:
                    publish.append((copy.deepcopy(pod), v["name"], copy.deepcopy(csi)))
        unpublish = [pub for (uid, _), pub in self.published.items()
                     if uid not in pods or pods[uid]["status"].get("phase") in ("Succeeded", "Failed")]
        return publish, unpublish

    def start_ready_pods(self) -> None:
        """Pods whose volumes are all published run (the containers are the test's business)."""
        pods = self.resources[("", "pods")]
        for pod in [copy.deepcopy(p) for p in self.list(pods, None)]:
            if not pod["spec"].get("nodeName") or pod["status"].get("phase") != "Pending":
                continue
            need = [v["name"] for v in pod["spec"].get("volumes") or []
                    if (v.get("csi") or {}).get("driver") == CSI_DRIVER]
            if all((pod["metadata"]["uid"], n) in self.published for n in need):
                pod["status"]["phase"] = "Running"
                pod["status"]["startTime"] = now_iso()
                self.replace(pods, pod["metadata"]["namespace"], pod["metadata"]["name"], pod, status=True)


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A metav1.LabelSelector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist)."""
    if not selector:
        return True
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def webhook_matches(wh: Mapping[str, Any], res: Resource, operation: str, obj: Mapping[str, Any]) -> bool:
    def has(values: Any, value: str) -> bool:
        return "*" in (values or []) or value in (values or [])
    if not selector_matches(wh.get("objectSelector"), (obj.get("metadata") or {}).get("labels") or {}):
        return False
    return any(has(r.get("apiGroups"), res.group) and has(r.get("apiVersions"), res.version)
               and has(r.get("resources"), res.plural) and has(r.get("operations"), operation)
               for r in wh.get("rules") or [])


def pod_gpus(spec: Mapping[str, Any]) -> int:
    total = 0
    for c in spec.get("containers") or []:
        res = c.get("resources") or {}
        total += int(str((res.get("requests") or res.get("limits") or {}).get(GPU, "0")))
    return total


def node_matches(pod: dict[str, Any], node: dict[str, Any]) -> bool:
    labels = node["metadata"].get("labels") or {}
    spec = pod["spec"]
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    req = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
           .get("requiredDuringSchedulingIgnoredDuringExecution"))
    if not req:
        return True
    for term in req.get("nodeSelectorTerms") or []:  # terms are ORed, expressions ANDed
        ok = True
        for e in term.get("matchExpressions") or []:
            have = labels.get(e["key"])
            op = e["operator"]
            if (op == "In" and have not in e.get("values", [])) or (op == "NotIn" and have in e.get("values", [])) \
                    or (op == "Exists" and have is None) or (op == "DoesNotExist" and have is not None):
                ok = False
        if ok:
            return True
    return False


# --- HTTP --------------------------------------------------------------------------------------

class Server:
    def __init__(self, em: Emulator):
        self.em = em
        self.lock = asyncio.Lock()

    def route(self, path: str) -> tuple[Resource, str | None, str | None, str | None]:
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        ns = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            ns, rest = rest[1], rest[2:]
        if not rest:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        res = self.em.resources.get((group, rest[0]))
        if res is None or res.version != version:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if sub not in (None, "status"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return res, ns, name, sub

    async def handle(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        self.em.requests.append((request.method, request.path))
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        user = self.em.users.get(token.strip(), "system:anonymous") if scheme.lower() == "bearer" else "system:anonymous"
        try:
            res, ns, name, sub = self.route(request.path)
            q = request.query
            if request.method == "GET" and name is None:
                if q.get("watch") in ("true", "1"):
                    return await self.watch(request, res, ns)
                async with self.lock:
                    items = self.em.list(res, ns, q.get("labelSelector", ""), q.get("fieldSelector", ""))
                    body = {"apiVersion": res.api_version, "kind": f"{res.kind}List",
                            "metadata": {"resourceVersion": str(self.em.rv)}, "items": copy.deepcopy(items)}
                return aiohttp.web.json_response(body)
            data = await request.json() if request.can_read_body and request.method != "GET" else None
            async with self.lock:
                with self._as(user):
                    if request.method == "GET":
                        return aiohttp.web.json_response(self.em.get(res, ns, name))
                    if request.method == "POST" and name is None:
                        return aiohttp.web.json_response(self.em.create(res, ns, data or {}), status=201)
                    if request.method == "PUT" and name:
                        return aiohttp.web.json_response(self.em.replace(res, ns, name, data or {}, status=sub == "status"))
                    if request.method == "PATCH" and name:
                        return aiohttp.web.json_response(self.em.patch(res, ns, name, data, request.content_type,
                                                                       status=sub == "status"))
                    if request.method == "DELETE" and name:
                        return aiohttp.web.json_response(self.em.delete(res, ns, name))
            raise ApiError(405, "MethodNotAllowed", f"{request.method} is not supported here")
        except ApiError as exc:
            return exc.response()

    @contextmanager
    def _as(self, user: str) -> Iterator[None]:
        """Admission sees the request's user (under the lock, so no other request interleaves)."""
        kubectl, self.em.acting_user = self.em.acting_user, user
        try:
            yield
        finally:
            self.em.acting_user = kubectl

    async def watch(self, request: aiohttp.web.Request, res: Resource, ns: str | None) -> aiohttp.web.StreamResponse:
        q = request.query
        sel = parse_label_selector(q.get("labelSelector", "")) if q.get("labelSelector") else []
        fsel = q.get("fieldSelector", "")
        timeout = float(q.get("timeoutSeconds") or 300)
        queue: asyncio.Queue = asyncio.Queue()
        resp = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)

        def wanted(obj: dict[str, Any]) -> bool:
            if ns and obj["metadata"].get("namespace") != ns:
                return False
            if sel and not labels_match(obj["metadata"].get("labels") or {}, sel):
                return False
            return not fsel or fields_match(obj, fsel)

        async with self.lock:
            since = q.get("resourceVersion")
            backlog: list[tuple[str, dict[str, Any]]] = []
            if since and since != "0":
                oldest = self.em.history[0][0] if self.em.history else self.em.rv + 1
                if int(since) < oldest - 1:
                    err = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                       "code": 410, "reason": "Expired",
                                                       "message": f"too old resource version: {since}"}}
                    await resp.write((json.dumps(err) + "\n").encode())
                    return resp
                backlog = [(k, o) for rv, key, k, o in self.em.history
                           if key == (res.group, res.plural) and rv > int(since)]
            else:
                backlog = [("ADDED", copy.deepcopy(o)) for o in self.em.list(res, ns)]
            entry = ((res.group, res.plural), queue)
            self.em.watchers.append(entry)
        try:
            for kind, obj in backlog:
                if wanted(obj):
                    await resp.write((json.dumps({"type": kind, "object": obj}) + "\n").encode())
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    kind, obj = await asyncio.wait_for(queue.get(), timeout=left)
                except TimeoutError:
                    break
                if wanted(obj):
                    await resp.write((json.dumps({"type": kind, "object": obj}) + "\n").encode())
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.em.watchers.remove(entry)
        return resp


class EmulatedCluster:
    """Starts the emulator on 127.0.0.1 in a background thread (the official client is
    synchronous), runs its controllers, and gives API clients pointed at it."""

    def __init__(self, *, kubelet_root: Path | None = None, csi_sockets: Mapping[str, str] | None = None,
                 crds: tuple[Resource, ...] = ()):
        self.em = Emulator(kubelet_root=kubelet_root, csi_sockets=dict(csi_sockets or {}))
        for crd in crds:
            self.em.install(crd)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="k8s-emulator", daemon=True)
        self.server = Server(self.em)
        self.url = ""
        self._runner: aiohttp.web.AppRunner | None = None
        self._controllers: asyncio.Task | None = None
        self._clients: list[Any] = []
        self.controller_errors: list[str] = []  # tests assert it stays empty
        self._stopping = False
        self.paused = threading.Event()  # set: controllers stop (to look at an intermediate state)

    def __enter__(self) -> EmulatedCluster:
        self._thread.start()

        async def up() -> str:
            app = aiohttp.web.Application(client_max_size=8 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", self.server.handle)
            # Open watch streams end at shutdown; do not wait a minute for them.
            self._runner = aiohttp.web.AppRunner(app, shutdown_timeout=3.0)
            await self._runner.setup()
            site = aiohttp.web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.em.changed = asyncio.Event()
            self._controllers = asyncio.ensure_future(self._control_loop())
            return f"http://127.0.0.1:{port}"

        self.url = asyncio.run_coroutine_threadsafe(up(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        for c in self._clients:
            c.close()

        async def down() -> None:
            if self._controllers:
                self._stopping = True
                self._controllers.cancel()
                # A pass blocked in a CSI call (an executor thread) cannot be interrupted: do not
                # wait for it longer than this.
                await asyncio.wait({self._controllers}, timeout=2.0)
            if self._runner:
                await self._runner.cleanup()

        try:
            asyncio.run_coroutine_threadsafe(down(), self._loop).result(60)  # generous: shared CI machines
            # Volumes still published when the cluster goes away are unpublished, like a drained node.
            for pub in list(self.em.published.values()):
                self._csi_unpublish(pub)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    async def _control_loop(self) -> None:
        assert self.em.changed is not None
        # A flag as well as cancel(): Python 3.11's wait_for can swallow a cancellation.
        while not self._stopping:
            try:
                await asyncio.wait_for(self.em.changed.wait(), timeout=0.2)
            except TimeoutError:
                pass
            self.em.changed.clear()
            if self.paused.is_set():
                continue
            try:
                await self._control_pass()
            except Exception as exc:  # noqa: BLE001 - a controller bug must show, not stop the loop
                self.controller_errors.append(repr(exc))

    async def _control_pass(self) -> None:
        async with self.server.lock:
            self.em.reconcile_jobs()
            self.em.schedule_pods()
            publish, unpublish = self.em.kubelet_work()
        for pub in unpublish:
            await self._loop.run_in_executor(None, self._csi_unpublish, pub)
        for pod, vol, csi in publish:
            await self._loop.run_in_executor(None, self._csi_publish, pod, vol, csi)
        async with self.server.lock:
            self.em.start_ready_pods()

    # --- the kubelet's CSI client (the real agent over its real unix socket) ------------------

    def _stub(self, node: str) -> Any:
        sock = self.em.csi_sockets.get(node)
        if not sock:
            return None
        import grpc

        from fuse_client.agent.csi import csi_pb2_grpc
        channel = grpc.insecure_channel(f"unix://{sock}")
        return channel, csi_pb2_grpc.NodeStub(channel)

    def _csi_publish(self, pod: dict[str, Any], vol: str, csi: dict[str, Any]) -> None:
        node = pod["spec"]["nodeName"]
        uid = pod["metadata"]["uid"]
        got = self._stub(node)
        if got is None or self.em.kubelet_root is None:
            # As kubelet: the pod stays ContainerCreating (FailedMount) until a driver registers.
            self.em.failed_mounts[uid] = f"driver name {CSI_DRIVER} not found in the list of registered CSI drivers"
            return
        from fuse_client.agent.csi import csi_pb2
        channel, stub = got
        # kubelet's volume id for an inline ephemeral volume: csi-<sha256(pod uid, volume)>.
        volume_id = "csi-" + hashlib.sha256(f"{uid}/{vol}".encode()).hexdigest()[:40]
        target = self.em.kubelet_root / node / "pods" / uid / "volumes" / "kubernetes.io~csi" / vol / "mount"
        target.parent.mkdir(parents=True, exist_ok=True)
        context = {**(csi.get("volumeAttributes") or {}), "csi.storage.k8s.io/pod.name": pod["metadata"]["name"],
                   "csi.storage.k8s.io/pod.namespace": pod["metadata"]["namespace"],
                   "csi.storage.k8s.io/pod.uid": uid,
                   "csi.storage.k8s.io/serviceAccount.name": pod["spec"].get("serviceAccountName") or "default",
                   "csi.storage.k8s.io/ephemeral": "true"}
        cap = csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(),
                                       access_mode=csi_pb2.VolumeCapability.AccessMode(mode=2))
        try:
            stub.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
                volume_id=volume_id, target_path=str(target), volume_capability=cap,
                readonly=bool(csi.get("readOnly")), volume_context=context), timeout=60)
            self.em.csi_calls.append(("NodePublishVolume", node, volume_id))
            self.em.published[(uid, vol)] = Published(node, volume_id, target)
            self.em.failed_mounts.pop(uid, None)
        except Exception as exc:  # noqa: BLE001 - kubelet records FailedMount and retries
            self.em.failed_mounts[uid] = str(exc)
        finally:
            channel.close()

    def _csi_unpublish(self, pub: Published) -> None:
        got = self._stub(pub.node)
        if got is None:
            return
        from fuse_client.agent.csi import csi_pb2
        channel, stub = got
        try:
            stub.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id=pub.volume_id,
                                                                        target_path=str(pub.target)), timeout=60)
            self.em.csi_calls.append(("NodeUnpublishVolume", pub.node, pub.volume_id))
            for key, p in list(self.em.published.items()):
                if p is pub:
                    del self.em.published[key]
        except Exception:  # noqa: BLE001 - retried on the next pass
            pass
        finally:
            channel.close()

    # --- clients ---------------------------------------------------------------------------

    def api_client(self) -> Any:
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        api = client.ApiClient(cfg)
        self._clients.append(api)
        return api

    # --- the test's own view and actions (not through the client) ----------------------------

    def call(self, fn: Callable[[Emulator], Any]) -> Any:
        async def run() -> Any:
            async with self.server.lock:
                out = fn(self.em)
                if self.em.changed:
                    self.em.changed.set()
                return out
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def add_namespace(self, name: str, labels: Mapping[str, str] | None = None) -> None:
        self.call(lambda em: em.create(em.resources[("", "namespaces")], None,
                                       {"metadata": {"name": name, "labels": dict(labels or {})}}))

    def add_node(self, name: str, gpus: int, *, cache: str | None = None, remote_io: str | None = None,
                 labels: Mapping[str, str] | None = None) -> None:
        ann = {}
        if cache:
            ann["silod.io/cache-capacity"] = cache
        if remote_io:
            ann["silod.io/remote-io"] = remote_io
        body = {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                             "annotations": ann},
                "status": {"allocatable": {GPU: str(gpus), "cpu": "32"}, "capacity": {GPU: str(gpus)},
                           "conditions": [{"type": "Ready", "status": "True"}]}}
        self.call(lambda em: em.create(em.resources[("", "nodes")], None, body))

    def objects(self, plural: str, group: str = "", namespace: str | None = None) -> list[dict[str, Any]]:
        return self.call(lambda em: copy.deepcopy(em.list(em.resources[(group, plural)], namespace)))

    def obj(self, plural: str, namespace: str | None, name: str, group: str = "") -> dict[str, Any]:
        return self.call(lambda em: copy.deepcopy(em.get(em.resources[(group, plural)], namespace, name)))

    def pods_of(self, namespace: str, job: str) -> list[dict[str, Any]]:
        return [p for p in self.objects("pods", namespace=namespace)
                if (p["metadata"].get("labels") or {}).get("job-name") == job]

    def finish_pod(self, namespace: str, name: str, phase: str = "Succeeded") -> None:
        """Play the container: it exits (0 -> Succeeded, else Failed)."""
        def run(em: Emulator) -> None:
            res = em.resources[("", "pods")]
            pod = copy.deepcopy(em.get(res, namespace, name))
            pod["status"]["phase"] = phase
            em.replace(res, namespace, name, pod, status=True)
        self.call(run)

    def run_in_pod(self, pod: Mapping[str, Any], argv: list[str], timeout: float = 120.0) -> Any:
        """Run `argv` as a container of `pod` would run: in the pod's cgroup (kubelet's cgroupfs
        layout, `kubepods/pod<uid>`). Returns the CompletedProcess. Needs root and a writable
        cgroup v1 `pids` hierarchy (or cgroup v2 at /sys/fs/cgroup)."""
        import os
        import subprocess

        uid = pod["metadata"]["uid"]
        base = Path("/sys/fs/cgroup/pids") if Path("/sys/fs/cgroup/pids").is_dir() else Path("/sys/fs/cgroup")
        cg = base / "kubepods" / f"pod{uid}"
        try:
            cg.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RuntimeError(f"cannot create the pod's cgroup {cg}: {exc}; run_in_pod needs root and a writable"
                               f" cgroup hierarchy") from None
        procs = str(cg / "cgroup.procs")

        def enter() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        try:
            return subprocess.run(argv, preexec_fn=enter, capture_output=True, text=True, timeout=timeout)
        finally:
            try:
                cg.rmdir()
            except OSError:
                pass

    def volume_path(self, pod: Mapping[str, Any], volume: str) -> Path | None:
        pub = self.em.published.get((pod["metadata"]["uid"], volume))
        return pub.target if pub else None

    def wait(self, predicate: Callable[[], Any], timeout: float = 20.0,
             what: str | Callable[[], str] = "condition") -> Any:
        """Poll `predicate` until truthy; `what` (or what it returns, at the timeout) names it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = predicate()
            if got:
                return got
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what() if callable(what) else what}")


@contextmanager
def emulated_cluster(**kwargs: Any) -> Iterator[EmulatedCluster]:
    with EmulatedCluster(**kwargs) as cluster:
        yield cluster


__all__ = ["JOBSET", "PYTORCHJOB", "EmulatedCluster", "Emulator", "emulated_cluster"]
