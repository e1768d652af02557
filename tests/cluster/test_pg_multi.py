"""Two metadata daemons over one PostgreSQL database, with racing clients on two mounts.

The first mount talks to daemon 1, the second to daemon 2 only. What the
daemons decide is checked through the mounts (error codes of the racing
calls) and in the database itself (the tree: every directory reachable from
the root exactly once, nlink counts right), because a mount's kernel cache
may not yet show the other daemon's changes (cross-daemon invalidation is the
change log's job, not tested here).
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path

import psycopg
import pytest

ROUNDS = 30


@pytest.fixture(scope="module")
def mounts(pg_cluster):
    """(mount on daemon 1, mount on daemon 2), each test in fresh directories."""
    second = pg_cluster.local.meta_addresses[1]
    m2 = pg_cluster.mount_again("mnt-daemon2", meta=second)
    yield pg_cluster.mnt, m2
    pg_cluster.unmount(m2)
    pg_cluster.extra_mounts.remove(m2)


def _dsn(cluster) -> str:
    info = json.loads(cluster.local.info_path.read_text())
    return f"host=127.0.0.1 port={info['postgres']['port']} dbname=stripefs user=postgres"


def _race(*calls):
    """Run the calls at once (threads released together); each one's errno, or 0."""
    barrier = threading.Barrier(len(calls))
    results = [None] * len(calls)

    def run(i, fn):
        barrier.wait()
        try:
            fn()
            results[i] = 0
        except OSError as exc:
            results[i] = exc.errno

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _tree(dsn: str) -> tuple[dict[int, tuple[int, bytes]], dict[int, int]]:
    """Directory entries ino -> (parent, name) and inode -> nlink, from the database."""
    with psycopg.connect(dsn) as conn:
        entries = {ino: (parent, bytes(name)) for parent, name, ino in conn.execute("SELECT parent, name, ino FROM dentries")}
        nlinks = dict(conn.execute("SELECT ino, nlink FROM inodes WHERE (mode & 61440) = 16384"))
    return entries, nlinks


def _check_tree(dsn: str) -> None:
    """Every directory reaches the root without a cycle; a directory's nlink is 2 + its subdirectories."""
    entries, nlinks = _tree(dsn)
    for ino in nlinks:
        seen, cur = set(), ino
        while cur != 1:
            assert cur not in seen, f"cycle through inode {cur}"
            seen.add(cur)
            assert cur in entries, f"directory {ino} is cut off from the root at {cur}"
            cur = entries[cur][0]
    subdirs = {ino: 0 for ino in nlinks}
    for ino, (parent, _) in entries.items():
        if ino in nlinks:
            subdirs[parent] += 1
    assert {ino: 2 + n for ino, n in subdirs.items()} == nlinks


def test_same_name_create_on_two_daemons_one_wins(pg_cluster, mounts):
    m1, m2 = mounts
    (m1 / "creates").mkdir()
    base2 = m2 / "creates"
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
    for i in range(ROUNDS):
        name = f"f{i}"

        def create(path):
            return lambda: os.close(os.open(path, flags, 0o644))

        results = _race(create(m1 / "creates" / name), create(base2 / name))
        assert sorted(results) == [0, errno.EEXIST], (name, results)
    for i in range(ROUNDS):  # mkdir races the same way
        results = _race(lambda: os.mkdir(m1 / "creates" / f"d{i}"), lambda: os.mkdir(base2 / f"d{i}"))
        assert sorted(results) == [0, errno.EEXIST], (i, results)
    names = sorted(os.listdir(m1 / "creates"))
    assert names == sorted([f"f{i}" for i in range(ROUNDS)] + [f"d{i}" for i in range(ROUNDS)])
    entries, _ = _tree(_dsn(pg_cluster))
    parent = os.stat(m1 / "creates").st_ino
    assert sorted(name for p, name in entries.values() if p == parent) == sorted(n.encode() for n in names)
    _check_tree(_dsn(pg_cluster))


