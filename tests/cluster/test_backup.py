"""stripefs meta backup / restore: an online backup, restored into a fresh metadata daemon, reads every file back.

A cluster of its own (2 nodes): the restore rolls the namespace back, which the
shared cluster's other tests must not see.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from conftest import Cluster, run_cli


def _content(name: str) -> bytes:
    return (name.encode() * 1000)[: 3000 + 97 * len(name)]


@pytest.fixture
def small_cluster():
    root = Path(tempfile.mkdtemp(prefix="stripefs-backup-"))
    root.chmod(0o755)
    c = Cluster(root, nodes=2)
    try:
        c.up()
        yield c
    finally:
        c.teardown()
    bad = c.bad_log_lines()
    shutil.rmtree(root, ignore_errors=True)
    assert not bad, "unexpected ERROR lines in process logs:\n" + "\n".join(bad[:30])


def test_backup_while_serving_then_restore_into_a_fresh_daemon_reads_every_file(small_cluster):
    c = small_cluster
    rng = random.Random(6)
    sums = {}
    for i in range(30):
        d = c.mnt / f"dir{i % 4}"
        d.mkdir(exist_ok=True)
        data = rng.randbytes(rng.choice([0, 100, 70_000, 3 << 20]))
        (d / f"f{i}").write_bytes(data)
        sums[f"dir{i % 4}/f{i}"] = hashlib.sha256(data).hexdigest()
    os.symlink("dir0/f0", c.mnt / "link")

    # a writer keeps changing the namespace while the backup runs
    stop = threading.Event()
    (c.mnt / "busy").mkdir()

    def writer():
        i = 0
        while not stop.is_set():
            (c.mnt / "busy" / f"w{i}").write_bytes(_content(f"w{i}"))
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        backup = c.root / "meta-backup.db"
        out = run_cli("meta", "backup", str(backup), "--dir", str(c.state)).stdout
        assert "backed up" in out and backup.stat().st_size > 0
    finally:
        stop.set()
        t.join()
    assert run_cli("meta", "backup", str(backup), "--dir", str(c.state), check=False).returncode == 1  # no overwrite

    (c.mnt / "after-backup").write_bytes(b"lost by the restore")
    refused = run_cli("meta", "restore", str(backup), "--dir", str(c.state), check=False)
    assert refused.returncode == 3 and "stop the metadata daemon" in refused.stderr

    # a fresh metadata daemon: the database is gone; chunk data stays on the storage nodes
    c.local.down()
    for f in (c.state / "meta").glob("meta.sqlite3*"):
        if not f.name.endswith(".lock"):
            f.unlink()
    out = run_cli("meta", "restore", str(backup), "--dir", str(c.state)).stdout
    assert "restored" in out and "previous database" not in out
    c.up()

    seen = set()
    for path in sorted(p for p in c.mnt.rglob("*") if p.is_file() and not p.is_symlink()):
        rel = str(path.relative_to(c.mnt))
        data = path.read_bytes()
        if rel.startswith("busy/"):
            # created before the snapshot; its data committed before it, or not yet (then empty)
            assert data in (_content(path.name), b""), rel
        else:
            assert hashlib.sha256(data).hexdigest() == sums[rel], rel
        seen.add(rel)
    assert set(sums) <= seen
    assert os.readlink(c.mnt / "link") == "dir0/f0"
    assert not (c.mnt / "after-backup").exists()

    # the restored daemon hands out new epochs and inodes: new files work and are seen from another mount
    (c.mnt / "after-restore").write_bytes(b"new" * 50_000)
    other = c.mount_again("second")
    assert (other / "after-restore").read_bytes() == b"new" * 50_000
    assert hashlib.sha256((other / "dir1" / "f1").read_bytes()).hexdigest() == sums["dir1/f1"]


def test_restore_refuses_what_is_not_a_backup(tmp_path):
    state = tmp_path / "state"
    (state / "meta").mkdir(parents=True)
    (state / "meta" / "metad.toml").write_text(f'data_dir = "{state / "meta"}"\n')
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database" * 100)
    res = run_cli("meta", "restore", str(junk), "--dir", str(state), check=False)
    assert res.returncode == 3 and "junk.db" in res.stderr and "Traceback" not in res.stderr
    assert not (state / "meta" / "meta.sqlite3").exists()
    res = run_cli("meta", "backup", str(tmp_path / "b.db"), "--dir", str(state), check=False)
    assert res.returncode == 1 and "no metadata database" in res.stderr
