"""The end-to-end scenario of test_kubernetes_e2e.py on the REAL control plane (tests/k8s_testenv.py:
etcd, "kube-apiserver v1.24.0-alpha snapshot", its Job controller and kube-scheduler, RBAC on,
deploy/base applied, the webhook called by URL on 127.0.0.1).

One `silod serve --backend kubernetes` program (REST over real HTTP, SQLite, the Gavel loop, the
admission controller, authenticated as its service account) and one real `silod agent` (CSI over a
real unix socket, real FUSE and bind mounts). A job submitted by REST and a Job created "with
kubectl" (running: the real API server has the webhook store it suspended) are admitted in policy
order, time-shared by suspension in Gavel rounds, and finished; the REST job's node is cordoned as soon as
its first run is seen, so re-admission must move a job to the other node (the real API server
refuses that unless silod clears status.startTime). The test plays the kubelet: it calls the agent's
CSI socket for each pod as kubelet does (NodePublishVolume before the pod runs,
NodeUnpublishVolume when it ends or is deleted) and plays the containers, which read the dataset
through the published volume.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from dataplane_helpers import force_unmount, make_dataset, require_fuse, silod_cmd
from k8s_testenv import SILOD_SA, ControlPlane, free_port, kubectl_job, wait
from scheduler.service.api.app import create_app
from scheduler.service.api.auth import TokenStore, load_token_key
from scheduler.service.cli import build_service
from scheduler.service.scheduler_process import ADMIN, Principal

pytestmark = [pytest.mark.fuse, pytest.mark.slow]

ADMIN_TOKEN = "admin-token-0123456789"
AGENT = "agent-token-00003"
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}


class Kubelet(threading.Thread):
    """kubelet for `nodes`, as far as silod's volumes go: publishes each silod CSI volume of a bound
    pod through the agent's socket before the pod runs, unpublishes when the pod ends or is being
    deleted, then finishes the deletion (the containers are gone)."""

    def __init__(self, cp: ControlPlane, namespace: str, nodes: list[str], sock: Path, root: Path):
        super().__init__(daemon=True)
        self.cp, self.ns, self.nodes, self.sock, self.root = cp, namespace, set(nodes), sock, root
        self.core = cp.core
        self.published: dict[tuple[str, str], tuple[str, Path]] = {}  # (pod uid, volume) -> (volume id, target)
        self.calls: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()

    def target(self, pod: dict, vol: str) -> Path:
        return self.root / pod["spec"]["nodeName"] / "pods" / pod["metadata"]["uid"] / "volumes" / "kubernetes.io~csi" / vol / "mount"

    def run(self) -> None:
        import grpc

        from fuse_client.agent.csi import csi_pb2, csi_pb2_grpc

        channel = grpc.insecure_channel(f"unix://{self.sock}")
        stub = csi_pb2_grpc.NodeStub(channel)
        while not self.stop.is_set():
            try:
                self._step(stub, csi_pb2)
            except Exception as exc:  # noqa: BLE001 - a kubelet retries; the test sees the errors
                self.errors.append(repr(exc)[:300])
            self.stop.wait(0.1)
        channel.close()

    def _volumes(self, pod: dict) -> list[tuple[str, dict]]:
        return [(v["name"], v["csi"]) for v in pod["spec"].get("volumes") or []
                if (v.get("csi") or {}).get("driver") == "silod.io"]

    def _step(self, stub, pb) -> None:  # type: ignore[no-untyped-def]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for pod in self.cp.pods(self.ns):
            meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
            if spec.get("nodeName") not in self.nodes:
                continue
            uid = meta["uid"]
            ending = meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed")
            if ending:
                for vol, _ in self._volumes(pod):
                    if (uid, vol) in self.published:
                        vid, target = self.published.pop((uid, vol))
                        stub.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=vid, target_path=str(target)),
                                                 timeout=60)
                        self.calls.append(("NodeUnpublishVolume", vid))
                if meta.get("deletionTimestamp"):
                    try:
                        self.core.delete_namespaced_pod(meta["name"], self.ns, grace_period_seconds=0)
                    except Exception:  # noqa: BLE001 - gone meanwhile
                        pass
                continue
            if status.get("phase") not in (None, "Pending"):
                continue
            for vol, csi in self._volumes(pod):
                if (uid, vol) in self.published:
                    continue
                vid = "csi-" + hashlib.sha256(f"{uid}/{vol}".encode()).hexdigest()[:40]  # kubelet's inline volume id
                target = self.target(pod, vol)
                target.parent.mkdir(parents=True, exist_ok=True)
                ctx = {**(csi.get("volumeAttributes") or {}), "csi.storage.k8s.io/pod.name": meta["name"],
                       "csi.storage.k8s.io/pod.namespace": self.ns, "csi.storage.k8s.io/pod.uid": uid,
                       "csi.storage.k8s.io/serviceAccount.name": spec.get("serviceAccountName") or "default",
                       "csi.storage.k8s.io/ephemeral": "true"}
                # kubelet sends an inline volume as SINGLE_NODE_WRITER with the volume's readOnly.
                cap = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                                          access_mode=pb.VolumeCapability.AccessMode(mode=1))
                stub.NodePublishVolume(pb.NodePublishVolumeRequest(
                    volume_id=vid, target_path=str(target), volume_capability=cap,
                    readonly=bool(csi.get("readOnly")), volume_context=ctx), timeout=60)
                self.calls.append(("NodePublishVolume", vid))
                self.published[(uid, vol)] = (vid, target)
            self.core.patch_namespaced_pod_status(meta["name"], self.ns, {"status": {
                "phase": "Running", "startTime": now,
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
                "containerStatuses": [{"name": c["name"], "image": c["image"], "imageID": "", "ready": True,
                                       "restartCount": 0, "started": True, "state": {"running": {"startedAt": now}}}
                                      for c in spec["containers"]]}})

    def finish(self, name: str) -> None:
        """The container exits 0."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        pod = self.core.read_namespaced_pod(name, self.ns)
        self.core.patch_namespaced_pod_status(name, self.ns, {"status": {
            "phase": "Succeeded",
            "containerStatuses": [{"name": c.name, "image": c.image, "imageID": "", "ready": False, "restartCount": 0,
                                   "state": {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now,
                                                            "finishedAt": now}}} for c in pod.spec.containers]}})


