"""The trash (daemon/trash.py): removals kept, restored whole, charged to quotas, expired, scoped by key.

Namespace-level tests run on SQLite and PostgreSQL (test_namespace's ``w``);
the subtree-key test runs against an in-process CURVE cluster
(test_security.secure_cluster) with raw requests, as a hostile key would.
"""

from __future__ import annotations

import stat

import pytest

from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode
from test_namespace import ROOT, code_of, w  # noqa: F401  (w: the fixture)
from test_security import _code, secure_cluster

DAY_NS = 86400 * 10**9


def _tree(w, top: int) -> dict:
    """Everything below ``top`` a restore must bring back: path -> (ino, mode, size, uid, chunk rows)."""
    out, todo = {}, [(top, b"")]
    while todo:
        d, path = todo.pop()
        for e in w.ns.readdir(d, 0, 1000)[0]:
            attr = w.ns.getattr(e.attr.ino)
            chunks = sorted((c.index, c.version, tuple(c.nodes)) for c in w.ns.open_info(attr.ino)[2]) if stat.S_ISREG(attr.mode) else []
            out[path + b"/" + e.name] = (attr.ino, attr.mode, attr.size, attr.uid, attr.nlink, chunks)
            if stat.S_ISDIR(attr.mode):
                todo.append((attr.ino, path + b"/" + e.name))
    return out


def _file(w, parent: int, name: bytes, size: int) -> int:
    ino, _ = w.ns.create(parent, name, 0o644, 7, 7)
    version = w.ns.alloc_epoch()[0]
    nodes = w.ns.open_info(ino)[2][0].nodes
    w.ns.commit(ino, size, 1, [P.ChunkRef(index=0, version=version, nodes=nodes)])
    return ino


def _rm_rf(w, parent: int, name: bytes) -> None:
    """What rm -rf sends: every file unlinked, then directories bottom-up."""
    ino = w.ns.lookup(parent, name).ino
    for e in w.ns.readdir(ino, 0, 1000)[0]:
        if stat.S_ISDIR(e.attr.mode):
            _rm_rf(w, ino, e.name)
        else:
            w.ns.unlink(ino, e.name)
    w.ns.rmdir(parent, name)


def _data_set(w):
    top = w.ns.mkdir(ROOT, b"data", 0o755, 7, 7).ino
    sub = w.ns.mkdir(top, b"train", 0o700, 7, 7).ino
    deep = w.ns.mkdir(sub, b"shard-0", 0o755, 7, 7).ino
    _file(w, top, b"README", 100)
    for i in range(3):
        _file(w, deep, b"%d.jpg" % i, 1000 + i)
    _file(w, sub, b"labels.csv", 5000)
    w.ns.symlink(top, b"latest", b"train/shard-0", 7, 7)
    return top


def test_an_rm_rf_restored_from_the_trash_is_the_same_tree_and_freed_nothing(w):
    w.raw.trash.keep_ns = DAY_NS
    w.add_nodes()
    top = _data_set(w)
    before = _tree(w, top)
    _rm_rf(w, ROOT, b"data")
    assert code_of(w.ns.lookup, ROOT, b"data") == ErrorCode.NOT_FOUND
    assert w.store.count_garbage() == 0  # nothing of it is deleted on the nodes
    assert w.store.orphans() == []  # and no orphan sweep would take it
    assert w.ns.getattr(top).nlink == 0
    restored, left = w.ns.trash.restore(top)
    assert left == [] and len(restored) == len(before) + 1
    assert w.ns.lookup(ROOT, b"data").ino == top
    assert _tree(w, top) == before  # inode numbers, modes, sizes, owners, link counts, chunk versions and nodes
    assert w.ns.getattr(ROOT).nlink == 3
    assert w.ns.trash.rows() == []


