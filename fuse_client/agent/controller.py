"""The CSI Controller service: dynamic provisioning for PVCs of the silod StorageClass.

A silod volume is a read-only view of a tenant's registered dataset, so "provisioning" creates
no storage: CreateVolume checks that the PVC's tenant (its namespace, which the
external-provisioner sidecar passes with `--extra-create-metadata`) owns the dataset, and
returns a volume whose context names the dataset and that namespace. The node agent publishes it
like an inline volume, and refuses it to pods of any other namespace. DeleteVolume deletes
nothing: the dataset stays registered and each node's cache of it is shared with the tenant's
other volumes (a dataset mount is released when its last volume is unpublished).

Which dataset: the StorageClass parameter `dataset` (a class per dataset), else the PVC's name
(Fluid's convention: the claim is named after the dataset). The whole answer is a function of
the request, so CreateVolume is idempotent without state: the same PV name gives the same
volume id.
"""

from __future__ import annotations

import logging

import grpc

from estimator.errors import UserError
from fuse_client.agent.csi import csi_pb2, csi_pb2_grpc
from fuse_client.agent.datasets import DatasetDenied, DatasetResolver, check_name

log = logging.getLogger("silod.csi-controller")

PVC_NAME = "csi.storage.k8s.io/pvc/name"
PVC_NAMESPACE = "csi.storage.k8s.io/pvc/namespace"
PV_NAME = "csi.storage.k8s.io/pv/name"
CTX_NAMESPACE = "silod.io/namespace"  # in a provisioned volume's context: the only namespace that may use it
PARAM_DATASET = "dataset"
VOLUME_PREFIX = "silod:"
READ_ONLY_MODES = {csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_READER_ONLY,
                   csi_pb2.VolumeCapability.AccessMode.MULTI_NODE_READER_ONLY}
MAX_NAME = 128


def tenant_of_namespace(namespace: str, prefix: str, context) -> str:  # type: ignore[no-untyped-def]
    """The tenant whose namespace is `namespace` (tenant T's namespace is prefix + T); aborts the
    gRPC call with PERMISSION_DENIED for a namespace of no tenant."""
    if not namespace.startswith(prefix) or len(namespace) == len(prefix):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, f"namespace {namespace} belongs to no silod tenant")
    return namespace[len(prefix):]


def volume_id(namespace: str, dataset: str, name: str) -> str:
    return f"{VOLUME_PREFIX}{namespace}:{dataset}:{name}"


def parse_volume_id(vid: str) -> tuple[str, str, str] | None:
    if not vid.startswith(VOLUME_PREFIX) or len(vid) > 3 * MAX_NAME + 16:
        return None
    parts = vid[len(VOLUME_PREFIX):].split(":")
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 and all(parts) else None


def capabilities_problem(caps) -> str | None:  # type: ignore[no-untyped-def]
    if not caps:
        return "volume_capabilities is required"
    for cap in caps:
        if cap.HasField("block"):
            return "silod volumes are file systems (mount), not block devices"
        if cap.access_mode.mode not in READ_ONLY_MODES:
            name = csi_pb2.VolumeCapability.AccessMode.Mode.Name(cap.access_mode.mode)
            return f"access mode {name}: silod volumes are read-only datasets (use ReadOnlyMany)"
    return None


class ControllerService(csi_pb2_grpc.ControllerServicer):
    def __init__(self, resolver: DatasetResolver, namespace_prefix: str = ""):
        self.resolver = resolver
        self.namespace_prefix = namespace_prefix

    def ControllerGetCapabilities(self, request, context):  # noqa: N802 - gRPC method names
        rpc = csi_pb2.ControllerServiceCapability.RPC(type=csi_pb2.ControllerServiceCapability.RPC.CREATE_DELETE_VOLUME)
        return csi_pb2.ControllerGetCapabilitiesResponse(capabilities=[csi_pb2.ControllerServiceCapability(rpc=rpc)])

    def CreateVolume(self, request, context):  # noqa: N802
        if not request.name or len(request.name) > MAX_NAME:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name is required (at most 128 characters)")
        problem = capabilities_problem(request.volume_capabilities)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        params = dict(request.parameters)
        unknown = sorted(k for k in params if k != PARAM_DATASET and not k.startswith("csi.storage.k8s.io/"))
        if unknown:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown StorageClass parameters {unknown}; silod takes"
                                                            f" only {PARAM_DATASET!r}")
        namespace = params.get(PVC_NAMESPACE, "")
        if not namespace:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no {PVC_NAMESPACE} parameter: run the csi-provisioner"
                                                            f" sidecar with --extra-create-metadata")
        tenant = tenant_of_namespace(namespace, self.namespace_prefix, context)
        try:
            dataset = check_name(params.get(PARAM_DATASET) or params.get(PVC_NAME, ""), "dataset (StorageClass"
                                 " parameter `dataset`, else the PVC's name)")
            # Only whether the tenant has it: provisioning reads no data, so it never asks for the
            # dataset's credential (its token is bound to no node: the scheduler would answer 403).
            self.resolver.resolve(tenant, dataset, credential=False)
        except DatasetDenied as exc:
            code = grpc.StatusCode.INVALID_ARGUMENT if "not a valid" in str(exc) else (
                grpc.StatusCode.NOT_FOUND if "no dataset" in str(exc) else grpc.StatusCode.PERMISSION_DENIED)
            context.abort(code, str(exc))
        except UserError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))  # the scheduler did not answer: the CO retries
        required = max(request.capacity_range.required_bytes, 0)
        log.info("provisioned %s: dataset %s of tenant %s", request.name, dataset, tenant)
        return csi_pb2.CreateVolumeResponse(volume=csi_pb2.Volume(
            capacity_bytes=required, volume_id=volume_id(namespace, dataset, request.name),
            volume_context={"dataset": dataset, CTX_NAMESPACE: namespace}))

    def DeleteVolume(self, request, context):  # noqa: N802
        if not request.volume_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "volume_id is required")
        # Nothing to delete (the dataset stays registered; node caches are shared). A volume id we
        # never made is treated as already deleted, as the spec asks of an unknown id.
        return csi_pb2.DeleteVolumeResponse()

    def ValidateVolumeCapabilities(self, request, context):  # noqa: N802
        # CSI spec: a missing volume_id or volume_capabilities is INVALID_ARGUMENT; an unknown
        # volume NOT_FOUND; unsupported capabilities an OK answer without `confirmed`.
        if not request.volume_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "volume_id is required")
        if not request.volume_capabilities:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "volume_capabilities is required")
        if parse_volume_id(request.volume_id) is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"{request.volume_id!r} is not a silod volume")
        problem = capabilities_problem(request.volume_capabilities)
        if problem:
            return csi_pb2.ValidateVolumeCapabilitiesResponse(message=problem)
        return csi_pb2.ValidateVolumeCapabilitiesResponse(confirmed=csi_pb2.ValidateVolumeCapabilitiesResponse.Confirmed(
            volume_context=dict(request.volume_context), volume_capabilities=list(request.volume_capabilities)))
