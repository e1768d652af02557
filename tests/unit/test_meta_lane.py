"""The metadata daemon's read lane (daemon/read_lane.py) and the mount's blocking client (client/meta_blocking.py).

The lane answers a lone getattr, lookup or ping on its own thread from the
committed state; it never answers what the task path must (a grant, a read
while a change waits for its commit), never overtakes a connection's own
earlier request, and under a stream of creates never shows a name going back.
The blocking client maps errors as the trio client does, and a daemon that
does not answer is a clean error after its timeout, never a hang.
"""

from __future__ import annotations

import threading
import time

import pytest
import trio
import zmq

from stripefs.client.meta_blocking import BlockingMetaClient
from stripefs.client.meta_rpc import MetaClient
from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.common.fast_lane import recv_frames, send_frames
from stripefs.common.transport import connect, open_socket
from test_meta_burst import _create, _service
from test_security import ROOT
from util import free_address


def _lane(service) -> str:
    """The daemon's read lane (PingRsp.read_port)."""
    assert service.read_port
    return service.config.listen.rsplit(":", 1)[0] + f":{service.read_port}"


async def _on_the_lane(service, exchange):
    """``await exchange()`` (requests to the lane) until the lane left none of its reads to serve(),
    3 times at most, committing between: a background write (housekeeping, open-file leases) not
    committed yet at that moment rightly sends reads to serve(). What the last exchange returned, and
    whether the lane answered all of its reads."""
    for _ in range(3):
        passed = service.lane.passed
        result = await exchange()
        if service.lane.passed == passed:
            return result, True
        await service.txn.commit_now()
    return result, False


def _blocking(ctx, address: str, timeout: float = 5.0) -> BlockingMetaClient:
    return BlockingMetaClient(ctx, MetaClient(ctx, [address], timeout=timeout), timeout=timeout)


async def test_the_lane_answers_lone_reads_as_the_task_path_does(tmp_path, ctx):
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        d = (await service.handle(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0), [])).attr.ino
        await service.handle(_create(b"f", parent=d), [])
        await service.txn.commit_now()
        expected = [await service.handle(body, []) for body in (P.GetattrReq(ino=d), P.LookupReq(parent=d, name=b"f"))]

        async def exchange():
            nonlocal answered
            answered = service.lane.answered
            async with connect(ctx, _lane(service)) as client:
                got = [(await client.call(body))[0] for body in (P.GetattrReq(ino=d), P.LookupReq(parent=d, name=b"f"))]
                ping, _ = await client.call(P.PingReq())
                with pytest.raises(StripefsError) as missing:
                    await client.call(P.LookupReq(parent=d, name=b"nope"))
                with pytest.raises(StripefsError) as not_dir:
                    await client.call(P.LookupReq(parent=got[1].attr.ino, name=b"x"))
            return got, ping, missing, not_dir

        answered = 0
        (got, ping, missing, not_dir), lane_only = await _on_the_lane(service, exchange)
        assert got == expected and lane_only
        assert ping.role == "meta" and ping.boot_id == service.boot_id
        assert missing.value.code == ErrorCode.NOT_FOUND and not_dir.value.code == ErrorCode.NOT_DIR
        assert service.lane.answered == answered + 5  # all on the lane's thread
        async with connect(ctx, service.config.listen) as client:  # the main socket: trio's, as before
            ping, _ = await client.call(P.PingReq())
            assert (await client.call(P.GetattrReq(ino=d)))[0] == expected[0]
        assert ping.read_port == service.read_port and service.lane.answered == answered + 5
        nursery.cancel_scope.cancel()


async def test_a_getattr_of_an_inode_that_is_not_there_is_answered_on_the_lane_as_on_the_task_path(tmp_path, ctx):
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        await service.txn.commit_now()
        expected = await service.handle(P.GetattrReq(ino=ROOT), [])
        with pytest.raises(StripefsError) as task_path:
            await service.handle(P.GetattrReq(ino=987654), [])

        async def exchange():
            nonlocal answered
            answered = service.lane.answered
            async with connect(ctx, _lane(service)) as client:
                got, _ = await client.call(P.GetattrReq(ino=ROOT))
                with pytest.raises(StripefsError) as lane:
                    await client.call(P.GetattrReq(ino=987654))
            return got, lane

        answered = 0
        (got, lane), lane_only = await _on_the_lane(service, exchange)
        assert got == expected and lane_only and service.lane.answered == answered + 2
        assert (lane.value.code, lane.value.message) == (task_path.value.code, task_path.value.message)
        nursery.cancel_scope.cancel()


