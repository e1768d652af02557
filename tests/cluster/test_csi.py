"""The CSI plugin (``stripefs csi``), driven over its Unix socket as kubelet and the sidecars drive it.

A real plugin process against the session's real cluster; every publish is a real
subtree mount. Covers a PVC's life (create, publish at two targets, write through one
and read through the other, stats, expand, unpublish, delete), an inline ephemeral
volume of a data set, a read-only publish, a plugin restarted (and a mount client
killed) between publish and unpublish, and the spec's status codes for bad requests.
Nothing stays mounted: the fixture unmounts whatever a failed test left below its
target root, and stops the plugin. The manifests are checked in
tests/unit/test_csi_manifests.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from stripefs.common.protocol import EVENTS_SILENCE_S
from stripefs.csi import csi_pb2 as pb

from conftest import _wait_dead, run_cli
from csi_plugin import MiB, MODE, MOUNT_CAP, code as _code, run_plugin


@pytest.fixture(scope="module")
def plugin(cluster):
    yield from run_plugin(cluster)


def test_identity_and_capabilities(plugin):
    info = plugin.identity.GetPluginInfo(pb.GetPluginInfoRequest())
    assert info.name == "csi.stripefs.io" and info.vendor_version
    caps = plugin.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest()).capabilities
    assert any(c.service.type == pb.PluginCapability.Service.CONTROLLER_SERVICE for c in caps)
    assert any(c.volume_expansion.type == pb.PluginCapability.VolumeExpansion.ONLINE for c in caps)
    ctl = {c.rpc.type for c in plugin.controller.ControllerGetCapabilities(pb.ControllerGetCapabilitiesRequest()).capabilities}
    rpc = pb.ControllerServiceCapability.RPC
    assert ctl == {rpc.CREATE_DELETE_VOLUME, rpc.EXPAND_VOLUME}  # no more than it serves
    node = {c.rpc.type for c in plugin.node.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest()).capabilities}
    assert node == {pb.NodeServiceCapability.RPC.GET_VOLUME_STATS}
    assert plugin.node.NodeGetInfo(pb.NodeGetInfoRequest()).node_id == "node-a"


def test_pvc_life(plugin):
    """CreateVolume, publish at two targets, write through one and read through the other, stats, expand,
    unpublish, delete: the calls of a PVC's life, in the order the provisioner, kubelet and the resizer make them."""
    vol = plugin.create("pvc-life", 64 * MiB, replicas="2", chunkSize="1M", inodes="1000")
    assert vol.volume_id == f"{plugin.volumes}/pvc-life" and vol.capacity_bytes == 64 * MiB
    # the same request again (the provisioner retries) is the same volume; another capacity is refused
    assert plugin.create("pvc-life", 64 * MiB, replicas="2", chunkSize="1M", inodes="1000").volume_id == vol.volume_id
    assert _code(lambda: plugin.create("pvc-life", 32 * MiB)) == grpc.StatusCode.ALREADY_EXISTS
    quota = run_cli("quota", "get", str(plugin.in_cluster(vol.volume_id))).stdout
    assert "of 64.0M" in quota and "of 1000" in quota, quota
    layout = run_cli("layout", "get", str(plugin.in_cluster(vol.volume_id))).stdout
    assert "chunk_size=1.0M" in layout and "replicas=2" in layout, layout

    a, b = plugin.target("pod-a"), plugin.target("pod-b")
    plugin.publish(vol.volume_id, a)
    plugin.publish(vol.volume_id, b)
    plugin.publish(vol.volume_id, a)  # kubelet retries: the same publish again is fine
    data = os.urandom(3 * MiB + 5)
    Path(a, "weights.bin").write_bytes(data)
    assert Path(b, "weights.bin").read_bytes() == data  # close-to-open between the two mounts
    assert os.listdir(plugin.in_cluster(vol.volume_id)) == ["weights.bin"]  # a subtree mount: the volume's directory
    for step in range(3):  # a tree for DeleteVolume to remove
        Path(a, "ckpt", f"step{step}").mkdir(parents=True)
        Path(a, "ckpt", f"step{step}", "model.pt").write_bytes(b"m" * step)

    usage = plugin.stats(vol.volume_id, a)
    assert usage[pb.VolumeUsage.BYTES].total == 64 * MiB
    assert usage[pb.VolumeUsage.BYTES].used == len(data) + 0 + 1 + 2
    assert usage[pb.VolumeUsage.BYTES].available == 64 * MiB - usage[pb.VolumeUsage.BYTES].used
    assert usage[pb.VolumeUsage.INODES].total == 1000 and usage[pb.VolumeUsage.INODES].used >= 8

    rsp = plugin.controller.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=vol.volume_id, capacity_range=pb.CapacityRange(required_bytes=128 * MiB), volume_capability=MOUNT_CAP))
    assert rsp.capacity_bytes == 128 * MiB and not rsp.node_expansion_required
    assert plugin.stats(vol.volume_id, b)[pb.VolumeUsage.BYTES].total == 128 * MiB  # online: no remount

    plugin.unpublish(vol.volume_id, a)
    plugin.unpublish(vol.volume_id, b)
    plugin.unpublish(vol.volume_id, b)  # again: nothing to do, still OK
    assert not plugin.mounts() and not os.path.exists(a) and not os.path.exists(b)
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id))
    assert not plugin.in_cluster(vol.volume_id).exists()
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id))  # gone already: OK, as the spec says


