"""How a fast lane (common/fast_lane.py) and the blocking metadata client (client/meta_blocking.py)
wait (issue 30, the GetattrReq round trip): the lane blocks in a receive on its ROUTER alone while
nothing it forwarded waits for serve(), and polls both sockets only while something does; a
handler that ignores ``waiting`` is not told it (no getsockopt per request); a small reply is
counted in one step (``ReplyQueues.add_small``); the client waits for a reply in blocking receives
of a bounded slice, not a zmq_poll per request. None of it may lose or delay a reply for good.
"""

from __future__ import annotations

import threading
import time

import pytest
import trio
import zmq

from stripefs.client.meta_blocking import _RECV_SLICE_MS, BlockingMetaClient
from stripefs.client.meta_rpc import MetaClient
from stripefs.common import protocol
from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.common.fast_lane import _Lane, serve_with_fast_lane
from stripefs.common.limits import ReplyQueues
from stripefs.common.transport import new_socket
from util import free_address


async def test_a_handler_not_told_waiting_answers_on_the_lane_and_forwards_keep_their_replies(ctx):
    """``tell_waiting=False``: ``fast(body, payloads)`` without the keyword. Requests it answers and
    requests it forwards to serve(), pipelined on two connections, all get their own reply (the
    forwards' while the lane polls, something outstanding), and a request sent alone after them is
    answered on the lane again (nothing outstanding: it waits on the ROUTER alone)."""
    address = free_address()
    threads = {}

    def fast(body, payloads):  # no ``waiting``: a TypeError if the lane passed it
        threads["fast"] = threading.current_thread().name
        return protocol.PingRsp(role="lane") if body.ino % 2 else None

    async def handler(body, payloads):
        await trio.sleep(0.01 if body.ino % 3 == 0 else 0)
        return protocol.PingRsp(role=f"trio-{body.ino}")

    def run_client(first: int, got: dict) -> None:
        sock = new_socket(ctx, zmq.DEALER, connect=address)
        try:
            for ino in range(first, first + 60):
                sock.send(protocol.encode(ino, protocol.GetattrReq(ino=ino)))
            for _ in range(60):
                request_id, body = protocol.decode_reply(sock.recv())
                got[request_id] = body.role
            sock.send(protocol.encode(1, protocol.GetattrReq(ino=1)))  # alone, after all were answered: the lane's
            got["alone"] = protocol.decode_reply(sock.recv())[1].role
        finally:
            sock.close(linger=0)

    def run_clients(results: list[dict]) -> None:
        clients = [threading.Thread(target=run_client, args=(1000 * (k + 1), got)) for k, got in enumerate(results)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()

    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: serve_with_fast_lane(
            ctx, address, handler, fast, name="wait-test", ordered=True, tell_waiting=False, task_status=task_status))
        results: list[dict] = [{}, {}]
        await trio.to_thread.run_sync(run_clients, results)
        for k, got in enumerate(results):
            first = 1000 * (k + 1)
            assert got.pop("alone") == "lane"
            assert sorted(got) == list(range(first, first + 60))  # each its own reply, none lost
            # an odd one is the lane's unless an earlier request of its connection waited in serve() (``ordered``)
            assert all(role == f"trio-{ino}" or (ino % 2 and role == "lane") for ino, role in got.items())
        assert threads["fast"] == "wait-test-fast-lane"
        nursery.cancel_scope.cancel()


def test_a_reply_of_serve_the_lane_did_not_count_still_goes_out(ctx):
    """The lane waits on the ROUTER alone while it counts nothing forwarded; a reply on the inner
    socket all the same (none should come) goes out at the next receive timeout, not never."""
    address = free_address()
    router = new_socket(ctx, zmq.ROUTER, bind=address)
    inner = new_socket(ctx, zmq.PAIR, bind="inproc://fast-lane-waits")
    outer = new_socket(ctx, zmq.PAIR, connect="inproc://fast-lane-waits")
    lane = _Lane(router, inner, lambda body, payloads: protocol.PingRsp(role="lane"), "uncounted", ReplyQueues(1 << 20),
                 ordered=True, tell_waiting=False)
    thread = threading.Thread(target=lane.run)
    thread.start()
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.setsockopt(zmq.ROUTING_ID, b"peer-1")
    client.setsockopt(zmq.RCVTIMEO, 10_000)
    client.connect(address)
    try:
        client.send(protocol.encode(1, protocol.PingReq()))
        assert protocol.decode_reply(client.recv())[1].role == "lane"
        assert lane.outstanding == 0
        outer.send_multipart([b"peer-1", protocol.encode(2, protocol.PingRsp(role="uncounted"))])
        assert protocol.decode_reply(client.recv())[1].role == "uncounted"
    finally:
        lane.stopping = True
        thread.join(10)
        client.close(linger=0)
        outer.close(linger=0)
    assert not thread.is_alive()


