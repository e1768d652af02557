"""Limits (common/limits.py): per-peer admission, handler deadlines, frame sizes, header checks."""

import math

import msgspec
import pytest
import trio
import zmq

from stripefs.common import limits, protocol
from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.common.limits import QUEUED, REFUSED, START, PeerQueues, ServeLimits
from stripefs.common.transport import RpcClient, connect, open_socket, serve

from util import free_address as _free_address


def test_peer_queues_admit_queue_refuse_in_order():
    q = PeerQueues(ServeLimits(per_peer_inflight=2, per_peer_queue=2, max_queued=3, max_queued_bytes=1000))
    assert [q.offer(b"a", i, 10) for i in range(5)] == [START, START, QUEUED, QUEUED, REFUSED]
    assert q.offer(b"b", "b0", 10) == START  # another peer is not held up by a's flood
    assert q.offer(b"b", "b1", 10) == START
    assert q.offer(b"b", "b2", 10) == QUEUED  # the third waiting request of all peers
    assert q.offer(b"b", "b3", 10) == REFUSED  # max_queued reached
    assert q.finish(b"a") == 2 and q.finish(b"a") == 3  # a's queue drains through a's own slots
    assert q.finish(b"a") is None and q.inflight(b"a") == 1
    assert q.finish(b"a") is None and q.inflight(b"a") == 0
    assert q.finish(b"b") == "b2" and q.queued == 0 and q.queued_bytes == 0
    assert q.offer(b"c", "big", 10) == START
    assert q.offer(b"c", "c1", 10) == START
    assert q.offer(b"c", "too-big", 2000) == REFUSED  # max_queued_bytes


def test_frame_limits_cover_the_largest_legitimate_frames():
    from stripefs.common.layout import MAX_CHUNK_SIZE

    assert limits.SERVER_MAX_FRAME >= MAX_CHUNK_SIZE and limits.SERVER_MAX_FRAME >= protocol.MAX_HEADER_BYTES
    assert limits.CLIENT_MAX_FRAME >= protocol.MAX_REPLY_HEADER_BYTES
    # the largest batched read request fits the request header limit
    read = protocol.ReadChunkReq(chunk=protocol.ChunkId(1 << 62, 1 << 40, 40), min_version=1 << 62, offset=0, length=1 << 26)
    big = protocol.encode(1 << 62, protocol.ReadChunksReq(reads=[read] * protocol.MAX_BATCH_READS))
    assert len(big) < protocol.MAX_HEADER_BYTES
    paths = protocol.encode(1, protocol.LookupPathsReq(root=1, paths=[b"x" * 200] * 256))  # what the client sends
    assert len(paths) < protocol.MAX_HEADER_BYTES


def _raw(request_id, body) -> bytes:
    return msgspec.msgpack.encode([protocol.PROTOCOL_VERSION, request_id, body])


@pytest.mark.parametrize(
    "frame, code, request_id",
    [
        (msgspec.msgpack.encode([protocol.PROTOCOL_VERSION + 1, "a newer header shape", {"t": "ping"}, "more"]), ErrorCode.VERSION_MISMATCH, 0),
        (msgspec.msgpack.encode([protocol.PROTOCOL_VERSION + 1, 77, {"t": "ping"}]), ErrorCode.VERSION_MISMATCH, 77),
        (msgspec.msgpack.encode([0, 5]), ErrorCode.VERSION_MISMATCH, 5),
        (msgspec.msgpack.encode(["1", 5, {"t": "ping"}]), ErrorCode.BAD_REQUEST, 0),
        (msgspec.msgpack.encode([protocol.PROTOCOL_VERSION, -5, {"t": "ping"}]), ErrorCode.BAD_REQUEST, 0),
        (_raw(3, {"t": "from_the_future"}), ErrorCode.UNKNOWN_MESSAGE, 3),
        (_raw(4, {"t": "read_chunks", "reads": [[[1, 0, 0], 0, 0, 1]] * (protocol.MAX_BATCH_READS + 1)}), ErrorCode.BAD_REQUEST, 4),
        (_raw(5, {"t": "session_heartbeat", "session_id": 1, "open_inodes": [1] * (4 * protocol.MAX_LIST + 1)}), ErrorCode.BAD_REQUEST, 5),
        (_raw(6, {"t": "lookup_paths", "root": 1, "paths": [b"a"] * (protocol.MAX_LOOKUP_PATHS + 1)}), ErrorCode.BAD_REQUEST, 6),
        (_raw(7, {"t": "getattr", "ino": "x" * (protocol.MAX_HEADER_BYTES)}), ErrorCode.BAD_REQUEST, 0),
        (b"\xdd\xff\xff\xff\xff", ErrorCode.BAD_REQUEST, 0),  # an array claiming 4 billion items: truncated, not allocated
    ],
)
def test_bad_headers_get_the_right_code(frame, code, request_id):
    with pytest.raises(protocol.ProtocolError) as exc:
        protocol.decode_request(frame)
    assert exc.value.code == code and exc.value.request_id == request_id