def test_half_made_volume_is_finished(plugin):
    """A plugin that stopped between its mkdir and its quota left a directory without one: the provisioner's
    retry finishes that volume instead of refusing it forever."""
    half = plugin.in_cluster(f"{plugin.volumes}/pvc-half")
    half.mkdir(parents=True)
    vol = plugin.create("pvc-half", 8 * MiB)
    assert "of 8.0M" in run_cli("quota", "get", str(half)).stdout
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id))


def test_retain_moves_the_tree_aside(plugin):
    """A StorageClass's subdir (a team's tree) holds its volumes, and onDelete: retain keeps a deleted one there."""
    vol = plugin.create("pvc-keep", 16 * MiB, onDelete="retain", subdir="team-a")
    assert vol.volume_id == f"{plugin.volumes}/team-a/pvc-keep"
    d = plugin.in_cluster(vol.volume_id)
    (d / "sub").mkdir()
    (d / "sub" / "f").write_bytes(b"kept")
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id))
    # the plugin's own client moved it: this mount sees a rename made elsewhere in a directory it does
    # not hold whole within the change feed's delay (docs/design.md, callbacks), not necessarily at once
    _eventually(lambda: not d.exists())
    (kept,) = (plugin.in_cluster(plugin.volumes) / "team-a" / ".retained").glob("pvc-keep-*")
    assert (kept / "sub" / "f").read_bytes() == b"kept"
    # what is retained is no volume of the plugin any more
    retained_id = f"{plugin.volumes}/team-a/.retained/{kept.name}"
    assert _code(lambda: plugin.publish(retained_id, plugin.target("pod-retained"))) == grpc.StatusCode.NOT_FOUND
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=retained_id))  # not a volume: OK, and nothing removed
    assert (kept / "sub" / "f").exists()


def _eventually(check, within: float = EVENTS_SILENCE_S + 2.0) -> None:
    """Poll ``check`` until it returns truthy (fails after ``within`` seconds)."""
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"not so within {within:.1f}s"
        time.sleep(0.02)


def test_read_only_publish_refuses_writes(plugin):
    vol = plugin.create("pvc-ro", 16 * MiB)
    plugin.in_cluster(vol.volume_id).joinpath("model.txt").write_text("v1")
    ro, rw = plugin.target("pod-ro"), plugin.target("pod-rw")
    plugin.publish(vol.volume_id, ro, readonly=True)
    flagged = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(mount_flags=["noatime", "op_timeout=30"]),
                                  access_mode=MODE(mode=MODE.MULTI_NODE_MULTI_WRITER))  # a StorageClass's mountOptions
    plugin.publish(vol.volume_id, rw, cap=flagged)
    try:
        assert Path(ro, "model.txt").read_text() == "v1"
        with pytest.raises(OSError) as info:
            Path(ro, "new.txt").write_text("x")
        assert info.value.errno == errno.EROFS
        Path(rw, "new.txt").write_text("x")  # the same volume published read-write writes
        with open("/proc/mounts") as f:
            options = {line.split()[1]: line.split()[3].split(",") for line in f}
        assert "noatime" in options[rw] and "ro" in options[ro] and "ro" not in options[rw]
        # the same target asked for read-write now: incompatible with what is there
        assert _code(lambda: plugin.publish(vol.volume_id, ro)) == grpc.StatusCode.ALREADY_EXISTS
    finally:
        plugin.unpublish(vol.volume_id, ro)
        plugin.unpublish(vol.volume_id, rw)
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id))


