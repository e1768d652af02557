"""What the three CSI services share: the error boundary, capability checks, the Identity service.

Errors are mapped once, here (``handler``): a ``CsiError`` becomes its gRPC
status and message; anything else is a bug, logged with its traceback and
answered INTERNAL, and the plugin keeps serving. Requests are never logged
whole: their ``secrets`` maps hold CURVE keys (csi.proto marks them
``csi_secret``); log lines name the call, the volume and the target only.
"""

from __future__ import annotations

import functools
import logging

import grpc
from google.protobuf import wrappers_pb2

from .. import __version__
from . import csi_pb2 as pb
from . import csi_pb2_grpc as pb_grpc
from .namespace import CsiError

log = logging.getLogger(__name__)

DRIVER_NAME = "csi.stripefs.io"


def handler(method):
    """Run one CSI call; map its failure to the gRPC status the spec names."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        what = " ".join(f"{f}={getattr(request, f)}" for f in ("name", "volume_id", "target_path") if getattr(request, f, ""))
        log.debug("%s %s", method.__name__, what)
        try:
            return method(self, request, context)
        except CsiError as exc:
            log.info("%s %s: %s %s", method.__name__, what, exc.code.name, exc.message)
            context.abort(exc.code, exc.message)
        except Exception:
            log.exception("%s %s failed", method.__name__, what)
            context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__} failed inside the plugin; its log has the traceback")

    return wrapper


def check_capabilities(caps) -> None:
    """Every capability a mount (stripefs is a file system, never a block device) with a known access mode."""
    if not caps:
        raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, "volume_capabilities are missing")
    for cap in caps:
        check_capability(cap)


def check_capability(cap) -> None:
    if cap is None or not (cap.HasField("mount") or cap.HasField("block")):
        raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, "volume_capability is missing (or names neither mount nor block access)")
    if cap.HasField("block"):
        raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, "stripefs volumes are file systems: block access is not supported (volumeMode: Filesystem)")
    if cap.mount.fs_type not in ("", "fuse.stripefs", "stripefs"):
        raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, f"fs_type {cap.mount.fs_type!r}: stripefs volumes are fuse.stripefs")
    if cap.access_mode.mode == pb.VolumeCapability.AccessMode.UNKNOWN:
        raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, "volume_capability.access_mode is missing")


class Identity(pb_grpc.IdentityServicer):
    def __init__(self, controller: bool):
        self.controller = controller

    @handler
    def GetPluginInfo(self, request, context):
        return pb.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    @handler
    def GetPluginCapabilities(self, request, context):
        caps = [pb.PluginCapability(volume_expansion=pb.PluginCapability.VolumeExpansion(type=pb.PluginCapability.VolumeExpansion.ONLINE))]
        if self.controller:
            caps.insert(0, pb.PluginCapability(service=pb.PluginCapability.Service(type=pb.PluginCapability.Service.CONTROLLER_SERVICE)))
        return pb.GetPluginCapabilitiesResponse(capabilities=caps)

    @handler
    def Probe(self, request, context):
        return pb.ProbeResponse(ready=wrappers_pb2.BoolValue(value=True))