def test_a_restore_says_what_it_could_not_put_back_and_takes_a_new_name(w):
    w.raw.trash.keep_ns = DAY_NS
    top = w.ns.mkdir(ROOT, b"d", 0o755, 0, 0).ino
    f = _file(w, top, b"f", 10)
    w.ns.unlink(top, b"f")
    w.ns.rmdir(ROOT, b"d")
    w.ns.mkdir(ROOT, b"d", 0o755, 0, 0)  # the old name is taken again
    assert code_of(w.ns.trash.restore, top) == ErrorCode.EXISTS
    # a removed directory takes no new entries, and its children cannot go back into it
    assert code_of(w.ns.mkdir, top, b"x", 0o755, 0, 0) == ErrorCode.NOT_FOUND
    assert code_of(w.ns.trash.restore, f) == ErrorCode.NOT_FOUND
    restored, left = w.ns.trash.restore(top, ROOT, b"d.restored")
    assert [r[0] for r in restored] == [top, f] and left == []
    assert w.ns.lookup(w.ns.lookup(ROOT, b"d.restored").ino, b"f").ino == f
    # two removed files of one name: the directory comes back with one, the other is named and stays
    again = w.ns.lookup(ROOT, b"d.restored").ino
    w.ns.unlink(again, b"f")
    second = _file(w, again, b"f", 20)
    w.ns.unlink(again, b"f")
    w.ns.rmdir(ROOT, b"d.restored")
    restored, left = w.ns.trash.restore(top)
    assert [r[0] for r in restored] == [top, f] and len(left) == 1 and left[0].startswith(f"{second}:")
    assert [r.ino for r in w.ns.trash.rows()] == [second]


def test_the_trash_stays_charged_to_its_quota_until_purged_and_recount_agrees(w):
    w.raw.trash.keep_ns = DAY_NS
    top = _data_set(w)
    w.ns.quotas.set(top, 1 << 30, 1000)
    used = (w.ns.quotas.get(top).used_bytes, w.ns.quotas.get(top).used_inodes)
    assert used == (100 + 1000 + 1001 + 1002 + 5000 + len(b"train/shard-0"), 8)
    sub = w.ns.lookup(top, b"train").ino
    _rm_rf(w, top, b"train")
    assert (w.ns.quotas.get(top).used_bytes, w.ns.quotas.get(top).used_inodes) == used
    assert w.atomically(lambda: w.raw.quotas.recount(top)) == []  # the recount counts the trash too
    # restored elsewhere (no quota there): the charge moves off
    w.ns.trash.restore(sub, ROOT, b"train")
    assert (w.ns.quotas.get(top).used_bytes, w.ns.quotas.get(top).used_inodes) == (100 + len(b"train/shard-0"), 2)
    # purged: off the quota, and the chunks are garbage now
    w.ns.unlink(top, b"README")
    assert w.ns.quotas.get(top).used_bytes == 100 + len(b"train/shard-0")
    readme = [r for r in w.ns.trash.rows() if r.name == b"README"][0]
    garbage = w.store.count_garbage()
    w.ns.trash.purge(readme.ino)
    assert (w.ns.quotas.get(top).used_bytes, w.ns.quotas.get(top).used_inodes) == (len(b"train/shard-0"), 1)
    assert w.store.count_garbage() == garbage + 2  # chunk 0's two copies
    assert code_of(w.ns.getattr, readme.ino) == ErrorCode.NOT_FOUND


def test_expiry_frees_what_is_due_and_an_open_file_stays_until_let_go(w):
    w.raw.trash.keep_ns = 10 * 10**9
    old = _file(w, ROOT, b"old", 10)
    held = _file(w, ROOT, b"held", 10)
    w.ns.unlink(ROOT, b"old")
    w.ns.unlink(ROOT, b"held")
    now = w.ns.trash.rows()[-1].deleted_ns
    assert not w.ns.trash.due(now) and w.ns.trash.expire(now) == 0
    assert w.ns.trash.due(now + 11 * 10**9)
    w.raw.is_open = lambda ino: ino == held
    assert w.ns.trash.expire(now + 11 * 10**9) == 2
    assert w.ns.trash.rows() == []
    assert code_of(w.ns.getattr, old) == ErrorCode.NOT_FOUND
    assert w.ns.getattr(held).nlink == 0  # an ordinary orphan now: its reader still reads it
    assert w.store.orphans() == [held]
    w.raw.is_open = lambda ino: False
    assert w.ns.reclaim_if_orphan(held)
    assert w.store.count_garbage() == 4


def test_the_orphans_a_release_looks_at_leave_out_what_the_trash_holds(w):
    """A session letting go of files it unlinked (an rm -rf with the trash on) costs no reclaim
    attempt per trashed file (daemon/housekeeping.py ``release``): only true orphans are named."""
    w.raw.trash.keep_ns = DAY_NS
    trashed, orphan, named = _file(w, ROOT, b"t", 10), _file(w, ROOT, b"o", 10), _file(w, ROOT, b"n", 10)
    w.ns.unlink(ROOT, b"t")
    w.raw.trash.keep_ns = 0
    w.raw.is_open = lambda ino: ino == orphan
    w.ns.unlink(ROOT, b"o")  # open: kept as an orphan, not trashed
    assert w.ns.getattr(trashed).nlink == 0 and w.ns.getattr(orphan).nlink == 0
    assert w.store.nameless_in([trashed, orphan, named]) == [orphan]


