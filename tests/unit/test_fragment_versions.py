"""Per-fragment versions of an erasure-coded stripe (common/protocol.ChunkRef ``fversions``):
the chunk row keeps each fragment's version, and every reader of the row (commits' garbage,
repair, reclaiming an expired session's slots, snapshots, the mount's decoding) takes the
fragment's own version, not the row's. A row whose fragments all share the row's version
stores none (the migration's rows, and every stripe written whole)."""

from __future__ import annotations

import sqlite3

from stripefs.common import protocol as P
from stripefs.common.erasure import codec, fragment_part
from stripefs.common.errors import ErrorCode
from stripefs.daemon.db import DB_NAME, MIGRATIONS, open_database, set_schema_version
from stripefs.daemon.repair_plan import ChunkRow, plan
from stripefs.daemon.store import EXACT_PART, SqliteStore
from test_namespace import LAYOUT, ROOT, code_of, w  # noqa: F401  (w: the fixture)
from test_repair import _file, svc  # noqa: F401  (svc: the fixture)

EC = "ec=2+1"


def _garbage(store) -> list[tuple]:
    return sorted(tuple(r) for r in store.execute("SELECT node_id, ino, idx, part, max_version FROM garbage"))


def _ec_file(w) -> int:
    ino = w.ns.create(ROOT, b"f", 0o644, 0, 0)[0]
    w.atomically(lambda: (w.store.update_inode(ino, redundancy=EC), w.store.put_chunk(ino, 0, 8, [1, 2, 3])))
    return ino


def test_a_commit_keeps_each_fragment_s_version_and_collects_only_the_slots_it_left(w):
    ino = _ec_file(w)
    # a delta left fragment 0 at v8; fragments 1 and 2 went to v9's slot: only their v8 slots are garbage
    w.ns.commit(ino, 100, 1, [P.ChunkRef(index=0, version=9, nodes=[1, 2, 3], fversions=[8, 9, 9])])
    assert w.store.get_chunks(ino)[0] == (9, [1, 2, 3], [8, 9, 9])
    assert _garbage(w.store) == [(2, ino, 0, fragment_part(1, 8), 8), (3, ino, 0, fragment_part(2, 8), 8)]
    (ref,) = w.ns.open_info(ino)[2]
    assert ref.fversions == [8, 9, 9] and [ref.fragment_version(j) for j in range(3)] == [8, 9, 9]
    w.atomically(lambda: w.store.put_chunk(ino, 0, 9, [1, 4, 3]))  # only a node changes (a repair): the versions stay
    assert w.store.get_chunks(ino)[0] == (9, [1, 4, 3], [8, 9, 9])
    # each fragment to the slot its own version does not use: fragment 0 (v8) at 11, the others (v9) at 10
    w.ns.commit(ino, 100, 2, [P.ChunkRef(index=0, version=11, nodes=[1, 4, 3], fversions=[11, 10, 10])])
    assert w.store.get_chunks(ino)[0] == (11, [1, 4, 3], [11, 10, 10])
    assert _garbage(w.store) == sorted([  # (the row's nodes' earlier deletions were cancelled by the put: put_chunk)
        (2, ino, 0, fragment_part(1, 8), 8),
        (1, ino, 0, fragment_part(0, 8), 8), (4, ino, 0, fragment_part(1, 9), 9), (3, ino, 0, fragment_part(2, 9), 9),
    ])
    # a stripe written whole: one version, none stored
    w.ns.commit(ino, 100, 3, [P.ChunkRef(index=0, version=12, nodes=[1, 4, 3], fversions=[12, 12, 12])])
    assert w.store.get_chunks(ino)[0] == (12, [1, 4, 3], [])
    bad = P.ChunkRef(index=0, version=13, nodes=[1, 4, 3], fversions=[14, 13, 13])  # a fragment newer than its stripe
    assert code_of(w.ns.commit, ino, 100, 4, [bad]) == ErrorCode.INVALID


def test_a_snapshot_s_row_carries_the_versions_and_its_copy_out_names_each_fragment_s_own(w):
    from stripefs.daemon.snapshots import CopyOutNeeded

    d = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    ino = w.ns.create(d, b"f", 0o644, 0, 0)[0]
    w.atomically(lambda: (w.store.update_inode(ino, redundancy=EC), w.store.put_chunk(ino, 0, 8, [1, 2, 3])))
    w.ns.commit(ino, 100, 1, [P.ChunkRef(index=0, version=9, nodes=[1, 2, 3], fversions=[8, 9, 9])])
    _, top, _ = w.ns.snapshots.create(d, b"s")
    snap_f = w.ns.lookup(top, b"f").ino
    (ref,) = w.ns.open_info(snap_f)[2]
    assert (ref.version, ref.fversions, ref.data_ino) == (9, [8, 9, 9], ino)
    try:
        w.ns.commit(ino, 100, 2, [P.ChunkRef(index=0, version=11, nodes=[1, 2, 3], fversions=[11, 10, 10])])
    except CopyOutNeeded as need:
        assert sorted(need.pins[0].parts) == [(1, fragment_part(0, 8), 8), (2, fragment_part(1, 9), 9), (3, fragment_part(2, 9), 9)]
    else:
        raise AssertionError("the commit moved a pinned stripe without a copy-out")


