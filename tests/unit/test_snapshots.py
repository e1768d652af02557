"""Directory snapshots in the namespace (daemon/snapshots.py): the copy, read-only, pins, the collector.

On SQLite and PostgreSQL (test_namespace's ``w``); subtree keys against an
in-process CURVE cluster (test_security.secure_cluster). The data path (copy-outs on
real storage nodes, reads of shared chunks) is tests/inprocess/test_snapshot_ops.py.
"""

from __future__ import annotations

import stat
import time

import pytest

from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode
from stripefs.daemon.snapshots import CopyOutNeeded
from test_namespace import ROOT, code_of, w  # noqa: F401  (w: the fixture)
from test_security import _code, secure_cluster
from test_trash import _data_set, _file, _tree


def _snapshot(w, d: int, name: bytes) -> int:
    _, top, _ = w.ns.snapshots.create(d, name)
    return top


def _raises(fn, *args, **kwargs) -> CopyOutNeeded:
    with pytest.raises(CopyOutNeeded) as info:
        fn(*args, **kwargs)
    return info.value


def test_a_snapshot_is_the_tree_as_it_was_with_every_chunk_shared(w):
    top = _data_set(w)
    w.ns.link(w.ns.lookup(top, b"README").ino, top, b"README.link")  # hard links stay one inode
    w.ns.setxattr(top, b"user.tag", b"v1")
    before = _tree(w, top)
    snap = _snapshot(w, top, b"v1")
    assert w.ns.lookup(w.ns.lookup(top, b".snapshots").ino, b"v1").ino == snap
    copy = _tree(w, snap)
    assert sorted(copy) == sorted(before)
    for path, (ino, mode, size, uid, nlink, chunks) in before.items():
        s_ino, s_mode, s_size, s_uid, s_nlink, s_chunks = copy[path]
        assert (s_mode, s_size, s_uid, s_nlink, s_chunks) == (mode, size, uid, nlink, chunks) and s_ino != ino
        if stat.S_ISREG(mode) and chunks:  # reads go to the live file's chunk ids
            assert {c.data_ino for c in w.ns.open_info(s_ino)[2]} == {ino}
    assert copy[b"/README"][0] == copy[b"/README.link"][0]
    assert w.ns.readlink(copy[b"/latest"][0]) == b"train/shard-0"
    assert w.ns.getxattr(snap, b"user.tag") == b"v1"
    assert w.ns.getattr(snap).nlink == w.ns.getattr(top).nlink - 1  # no .snapshots inside the copy
    assert w.store.count_garbage() == 0
    snap2 = _snapshot(w, top, b"v2")  # the .snapshots directory is not copied into the next one
    assert sorted(_tree(w, snap2)) == sorted(before)
    assert [s.name for s in w.ns.snapshots.infos(top)] == [b"v1", b"v2"]


def test_every_change_inside_a_snapshot_is_read_only(w):
    top = _data_set(w)
    snap = _snapshot(w, top, b"s")
    holder = w.ns.lookup(top, b".snapshots").ino
    f = w.ns.lookup(snap, b"README").ino
    train = w.ns.lookup(snap, b"train").ino
    ro = ErrorCode.READ_ONLY
    assert code_of(w.ns.create, snap, b"new", 0o644, 0, 0) == ro
    assert code_of(w.ns.mkdir, train, b"new", 0o755, 0, 0) == ro
    assert code_of(w.ns.unlink, snap, b"README") == ro
    assert code_of(w.ns.rmdir, top, b".snapshots") == ro
    assert code_of(w.ns.rmdir, holder, b"s") == ro
    assert code_of(w.ns.rename, snap, b"README", top, b"stolen") == ro
    assert code_of(w.ns.rename, top, b"README", snap, b"README") == ro
    assert code_of(w.ns.link, f, top, b"hard") == ro
    assert code_of(w.ns.setattr, f, mode=0o600) == ro
    assert code_of(w.ns.setxattr, f, b"user.k", b"v") == ro
    assert code_of(w.ns.removexattr, f, b"user.k") == ro
    assert code_of(w.ns.set_layout, train, chunk_size=1 << 16) == ro
    assert code_of(w.ns.alloc_chunks, f, [1]) == ro
    assert code_of(w.ns.commit, f, 10, 1, []) == ro
    assert code_of(w.ns.snapshots.create, snap, b"nested") == ro
    assert code_of(w.ns.snapshots.create, top, b"s") == ErrorCode.EXISTS


