"""One way to build a client: the metadata session, the node pool and the data path, from a ClientConfig.

The mount (client/mount.py) and the layout converter (client/convert.py) both
go through ``open_client``; so can tests. What it wires:

* a MetaClient (failover over the config's daemons, ``op_timeout_s`` of retries,
  ``subdir`` and ``root_squash`` asked in the hello) with its session open;
* a NodePool whose first read attempt gives a replica ``READ_ATTEMPT_S`` at most
  (then the next one is asked) and whose last waits ``rpc_timeout_s``;
* the capability store shared by both (a subtree key's capabilities, client/caps.py);
* a DataPath with its chunk cache, read-ahead, write parallelism, hedging and
  erasure-coding settings, and the disk cache when the config names one.

Everything it opens belongs to the caller's exit stack and nursery.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import dataclass

import trio
import zmq

from ..common.config import ClientConfig
from .chunk_cache import ChunkCache
from .data_rpc import NodePool
from .disk_cache import DiskCache
from .meta_rpc import MetaClient
from .striping import DataPath

#: a replica that has not answered a read this long is given up for the next one (not on the last try)
READ_ATTEMPT_S = 3.0
#: the hello waits at least this long for a metadata daemon to answer
HELLO_PATIENCE_S = 10.0


@dataclass
class Client:
    meta: MetaClient
    nodes: NodePool
    data: DataPath


async def open_client(
    ctx: zmq.Context, stack: AsyncExitStack, nursery: trio.Nursery, config: ClientConfig, addresses: list[str], *, name: str
) -> Client:
    """A client of the cluster at ``addresses`` with its session open; ``name`` tells the daemon who it is
    (a mountpoint, say)."""
    meta = MetaClient(ctx, addresses, timeout=config.rpc_timeout_s, retry_window_s=config.op_timeout_s)
    meta.subdir = config.subdir.encode()
    meta.root_squash = config.root_squash
    await meta.open(stack)
    await meta.hello(name, patience_s=max(config.rpc_timeout_s, HELLO_PATIENCE_S))
    nodes = NodePool(ctx, nursery, timeout=config.rpc_timeout_s, read_timeout=min(READ_ATTEMPT_S, config.rpc_timeout_s))
    meta.caps, nodes.caps.meta = nodes.caps, meta  # a subtree key's capabilities (client/caps.py)
    data = DataPath(
        meta,
        nodes,
        ChunkCache(config.cache_size),
        nursery,
        readahead_chunks=config.readahead_chunks,
        write_parallelism=config.write_parallelism,
        write_inflight=config.write_inflight,
    )
    data.hedge_after_s = config.hedge_after_s
    data.ec.min_extra = config.ec_min_fragments_over_k
    if config.disk_cache_dir:
        data.disk_cache = DiskCache(
            config.disk_cache_dir,
            meta.cluster_id,
            capacity=config.disk_cache_size,
            min_free=config.disk_cache_min_free,
        )
        await trio.to_thread.run_sync(data.disk_cache.scan)
    return Client(meta, nodes, data)
