"""What a new operator hits (issue 17, items 1-5): recovery that must really recover, configurations
that cannot work, df. A small cluster of its own (3 nodes, short timeouts): the tests break it on
purpose and run in file order: the mount is killed, node 3 is drained and removed, node 2 dies and
comes back, the state directory disappears. Layout refusals and df use the shared cluster."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, Cluster, _wait_dead, cluster_root, run_cli, run_cluster
from stripefs.local_cluster import _is_mounted
from stripefs.local_processes import processes_of
from util import eventually

SETTINGS = ["meta.node_timeout_s=3", "meta.node_suspect_s=1.5", "meta.repair_scan_interval_s=2",
            "storage.heartbeat_interval_s=0.5"]


@pytest.fixture(scope="module")
def small(request):
    c = Cluster(cluster_root("stripefs-operator-"), nodes=3, up_args=tuple(a for s in SETTINGS for a in ("--set", s)))
    c.expected_log_patterns += [r"not answering", r"failed", r"no copy could be read"]
    yield from run_cluster(request, c, label="operator ")


def _local_status(c: Cluster) -> dict:
    return {(p["role"], p["node_id"]): p for p in json.loads(run_cli("local", "status", "--dir", str(c.state), "--json").stdout)["processes"]}


def _wait(what: str, check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (last := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
    return last


def _node_state(c: Cluster, node_id: int) -> str:
    rsp = json.loads(run_cli("status", "--dir", str(c.state), "--json").stdout)
    return next(n["state"] for n in rsp["nodes"] if n["node_id"] == node_id)


def test_up_mounts_again_over_a_dead_mount(small):
    """item 1: after kill -9 of the client its reaper (client/fuse/reaper.py) unmounts the dead mount,
    and up mounts again."""
    (small.mnt / "kept").write_bytes(b"data")
    os.stat(small.mnt)  # the kernel caches the root's attributes ...
    pid = small.pids()["mount"]
    os.kill(pid, signal.SIGKILL)
    _wait_dead(pid)
    eventually(lambda: not _is_mounted(small.mnt), what="the reaper unmounts the killed client's mount")
    assert os.listdir(small.mnt) == []  # the directory beneath
    out = run_cli("local", "up", "--dir", str(small.state), "--mount", str(small.mnt), "--nodes", "3").stdout
    assert "mounted at" in out
    assert (small.mnt / "kept").read_bytes() == b"data"
    assert _local_status(small)[("mount", None)]["state"] == "up"


def test_up_again_refuses_a_tier_and_needs_no_nodes(small):
    """Issue 36 item 5: 'local up --tier s3' on an existing cluster said "already running" (exit 0) and
    added no tier; 'local up' without --nodes said "--nodes 4 is ignored" of a 3-node cluster."""
    res = run_cli("local", "up", "--dir", str(small.state), "--mount", str(small.mnt), "--tier", "s3", check=False)
    assert res.returncode == 1 and "tier add" in res.stderr and "already running" not in res.stdout, (res.stdout, res.stderr)
    res = run_cli("local", "up", "--dir", str(small.state), "--mount", str(small.mnt))
    assert "already running" in res.stdout and "--nodes" not in res.stderr, res.stderr


def test_a_removed_node_is_not_started_again(small):
    """item 3: drain and remove node 3, stop it; down and up leave it stopped (and up then finds all running)."""
    for i in range(4):
        (small.mnt / f"r{i}").write_bytes(os.urandom(200_000))
    run_cli("node", "drain", "3", "--dir", str(small.state))
    run_cli("node", "remove", "3", "--dir", str(small.state))
    small.kill_node(3, signal.SIGTERM)
    run_cli("local", "down", "--dir", str(small.state))
    out = run_cli("local", "up", "--dir", str(small.state), "--mount", str(small.mnt), "--nodes", "3").stdout
    assert "1 removed: not started" in out
    procs = _local_status(small)
    assert procs[("storage", 3)]["state"] == "removed" and procs[("storage", 3)]["pid"] is None
    assert not any(p.name == "storage-3" for p in processes_of(small.state))
    again = run_cli("local", "up", "--dir", str(small.state), "--mount", str(small.mnt), "--nodes", "3").stdout
    assert "already running" in again
    assert (small.mnt / "r3").stat().st_size == 200_000


def test_fsck_says_what_it_cannot_repair(small):
    """item 4: a chunk that wants a copy no node can take is reported, not counted as repaired, and the
    daemon says so once instead of failing to 'replace node -1' on every pass."""
    d = small.mnt / "two"
    d.mkdir()
    run_cli("layout", "set", str(d), "--replicas", "2")
    data = os.urandom(100_000)
    (d / "f").write_bytes(data)
    small.expect_log(r"only live copy")
    small.kill_node(2)
    _wait("node 2 down", lambda: _node_state(small, 2) == "down")
    res = run_cli("fsck", "--repair", "--dir", str(small.state), check=False)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "repaired: 0" in res.stdout and "not repaired:" in res.stdout and "cannot be repaired now:" in res.stdout
    _wait("the repair pass", lambda: "need a copy that no storage node can take" in small.logs()["meta.log"])
    assert "to replace node -1" not in small.logs()["meta.log"]
    small.restart()
    _wait("node 2 up", lambda: _node_state(small, 2) == "up")
    assert (d / "f").read_bytes() == data  # (a read sends a file still in the write-back first)


def test_down_stops_a_cluster_whose_state_directory_is_gone(small):
    """item 2: with STATE gone, up refuses to build a second cluster beside the orphans, and make stop
    (local down) finds them by their command lines and stops them; with nothing left it says so, exit 0."""
    moved = small.state.with_name("state-moved-away")
    small.expect_log(r"cannot read disk usage")  # the nodes notice their data directory has gone
    small.state.rename(moved)
    try:
        assert len(processes_of(small.state)) == 4  # meta, 2 storage nodes, mount
        res = run_cli("local", "up", "--dir", str(small.state), "--mount", str(small.mnt), check=False)
        assert res.returncode == 3 and "still run" in res.stderr and not small.state.exists()
        res = subprocess.run(["make", "-s", "stop", f"STATE={small.state}"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "still run: stopping them" in res.stderr and "stopped" in res.stdout
        assert processes_of(small.state) == [] and not _is_mounted(small.mnt)
        res = subprocess.run(["make", "-s", "stop", f"STATE={small.state}"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and "nothing to stop" in res.stdout
    finally:
        if small.state.exists():  # what this test is against: a second cluster made beside the first
            run_cli("local", "down", "--dir", str(small.state), check=False)
            shutil.rmtree(small.state)
        moved.rename(small.state)


# -- on the shared cluster -----------------------------------------------------------------------


def test_layouts_the_nodes_cannot_hold_are_refused(cluster, mnt):
    """item 4: replicas beyond the hosts with nodes up are refused, as EC beyond them is."""
    for flag, value in (("--replicas", "5"), ("--ec", "4+2")):
        res = run_cli("layout", "set", str(mnt), flag, value, check=False)
        assert res.returncode == 3 and "4 host(s) have storage nodes up" in res.stderr, res.stderr
    assert "replicas=2" in run_cli("layout", "get", str(mnt)).stdout
    run_cli("layout", "set", str(mnt), "--replicas", "4")  # as many as there are


def test_df_counts_the_shared_disk_once_and_used_is_what_stripefs_stores(cluster, mnt):
    """item 5: four nodes on one disk are not four disks; used is not what other programs use."""
    with open(mnt / "f", "wb") as f:
        f.write(os.urandom(1 << 20))
        os.fsync(f.fileno())
    # the nodes report what they store at their next heartbeat: both copies of the MiB
    status = _wait("the copies in the nodes' reports",
                   lambda: (s := json.loads(run_cli("status", str(mnt), "--json").stdout))["used_bytes"] >= 2 << 20 and s)
    disk = os.statvfs(cluster.state)
    df = os.statvfs(mnt)
    size = df.f_blocks * df.f_frsize
    assert abs(size - disk.f_blocks * disk.f_frsize) <= 2 * df.f_frsize, (size, disk.f_blocks * disk.f_frsize)
    assert abs(status["capacity_bytes"] - size) <= 2 * df.f_frsize
    used = (df.f_blocks - df.f_bfree) * df.f_frsize
    assert 2 << 20 <= used <= status["used_bytes"] + (64 << 20), (used, status["used_bytes"])  # other tests write meanwhile
    # free: the disk's, once (four nodes summed would be four times it). The nodes report free
    # space at their heartbeats, so it may lag what other tests wrote or deleted since (CI saw
    # 58 MiB, and once 323 MiB, of lag): a tenth of the disk's free space is allowed, far below
    # the three times more that counting the shared disk four times gives.
    lag = max(256 << 20, disk.f_bavail * disk.f_frsize // 10)
    assert df.f_bavail * df.f_frsize <= disk.f_bavail * disk.f_frsize + lag, (df.f_bavail, disk.f_bavail)


def test_two_ups_at_once_on_a_new_directory(tmp_path):
    """Issue 36 item 14: two 'local up' started together on one new directory: the second said
    "storage-2 exited at start" (its processes found the ports taken). Now it waits for the first
    and finds the cluster running."""
    state, mnt = tmp_path / "state", tmp_path / "mnt"
    args = [sys.executable, "-m", "stripefs", "local", "up", "--dir", str(state), "--mount", str(mnt), "--nodes", "2"]
    try:
        procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = [p.communicate(timeout=120) for p in procs]
        for p, (out, err) in zip(procs, results):
            assert p.returncode == 0 and "exited at start" not in err, (out, err)
        outs = sorted(out for out, _ in results)
        assert "already running" in outs[0] and "local cluster up" in outs[1], outs
        assert len(processes_of(state)) == 4  # meta, 2 storage nodes, mount: one set
    finally:
        run_cli("local", "down", "--dir", str(state), check=False)


def test_up_mounts_a_dataset_mount_beside_and_down_unmounts_it(tmp_path):
    """Issue 36 item 12: a dataset mount needed the daemon's address copied by hand from 'local status',
    and 'make stop' left it behind (every access then blocked 60 s, then EIO)."""
    state, mnt, data = tmp_path / "state", tmp_path / "mnt", tmp_path / "data"
    try:
        out = run_cli("local", "up", "--dir", str(state), "--mount", str(mnt), "--nodes", "2", "--dataset-mount", str(data)).stdout
        assert "read-only (dataset mode)" in out, out
        (mnt / "f").write_bytes(b"written through the default mount")
        _wait("the dataset mount to see the new file", lambda: (data / "f").exists())
        assert (data / "f").read_bytes() == b"written through the default mount"
        with pytest.raises(OSError) as err:
            (data / "g").write_bytes(b"x")
        assert err.value.errno == 30  # EROFS
        procs = {p["role"]: p for p in json.loads(run_cli("local", "status", "--dir", str(state), "--json").stdout)["processes"]}
        assert procs["dataset-mount"]["state"] == "up" and procs["dataset-mount"]["mountpoint"] == str(data)
        res = subprocess.run(["make", "-s", "stop", f"STATE={state}"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        assert not _is_mounted(data) and not _is_mounted(mnt) and processes_of(state) == []
        # remembered: the next up mounts it again
        assert "read-only (dataset mode)" in run_cli("local", "up", "--dir", str(state), "--mount", str(mnt)).stdout
        assert _is_mounted(data)
    finally:
        run_cli("local", "down", "--dir", str(state), check=False)