def test_ephemeral_data_set(plugin):
    """An inline volume (a training pod's data set): an existing directory, dataset mode, read-only."""
    data = plugin.cluster.mnt / f"dataset-{os.getpid()}"
    (data / "train").mkdir(parents=True)
    (data / "train" / "0001.jpg").write_bytes(b"\xff\xd8jpeg")
    target = plugin.target("pod-train")
    context = {"csi.storage.k8s.io/ephemeral": "true", "csi.storage.k8s.io/pod.name": "train", "path": f"/{data.name}"}
    plugin.publish("csi-0123abcd", target, context=context)
    try:
        assert Path(target, "train", "0001.jpg").read_bytes() == b"\xff\xd8jpeg"
        with pytest.raises(OSError) as info:
            Path(target, "train", "0002.jpg").write_bytes(b"x")
        assert info.value.errno == errno.EROFS  # dataset mode: the mount itself refuses changes
        # no quota on a data set: the cluster's space, and what is stored
        usage = plugin.stats("csi-0123abcd", target)[pb.VolumeUsage.BYTES]
        assert usage.total > 0 and 0 < usage.available <= usage.total
    finally:
        plugin.unpublish("csi-0123abcd", target)
    assert not plugin.mounts() and (data / "train" / "0001.jpg").exists()
    missing = {**context, "path": "/no-such-data-set"}
    assert _code(lambda: plugin.publish("csi-0123abcd", plugin.target("pod-x"), context=missing)) == grpc.StatusCode.NOT_FOUND
    # the path becomes -o subdir=PATH: no options smuggled in after a comma, no '..'
    (data / "x,root_squash").mkdir()  # a directory whose name would add an option
    for path in (f"/{data.name}/x,root_squash", f"/{data.name}/../other", "relative"):
        sneaky = {**context, "path": path}
        assert _code(lambda: plugin.publish("csi-0123abcd", plugin.target("pod-x"), context=sneaky)) == grpc.StatusCode.INVALID_ARGUMENT, path
    assert not plugin.mounts()
    shutil.rmtree(data)


def test_restart_between_publish_and_unpublish(plugin):
    """The plugin killed and started again while pods use their volumes: the mounts keep serving, stats
    still answer, and unpublish still cleans up, even a target whose mount client died meanwhile."""
    vol = plugin.create("pvc-restart", 16 * MiB)
    live, dead = plugin.target("pod-live"), plugin.target("pod-dead")
    plugin.publish(vol.volume_id, live)
    plugin.publish(vol.volume_id, dead)
    Path(live, "before").write_text("1")
    plugin.stop(signal.SIGKILL)
    dead_pid = next(r["pid"] for r in map(json.loads, (f.read_text() for f in plugin.state.glob("*.json"))) if r["target"] == dead)
    os.kill(dead_pid, signal.SIGKILL)
    _wait_dead(dead_pid)
    plugin.start()
    assert Path(live, "before").read_text() == "1"  # a plugin restart did not touch the pod's mount
    Path(live, "after").write_text("2")
    assert plugin.stats(vol.volume_id, live)[pb.VolumeUsage.BYTES].used == 2
    plugin.unpublish(vol.volume_id, live)
    plugin.unpublish(vol.volume_id, dead)  # its client is gone ("Transport endpoint is not connected")
    assert not plugin.mounts() and not os.path.exists(live) and not os.path.exists(dead)
    plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id))