def test_small_replies_are_counted_in_one_step_as_outgoing_and_sent_count_them():
    queues = ReplyQueues(8 * 1000)  # track_every: 1000 bytes
    assert queues.track_every == 1000
    assert queues.add_small(b"p", 400) and queues.add_small(b"p", 500)
    assert queues.queued(b"p") == 900
    assert not queues.add_small(b"p", 100)  # would reach track_every: the tracked way
    assert queues.queued(b"p") == 900  # nothing counted by the refusal
    frames, nbytes, tracked = queues.outgoing(b"p", [b"p", b"x" * 100])
    assert tracked and nbytes == 100  # the same answer the usual way gives
    assert not queues.add_small(b"q", 1000)  # one reply as big as track_every is tracked from the start
    assert queues.queued(b"q") == 0


def test_a_reply_slower_than_one_receive_slice_is_taken(ctx):
    """The blocking client waits in receives of ``_RECV_SLICE_MS`` at most: a reply that takes
    several slices is still its call's answer, and the next call, after a wait cut short at the
    deadline, is answered at once."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    delays = {1: 3.5 * _RECV_SLICE_MS / 1000, 2: 0.0}

    def server() -> None:
        for _ in range(3):
            identity, header = router.recv_multipart()
            request_id, body = protocol.decode_request(header)
            if isinstance(body, protocol.PingReq):  # where the read lane is: none here
                router.send_multipart([identity, protocol.encode(request_id, protocol.PingRsp(role="meta"))])
                continue
            time.sleep(delays[body.ino])
            router.send_multipart([identity, protocol.encode(request_id, protocol.PingRsp(role=str(body.ino)))])

    thread = threading.Thread(target=server)
    thread.start()
    ctx_address = f"tcp://127.0.0.1:{port}"
    client = BlockingMetaClient(ctx, MetaClient(ctx, [ctx_address], timeout=10.0), timeout=10.0)
    try:
        assert client.call(protocol.GetattrReq(ino=1)).role == "1"
        assert client.call(protocol.GetattrReq(ino=2)).role == "2"
    finally:
        thread.join()
        client.close()
        router.close()


@pytest.mark.parametrize("slices", [0.5, 2.5])
def test_a_call_that_gets_no_reply_is_a_timeout_at_its_deadline(ctx, slices):
    """No reply: TIMEOUT once the call's time is up, whether shorter or longer than a slice."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, 100)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    stop = threading.Event()

    def server() -> None:  # answers pings (no read lane told), never a getattr
        while not stop.is_set():
            try:
                identity, header = router.recv_multipart()
            except zmq.Again:
                continue
            request_id, body = protocol.decode_request(header)
            if isinstance(body, protocol.PingReq):
                router.send_multipart([identity, protocol.encode(request_id, protocol.PingRsp(role="meta"))])

    thread = threading.Thread(target=server)
    thread.start()
    wait = slices * _RECV_SLICE_MS / 1000
    client = BlockingMetaClient(ctx, MetaClient(ctx, [address], timeout=5.0), timeout=5.0)
    try:
        assert client.call(protocol.PingReq()).role == "meta"  # the lane look-up and the connection first
        started = time.monotonic()
        with pytest.raises(StripefsError) as exc:
            client.call(protocol.GetattrReq(ino=1), timeout=wait)
        assert exc.value.code == ErrorCode.TIMEOUT
        assert time.monotonic() - started >= wait  # never before the deadline (no upper bound: a shared machine)
        assert client.call(protocol.PingReq()).role == "meta"  # and the next call is answered
    finally:
        stop.set()
        thread.join()
        client.close()
        router.close()
