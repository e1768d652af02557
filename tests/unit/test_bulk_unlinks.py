"""A BatchReq's run of unlinks in one directory run in one savepoint (daemon/burst.py ``_unlinks``,
daemon/namespace_bulk.py ``unlink_many``): each item answered with its own outcome and its own
change (number, event), the directory's attributes after the run in the last reply, a retried
batch applied once, an error past an item's checks undoing the run so the items run one by one;
the trash keeps each file unlinked in a run as it keeps one unlinked alone."""

from __future__ import annotations

import sqlite3

import pytest
import trio

from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode
from stripefs.daemon import change_log
from test_meta_burst import _create, _register
from test_security import ROOT
from util import free_address

from stripefs.common.config import MetaConfig
from stripefs.daemon.service import MetaService


async def _service(nursery, ctx, tmp_path, trash_keep_s: float) -> MetaService:  # noqa: F811
    config = MetaConfig(listen=free_address(), data_dir=str(tmp_path), chunk_size=1 << 20, stripe_count=1,
                        redundancy="replicas=1", trash_keep_s=trash_keep_s)
    service = MetaService(config, zmq_context=ctx)
    await nursery.start(service.run)
    await service.handle(_register(), [])
    return service


async def _tree(service, names) -> tuple[int, dict[bytes, int]]:
    """A directory ``d`` holding files ``names`` and a directory ``sub``: (d, name -> inode)."""
    d = (await service.handle(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0), [])).attr.ino
    inos = {name: (await service.handle(_create(name, parent=d), [])).attr.ino for name in names}
    await service.handle(P.MkdirReq(parent=d, name=b"sub", mode=0o40755, uid=0, gid=0), [])
    return d, inos


def _changes(tmp_path) -> int:
    with sqlite3.connect(tmp_path / "meta.sqlite3") as disk:  # committed rows only
        return disk.execute("SELECT count(*) FROM change_log").fetchone()[0]


def _unlink(d: int, name: bytes, op_id: int = 0) -> P.Msg:
    body = P.UnlinkReq(parent=d, name=name)
    return P.OnceReq(client_id=9, op_id=op_id, done_below=1, body=body) if op_id else body


@pytest.mark.parametrize("trash_keep_s", [0.0, 86400.0])
async def test_a_run_of_unlinks_with_successes_and_failures_answers_each_its_own(tmp_path, ctx, trash_keep_s):  # noqa: F811
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path, trash_keep_s)
        d, inos = await _tree(service, [b"a", b"b", b"c"])
        changes = _changes(tmp_path)
        unlinked = []
        real = service.ns.unlink_row

        def counted(parent, name, row, now):
            unlinked.append(name)
            return real(parent, name, row, now)

        real_many = service.ns.trash.take_many

        def counted_many(taken):  # with the trash on, the run's unlinks are written at once
            unlinked.extend(name for _, name, _, _ in taken)
            return real_many(taken)

        service.ns.unlink_row, service.ns.trash.take_many = counted, counted_many
        items = [_unlink(d, b"a"), _unlink(d, b"nope"), _unlink(d, b"sub"), _unlink(d, b"a"), _unlink(d, b"b"), _unlink(d, b"c")]
        r = (await service.burst.run([(P.BatchReq(items=items), None)]))[0].results
        assert [type(x).__name__ for x in r] == ["ChangedRsp", "ErrorRsp", "ErrorRsp", "ErrorRsp", "ChangedRsp", "ChangedRsp"]
        assert [r[i].code for i in (1, 2, 3)] == [ErrorCode.NOT_FOUND, ErrorCode.IS_DIR, ErrorCode.NOT_FOUND]
        assert unlinked == [b"a", b"b", b"c"]  # one run, each unlinked once
        # each its own change, numbered in order; the directory after the run in the last reply alone
        seqs = [r[i].seq for i in (0, 4, 5)]
        assert seqs == sorted(set(seqs)) and seqs[0] > 0 and _changes(tmp_path) == changes + 3
        assert r[0].dir_attrs == [] and r[4].dir_attrs == []
        assert [a.ino for a in r[5].dir_attrs] == [d] and r[5].dir_attrs[0] == service.ns.getattr(d)
        listing = (await service.handle(P.ReaddirReq(ino=d), [])).entries
        assert [e.name for e in listing] == [b"sub"]
        with sqlite3.connect(tmp_path / "meta.sqlite3") as disk:  # durable before the replies
            trashed = disk.execute("SELECT count(*) FROM trash").fetchone()[0]
            kept = disk.execute("SELECT count(*) FROM inodes WHERE ino IN (?,?,?)", list(inos.values())).fetchone()[0]
        assert (trashed, kept) == ((3, 3) if trash_keep_s else (0, 0))
        nursery.cancel_scope.cancel()