def test_crossing_directory_renames_make_no_cycle(pg_cluster, mounts):
    m1, m2 = mounts
    for i in range(ROUNDS):
        top = m1 / f"ren{i}"
        (top / "a" / "inside-a").mkdir(parents=True)
        (top / "b" / "inside-b").mkdir(parents=True)
        (top / "a" / "file").write_bytes(b"x")
        top2 = m2 / f"ren{i}"
        # a into b, and b into a, at once: together they would make a cycle
        results = _race(lambda: os.rename(top / "a", top / "b" / "a"), lambda: os.rename(top2 / "b", top2 / "a" / "b"))
        assert results.count(0) == 1, results
        assert set(results) <= {0, errno.EINVAL, errno.ENOENT}, results
    dsn = _dsn(pg_cluster)
    _check_tree(dsn)
    entries, _ = _tree(dsn)
    for i in range(ROUNDS):  # one of the two layouts, nothing lost
        found = _paths_under(entries, os.stat(m1 / f"ren{i}").st_ino)
        assert found in (
            ["b", "b/a", "b/a/file", "b/a/inside-a", "b/inside-b"],
            ["a", "a/b", "a/b/inside-b", "a/file", "a/inside-a"],
        ), found


def test_renames_across_directories_from_both_daemons_lose_nothing(pg_cluster, mounts):
    """Many files shuffled between directories from both daemons at once: each file ends in exactly one place."""
    m1, m2 = mounts
    top = m1 / "shuffle"
    for d in "abcd":
        (top / d).mkdir(parents=True)
    files = [f"x{i}" for i in range(40)]
    for name in files:
        (top / "a" / name).write_bytes(name.encode())

    def mover(root: Path, src: str, dst: str):
        def run():
            for name in files:
                try:
                    os.rename(root / src / name, root / dst / name)
                except FileNotFoundError:
                    pass  # the other daemon moved it first

        return run

    _race(mover(top, "a", "b"), mover(m2 / "shuffle", "a", "c"), mover(m2 / "shuffle", "b", "d"))
    entries, _ = _tree(_dsn(pg_cluster))
    found = [p for p in _paths_under(entries, os.stat(top).st_ino) if "/" in p]
    assert sorted(p.split("/")[1] for p in found) == sorted(files)  # every file once, none twice, none lost
    for path in found:  # names the mount has not cached: looked up afresh
        assert (top / path).read_bytes() == path.split("/")[1].encode()


def _paths_under(entries: dict[int, tuple[int, bytes]], top: int) -> list[str]:
    """Sorted relative paths of everything below directory ``top``, from the database's entries."""
    children: dict[int, list[tuple[bytes, int]]] = {}
    for ino, (parent, name) in entries.items():
        children.setdefault(parent, []).append((name, ino))
    out, stack = [], [(top, "")]
    while stack:
        ino, prefix = stack.pop()
        for name, child in children.get(ino, []):
            path = prefix + name.decode()
            out.append(path)
            stack.append((child, path + "/"))
    return sorted(out)


def test_file_open_through_one_daemon_survives_unlink_through_the_other(pg_cluster, mounts):
    """daemon/open_holds.py: daemon 1 must not reclaim a file that a mount of daemon 2 holds open."""
    from stripefs.daemon.open_holds import GRACE_S, SWEEP_INTERVAL_S

    m1, m2 = mounts
    (m1 / "held").mkdir()
    (m1 / "held" / "f").write_bytes(os.urandom(300_000))
    ino = os.stat(m1 / "held" / "f").st_ino
    dsn = _dsn(pg_cluster)

    def rows():
        with psycopg.connect(dsn) as conn:
            inode = conn.execute("SELECT nlink FROM inodes WHERE ino=%s", (ino,)).fetchone()
            chunks = conn.execute("SELECT count(*) FROM chunks WHERE ino=%s", (ino,)).fetchone()[0]
        return inode, chunks

    fd = os.open(m2 / "held" / "f", os.O_RDONLY)
    try:
        assert len(os.pread(fd, 10, 0)) == 10
        os.unlink(m1 / "held" / "f")
        # past the grace period and two orphan sweeps of every daemon: still there, an orphan
        time.sleep(GRACE_S + 2 * SWEEP_INTERVAL_S + 1)
        inode, chunks = rows()
        assert inode == (0,) and chunks >= 1
    finally:
        os.close(fd)
    deadline = time.monotonic() + 60
    while rows()[0] is not None:  # released: reclaimed by a daemon
        assert time.monotonic() < deadline, "orphan never reclaimed after the last close"
        time.sleep(0.5)
    assert rows() == (None, 0)
