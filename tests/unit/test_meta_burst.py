"""The metadata daemon's request path without a task per request (daemon/burst.py) and BatchReq.

A burst of requests received together runs in one hold of the lock and one
group commit, answered in request order; what must wait (a callback's
acknowledgement) is answered later from a task; what the path does not serve
takes the usual one. A kill -9 while bursts are in flight loses no answered
change. A BatchReq is one message, one commit, one result per item, each item
checked (access, quotas) as it would be alone.
"""

from __future__ import annotations

import sqlite3

import pytest
import trio
import zmq

from stripefs.common import protocol as P
from stripefs.common.config import MetaConfig
from stripefs.common.errors import ErrorCode
from stripefs.common.transport import connect, open_socket
from stripefs.daemon.service import MetaService
from test_meta_service import Daemon
from test_security import ROOT, _code, secure_cluster
from util import free_address


def _register(node_id: int = 1) -> P.RegisterNodeReq:
    return P.RegisterNodeReq(node_id=node_id, address="tcp://127.0.0.1:1", host="h", capacity_bytes=1 << 40,
                             free_bytes=1 << 39, used_bytes=0, chunks=0)


def _create(name: bytes, parent: int = ROOT, session_id: int = 0) -> P.CreateReq:
    return P.CreateReq(parent=parent, name=name, mode=0o100644, uid=0, gid=0, session_id=session_id)


class _Commits:
    """Counts the COMMITs of ``service``'s store (each an fsync)."""

    def __init__(self, service: MetaService):
        self.n = 0
        real = service.store.commit

        def counting():
            self.n += 1
            real()

        service.store.commit = counting


async def _service(nursery, ctx, tmp_path) -> MetaService:
    config = MetaConfig(listen=free_address(), data_dir=str(tmp_path), chunk_size=1 << 20, stripe_count=1,
                        redundancy="replicas=1")
    service = MetaService(config, zmq_context=ctx)
    await nursery.start(service.run)
    await service.handle(_register(), [])
    return service


async def test_a_burst_of_successes_failures_and_a_wait_is_committed_once_and_answered_in_order(tmp_path, ctx):
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        sid = (await service.handle(P.HelloReq(host="a", pid=1, client_id=111), [])).session_id
        other = (await service.handle(P.HelloReq(host="b", pid=2, client_id=222), [])).session_id
        await service.handle(_create(b"held"), [])
        held = await service.handle(P.LookupReq(parent=ROOT, name=b"held", callback=True, session_id=other), [])
        assert held.callback >= 0  # the other mount caches it: a change of it waits for that mount
        commits = _Commits(service)
        disk = sqlite3.connect(tmp_path / "meta.sqlite3")  # sees only what is committed

        once = P.OnceReq(client_id=111, op_id=1, done_below=0, body=_create(b"b", session_id=sid))
        items = [
            _create(b"a", session_id=sid),  # 0: succeeds
            P.MkdirReq(parent=ROOT, name=b"held", mode=0o40755, uid=0, gid=0),  # 1: EXISTS
            P.GetattrReq(ino=987654),  # 2: NOT_FOUND
            once,  # 3: succeeds, once
            P.UnlinkReq(parent=ROOT, name=b"held"),  # 4: waits for the other mount's acknowledgement
            P.ReaddirReq(ino=ROOT),  # 5: not this path's: served the usual way
            P.SetattrReq(ino=ROOT, mode=0o40755),  # 6: succeeds
            once,  # 7: the retry of 3, in the same burst: applied once, the same answer
            _create(b"x" * 300),  # 8: name too long
        ]
        results = await service.burst.run([(body, None) for body in items])

        assert commits.n == 1  # one fsync for the whole burst
        names = {row[0] for row in disk.execute("SELECT name FROM dentries WHERE parent=1")}
        assert {b"a", b"b"} <= names  # durable before any reply exists
        a, exists, missing, b, wait, usual, setattr, retry, long = results
        assert isinstance(a, P.OpenRsp) and isinstance(b, P.OpenRsp) and isinstance(setattr, P.AttrRsp)
        assert (exists.code, missing.code) == (ErrorCode.EXISTS, ErrorCode.NOT_FOUND)
        assert isinstance(long, P.ErrorRsp) and long.code != ErrorCode.INTERNAL
        assert usual is None
        assert isinstance(retry, P.OpenRsp) and retry.attr.ino == b.attr.ino  # not a second file
        assert a.seq < b.seq < setattr.seq  # change numbers in request (= commit) order
        assert callable(wait)

        async with trio.open_nursery() as waiting:
            answer = []

            async def finish():
                answer.append(await wait())

            waiting.start_soon(finish)
            await trio.sleep(0.2)
            assert not answer  # the other mount has not dropped it yet
            await service.handle(P.AckReq(session_id=other, seq=0, everything=True), [])
        assert isinstance(answer[0], P.ChangedRsp)
        assert service.callbacks.timeouts == 0
        disk.close()
        nursery.cancel_scope.cancel()


