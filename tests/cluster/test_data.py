"""Data through the mount: big and small files, two mounts, layouts, status.

Thousands of small files written side by side, and a writer scattering small
writes over many chunks, are tested on the mount's handlers without a kernel
(tests/inprocess/test_data_ops.py)."""

import hashlib
import json
import os
import random
import time

from conftest import drop_caches, run_cli

MiB = 1 << 20


def _write_random(path, size, seed):
    rng = random.Random(seed)
    h = hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 4 * MiB + 12345)
            block = rng.randbytes(n)
            h.update(block)
            f.write(block)
            left -= n
    return h.hexdigest()


def _sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def test_256mib_file_round_trip(mnt):
    digest = _write_random(mnt / "big", 256 * MiB, seed=1)
    assert os.stat(mnt / "big").st_size == 256 * MiB
    drop_caches()
    assert _sha(mnt / "big") == digest
    # random ranged reads agree with the file
    rng = random.Random(2)
    expected = random.Random(1)
    whole = b"".join(expected.randbytes(min(256 * MiB - i, 4 * MiB + 12345)) for i in range(0, 256 * MiB, 4 * MiB + 12345))
    with open(mnt / "big", "rb") as f:
        for _ in range(50):
            off = rng.randrange(0, 256 * MiB - 100_000)
            f.seek(off)
            assert f.read(100_000) == whole[off : off + 100_000]


def test_two_mounts_see_each_others_closed_files(cluster, mnt):
    other = cluster.mount_again("mnt2")
    try:
        rel = mnt.relative_to(cluster.mnt)
        (mnt / "shared").write_bytes(b"v1" * 1000)
        assert (other / rel / "shared").read_bytes() == b"v1" * 1000
        # rewrite, longer, on the first mount: the second sees all of it on its next open
        (mnt / "shared").write_bytes(b"v2" * 300_000)
        assert (other / rel / "shared").read_bytes() == b"v2" * 300_000
        # and the other way round
        (other / rel / "back").write_text("from mount 2")
        assert (mnt / "back").read_text() == "from mount 2"
        with open(other / rel / "shared", "ab") as f:
            f.write(b"tail")
        assert (mnt / "shared").read_bytes().endswith(b"v2tail")
    finally:
        cluster.unmount(other)
        cluster.extra_mounts.remove(other)


def test_layout_set_and_get(cluster, mnt):
    d = mnt / "wide"
    d.mkdir()
    out = json.loads(run_cli("layout", "get", str(d), "--json").stdout)
    assert set(out) == {"chunk_size", "stripe_count", "redundancy"}
    run_cli("layout", "set", str(d), "--chunk-size", "1M")
    out = json.loads(run_cli("layout", "get", str(d), "--json").stdout)
    assert out["chunk_size"] == MiB and out["redundancy"] == "replicas=2"
    run_cli("layout", "set", str(d), "--replicas", "3", "--stripe-count", "2")
    out = json.loads(run_cli("layout", "get", str(d), "--json").stdout)
    assert out == {"chunk_size": MiB, "stripe_count": 2, "redundancy": "replicas=3"}
    digest = _write_random(d / "f", 5 * MiB + 7, seed=9)
    out = json.loads(run_cli("layout", "get", str(d / "f"), "--json").stdout)
    assert out == {"chunk_size": MiB, "stripe_count": 2, "redundancy": "replicas=3"}
    assert _sha(d / "f") == digest
    bad = run_cli("layout", "set", str(d), "--chunk-size", "3K", check=False)
    assert bad.returncode != 0 and "chunk_size" in bad.stderr
    # via --meta and a namespace path, without the mount
    rel = "/" + str(d.relative_to(cluster.mnt))
    out = json.loads(run_cli("layout", "get", rel, "--meta", cluster.meta_address, "--json").stdout)
    assert out["stripe_count"] == 2


def test_status_tells_the_truth(cluster, mnt):
    (mnt / "f").write_bytes(b"x" * 100_000)
    local = json.loads(run_cli("local", "status", "--dir", str(cluster.state), "--json").stdout)
    roles = [p["role"] for p in local["processes"]]
    assert roles.count("meta") == 1 and roles.count("storage") == 4 and roles.count("mount") == 1
    for p in local["processes"]:
        assert set(p) >= {"role", "node_id", "pid", "address", "state", "bytes_stored"}
        assert p["state"] == "up"
    assert sum(p["bytes_stored"] for p in local["processes"] if p["role"] == "storage") >= 200_000
    status = json.loads(run_cli("status", str(cluster.mnt), "--json").stdout)
    assert len(status["nodes"]) == 4 and all(n["state"] == "up" for n in status["nodes"])
    assert status["files"] >= 1 and status["chunks"] >= 1
    text = run_cli("status", "--meta", cluster.meta_address).stdout
    assert "4/4 storage nodes up" in text


def test_unlinked_on_another_mount_while_open_here(cluster, mnt):
    """Data of a file open on one mount survives its unlink on another until closed."""
    other = cluster.mount_again("mnt3")
    try:
        data = random.Random(5).randbytes(3 * MiB + 17)
        (mnt / "held").write_bytes(data)
        with open(mnt / "held", "rb") as f:
            os.unlink(other / mnt.relative_to(cluster.mnt) / "held")
            assert not (mnt / "held").exists()
            time.sleep(1.5)  # past the daemon's garbage collection cycle
            drop_caches()
            assert f.read() == data
    finally:
        cluster.unmount(other)
        cluster.extra_mounts.remove(other)