def test_a_commit_or_truncate_moving_a_live_chunk_off_a_pinned_version_copies_it_out_first(w):
    d = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    f = _file(w, d, b"f", 100)
    (ref,) = w.ns.open_info(f)[2]
    snap_f = w.ns.lookup(_snapshot(w, d, b"s"), b"f").ino
    newer = P.ChunkRef(index=0, version=ref.version + 1, nodes=ref.nodes)
    assert w.ns.commit(f, 100, 1, [ref]).size == 100  # the same version: nothing moves
    need = _raises(w.ns.commit, f, 200, 2, [newer])
    assert [(p.ino, p.idx, p.version, p.data_ino) for p in need.pins] == [(snap_f, 0, ref.version, f)]
    assert sorted(need.pins[0].parts) == sorted((n, 32 * (ref.version & 1), ref.version) for n in ref.nodes)
    assert w.ns.getattr(f).size == 100  # nothing of the commit was applied
    assert code_of(w.ns.setattr, f, size=0) == ErrorCode.BUSY  # a truncate past it too
    assert w.store.snapshot_usage() == (1, 0)  # sharing everything: it holds nothing of its own
    w.atomically(lambda: w.raw.snapshots.copied(need.pins))  # the service copied the bytes
    assert w.ns.commit(f, 200, 2, [newer]).size == 200
    assert [c.data_ino for c in w.ns.open_info(snap_f)[2]] == [0]  # its own copies now
    assert w.store.snapshot_usage() == (1, 100)  # status: the file's 100 bytes are the snapshot's alone
    assert w.store.counts()["files"] == 1  # the live file only
    assert w.ns.setattr(f, size=0).size == 0


def test_the_collector_keeps_a_copy_a_snapshot_reads_until_the_snapshot_goes(w):
    d = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    f = _file(w, d, b"f", 100)
    nodes = w.ns.open_info(f)[2][0].nodes
    _snapshot(w, d, b"s")
    w.ns.unlink(d, b"f")  # the live file is freed: its copies are queued...
    assert w.store.count_garbage() == len(nodes)
    assert all(w.store.garbage_for_node(n, 100) == [] for n in nodes)  # ...but not deleted while pinned
    w.atomically(lambda: w.raw.snapshots.delete(d, b"s"))
    assert code_of(w.ns.lookup, d, b".snapshots") == ErrorCode.NOT_FOUND
    assert all({(r["ino"], r["idx"]) for r in w.store.garbage_for_node(n, 100)} == {(f, 0)} for n in nodes)
    assert w.store.count_snapshots() == 0 and w.ns.getattr(d).nlink == 2