def test_bad_requests_get_the_spec_codes(plugin):
    ctl, node = plugin.controller, plugin.node
    INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    # missing capability
    assert _code(lambda: ctl.CreateVolume(pb.CreateVolumeRequest(name="pvc-nocap"))) == INVALID
    assert _code(lambda: node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id=f"{plugin.volumes}/x", target_path=plugin.target("pod-nocap")))) == INVALID
    block = pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(), access_mode=MODE(mode=MODE.SINGLE_NODE_WRITER))
    assert _code(lambda: ctl.CreateVolume(pb.CreateVolumeRequest(name="pvc-block", volume_capabilities=[block]))) == INVALID
    # a mount option that is the plugin's to set (the key, the directory) is refused
    keyed = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(mount_flags=["key=/etc/stripefs/admin.key_secret"]),
                                access_mode=MODE(mode=MODE.MULTI_NODE_MULTI_WRITER))
    assert _code(lambda: plugin.publish(f"{plugin.volumes}/x", plugin.target("pod-keyed"), cap=keyed)) == INVALID
    # a typo in the StorageClass is refused, not ignored
    assert _code(lambda: plugin.create("pvc-typo", replica="3")) == INVALID
    # capacity beyond the cluster
    assert _code(lambda: plugin.create("pvc-huge", 1 << 60)) == grpc.StatusCode.OUT_OF_RANGE
    assert not plugin.in_cluster(f"{plugin.volumes}/pvc-huge").exists()
    # unknown volume ids
    unknown = f"{plugin.volumes}/pvc-never-made"
    assert _code(lambda: ctl.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=unknown, capacity_range=pb.CapacityRange(required_bytes=MiB)))) == NOT_FOUND
    assert _code(lambda: plugin.publish(unknown, plugin.target("pod-unknown"))) == NOT_FOUND
    assert _code(lambda: plugin.publish("/etc", plugin.target("pod-unknown"))) == NOT_FOUND  # not one of its volumes
    assert _code(lambda: plugin.stats(unknown, plugin.target("pod-unknown"))) == NOT_FOUND
    assert _code(lambda: ctl.ValidateVolumeCapabilities(pb.ValidateVolumeCapabilitiesRequest(
        volume_id=unknown, volume_capabilities=[MOUNT_CAP]))) == NOT_FOUND
    ctl.DeleteVolume(pb.DeleteVolumeRequest(volume_id=unknown))  # deleting what is not there: OK
    # an expansion beyond the cluster, and a limit below the requirement
    small = plugin.create("pvc-small", MiB)
    assert _code(lambda: ctl.ControllerExpandVolume(pb.ControllerExpandVolumeRequest(
        volume_id=small.volume_id, capacity_range=pb.CapacityRange(required_bytes=1 << 60)))) == grpc.StatusCode.OUT_OF_RANGE
    assert _code(lambda: ctl.CreateVolume(pb.CreateVolumeRequest(
        name="pvc-upside-down", volume_capabilities=[MOUNT_CAP],
        capacity_range=pb.CapacityRange(required_bytes=2 * MiB, limit_bytes=MiB)))) == grpc.StatusCode.OUT_OF_RANGE
    ctl.DeleteVolume(pb.DeleteVolumeRequest(volume_id=small.volume_id))
    # target paths outside the allowed root, plainly or through '..' or a symlink
    vol = plugin.create("pvc-bad-target", 16 * MiB)
    outside = tempfile.mkdtemp(prefix="stripefs-csi-outside-")
    link = Path(plugin.target("pod-link")).parent / "escape"
    link.symlink_to(outside)
    try:
        for target in (f"{outside}/mount", f"{plugin.pods}/../outside/mount", f"{link}/mount", "relative/mount"):
            assert _code(lambda: plugin.publish(vol.volume_id, target)) == INVALID, target
            assert _code(lambda: plugin.unpublish(vol.volume_id, target)) == INVALID, target
        assert os.listdir(outside) == []
    finally:
        os.rmdir(outside)
    assert not plugin.mounts()
    ctl.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id))


def test_command_line(plugin, tmp_path, monkeypatch, capsys):
    """stripefs csi --help explains; a missing cluster address and a probe of no plugin are one line each
    (in this process: the command's own main(), as the installed entry point runs it)."""
    from stripefs.cli import main

    with pytest.raises(SystemExit):
        main(["csi", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for words in ("--endpoint", "--meta", "--services", "--target-root", "--state-dir", "--probe", "docs/kubernetes.md"):
        assert words in out, words
    monkeypatch.delenv("STRIPEFS_META", raising=False)
    monkeypatch.delenv("STRIPEFS_KEY", raising=False)
    assert main(["csi", "--endpoint", f"unix://{tmp_path}/x.sock"]) == 1
    assert "--meta" in capsys.readouterr().err
    assert main(["csi", "--probe", "--endpoint", f"unix://{tmp_path}/nobody.sock"]) == 2
    assert "does not answer" in capsys.readouterr().err
    assert main(["csi", "--probe", "--endpoint", f"unix://{plugin.sock}"]) == 0  # the liveness probe of node.yaml
