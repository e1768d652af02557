"""RpcClient (common/transport.py): the caller that waits reads the socket for everyone.

Against a ROUTER in the test that answers in an order of its choosing: each caller gets its own
reply whatever the order, a caller that leaves (cancelled, timed out) never leaves the others
without a reader, and a reply nobody waits for any more is dropped without harm.
"""

from __future__ import annotations

import random

import pytest
import trio
import zmq

from stripefs.common import protocol as P
from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.common.transport import RpcClient, open_socket

pytestmark = pytest.mark.trio


class Server:
    """A ROUTER that holds the requests it receives until the test answers them."""

    def __init__(self, sock):
        self.sock = sock
        self.held: list[tuple[bytes, int, int]] = []  # (peer, request id, the number the caller sent)
        self.arrived = trio.Event()

    async def receive(self) -> None:
        while True:
            peer, frame, number = await self.sock.recv_multipart()
            request_id, _ = P.decode_request(frame.bytes)
            self.held.append((peer.bytes, request_id, int(number.bytes)))
            self.arrived.set()
            self.arrived = trio.Event()

    async def wait_for(self, n: int) -> None:
        while len(self.held) < n:
            await self.arrived.wait()

    async def answer(self, index: int) -> None:
        peer, request_id, number = self.held.pop(index)
        await self.sock.send_multipart([peer, P.encode(request_id, P.PingRsp(role="test", node_id=number))])


@pytest.fixture
async def pair(nursery):
    ctx = zmq.Context()
    try:
        async with open_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*") as server_sock:
            address = server_sock.raw.getsockopt(zmq.LAST_ENDPOINT).decode()
            async with open_socket(ctx, zmq.DEALER, connect=address) as client_sock:
                server = Server(server_sock)
                nursery.start_soon(server.receive)
                await client_sock.wait_writable()
                yield RpcClient(client_sock, address, 5.0), server
                nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)


async def _ask(client: RpcClient, number: int, results: dict, timeout: float = 5.0) -> None:
    rsp, _ = await client.call(P.PingReq(), [str(number).encode()], timeout=timeout)
    results[number] = rsp.node_id


async def test_each_caller_gets_its_own_reply_in_any_order(pair):
    client, server = pair
    rng = random.Random(7)
    for round_ in range(20):
        results: dict[int, int] = {}
        async with trio.open_nursery() as nursery:
            numbers = [round_ * 100 + i for i in range(rng.randint(1, 12))]
            for n in numbers:
                nursery.start_soon(_ask, client, n, results)
            await server.wait_for(len(numbers))
            while server.held:
                await server.answer(rng.randrange(len(server.held)))
                if rng.random() < 0.5:
                    await trio.sleep(0)
        assert results == {n: n for n in numbers}
    assert not client._pending and not client._reading


async def test_a_caller_that_leaves_never_strands_the_others(pair):
    """Callers cancelled while they wait, while they read, and while the reader hands over to
    them: every caller left gets its reply (one stranded would wait out its 5 s and fail)."""
    client, server = pair
    rng = random.Random(11)
    for round_ in range(30):
        results: dict[int, int] = {}
        scopes: dict[int, trio.CancelScope] = {}

        async def ask(n: int) -> None:
            with trio.CancelScope() as scopes[n]:
                await _ask(client, n, results)

        numbers = [round_ * 100 + i for i in range(6)]
        async with trio.open_nursery() as nursery:
            for n in numbers:
                nursery.start_soon(ask, n)
            await server.wait_for(len(numbers))
            cancelled = set(rng.sample(numbers, 3))
            for n in cancelled:  # in the same scheduling batch as the replies below
                scopes[n].cancel()
            while server.held:
                await server.answer(rng.randrange(len(server.held)))
        assert {n: n for n in numbers if n not in cancelled}.items() <= results.items()
        assert not client._pending and not client._reading


async def test_a_late_reply_is_dropped_and_the_next_call_is_answered(pair):
    client, server = pair
    results: dict[int, int] = {}
    with pytest.raises(StripefsError) as exc:
        await _ask(client, 1, results, timeout=0.2)
    assert exc.value.code == ErrorCode.TIMEOUT
    await server.answer(0)  # the reply to the call that gave up: nobody waits for it
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_ask, client, 2, results)
        await server.wait_for(1)
        await server.answer(0)
    assert results == {2: 2}