def test_frames_go_and_come_as_with_pyzmq_s_multipart_calls(ctx):
    """fast_lane's recv_frames and send_frames (the lane's and the blocking client's, without
    pyzmq's per-frame sugar) carry a message of several parts, a tracked frame (limits.ReplyQueues)
    among them."""
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://test-frames")
        b.connect("inproc://test-frames")
        tracked = zmq.Frame(b"last" * 100, copy=False, track=True)
        send_frames(a, [b"id", memoryview(b"header"), tracked])
        frames = recv_frames(b)
        assert [f.bytes for f in frames] == [b"id", b"header", b"last" * 100]
        assert not frames[-1].more and all(f.more for f in frames[:-1])
        send_frames(b, [b"one"])
        assert [f.bytes for f in recv_frames(a, zmq.NOBLOCK)] == [b"one"]
        with pytest.raises(zmq.Again):
            recv_frames(a, zmq.NOBLOCK)
    finally:
        a.close(linger=0)
        b.close(linger=0)


async def test_a_lookup_that_carries_a_grant_or_opens_takes_the_task_path(tmp_path, ctx):
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        sid = (await service.handle(P.HelloReq(host="a", pid=1, client_id=111), [])).session_id
        await service.handle(_create(b"f"), [])
        await service.txn.commit_now()
        answered = service.lane.answered
        async with connect(ctx, _lane(service)) as client:
            granted, _ = await client.call(P.LookupReq(parent=ROOT, name=b"f", callback=True, session_id=sid))
            opened, _ = await client.call(P.LookupReq(parent=ROOT, name=b"f", open_info=True, session_id=sid))
        assert granted.callback >= 0 and service.callbacks.held(granted.attr.ino)  # recorded as the task path does
        assert isinstance(opened, P.OpenRsp)
        assert service.lane.answered == answered
        nursery.cancel_scope.cancel()


async def test_a_read_while_a_change_waits_for_its_commit_sees_it_as_the_task_path_does(tmp_path, ctx):
    """The burst path answers reads before the commit of the writes beside them, so a client may
    have seen a change whose commit is pending: its next read must not go back to the committed
    state before it. A change made and not committed yet: the lane leaves the read to the task
    path, which sees it."""
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        service.txn.group_commit_ms = 60_000  # nothing commits behind the test's back (the committer waits)
        await trio.sleep(0.1)  # (a commit under way ends first)
        async with service.txn.lock:  # as a burst runs its operations, its commit still to come
            service.txn.write_locked(service.ns.mkdir, ROOT, b"pending", 0o40755, 0, 0, wake=False)
        passed = service.lane.passed
        async with connect(ctx, _lane(service)) as client:
            found, _ = await client.call(P.LookupReq(parent=ROOT, name=b"pending"))
        assert found.attr.ino > ROOT and service.lane.passed == passed + 1
        await service.txn.commit_now()

        async def lookup():
            async with connect(ctx, _lane(service)) as client:  # committed: the lane answers
                return (await client.call(P.LookupReq(parent=ROOT, name=b"pending")))[0]

        assert await _on_the_lane(service, lookup) == (found, True)
        nursery.cancel_scope.cancel()


async def test_a_read_while_a_commit_is_under_way_waits_for_it(tmp_path, ctx):
    """A COMMIT swaps its batch out first and returns an fsync later: meanwhile the change is
    neither in a dirty batch nor committed, and the lane leaves reads to the task path."""
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        service.txn.group_commit_ms = 60_000  # only the test commits
        await trio.sleep(0.1)
        async with service.txn.lock:
            service.txn.write_locked(service.ns.mkdir, ROOT, b"committing", 0o40755, 0, 0, wake=False)
        entered, go = threading.Event(), threading.Event()
        real = service.store.commit

        def slow_commit():
            entered.set()
            go.wait(10)
            real()

        service.store.commit = slow_commit
        nursery.start_soon(service.txn.commit_now)
        await trio.to_thread.run_sync(entered.wait, 10)
        passed, result = service.lane.passed, []

        def ask():
            try:
                result.append(_one_call(ctx, service, P.LookupReq(parent=ROOT, name=b"committing")))
            except StripefsError as exc:
                result.append(exc)

        thread = threading.Thread(target=ask)
        thread.start()
        with trio.fail_after(10):
            while service.lane.passed == passed and thread.is_alive():
                await trio.sleep(0.01)
        go.set()
        await trio.to_thread.run_sync(thread.join, 10)
        assert isinstance(result[0], P.AttrRsp) and result[0].attr.ino > ROOT, result
        nursery.cancel_scope.cancel()