async def test_a_retried_batch_of_unlinks_is_applied_once_and_answered_as_the_first_time(tmp_path, ctx):  # noqa: F811
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path, 86400.0)
        sid = (await service.handle(P.HelloReq(host="m", pid=1, client_id=9), [])).session_id
        assert sid
        d, _ = await _tree(service, [b"a", b"b", b"c"])
        batch = P.BatchReq(items=[_unlink(d, b"a", 1), _unlink(d, b"nope", 2), _unlink(d, b"b", 3)])
        before = _changes(tmp_path)
        a, nope, b = (await service.burst.run([(batch, None)]))[0].results
        assert isinstance(a, P.ChangedRsp) and isinstance(b, P.ChangedRsp) and nope.code == ErrorCode.NOT_FOUND
        assert 0 < a.seq < b.seq and _changes(tmp_path) == before + 2
        # the reply was lost: the same batch again, with a new op after it
        await service.handle(_create(b"a", parent=d), [])  # a new "a": a second unlink of op 1 would take it
        retry = P.BatchReq(items=[*batch.items, _unlink(d, b"c", 4)])
        a2, nope2, b2, c = (await service.burst.run([(retry, None)]))[0].results
        assert isinstance(a2, P.ChangedRsp) and isinstance(b2, P.ChangedRsp)  # answered from their records
        assert nope2.code == ErrorCode.NOT_FOUND and isinstance(c, P.ChangedRsp) and c.seq > b.seq
        assert _changes(tmp_path) == before + 2 + 2  # the new "a", and c's unlink: nothing of ops 1 and 3 again
        listing = (await service.handle(P.ReaddirReq(ino=d), [])).entries
        assert sorted(e.name for e in listing) == [b"a", b"sub"]
        nursery.cancel_scope.cancel()


async def test_an_error_past_the_checks_undoes_the_run_and_each_unlink_runs_alone(tmp_path, ctx):  # noqa: F811
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path, 86400.0)
        d, inos = await _tree(service, [b"a", b"b", b"c"])
        calls = []
        real, real_many = service.store.put_trash, service.store.trash_many

        def one(ino, *args):
            calls.append(ino)
            return real(ino, *args)

        def failing_many(taken):  # the run's trash rows, written at once after its checks
            calls.append([t[0] for t in taken])
            real_many(taken)  # its rows written, then undone with the run
            raise sqlite3.IntegrityError("a constraint, once")

        service.store.put_trash, service.store.trash_many = one, failing_many
        items = [_unlink(d, b"a"), _unlink(d, b"b"), _unlink(d, b"c")]
        a, b, c = (await service.burst.run([(P.BatchReq(items=items), None)]))[0].results
        assert all(isinstance(x, P.ChangedRsp) for x in (a, b, c))
        assert calls == [[inos[b"a"], inos[b"b"], inos[b"c"]], inos[b"a"], inos[b"b"], inos[b"c"]]  # the run, then one by one
        assert a.dir_attrs and b.dir_attrs and c.dir_attrs and a.seq < b.seq < c.seq  # each on its own
        with sqlite3.connect(tmp_path / "meta.sqlite3") as disk:  # the undone run left nothing twice
            assert disk.execute("SELECT count(*) FROM trash").fetchone()[0] == 3
        listing = (await service.handle(P.ReaddirReq(ino=d), [])).entries
        assert [e.name for e in listing] == [b"sub"]
        nursery.cancel_scope.cancel()


