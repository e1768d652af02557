"""The trio adapter for pyzmq under concurrent load, and the server's answers to bad input."""

import random

import msgspec
import pytest
import trio
import zmq

from stripefs.common import limits, protocol
from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.common.transport import connect, open_socket, serve


async def _echo_server(ctx, address, task_status=trio.TASK_STATUS_IGNORED):
    async def handler(body, payloads):
        if isinstance(body, protocol.ReadChunkReq):
            if body.length < 0:
                raise StripefsError(ErrorCode.INVALID, "negative length")
            if body.chunk.ino == 666:
                raise RuntimeError("a bug")
            await trio.sleep(random.random() / 1000)
            data = bytes([body.offset % 256]) * body.length
            return protocol.ReadChunkRsp(version=body.min_version, xxh3=0), [data]
        if isinstance(body, protocol.WriteChunkReq):
            return protocol.WriteChunkRsp(version=body.version, length=sum(len(p) for p in payloads))
        return protocol.PingRsp(role="test")

    for attempt in range(100):  # libzmq closes sockets in its I/O thread: a rebind may briefly find the port taken
        try:
            server = open_socket(ctx, zmq.ROUTER, bind=address)
            sock = await server.__aenter__()
            break
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or attempt == 99:
                raise
            await trio.sleep(0.02)
    try:
        task_status.started()
        await serve(sock, handler, name="echo")
    finally:
        await server.__aexit__(None, None, None)


async def _until_bindable(address: str, timeout: float = 5.0) -> None:
    import socket

    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with trio.fail_after(timeout):
        while True:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq binds
                try:
                    s.bind((host, int(port)))
                    return
                except OSError:
                    pass
            await trio.sleep(0.01)


from util import free_address as _free_address  # noqa: E402


async def test_many_tasks_share_one_socket(ctx):
    """8 clients x 32 requests in flight, with payloads both ways: every reply arrives and matches."""
    address = _free_address()
    async with trio.open_nursery() as nursery:
        await nursery.start(_echo_server, ctx, address)
        done = 0

        async def worker(client, wid):
            nonlocal done
            for i in range(60):
                n = random.randrange(0, 70_000)
                if i % 2:
                    rsp, payloads = await client.call(
                        protocol.ReadChunkReq(chunk=protocol.ChunkId(1, wid), min_version=i, offset=wid + i, length=n)
                    )
                    assert rsp.version == i
                    assert bytes(payloads[0]) == bytes([(wid + i) % 256]) * n
                else:
                    rsp, _ = await client.call(
                        protocol.WriteChunkReq(chunk=protocol.ChunkId(1, 0), version=i, base_version=0, offset=0, xxh3=0),
                        [b"x" * n, b"y" * 3],
                    )
                    assert rsp.version == i and rsp.length == n + 3
                done += 1

        for c in range(8):
            async with connect(ctx, address, timeout=20) as client:
                async with trio.open_nursery() as inner:
                    for w in range(32):
                        inner.start_soon(worker, client, w)
        assert done == 8 * 32 * 60
        nursery.cancel_scope.cancel()