async def test_a_read_in_a_burst_is_answered_before_the_commit_of_the_writes_beside_it(tmp_path, ctx):
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        await service.handle(_create(b"old"), [])
        commits = _Commits(service)
        ahead: list[tuple[int, object, int]] = []

        async def early(index, reply):
            ahead.append((index, reply, commits.n))

        items = [_create(b"new"), P.GetattrReq(ino=ROOT), P.LookupReq(parent=ROOT, name=b"old"), P.GetattrReq(ino=987654)]
        results = await service.burst.run([(body, None) for body in items], early)

        assert [(i, n) for i, _, n in ahead] == [(1, 0), (2, 0), (3, 0)]  # sent before the one commit
        assert isinstance(ahead[0][1], P.AttrRsp) and ahead[0][1].attr.ino == ROOT
        assert isinstance(ahead[1][1], P.AttrRsp) and ahead[2][1].code == ErrorCode.NOT_FOUND
        assert commits.n == 1 and isinstance(results[0], P.OpenRsp)  # the create: after its commit
        nursery.cancel_scope.cancel()


async def test_a_number_out_of_range_in_a_burst_is_refused_alone(tmp_path, ctx):
    """A lookup naming a parent past SQLite's signed 64 bits (the fuzzer's): refused (not INTERNAL),
    and the requests received with it answered as if it were not there."""
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        await service.handle(_create(b"old"), [])
        sid = (await service.handle(P.HelloReq(host="a", pid=1, client_id=111), [])).session_id
        other = (await service.handle(P.HelloReq(host="b", pid=2, client_id=222), [])).session_id
        await service.handle(P.DelegateInodesReq(session_id=other, count=100), [])  # a lookup then reads the name first
        huge = (1 << 64) - 1
        hostile = [P.LookupReq(parent=huge, name=b"x"), P.LookupReq(parent=huge, name=b"p" + b"z" * 272, session_id=7412),
                   P.LookupReq(parent=huge, name=b"x", session_id=sid, callback=True), P.GetattrReq(ino=huge),
                   P.BatchReq(items=[_create(b"in-batch"), P.UnlinkReq(parent=huge, name=b"x")])]
        async with open_socket(ctx, zmq.DEALER, connect=service.config.listen) as sock:
            for i, bad in enumerate(hostile):
                items = [_create(b"new%d" % i), bad, P.LookupReq(parent=ROOT, name=b"old")]
                for k, body in enumerate(items):  # no await between them: one burst
                    sock.raw.send_multipart([P.encode(k + 1, body)])
                with trio.fail_after(20):
                    replies = dict([P.decode_reply((await sock.recv_multipart())[0].bytes) for _ in items])
                assert isinstance(replies[1], P.OpenRsp) and isinstance(replies[3], P.AttrRsp), (bad, replies)
                flat = replies[2].results if isinstance(replies[2], P.BatchRsp) else [replies[2]]
                assert any(isinstance(r, P.ErrorRsp) for r in flat), (bad, flat)
                assert not any(isinstance(r, P.ErrorRsp) and r.code == ErrorCode.INTERNAL for r in flat), (bad, flat)
        nursery.cancel_scope.cancel()


