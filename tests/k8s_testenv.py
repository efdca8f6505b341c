"""A REAL Kubernetes control plane for tests, on 127.0.0.1 only (like Kueue's envtest suites).

etcd (Debian `etcd-server`) plus, from `../shared/tools/k8s-testenv/` beside the repository
(README.md there; never copied into the repository), the kube-apiserver, `jobctl` (the upstream
Job controller alone) and, for tests that need it, kube-scheduler. They report
"kube-apiserver v1.24.0-alpha snapshot" (Kubernetes master of 2021-12-23): what a test checks
here is checked for that version, and docs/kubernetes-nodes.md says which behaviours newer releases
change. The binaries are decompressed into a scratch directory under the system temp dir (keyed
by their SHA256SUMS), once per machine.

RBAC is on. silod authenticates as its service account (a static token in tokens.csv for the
user `system:serviceaccount:silod-system:silod-scheduler`), so deploy/base's own ClusterRole is
what authorizes it; a test that needs more has found a bug in the manifests. deploy/base is
applied as written except for what the loopback-only rule demands: the admission webhook is
called by `url: https://127.0.0.1:PORT/mutate` (the scheduler's WebhookServer, started here)
rather than through its Service.

No kubelet, no node lifecycle or namespace or garbage-collection controller runs: a test plays
the kubelet (`Kubelet.step`: marks bound pods Running, finishes the deletion of terminating
pods, as kubelet does once the containers are gone) and creates its Node objects itself
(`ControlPlane.add_node`). Under CI=true a missing binary is a failure, not a skip.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
VERSION = "kube-apiserver v1.24.0-alpha snapshot"
SILOD_SA = "system:serviceaccount:silod-system:silod-scheduler"
CSI_SA = "system:serviceaccount:silod-system:silod-csi-controller"
BINARIES = ("kube-apiserver", "jobctl", "kube-scheduler", "csi-sanity", "csi-provisioner")


def _ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def unavailable(why: str) -> None:
    """Skip locally, fail under CI=true (CI promises these tests run)."""
    if _ci():
        pytest.fail(f"{why} (CI=true: the real-control-plane tests must run; .ci/run installs etcd-server)")
    pytest.skip(why)


def testenv_dir() -> Path:
    """`../shared/tools/k8s-testenv` beside the repository, or beside the repository this one was
    cloned from (as tests/test_simulate_cli.py finds ../shared/traces)."""
    candidates = [REPO.parent / "shared" / "tools" / "k8s-testenv"]
    origin = subprocess.run(["git", "-C", str(REPO), "config", "--get", "remote.origin.url"],
                            capture_output=True, text=True)
    url = origin.stdout.strip().removeprefix("file://")
    if origin.returncode == 0 and url.startswith("/"):
        candidates.append(Path(url).resolve().parent / "shared" / "tools" / "k8s-testenv")
    git_common = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--git-common-dir"], capture_output=True, text=True)
    if git_common.returncode == 0 and git_common.stdout.strip():  # a worktree: beside the main checkout
        candidates.append((REPO / git_common.stdout.strip()).resolve().parent.parent / "shared" / "tools" / "k8s-testenv")
    return next((c for c in candidates if (c / "SHA256SUMS").is_file()), candidates[0])


def binary(name: str) -> Path:
    """The decompressed binary `name`, checked against SHA256SUMS (once per machine)."""
    src_dir = testenv_dir()
    sums_file = src_dir / "SHA256SUMS"
    if not sums_file.is_file():
        unavailable(f"{src_dir} is missing: the real-control-plane tests need ../shared/tools/k8s-testenv")
    sums = dict(reversed(line.split()) for line in sums_file.read_text().splitlines() if line.strip())
    digest = sums.get(f"{name}.xz")
    if digest is None:
        unavailable(f"{name}.xz is not listed in {sums_file}")
    out_dir = Path(tempfile.gettempdir()) / "silod-k8s-testenv" / digest[:16]
    out = out_dir / name
    if out.is_file():
        return out
    packed = src_dir / f"{name}.xz"
    h = hashlib.sha256()
    with open(packed, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != digest:
        pytest.fail(f"{packed}: sha256 {h.hexdigest()} does not match SHA256SUMS ({digest})")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{name}.{os.getpid()}"
    with lzma.open(packed) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    tmp.chmod(0o755)
    os.replace(tmp, out)  # atomic: a concurrent session sees the whole binary or none
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rsa_key(path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption()))
    path.with_suffix(".pub").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


def wait(cond: Callable[[], Any], timeout: float = 30.0, what: str | Callable[[], str] = "condition",
         interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what() if callable(what) else what}")
        time.sleep(interval)


@dataclass
class ControlPlane:
    dir: Path
    url: str
    ca: Path
    tokens: dict[str, str]  # user -> bearer token
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    webhook: Any = None

    # --- clients -------------------------------------------------------------------------------

    def api_client(self, user: str = "admin") -> Any:
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        cfg.ssl_ca_cert = str(self.ca)
        cfg.api_key = {"authorization": self.tokens[user]}
        cfg.api_key_prefix = {"authorization": "Bearer"}
        return client.ApiClient(cfg)

    def token_file(self, user: str) -> Path:
        path = self.dir / f"token-{user.replace(':', '_')}"
        path.write_text(self.tokens[user] + "\n")
        return path

    def kubeconfig(self, user: str = "admin") -> Path:
        path = self.dir / f"kubeconfig-{user.replace(':', '_')}"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "t",
            "clusters": [{"name": "t", "cluster": {"server": self.url, "certificate-authority": str(self.ca)}}],
            "users": [{"name": "u", "user": {"token": self.tokens[user]}}],
            "contexts": [{"name": "t", "context": {"cluster": "t", "user": "u"}}],
        }))
        return path

    @property
    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.api_client())

    @property
    def batch(self) -> Any:
        from kubernetes import client

        return client.BatchV1Api(self.api_client())

    # --- processes -----------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "ab")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str, n: int = 3000) -> str:
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def start_kube_scheduler(self) -> None:
        """The upstream kube-scheduler (taints, tolerations, node affinity for real)."""
        if "kube-scheduler" in self.procs and self.procs["kube-scheduler"].poll() is None:
            return
        self._spawn("kube-scheduler", [str(binary("kube-scheduler")), f"--kubeconfig={self.kubeconfig()}",
                                       "--leader-elect=false", "--secure-port=0", "--v=1"])

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        if self.webhook is not None:
            self.webhook.stop()

    # --- objects -------------------------------------------------------------------------------

    def apply(self, docs: list[dict[str, Any]]) -> None:
        """Create each object as the admin (what `kubectl apply` of a fresh install does)."""
        from kubernetes import utils

        api = self.api_client()
        for doc in docs:
            utils.create_from_dict(api, doc)

    def add_namespace(self, name: str, labels: dict[str, str] | None = None, *, tenant: bool = True) -> None:
        """A namespace and its `default` ServiceAccount (no controller manager creates it here; the
        ServiceAccount admission plugin refuses pods without it). A tenant's namespace also gets
        what deploy/base/workloads-namespace.yaml gives ml-team besides the Namespace (the
        RoleBinding that lets silod create its REST Jobs there), as an operator copies it."""
        from kubernetes import client

        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels=labels or {})))
        self.core.create_namespaced_service_account(name, client.V1ServiceAccount(
            metadata=client.V1ObjectMeta(name="default")))
        if tenant:
            per_tenant = [d for d in yaml.safe_load_all((DEPLOY / "base" / "workloads-namespace.yaml").read_text())
                          if d and d["kind"] != "Namespace"]
            for doc in per_tenant:
                doc["metadata"]["namespace"] = name
            self.apply(per_tenant)

    def add_node(self, name: str, gpus: int, *, taints: list[dict[str, str]] | None = None, ready: bool = True,
                 unschedulable: bool = False, labels: dict[str, str] | None = None,
                 annotations: dict[str, str] | None = None, cpu: str = "64", memory: str = "256Gi") -> None:
        """A Node with `gpus` nvidia.com/gpu, `cpu` cores and, when `ready`, a Ready condition, as kubelet
        and the node lifecycle controller leave it: the TaintNodesByCondition admission plugin
        taints every new Node node.kubernetes.io/not-ready:NoSchedule, and the lifecycle
        controller (not running here) removes that taint once the node is Ready, so this does
        it. No addresses: nothing may dial a node (loopback-only rule)."""
        core = self.core
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                             "annotations": annotations or {}},
                "spec": {"unschedulable": unschedulable}}
        core.create_node(body)
        capacity = {"cpu": cpu, "memory": memory, "pods": "110", "nvidia.com/gpu": str(gpus)}
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        cond = {"type": "Ready", "status": "True" if ready else "False", "reason": "Test",
                "lastHeartbeatTime": now, "lastTransitionTime": now}
        core.patch_node_status(name, {"status": {"capacity": capacity, "allocatable": capacity, "conditions": [cond]}})
        node = core.read_node(name)
        kept = [t for t in (node.spec.taints or []) if not (ready and t.key == "node.kubernetes.io/not-ready")]
        wanted = [{"key": t.key, "value": t.value, "effect": t.effect} for t in kept] + list(taints or [])
        core.patch_node(name, {"spec": {"taints": wanted or None}})

    def set_ready(self, name: str, ready: bool) -> None:
        """Flip the node's Ready condition, as its kubelet (or the lifecycle controller) would."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.core.patch_node_status(name, {"status": {"conditions": [{
            "type": "Ready", "status": "True" if ready else "False", "reason": "Test", "lastHeartbeatTime": now,
            "lastTransitionTime": now}]}})

    def delete_nodes(self, names: list[str]) -> None:
        for name in names:
            try:
                self.core.delete_node(name)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def job(self, namespace: str, name: str) -> dict[str, Any]:
        from kubernetes import client

        return client.CustomObjectsApi(self.api_client()).get_namespaced_custom_object(
            "batch", "v1", namespace, "jobs", name)

    def pods(self, namespace: str) -> list[dict[str, Any]]:
        api = self.api_client()
        return api.sanitize_for_serialization(self.core.list_namespaced_pod(namespace).items)

    def cleanup_namespace(self, namespace: str) -> None:
        """Delete a test's Jobs and pods (no namespace or garbage-collection controller runs)."""
        from kubernetes import client

        custom = client.CustomObjectsApi(self.api_client())
        for job in custom.list_namespaced_custom_object("batch", "v1", namespace, "jobs").get("items", []):
            custom.delete_namespaced_custom_object("batch", "v1", namespace, "jobs", job["metadata"]["name"],
                                                   body={"propagationPolicy": "Orphan"})
        for pod in self.pods(namespace):
            name = pod["metadata"]["name"]
            if pod["metadata"].get("finalizers"):
                self.core.patch_namespaced_pod(name, namespace, {"metadata": {"finalizers": None}})
            try:
                self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
            except Exception:  # noqa: BLE001 - already gone
                pass