def test_with_the_trash_off_nothing_is_kept(w):
    f = _file(w, ROOT, b"f", 10)
    w.ns.unlink(ROOT, b"f")
    assert code_of(w.ns.getattr, f) == ErrorCode.NOT_FOUND and w.ns.trash.rows() == []


async def test_a_subtree_key_sees_restores_and_purges_only_its_own_trash(tmp_path):
    async with secure_cluster(tmp_path, trash_keep_s=3600.0) as c:
        async with c.client("admin") as admin:
            async def mkdir(parent, name):
                return (await admin.call(P.MkdirReq(parent=parent, name=name, mode=0o40755, uid=0, gid=0)))[0].attr.ino

            team_a, team_b = await mkdir(ROOT, b"team-a"), await mkdir(ROOT, b"team-b")
            proj = await mkdir(team_a, b"proj")
            secret = (await admin.call(P.CreateReq(parent=team_b, name=b"secret", mode=0o100644, uid=0, gid=0, session_id=0)))[0].attr.ino
            await admin.call(P.UnlinkReq(parent=team_b, name=b"secret"))
            gone_b = await mkdir(team_b, b"gone")
            await admin.call(P.RmdirReq(parent=team_b, name=b"gone"))
        async with c.client("team") as team:
            mine = (await team.call(P.CreateReq(parent=proj, name=b"ckpt", mode=0o100644, uid=0, gid=0, session_id=0)))[0].attr.ino
            await team.call(P.UnlinkReq(parent=proj, name=b"ckpt"))
            await team.call(P.RmdirReq(parent=team_a, name=b"proj"))
            listed = (await team.call(P.TrashListReq()))[0].entries
            assert {(e.ino, e.path) for e in listed} == {(mine, b"/proj/ckpt"), (proj, b"/proj")}
            for other in (secret, gone_b):
                assert await _code(team.call(P.TrashRestoreReq(item=other))) == ErrorCode.NOT_FOUND
                assert await _code(team.call(P.TrashPurgeReq(items=[other]))) == ErrorCode.NOT_FOUND
            # nor may it restore its own into another team's directory
            assert await _code(team.call(P.TrashRestoreReq(item=mine, new_parent=team_b, new_name=b"x"))) == ErrorCode.ACCESS
            done = (await team.call(P.TrashRestoreReq(item=proj)))[0]
            assert done.done == [proj, mine] and done.left == []
            assert (await team.call(P.LookupReq(parent=proj, name=b"ckpt")))[0].attr.ino == mine
            await team.call(P.UnlinkReq(parent=proj, name=b"ckpt"))
            assert (await team.call(P.TrashPurgeReq(everything=True)))[0].done == [mine]
        async with c.client("ro") as ro:
            assert await _code(ro.call(P.TrashPurgeReq(everything=True))) == ErrorCode.READ_ONLY
            assert {e.ino for e in (await ro.call(P.TrashListReq()))[0].entries} == {secret, gone_b}
        async with c.client("admin") as admin:
            rsp = (await admin.call(P.TrashListReq()))[0]
            assert {(e.ino, e.path) for e in rsp.entries} == {(secret, b"/team-b/secret"), (gone_b, b"/team-b/gone")}


async def test_a_restore_resent_after_a_lost_reply_answers_what_it_did_the_first_time(tmp_path):
    """stripefs trash restore sends its request in a OnceReq (stripefs/cluster.py rpc_once): the
    same OnceReq again (a timeout, a failover) is answered from the first attempt, not NOT_FOUND."""
    async with secure_cluster(tmp_path, trash_keep_s=3600.0) as c:
        async with c.client("admin") as admin:
            d = (await admin.call(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0)))[0].attr.ino
            await admin.call(P.RmdirReq(parent=ROOT, name=b"d"))
            once = P.OnceReq(client_id=77, op_id=1, done_below=0, body=P.TrashRestoreReq(item=d))
            first = (await admin.call(once))[0]
            again = (await admin.call(once))[0]
            assert first.done == again.done == [d] and again.left == []
            assert await _code(admin.call(P.TrashRestoreReq(item=d))) == ErrorCode.NOT_FOUND  # a new request: gone