def test_a_well_formed_header_is_decoded_in_one_pass(monkeypatch):
    """Every request and reply decodes its header once (issue 30: the three passes that word an
    error cost 2-2.5 us of a round trip's critical path); only a bad frame takes them (above)."""

    def careful(*args):
        raise AssertionError("a well-formed header took the careful passes")

    monkeypatch.setattr(protocol, "_decode_carefully", careful)
    body = protocol.LookupReq(parent=5, name=b"x", callback=True, session_id=7)
    assert protocol.decode_request(protocol.encode(9, body)) == (9, body)
    reply = protocol.AttrRsp(attr=protocol.Attr(*range(1, 12)), callback=3)
    assert protocol.decode_reply(memoryview(protocol.encode(1 << 63, reply))) == (1 << 63, reply)  # a frame's buffer


def test_change_events_of_another_version_are_refused():
    frame = msgspec.msgpack.encode([protocol.PROTOCOL_VERSION + 1, {"a": "newer event shape"}])
    with pytest.raises(protocol.ProtocolError) as exc:
        protocol.decode_event(frame)
    assert exc.value.code == ErrorCode.VERSION_MISMATCH


async def _server(ctx, address, handler, serve_limits, *, max_frame=None, task_status=trio.TASK_STATUS_IGNORED):
    async with open_socket(ctx, zmq.ROUTER, bind=address, max_frame=max_frame) as sock:
        task_status.started()
        await serve(sock, handler, name="limits", limits=serve_limits)


async def _call_raw(sock, request_id, body):
    await sock.send_multipart([protocol.encode(request_id, body)])


async def test_a_flooding_peer_gets_busy_and_others_are_served(ctx):
    """Peer A's requests never finish: past its slots and queue it gets BUSY at once; peer B is
    still answered; after request_timeout_s A's stuck requests are answered TIMEOUT and its
    queued ones run."""
    address = _free_address()
    release = trio.Event()

    async def handler(body, payloads):
        if isinstance(body, protocol.GetattrReq) and body.ino == 1:
            await release.wait()  # never set: a handler that never finishes
        return protocol.PingRsp(role="test")

    serve_limits = ServeLimits(per_peer_inflight=4, per_peer_queue=3, request_timeout_s=1.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(_server, ctx, address, handler, serve_limits)
        async with open_socket(ctx, zmq.DEALER, connect=address) as flood:
            for i in range(4):
                await _call_raw(flood, i + 1, protocol.GetattrReq(ino=1))  # stuck in the 4 slots
            for i in range(3):
                await _call_raw(flood, 10 + i, protocol.GetattrReq(ino=2))  # queued behind them
            for i in range(5):
                await _call_raw(flood, 20 + i, protocol.GetattrReq(ino=2))  # past the queue: BUSY
            busy = []
            with trio.fail_after(5):
                while len(busy) < 5:
                    frames = await flood.recv_multipart()
                    request_id, body = protocol.decode_reply(frames[0].bytes)
                    assert isinstance(body, protocol.ErrorRsp) and body.code == ErrorCode.BUSY, body
                    busy.append(request_id)
            assert sorted(busy) == [20, 21, 22, 23, 24]
            async with connect(ctx, address, timeout=5) as other:  # another peer is served meanwhile
                rsp, _ = await other.call(protocol.PingReq())
                assert rsp.role == "test"
            replies = {}
            with trio.fail_after(10):
                while len(replies) < 7:
                    frames = await flood.recv_multipart()
                    request_id, body = protocol.decode_reply(frames[0].bytes)
                    replies[request_id] = body
            assert {i: getattr(replies[i], "code", None) for i in (1, 2, 3, 4)} == dict.fromkeys((1, 2, 3, 4), ErrorCode.TIMEOUT)
            assert all(isinstance(replies[i], protocol.PingRsp) for i in (10, 11, 12))
        nursery.cancel_scope.cancel()


async def test_an_oversized_frame_drops_the_connection_not_the_server(ctx):
    address = _free_address()

    async def handler(body, payloads):
        return protocol.PingRsp(role="test")

    async with trio.open_nursery() as nursery:
        await nursery.start(functools_partial(_server, max_frame=64 << 10), ctx, address, handler, ServeLimits())
        async with open_socket(ctx, zmq.DEALER, connect=address) as raw:
            await raw.send_multipart([protocol.encode(1, protocol.PingReq()), b"x" * (1 << 20)])
            with trio.move_on_after(1) as silence:
                await raw.recv_multipart()
            assert silence.cancelled_caught  # the peer was cut off while sending: no reply
        async with connect(ctx, address, timeout=5) as client:
            rsp, _ = await client.call(protocol.PingReq())
            assert rsp.role == "test"
        nursery.cancel_scope.cancel()


def functools_partial(fn, **kwargs):
    import functools

    return functools.partial(fn, **kwargs)


async def test_too_many_frames_are_refused_without_decoding(ctx):
    address = _free_address()

    async def handler(body, payloads):
        return protocol.PingRsp(role="test")

    async with trio.open_nursery() as nursery:
        await nursery.start(_server, ctx, address, handler, ServeLimits())
        async with open_socket(ctx, zmq.DEALER, connect=address) as raw:
            await raw.send_multipart([protocol.encode(1, protocol.PingReq())] + [b""] * limits.MAX_REQUEST_FRAMES)
            with trio.fail_after(5):
                frames = await raw.recv_multipart()
            _, body = protocol.decode_reply(frames[0].bytes)
            assert body.code == ErrorCode.BAD_REQUEST
        nursery.cancel_scope.cancel()


async def test_an_rpc_client_never_waits_forever(ctx):
    async with open_socket(ctx, zmq.DEALER, connect=_free_address()) as sock:
        with pytest.raises(ValueError):
            RpcClient(sock, "nowhere", math.inf)
    address = _free_address()
    async with trio.open_nursery() as nursery:
        async with open_socket(ctx, zmq.ROUTER, bind=address):  # receives, never answers
            async with connect(ctx, address, timeout=0.3) as client:
                with pytest.raises(StripefsError) as exc:
                    await client.call(protocol.PingReq(), timeout=math.inf)  # falls back to the client's timeout
                assert exc.value.code == ErrorCode.TIMEOUT
        nursery.cancel_scope.cancel()


async def test_the_change_feed_cuts_off_a_subscriber_sending_large_frames(ctx):
    """PUB receives subscriptions only: a peer sending a large one is disconnected, others are fed."""
    from stripefs.daemon.events import ChangeFeed

    from stripefs.daemon import change_log

    feed = ChangeFeed(ctx, "tcp://127.0.0.1:0", "b", 0)
    hostile = ctx.socket(zmq.SUB)
    good = ctx.socket(zmq.SUB)
    try:
        for sock in (hostile, good):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 100)
            sock.connect(f"tcp://127.0.0.1:{feed.port}")
        hostile.setsockopt(zmq.SUBSCRIBE, b"x" * 4096)  # larger than any subscription
        hostile.setsockopt(zmq.SUBSCRIBE, b"")
        good.setsockopt(zmq.SUBSCRIBE, b"")
        got_good = got_hostile = 0
        with trio.fail_after(10):
            while got_good < 3:
                feed.publish([(feed.seq + 1, change_log.encode([1], []))])
                await trio.sleep(0.05)
                for sock in (good, hostile):
                    try:
                        sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        continue
                    if sock is good:
                        got_good += 1
                    else:
                        got_hostile += 1
        assert got_hostile == 0
    finally:
        hostile.close(linger=0)
        good.close(linger=0)
        feed.close()


