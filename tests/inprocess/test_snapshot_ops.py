"""Directory snapshots end to end through the mount's handlers (daemon/snapshots.py, docs/snapshots.md).

Real daemon and storage node processes; the requests ``stripefs snapshot`` sends.
A snapshot taken while a writer appends reads back what was committed then,
however the live file changes afterwards (each change of a shared chunk copies it
out first); deleting both sides leaves no chunk file on the nodes and fsck clean;
every changing request into a snapshot is EROFS. The first test runs on
PostgreSQL with two daemons too.
"""

from __future__ import annotations

import errno
import os
import stat

import pytest
import trio

from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode, StripefsError

from fsapi import Kernel, open_fs, raises_errno
from util import eventually_async

KiB = 1 << 10


def _copies(rig, ino: int) -> list:
    return list(rig.root.glob(f"storage-*/data/chunks/*/*/{ino}-*.chunk"))


async def _snapshot(fs, d: int, name: bytes) -> int:
    """``stripefs snapshot create``; the snapshot's top directory inode (through its path, as a reader finds it)."""
    (info,) = (await fs.ops.meta.call(P.SnapshotCreateReq(ino=d, name=name))).snapshots
    holder = (await fs.lookup(d, b".snapshots")).nodeid
    top = (await fs.lookup(holder, name)).nodeid
    assert top == info.ino
    return top


async def _read_cold(fs, monkeypatch, parent: int, name: bytes) -> bytes:
    """``name`` as a fresh client reads it: from the storage nodes, not this client's caches."""
    async with open_fs(fs.rig, Kernel(monkeypatch), "snapshot-reader") as reader:
        return await reader.read_file(parent, name)


async def _fsck_clean(fs, inodes) -> None:
    """fsck finds no orphan or missing copy of ``inodes`` on any node. Only those: the rig is shared
    with the worker's other tests, whose copies may be in flight (a write not committed yet is an
    orphan to fsck) while this one checks."""
    for node_id in fs.rig.node_addresses:
        report = await fs.ops.meta.call(P.FsckReq(node_id=node_id))
        mine = [line for line in report.problems if any(f" {ino}:" in line for ino in inodes)]
        assert mine == [], report.problems


@pytest.fixture
def rig(request, sqlite_rig):
    """SQLite; a test parametrized with ``rig`` (indirect) names the rig fixture it runs on."""
    return request.getfixturevalue(request.param) if hasattr(request, "param") else sqlite_rig


#: the shared PostgreSQL rig has two daemons: the create on one, the copy-out at a commit through the same
BOTH = pytest.mark.parametrize("rig", ["sqlite_rig", pytest.param("pg_rig", marks=pytest.mark.pg_rig)], indirect=True)


@BOTH
async def test_a_snapshot_taken_while_a_writer_appends_reads_what_was_committed_then(fs, monkeypatch):
    d = await fs.mkdir(fs.dir, b"data")
    first = os.urandom(300 * KiB)
    fh, ino = await fs.create(d, b"log")
    await fs.write(fh, 0, first)
    await fs.fsync(fh)  # committed: in the snapshot
    top = await _snapshot(fs, d, b"s1")
    snap = (await fs.lookup(top, b"log")).nodeid
    await fs.write(fh, len(first), os.urandom(200 * KiB))  # the writer goes on appending
    await fs.close(fh)
    assert len(await fs.read_file(d, b"log")) == 500 * KiB
    assert await _read_cold(fs, monkeypatch, top, b"log") == first

    for _ in range(3):  # rewrites in place: the second one's slot is the snapshot's (common/layout.py "Slots")
        fh, _ = await fs.open_path(d, b"log", os.O_WRONLY)
        await fs.write(fh, 0, os.urandom(250 * KiB))
        await fs.close(fh)
        assert await _read_cold(fs, monkeypatch, top, b"log") == first
    await fs.setattr(ino, st_size=10 * KiB)  # truncate
    assert await _read_cold(fs, monkeypatch, top, b"log") == first
    await fs.write_file(d, b"log", os.urandom(100 * KiB))  # O_TRUNC and write again
    assert await _read_cold(fs, monkeypatch, top, b"log") == first
    await fs.unlink(d, b"log")
    assert await _read_cold(fs, monkeypatch, top, b"log") == first
    assert await _read_cold(fs, monkeypatch, top, b"log") == first  # after the collector's round too
    await fs.ops.meta.call(P.SnapshotDeleteReq(ino=d, name=b"s1"))
    assert not await fs.exists(d, b".snapshots")
    await eventually_async(lambda: not _copies(fs.rig, ino) and not _copies(fs.rig, snap), within=30,
                           what="every copy of the live file and of the snapshot deleted")
    await _fsck_clean(fs, [ino, snap])


