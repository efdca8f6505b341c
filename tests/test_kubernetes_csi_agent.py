"""The node agent's CSI services: a real gRPC client on a real unix socket, real FUSE mounts,
real bind mounts (root and /dev/fuse needed; under CI=true their absence fails the test).

The agent runs as a real `silod agent` process. The client plays kubelet: it sends the volume
context kubelet sends for an inline ephemeral volume of a driver with podInfoOnMount.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from dataplane_helpers import force_unmount, make_dataset, read_epoch, require_fuse, silod_cmd

pytestmark = [pytest.mark.fuse]


@pytest.fixture(autouse=True)
def _fuse():
    require_fuse()
    if os.geteuid() != 0:
        msg = "bind mounts need root"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)


class AgentProc:
    def __init__(self, tmp: Path, catalog: Path | None, node: str = "n1", *, resolver_args: list[str] | None = None,
                 env: dict[str, str] | None = None):
        """`catalog`: the --datasets file; else `resolver_args` (e.g. --scheduler URL --manager URL)."""
        self.tmp = tmp
        self.resolver_args = ["--datasets", str(catalog)] if catalog is not None else list(resolver_args or [])
        self.env = env
        self.socket = tmp / "plugins" / "silod.io" / "csi.sock"
        self.state = tmp / "agent-state"
        self.kubelet = tmp / "kubelet"
        self.kubelet.mkdir(exist_ok=True)
        self.catalog = catalog
        self.node = node
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.tmp / "agent.log", "ab")
        self.proc = subprocess.Popen(
            [*silod_cmd(), "agent", "--socket", str(self.socket), "--state-dir", str(self.state), "--node", self.node,
             *self.resolver_args, "--kubelet-dir", str(self.kubelet), "--log-level", "debug", "--idle-unmount", "0"],
            stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited: {(self.tmp / 'agent.log').read_text()[-2000:]}")
            if self.socket.exists():
                try:
                    self.identity().Probe(self.pb.ProbeRequest(), timeout=2)
                    return
                except grpc.RpcError:
                    pass
            time.sleep(0.1)
        raise AssertionError("agent did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                # A dataset mount still bind-mounted into pods takes up to 15 s to end on SIGTERM.
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    @property
    def pb(self):  # noqa: ANN201
        from fuse_client.agent.csi import csi_pb2

        return csi_pb2

    def _channel(self) -> grpc.Channel:
        return grpc.insecure_channel(f"unix://{self.socket}")

    def identity(self):  # noqa: ANN201
        from fuse_client.agent.csi import csi_pb2_grpc

        return csi_pb2_grpc.IdentityStub(self._channel())

    def node_stub(self):  # noqa: ANN201
        from fuse_client.agent.csi import csi_pb2_grpc

        return csi_pb2_grpc.NodeStub(self._channel())

    def target(self, pod_uid: str) -> Path:
        t = self.kubelet / "pods" / pod_uid / "volumes" / "kubernetes.io~csi" / "data" / "mount"
        t.parent.mkdir(parents=True, exist_ok=True)
        return t

    def publish(self, volume_id: str, target: Path, namespace: str = "alice", dataset: str = "ds", *,
                mode: int = 1, readonly: bool = True, **extra: str):
        """NodePublishVolume as kubelet sends it. Inline volume: access mode SINGLE_NODE_WRITER
        (1, kubelet's default for inline volumes) with readonly=true; a ReadOnlyMany PV:
        MULTI_NODE_READER_ONLY (3)."""
        pb = self.pb
        ctx = {"dataset": dataset, "csi.storage.k8s.io/pod.name": "p", "csi.storage.k8s.io/pod.namespace": namespace,
               "csi.storage.k8s.io/pod.uid": "u", "csi.storage.k8s.io/ephemeral": "true", **extra}
        if not namespace:
            del ctx["csi.storage.k8s.io/pod.namespace"]
        cap = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                                  access_mode=pb.VolumeCapability.AccessMode(mode=mode))
        return self.node_stub().NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id=volume_id, target_path=str(target), volume_capability=cap, readonly=readonly, volume_context=ctx),
            timeout=60)

    def unpublish(self, volume_id: str, target: Path):
        return self.node_stub().NodeUnpublishVolume(
            self.pb.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target)), timeout=60)

    def stats(self, tenant: str = "alice", dataset: str = "ds") -> dict:
        return json.loads((self.state / "mounts" / tenant / f"{dataset}.stats.json").read_text())

    def cleanup(self) -> None:
        self.stop()
        mine = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                if line.split()[1].startswith(str(self.tmp))]
        for m in sorted(mine, key=len, reverse=True):
            force_unmount(Path(m))


@pytest.fixture
def setup(tmp_path):
    ds = make_dataset(tmp_path / "remote", n_files=60)
    catalog = tmp_path / "datasets.yaml"
    catalog.write_text(f"datasets:\n  - {{tenant: alice, name: ds, uri: '{ds.root}'}}\n")
    agent = AgentProc(tmp_path, catalog)
    agent.start()
    yield agent, ds
    agent.cleanup()


def wait_stats(agent: AgentProc, pred, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = agent.stats()
            if pred(s):
                return s
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"stats never satisfied the condition: {agent.stats()}")
        time.sleep(0.1)


def read_as_user(path: Path, uid: int = 1000) -> bytes:
    """Read a file as an unprivileged uid, as a restricted pod's container does."""
    # cwd is entered as root (pytest's tmp dirs are 0700); the read itself is done as `uid`.
    r = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "cat", path.name],
                       capture_output=True, timeout=30, cwd=path.parent)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout


def test_identity_and_node_info_over_the_unix_socket(setup):
    agent, _ = setup
    info = agent.identity().GetPluginInfo(agent.pb.GetPluginInfoRequest(), timeout=5)
    assert info.name == "silod.io" and info.vendor_version
    assert agent.identity().Probe(agent.pb.ProbeRequest(), timeout=5).ready.value is True
    assert agent.node_stub().NodeGetInfo(agent.pb.NodeGetInfoRequest(), timeout=5).node_id == "n1"
    caps = agent.node_stub().NodeGetCapabilities(agent.pb.NodeGetCapabilitiesRequest(), timeout=5)
    assert list(caps.capabilities) == []  # no staging: kubelet calls publish directly
    assert oct(agent.socket.stat().st_mode & 0o777) == "0o600"


def test_publish_read_restart_keeps_cache_unpublish(setup):
    agent, ds = setup
    target = agent.target("pod-1")
    agent.publish("vol-1", target)
    assert os.path.ismount(target)
    read_epoch(target, ds, seed=1)  # every byte checked against the source
    rel = sorted(ds.sizes)[0]
    assert read_as_user(target / rel) == (ds.root / rel).read_bytes()  # a non-root pod reads it
    with pytest.raises(OSError):
        (target / "new-file").write_bytes(b"x")  # read-only
    first = wait_stats(agent, lambda s: s["read_bytes"] >= ds.total)
    assert first["remote_bytes"] >= ds.total

    # Restart the agent: its FUSE process goes away with it (as in a container restart), the
    # pod's bind mount is stale until the new agent restores it, and the cache on disk survives.
    agent.stop()
    agent.start()
    assert os.path.ismount(target)
    read_epoch(target, ds, seed=2)
    again = wait_stats(agent, lambda s: s["read_bytes"] >= ds.total)
    assert again["remote_bytes"] == 0, again  # served from the node's cache, nothing re-fetched
    assert again["hit_bytes"] >= ds.total

    # A second pod of the same tenant shares the node's one dataset mount.
    t2 = agent.target("pod-2")
    agent.publish("vol-2", t2)
    agent.publish("vol-2", t2)  # idempotent repeat
    assert (t2 / rel).read_bytes() == (ds.root / rel).read_bytes()
    agent.unpublish("vol-1", target)
    assert not os.path.exists(target) and os.path.ismount(t2)
    agent.unpublish("vol-2", t2)
    agent.unpublish("vol-2", t2)  # idempotent: already gone
    assert not os.path.ismount(agent.state / "mounts" / "alice" / "ds")  # released with its last volume


def test_a_pod_cannot_mount_another_tenants_dataset_or_escape_the_kubelet_dir(setup):
    agent, _ = setup
    with pytest.raises(grpc.RpcError) as err:
        agent.publish("v-bob", agent.target("pod-b"), namespace="bob")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "tenant bob" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        agent.publish("v-esc", agent.tmp / "elsewhere")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the kubelet" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        agent.publish("v-nons", agent.target("pod-c"), namespace="")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "podInfoOnMount" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        agent.publish("v-dots", agent.target("pod-d"), dataset="../etc")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not any(os.path.ismount(p) for p in agent.kubelet.rglob("mount"))