async def test_a_task_holding_the_lock_to_read_does_not_stop_the_lane(tmp_path, ctx):
    """The healer and the operator requests hold the service lock across awaits while they read:
    the lane answers meanwhile (its rule is "no change waits for its commit", not "the lock free")."""
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        await service.txn.commit_now()
        answered = service.lane.answered
        async with service.txn.lock:
            rsp = await trio.to_thread.run_sync(lambda: _one_call(ctx, service, P.GetattrReq(ino=ROOT)))
        assert rsp.attr.ino == ROOT and service.lane.answered == answered + 1
        nursery.cancel_scope.cancel()


def _one_call(ctx, service, request):
    client = _blocking(ctx, service.config.listen, timeout=5.0)
    try:
        return client.call(request)
    finally:
        client.close()


async def test_the_lane_never_overtakes_a_connections_earlier_request(tmp_path, ctx):
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        async with open_socket(ctx, zmq.DEALER, connect=_lane(service)) as sock:
            for i in range(50):  # a create and, pipelined behind it, a lookup of its name
                name = b"p%d" % i
                sock.raw.send_multipart([P.encode(2 * i + 1, _create(name))])
                sock.raw.send_multipart([P.encode(2 * i + 2, P.LookupReq(parent=ROOT, name=name))])
            with trio.fail_after(20):
                for _ in range(100):
                    request_id, body = P.decode_reply((await sock.recv_multipart())[0].bytes)
                    assert not isinstance(body, P.ErrorRsp), (request_id, body)
        nursery.cancel_scope.cancel()


async def test_lane_reads_under_a_stream_of_creates_never_see_a_name_go_back(tmp_path, ctx):
    """Creates of d/m0, d/m1, ... answered one after another while threads look names up and
    stat the directory through the lane: a name created before a read began is always found,
    and no read sees m<i+1> without m<i> (the creates commit in order)."""
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        d = (await service.handle(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0), [])).attr.ino
        await service.txn.commit_now()
        answered = service.lane.answered
        created = [0]  # names f0 .. f<created-1> answered
        stop = threading.Event()
        problems: list[str] = []

        def reader() -> None:
            client = _blocking(ctx, service.config.listen)
            try:
                while not stop.is_set():
                    known = created[0]
                    if known:
                        try:
                            client.call(P.LookupReq(parent=d, name=b"m%d" % (known - 1)))
                        except StripefsError as exc:
                            problems.append(f"m{known - 1} answered, then not found: {exc.message}")
                    ahead = b"m%d" % (known + 1)
                    try:
                        client.call(P.LookupReq(parent=d, name=ahead))
                        client.call(P.LookupReq(parent=d, name=b"m%d" % known))  # created before the one after it
                    except StripefsError as exc:
                        if exc.code != ErrorCode.NOT_FOUND:
                            problems.append(str(exc))
                    client.call(P.GetattrReq(ino=d))
            except Exception as exc:  # noqa: BLE001 - reported by the test
                problems.append(repr(exc))
            finally:
                client.close()

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            async with open_socket(ctx, zmq.DEALER, connect=service.config.listen) as sock:
                for i in range(300):
                    sock.raw.send_multipart([P.encode(i + 1, _create(b"m%d" % i, parent=d))])
                    with trio.fail_after(10):
                        _, body = P.decode_reply((await sock.recv_multipart())[0].bytes)
                    assert isinstance(body, P.OpenRsp), body
                    created[0] = i + 1
        finally:
            stop.set()
            for t in threads:
                await trio.to_thread.run_sync(t.join)
        assert not problems, problems[:5]
        assert service.lane.answered > answered  # the lane took part
        nursery.cancel_scope.cancel()


# -- the blocking client -----------------------------------------------------------------


