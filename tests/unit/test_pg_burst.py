"""The burst path on PostgreSQL (daemon/burst.py ``_transaction``): a burst is one transaction.

A burst of requests received together (or a BatchReq's items) runs as one
SERIALIZABLE transaction, a savepoint per operation, answered in request order
only after its COMMIT; one failing operation (a name too long, a number beyond
BIGINT) leaves the others; reads take the usual path. Two daemons whose
bursts create the same names in one directory at once conflict, the loser's
whole burst is run again, and each name is created by exactly one of them.
(A kill -9 in the middle of bursts: test_meta_burst.py, on both stores.)
"""

from __future__ import annotations

import logging

import psycopg
import trio

from stripefs.common import protocol as P
from stripefs.common.config import MetaConfig
from stripefs.common.errors import ErrorCode
from stripefs.daemon.service import MetaService
from test_meta_burst import _create, _register, batches_past_the_bound
from test_security import ROOT
from util import free_address


class _Transactions:
    """The write transactions run on ``service``'s store, by function (each one COMMIT, retries inside it)."""

    def __init__(self, service: MetaService):
        self.writes: list[str] = []
        real = service.store.run

        def counting(fn, *args, readonly=False, **kwargs):
            if not readonly:  # a request's own transaction (the task path) runs its operation in ``_operation``
                inner = args[0] if getattr(fn, "__name__", "") == "_operation" and args else None
                self.writes.append(getattr(inner or fn, "__qualname__", repr(fn)))
            return real(fn, *args, readonly=readonly, **kwargs)

        service.store.run = counting


async def _service(nursery, ctx, tmp_path, dsn: str) -> MetaService:
    config = MetaConfig(listen=free_address(), data_dir=str(tmp_path), chunk_size=1 << 20, stripe_count=1,
                        redundancy="replicas=1", store="postgresql", dsn=dsn, pool_size=4)
    service = MetaService(config, zmq_context=ctx)
    await nursery.start(service.run)
    await service.handle(_register(), [])
    return service


def _names(dsn: str, parent: int) -> set[bytes]:
    """The names in ``parent`` as committed (another connection)."""
    with psycopg.connect(dsn) as conn:
        return {bytes(row[0]) for row in conn.execute("SELECT name FROM dentries WHERE parent=%s", (parent,))}


async def test_a_burst_on_postgresql_is_one_transaction_answered_in_order_after_its_commit(tmp_path, ctx, pg_dsn):
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path, pg_dsn)
        sid = (await service.handle(P.HelloReq(host="a", pid=1, client_id=111), [])).session_id
        await service.handle(P.MkdirReq(parent=ROOT, name=b"held", mode=0o40755, uid=0, gid=0), [])
        transactions = _Transactions(service)

        once = P.OnceReq(client_id=111, op_id=1, done_below=0, body=_create(b"b", session_id=sid))
        items = [
            _create(b"a", session_id=sid),  # 0: succeeds
            P.MkdirReq(parent=ROOT, name=b"held", mode=0o40755, uid=0, gid=0),  # 1: EXISTS
            once,  # 2: succeeds, once
            P.GetattrReq(ino=ROOT),  # 3: a read: the usual path (a snapshot of its own)
            P.MknodReq(parent=ROOT, name=b"big", mode=0o20644, rdev=1 << 63, uid=0, gid=0),  # 4: beyond BIGINT
            P.ReaddirReq(ino=ROOT),  # 5: not this path's
            P.SetattrReq(ino=ROOT, mode=0o40700),  # 6: succeeds
            once,  # 7: the retry of 2, in the same burst: applied once, the same answer
            _create(b"x" * 300),  # 8: name too long
            _create(b"c"),  # 9: succeeds after all those failures
        ]
        results = await service.burst.run([(body, None) for body in items])

        # one transaction, one COMMIT for the whole burst; none of a create of its own (background
        # work, the change log's sequencer, may run beside)
        assert transactions.writes.count("Burst._transaction") == 1, transactions.writes
        assert not [w for w in transactions.writes if "_op_create" in w], transactions.writes
        assert {b"a", b"b", b"c"} <= _names(pg_dsn, ROOT)  # committed before any reply exists
        assert b"big" not in _names(pg_dsn, ROOT)  # its savepoint rolled back, the others kept
        a, exists, b, read, big, usual, setattr, retry, long, c = results
        assert all(isinstance(r, P.OpenRsp) for r in (a, b, c)) and isinstance(setattr, P.AttrRsp)
        assert setattr.attr.mode & 0o777 == 0o700
        assert exists.code == ErrorCode.EXISTS and big.code == ErrorCode.BAD_REQUEST
        assert isinstance(long, P.ErrorRsp) and long.code not in (ErrorCode.INTERNAL, ErrorCode.IO)
        assert read is None and usual is None
        assert isinstance(retry, P.OpenRsp) and retry.attr.ino == b.attr.ino  # not a second file
        assert len({a.attr.ino, b.attr.ino, c.attr.ino}) == 3
        nursery.cancel_scope.cancel()