def test_one_pvc_volume_is_published_for_two_pods_on_the_node(setup):
    """Finding 3: no STAGE_UNSTAGE, so kubelet publishes a PVC's volume once per pod, with the same
    volume_id at two target paths (allowed for MULTI_NODE_READER_ONLY). Both pods read; the
    dataset mount lives until the last of them is unpublished."""
    agent, ds = setup
    vid = "silod:alice:ds:pvc-0a1b"  # what silod's CSI controller provisions for alice's PVC "ds"
    pvc = {"silod.io/namespace": "alice"}
    t1, t2 = agent.target("pod-1"), agent.target("pod-2")
    agent.publish(vid, t1, mode=3, **pvc)
    agent.publish(vid, t2, mode=3, **pvc)  # the second pod on the node: was INVALID_ARGUMENT "already published"
    agent.publish(vid, t2, mode=3, **pvc)  # idempotent repeat
    rel = sorted(ds.sizes)[0]
    assert (t1 / rel).read_bytes() == (t2 / rel).read_bytes() == (ds.root / rel).read_bytes()
    agent.unpublish(vid, t1)
    assert not os.path.exists(t1) and os.path.ismount(t2)
    assert (t2 / rel).read_bytes() == (ds.root / rel).read_bytes()  # the other pod still reads
    assert os.path.ismount(agent.state / "mounts" / "alice" / "ds")
    agent.unpublish(vid, t2)
    assert not os.path.ismount(agent.state / "mounts" / "alice" / "ds")  # released with its last publication


def test_publish_error_codes_follow_the_csi_spec(setup):
    agent, _ = setup
    t = agent.target("pod-1")
    # A writable publish of a read-only dataset is refused, not silently mounted read-only.
    with pytest.raises(grpc.RpcError) as err:
        agent.publish("v1", t, readonly=False)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "readOnly" in err.value.details()
    assert not os.path.ismount(t)
    agent.publish("v1", t)
    # The same volume at the same target with an incompatible capability: ALREADY_EXISTS.
    with pytest.raises(grpc.RpcError) as err:
        agent.publish("v1", t, mode=3)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    # Another volume at a target that holds one: ALREADY_EXISTS, the first stays.
    with pytest.raises(grpc.RpcError) as err:
        agent.publish("v2", t)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and os.path.ismount(t)
    # A reader-only access mode is read-only whatever the readonly flag (a PVC mounted without readOnly).
    t3 = agent.target("pod-3")
    agent.publish("v3", t3, mode=3, readonly=False)
    with pytest.raises(OSError):
        (t3 / "new-file").write_bytes(b"x")


def test_the_agents_mount_process_never_inherits_the_nodes_cloud_keys(tmp_path, monkeypatch):
    """The `silod mount` the agent starts for a catalog dataset (no credential) reads anonymously:
    its environment has SILOD_SOURCE_ANONYMOUS=1 and none of the node's AWS keys or the agent's token."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "NODE-KEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "node-secret")
    monkeypatch.setenv("SILOD_AGENT_TOKEN", "agent-token")
    ds = make_dataset(tmp_path / "remote", n_files=5)
    catalog = tmp_path / "datasets.yaml"
    catalog.write_text(f"datasets:\n  - {{tenant: alice, name: ds, uri: '{ds.root}'}}\n")
    agent = AgentProc(tmp_path, catalog)
    agent.start()
    try:
        agent.publish("v1", agent.target("pod-1"))
        mount_dir = str(agent.state / "mounts" / "alice" / "ds")
        pids = [p for p in Path("/proc").iterdir() if p.name.isdigit()
                and mount_dir.encode() in _read(p / "cmdline") and b"mount" in _read(p / "cmdline")]
        assert pids, "no silod mount process found"
        env = dict(kv.split(b"=", 1) for kv in _read(pids[0] / "environ").split(b"\0") if b"=" in kv)
        assert env.get(b"SILOD_SOURCE_ANONYMOUS") == b"1"
        assert not {b"AWS_ACCESS_KEY_ID", b"AWS_SECRET_ACCESS_KEY", b"SILOD_AGENT_TOKEN"} & set(env)
    finally:
        agent.cleanup()


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""
