"""Hedged reads: a replica that does not answer is joined by the next one, over real ZeroMQ.

Node 1 is a socket that takes requests and never answers (a hung disk, a
paused process); node 2 is a real storage node. The read must come back from
node 2 long before node 1's timeout, and must not without hedging.
"""

import socket

import pytest
import trio
import zmq

from stripefs.client.chunk_cache import ChunkCache
from stripefs.client.data_rpc import NodePool
from stripefs.client.striping import DataPath
from stripefs.common import protocol as p
from stripefs.common.config import StorageConfig
from stripefs.common.layout import replica_part
from stripefs.common.transport import open_socket
from stripefs.storage_node.chunk_store import ChunkStore
from stripefs.storage_node.service import StorageService


def _addr():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("hedge", [0.2, 0.0])
async def test_a_silent_replica_is_hedged(tmp_path, hedge):
    ctx = zmq.Context()
    cfg = StorageConfig(node_id=2, listen=_addr(), data_dir=str(tmp_path), meta=[_addr()], reserved_space=0, scrub_bandwidth=0)
    store = ChunkStore(tmp_path, reserved_space=0, node_id=2)
    chunk = p.ChunkId(4, 0, replica_part(3))  # ino + index even: node 1 is asked first; v3 is in slot part 32
    store.write(chunk, 3, 0, 0, b"abc" * 1000)
    silent = _addr()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(StorageService(cfg, store, ctx=ctx).run)
            async with open_socket(ctx, zmq.ROUTER, bind=silent):  # receives, never answers
                nodes = NodePool(ctx, nursery, timeout=30, read_timeout=30)
                nodes.learn([p.NodeAddr(1, silent), p.NodeAddr(2, cfg.listen)])
                data = DataPath(None, nodes, ChunkCache(1 << 20), nursery, readahead_chunks=0, write_parallelism=1)
                data.hedge_after_s = hedge
                ref = p.ChunkRef(index=0, version=3, nodes=[1, 2])
                with trio.move_on_after(4) as waited:
                    got = await data._read_chunk(4, ref, 1 << 20)
                if hedge:
                    assert not waited.cancelled_caught and bytes(got) == b"abc" * 1000
                else:
                    assert waited.cancelled_caught  # without hedging the read waits for node 1's timeout
            nursery.cancel_scope.cancel()
    finally:
        store.close()
        ctx.destroy(linger=0)
