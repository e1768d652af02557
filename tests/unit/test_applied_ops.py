"""Idempotent retries (daemon/applied_ops.py) against the real SQLite store and a real daemon.

The store part checks the table's rules (recorded with the operation, replayed
without running it, nothing recorded for a failure, trimmed by acknowledgement
and by age); the daemon part resends the very same OnceReq, as a client does
after a lost reply, including across a kill -9 of the daemon.
"""

import os
import time

import pytest
import trio

from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.common.transport import connect
from stripefs.daemon import applied_ops
from stripefs.daemon.db import open_database
from stripefs.daemon.pg_store import open_pg_store
from stripefs.daemon.store import SqliteStore

from test_meta_service import ROOT, _call, daemon  # noqa: F401  (daemon: its fixture)


LAYOUT = P.Layout(1 << 20, 1, "replicas=1")


@pytest.fixture(params=["sqlite", "postgresql"])
def store(tmp_path, request):
    if request.param == "sqlite":
        s = SqliteStore(open_database(tmp_path / "meta.sqlite3", LAYOUT))
        s.begin()
    else:
        s = open_pg_store(request.getfixturevalue("pg_dsn"), LAYOUT, pool_size=2)
    yield s
    s.close()


def _in_transaction(store, fn, *args):
    """As the service runs an operation: SQLite inside its open transaction, PostgreSQL one transaction each."""
    return fn(*args) if store.group_commit else store.run(fn, *args)


def _once(key, store, fn, *args):
    token = applied_ops.once.set(key)
    try:
        return _in_transaction(store, applied_ops.run_once, store, fn, *args)
    finally:
        applied_ops.once.reset(token)


def test_an_op_runs_once_and_its_result_is_replayed(store):
    calls = []

    def op(x):
        calls.append(x)
        return (P.Attr(ino=7, mode=0o100644, nlink=1, uid=0, gid=0, rdev=0, size=0, atime_ns=0, mtime_ns=0, ctime_ns=0), x)

    first, ran = _once(applied_ops.OnceKey(5, 1, 1), store, op, "a")
    again, ran_again = _once(applied_ops.OnceKey(5, 1, 1), store, op, "b")  # the retry: same key
    assert ran and not ran_again and calls == ["a"] and again == first
    other, ran_other = _once(applied_ops.OnceKey(6, 1, 1), store, op, "c")  # another client's op 1
    assert ran_other and other[1] == "c"
    assert _in_transaction(store, applied_ops.run_once, store, op, "d") == (op("d"), True)  # no OnceReq: a plain call


def test_a_failed_op_records_nothing(store):
    def fails():
        raise StripefsError(ErrorCode.EXISTS, "taken")

    with pytest.raises(StripefsError):
        _once(applied_ops.OnceKey(5, 2, 1), store, fails)
    assert store.get_applied(5, 2) is None
    assert _once(applied_ops.OnceKey(5, 2, 1), store, lambda: "now") == ("now", True)


def test_the_table_is_trimmed_by_acknowledgement_and_by_age(store):
    for op_id in range(1, applied_ops.TRIM_EVERY):
        _once(applied_ops.OnceKey(5, op_id, 1), store, lambda: None)
    assert store.count_applied() == applied_ops.TRIM_EVERY - 1
    # op TRIM_EVERY says every op below 30 was answered: those rows go with it
    _once(applied_ops.OnceKey(5, applied_ops.TRIM_EVERY, 30), store, lambda: None)
    assert store.count_applied() == applied_ops.TRIM_EVERY - 30 + 1
    assert store.get_applied(5, 29) is None and store.get_applied(5, 30) is not None
    assert _in_transaction(store, applied_ops.expire, store) == 0  # nothing is that old yet
    later = time.time_ns() + int((applied_ops.RETENTION_S + 1) * 1e9)
    assert _in_transaction(store, applied_ops.expire, store, later) == applied_ops.TRIM_EVERY - 29
    assert store.count_applied() == 0


def test_two_daemons_racing_one_retry_apply_it_once(pg_dsn):
    """PostgreSQL: the first attempt and its retry run at once on two daemons; both miss the row,
    both run the operation, one commits; the other's insert of the row conflicts, its transaction
    is retried and answers the recorded result. The change is made once."""
    import threading

    stores = [open_pg_store(pg_dsn, LAYOUT, pool_size=2) for _ in range(2)]
    both_ran = threading.Barrier(2, timeout=10)
    results, calls = [None, None], []

    def attempt(i):
        store = stores[i]

        def op():
            calls.append(i)
            if len(calls) <= 2:
                both_ran.wait()  # both attempts are inside their transactions, both found no row
            store.log_change(i, b"x")  # a change: applied twice, the log would hold two rows
            return i

        results[i] = _once(applied_ops.OnceKey(9, 1, 1), store, op)

    try:
        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(ran for _, ran in results) == [False, True]  # one applied it, one answered from the row
        assert results[0][0] == results[1][0]  # the replay answers the first attempt's result
        assert stores[0].run(stores[0].number_changes, 10) == 1 and len(stores[0].changes_after(0, 10)) == 1
    finally:
        for s in stores:
            s.close()