def read_all(path: Path, ds) -> int:  # type: ignore[no-untyped-def]
    """The container reads every item through the published volume and checks it."""
    for rel, digest in ds.digests.items():
        assert hashlib.sha256((path / rel).read_bytes()).hexdigest() == digest, rel
    return ds.total


def test_rest_and_kubectl_jobs_time_shared_and_moved_on_the_real_control_plane(control_plane, tmp_path):
    require_fuse()
    if os.geteuid() != 0:
        pytest.fail("bind mounts need root") if os.environ.get("CI", "").lower() == "true" else pytest.skip("needs root")
    cp = control_plane
    cp.start_kube_scheduler()
    ns = f"t-{uuid.uuid4().hex[:8]}"  # the tenant (namespace prefix "")
    user_token = f"{ns}-token-0001"
    cp.add_namespace(ns, RESTRICTED)
    cp.core.create_namespaced_service_account(ns, {"metadata": {"name": "silod-e2e"}})
    a, b = f"{ns}-a", f"{ns}-b"
    for n in (a, b):
        cp.add_node(n, 4, annotations={"silod.io/cache-capacity": "1GB", "silod.io/remote-io": "1GB/s"})
    ds = make_dataset(tmp_path / "remote", n_files=20)
    sock = tmp_path / "plugins" / "silod.io" / "csi.sock"
    kubelet_root = tmp_path / "kubelet"
    kubelet_root.mkdir()
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ns}:{user_token}\nagent:{AGENT}\n")
    service = build_service(db=f"sqlite:///{tmp_path / 'silod.db'}", backend="kubernetes", policy="gavel",
                            round_s=4.0, gpus="4", gpus_per_node="4", cache="1GB", remote_io="1GB/s",
                            state_dir=tmp_path / "state", backend_opts={"kubeconfig": str(cp.kubeconfig(SILOD_SA))},
                            allowed_uris=[f"file://{tmp_path / 'remote'}/"], node_agents=["agent"])
    service.config = dataclasses.replace(service.config, poll_seconds=0.2, min_event_gap_s=0.5)
    import uvicorn

    store = TokenStore(service.engine, load_token_key(tmp_path / "token-key"), admin_token=ADMIN_TOKEN)
    store.import_file(tokens)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service, store, run_loop=True), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait(lambda: server.started, 30, "silod serve")
    agent = subprocess.Popen(
        [*silod_cmd(), "agent", "--socket", str(sock), "--state-dir", str(tmp_path / "agent"), "--node", a,
         "--scheduler", url, "--kubelet-dir", str(kubelet_root), "--report-interval", "0"],
        stdout=open(tmp_path / "agent.log", "ab"), stderr=subprocess.STDOUT, env={**os.environ, "SILOD_AGENT_TOKEN": AGENT})
    kubelet = Kubelet(cp, ns, [a, b], sock, kubelet_root)
    try:
        wait(sock.exists, 30, "the agent's socket")
        kubelet.start()
        h = {"Authorization": f"Bearer {user_token}"}
        with httpx.Client(base_url=url, headers=h, timeout=30) as api:
            r = api.post("/v1/datasets", json={"name": "ds", "uri": f"file://{ds.root}", "size": ds.total})
            assert r.status_code == 201, r.text
            r = api.post("/v1/jobs", json={"name": "by-rest", "gpus": 4, "dataset": "ds", "epochs": 1,
                                           "ideal_throughput": "1MB/s", "pod_template": {"image": "trainer:1"}})
            assert r.status_code == 201, r.text
            rest_job = f"silod-{r.json()['id']}"
        time.sleep(0.3)
        # Created running, as most users write a Job: the real API server has the webhook store it suspended.
        job = kubectl_job("by-kubectl", gpus=4)
        created = cp.batch.create_namespaced_job(ns, job)
        assert created.spec.suspend is True  # stored suspended: the webhook's patch, applied by the real API server

        runs = {rest_job: [], "by-kubectl": []}  # the nodes each run was on
        seen: set[str] = set()
        cordoned = False
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            done = [j for j in cp.batch.list_namespaced_job(ns).items
                    if any(c.type == "Complete" and c.status == "True" for c in (j.status.conditions or []))]
            if len(done) == 2:
                break
            for name in runs:
                for pod in cp.pods(ns):
                    if (pod["metadata"].get("labels") or {}).get("job-name") != name:
                        continue
                    uid = pod["metadata"]["uid"]
                    vol = "dataset" if name == rest_job else "data"
                    if (pod.get("status") or {}).get("phase") != "Running" or uid in seen \
                            or (uid, vol) not in kubelet.published:
                        continue
                    seen.add(uid)
                    runs[name].append(pod["spec"]["nodeName"])
                    if not cordoned and name == rest_job:
                        # Node maintenance while the first run is on: its node is cordoned at once
                        # (before the slow read below), so whatever runs after it, the REST job's
                        # next run included, must go to the other node (a move the API server
                        # refuses while startTime is set). Cordoning only once both jobs had been
                        # seen let a lagging loop (a loaded CI machine, 4-s rounds) see the REST
                        # job's second run already placed on the first node.
                        cp.core.patch_node(pod["spec"]["nodeName"], {"spec": {"unschedulable": True}})
                        cordoned = True
                    try:
                        read_all(kubelet.published[(uid, vol)][1], ds)  # the container reads its data through CSI
                    except (OSError, KeyError):
                        continue  # preempted while reading: kubelet unpublished its volume
                    if len(runs[name]) >= 2:  # finish on its second run: it was preempted and resumed first
                        kubelet.finish(pod["metadata"]["name"])
            time.sleep(0.1)
        admin = Principal(ADMIN, is_admin=True)
        jobs = {j.name: j for j in service.list_jobs(admin)}
        assert len(done) == 2, (runs, kubelet.errors[-5:], {k: (v.state, v.message) for k, v in jobs.items()},
                                _debug(cp, ns))
        wait(lambda: all(j.state == "finished" for j in service.list_jobs(admin)), 30, "the service to see both end")
        # Policy order: the REST job (submitted first) ran first; each ran at least twice (preempted, resumed).
        assert len(runs[rest_job]) >= 2 and len(runs["by-kubectl"]) >= 2, runs
        # Re-admitted on OTHER nodes: a job that ran on the cordoned node later ran on the other one.
        moved = [name for name, nodes in runs.items() if len(set(nodes)) > 1]
        assert moved, runs
        assert {c[0] for c in kubelet.calls} == {"NodePublishVolume", "NodeUnpublishVolume"}
        assert not kubelet.errors, kubelet.errors[-5:]
    finally:
        kubelet.stop.set()
        server.should_exit = True
        thread.join(20)
        agent.terminate()
        agent.wait(30)
        for line in reversed(Path("/proc/mounts").read_text().splitlines()):
            if line.split()[1].startswith(str(tmp_path)):
                force_unmount(Path(line.split()[1]))
        cp.cleanup_namespace(ns)
        cp.delete_nodes([a, b])


def _debug(cp: ControlPlane, ns: str) -> str:
    out = []
    for j in cp.batch.list_namespaced_job(ns).items:
        aff = j.spec.template.spec.affinity
        out.append(f"job {j.metadata.name} suspend={j.spec.suspend} status=active:{j.status.active} "
                   f"start:{j.status.start_time} aff={aff.node_affinity.required_during_scheduling_ignored_during_execution if aff else None}")
    for p in cp.pods(ns):
        out.append(f"pod {p['metadata']['name']} node={p['spec'].get('nodeName')} phase={(p.get('status') or {}).get('phase')}"
                   f" del={p['metadata'].get('deletionTimestamp')} conds={(p.get('status') or {}).get('conditions')}")
    for e in cp.core.list_namespaced_event(ns).items[-8:]:
        out.append(f"event {e.involved_object.name} {e.reason}: {e.message[:200]}")
    text = "\n".join(out)
    print(text)  # pytest shows it with the failure (captured stdout)
    return text