async def test_errors_travel_as_codes_and_server_survives(ctx):
    address = _free_address()
    async with trio.open_nursery() as nursery:
        await nursery.start(_echo_server, ctx, address)
        async with connect(ctx, address, timeout=5) as client:
            with pytest.raises(StripefsError) as exc:
                await client.call(protocol.ReadChunkReq(chunk=protocol.ChunkId(1, 0), min_version=0, offset=0, length=-1))
            assert exc.value.code == ErrorCode.INVALID
            with pytest.raises(StripefsError) as exc:
                await client.call(protocol.ReadChunkReq(chunk=protocol.ChunkId(666, 0), min_version=0, offset=0, length=1))
            assert exc.value.code == ErrorCode.INTERNAL

        # raw garbage: every malformed message gets an ErrorRsp, then a ping still works
        async with open_socket(ctx, zmq.DEALER, connect=address) as raw:
            bad = [
                [b"\xff\x00garbage"],
                [msgspec.msgpack.encode([99, 7, {"t": "ping"}])],
                [msgspec.msgpack.encode([protocol.PROTOCOL_VERSION, 8, {"t": "no_such_message"}])],
                [msgspec.msgpack.encode([protocol.PROTOCOL_VERSION, 9, {"t": "read_chunk", "offset": "x"}])],
                [],
            ]
            expected = [ErrorCode.BAD_REQUEST, ErrorCode.VERSION_MISMATCH, ErrorCode.UNKNOWN_MESSAGE, ErrorCode.BAD_REQUEST]
            for frames, code in zip(bad, expected):
                await raw.send_multipart(frames)
                with trio.fail_after(5):
                    reply = await raw.recv_multipart()
                _, body = protocol.decode_reply(reply[0].bytes)
                assert isinstance(body, protocol.ErrorRsp) and body.code == code
        async with connect(ctx, address, timeout=5) as client:
            rsp, _ = await client.call(protocol.PingReq())
            assert rsp.role == "test"
        nursery.cancel_scope.cancel()


async def test_timeout_when_peer_is_absent(ctx):
    async with connect(ctx, _free_address(), timeout=0.3) as client:
        with pytest.raises(StripefsError) as exc:
            await client.call(protocol.PingReq())
        assert exc.value.code == ErrorCode.TIMEOUT


async def _port_released(address):
    """Wait until a listener that was just closed has really let go of its port: zmq
    closes sockets in its I/O thread, after close() returns, so binding again at once
    can fail with EADDRINUSE."""
    import socket

    port = int(address.rsplit(":", 1)[1])
    for _ in range(500):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as zmq's listener does
            try:
                s.bind(("127.0.0.1", port))
                return
            except OSError:
                pass
        await trio.sleep(0.01)


async def _until_disconnected(monitor: zmq.Socket, timeout: float = 5.0) -> None:
    """Wait for the DISCONNECTED event on a client's monitor socket: until the client's I/O
    thread has seen its peer go, a request it is given still goes into the dead connection,
    and is lost there (as any request in flight when a server dies is: callers retry)."""
    from zmq.utils.monitor import recv_monitor_message

    with trio.fail_after(timeout):
        while True:
            try:
                if recv_monitor_message(monitor, zmq.NOBLOCK)["event"] == zmq.EVENT_DISCONNECTED:
                    return
            except zmq.Again:
                await trio.sleep(0.01)


async def test_reconnects_after_server_restart(ctx):
    address = _free_address()
    async with connect(ctx, address, timeout=5) as client:
        monitor = client.sock.raw.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            for _ in range(2):
                await _port_released(address)
                async with trio.open_nursery() as nursery:
                    await nursery.start(_echo_server, ctx, address)
                    rsp, _ = await client.call(protocol.PingReq())
                    assert rsp.role == "test"
                    nursery.cancel_scope.cancel()
                await _until_bindable(address)  # libzmq closes the listener in its own thread, a moment later
                await _until_disconnected(monitor)
        finally:
            client.sock.raw.disable_monitor()
            monitor.close(linger=0)


