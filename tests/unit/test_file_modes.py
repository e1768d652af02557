"""What stripefs keeps on local disks is its own user's only, whatever the umask (docs/security.md):
chunk files on storage nodes, the client's disk cache, the metadata database, the mount's log.
Each test performs the review's attack as another local user (uid 65534)."""

import os
import stat
import subprocess
import sys

import pytest

from stripefs.client.disk_cache import DiskCache
from stripefs.common import protocol as P
from stripefs.daemon.db import open_database
from stripefs.storage_node.chunk_store import ChunkStore

NOBODY = 65534


@pytest.fixture
def open_umask():
    old = os.umask(0)  # the worst an operator's environment can give
    yield
    os.umask(old)


def _nobody_reads(path) -> str:
    res = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "cat", str(path)],
                         capture_output=True, text=True, timeout=30)
    return res.stderr if res.returncode else res.stdout


def _modes(root) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(os.lstat(p).st_mode) for p in [root, *root.rglob("*")]}


def test_chunk_files_are_private(tmp_path, open_umask):
    tmp_path.chmod(0o755)
    data = tmp_path / "node"
    data.mkdir(mode=0o777)
    store = ChunkStore(data, reserved_space=0, node_id=1)
    try:
        store.write(P.ChunkId(7, 0, 0), 1, 0, 0, b"another user's file" * 100)
        store.write(P.ChunkId(8, 0, 0), 1, 0, 0, os.urandom(2 << 20))  # O_DIRECT-sized
        modes = _modes(data)
        assert modes["."] == 0o700
        assert {m for name, m in modes.items() if os.path.isdir(data / name)} == {0o700}
        assert {m for name, m in modes.items() if os.path.isfile(data / name)} == {0o600}
        chunk = store.path(P.ChunkId(7, 0, 0))
        assert "Permission denied" in _nobody_reads(chunk)
    finally:
        store.close()


def test_the_disk_cache_is_private(tmp_path, open_umask):
    tmp_path.chmod(0o755)
    cache = DiskCache(tmp_path, "cluster-1", capacity=1 << 30, min_free=0)
    cache.scan()
    cache._write((5, 0, 3), b"a root-only file's bytes")
    entries = [p for p in (tmp_path / "cluster-1").rglob("*") if p.is_file()]
    assert len(entries) == 1
    assert {m for name, m in _modes(tmp_path / "cluster-1").items()} == {0o700, 0o600}
    assert stat.S_IMODE(os.stat(entries[0]).st_mode) == 0o600
    assert "Permission denied" in _nobody_reads(entries[0])


def test_the_metadata_database_is_private(tmp_path, open_umask):
    tmp_path.chmod(0o755)
    meta = tmp_path / "meta"
    meta.mkdir(mode=0o777)
    conn = open_database(meta / "meta.sqlite3", P.Layout(1 << 20, 1, "replicas=1"))
    try:
        conn.execute("BEGIN")
        conn.execute("CREATE TABLE probe (x)")
        conn.execute("COMMIT")
        files = sorted(p.name for p in meta.iterdir())
        assert "meta.sqlite3-wal" in files
        assert {stat.S_IMODE(os.stat(meta / f).st_mode) for f in files} == {0o600}
        assert stat.S_IMODE(os.stat(meta).st_mode) == 0o700
    finally:
        conn.close()


def test_the_mount_never_follows_a_planted_log_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    victim.chmod(0o600)
    link = tmp_path / "mount.log"
    os.symlink(victim, link)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    res = subprocess.run([sys.executable, "-m", "stripefs", "mount", "tcp://127.0.0.1:9", str(mountpoint), "--log", str(link)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "cannot open the log file" in res.stderr and "Traceback" not in res.stderr, res
    assert victim.read_text() == "root's file\n"
    # and by default the log is not in /tmp at all
    from stripefs.client.mount import build_parser

    assert "/tmp" not in build_parser().format_help().split("--log")[1].split("--pidfile")[0]
