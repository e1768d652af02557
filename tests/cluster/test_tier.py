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

from stripefs.cluster import rpc
from stripefs.common import protocol as P

from conftest import Cluster, cluster_root, drop_caches, run_cli, run_cluster
from util import eventually

pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("moto") is None, reason="moto[server] is not installed (pip install -e '.[test]')"
)

CHUNK = 1 << 20  # the tier cluster's chunk size: small data, several chunks per file
LARGE = 5 * CHUNK // 2  # three chunks, the last one partial


@pytest.fixture(scope="module")
def tcluster(request):
    c = Cluster(cluster_root("stripefs-tier-"), nodes=4, up_args=(
        "--tier", "s3", "--set", "meta.tier_timeout_s=1", "--set", "meta.tier_scan_interval_s=0.5",
        "--set", "meta.tier_bandwidth=\"2M\"", "--set", f"meta.chunk_size={CHUNK}",
    ))
    yield from run_cluster(request, c, label="tier: ")


@pytest.fixture
def tdir(tcluster, request) -> Path:
    d = tcluster.mnt / request.node.name.replace("[", "_").replace("]", "_")
    d.mkdir()
    return d


def cli(c: Cluster, *args: str, check: bool = True):
    return run_cli(*args, "--dir", str(c.state), check=check)


def objects(c: Cluster) -> int:
    """Objects tier 'cold' holds (asked in-process: polling with a subprocess each time is slow)."""
    (rsp,) = rpc([c.meta_address], P.TierListReq())
    return {t.name: t for t in rsp.tiers}["cold"].objects


def tier_lines(c: Cluster) -> str:
    """The metadata daemon's log lines about chunks and tiers: what an object count's assertion shows."""
    text = c.logs().get("meta.log", "")
    return "\n".join([line for line in text.splitlines() if "chunk" in line or "tier" in line][-40:])


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def stored_bytes(c: Cluster) -> int:
    """Bytes in the nodes' chunk files; a file the collector deletes during the walk counts nothing."""
    total = 0
    for i in range(1, c.nodes + 1):
        for root, _, names in os.walk(c.state / f"storage-{i}" / "data"):
            for n in names:
                if not n.startswith("."):
                    try:
                        total += os.path.getsize(os.path.join(root, n))
                    except FileNotFoundError:
                        pass  # deleted between the listing and the stat: what the test waits for
    return total


def make_files(d: Path, ec: bool, c: Cluster, sizes=(("small", 3000), ("large", LARGE))) -> dict[Path, str]:
    """A small and a large file in a replicated and an erasure-coded directory; path -> md5."""
    files = {}
    for kind in ("rep", "ec") if ec else ("rep",):
        sub = d / kind
        sub.mkdir()
        if kind == "ec":
            run_cli("layout", "set", str(sub), "--ec", "2+1")
        for name, size in sizes:
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
    stats = {f: os.stat(f) for f in files}
    out = cli(c, "tier", "migrate", "-r", str(tdir), "--to", "cold").stdout
    assert "4 file(s) moved" in out, out
    assert objects(c) == before_objects + 2 * (1 + 3)  # one object per chunk: small 1, large 3, in each layout
    # node copies released (the collector deletes them after the switch)
    eventually(lambda: stored_bytes(c) < before_bytes - 2 * LARGE, within=20, what="node copies released")
    for f, st in stats.items():  # a migrated file keeps its inode, size, times, mode
        now = os.stat(f)
        assert (now.st_ino, now.st_size, now.st_mtime_ns, now.st_mode) == (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)
    check_all(files)  # transparent recall
    assert objects(c) == before_objects, "a recall queues the object for deletion"
    # again cold, then a restart of the daemon and every storage node: still cold, still readable
    out = cli(c, "tier", "migrate", "-r", str(tdir), "--to", "cold").stdout
    assert "4 file(s) moved to tier cold; 8 chunk(s)" in out, out + tier_lines(c)
    assert objects(c) == before_objects + 8, tier_lines(c)
    c.kill_meta()
    for i in range(1, c.nodes + 1):
        c.kill_node(i)
    c.restart()
    assert objects(c) == before_objects + 8, tier_lines(c)
    check_all(files)


def test_recall_by_command_and_write(tcluster, tdir):
    c = tcluster
    files = make_files(tdir, True, c)
    cli(c, "tier", "migrate", "-r", str(tdir), "--to", "cold")
    base = objects(c)
    out = cli(c, "tier", "recall", "-r", str(tdir / "rep")).stdout
    assert "2 file(s) back on storage nodes" in out, out
    assert objects(c) == base - 4
    run_cli("warmup", str(tdir / "ec"))  # recalls too
    assert objects(c) == base - 8
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
    """Objects of chunks the namespace drops are deleted from the bucket. Here by O_TRUNC, which
    drops them at once; an unlinked file goes when no mount holds it any more (the mount that
    unlinked it holds it while it caches it: callbacks), which tests/unit/test_tiering.py covers."""
    c = tcluster
    make_files(tdir, False, c)
    base = objects(c)
    cli(c, "tier", "migrate", "-r", str(tdir), "--to", "cold")
    # (counted from the tier's rows: once in CI, under load, one object of four was not counted yet)
    eventually(lambda: objects(c) == base + 4, within=20, what="the four chunks' objects counted")
    with open(tdir / "rep" / "large", "wb") as f:  # O_TRUNC: its three chunks go
        f.write(b"new")
    eventually(lambda: objects(c) == base + 1, within=20, what="objects of dropped chunks collected")
    assert (tdir / "rep" / "large").read_bytes() == b"new"
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
    # the failed migration's intents stay in the metadata store: the daemon finishes it by itself
    eventually(lambda: objects(c) == before + 3, within=30, what="the failed migration retried", every=0.2)
    assert "tier cold" in (c.state / "logs" / "meta.log").read_text()
    check_all(files)  # the bucket is back: everything reads


def test_policy_migration_killed_and_resumed(tcluster, tdir):
    """A policy moves a directory of small and large files (replicated and EC); the pass, throttled
    to tier_bandwidth (2 MiB/s), is killed (kill -9) half way and resumes from the metadata store."""
    c = tcluster
    d = tdir / "data"
    d.mkdir()
    sizes = (("small", 3000), ("large", 2 * CHUNK), ("large2", 2 * CHUNK + 1), ("large3", 2 * CHUNK))
    files = make_files(d, True, c, sizes)
    want = sum(-(-len(p.read_bytes()) // CHUNK) for p in files)  # one object per chunk
    (d / "rep" / "keep").mkdir()
    kept = d / "rep" / "keep" / "too-small"
    kept.write_bytes(b"x" * 100)
    base = objects(c)
    cli(c, "tier", "policy", "set", str(d), "--to", "cold", "--after", "0s", "--min-size", "1K")
    try:
        eventually(lambda: objects(c) >= base + 2, within=20, what="the policy pass started", every=0.1)
        half = objects(c)
        c.kill_meta()  # kill -9 half way: the rest of the queue is in the metadata store
        assert half < base + want, "the pass was not half way"
        c.restart()
        eventually(lambda: objects(c) == base + want, within=40, what="the migration resumed and finished", every=0.2)
    finally:
        cli(c, "tier", "policy", "clear", str(d))
    status = json.loads(run_cli("status", "--json", "--dir", str(c.state)).stdout)
    assert status["tiering"]["migrate_backlog"] == 0
    check_all(files)
    assert kept.read_bytes() == b"x" * 100