async def test_a_directory_read_once_per_burst_is_reported_as_the_database_has_it(tmp_path, ctx, monkeypatch):
    """The burst keeps the directory rows it read (daemon/store.py dir_cache): what each reply
    reports of the directory is what the database holds after its operation, through a
    subdirectory (nlink), a setattr of the directory, and an operation that failed after
    changing the directory (its savepoint rolled back)."""
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        d = (await service.handle(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0), [])).attr.ino
        real = service.store.touch_dir

        def fails_for_bad(ino, now, nlink=0):
            real(ino, now, nlink)
            if service.store.get_dentry(d, b"bad") is not None:
                raise RuntimeError("injected after the directory changed")

        monkeypatch.setattr(service.store, "touch_dir", fails_for_bad)
        items = [_create(b"a", parent=d), P.MkdirReq(parent=d, name=b"sub", mode=0o40755, uid=0, gid=0),
                 P.SetattrReq(ino=d, mode=0o40700), P.MkdirReq(parent=d, name=b"bad", mode=0o40755, uid=0, gid=0),
                 _create(b"b", parent=d)]
        a, sub, chmod, bad, b = await service.burst.run([(body, None) for body in items])

        assert bad.code == ErrorCode.INTERNAL and service.store.get_dentry(d, b"bad") is None
        disk = sqlite3.connect(tmp_path / "meta.sqlite3")
        nlink, mode, mtime = disk.execute("SELECT nlink, mode, mtime_ns FROM inodes WHERE ino=?", (d,)).fetchone()
        reported = b.dir_attrs[0]
        assert (reported.ino, reported.nlink, reported.mode, reported.mtime_ns) == (d, nlink, mode, mtime) == (d, 3, 0o40700, mtime)
        assert sub.dir_attrs[0].nlink == 3 and a.dir_attrs[0].nlink == 2 and chmod.attr.mode == 0o40700
        assert service.ns.getattr(d) == reported
        nursery.cancel_scope.cancel()


async def test_requests_sent_together_are_answered_in_order_with_one_commit_per_burst(tmp_path, ctx):
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        commits = _Commits(service)
        async with open_socket(ctx, zmq.DEALER, connect=service.config.listen) as sock:
            n = 200
            for i in range(n):  # no await between them: they wait on the daemon's socket together
                sock.raw.send_multipart([P.encode(i + 1, _create(b"f%d" % i))])
            got = []
            with trio.fail_after(20):
                while len(got) < n:
                    request_id, body = P.decode_reply((await sock.recv_multipart())[0].bytes)
                    got.append(request_id)
                    assert isinstance(body, P.OpenRsp), body
        assert got == list(range(1, n + 1))  # in order
        assert service.burst.requests >= n and commits.n < n // 4  # bursts, not a commit per create
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("store, batch", [("sqlite", 1), ("sqlite", 64), ("postgresql", 1)])
async def test_a_kill9_in_the_middle_of_bursts_loses_no_answered_create(tmp_path, ctx, store, batch, request):
    """Creates sent alone, or in BatchReqs of 64 (each run made as one operation: daemon/burst.py ``_many``)."""
    daemon = Daemon(tmp_path)
    if store == "postgresql":  # the bursts are transactions of their own there (test_pg_burst.py)
        dsn = request.getfixturevalue("pg_dsn")
        daemon.config.write_text(daemon.config.read_text() + f'store = "postgresql"\ndsn = "{dsn}"\n')
    daemon.start()
    try:
        await daemon.wait_ready(ctx)
        async with connect(ctx, daemon.address, timeout=10) as c:
            await c.call(_register())
            parent = (await c.call(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0)))[0].attr.ino
        answered: list[bytes] = []
        async with open_socket(ctx, zmq.DEALER, connect=daemon.address) as sock:
            n = 3000
            creates = [_create(b"f%d" % i, parent=parent) for i in range(n)]
            for k in range(0, n, batch):
                body = creates[k] if batch == 1 else P.BatchReq(items=creates[k:k + batch])
                sock.raw.send_multipart([P.encode(k + 1, body)])
            with trio.fail_after(30):
                while len(answered) < 300:
                    request_id, body = P.decode_reply((await sock.recv_multipart())[0].bytes)
                    results = body.results if batch > 1 else [body]
                    assert all(isinstance(r, P.OpenRsp) for r in results), body
                    answered += [b"f%d" % (request_id - 1 + j) for j in range(len(results))]
            daemon.kill9()  # creates still queued, running and waiting for their commit
        assert len(answered) < n
        daemon.start()
        await daemon.wait_ready(ctx)
        async with connect(ctx, daemon.address, timeout=10) as c:
            names, after = set(), 0
            while True:
                page = (await c.call(P.ReaddirReq(ino=parent, after=after, limit=1000)))[0]
                names |= {e.name for e in page.entries}
                if not page.more:
                    break
                after = page.entries[-1].cookie
        assert set(answered) <= names
    finally:
        daemon.stop()