async def test_a_batch_of_creates_in_one_directory_is_one_operation_on_postgresql_too(tmp_path, ctx, pg_dsn):
    """A BatchReq's run of creates goes through ``create_many`` (daemon/namespace_bulk.py: a
    statement per table) within the burst's one transaction; each item keeps its own outcome and
    a retried batch is applied once."""
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path, pg_dsn)
        d = (await service.handle(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0), [])).attr.ino
        await service.handle(_create(b"taken", parent=d), [])
        runs = []
        real = service.burst.create_many
        service.burst.create_many = lambda reqs: runs.append(len(reqs)) or real(reqs)
        transactions = _Transactions(service)
        names = [b"f%d" % i for i in range(20)] + [b"taken"]
        batch = P.BatchReq(items=[P.OnceReq(client_id=9, op_id=i + 1, done_below=0, body=_create(name, parent=d))
                                  for i, name in enumerate(names)])
        first = (await service.burst.run([(batch, None)]))[0].results
        again = (await service.burst.run([(batch, None)]))[0].results  # the client's retry of the batch

        assert runs == [len(names), 1]  # one run; the retry answered from its records but the refused item's
        assert transactions.writes.count("Burst._transaction") == 2
        assert all(isinstance(r, P.OpenRsp) and r.chunks and r.nodes for r in first[:-1]), first
        assert first[-1].code == ErrorCode.EXISTS
        assert [r.attr.ino for r in again[:-1]] == [r.attr.ino for r in first[:-1]]
        assert len({r.attr.ino for r in first[:-1]}) == 20
        assert _names(pg_dsn, d) == set(names)
        nursery.cancel_scope.cancel()


async def test_two_daemons_bursts_creating_the_same_names_at_once_never_both_succeed(tmp_path, ctx, pg_dsn, caplog):
    async with trio.open_nursery() as nursery:
        first = await _service(nursery, ctx, tmp_path / "a", pg_dsn)
        second = await _service(nursery, ctx, tmp_path / "b", pg_dsn)
        d = (await first.handle(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0), [])).attr.ino
        rounds, width = 12, 8
        for r in range(rounds):
            names = [b"r%d-%d" % (r, i) for i in range(width)]
            got: dict[int, list] = {}

            async def burst(service, key):
                got[key] = await service.burst.run([(_create(name, parent=d), None) for name in names])

            async with trio.open_nursery() as both:
                both.start_soon(burst, first, 0)
                both.start_soon(burst, second, 1)
            for i in range(width):
                pair = (got[0][i], got[1][i])
                won = [x for x in pair if isinstance(x, P.OpenRsp)]
                lost = [x for x in pair if isinstance(x, P.ErrorRsp) and x.code == ErrorCode.EXISTS]
                assert len(won) == 1 and len(lost) == 1, (names[i], pair)
        assert len(_names(pg_dsn, d)) == rounds * width
        assert first.store.retries + second.store.retries > 0  # they did conflict
        assert not [r for r in caplog.records if "pipeline" in r.getMessage()]  # psycopg's "pipeline aborted"
        nursery.cancel_scope.cancel()


async def test_a_conflict_inside_a_bursts_operation_reruns_the_whole_burst_and_applies_a_retry_once(
        tmp_path, ctx, pg_dsn, caplog):
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path, pg_dsn)
        d = (await service.handle(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0), [])).attr.ino
        once = P.OnceReq(client_id=7, op_id=1, done_below=0, body=_create(b"once"))  # applied before the conflict
        other = psycopg.connect(pg_dsn)  # another daemon's transaction, holding the directory's row
        other.execute("BEGIN ISOLATION LEVEL SERIALIZABLE")
        other.execute("UPDATE inodes SET mtime_ns = mtime_ns + 1 WHERE ino = %s", (d,))
        got = []

        async def burst():
            got.extend(await service.burst.run([(body, None) for body in (once, _create(b"a", parent=d), _create(b"b", parent=d))]))

        retries = service.store.retries
        async with trio.open_nursery() as running:
            running.start_soon(burst)
            await trio.sleep(0.5)  # the burst's first create waits for that row
            assert not got
            other.commit()  # the burst's update of the row now fails (40001) inside its operation
        other.close()
        assert service.store.retries > retries  # run again, whole
        first, a, b = got
        assert all(isinstance(r, P.OpenRsp) for r in got), got
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # a conflict is no operation's failure
        assert {b"a", b"b"} == _names(pg_dsn, d) and b"once" in _names(pg_dsn, ROOT)
        again = await service.handle(once, [])  # the client's retry: the record committed with the rerun
        assert isinstance(again, P.OpenRsp) and again.attr.ino == first.attr.ino
        nursery.cancel_scope.cancel()