def test_a_snapshot_of_ten_thousand_files_is_one_quick_transaction(w):
    if w.kind != "sqlite":
        pytest.skip("timed on the embedded store; PostgreSQL runs the same SQL in the tests above")
    d = w.ns.mkdir(ROOT, b"big", 0o755, 0, 0).ino

    def fill():  # 10 directories of 1,000 one-chunk files, written in bulk (the namespace's own calls take ~20 s here)
        store = w.raw.store
        subs = [w.raw.mkdir(d, b"s%d" % s, 0o755, 0, 0).ino for s in range(10)]
        inos = store.reserve_inos(10_000)
        now = time.time_ns()
        store.insert_rows("inodes", "ino,mode,uid,gid,nlink,size,atime_ns,mtime_ns,ctime_ns,chunk_size,stripe_count,redundancy,stripe_seed",
                          [(i, stat.S_IFREG | 0o644, 0, 0, 1, 10, now, now, now, 1 << 20, 2, "replicas=2", 7) for i in inos])
        store.insert_rows("dentries", "parent,name,ino", [(subs[n // 1000], b"f%d" % n, i) for n, i in enumerate(inos)])
        store.insert_rows("chunks", "ino,idx,version,nodes", [(i, 0, 3, "1,2") for i in inos])

    w.atomically(fill)
    rows, garbage = w.store.counts()["chunks"], w.store.count_garbage()
    took = []
    for name in (b"s1", b"s2"):  # the better of two: a shared machine's load spikes are not the code's
        started = time.perf_counter()
        w.atomically(lambda: w.raw.snapshots.create(d, name))
        took.append(time.perf_counter() - started)
    assert w.store.counts()["chunks"] == 3 * rows and w.store.count_garbage() == garbage  # rows only: no chunk data
    print(f"snapshot of 10,011 inodes: {min(took):.2f}..{max(took):.2f}s")
    # a loose bound (the goal is 2 s: bench/snapshot.py prints it with PASS/BELOW): copying chunks, or a row
    # at a time over the namespace's own calls, takes far longer
    assert min(took) < 5.0, f"a snapshot of 10,011 inodes took {min(took):.2f}s"


async def test_a_subtree_key_creates_lists_and_deletes_only_its_own_subtrees_snapshots(tmp_path):
    async with secure_cluster(tmp_path) as c:
        async with c.client("admin") as admin:
            async def mkdir(parent, name):
                return (await admin.call(P.MkdirReq(parent=parent, name=name, mode=0o40755, uid=0, gid=0)))[0].attr.ino

            team_a, team_b = await mkdir(ROOT, b"team-a"), await mkdir(ROOT, b"team-b")
            data_a, data_b = await mkdir(team_a, b"data"), await mkdir(team_b, b"data")
            await admin.call(P.SnapshotCreateReq(ino=data_b, name=b"b1"))
        async with c.client("team-admin") as team:  # an admin key restricted to /team-a
            (made,) = (await team.call(P.SnapshotCreateReq(ino=data_a, name=b"a1")))[0].snapshots
            assert [s.name for s in (await team.call(P.SnapshotListReq(ino=data_a)))[0].snapshots] == [b"a1"]
            holder = (await team.call(P.LookupReq(parent=data_a, name=b".snapshots")))[0].attr.ino
            assert (await team.call(P.LookupReq(parent=holder, name=b"a1")))[0].attr.ino == made.ino
            for request in (P.SnapshotCreateReq(ino=data_b, name=b"mine"), P.SnapshotListReq(ino=data_b),
                            P.SnapshotDeleteReq(ino=data_b, name=b"b1"), P.LookupReq(parent=data_b, name=b".snapshots")):
                assert await _code(team.call(request)) == ErrorCode.ACCESS
            await team.call(P.SnapshotDeleteReq(ino=data_a, name=b"a1"))
        async with c.client("team") as client:  # a client key of the same subtree: listing only
            assert (await client.call(P.SnapshotListReq(ino=data_a)))[0].snapshots == []
            assert await _code(client.call(P.SnapshotCreateReq(ino=data_a, name=b"x"))) == ErrorCode.ACCESS
        async with c.client("admin") as admin:
            assert [s.name for s in (await admin.call(P.SnapshotListReq(ino=data_b)))[0].snapshots] == [b"b1"]


async def test_a_subtree_key_gets_capabilities_for_the_removed_file_its_snapshot_reads(tmp_path):
    """A snapshot's shared chunks carry the live file's chunk ids: a /team-a mount asks for that file's
    capability (CapsReq) when a node refuses its read, also once the live file is gone."""
    async with secure_cluster(tmp_path) as c:
        async with c.client("admin") as admin:
            team_a = (await admin.call(P.MkdirReq(parent=ROOT, name=b"team-a", mode=0o40755, uid=0, gid=0)))[0].attr.ino
            await admin.call(P.MkdirReq(parent=ROOT, name=b"team-b", mode=0o40755, uid=0, gid=0))
            f = (await admin.call(P.CreateReq(parent=team_a, name=b"f", mode=0o100644, uid=0, gid=0, session_id=0)))[0].attr.ino
            await admin.call(P.CommitReq(ino=f, size=10, mtime_ns=1, chunks=[P.ChunkRef(index=0, version=3, nodes=[1])]))
            await admin.call(P.SnapshotCreateReq(ino=team_a, name=b"s"))
            await admin.call(P.UnlinkReq(parent=team_a, name=b"f"))
        async with c.client("team") as team:
            (cap,) = (await team.call(P.CapsReq(inos=[f])))[0].caps
            assert cap.ino == f
        async with c.client("team-b") as other:
            assert await _code(other.call(P.CapsReq(inos=[f]))) == ErrorCode.ACCESS


def test_a_snapshot_of_a_cold_file_keeps_its_object_and_needs_no_copy_out(w):
    d = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    f = _file(w, d, b"f", 100)
    (ref,) = w.ns.open_info(f)[2]

    def go_cold():  # what a migration leaves (daemon/tiering.py): a stored object, a row with no nodes
        w.raw.store.add_tier_objects([(f, 0, ref.version, 1, 1)])
        w.raw.store.set_object_stored(f, 0, ref.version, 100, 7)
        w.raw.store.put_chunk(f, 0, ref.version, [])

    w.atomically(go_cold)
    _snapshot(w, d, b"s")
    w.ns.commit(f, 200, 2, [P.ChunkRef(index=0, version=ref.version + 1, nodes=[1, 2])])  # no copy-out to make
    assert w.store.orphan_tier_objects(10) == []  # the snapshot's row still reads it
    w.atomically(lambda: w.raw.snapshots.delete(d, b"s"))
    assert [tuple(r)[:3] for r in w.store.orphan_tier_objects(10)] == [(f, 0, ref.version)]