async def test_a_batch_is_one_message_one_commit_and_one_result_per_item(tmp_path, ctx):
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        d = await service.handle(P.MkdirReq(parent=ROOT, name=b"q", mode=0o40755, uid=0, gid=0), [])
        await service.handle(P.QuotaSetReq(ino=d.attr.ino, max_inodes=3), [])
        commits = _Commits(service)
        items = [_create(b"f%d" % i, parent=d.attr.ino) for i in range(4)]  # the 4th passes the quota
        items += [P.UnlinkReq(parent=d.attr.ino, name=b"f0"), P.UnlinkReq(parent=d.attr.ino, name=b"nothing"),
                  P.OnceReq(client_id=5, op_id=1, done_below=0, body=P.SetattrReq(ino=d.attr.ino, mode=0o40700)),
                  P.GetattrReq(ino=ROOT)]  # not a change: refused in a batch
        async with connect(ctx, service.config.listen, timeout=10) as c:
            rsp = (await c.call(P.BatchReq(items=items)))[0]
            assert isinstance(rsp, P.BatchRsp) and len(rsp.results) == len(items)
            r = rsp.results
            assert all(isinstance(x, P.OpenRsp) for x in r[:3]) and r[3].code == ErrorCode.QUOTA_EXCEEDED
            assert isinstance(r[4], P.ChangedRsp) and r[5].code == ErrorCode.NOT_FOUND
            assert isinstance(r[6], P.AttrRsp) and r[6].attr.mode & 0o777 == 0o700
            assert r[7].code == ErrorCode.BAD_REQUEST
            assert commits.n == 1
            listing = (await c.call(P.ReaddirReq(ino=d.attr.ino)))[0]
            assert sorted(e.name for e in listing.entries) == [b"f1", b"f2"]
        nursery.cancel_scope.cancel()


async def test_each_item_of_a_batch_passes_the_access_checks_it_would_pass_alone(tmp_path):
    async with secure_cluster(tmp_path) as c:
        async with c.client("rw") as admin:
            team_a = (await admin.call(P.MkdirReq(parent=ROOT, name=b"team-a", mode=0o40755, uid=0, gid=0)))[0].attr
            outside = (await admin.call(P.MkdirReq(parent=ROOT, name=b"elsewhere", mode=0o40755, uid=0, gid=0)))[0].attr
        batch = P.BatchReq(items=[_create(b"in", parent=team_a.ino), _create(b"out", parent=outside.ino)])
        async with c.client("team") as team:  # a subtree key: its items go through its subtree checks one by one
            inside, out = (await team.call(batch))[0].results
            assert isinstance(inside, P.OpenRsp) and inside.cap is not None  # signed, as a create alone is
            assert out.code == ErrorCode.ACCESS
        async with c.client("ro") as ro:
            assert await _code(ro.call(batch)) == ErrorCode.READ_ONLY
        async with c.client("squash") as squashed:
            made = (await squashed.call(P.BatchReq(items=[_create(b"s", parent=outside.ino)])))[0].results[0]
            assert (made.attr.uid, made.attr.gid) == (65534, 65534)
        async with c.client("rw") as admin:
            names = {e.name for e in (await admin.call(P.ReaddirReq(ino=outside.ino)))[0].entries}
            assert names == {b"s"}


