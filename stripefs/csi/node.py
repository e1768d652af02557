"""The CSI Node service: a volume becomes visible at a pod's target path as a subtree mount of its own.

    NodePublishVolume    stripefs mount META TARGET -o subdir=VOLUME,allow_other[,ro|dataset][,key=...]
    NodeUnpublishVolume  unmount TARGET (lazily when busy, and when its client is dead), remove it
    NodeGetVolumeStats   the volume's quota: bytes and inodes used, limit, available
    NodeGetCapabilities, NodeGetInfo

Why one mount per published volume, and not a bind mount of one node-wide
mount (docs/kubernetes.md has the longer answer): read-only, dataset mode and
the CURVE key are options of a whole mount, and they differ per volume (a
training pod's data set in dataset mode beside its read-write checkpoint
volume); a subtree mount's key can be one whose keyring entry restricts it to
the team's tree, which the metadata daemon enforces, whereas a node-wide mount
holds a key that reaches every volume, and a bind mount hides the rest by path
only; and one volume's client failing, or being unmounted, touches no other pod.
The cost is one client process (and cache) per published volume.

Each publish leaves a small record in the plugin's state directory (a host
directory that outlives the plugin's container): what is mounted where, and the
client's pid, so a restarted plugin still answers stats and unpublishes. The
mount clients are started detached (``stripefs mount`` forks into its own
session), so a plugin restart leaves pods' mounts serving. The key a
publish secret hands over lives in a file of mode 0600 in the state directory
only while the client starts (it reads it before answering), then is removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from ..cluster import mount_of
from . import csi_pb2 as pb
from . import csi_pb2_grpc as pb_grpc
from . import params as sc
from .namespace import CsiError, Namespace, split_path
from .service import check_capability, handler

log = logging.getLogger(__name__)

EPHEMERAL = "csi.storage.k8s.io/ephemeral"
#: the secret's key holding a NAME.key_secret file's text (docs/kubernetes.md)
SECRET_KEY = "key"
MOUNT_TIMEOUT_S = 60.0
_READ_ONLY_MODES = {pb.VolumeCapability.AccessMode.SINGLE_NODE_READER_ONLY, pb.VolumeCapability.AccessMode.MULTI_NODE_READER_ONLY}


class Node(pb_grpc.NodeServicer):
    def __init__(self, ns: Namespace, *, node_id: str, volume_root: str, target_root: str, state_dir: str, key_file: str | None,
                 client_config: str | None = None):
        self.ns = ns
        self.node_id = node_id
        self.volume_root = "/" + "/".join(n.decode() for n in split_path(volume_root))
        self.target_root = Path(os.path.realpath(target_root))
        self.state_dir = Path(state_dir)
        self.key_file = key_file
        self.client_config = client_config
        for sub in ("", "logs", "keys"):
            (self.state_dir / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    # -- paths and records ----------------------------------------------------------------------

    def _target(self, target_path: str) -> Path:
        """``target_path``, which must lie below the plugin's target root (kubelet's pods directory):
        the plugin mounts and removes directories as root, so it touches nothing else."""
        if not target_path:
            raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, "target_path is missing")
        if not os.path.isabs(target_path):
            raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, f"target_path {target_path!r} is not absolute")
        parent = Path(os.path.realpath(os.path.dirname(os.path.normpath(target_path))))
        target = parent / os.path.basename(os.path.normpath(target_path))
        if self.target_root not in target.parents:
            raise CsiError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"target_path {target_path} is outside {self.target_root}, where this plugin mounts volumes (--target-root)")
        return target

    def _record_path(self, target: Path, suffix: str = ".json") -> Path:
        return self.state_dir / (hashlib.sha256(str(target).encode()).hexdigest()[:32] + suffix)

    def _record(self, target: Path) -> dict | None:
        try:
            return json.loads(self._record_path(target).read_text())
        except (OSError, ValueError):
            return None

    def _lock(self, target: Path) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(str(target), threading.Lock())

    def _mounted(self, target: Path) -> bool:
        found = mount_of(target)
        return found is not None and found[1] == target

    # -- publish ------------------------------------------------------------------------------

    def _volume(self, request) -> tuple[str, list[str]]:
        """The directory to mount and the mount's -o options for this request."""
        ctx = dict(request.volume_context)
        cap = request.volume_capability
        options = sc.mount_options(list(cap.mount.mount_flags) + [ctx.get("mountOptions", "")])
        if ctx.get(EPHEMERAL) == "true":
            path = ctx.get("path", "")
            if not path:
                raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, "an inline volume needs volumeAttributes.path: the directory (a data set) to mount")
            split_path(path)
            if "," in path:  # it becomes -o subdir=PATH: a comma would smuggle in options of the pod author's choosing
                raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, f"volumeAttributes.path {path!r}: a comma is not allowed in it")
            if self.key_file and not request.secrets.get(SECRET_KEY):
                # the pod's author names the directory: in a secure cluster only the key of the pod's team,
                # whose keyring entry bounds what it reaches (subdir), may mount it, never the node's own
                raise CsiError(grpc.StatusCode.PERMISSION_DENIED,
                               "an inline stripefs volume needs nodePublishSecretRef: a Secret in the pod's namespace whose "
                               f"'{SECRET_KEY}' holds the team's NAME.key_secret (docs/kubernetes.md)")
            if ctx.get("dataset", "true") == "true" and "dataset" not in options:
                options.append("dataset")  # training data: warm opens answered by the kernel, read-only
        else:
            path = sc.volume_path(self.volume_root, request.volume_id)
        attr = self.ns.lookup(path)
        if attr is None:
            raise CsiError(grpc.StatusCode.NOT_FOUND, f"volume {request.volume_id}: {path} does not exist in the cluster")
        read_only = request.readonly or cap.access_mode.mode in _READ_ONLY_MODES
        if read_only and "dataset" not in options and "ro" not in options:
            options.append("ro")
        return path, options

    @handler
    def NodePublishVolume(self, request, context):
        if not request.volume_id:
            raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, "volume_id is missing")
        target = self._target(request.target_path)
        if not request.HasField("volume_capability"):
            raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, "volume_capability is missing")
        check_capability(request.volume_capability)
        path, options = self._volume(request)
        with self._lock(target):
            if self._mounted(target):
                record = self._record(target)
                if record and record["volume_id"] == request.volume_id and record["path"] == path and record["options"] == options:
                    return pb.NodePublishVolumeResponse()
                raise CsiError(grpc.StatusCode.ALREADY_EXISTS, f"{target} is already published, with other options or another volume")
            target.mkdir(mode=0o750, parents=True, exist_ok=True)
            self._mount(target, path, options, request.volume_id, dict(request.secrets).get(SECRET_KEY))
        log.info("published %s (%s) at %s, -o %s", request.volume_id, path, target, ",".join(options) or "-")
        return pb.NodePublishVolumeResponse()

    def _mount(self, target: Path, path: str, options: list[str], volume_id: str, key_text: str | None) -> None:
        key_path = None
        all_options = [f"subdir={path}", "allow_other", *options]
        if self.client_config:
            all_options.append(f"config={self.client_config}")
        if key_text:
            key_path = self.state_dir / "keys" / self._record_path(target, ".key_secret").name
            fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(key_text)
            all_options.append(f"key={key_path}")
        elif self.key_file:
            all_options.append(f"key={self.key_file}")
        pidfile = self._record_path(target, ".pid")
        command = [sys.executable, "-m", "stripefs", "mount", ",".join(self.ns.addresses), str(target),
                   "-o", ",".join(all_options), "--log", str(self.state_dir / "logs" / self._record_path(target, ".log").name),
                   "--pidfile", str(pidfile)]
        try:
            res = subprocess.run(command, capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise CsiError(grpc.StatusCode.DEADLINE_EXCEEDED, f"mounting {path} at {target} took over {MOUNT_TIMEOUT_S:.0f}s") from None
        finally:
            if key_path is not None:
                key_path.unlink(missing_ok=True)  # the client read it before answering; keep no secret on disk
        if res.returncode:
            why = (res.stderr or res.stdout).strip().splitlines()
            code = grpc.StatusCode.UNAVAILABLE if res.returncode == 2 else grpc.StatusCode.INTERNAL
            raise CsiError(code, f"mounting {path} at {target} failed: {why[-1] if why else f'exit {res.returncode}'}")
        pid = int(pidfile.read_text()) if pidfile.exists() else 0
        record = {"volume_id": volume_id, "path": path, "options": options, "target": str(target), "pid": pid}
        tmp = self._record_path(target, ".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self._record_path(target))

    # -- unpublish ----------------------------------------------------------------------------

    @handler
    def NodeUnpublishVolume(self, request, context):
        if not request.volume_id:
            raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, "volume_id is missing")
        target = self._target(request.target_path)
        with self._lock(target):
            record = self._record(target)
            if self._mounted(target):
                self._unmount(target)
            pid = record.get("pid") if record else 0
            if pid:
                _wait_exit(pid, target)
            try:
                target.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise CsiError(grpc.StatusCode.INTERNAL, f"{target} stays: {exc.strerror} (something else is mounted there, or it has files)") from None
            for suffix in (".json", ".pid"):
                self._record_path(target, suffix).unlink(missing_ok=True)
        log.info("unpublished %s from %s", request.volume_id, target)
        return pb.NodeUnpublishVolumeResponse()

    def _unmount(self, target: Path) -> None:
        res = subprocess.run(["fusermount3", "-u", str(target)], capture_output=True, text=True)
        if res.returncode and self._mounted(target):
            # busy (a process of the pod still in it) or its client is gone: detach it now, the kernel
            # finishes when the last user lets go; the pod is being torn down anyway
            log.info("%s: %s; unmounting lazily", target, res.stderr.strip())
            res = subprocess.run(["fusermount3", "-u", "-z", str(target)], capture_output=True, text=True)
        if self._mounted(target):
            raise CsiError(grpc.StatusCode.INTERNAL, f"cannot unmount {target}: {res.stderr.strip()}")

    # -- stats and info -----------------------------------------------------------------------

    @handler
    def NodeGetVolumeStats(self, request, context):
        if not request.volume_id or not request.volume_path:
            raise CsiError(grpc.StatusCode.INVALID_ARGUMENT, "volume_id and volume_path are both needed")
        target = self._target(request.volume_path)
        record = self._record(target)
        if record is None or record["volume_id"] != request.volume_id or not self._mounted(target):
            raise CsiError(grpc.StatusCode.NOT_FOUND, f"volume {request.volume_id} is not published at {request.volume_path}")
        try:
            st = os.statvfs(target)
        except OSError as exc:
            return pb.NodeGetVolumeStatsResponse(volume_condition=pb.VolumeCondition(
                abnormal=True, message=f"the mount at {target} does not answer ({exc.strerror}); the pod needs restarting"))
        attr = self.ns.lookup(record["path"])
        if attr is None:
            raise CsiError(grpc.StatusCode.NOT_FOUND, f"volume {request.volume_id}: {record['path']} no longer exists")
        quota = self.ns.quota(attr.ino)
        usage = []
        if quota and quota.max_bytes:
            usage.append(pb.VolumeUsage(unit=pb.VolumeUsage.BYTES, total=quota.max_bytes, used=quota.used_bytes,
                                        available=max(0, quota.max_bytes - quota.used_bytes)))
        else:  # no byte limit: the cluster's space
            total = st.f_blocks * st.f_frsize
            usage.append(pb.VolumeUsage(unit=pb.VolumeUsage.BYTES, total=total, available=st.f_bavail * st.f_frsize,
                                        used=quota.used_bytes if quota else total - st.f_bfree * st.f_frsize))
        if quota and quota.max_inodes:
            usage.append(pb.VolumeUsage(unit=pb.VolumeUsage.INODES, total=quota.max_inodes, used=quota.used_inodes,
                                        available=max(0, quota.max_inodes - quota.used_inodes)))
        return pb.NodeGetVolumeStatsResponse(usage=usage, volume_condition=pb.VolumeCondition(abnormal=False, message="mounted"))

    @handler
    def NodeGetCapabilities(self, request, context):
        rpc = pb.NodeServiceCapability.RPC
        return pb.NodeGetCapabilitiesResponse(capabilities=[pb.NodeServiceCapability(rpc=rpc(type=rpc.GET_VOLUME_STATS))])

    @handler
    def NodeGetInfo(self, request, context):
        return pb.NodeGetInfoResponse(node_id=self.node_id)


def _wait_exit(pid: int, target: Path, timeout: float = 10.0) -> None:
    """Wait for the mount client ``pid`` to exit after its unmount (it commits what open files buffered);
    a pid that no longer names the client of ``target`` (it exited long ago, the number was reused) is not waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if os.fsencode(str(target)) not in f.read().split(b"\0"):
                    return
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return
        except OSError:
            return
        time.sleep(0.05)
    log.warning("mount client %d still runs %.0fs after its unmount", pid, timeout)
