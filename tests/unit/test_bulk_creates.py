"""A BatchReq's run of creates in one directory made as one operation (daemon/burst.py ``_many``,
daemon/namespace_bulk.py): each item answered with its own outcome, one change logged for the
run (one number in every reply it made), a retried batch applied once, an error that is no item's
own undoing the run so that the items are made one by one."""

from __future__ import annotations

import sqlite3

import trio

from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode
from test_meta_burst import _Commits, _create, _service
from test_security import ROOT


async def _setup(service, client_id: int) -> tuple[int, int, int]:
    """A session of a mount with ``client_id``, the first of 100 inode numbers delegated to it, and
    a directory holding the name ``taken``: (session, first number, directory)."""
    sid = (await service.handle(P.HelloReq(host="m", pid=1, client_id=client_id), [])).session_id
    first = (await service.handle(P.DelegateInodesReq(session_id=sid, count=100), [])).first
    d = (await service.handle(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0), [])).attr.ino
    await service.handle(_create(b"taken", parent=d), [])
    return sid, first, d


def _changes(tmp_path) -> int:
    with sqlite3.connect(tmp_path / "meta.sqlite3") as disk:  # committed rows only
        return disk.execute("SELECT count(*) FROM change_log").fetchone()[0]


async def test_a_run_of_creates_with_successes_and_failures_is_one_change_each_item_answered_its_own(tmp_path, ctx):  # noqa: F811
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        sid, first, d = await _setup(service, 7)
        commits, changes = _Commits(service), _changes(tmp_path)

        def mine(name: bytes, ino: int) -> P.CreateReq:
            return P.CreateReq(parent=d, name=name, mode=0o100600, uid=5, gid=6, session_id=sid, new_ino=ino)

        items = [
            _create(b"a", parent=d),  # 0: made, the daemon's next number
            mine(b"b", first),  # 1: made, a delegated number
            _create(b"taken", parent=d),  # 2: EXISTS (made before)
            _create(b"a", parent=d),  # 3: EXISTS (item 0 took it)
            _create(b"x/y", parent=d),  # 4: INVALID name
            _create(b"n" * 300, parent=d),  # 5: NAME_TOO_LONG
            mine(b"c", first),  # 6: EXISTS: the number item 1 took
            mine(b"e", first + 1000),  # 7: INVALID: a number never delegated
            _create(b"f", parent=d),  # 8: made
        ]
        rsp = (await service.burst.run([(P.BatchReq(items=items), None)]))[0]

        r = rsp.results
        made = [r[i] for i in (0, 1, 8)]
        assert all(isinstance(x, P.OpenRsp) for x in made), r
        assert [r[i].code for i in (2, 3, 4, 5, 6, 7)] == [ErrorCode.EXISTS, ErrorCode.EXISTS, ErrorCode.INVALID,
                                                         ErrorCode.NAME_TOO_LONG, ErrorCode.EXISTS, ErrorCode.INVALID]
        assert r[1].attr.ino == first and (r[1].attr.uid, r[1].attr.gid, r[1].attr.mode) == (5, 6, 0o100600)
        assert len({x.attr.ino for x in made}) == 3 and all(x.chunks and x.nodes and x.epoch for x in made)
        # one operation: one change logged for the run, its number and the directory after it in each reply
        assert _changes(tmp_path) == changes + 1 and commits.n == 1
        assert len({x.seq for x in made}) == 1 and made[0].seq > 0
        assert all(x.dir_attrs and x.dir_attrs[0].ino == d for x in made)
        listing = (await service.handle(P.ReaddirReq(ino=d), [])).entries
        assert sorted(e.name for e in listing) == [b"a", b"b", b"f", b"taken"]
        with sqlite3.connect(tmp_path / "meta.sqlite3") as disk:  # durable before the replies, chunk 0 placed
            assert disk.execute("SELECT count(*) FROM chunks WHERE ino IN (?,?,?)", [x.attr.ino for x in made]).fetchone()[0] == 3
        assert service.ns.getattr(d).mtime_ns == made[0].dir_attrs[0].mtime_ns
        nursery.cancel_scope.cancel()


async def test_a_run_of_creates_that_all_fail_is_answered_with_nothing_to_commit(tmp_path, ctx):  # noqa: F811
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        _, _, d = await _setup(service, 7)
        changes = _changes(tmp_path)
        items = [_create(b"taken", parent=d), _create(b"x/y", parent=d), _create(b"taken", parent=d)]
        rsp = (await service.burst.run([(P.BatchReq(items=items), None)]))[0]
        assert [x.code for x in rsp.results] == [ErrorCode.EXISTS, ErrorCode.INVALID, ErrorCode.EXISTS]
        assert _changes(tmp_path) == changes
        nursery.cancel_scope.cancel()