class Kubelet:
    """What the kubelets of `nodes` would do to the pods bound to them, one step at a time: a
    bound Pending pod becomes Running; a terminating pod (deletionTimestamp set, e.g. by the Job
    controller on suspension) is removed for good, as kubelet does once its containers stopped;
    `finish` ends a pod's containers with exit code 0."""

    def __init__(self, cp: ControlPlane, nodes: list[str]):
        self.cp = cp
        self.nodes = set(nodes)
        self.core = cp.core

    def step(self, namespace: str) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for pod in self.cp.pods(namespace):
            meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
            if spec.get("nodeName") not in self.nodes:
                continue
            if meta.get("deletionTimestamp"):
                try:
                    self.core.delete_namespaced_pod(meta["name"], namespace, grace_period_seconds=0)
                except Exception:  # noqa: BLE001 - gone meanwhile
                    pass
            elif status.get("phase") in (None, "Pending"):
                self.core.patch_namespaced_pod_status(meta["name"], namespace, {"status": {
                    "phase": "Running", "startTime": now,
                    "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
                    "containerStatuses": [{"name": c["name"], "image": c["image"], "imageID": "", "ready": True,
                                           "restartCount": 0, "started": True,
                                           "state": {"running": {"startedAt": now}}} for c in spec["containers"]]}})

    def finish(self, namespace: str, name: str) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        pod = self.core.read_namespaced_pod(name, namespace)
        self.core.patch_namespaced_pod_status(name, namespace, {"status": {
            "phase": "Succeeded",
            "containerStatuses": [{"name": c.name, "image": c.image, "imageID": "", "ready": False, "restartCount": 0,
                                   "state": {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now,
                                                            "finishedAt": now}}} for c in pod.spec.containers]}})


