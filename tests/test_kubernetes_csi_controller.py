"""The CSI Controller service (`silod csi-controller`): dynamic provisioning of PVCs of the silod
StorageClass. A real gRPC client on a real unix socket plays the csi-provisioner sidecar (with
--extra-create-metadata), then plays kubelet: the provisioned volume is published by the real
node agent (real FUSE and bind mounts) to a pod of the PVC's namespace, and refused to any other.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from dataplane_helpers import make_dataset, read_epoch, require_fuse, silod_cmd
from fuse_client.agent.csi import csi_pb2 as pb
from fuse_client.agent.csi import csi_pb2_grpc

try:
    from test_kubernetes_csi_agent import AgentProc
except ImportError:
    from tests.test_kubernetes_csi_agent import AgentProc

RO_MANY = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                              access_mode=pb.VolumeCapability.AccessMode(mode=pb.VolumeCapability.AccessMode.MULTI_NODE_READER_ONLY))
RWO = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                          access_mode=pb.VolumeCapability.AccessMode(mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))


def meta(pvc: str, ns: str = "alice") -> dict[str, str]:
    """What the csi-provisioner sidecar adds with --extra-create-metadata."""
    return {"csi.storage.k8s.io/pvc/name": pvc, "csi.storage.k8s.io/pvc/namespace": ns,
            "csi.storage.k8s.io/pv/name": f"pvc-{pvc}"}


@pytest.fixture
def catalog(tmp_path):
    ds = make_dataset(tmp_path / "remote", n_files=30)
    path = tmp_path / "datasets.yaml"
    path.write_text(f"datasets:\n  - {{tenant: alice, name: ds, uri: '{ds.root}'}}\n"
                    f"  - {{tenant: bob, name: private, uri: '{ds.root}'}}\n")
    return path, ds


@pytest.fixture
def controller(tmp_path, catalog):
    sock = tmp_path / "controller" / "csi.sock"
    log = open(tmp_path / "controller.log", "ab")
    proc = subprocess.Popen([*silod_cmd(), "csi-controller", "--socket", str(sock), "--datasets", str(catalog[0])],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not sock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "controller.log").read_text()
        time.sleep(0.05)
    channel = grpc.insecure_channel(f"unix://{sock}")
    yield csi_pb2_grpc.ControllerStub(channel), csi_pb2_grpc.IdentityStub(channel)
    channel.close()
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


def create(stub, name: str, params: dict[str, str], caps=(RO_MANY,), size: int = 10**9):  # type: ignore[no-untyped-def]
    return stub.CreateVolume(pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=size), volume_capabilities=list(caps),
        parameters=params), timeout=10)


def code_of(fn) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code()


def test_identity_advertises_the_controller_and_it_creates_and_deletes(controller):
    ctl, ident = controller
    caps = ident.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest(), timeout=5).capabilities
    assert [c.service.type for c in caps] == [pb.PluginCapability.Service.CONTROLLER_SERVICE]
    rpcs = ctl.ControllerGetCapabilities(pb.ControllerGetCapabilitiesRequest(), timeout=5).capabilities
    assert [c.rpc.type for c in rpcs] == [pb.ControllerServiceCapability.RPC.CREATE_DELETE_VOLUME]

    vol = create(ctl, "pvc-1", meta("ds")).volume  # the PVC is named after the dataset
    assert dict(vol.volume_context) == {"dataset": "ds", "silod.io/namespace": "alice"}
    assert vol.capacity_bytes == 10**9 and vol.volume_id
    assert create(ctl, "pvc-1", meta("ds")).volume == vol  # idempotent
    by_param = create(ctl, "pvc-2", {**meta("anything"), "dataset": "ds"}).volume  # a class per dataset
    assert by_param.volume_context["dataset"] == "ds" and by_param.volume_id != vol.volume_id

    ok = ctl.ValidateVolumeCapabilities(pb.ValidateVolumeCapabilitiesRequest(
        volume_id=vol.volume_id, volume_capabilities=[RO_MANY]), timeout=5)
    assert ok.HasField("confirmed")
    no = ctl.ValidateVolumeCapabilities(pb.ValidateVolumeCapabilitiesRequest(
        volume_id=vol.volume_id, volume_capabilities=[RWO]), timeout=5)
    assert not no.HasField("confirmed") and "read-only" in no.message
    for _ in range(2):  # deletes nothing; idempotent
        ctl.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id), timeout=5)


def test_create_refuses_what_a_tenant_may_not_have(controller):
    ctl, _ = controller
    assert code_of(lambda: create(ctl, "v", meta("private"))) == grpc.StatusCode.NOT_FOUND  # bob's, not alice's
    assert code_of(lambda: create(ctl, "v", meta("nope"))) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: create(ctl, "v", meta("ds"), caps=(RWO,))) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: create(ctl, "v", {"dataset": "ds"})) == grpc.StatusCode.INVALID_ARGUMENT  # no metadata
    assert code_of(lambda: create(ctl, "v", {**meta("ds"), "uri": "file:///etc"})) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: create(ctl, "v", {**meta("x"), "dataset": "../bob"})) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: create(ctl, "", meta("ds"))) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: create(ctl, "v", meta("ds"), caps=())) == grpc.StatusCode.INVALID_ARGUMENT


def test_a_provisioned_volume_is_published_in_its_namespace_only(controller, catalog, tmp_path):
    require_fuse()
    if os.geteuid() != 0:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("bind mounts need root")
        pytest.skip("bind mounts need root")
    ctl, _ = controller
    vol = create(ctl, "pvc-abc", meta("ds")).volume
    agent = AgentProc(tmp_path, catalog[0])
    agent.start()
    try:
        # kubelet: the PV's volumeHandle and volumeAttributes, plus the pod's info (not ephemeral).
        def publish(ns: str, target: Path):  # type: ignore[no-untyped-def]
            ctx = {**dict(vol.volume_context), "csi.storage.k8s.io/pod.name": "p",
                   "csi.storage.k8s.io/pod.namespace": ns, "csi.storage.k8s.io/pod.uid": "u"}
            return agent.node_stub().NodePublishVolume(pb.NodePublishVolumeRequest(
                volume_id=vol.volume_id, target_path=str(target), volume_capability=RO_MANY, readonly=True,
                volume_context=ctx), timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            publish("bob", agent.target("bob-pod"))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        target = agent.target("alice-pod")
        publish("alice", target)
        read_epoch(target, catalog[1], seed=1)
        agent.unpublish(vol.volume_id, target)
        assert not os.path.ismount(target)
    finally:
        agent.cleanup()


def test_validate_volume_capabilities_codes_follow_the_csi_spec(controller):
    ctl, _ = controller
    validate = ctl.ValidateVolumeCapabilities
    # A missing field is INVALID_ARGUMENT (was NOT_FOUND and OK-with-a-message).
    assert code_of(lambda: validate(pb.ValidateVolumeCapabilitiesRequest(volume_capabilities=[RO_MANY]),
                                    timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: validate(pb.ValidateVolumeCapabilitiesRequest(volume_id="silod:alice:ds:v"),
                                    timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    # A volume silod never made: NOT_FOUND.
    assert code_of(lambda: validate(pb.ValidateVolumeCapabilitiesRequest(volume_id="nope", volume_capabilities=[RO_MANY]),
                                    timeout=5)) == grpc.StatusCode.NOT_FOUND
