"""The CSI plugin under test: one ``stripefs csi`` process and the gRPC stubs kubelet and the sidecars hold.

Shared by tests/cluster/test_csi.py and the secure cluster's tests (keys from secrets).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from stripefs.csi import csi_pb2 as pb
from stripefs.csi import csi_pb2_grpc as pb_grpc
from stripefs.local_cluster import _is_mounted

from conftest import BAD_LOG_LINE, _wait_dead

MiB = 1 << 20
MODE = pb.VolumeCapability.AccessMode
MOUNT_CAP = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(), access_mode=MODE(mode=MODE.MULTI_NODE_MULTI_WRITER))


class Plugin:
    """One ``stripefs csi`` process and the stubs kubelet and the sidecars would hold."""

    def __init__(self, cluster, root: Path, key: str | None = None):
        self.cluster = cluster
        self.key = key  # the plugin's own key file: handed over as a path in $STRIPEFS_KEY, as deploy/kubernetes does
        self.root = root
        self.sock = root / "csi.sock"
        self.pods = root / "pods"  # the target root: kubelet's /var/lib/kubelet/pods
        self.state = root / "state"
        self.volumes = f"/csi-{os.getpid()}"
        self.log = root / "plugin.log"
        self.proc: subprocess.Popen | None = None
        self.pods.mkdir()

    def start(self) -> None:
        client_toml = self.root / "client.toml"  # every mount's config: one client per publish, so a small cache
        client_toml.write_text('cache_size = "64M"\n')
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "stripefs", "csi", "--endpoint", f"unix://{self.sock}", "--meta", self.cluster.meta_address,
                 "--root", self.volumes, "--target-root", str(self.pods), "--state-dir", str(self.state), "--node-id", "node-a",
                 "--client-config", str(client_toml)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={k: v for k, v in os.environ.items() if k != "STRIPEFS_KEY"} | ({"STRIPEFS_KEY": self.key} if self.key else {}))
        self.channel = grpc.insecure_channel(f"unix://{self.sock}")
        self.identity = pb_grpc.IdentityStub(self.channel)
        self.controller = pb_grpc.ControllerStub(self.channel)
        self.node = pb_grpc.NodeStub(self.channel)
        deadline = time.monotonic() + 30
        while True:  # ready once it answers a Probe, as the liveness probe asks
            assert self.proc.poll() is None, f"the plugin exited {self.proc.returncode}:\n{self.log.read_text()}"
            try:
                if self.identity.Probe(pb.ProbeRequest(), timeout=2).ready.value:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"the plugin does not answer on {self.sock}:\n{self.log.read_text()}"
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.channel.close()
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def target(self, name: str) -> str:
        """A target path as kubelet makes it: its parent exists, the target itself not yet."""
        parent = self.pods / name / "volumes" / "kubernetes.io~csi"
        parent.mkdir(parents=True, exist_ok=True)
        return str(parent / "mount")

    def create(self, name: str, capacity: int = 64 * MiB, **parameters: str) -> pb.Volume:
        rsp = self.controller.CreateVolume(pb.CreateVolumeRequest(
            name=name, capacity_range=pb.CapacityRange(required_bytes=capacity), volume_capabilities=[MOUNT_CAP],
            parameters=parameters))
        return rsp.volume

    def publish(self, volume_id: str, target: str, *, readonly: bool = False, context: dict | None = None,
                cap: pb.VolumeCapability = MOUNT_CAP, secrets: dict | None = None) -> None:
        self.node.NodePublishVolume(pb.NodePublishVolumeRequest(
            volume_id=volume_id, target_path=target, volume_capability=cap, readonly=readonly,
            volume_context=context or {}, secrets=secrets or {}))

    def unpublish(self, volume_id: str, target: str) -> None:
        self.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=target))

    def stats(self, volume_id: str, target: str) -> dict[int, pb.VolumeUsage]:
        rsp = self.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(volume_id=volume_id, volume_path=target))
        return {u.unit: u for u in rsp.usage}

    def mounts(self) -> list[str]:
        """Every mount below the target root (there should be none between tests)."""
        with open("/proc/mounts") as f:
            return [line.split()[1] for line in f if line.split()[1].startswith(str(self.pods))]

    def in_cluster(self, volume_id: str) -> Path:
        """Where the volume's directory shows in the cluster's own mount."""
        return self.cluster.mnt / volume_id.lstrip("/")


def run_plugin(cluster, key: str | None = None):
    """The body of a plugin fixture (``yield from``): a plugin for ``cluster`` (with the CURVE key file
    ``key``), stopped afterwards, with whatever a failed test left mounted unmounted."""
    root = Path(tempfile.mkdtemp(prefix="stripefs-csi-"))
    root.chmod(0o755)
    plugin = Plugin(cluster, root, key)
    plugin.start()
    try:
        yield plugin
    finally:
        plugin.stop()
        left = plugin.mounts()
        for mnt in left:  # a failed test's publishes: lazily, and their clients are stopped
            subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
        for pidfile in plugin.state.glob("*.pid"):
            _wait_dead(int(pidfile.read_text()), timeout=10, kill=True)
        # the volumes this plugin left (retained ones, a failed test's) go: the cluster is shared with other files
        shutil.rmtree(plugin.in_cluster(plugin.volumes), ignore_errors=True)
        log = plugin.log.read_text(errors="replace")
        if not any(_is_mounted(Path(m)) for m in left):
            shutil.rmtree(root, ignore_errors=True)
        bad = [line for line in log.splitlines() if BAD_LOG_LINE.search(line)]
        assert not bad, "unexpected ERROR lines in the plugin's log:\n" + "\n".join(bad[:30])
        assert not left, f"a test left these mounted: {left}"


def code(call) -> grpc.StatusCode:
    """The status code ``call()`` failed with (it must fail)."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()