@pytest.mark.parametrize("order", ["live first", "snapshot first"])
async def test_deleting_the_live_tree_and_the_snapshot_frees_every_chunk(fs, monkeypatch, order):
    d = await fs.mkdir(fs.dir, b"data")
    sub = await fs.mkdir(d, b"sub")
    data = {b"a": os.urandom(120 * KiB), b"b": os.urandom(5 * KiB)}
    inos = [await fs.write_file(sub, name, payload) for name, payload in data.items()]
    chunk_files = set(fs.rig.root.glob("storage-*/data/chunks/*/*/*.chunk"))
    top = await _snapshot(fs, d, b"s")
    assert set(fs.rig.root.glob("storage-*/data/chunks/*/*/*.chunk")) - chunk_files == set()  # no chunk copied or written
    snap_sub = (await fs.lookup(top, b"sub")).nodeid
    snap_inos = [(await fs.lookup(snap_sub, name)).nodeid for name in data]
    for name, payload in data.items():
        assert await fs.read_file(snap_sub, name) == payload
    await fs.write_file(sub, b"a", os.urandom(120 * KiB))  # one chunk copied out: the snapshot's own copy
    assert _copies(fs.rig, snap_inos[0]), "the copy-out stored the snapshot's own copy"

    async def delete_live():
        for name in data:
            await fs.unlink(sub, name)
        await fs.rmdir(d, b"sub")
        if order == "live first":  # the collector's round has run (a's own copies are gone): b's shared ones stay
            await eventually_async(lambda: not _copies(fs.rig, inos[0]), within=30, what="the live file's copies deleted")
            assert await _read_cold(fs, monkeypatch, snap_sub, b"b") == data[b"b"]

    async def delete_snapshot():
        await fs.ops.meta.call(P.SnapshotDeleteReq(ino=d, name=b"s"))

    for step in ((delete_live, delete_snapshot) if order == "live first" else (delete_snapshot, delete_live)):
        await step()
    await eventually_async(lambda: not any(_copies(fs.rig, i) for i in inos + snap_inos), within=30,
                           what="no chunk file of either side left on the nodes")
    await _fsck_clean(fs, inos + snap_inos)


async def _open_and_write(fs, ino: int) -> None:
    """open(O_WRONLY) and a write: refused at the OPEN, or with no OPEN sent (no-open) at the first WRITE."""
    fh = await fs.open(ino, os.O_WRONLY)
    try:
        await fs.write(fh, 0, b"z")
    finally:
        await fs.release(fh)


async def test_every_write_path_into_a_snapshot_is_erofs(fs):
    d = await fs.mkdir(fs.dir, b"data")
    await fs.write_file(d, b"f", b"x" * 1000)
    await fs.mkdir(d, b"dir")
    top = await _snapshot(fs, d, b"s")
    f = (await fs.lookup(top, b"f")).nodeid
    holder = (await fs.lookup(d, b".snapshots")).nodeid
    for attempt in (
        lambda: fs.write_file(top, b"new", b"y"),
        lambda: fs.mkdir(top, b"newdir"),
        lambda: fs.symlink(top, b"ln", b"f"),
        lambda: fs.unlink(top, b"f"),
        lambda: fs.rmdir(top, b"dir"),
        lambda: fs.rename(top, b"f", top, b"g"),
        lambda: fs.rename(top, b"f", d, b"g"),
        lambda: fs.rename(d, b"f", top, b"f"),
        lambda: fs.link(f, d, b"hard"),
        lambda: fs.setattr(f, st_mode=stat.S_IFREG | 0o600),
        lambda: fs.setattr(f, st_size=0),
        lambda: fs.setxattr(f, b"user.k", b"v"),
        lambda: _open_and_write(fs, f),
        lambda: fs.mkdir(holder, b"mine"),
        lambda: fs.rmdir(d, b".snapshots"),  # rm -rf DIR stops here while snapshots exist
        lambda: fs.rmdir(holder, b"s"),
    ):
        async with raises_errno(errno.EROFS):
            await attempt()
    with pytest.raises(StripefsError) as info:
        await fs.ops.meta.call(P.SnapshotCreateReq(ino=d, name=b"s"))
    assert info.value.code == ErrorCode.EXISTS
    assert await fs.read_file(top, b"f") == b"x" * 1000
    names = [s.name for s in (await fs.ops.meta.call(P.SnapshotListReq(ino=d))).snapshots]
    assert names == [b"s"]
    await fs.ops.meta.call(P.SnapshotDeleteReq(ino=d, name=b"s"))
    assert (await fs.ops.meta.call(P.SnapshotListReq(ino=d))).snapshots == []
    await fs.rmdir(d, b"dir")  # the live tree is as it was: writable
    await fs.unlink(d, b"f")
    await fs.rmdir(fs.dir, b"data")


async def _chunk0(fs, ino: int) -> P.ChunkRef:
    return (await fs.ops.meta.call(P.OpenReq(ino=ino, session_id=0))).chunks[0]


async def test_a_snapshot_reads_its_data_after_a_node_is_killed_and_its_chunks_repaired(fs, monkeypatch):
    d = await fs.mkdir(fs.dir, b"data")
    data = os.urandom(200 * KiB)
    ino = await fs.write_file(d, b"f", data)
    top = await _snapshot(fs, d, b"s")
    snap = (await fs.lookup(top, b"f")).nodeid
    ref = await _chunk0(fs, snap)
    assert ref.data_ino == ino
    killed = ref.nodes[0]
    fs.rig.expect_log(r"node %d|Connection|unreachable|timed out" % killed)
    fs.rig.kill_node(killed)
    try:
        async def repaired() -> bool:
            return killed not in (await _chunk0(fs, snap)).nodes and killed not in (await _chunk0(fs, ino)).nodes

        with trio.fail_after(60):  # the node is declared down (node_timeout_s), then the healer copies
            while not await repaired():
                await trio.sleep(0.2)
        now = await _chunk0(fs, snap)
        assert now.data_ino == ino and now.version == ref.version  # still shared, under the live file's ids
        assert await _read_cold(fs, monkeypatch, top, b"f") == data
        for _ in range(2):  # the live file moves twice: the repaired shared copies are copied out first
            await fs.write_file(d, b"f", os.urandom(200 * KiB))
        assert await _read_cold(fs, monkeypatch, top, b"f") == data
    finally:
        await fs.rig.restart()