async def test_a_burst_that_fails_is_answered_internal_and_the_daemon_serves_on(tmp_path, ctx):
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        real = service.burst._settle

        async def broken(units):
            service.burst._settle = real  # once
            raise RuntimeError("a bug")

        service.burst._settle = broken
        async with connect(ctx, service.config.listen, timeout=10) as c:
            assert await _code(c.call(_create(b"a"))) == ErrorCode.INTERNAL
            assert isinstance((await c.call(_create(b"b")))[0], P.OpenRsp)
        nursery.cancel_scope.cancel()


async def batches_past_the_bound(service, most: int) -> tuple[P.BatchReq, int]:
    """Two BatchReqs of creates that together pass the serving loop's bound ``most``, as one
    burst: the first is served, the second left for a task (returned, with its length)."""
    half = most // 2 + 1
    first = P.BatchReq(items=[_create(b"a%d" % i) for i in range(half)])
    second = P.BatchReq(items=[_create(b"b%d" % i) for i in range(half)])
    taken = await service.burst.run([(first, None), (second, None)])
    assert isinstance(taken[0], P.BatchRsp) and taken[1] is None  # the loop's burst stays bounded
    return second, half


async def test_a_batch_past_the_bursts_bound_is_served_as_a_burst_of_its_own_in_a_task(tmp_path, ctx):
    from stripefs.daemon import burst

    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        second, half = await batches_past_the_bound(service, burst.MOST)
        commits = _Commits(service)
        rsp = await service.handle(second, [])  # what serve() then does with it, in a task
        errors = [r for r in rsp.results if not isinstance(r, P.OpenRsp)]
        # one commit for all; or one per slice of the lock at most, when other work committed in between
        assert not errors and len(rsp.results) == half and commits.n <= -(-half // burst.SLICE), (errors[:2], commits.n)
        nursery.cancel_scope.cancel()


async def test_a_commit_on_the_burst_path_that_needs_a_snapshots_copy_out_is_run_again_on_the_task_path(tmp_path, ctx):
    """While snapshots exist commits take the task path (service.GATED_KINDS); one already taken by a
    burst when a snapshot appears (the create runs between its planning and its turn under the lock)
    must not answer BUSY: the burst hands it to the task path, which copies the shared chunk out first."""
    from stripefs.daemon.service import BURST_KINDS

    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        copied = []

        async def copy_out(need):  # the storage node's part (CopyChunkReq with a source): done
            copied.append(need)
            await service.txn.write(service.ns.snapshots.copied, need.pins)

        service.snapshot_service.copy_out = copy_out
        d = (await service.handle(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0), [])).attr.ino
        f = (await service.handle(_create(b"f", parent=d), [])).attr.ino
        node = [1]
        await service.handle(P.CommitReq(ino=f, size=10, mtime_ns=1, chunks=[P.ChunkRef(index=0, version=3, nodes=node)]), [])
        await service.handle(P.SnapshotCreateReq(ino=d, name=b"s"), [])
        service.burst.kinds = BURST_KINDS  # as a burst planned before the create saw them
        (rsp,) = await service.burst.run([(P.CommitReq(ino=f, size=20, mtime_ns=2, chunks=[P.ChunkRef(index=0, version=4, nodes=node)]), None)])
        if callable(rsp):
            rsp = await rsp()
        assert isinstance(rsp, P.AttrRsp) and rsp.attr.size == 20, rsp
        assert len(copied) == 1 and [p.data_ino for p in copied[0].pins] == [f]
        nursery.cancel_scope.cancel()


