"""The CSI messages and service stubs, compiled from csi.proto when first imported.

`grpc.protos_and_services` runs grpcio-tools' protoc in-process, so the .proto next to this file
is the single source (no generated code to keep in sync). Import `csi_pb2` (messages) and
`csi_pb2_grpc` (stubs, servicers, `add_*_to_server`) from here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc

_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding the fuse_client package
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

csi_pb2, csi_pb2_grpc = grpc.protos_and_services("fuse_client/agent/csi.proto")

DRIVER_NAME = "silod.io"

__all__ = ["DRIVER_NAME", "csi_pb2", "csi_pb2_grpc"]