async def test_the_blocking_client_maps_errors_and_subtree_replies_as_the_trio_client(tmp_path, ctx):
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        d = (await service.handle(P.MkdirReq(parent=ROOT, name=b"d", mode=0o40755, uid=0, gid=0), [])).attr.ino
        await service.txn.commit_now()

        def calls():
            client = _blocking(ctx, service.config.listen)
            try:
                out = [client.call(P.GetattrReq(ino=d)), client.call(P.LookupReq(parent=ROOT, name=b"d"))]
                for bad in (P.LookupReq(parent=ROOT, name=b"nope"), P.GetattrReq(ino=987654), P.LookupReq(parent=ROOT, name=b"")):
                    with pytest.raises(StripefsError) as exc:
                        client.call(bad)
                    out.append(exc.value.code)
                with pytest.raises(ValueError):
                    client.call(_create(b"x"))  # not a read: the MetaClient's
                with pytest.raises(ValueError):
                    client.call(P.LookupReq(parent=ROOT, name=b"d", open_info=True))
                return out
            finally:
                client.close()

        answered = service.lane.answered
        getattr_rsp, lookup_rsp, *codes = await trio.to_thread.run_sync(calls)
        assert service.lane.answered == answered + 5  # it found the lane (PingRsp.read_port) and asked there
        assert getattr_rsp.attr == lookup_rsp.attr == (await service.handle(P.GetattrReq(ino=d), [])).attr
        assert codes == [ErrorCode.NOT_FOUND, ErrorCode.NOT_FOUND, ErrorCode.INVALID]
        nursery.cancel_scope.cancel()


async def test_the_blocking_client_asks_a_lookup_with_a_callback_at_the_daemon_s_address(tmp_path, ctx):
    """A default mount's worker threads ask its cold lookups with a callback (client/thread_meta.py):
    such a LookupReq goes to the main socket, where trio records the grant with the read, not to
    the lane, which would only forward it there through its thread; the next read goes to the lane."""
    async with trio.open_nursery() as nursery:
        service = await _service(nursery, ctx, tmp_path)
        sid = (await service.handle(P.HelloReq(host="a", pid=1, client_id=111), [])).session_id
        await service.handle(_create(b"f"), [])
        await service.txn.commit_now()

        def calls():
            client = _blocking(ctx, service.config.listen)
            try:
                return (client.call(P.LookupReq(parent=ROOT, name=b"f", callback=True, session_id=sid)),
                        client.call(P.GetattrReq(ino=ROOT)), client.call(P.LookupReq(parent=ROOT, name=b"f", callback=True, session_id=sid)))
            finally:
                client.close()

        answered, passed = service.lane.answered, service.lane.passed
        granted, attr, again = await trio.to_thread.run_sync(calls)
        assert granted.callback >= 0 and again.callback >= 0 and service.callbacks.held(granted.attr.ino)
        assert isinstance(attr, P.AttrRsp) and attr.attr.ino == ROOT
        assert service.lane.passed == passed and service.lane.answered == answered + 1  # only the getattr was the lane's
        nursery.cancel_scope.cancel()


def test_a_daemon_that_is_not_there_is_a_clean_error_after_the_timeout(ctx):
    client = _blocking(ctx, free_address(), timeout=0.3)
    try:
        started = time.monotonic()
        with pytest.raises(StripefsError) as exc:
            client.call(P.GetattrReq(ino=ROOT))
        assert exc.value.code in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT)
        assert time.monotonic() - started < 5  # not a hang (bounded loosely: a shared machine)
    finally:
        client.close()


def test_a_reply_that_comes_after_its_timeout_is_not_taken_for_the_next_one(ctx):
    """A daemon that answers late: the first call times out; the next one gets its own reply."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen: list[int] = []

    def server() -> None:
        while 8 not in seen:
            identity, header = router.recv_multipart()
            request_id, body = P.decode_request(header)
            if isinstance(body, P.PingReq):  # where the read lane is: none here (read_port 0)
                router.send_multipart([identity, P.encode(request_id, P.PingRsp(role="meta"))])
                continue
            seen.append(body.ino)
            time.sleep(0.5 if body.ino == 7 else 0.0)
            router.send_multipart([identity, P.encode(request_id, P.PingRsp(role=str(body.ino)))])

    thread = threading.Thread(target=server)
    thread.start()
    client = _blocking(ctx, f"tcp://127.0.0.1:{port}", timeout=0.2)
    try:
        with pytest.raises(StripefsError) as exc:
            client.call(P.GetattrReq(ino=7))
        assert exc.value.code == ErrorCode.TIMEOUT
        assert client.call(P.GetattrReq(ino=8), timeout=5.0).role == "8"  # not the late reply for 7
    finally:
        thread.join()
        client.close()
        router.close()
    assert seen == [7, 8]