async def test_a_retried_batch_of_creates_is_applied_once_and_answered_as_the_first_time(tmp_path, ctx):  # noqa: F811
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        sid, first, d = await _setup(service, 9)

        def once(op_id: int, name: bytes, ino: int) -> P.OnceReq:
            body = P.CreateReq(parent=d, name=name, mode=0o100644, uid=0, gid=0, session_id=sid, new_ino=ino, callback=True)
            return P.OnceReq(client_id=9, op_id=op_id, done_below=1, body=body)

        batch = P.BatchReq(items=[once(1, b"a", first), once(2, b"taken", first + 1), once(3, b"b", first + 2)])
        before = _changes(tmp_path)
        a, taken, b = (await service.burst.run([(batch, None)]))[0].results
        assert isinstance(a, P.OpenRsp) and isinstance(b, P.OpenRsp) and taken.code == ErrorCode.EXISTS
        assert a.seq == b.seq > 0 and _changes(tmp_path) == before + 1  # one operation for the run

        # the reply was lost: the mount sends the very same batch again, with a new op after it
        retry = P.BatchReq(items=[*batch.items, once(4, b"c", first + 3)])
        a2, taken2, b2, c = (await service.burst.run([(retry, None)]))[0].results
        assert (a2.attr, a2.chunks, a2.epoch) == (a.attr, a.chunks, a.epoch)  # answered from its record
        assert (b2.attr, b2.chunks, b2.epoch) == (b.attr, b.chunks, b.epoch)
        assert taken2.code == ErrorCode.EXISTS  # a refusal records nothing: run again, refused again
        assert isinstance(c, P.OpenRsp) and c.attr.ino == first + 3
        assert _changes(tmp_path) == before + 2  # only c's change is new
        listing = (await service.handle(P.ReaddirReq(ino=d), [])).entries
        assert sorted(e.name for e in listing) == [b"a", b"b", b"c", b"taken"]  # not a second a or b
        nursery.cancel_scope.cancel()


async def test_an_error_that_is_no_items_own_undoes_the_run_and_each_item_gets_its_outcome_alone(tmp_path, ctx):  # noqa: F811
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        d = (await service.handle(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0), [])).attr.ino
        calls = []
        real = service.store.insert_inodes

        def counted(rows):
            calls.append(len(rows))
            return real(rows)

        service.store.insert_inodes = counted
        items = [_create(b"a", parent=d), P.CreateReq(parent=d, name=b"big", mode=0o100644, uid=1 << 64, gid=0, session_id=0),
                 _create(b"b", parent=d)]
        a, big, b = (await service.burst.run([(P.BatchReq(items=items), None)]))[0].results
        assert calls == [3]  # tried as one run: the uid out of range failed its statement, for all three
        assert isinstance(a, P.OpenRsp) and isinstance(b, P.OpenRsp) and big.code == ErrorCode.BAD_REQUEST
        assert a.seq < b.seq  # then made one by one, each its own change
        listing = (await service.handle(P.ReaddirReq(ino=d), [])).entries
        assert sorted(e.name for e in listing) == [b"a", b"b"]
        with sqlite3.connect(tmp_path / "meta.sqlite3") as disk:  # nothing of the undone run is left
            assert disk.execute("SELECT count(*) FROM inodes WHERE uid > 1000").fetchone()[0] == 0
            assert disk.execute("SELECT count(*) FROM chunks").fetchone()[0] == 2
        nursery.cancel_scope.cancel()


async def test_creates_sent_alone_share_one_operation_and_each_waits_for_the_mount_holding_the_directory(tmp_path, ctx):  # noqa: F811
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        other = (await service.handle(P.HelloReq(host="b", pid=2, client_id=222), [])).session_id
        made = await service.handle(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0, session_id=other,
                                               callback=True), [])
        assert made.callback >= 0  # the other mount holds every name of d: a change in it waits for that mount
        d, changes = made.attr.ino, _changes(tmp_path)

        first, second = await service.burst.run([(_create(b"a", parent=d), None), (_create(b"b", parent=d), None)])
        assert _changes(tmp_path) == changes + 1  # one operation for both requests: one change
        assert callable(first) and callable(second)  # neither answered before the other mount let go
        answers = []

        async def answer(later):
            answers.append(await later())

        async with trio.open_nursery() as waiting:
            waiting.start_soon(answer, first)
            waiting.start_soon(answer, second)
            await trio.sleep(0.2)
            assert not answers
            await service.handle(P.AckReq(session_id=other, seq=0, everything=True), [])
        assert sorted(a.attr.ino for a in answers) == sorted({a.attr.ino for a in answers}) and len(answers) == 2
        assert answers[0].seq == answers[1].seq > 0 and service.callbacks.timeouts == 0
        nursery.cancel_scope.cancel()
