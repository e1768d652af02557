"""The cold tier (docs/tiering.md) end to end, against a real S3 endpoint on loopback.

The cluster is ``stripefs local up --tier s3``: moto's standalone server in
its own process, talked to over HTTP by the daemon's boto3 code, added as
tier ``cold``. Stopping the bucket is SIGSTOP of that process (requests time
out after ``tier_timeout_s``), SIGCONT brings it back with its objects.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
from pathlib import Path

import pytest

from conftest import Cluster, cluster_root, drop_caches, run_cli, run_cluster
from util import eventually

pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("moto") is None, reason="moto[server] is not installed (pip install -e '.[test]')"
)

LARGE = 10 << 20  # three 4 MiB chunks, the last one partial


@pytest.fixture(scope="module")
def tcluster(request):
    c = Cluster(cluster_root("stripefs-tier-"), nodes=4, up_args=(
        "--tier", "s3", "--set", "meta.tier_timeout_s=1", "--set", "meta.tier_scan_interval_s=0.5",
        "--set", "meta.tier_bandwidth=\"8M\"",
    ))
    yield from run_cluster(request, c, label="tier: ")


@pytest.fixture
def tdir(tcluster, request) -> Path:
    d = tcluster.mnt / request.node.name.replace("[", "_").replace("]", "_")
    d.mkdir()
    return d


def cli(c: Cluster, *args: str, check: bool = True):
    return run_cli(*args, "--dir", str(c.state), check=check)


def tiers(c: Cluster) -> dict:
    return {t["name"]: t for t in json.loads(cli(c, "tier", "list", "--json").stdout)["tiers"]}


def objects(c: Cluster) -> int:
    return tiers(c)["cold"]["objects"]


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def stored_bytes(c: Cluster) -> int:
    total = 0
    for i in range(1, c.nodes + 1):
        for root, _, names in os.walk(c.state / f"storage-{i}" / "data"):
            total += sum(os.path.getsize(os.path.join(root, n)) for n in names if not n.startswith("."))
    return total


def make_files(d: Path, ec: bool, c: Cluster) -> dict[Path, str]:
    """A small and a large file in a replicated and an erasure-coded directory; path -> md5."""
    files = {}
    for kind in ("rep", "ec") if ec else ("rep",):
        sub = d / kind
        sub.mkdir()
        if kind == "ec":
            run_cli("layout", "set", str(sub), "--ec", "2+1")
        for name, size in (("small", 3000), ("large", LARGE)):
            p = sub / name
            p.write_bytes(os.urandom(size))
            files[p] = md5(p)
    return files


def check_all(files: dict[Path, str]) -> None:
    drop_caches()
    for p, digest in files.items():
        assert md5(p) == digest, p


def test_migrate_release_read_back_restart(tcluster, tdir):
    c = tcluster
    files = make_files(tdir, True, c)
    before_objects, before_bytes = objects(c), stored_bytes(c)
    out = cli(c, "tier", "migrate", "-r", str(tdir), "--to", "cold").stdout
    assert "4 file(s) moved" in out, out
    assert objects(c) == before_objects + 2 * (1 + 3)  # one object per chunk: small 1, large 3, in each layout
    # node copies released (the collector deletes them after the switch)
    eventually(lambda: stored_bytes(c) < before_bytes - 2 * LARGE, within=20, what="node copies released")
    check_all(files)  # transparent recall
    assert objects(c) == before_objects, "a recall queues the object for deletion"
    # again cold, then a restart of the whole cluster: still cold, still readable
    cli(c, "tier", "migrate", "-r", str(tdir), "--to", "cold")
    c.kill_meta()
    c.restart()
    assert objects(c) == before_objects + 8
    check_all(files)


def test_recall_by_command_and_write(tcluster, tdir):
    c = tcluster
    files = make_files(tdir, True, c)
    cli(c, "tier", "migrate", "-r", str(tdir), "--to", "cold")
    base = objects(c)
    out = cli(c, "tier", "recall", "-r", str(tdir / "rep")).stdout
    assert "2 file(s) back on storage nodes" in out, out
    assert objects(c) == base - 4
    check_all(files)
    # a write into a cold chunk (EC and replicated) recalls it first: the rest of the chunk is kept
    for p in (tdir / "ec" / "large", tdir / "rep" / "large"):
        cli(c, "tier", "migrate", str(p), "--to", "cold")
        with open(p, "r+b") as f:
            f.seek(5 << 20)
            f.write(b"written while cold")
        data = bytearray(Path(p).read_bytes())
        drop_caches()
        assert Path(p).read_bytes() == bytes(data)
        assert data[5 << 20 : (5 << 20) + 18] == b"written while cold"
        files.pop(p)
    check_all(files)
    # a truncate cutting into a cold chunk
    p = tdir / "rep" / "small"
    want = p.read_bytes()[:1000]
    cli(c, "tier", "migrate", str(p), "--to", "cold")
    os.truncate(p, 1000)
    drop_caches()
    assert p.read_bytes() == want


def test_deleted_files_objects_collected(tcluster, tdir):
    c = tcluster
    make_files(tdir, False, c)
    base = objects(c)
    cli(c, "tier", "migrate", "-r", str(tdir), "--to", "cold")
    assert objects(c) == base + 4
    for p in (tdir / "rep").iterdir():
        p.unlink()
    eventually(lambda: objects(c) == base, within=20, what="objects of deleted files collected")
    # and gone from the bucket: fsck finds nothing missing and no orphans
    eventually(lambda: cli(c, "tier", "fsck", check=False).returncode == 0, within=20, what="fsck clean")


def test_bucket_stopped_while_reading(tcluster, tdir):
    c = tcluster
    files = make_files(tdir, False, c)
    small, large = tdir / "rep" / "small", tdir / "rep" / "large"
    cli(c, "tier", "migrate", str(small), "--to", "cold")
    drop_caches()
    s3 = c.pids()["s3"]
    c.expect_log(r"tier cold|recall|Input/output|EIO|chunk .* no readable copy")
    os.kill(s3, signal.SIGSTOP)
    try:
        with pytest.raises(OSError) as err:
            small.read_bytes()
        assert err.value.errno == errno.EIO
        # nothing is released while the bucket fails: a migration fails, the copies stay, the file reads
        before = objects(c)
        res = cli(c, "tier", "migrate", str(large), "--to", "cold", check=False)
        assert res.returncode == 3, res.stdout + res.stderr
        assert objects(c) == before
        drop_caches()
        assert md5(large) == files[large]
    finally:
        os.kill(s3, signal.SIGCONT)
    assert "tier cold" in (c.state / "logs" / "meta.log").read_text()
    check_all(files)  # the bucket is back: everything reads


def test_policy_migration_killed_and_resumed(tcluster, tdir):
    """A policy queues the directory; the pass (throttled to 8 MiB/s) is killed half way and resumes."""
    c = tcluster
    d = tdir / "data"
    d.mkdir()
    files = {}
    for i in range(6):
        p = d / f"f{i}"
        p.write_bytes(os.urandom(8 << 20))
        files[p] = md5(p)
    base = objects(c)
    cli(c, "tier", "policy", "set", str(d), "--to", "cold", "--after", "0s")
    eventually(lambda: objects(c) >= base + 2, within=20, what="the policy pass started", every=0.1)
    half = objects(c)
    c.kill_meta()  # kill -9 half way: the rest of the queue is in the metadata store
    assert half < base + 12, "the pass was not half way"
    c.restart()
    eventually(lambda: objects(c) == base + 12, within=40, what="the migration resumed and finished", every=0.2)
    cli(c, "tier", "policy", "clear", str(d))
    status = json.loads(run_cli("status", "--json", "--dir", str(c.state)).stdout)
    assert status["tiering"]["migrate_backlog"] == 0
    check_all(files)