async def test_a_resent_request_is_not_applied_twice_even_across_kill9(daemon, ctx):
    await daemon.wait_ready(ctx)
    client_id = 0x5EED

    def once(op_id, body):
        return P.OnceReq(client_id=client_id, op_id=op_id, done_below=op_id, body=body)

    async with connect(ctx, daemon.address, timeout=10) as c:
        sid = (await _call(c, P.HelloReq(host="test", pid=os.getpid()))).session_id
        create = once(1, P.CreateReq(parent=ROOT, name=b"f", mode=0o644, uid=0, gid=0, session_id=sid))
        first = await _call(c, create)
        again = await _call(c, create)  # a retry after a lost reply: the same answer, not EEXIST
        assert again.attr == first.attr and again.epoch == first.epoch
        # the first answer says where the parent stands after it (client/dir_attrs.py); a replay cannot
        assert first.seq > 0 and [d.ino for d in first.dir_attrs] == [ROOT] and again.seq == 0
        rename = once(2, P.RenameReq(parent_old=ROOT, name_old=b"f", parent_new=ROOT, name_new=b"g"))
        assert isinstance(await _call(c, rename), P.ChangedRsp)
        # another file takes the old name: a second application would now rename it over g
        other = await _call(c, once(3, P.CreateReq(parent=ROOT, name=b"f", mode=0o644, uid=0, gid=0, session_id=sid)))
        assert isinstance(await _call(c, rename), P.ChangedRsp)
        assert (await _call(c, P.LookupReq(parent=ROOT, name=b"g"))).attr.ino == first.attr.ino
        assert (await _call(c, P.LookupReq(parent=ROOT, name=b"f"))).attr.ino == other.attr.ino
        with pytest.raises(StripefsError) as info:  # only mutating requests may be wrapped
            await c.call(once(4, P.GetattrReq(ino=ROOT)))
        assert info.value.code == ErrorCode.BAD_REQUEST
        unlink = once(5, P.UnlinkReq(parent=ROOT, name=b"g"))
        assert isinstance(await _call(c, unlink), P.ChangedRsp)

    daemon.kill9()  # the records are durable like the changes they answer for
    daemon.start()
    await daemon.wait_ready(ctx)
    async with connect(ctx, daemon.address, timeout=10) as c:
        assert isinstance(await _call(c, unlink), P.ChangedRsp)  # not ENOENT
        assert (await _call(c, create)).attr == first.attr  # not a new file named f
        assert (await _call(c, P.LookupReq(parent=ROOT, name=b"f"))).attr.ino == other.attr.ino
        with pytest.raises(StripefsError) as info:
            await c.call(P.CreateReq(parent=ROOT, name=b"f", mode=0o644, uid=0, gid=0, session_id=sid))
        assert info.value.code == ErrorCode.EXISTS  # unwrapped requests are applied as they come


async def test_a_client_whose_reply_was_lost_retries_on_the_next_daemon_without_applying_twice(daemon, ctx):
    """The first daemon address is a relay that passes requests on but loses the reply
    of the first create, as when a daemon dies between its commit and its reply."""
    from stripefs.client.meta_rpc import MetaClient
    from stripefs.common.transport import open_socket
    import contextlib
    import zmq

    await daemon.wait_ready(ctx)
    relay_address = daemon.address.rsplit(":", 1)[0] + ":0"
    lost = []

    async def relay(router, task_status):
        async with open_socket(ctx, zmq.DEALER, connect=daemon.address) as upstream:
            task_status.started()
            while True:
                identity, *frames = await router.recv_multipart()
                await upstream.send_multipart([f.bytes for f in frames])
                reply = await upstream.recv_multipart()
                _, body = P.decode_request(frames[0].bytes)
                if isinstance(body, P.OnceReq) and isinstance(body.body, P.CreateReq) and not lost:
                    lost.append(body)  # applied by the daemon; the mount never hears of it
                    continue
                await router.send_multipart([identity.bytes, *[f.bytes for f in reply]])

    async with open_socket(ctx, zmq.ROUTER, bind=relay_address) as router:
        port = router.raw.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[-1]
        async with trio.open_nursery() as nursery:
            await nursery.start(relay, router)
            client = MetaClient(ctx, [relay_address.rsplit(":", 1)[0] + f":{port}", daemon.address], timeout=1.0)
            async with contextlib.AsyncExitStack() as stack:
                await client.open(stack)
                await client.hello("", patience_s=10)
                created = await client.call(P.CreateReq(parent=ROOT, name=b"once", mode=0o644, uid=0, gid=0,
                                                        session_id=client.session_id))
                assert isinstance(created, P.OpenRsp) and len(lost) == 1  # not EEXIST: the first answer
                listing = await client.call(P.ReaddirReq(ino=ROOT))
                assert [e.name for e in listing.entries] == [b"once"] and listing.entries[0].attr.ino == created.attr.ino
                # the next op carries the next id and says the first one was answered
                await client.call(P.UnlinkReq(parent=ROOT, name=b"once"))
            nursery.cancel_scope.cancel()