def test_rows_written_before_the_column_read_as_every_fragment_at_the_row_s_version(tmp_path):
    conn = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    old = SqliteStore(conn)
    for target, migrate in enumerate(MIGRATIONS[:9], start=1):  # the schema as schema version 9 left it
        migrate(old, LAYOUT)
        set_schema_version(old, target)
    conn.execute("INSERT INTO inodes (ino, mode, uid, gid, nlink, atime_ns, mtime_ns, ctime_ns, chunk_size, stripe_count,"
                 " redundancy, stripe_seed) VALUES (5, 33188, 0, 0, 1, 0, 0, 0, 1048576, 2, ?, 0)", (EC,))
    conn.execute("INSERT INTO chunks (ino, idx, version, nodes) VALUES (5, 0, 7, '1,2,3')")
    conn.close()
    store = SqliteStore(open_database(tmp_path / DB_NAME, LAYOUT))
    try:
        assert store.get_chunks(5) == {0: (7, [1, 2, 3], [])}
    finally:
        store.close()


def test_an_expired_session_s_slots_are_each_fragment_s_other_one(svc):  # noqa: F811
    """The hazard: the slot a session wrote a fragment into is the one its *own* version does not
    use; for a fragment left at an older version of the other parity, the row's ``version + 1``
    slot is where its committed copy is, and reclaiming that would lose it."""
    ino = _file(svc, b"ec", chunks=())
    svc.store.update_inode(ino, redundancy=EC)
    svc.store.put_chunk(ino, 0, 9, [1, 2, 3], [8, 9, 9])
    bound = svc.ns.last_epoch()
    with svc.store.savepoint():
        svc.healer.reclaim_uncommitted([ino])
    assert _garbage(svc.store.conn) == sorted([
        (1, ino, 0, fragment_part(0, 9) | EXACT_PART, bound),  # never fragment_part(0, 10) = its committed v8
        (2, ino, 0, fragment_part(1, 10) | EXACT_PART, bound), (3, ino, 0, fragment_part(2, 10) | EXACT_PART, bound),
    ])


def test_repair_and_bad_copy_reports_take_the_fragment_s_own_version(svc):  # noqa: F811
    ino = _file(svc, b"ec", chunks=())
    svc.store.update_inode(ino, redundancy=EC)
    svc.store.put_chunk(ino, 0, 9, [1, 2, 3], [8, 9, 9])
    with svc.store.savepoint():  # fragment 0's committed copy is v8's slot: a report of v9's is of another version
        assert svc.healer.mark_bad(1, [P.ChunkId(ino, 0, fragment_part(0, 9))]) == 0
    with svc.store.savepoint():
        assert svc.healer.mark_bad(1, [P.ChunkId(ino, 0, fragment_part(0, 8))]) == 1
    assert svc.store.get_chunks(ino)[0] == (9, [0, 2, 3], [8, 9, 9])
    rows = [ChunkRow.from_sql(r) for r in svc.store.chunk_rows_page((0, -1), 100) if r[0] == ino]
    assert rows[0].fversions == (8, 9, 9)
    (task,) = plan(rows, {n: "up" for n in (1, 2, 3, 4)}).tasks
    assert (task.kind, task.slot, task.slot_version, task.part) == ("reconstruct", 0, 8, fragment_part(0, 8))
    with svc.store.savepoint():  # rebuilt at the row's version instead: not the fragment the row names
        assert not svc.healer._record(task, 4, 9)
    with svc.store.savepoint():
        assert svc.healer._record(task, 4, 8)
    assert svc.store.get_chunks(ino)[0] == (9, [4, 2, 3], [8, 9, 9])


def test_the_mount_decodes_fragments_at_their_own_versions():
    from stripefs.client.ec_path import EcPath

    c = codec(2, 1, 1 << 16)
    frags = c.encode(bytes(range(256)) * 256)
    ref = P.ChunkRef(index=0, version=9, nodes=[1, 2, 3], fversions=[8, 9, 9])
    got = {0: (8, frags[0]), 2: (9, frags[2])}
    assert EcPath._decodable(c, ref, got) == {0: frags[0], 2: frags[2]}
    assert EcPath._decodable(c, ref, {0: (6, frags[0]), 2: (9, frags[2])}) is None  # fragment 0 is not v8: not this stripe