async def test_the_fast_path_answers_what_it_can_and_never_passes_a_peer_queue(ctx):
    """serve(fast=...): a reply from ``fast`` goes out at once; None takes the usual path; a
    request of a peer whose queue holds requests waits its turn behind them."""
    address = _free_address()
    seen = {"fast": 0, "slow": 0}
    held = trio.Event()
    release = trio.Event()

    def fast(body, payloads):
        if isinstance(body, protocol.ReadChunkReq) and body.chunk.ino == 1:
            seen["fast"] += 1
            return protocol.ReadChunkRsp(version=7, xxh3=0), [b"fast"]
        return None

    async def handler(body, payloads):
        seen["slow"] += 1
        if body.chunk.ino == 2:  # holds the peer's only slot until released
            held.set()
            await release.wait()
        return protocol.ReadChunkRsp(version=body.chunk.ino, xxh3=0), [b"slow"]

    def read(ino):
        return protocol.ReadChunkReq(chunk=protocol.ChunkId(ino, 0), min_version=0, offset=0, length=4)

    one_slot = limits.ServeLimits(per_peer_inflight=1)
    async with trio.open_nursery() as nursery:
        async with open_socket(ctx, zmq.ROUTER, bind=address) as sock:
            nursery.start_soon(lambda: serve(sock, handler, name="fast-test", limits=one_slot, fast=fast))
            async with connect(ctx, address, timeout=5) as client:
                rsp, data = await client.call(read(1))
                assert (rsp.version, bytes(data[0])) == (7, b"fast") and seen == {"fast": 1, "slow": 0}
                rsp, data = await client.call(read(3))  # fast says None: the handler answers
                assert (rsp.version, bytes(data[0])) == (3, b"slow") and seen == {"fast": 1, "slow": 1}

                results = {}

                async def ask(name, ino):
                    results[name] = await client.call(read(ino))

                async with trio.open_nursery() as calls:
                    calls.start_soon(ask, "held", 2)
                    await held.wait()
                    calls.start_soon(ask, "queued", 3)  # the peer's slot is taken: it queues
                    await trio.sleep(0.1)
                    calls.start_soon(ask, "behind", 1)  # fast could answer it, but not past "queued"
                    await trio.sleep(0.2)
                    assert not results and seen["fast"] == 1
                    release.set()
                assert [results[k][0].version for k in ("held", "queued", "behind")] == [2, 3, 1]
                assert bytes(results["behind"][1][0]) == b"slow"
            nursery.cancel_scope.cancel()


async def test_a_fast_lane_answers_on_its_thread_and_forwards_the_rest(ctx):
    """common/fast_lane.py: ``fast`` answers on the lane thread; everything else reaches the trio
    handler with its errors and payloads intact; stopping frees the address."""
    import threading

    from stripefs.common.fast_lane import serve_with_fast_lane

    address = _free_address()
    threads = {}

    def fast(body, payloads, *, waiting):
        threads["fast"] = threading.current_thread().name
        if isinstance(body, protocol.ReadChunkReq) and body.chunk.ino == 1:
            return protocol.ReadChunkRsp(version=1, xxh3=0), [b"from the lane"]
        return None

    async def handler(body, payloads):
        threads["handler"] = threading.current_thread().name
        if isinstance(body, protocol.WriteChunkReq):
            return protocol.WriteChunkRsp(version=body.version, length=sum(len(p) for p in payloads))
        if body.chunk.ino == 666:
            raise StripefsError(ErrorCode.NOT_FOUND, "no such chunk")
        return protocol.ReadChunkRsp(version=body.chunk.ino, xxh3=0), [b"from trio"]

    def read(ino):
        return protocol.ReadChunkReq(chunk=protocol.ChunkId(ino, 0), min_version=0, offset=0, length=4)

    for _ in range(2):  # twice on one address: the first lane closed its socket
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: serve_with_fast_lane(ctx, address, handler, fast, name="lane-test", task_status=task_status))
            async with connect(ctx, address, timeout=5) as client:
                rsp, data = await client.call(read(1))
                assert bytes(data[0]) == b"from the lane" and threads["fast"] == "lane-test-fast-lane"
                rsp, data = await client.call(read(7))
                assert (rsp.version, bytes(data[0])) == (7, b"from trio") and threads["handler"] == threading.main_thread().name
                write = protocol.WriteChunkReq(chunk=protocol.ChunkId(2, 0), version=3, base_version=0, offset=0, xxh3=0)
                rsp, _ = await client.call(write, [b"x" * 1000, b"y" * 24])
                assert rsp.length == 1024
                with pytest.raises(StripefsError) as info:
                    await client.call(read(666))
                assert info.value.code == ErrorCode.NOT_FOUND

                async def many(k):
                    rsp, data = await client.call(read(1 if k % 2 else 100 + k))
                    assert bytes(data[0]) == (b"from the lane" if k % 2 else b"from trio")

                async with trio.open_nursery() as calls:
                    for k in range(200):
                        calls.start_soon(many, k)
            nursery.cancel_scope.cancel()
        await _until_bindable(address)


