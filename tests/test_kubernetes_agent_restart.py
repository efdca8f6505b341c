"""A node agent restart (rolling update, OOM kill) under a pod that keeps reading: real FUSE mounts,
the real `silod agent` (CSI Node service over its socket, called as kubelet calls it), and the
pod's view of its volume made as kubelet and runc make it: the kubelet directory is a shared mount
(the agent's DaemonSet mounts it Bidirectional), and the container gets a recursive bind of the
volume's target path in its own mount namespace with the propagation its pod spec asks for
(`mountPropagation: HostToContainer` -> rslave, none -> rprivate).

Which propagation the pod gets is read from a real API server (tests/k8s_testenv.py): the Job a
user creates, as the admission webhook left it. The reader, in its own mount namespace, reads every
item in a loop and checks every byte against the dataset's digests; the agent and its mount
processes are killed with SIGKILL (what a container kill does to every process in it) and the
agent is started again. The reader must get its data back, and never a wrong byte. Before the
webhook set HostToContainer, the pod kept the dead FUSE mount: every read failed with "Transport
endpoint is not connected" until the pod was deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from dataplane_helpers import make_dataset, require_fuse, silod_cmd
from k8s_testenv import ControlPlane

pytestmark = [pytest.mark.slow, pytest.mark.fuse]

KUBELET_PROPAGATION = {"HostToContainer": "rslave", "Bidirectional": "rshared", "None": "rprivate", None: "rprivate"}

READER = r"""
import hashlib, json, os, sys, time
root, digests, out = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3]
state = {"passes": 0, "errors": 0, "mismatches": 0, "last_error": ""}
while True:
    ok = True
    for rel, digest in sorted(digests.items()):
        try:
            with open(os.path.join(root, rel), "rb") as f:
                got = hashlib.sha256(f.read()).hexdigest()
        except OSError as exc:
            state["errors"] += 1
            state["last_error"] = f"{rel}: {exc}"
            ok = False
            time.sleep(0.05)
            break
        if got != digest:
            state["mismatches"] += 1
            state["last_error"] = f"{rel}: wrong bytes"
            ok = False
    if ok:
        state["passes"] += 1
    with open(out + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(out + ".tmp", out)
"""


def _sh(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True, timeout=60)


def _webhook_propagation(cp: ControlPlane) -> str | None:
    """The mountPropagation of the dataset mount of a labelled Job as the API server stored it."""
    ns = f"prop-{uuid.uuid4().hex[:8]}"
    cp.add_namespace(ns)
    try:
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train", "labels": {"silod.io/queue": "default"}},
               "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [
                   {"name": "c", "image": "trainer:1", "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}]}],
                   "volumes": [{"name": "data", "csi": {"driver": "silod.io", "readOnly": True,
                                                        "volumeAttributes": {"dataset": "files"}}}]}}}}
        got = client.BatchV1Api(cp.api_client()).create_namespaced_job(ns, job)
        return got.spec.template.spec.containers[0].volume_mounts[0].mount_propagation
    finally:
        cp.cleanup_namespace(ns)


class Agent:
    def __init__(self, args: list[str], log: Path):
        self.log = open(log, "ab")
        self.proc = subprocess.Popen([*silod_cmd(), "agent", *args], stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def kill(self, mounts_under: Path) -> None:
        """SIGKILL the agent and the `silod mount` processes it started (they run in sessions of
        their own; a container kill ends every process of the container)."""
        children = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"mount" in cmd and any(str(mounts_under).encode() in c for c in cmd):
                children.append(int(pid))
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_pod_keeps_reading_correct_bytes_across_an_agent_restart(control_plane, tmp_path):
    require_fuse()
    propagation = _webhook_propagation(control_plane)
    final = restart_agent_under_reader(tmp_path, propagation)
    assert final["mismatches"] == 0, final
    assert propagation == "HostToContainer"


def restart_agent_under_reader(tmp_path: Path, propagation: str | None) -> dict:
    """Publish a dataset volume through a real `silod agent`, read it from a container mount
    namespace with the propagation kubelet gives `propagation`, SIGKILL the agent and its mounts,
    start it again; fails unless the reader gets its data back. Returns the reader's final
    counters (passes, errors, mismatches). Also the operator walk's restart step
    (tests/test_kubernetes_operator_walk.py)."""
    from fuse_client.agent.csi import csi_pb2 as pb, csi_pb2_grpc as pb_grpc
    import grpc

    ds = make_dataset(tmp_path / "remote", n_files=40)
    (tmp_path / "catalog.yaml").write_text(f"datasets:\n  - {{tenant: t1, name: files, uri: '{ds.root}'}}\n")
    (tmp_path / "digests.json").write_text(json.dumps(ds.digests))
    (tmp_path / "reader.py").write_text(READER)
    kubelet, state, sock = tmp_path / "kubelet", tmp_path / "state", tmp_path / "plugin" / "csi.sock"
    for d in (kubelet, state):
        d.mkdir()
        # As on a node: the agent pod mounts both Bidirectional (rshared).
        _sh("mount", "--bind", str(d), str(d))
        _sh("mount", "--make-rshared", str(d))
    args = ["--node", "n1", "--socket", str(sock), "--state-dir", str(state), "--kubelet-dir", str(kubelet),
            "--datasets", str(tmp_path / "catalog.yaml"), "--report-interval", "0", "--idle-unmount", "0"]
    target = kubelet / "pods" / "uid-1" / "volumes" / "kubernetes.io~csi" / "data" / "mount"
    target.parent.mkdir(parents=True)
    container_root = tmp_path / "container"
    reader = None
    agent = Agent(args, tmp_path / "agent1.log")
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert agent.proc.poll() is None and time.monotonic() < deadline, (tmp_path / "agent1.log").read_text()
            time.sleep(0.1)
        ctx = {"dataset": "files", "csi.storage.k8s.io/pod.name": "train-0", "csi.storage.k8s.io/pod.namespace": "t1",
               "csi.storage.k8s.io/pod.uid": "uid-1", "csi.storage.k8s.io/serviceAccount.name": "default",
               "csi.storage.k8s.io/ephemeral": "true"}
        cap = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(), access_mode=pb.VolumeCapability.AccessMode(mode=1))
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            pb_grpc.NodeStub(ch).NodePublishVolume(pb.NodePublishVolumeRequest(
                volume_id="csi-vol-1", target_path=str(target), volume_capability=cap, readonly=True,
                volume_context=ctx), timeout=60)
        # The container: its own mount namespace, the volume bound in recursively, then given
        # the propagation kubelet asks of the runtime for this pod spec.
        container_root.mkdir()
        mode = KUBELET_PROPAGATION[propagation]
        status = tmp_path / "reader.json"
        reader = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "unchanged", "sh", "-c",
             f'mount --rbind "{target}" "{container_root}" && mount --make-{mode} "{container_root}" && '
             f'exec "{sys.executable}" "{tmp_path / "reader.py"}" "{container_root}" "{tmp_path / "digests.json"}" "{status}"'],
            stdout=open(tmp_path / "reader.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)

        def read_state() -> dict:
            assert reader.poll() is None, (tmp_path / "reader.log").read_text()
            try:
                return json.loads(status.read_text())
            except (OSError, ValueError):
                return {"passes": 0, "errors": 0, "mismatches": 0}

        deadline = time.monotonic() + 60
        while read_state()["passes"] < 2:
            assert time.monotonic() < deadline, read_state()
            time.sleep(0.2)
        # The agent restarts: killed with everything it started, then started again.
        agent.kill(state)
        time.sleep(1.0)
        broken = read_state()
        agent = Agent(args, tmp_path / "agent2.log")
        deadline = time.monotonic() + 90
        while read_state()["passes"] < broken["passes"] + 3:
            assert time.monotonic() < deadline, (
                f"the pod's reads did not come back after the agent restarted (propagation {propagation!r} ->"
                f" {mode}): {read_state()}; agent: {(tmp_path / 'agent2.log').read_text()[-1500:]}")
            time.sleep(0.2)
        return read_state()
    finally:
        if reader is not None and reader.poll() is None:
            os.killpg(reader.pid, signal.SIGKILL)
            reader.wait(10)
        try:
            with grpc.insecure_channel(f"unix://{sock}") as ch:
                pb_grpc.NodeStub(ch).NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
                    volume_id="csi-vol-1", target_path=str(target)), timeout=60)
        except Exception:  # noqa: BLE001 - the agent may be gone; the unmounts below clean up
            pass
        agent.kill(state)
        for d in (kubelet, state):
            for _ in range(20):  # every mount under it (stacked ones included), then itself
                r = subprocess.run(["umount", "-R", "-l", str(d)], capture_output=True)
                if r.returncode != 0:
                    break