async def test_a_run_reads_its_names_at_once_and_a_file_with_hard_links_again(tmp_path, ctx):  # noqa: F811
    """The run's entries come from one read (``entry_inodes_in``); a file with hard links is read
    again before its unlink (an earlier unlink of the run changed its nlink), so the last of its
    names unlinked in the run sends it to the trash, as unlinks one by one do."""
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path, 86400.0)
        d, inos = await _tree(service, [b"a", b"l1", b"b"])
        await service.handle(P.LinkReq(ino=inos[b"l1"], new_parent=d, new_name=b"l2"), [])
        reads = []
        real = service.store.entry_inode

        def counted(parent, name):
            reads.append(name)
            return real(parent, name)

        service.store.entry_inode = counted
        items = [_unlink(d, b"a"), _unlink(d, b"l1"), _unlink(d, b"l2"), _unlink(d, b"b")]
        r = (await service.burst.run([(P.BatchReq(items=items), None)]))[0].results
        assert all(isinstance(x, P.ChangedRsp) for x in r)
        assert reads == [b"l1", b"l2"]  # a and b from the run's one read
        with sqlite3.connect(tmp_path / "meta.sqlite3") as disk:
            trashed = {row[0] for row in disk.execute("SELECT ino FROM trash")}
            nlinks = dict(disk.execute("SELECT ino, nlink FROM inodes WHERE ino IN (?,?,?)", list(inos.values())))
        assert trashed == set(inos.values()) and set(nlinks.values()) == {0}
        listing = (await service.handle(P.ReaddirReq(ino=d), [])).entries
        assert [e.name for e in listing] == [b"sub"]
        nursery.cancel_scope.cancel()


async def test_a_runs_change_rows_are_written_at_once_each_its_own_number_and_event(tmp_path, ctx):  # noqa: F811
    """The run's change log rows go in together after the last unlink (``Txn.log_many_in_run``:
    the counter moved once, one executemany), yet each unlink keeps its own number, in the order
    of the unlinks, with no hole, and its own event (what the feed and the callbacks read)."""
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path, 86400.0)
        names = [b"f%d" % i for i in range(6)]
        d, inos = await _tree(service, names)
        one, many = [], []
        real_one, real_many = service.store.log_change, getattr(service.store, "log_changes", None)

        def counted_one(created_ns, event):
            one.append(event)
            return real_one(created_ns, event)

        def counted_many(created_ns, events):
            many.append(len(events))
            return real_many(created_ns, events)

        service.store.log_change, service.store.log_changes = counted_one, counted_many
        items = [_unlink(d, b"f0"), _unlink(d, b"f1"), _unlink(d, b"nope"), *(_unlink(d, n) for n in names[2:])]
        r = (await service.burst.run([(P.BatchReq(items=items), None)]))[0].results
        assert r[2].code == ErrorCode.NOT_FOUND
        seqs = [x.seq for i, x in enumerate(r) if i != 2]
        assert seqs == list(range(seqs[0], seqs[0] + 6))
        assert (one, many) == ([], [6])  # one by one: a log_change per unlink
        with sqlite3.connect(tmp_path / "meta.sqlite3") as disk:
            rows = disk.execute("SELECT seq, event FROM change_log WHERE seq >= ? ORDER BY seq", (seqs[0],)).fetchall()
        assert [seq for seq, _ in rows] == seqs
        for (_, event), name in zip(rows, names):
            inodes, entries = change_log.decode(bytes(event))
            assert entries == [(d, name)] and inodes == sorted({d, inos[name]})
        nursery.cancel_scope.cancel()