async def test_a_session_heartbeat_waiting_for_its_daemon_names_the_files_open_when_it_goes(ctx):
    """The daemon is down: a heartbeat waits for it (ZMQ_IMMEDIATE). A file closed meanwhile is
    not in the open set the daemon gets when it is back (client/meta_rpc.py ``heartbeat``): a
    restarted daemon that adopted the session kept it open, and fsck kept the copies of a write
    the restart cut (issue 31, tests/cluster/test_failures.py)."""
    from contextlib import AsyncExitStack

    from stripefs.client.meta_rpc import MetaClient

    address = _free_address()
    meta = MetaClient(ctx, [address], timeout=5.0)
    meta.session_id = 7
    held = [42]
    meta.open_inodes = lambda: list(held)
    with trio.fail_after(10):
        async with AsyncExitStack() as stack:
            await meta.open(stack)
            answered = trio.Event()

            async def beat():
                await meta.heartbeat()
                answered.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(beat)
                await trio.sleep(0.3)  # the heartbeat waits for the daemon
                held.clear()  # the file is closed meanwhile
                async with open_socket(ctx, zmq.ROUTER, bind=address) as router:
                    identity, header = await router.recv_multipart()
                    request_id, body = protocol.decode_request(header.bytes)
                    assert isinstance(body, protocol.SessionHeartbeatReq) and body.open_inodes == []
                    await router.send_multipart([identity.bytes, protocol.encode(request_id, protocol.OkRsp())])
                    await answered.wait()  # before the router closes: it closes with linger 0, reply unsent


async def test_waiting_for_a_closed_connection_to_take_a_request_is_unavailable(ctx):
    """A mount stopping closes its sockets under its session heartbeat: an error it handles (the
    heartbeat loop ended the mount with a traceback: "mount client failed")."""
    async with connect(ctx, _free_address(), timeout=1.0) as client:
        client.sock.close()
        with pytest.raises(StripefsError) as exc:
            await client.wait_writable()
        assert exc.value.code == ErrorCode.UNAVAILABLE


async def test_a_server_whose_socket_never_empties_lets_the_process_s_other_tasks_run(ctx):
    """serve() takes a message already queued, and sends a reply, with no scheduling point: with the
    next requests always queued it let no other task of the process run until the flood ended (the
    metadata daemon's feed heartbeat: an idle mount heard nothing for 3 s and dropped its caches while
    another mount created files). It lets them run every BURST_MAX messages."""
    import functools
    import threading

    from stripefs.common.transport import BURST_MAX

    n = 15 * BURST_MAX  # all queued at once, under the socket's high-water mark (1,000)
    address = _free_address()
    answered, seen, received, sent = [0], [], [], threading.Event()

    async def burst(items, early):
        answered[0] += len(items)
        return [protocol.PingRsp(role="test") for _ in items]

    async def handler(body, payloads):
        return protocol.PingRsp(role="test")

    def flood() -> int:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        try:
            for i in range(n):
                dealer.send(protocol.encode(i + 1, protocol.PingReq()))
            sent.set()
            return sum(1 for _ in range(n) if dealer.recv())
        finally:
            dealer.close()

    async def other_task() -> None:
        while answered[0] < n:
            seen.append(answered[0])
            await trio.sleep(0)

    async with open_socket(ctx, zmq.ROUTER, bind=address) as router:
        with trio.fail_after(30):
            async with trio.open_nursery() as servers:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(lambda: _put(received, trio.to_thread.run_sync(flood)))
                    while not sent.is_set():
                        await trio.sleep(0.01)
                    await trio.sleep(0.2)  # in the server's queue by now
                    servers.start_soon(functools.partial(serve, router, handler, name="flood", burst=burst))
                    await other_task()
                servers.cancel_scope.cancel()  # every reply received (the flood's thread returned)
    assert answered[0] == n and received == [n]
    assert any(0 < count < n for count in seen), seen  # it ran while the flood was being answered


async def _put(into: list, awaitable) -> None:
    into.append(await awaitable)
