"""A storage node that answers BUSY ran nothing and asks to be retried (common/limits.py): the mount's
NodePool asks again after a short, growing pause, within the call's timeout, over real ZeroMQ.

The node here is a bare ROUTER socket speaking the wire protocol: BUSY to the first requests,
then a real answer (a real node's BUSY needs its queues full, which no test makes happen on time).
"""

import pytest
import trio
import xxhash
import zmq

from stripefs.client.data_rpc import NodePool
from stripefs.common import protocol as p
from stripefs.common.errors import ErrorCode, StripefsError
from stripefs.common.transport import open_socket
from test_meta_service import _free_address

DATA = b"stored bytes"


async def _node(sock, busy_first: int, seen: list) -> None:
    """Answer ReadChunkReqs: BUSY to the first ``busy_first``, then the data."""
    while True:
        identity, frame = (await sock.recv_multipart())[:2]
        request_id, body = p.decode_request(frame.bytes)
        seen.append(trio.current_time())
        if len(seen) <= busy_first:
            reply = [identity, p.encode(request_id, p.ErrorRsp(code=ErrorCode.BUSY, message="too far behind"))]
        else:
            reply = [identity, p.encode(request_id, p.ReadChunkRsp(version=1, xxh3=xxhash.xxh3_64_intdigest(DATA))), DATA]
        await sock.send_multipart(reply)


@pytest.mark.parametrize("busy_first, timeout, answered", [(3, 5.0, True), (1000, 0.5, False)])
async def test_a_busy_node_is_asked_again_within_the_timeout(busy_first, timeout, answered):
    ctx = zmq.Context()
    address = _free_address()
    seen: list[float] = []
    try:
        async with trio.open_nursery() as nursery:
            async with open_socket(ctx, zmq.ROUTER, bind=address) as sock:
                nursery.start_soon(_node, sock, busy_first, seen)
                nodes = NodePool(ctx, nursery, timeout=timeout, read_timeout=timeout)
                nodes.learn([p.NodeAddr(1, address)])
                started = trio.current_time()
                if answered:
                    version, data = await nodes.read_versioned(1, p.ChunkId(5, 0), 1, 0, 100, last_try=True)
                    assert (version, bytes(data)) == (1, DATA) and len(seen) == busy_first + 1
                    assert seen[1] - seen[0] >= 0.004  # paused before asking again
                else:
                    with pytest.raises(StripefsError) as failed:
                        await nodes.read_versioned(1, p.ChunkId(5, 0), 1, 0, 100, last_try=True)
                    assert failed.value.code == ErrorCode.BUSY and len(seen) > 3  # asked again until the timeout
                    assert trio.current_time() - started < timeout + 0.5
                nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)