async def test_a_peer_that_never_reads_its_replies_gets_no_more_handled(ctx):
    """Review finding (issue 20): a client that never read its replies made a server queue every
    reply it answered (a storage node grew to 1 GiB). Past per_peer_reply_bytes of replies its
    connection has not taken, the peer's requests wait; another peer is served meanwhile; once
    the peer reads, every request is answered."""
    address = _free_address()
    handled = []

    async def handler(body, payloads):
        if isinstance(body, protocol.PingReq):
            return protocol.PingRsp(role="test")
        handled.append(body.chunk.ino)
        return protocol.ReadChunkRsp(version=1, xxh3=0), [bytes(1 << 20)]

    serve_limits = ServeLimits(per_peer_inflight=2, per_peer_reply_bytes=4 << 20)
    slow = ctx.socket(zmq.DEALER)
    slow.setsockopt(zmq.LINGER, 0)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.RCVBUF, 64 << 10)
    async with trio.open_nursery() as nursery:
        await nursery.start(_server, ctx, address, handler, serve_limits)
        try:
            slow.connect(address)
            for i in range(64):  # 64 MiB of replies asked for, none read
                read = protocol.ReadChunkReq(chunk=protocol.ChunkId(i + 1, 0), min_version=0, offset=0, length=1 << 20)
                slow.send(protocol.encode(i + 1, read))
            await trio.sleep(1.0)
            assert len(handled) < 24, len(handled)  # 4 MiB queued, and what the kernel's buffers took
            async with connect(ctx, address, timeout=2) as other:
                assert (await other.call(protocol.PingReq()))[0].role == "test"
            got = set()
            with trio.fail_after(20):
                while len(got) < 64:
                    if slow.poll(0):
                        request_id, body = protocol.decode_reply(slow.recv_multipart()[0])
                        assert isinstance(body, protocol.ReadChunkRsp), body
                        got.add(request_id)
                    else:
                        await trio.sleep(0.005)
            assert sorted(handled) == list(range(1, 65))
        finally:
            slow.close(linger=0)
            nursery.cancel_scope.cancel()