async def test_a_oncereq_commit_that_needed_a_copy_out_is_recorded_once_applied(tmp_path, ctx):
    """gated runs the commit again after the copy-out: that run is the OnceReq's operation, so a
    resend is answered from its record (not applied again)."""
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)

        async def copy_out(need):
            await service.txn.write(service.ns.snapshots.copied, need.pins)

        service.snapshot_service.copy_out = copy_out
        d = (await service.handle(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0), [])).attr.ino
        f = (await service.handle(_create(b"f", parent=d), [])).attr.ino
        await service.handle(P.CommitReq(ino=f, size=10, mtime_ns=1, chunks=[P.ChunkRef(index=0, version=3, nodes=[1])]), [])
        await service.handle(P.SnapshotCreateReq(ino=d, name=b"s"), [])
        once = P.OnceReq(client_id=9, op_id=1, done_below=0,
                         body=P.CommitReq(ino=f, size=20, mtime_ns=2, chunks=[P.ChunkRef(index=0, version=4, nodes=[1])]))
        assert (await service.handle(once, [])).attr.size == 20
        await service.handle(P.CommitReq(ino=f, size=30, mtime_ns=3, chunks=[P.ChunkRef(index=0, version=5, nodes=[1])]), [])
        assert (await service.handle(once, [])).attr.size == 20  # the first answer again, from applied_ops
        nursery.cancel_scope.cancel()


async def test_a_write_sessions_bookkeeping_takes_the_burst_path_and_its_epochs_are_durable_first(tmp_path, ctx):
    """Opens (a mark too), epochs, placements and their release (issue 35: a task each cost the
    daemon ~1 ms) run in the burst: answered by it, one commit. The epochs it hands out are
    distinct, increasing and all below the high-water mark on disk when the burst returns (a kill -9
    right after never hands one out twice), across a raise of that mark in the burst. A mark on a
    file another session caches is left to its handler (which has that cache dropped first)."""
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        sid = (await service.handle(P.HelloReq(host="a", pid=1, client_id=111), [])).session_id
        other = (await service.handle(P.HelloReq(host="b", pid=2, client_id=222), [])).session_id
        ino = (await service.handle(_create(b"f", session_id=sid), [])).attr.ino
        cached = (await service.handle(_create(b"g"), [])).attr.ino
        held = await service.handle(P.LookupReq(parent=ROOT, name=b"g", callback=True, session_id=other), [])
        assert held.callback >= 0  # the other mount caches g
        for _ in range(2):  # ~960 epochs handed out: this test's burst raises the mark (EPOCH_BLOCK, 1,000)
            await service.burst.run([(P.AllocEpochReq(pair=True), None)] * 240)
        commits = _Commits(service)
        disk = sqlite3.connect(tmp_path / "meta.sqlite3")  # sees only what is committed
        epochs_asked = 100  # pairs: one slice of the burst (SLICE), across the raise
        items = [
            P.OpenReq(ino=ino, session_id=sid, write=True, mark=True, pair=True),
            P.AllocChunksReq(ino=ino, indices=[0, 1, 2]),
            P.ReleaseChunksReq(ino=ino, indices=[1, 2]),
            P.OpenReq(ino=ino, session_id=sid),
            P.OpenReq(ino=cached, session_id=sid, mark=True),  # cached elsewhere: handle_open's
            *[P.AllocEpochReq(pair=True) for _ in range(epochs_asked)],
        ]
        results = await service.burst.run([(body, None) for body in items])

        opened, placed, released, read_open, marked_elsewhere, *epochs = results
        assert commits.n == 1
        assert isinstance(opened, P.OpenRsp) and opened.epoch > 0 and opened.epoch_pair and opened.callback >= 0
        assert service.callbacks.written_elsewhere(other, ino)  # the mark holds: another's read recalls it
        assert isinstance(placed, P.ChunksRsp) and [c.index for c in placed.chunks] == [0, 1, 2]
        assert isinstance(released, P.OkRsp)
        assert isinstance(read_open, P.OpenRsp) and read_open.epoch == 0 and read_open.attr.ino == ino
        assert marked_elsewhere is None  # not this path's
        assert all(isinstance(e, P.EpochRsp) and e.pair for e in epochs)
        handed = [opened.epoch, *(e.epoch for e in epochs)]
        assert all(b >= a + 2 for a, b in zip(handed, handed[1:]))  # each a pair of its own
        hwm = int(disk.execute("SELECT value FROM meta WHERE key='epoch_hwm'").fetchone()[0])
        assert handed[0] < 1000 < handed[-1] < hwm - 1  # the raise in the burst, committed before any reply
        disk.close()
        nursery.cancel_scope.cancel()