async def test_bursts_with_a_failing_operation_again_and_again_keep_their_connections_usable(tmp_path, ctx, pg_dsn, caplog):
    """A database error of one operation (a number beyond BIGINT) is that operation's answer, in
    burst after burst on the same pooled connections: its savepoint rolled back, the others of
    the burst committed, nothing left behind on the connection (an aborted transaction, a
    statement psycopg thinks prepared) that a later burst trips over."""
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path, pg_dsn)
        for k in range(12):
            items = [_create(b"a%d" % k), P.MknodReq(parent=ROOT, name=b"big%d" % k, mode=0o20644, rdev=1 << 63, uid=0, gid=0),
                     _create(b"b%d" % k), P.MkdirReq(parent=ROOT, name=b"d%d" % k, mode=0o40755, uid=0, gid=0)]
            a, big, b, d = await service.burst.run([(body, None) for body in items])
            assert isinstance(a, P.OpenRsp) and isinstance(b, P.OpenRsp) and isinstance(d, P.AttrRsp), (k, a, b, d)
            assert big.code == ErrorCode.BAD_REQUEST
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR or "pipeline" in r.getMessage()]
        names = _names(pg_dsn, ROOT)
        assert all({b"a%d" % k, b"b%d" % k, b"d%d" % k} <= names and b"big%d" % k not in names for k in range(12))
        nursery.cancel_scope.cancel()


async def test_the_serving_loops_burst_on_postgresql_takes_fewer_operations_and_leaves_a_big_batch_to_a_task(
        tmp_path, ctx, pg_dsn):
    """The loop awaits a PostgreSQL burst's transaction: it takes at most ``SHARED_MOST``
    operations, a BatchReq past that runs in a task (a transaction of its own) meanwhile."""
    from stripefs.daemon import burst

    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path, pg_dsn)
        second, half = await batches_past_the_bound(service, burst.SHARED_MOST)
        transactions = _Transactions(service)
        rsp = await service.handle(second, [])  # what serve() then does with it, in a task
        assert all(isinstance(r, P.OpenRsp) for r in rsp.results) and len(rsp.results) == half
        assert transactions.writes.count("Burst._transaction") == 1  # one transaction for the batch
        nursery.cancel_scope.cancel()


async def test_a_write_sessions_bookkeeping_is_part_of_the_bursts_transaction_on_postgresql(tmp_path, ctx, pg_dsn):
    """Opens, epochs (the database's sequence), placements and their release run in the burst's one
    transaction; an open that marks the file written takes its handler (the callbacks are the trio
    thread's, the transaction a worker thread's)."""
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path, pg_dsn)
        sid = (await service.handle(P.HelloReq(host="a", pid=1, client_id=111), [])).session_id
        ino = (await service.handle(_create(b"f", session_id=sid), [])).attr.ino
        transactions = _Transactions(service)
        items = [
            P.OpenReq(ino=ino, session_id=sid, write=True, pair=True),
            P.AllocEpochReq(pair=True),
            P.AllocChunksReq(ino=ino, indices=[0, 1]),
            P.ReleaseChunksReq(ino=ino, indices=[1]),
            P.OpenReq(ino=ino, session_id=sid),
            P.OpenReq(ino=ino, session_id=sid, mark=True),
        ]
        opened, epoch, placed, released, read_open, marked = await service.burst.run([(body, None) for body in items])

        assert transactions.writes.count("Burst._transaction") == 1, transactions.writes
        assert isinstance(opened, P.OpenRsp) and isinstance(epoch, P.EpochRsp) and epoch.epoch > opened.epoch > 0
        assert isinstance(placed, P.ChunksRsp) and [c.index for c in placed.chunks] == [0, 1]
        assert isinstance(released, P.OkRsp) and isinstance(read_open, P.OpenRsp) and read_open.epoch == 0
        assert marked is None
        nursery.cancel_scope.cancel()
