"""The CSI Identity and Node services over gRPC on a unix socket (kubelet's side of the agent).

Only the RPCs a node-only, stage-less driver needs: GetPluginInfo, GetPluginCapabilities, Probe,
NodeGetCapabilities, NodeGetInfo, NodePublishVolume, NodeUnpublishVolume. Errors use the gRPC
codes the CSI spec names: INVALID_ARGUMENT for a missing field or a bad attribute,
PERMISSION_DENIED when the pod's tenant may not read the dataset, NOT_FOUND for an unknown
dataset, ALREADY_EXISTS when the target already holds the volume with an incompatible
capability (or another volume), INTERNAL when the node cannot mount.

Read-only: a publish with readonly=false and a writer access mode is refused (INVALID_ARGUMENT)
rather than silently mounted read-only. kubelet sends readonly=true for a volume the pod mounts
`readOnly: true` (an inline volume's access mode is then SINGLE_NODE_WRITER: kubelet's default
for inline volumes, accepted because readonly is set); a PersistentVolume of ReadOnlyMany has a
reader-only access mode, read-only whatever the flag.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

from estimator.errors import UserError
from fuse_client.agent.controller import (
    CTX_NAMESPACE,
    READ_ONLY_MODES,
    ControllerService,
    tenant_of_namespace,
)
from fuse_client.agent.csi import DRIVER_NAME, csi_pb2, csi_pb2_grpc
from fuse_client.agent.datasets import DatasetDenied, DatasetResolver, check_name
from fuse_client.agent.volumes import AlreadyPublished, MountError, VolumeManager

log = logging.getLogger("silod.agent")

POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_NAME = "csi.storage.k8s.io/pod.name"
POD_UID = "csi.storage.k8s.io/pod.uid"
VERSION = "0.1.0"
MAX_ID = 1024


class IdentityService(csi_pb2_grpc.IdentityServicer):
    def __init__(self, ready: Callable[[], bool] = lambda: True, controller: bool = False):
        self.ready = ready
        self.controller = controller

    def GetPluginInfo(self, request, context):  # noqa: N802 - gRPC method names
        return csi_pb2.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=VERSION)

    def GetPluginCapabilities(self, request, context):  # noqa: N802
        if not self.controller:
            return csi_pb2.GetPluginCapabilitiesResponse()  # the node plugin: no controller service
        svc = csi_pb2.PluginCapability.Service(type=csi_pb2.PluginCapability.Service.CONTROLLER_SERVICE)
        return csi_pb2.GetPluginCapabilitiesResponse(capabilities=[csi_pb2.PluginCapability(service=svc)])

    def Probe(self, request, context):  # noqa: N802
        from google.protobuf import wrappers_pb2

        return csi_pb2.ProbeResponse(ready=wrappers_pb2.BoolValue(value=bool(self.ready())))


class NodeService(csi_pb2_grpc.NodeServicer):
    def __init__(self, node: str, volumes: VolumeManager, resolver: DatasetResolver, namespace_prefix: str = ""):
        self.node = node
        self.volumes = volumes
        self.resolver = resolver
        self.namespace_prefix = namespace_prefix

    def NodeGetCapabilities(self, request, context):  # noqa: N802
        return csi_pb2.NodeGetCapabilitiesResponse()  # no staging, no stats

    def NodeGetInfo(self, request, context):  # noqa: N802
        return csi_pb2.NodeGetInfoResponse(node_id=self.node)

    def NodePublishVolume(self, request, context):  # noqa: N802
        vid, target = request.volume_id, request.target_path
        if not vid or len(vid) > MAX_ID:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "volume_id is required")
        if not target or len(target) > 4096:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "target_path is required")
        if not request.HasField("volume_capability") or request.volume_capability.HasField("block"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "silod volumes are filesystem (mount) volumes")
        mode = request.volume_capability.access_mode.mode
        if not request.readonly and mode not in READ_ONLY_MODES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"volume {vid}: a writable publish ({csi_pb2.VolumeCapability.AccessMode.Mode.Name(mode)},"
                          f" readonly false) of a read-only dataset; mount it readOnly: true")
        ctx = dict(request.volume_context)
        namespace = ctx.get(POD_NAMESPACE, "")
        if not namespace:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no {POD_NAMESPACE} in the volume context: the CSIDriver"
                                                            f" object must set podInfoOnMount: true")
        tenant = tenant_of_namespace(namespace, self.namespace_prefix, context)
        owner_ns = ctx.get(CTX_NAMESPACE)
        if owner_ns is not None and owner_ns != namespace:
            # A volume provisioned for a PVC of another namespace (controller.py): never theirs.
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"volume {vid} was provisioned for namespace {owner_ns},"
                                                             f" not {namespace}")
        try:
            dataset = check_name(ctx.get("dataset", ""), "volumeAttributes.dataset")
            src = self.resolver.resolve(tenant, dataset)
            self.volumes.publish(vid, target, src, namespace, ctx.get(POD_NAME, ""), ctx.get(POD_UID, ""),
                                 access_mode=int(mode), readonly=bool(request.readonly))
        except AlreadyPublished as exc:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except DatasetDenied as exc:
            code = grpc.StatusCode.NOT_FOUND if "no dataset" in str(exc) else grpc.StatusCode.PERMISSION_DENIED
            if "not a valid" in str(exc):
                code = grpc.StatusCode.INVALID_ARGUMENT
            context.abort(code, str(exc))
        except MountError as exc:
            log.error("publish %s: %s", vid, exc)
            context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except UserError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return csi_pb2.NodePublishVolumeResponse()

    def NodeUnpublishVolume(self, request, context):  # noqa: N802
        if not request.volume_id or not request.target_path:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "volume_id and target_path are required")
        try:
            self.volumes.check_target(request.target_path)
            self.volumes.unpublish(request.volume_id, request.target_path)
        except UserError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except MountError as exc:
            context.abort(grpc.StatusCode.INTERNAL, str(exc))
        return csi_pb2.NodeUnpublishVolumeResponse()


class Agent:
    """The gRPC server on `socket` plus the node's volumes; `start()` restores the previous
    agent's volumes before answering kubelet."""

    def __init__(self, socket: Path, node: str, volumes: VolumeManager, resolver: DatasetResolver,
                 namespace_prefix: str = "", workers: int = 4):
        self.socket = socket
        self.volumes = volumes
        self.node_service = NodeService(node, volumes, resolver, namespace_prefix)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
        csi_pb2_grpc.add_IdentityServicer_to_server(IdentityService(), self.server)
        csi_pb2_grpc.add_NodeServicer_to_server(self.node_service, self.server)

    def start(self) -> list[str]:
        repaired = self.volumes.recover(self.node_service.resolver)
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        if self.socket.exists():
            self.socket.unlink()  # a previous agent's socket
        self.server.add_insecure_port(f"unix://{self.socket}")
        self.server.start()
        os.chmod(self.socket, 0o600)  # kubelet (root) only
        return repaired

    def stop(self, unmount_all: bool = False) -> None:
        self.server.stop(grace=5).wait()
        self.volumes.close(unmount_all=unmount_all)


class ControllerServer:
    """The CSI Identity and Controller services on `socket` (`silod csi-controller`, next to the
    csi-provisioner sidecar)."""

    def __init__(self, socket: Path, resolver: DatasetResolver, namespace_prefix: str = "", workers: int = 4):
        self.socket = socket
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
        csi_pb2_grpc.add_IdentityServicer_to_server(IdentityService(controller=True), self.server)
        csi_pb2_grpc.add_ControllerServicer_to_server(ControllerService(resolver, namespace_prefix), self.server)

    def start(self) -> None:
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        if self.socket.exists():
            self.socket.unlink()
        self.server.add_insecure_port(f"unix://{self.socket}")
        self.server.start()
        os.chmod(self.socket, 0o600)

    def stop(self) -> None:
        self.server.stop(grace=5).wait()