async def _writer_reader_and_file(service: MetaService) -> tuple[int, int, int]:
    """Two sessions (a writer, a reader on another mount) and the file ``g`` in the root: their ids and its inode."""
    sid = (await service.handle(P.HelloReq(host="a", pid=1, client_id=111), [])).session_id
    other = (await service.handle(P.HelloReq(host="b", pid=2, client_id=222), [])).session_id
    return sid, other, (await service.handle(_create(b"g"), [])).attr.ino


async def test_a_write_mark_on_a_file_cached_earlier_in_the_same_burst_waits_for_that_cache_to_go(tmp_path, ctx):
    """A burst planned a marking open before another session's lookup, earlier in the same burst,
    began caching the file. The open must not answer "no mark" (-1): that mount's closes would send
    nothing and its commit come after its close returned, while the other session's next open is
    answered from its cache (the close-to-open rule). It goes to the task path, which has the other
    cache dropped first (a change it acknowledges), then marks."""
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        sid, other, ino = await _writer_reader_and_file(service)
        lookup, opened = await service.burst.run([
            (P.LookupReq(parent=ROOT, name=b"g", callback=True, session_id=other), None),
            (P.OpenReq(ino=ino, session_id=sid, mark=True), None),
        ])
        assert isinstance(lookup, P.AttrRsp) and lookup.callback >= 0  # the other session caches g now
        assert callable(opened)  # not answered by the burst: a continuation (the task path)
        got = []

        async def answer():
            got.append(await opened())

        nursery.start_soon(answer)
        with trio.fail_after(10):
            while not got:  # the other mount drops g and acknowledges the change naming it
                await trio.sleep(0.05)
                await service.handle(P.AckReq(session_id=other, seq=service.callbacks.last_seq()), [])
        (rsp,) = got
        assert isinstance(rsp, P.OpenRsp) and rsp.callback >= 0, rsp  # marked
        assert service.callbacks.written_elsewhere(other, ino)  # the other session's next read recalls the writer
        assert not service.callbacks.held_elsewhere(sid, ino)  # its cache of g is gone
        nursery.cancel_scope.cancel()


async def test_a_lookup_after_a_write_mark_in_the_same_burst_gets_no_callback(tmp_path, ctx):
    """The other order: the burst planned another session's lookup before a marking open earlier in
    it granted the mark. The lookup's answer is right (the writer's WRITE waits for the mark's
    reply), but it must not be cached under a callback: the writer's close sends nothing, and that
    cache would answer the other mount's next open from before it."""
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        sid, other, ino = await _writer_reader_and_file(service)
        opened, lookup = await service.burst.run([
            (P.OpenReq(ino=ino, session_id=sid, mark=True), None),
            (P.LookupReq(parent=ROOT, name=b"g", callback=True, session_id=other), None),
        ])
        assert isinstance(opened, P.OpenRsp) and opened.callback >= 0  # marked
        assert isinstance(lookup, P.AttrRsp) and lookup.attr.ino == ino and lookup.callback == -1, lookup
        assert not service.callbacks.held_elsewhere(sid, ino)
        nursery.cancel_scope.cancel()
