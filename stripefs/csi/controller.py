"""The CSI Controller service: a volume is a directory under the plugin's root, with a quota and a layout.

    CreateVolume            mkdir ROOT[/SUBDIR]/NAME; quota = the requested bytes (and inodes, a parameter);
                            the StorageClass's layout and cold-tier policy on it
    DeleteVolume            remove the tree, or (onDelete: retain) move it to ROOT[/SUBDIR]/.retained/NAME-TIME
    ControllerExpandVolume  raise the quota (never lowers it); nothing to do on the node
    ValidateVolumeCapabilities, ControllerGetCapabilities

The volume id is the directory's path in the cluster (``/k8s/pvc-...``): the
plugin keeps no state of its own, so any replica of the controller, or one that
just restarted, serves any volume. CreateVolume is idempotent by name, as the
spec asks: the same name with the same capacity returns the volume again; with
another, ALREADY_EXISTS. A volume is never promised more bytes than the storage
nodes hold (OUT_OF_RANGE).
"""

from __future__ import annotations

import logging
import posixpath
import time

import grpc

from ..common import protocol as p
from . import csi_pb2 as pb
from . import csi_pb2_grpc as pb_grpc
from . import params as sc
from .namespace import CsiError, Namespace, split_path
from .service import check_capabilities, handler

log = logging.getLogger(__name__)

#: set on the directory of a volume whose StorageClass says onDelete: retain. In the trusted namespace:
#: the kernel lets only CAP_SYS_ADMIN see or change it through a mount, so a pod cannot flip it
RETAIN_XATTR = b"trusted.stripefs.csi.on_delete"