def deploy_base_docs() -> list[dict[str, Any]]:
    """deploy/base's objects in kustomization order (kustomize's `images:` only rewrites image
    names, which nothing here runs)."""
    kust = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for res in kust["resources"]:
        docs += [d for d in yaml.safe_load_all((DEPLOY / "base" / res).read_text()) if d]
    return docs


def loopback_webhook(doc: dict[str, Any], url: str, ca_pem: bytes) -> dict[str, Any]:
    """The webhook configuration with `clientConfig.url` on 127.0.0.1 instead of its Service (the
    API server would dial the Service's cluster IP: off this machine)."""
    import base64

    doc = json.loads(json.dumps(doc))
    for wh in doc["webhooks"]:
        wh["clientConfig"] = {"url": url, "caBundle": base64.b64encode(ca_pem).decode()}
    return doc


def start_control_plane(base: Path) -> ControlPlane:
    if shutil.which("etcd") is None:
        unavailable("etcd is not installed (Debian package etcd-server; .ci/run installs it)")
    apiserver, jobctl = binary("kube-apiserver"), binary("jobctl")
    from scheduler.backends.kubernetes.webhook import WebhookServer
    from tls_helpers import issue, make_ca

    base.mkdir(parents=True, exist_ok=True)
    pki = base / "pki"
    ca = make_ca(pki, "testenv-ca")
    serving = issue(ca, pki, "apiserver", dns=("localhost",), ips=("127.0.0.1",))
    _rsa_key(pki / "sa.key")
    tokens = {"admin": uuid.uuid4().hex, SILOD_SA: uuid.uuid4().hex, CSI_SA: uuid.uuid4().hex,
              "alice": uuid.uuid4().hex}
    groups = {"admin": "system:masters,system:authenticated",
              SILOD_SA: "system:serviceaccounts,system:serviceaccounts:silod-system,system:authenticated",
              CSI_SA: "system:serviceaccounts,system:serviceaccounts:silod-system,system:authenticated",
              "alice": "system:authenticated"}
    (base / "tokens.csv").write_text("".join(f'{tokens[u]},{u},{uuid.uuid4()},"{groups[u]}"\n' for u in tokens))
    etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
    cp = ControlPlane(dir=base, url=f"https://127.0.0.1:{api_port}", ca=ca.cert, tokens=tokens)
    try:
        cp._spawn("etcd", ["etcd", "--data-dir", str(base / "etcd"), "--name", "testenv",
                           f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                           f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                           f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                           f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                           f"--initial-cluster=testenv=http://127.0.0.1:{peer_port}",
                           "--unsafe-no-fsync"])
        cp._spawn("kube-apiserver", [
            str(apiserver), f"--etcd-servers=http://127.0.0.1:{etcd_port}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={api_port}", f"--cert-dir={base / 'certs'}",
            f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
            "--authorization-mode=RBAC", f"--token-auth-file={base / 'tokens.csv'}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={pki / 'sa.pub'}", f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/24", "--allow-privileged=true",
            "--enable-priority-and-fairness=false", "--profiling=false",
            # On top of the default plugins: pods requesting nvidia.com/gpu tolerate nvidia.com/gpu
            # taints (what GPU clusters commonly run; silod's placement must agree with it).
            "--enable-admission-plugins=ExtendedResourceToleration",
        ])
        import httpx

        def ready() -> bool:
            for name in ("etcd", "kube-apiserver"):
                if cp.procs[name].poll() is not None:
                    raise RuntimeError(f"{name} exited: {cp.log_tail(name)}")
            try:
                r = httpx.get(f"{cp.url}/readyz", verify=ssl.create_default_context(cafile=str(ca.cert)), timeout=2,
                              headers={"Authorization": f"Bearer {tokens['admin']}"})
                return r.status_code == 200 and r.text == "ok"
            except httpx.HTTPError:
                return False

        wait(ready, timeout=120, what="kube-apiserver /readyz", interval=0.3)
        # RBAC's bootstrap roles are written by a post-start hook; wait until they exist.
        wait(lambda: _has_cluster_role(cp, "edit"), timeout=60, what="the bootstrap ClusterRoles")
        cp._spawn("jobctl", [str(jobctl), f"--kubeconfig={cp.kubeconfig()}", "--v=1"])
        # The scheduler's admission webhook, served as `silod serve --webhook-listen` serves it.
        whca = make_ca(pki, "webhook-ca")
        whcert = issue(whca, pki, "webhook", ips=("127.0.0.1",))
        from scheduler.backends.kubernetes.webhook import NodeCache

        # As `silod serve` runs it: with the cluster's nodes (read as silod, no caching here so a
        # test's new node counts at once) for the nodeSelector / affinity check.
        cp.webhook = WebhookServer("127.0.0.1", 0, whcert.cert, whcert.key, admitters=frozenset({SILOD_SA}),
                                   nodes=NodeCache(cp.api_client(SILOD_SA), ttl_s=0.0)).start()
        docs = []
        for doc in deploy_base_docs():
            if doc["kind"] == "MutatingWebhookConfiguration":
                doc = loopback_webhook(doc, cp.webhook.url, whca.pem())
            docs.append(doc)
        cp.apply(docs)
        return cp
    except BaseException:
        cp.stop()
        raise


def _has_cluster_role(cp: ControlPlane, name: str) -> bool:
    from kubernetes import client

    try:
        client.RbacAuthorizationV1Api(cp.api_client()).read_cluster_role(name)
        return True
    except Exception:  # noqa: BLE001 - not yet
        return False


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory) -> Iterator[ControlPlane]:
    cp = start_control_plane(tmp_path_factory.mktemp("k8s-testenv"))
    try:
        yield cp
    finally:
        cp.stop()


def kubectl_job(name: str, gpus: int = 2) -> dict:
    """A labelled Job of `gpus` GPUs as a user writes it (suspend unset: created running), Pod Security
    "restricted" compliant, reading dataset `ds` through an inline silod volume."""
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "labels": {"silod.io/queue": "default"},
                         "annotations": {"silod.io/epochs": "1", "silod.io/ideal-throughput": "1MB/s"}},
            "spec": {"backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never",
                "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [{"name": "train", "image": "trainer:1", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                                "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}]}],
                "volumes": [{"name": "data", "csi": {"driver": "silod.io", "readOnly": True,
                                                     "volumeAttributes": {"dataset": "ds"}}}]}}}}