class Controller(pb_grpc.ControllerServicer):
    def __init__(self, ns: Namespace, root: str):
        self.ns = ns
        self.root = "/" + "/".join(n.decode() for n in split_path(root))

    def volume_path(self, volume_id: str) -> str:
        return sc.volume_path(self.root, volume_id)

    def _attr(self, volume_id: str) -> p.Attr:
        attr = self.ns.lookup(self.volume_path(volume_id))
        if attr is None:
            raise CsiError(grpc.StatusCode.NOT_FOUND, f"volume {volume_id} does not exist")
        return attr

    def _capacity(self, cap: pb.CapacityRange) -> int:
        want = cap.required_bytes or cap.limit_bytes
        if cap.required_bytes < 0 or cap.limit_bytes < 0:
            raise CsiError(grpc.StatusCode.OUT_OF_RANGE, "a capacity cannot be negative")
        if cap.limit_bytes and cap.required_bytes > cap.limit_bytes:
            raise CsiError(grpc.StatusCode.OUT_OF_RANGE, f"required_bytes {cap.required_bytes} is above limit_bytes {cap.limit_bytes}")
        total = self.ns.total_bytes()
        if want > total:
            raise CsiError(grpc.StatusCode.OUT_OF_RANGE,
                           f"{want} bytes asked for; the cluster's storage nodes hold {total} bytes in all: ask for less, or add nodes")
        return want

    @handler
    def CreateVolume(self, request, context):
        if not request.name:
            raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, "name is missing")
        if not sc.NAME.fullmatch(request.name):
            raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, f"name {request.name!r}: letters, digits, '.', '_' and '-' only")
        check_capabilities(request.volume_capabilities)
        if request.HasField("volume_content_source"):
            raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, "stripefs volumes cannot be created from a snapshot or another volume")
        settings = sc.check(dict(request.parameters))
        capacity = self._capacity(request.capacity_range)
        path = f"{self.root}/{settings['subdir']}/{request.name}" if settings["subdir"] else f"{self.root}/{request.name}"
        attr, made = self.ns.make_dirs(path, settings["mode"])
        try:
            if not made:
                # there already: the same volume asked for again (a retry), or one half made by a plugin that
                # stopped between mkdir and quota (no quota yet: finished now); another size is another volume
                quota = self.ns.quota(attr.ino)
                if quota is not None and quota.max_bytes != capacity:
                    raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"volume {request.name} exists with a capacity of {quota.max_bytes} bytes, not {capacity}")
            self._apply(attr.ino, capacity, settings)
        except Exception:
            if made:  # nothing half-made stays behind: the provisioner retries from the start
                self.ns.remove_tree(path)
            raise
        log.info("volume %s: %s, %d bytes", "made" if made else "already there", path, capacity)
        return pb.CreateVolumeResponse(volume=pb.Volume(volume_id=path, capacity_bytes=capacity))

    def _apply(self, ino: int, capacity: int, settings: dict) -> None:
        if settings["retain"]:
            self.ns.call(p.SetxattrReq(ino=ino, name=RETAIN_XATTR, value=b"retain"))
        if capacity or settings["inodes"]:
            self.ns.call(p.QuotaSetReq(ino=ino, max_bytes=capacity or None, max_inodes=settings["inodes"]))
        if settings["chunk_size"] or settings["stripe_count"] or settings["redundancy"]:
            self.ns.call(p.SetLayoutReq(ino=ino, chunk_size=settings["chunk_size"], stripe_count=settings["stripe_count"],
                                        redundancy=settings["redundancy"]))
        if settings["tier"]:
            try:
                self.ns.call(p.TierPolicySetReq(ino=ino, tier=settings["tier"], after_s=settings["tier_after_s"]))
            except CsiError as exc:
                if exc.code == grpc.StatusCode.NOT_FOUND:
                    raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, f"tierTo {settings['tier']!r}: {exc.message} ('stripefs tier list')") from None
                raise

    @handler
    def DeleteVolume(self, request, context):
        try:
            path = self.volume_path(request.volume_id)
        except CsiError as exc:
            if exc.code == grpc.StatusCode.NOT_FOUND:
                return pb.DeleteVolumeResponse()  # the spec: a volume that is not there is deleted
            raise
        if self._retains(path):
            parent, name = posixpath.split(path)
            new = f"{parent}/{sc.RETAINED}/{name}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
            self.ns.rename(path, new)
            log.info("volume %s retained as %s", path, new)
        elif self.ns.remove_tree(path):
            log.info("volume %s removed", path)
        return pb.DeleteVolumeResponse()

    def _retains(self, path: str) -> bool:
        """Whether the volume's StorageClass said onDelete: retain: a marker xattr on the directory (set at
        creation), since DeleteVolume is not given the StorageClass's parameters."""
        attr = self.ns.lookup(path)
        if attr is None:
            return False
        try:
            (rsp,) = self.ns.call(p.GetxattrReq(ino=attr.ino, name=RETAIN_XATTR))
        except CsiError as exc:
            if exc.code == grpc.StatusCode.NOT_FOUND:  # no marker: delete. Anything else: fail, remove nothing
                return False
            raise
        return rsp.value == b"retain"

    @handler
    def ControllerExpandVolume(self, request, context):
        attr = self._attr(request.volume_id)
        capacity = self._capacity(request.capacity_range)
        quota = self.ns.quota(attr.ino)
        have = quota.max_bytes if quota else 0
        if capacity > have:
            self.ns.call(p.QuotaSetReq(ino=attr.ino, max_bytes=capacity))
            log.info("volume %s expanded from %d to %d bytes", request.volume_id, have, capacity)
        return pb.ControllerExpandVolumeResponse(capacity_bytes=max(capacity, have), node_expansion_required=False)

    @handler
    def ValidateVolumeCapabilities(self, request, context):
        self._attr(request.volume_id)
        check_capabilities(request.volume_capabilities)
        return pb.ValidateVolumeCapabilitiesResponse(confirmed=pb.ValidateVolumeCapabilitiesResponse.Confirmed(
            volume_context=request.volume_context, volume_capabilities=request.volume_capabilities, parameters=request.parameters))

    @handler
    def ControllerGetCapabilities(self, request, context):
        rpc = pb.ControllerServiceCapability.RPC
        return pb.ControllerGetCapabilitiesResponse(capabilities=[
            pb.ControllerServiceCapability(rpc=rpc(type=t)) for t in (rpc.CREATE_DELETE_VOLUME, rpc.EXPAND_VOLUME)])


