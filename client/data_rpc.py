"""Connections from the mount straight to storage nodes: the data path.

One DEALER per storage node, opened on first use and kept. Every payload is
checked against the xxh3 its header carries. A node that timed out is
*suspect* for a while: replica choice tries it last, so one dead node costs one
timeout, not one per chunk. A node answering BUSY (it ran nothing: its queues are
full) is asked again after a short, growing pause, within the call's timeout.

A mount whose key is restricted to a subtree shows a capability with every
chunk request (``caps``, client/caps.py); a node refusing one with ACCESS gets
the request once more with a renewed capability.
"""

from __future__ import annotations

import logging

import msgspec
import trio
import xxhash
import zmq

from ..common import protocol as p
from ..common.errors import ErrorCode, StripefsError, error_from
from ..common.transport import RpcClient, connect
from .caps import CapStore

log = logging.getLogger(__name__)

SUSPECT_FOR_S = 15.0
#: a node answering BUSY is asked again after this, then twice as long each time, up to the most
BUSY_FIRST_PAUSE_S = 0.005
BUSY_MAX_PAUSE_S = 0.2


class NodePool:
    def __init__(self, ctx: zmq.Context, nursery: trio.Nursery, *, timeout: float, read_timeout: float):
        self._ctx = ctx
        self._nursery = nursery
        self.timeout = timeout
        self.read_timeout = read_timeout
        self.addresses: dict[int, str] = {}
        self._clients: dict[str, RpcClient] = {}
        self._suspect_until: dict[int, float] = {}
        self._lock = trio.Lock()
        self.caps = CapStore()  # capabilities, for a key restricted to a subtree (client/caps.py)

    async def _call_with_caps(self, client: RpcClient, request: p.Msg, payloads=(), **kwargs):
        """``_call_once``, again after a pause (5 ms, doubling to 200 ms) while the node answers BUSY:
        it ran nothing and asks to be retried (common/limits.py). Within the call's own timeout:
        past it the BUSY is the answer."""
        deadline = trio.current_time() + (kwargs.get("timeout") or self.timeout)
        pause = BUSY_FIRST_PAUSE_S
        while True:
            try:
                return await self._call_once(client, request, payloads, **kwargs)
            except StripefsError as exc:
                if exc.code != ErrorCode.BUSY or trio.current_time() + pause >= deadline:
                    raise
            await trio.sleep(pause)
            pause = min(pause * 2, BUSY_MAX_PAUSE_S)
            kwargs["timeout"] = deadline - trio.current_time()

    async def _call_once(self, client: RpcClient, request: p.Msg, payloads=(), **kwargs):
        """``client.call``, with capabilities when this mount has any; once more with renewed ones on ACCESS."""
        try:
            return await client.call(await self._with_caps(request) if self.caps.active else request, payloads, **kwargs)
        except StripefsError as exc:
            if exc.code != ErrorCode.ACCESS or not await self.caps.refresh(_inodes(request), force=True):
                raise
        return await client.call(await self._with_caps(request), payloads, **kwargs)

    async def _with_caps(self, request: p.Msg) -> p.Msg:
        fresh = self.caps.fresh
        if isinstance(request, (p.ReadChunkReq, p.WriteChunkReq, p.StatChunkReq)):
            return msgspec.structs.replace(request, cap=await fresh(request.chunk.ino))
        if isinstance(request, p.ReadChunksReq):
            return p.ReadChunksReq(reads=[msgspec.structs.replace(r, cap=await fresh(r.chunk.ino)) for r in request.reads])
        if isinstance(request, p.WriteChunksReq):
            writes = [msgspec.structs.replace(w, cap=await fresh(w.chunk.ino)) for w in request.writes]
            return p.WriteChunksReq(writes=writes, sync=request.sync)
        if isinstance(request, p.SyncChunksReq):
            caps = [await fresh(ino) for ino in sorted({c.ino for c in request.chunks})]
            return p.SyncChunksReq(chunks=request.chunks, caps=[c for c in caps if c is not None])
        return request

    def learn(self, nodes: list[p.NodeAddr]) -> None:
        for node in nodes:
            self.addresses[node.node_id] = node.address

    async def _client(self, node_id: int) -> RpcClient:
        address = self.addresses.get(node_id)
        if address is None:
            raise StripefsError(ErrorCode.UNAVAILABLE, f"address of storage node {node_id} is unknown")
        client = self._clients.get(address)
        if client is None:
            async with self._lock:
                client = self._clients.get(address)
                if client is None:
                    client = await self._nursery.start(self._hold, address, name=f"node-connection-{node_id}")
                    self._clients[address] = client
        return client

    async def _hold(self, address: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
        # a connection lives in its own task of the root nursery: opened by whichever
        # request needs it first, it must not belong to that request's task
        async with connect(self._ctx, address, timeout=self.timeout) as client:
            task_status.started(client)
            await trio.sleep_forever()

    def order(self, nodes: list[int], start: int = 0) -> list[int]:
        """Replica order for a read: rotate by ``start`` to spread load, suspects last."""
        if not nodes:
            return []
        rotated = nodes[start % len(nodes) :] + nodes[: start % len(nodes)]
        now = trio.current_time()
        return sorted(rotated, key=lambda n: self._suspect_until.get(n, 0) > now)

    def suspect(self, node_id: int, exc: StripefsError) -> None:
        """(trio thread) ``node_id`` failed with ``exc``: a timeout or an unreachable node is asked last for
        ``SUSPECT_FOR_S``."""
        if exc.code in (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE):
            self._ask_last(node_id, log.warning, "is not answering: %s", exc.message)

    def note_slow(self, node_id: int) -> None:
        """A hedged read got its answer elsewhere first: try this node last for a while. Not a
        failure (the node answers, later than another): logged at INFO, not as 'not answering'."""
        self._ask_last(node_id, log.info, "was slower than the hedge deadline: asked last for %.0f s", SUSPECT_FOR_S)

    def _ask_last(self, node_id: int, say, why: str, detail) -> None:
        """Ask ``node_id`` last for ``SUSPECT_FOR_S``; ``say`` the ``why`` once, when it was not suspect already."""
        now = trio.current_time()
        if self._suspect_until.get(node_id, 0) < now:
            say("storage node %d (%s) " + why, node_id, self.addresses.get(node_id), detail)
        self._suspect_until[node_id] = now + SUSPECT_FOR_S

    def is_suspect(self, node_id: int) -> bool:
        return self._suspect_until.get(node_id, 0) > trio.current_time()

    def suspect_until(self, node_id: int) -> float:
        """(any thread: a plain dict read) Until when, on trio's clock, ``node_id`` is asked last; 0: not suspect."""
        return self._suspect_until.get(node_id, 0)

    async def read(self, node_id: int, chunk: p.ChunkId, min_version: int, offset: int, length: int, *, last_try: bool) -> memoryview:
        return (await self.read_versioned(node_id, chunk, min_version, offset, length, last_try=last_try))[1]

    async def read_versioned(
        self, node_id: int, chunk: p.ChunkId, min_version: int, offset: int, length: int, *, last_try: bool
    ) -> tuple[int, memoryview]:
        """``read``, with the version of the copy that answered (EC decodes only one version's fragments)."""
        client = await self._client(node_id)
        try:
            rsp, payloads = await self._call_with_caps(
                client,
                p.ReadChunkReq(chunk=chunk, min_version=min_version, offset=offset, length=length),
                timeout=self.timeout if last_try else self.read_timeout,
                expect=p.ReadChunkRsp,
            )
        except StripefsError as exc:
            self.suspect(node_id, exc)
            raise
        self._suspect_until.pop(node_id, None)
        if len(payloads) != 1:
            raise StripefsError(ErrorCode.BAD_REQUEST, f"node {node_id} sent {len(payloads)} payload frames")
        data = payloads[0]
        if xxhash.xxh3_64_intdigest(data) != rsp.xxh3:
            raise StripefsError(ErrorCode.CORRUPT, f"chunk {chunk} from node {node_id} failed its checksum in transit")
        return rsp.version, data  # a view of the received frame: the bytes are never copied on the client

    async def read_many(self, node_id: int, reads: list[p.ReadChunkReq]) -> list[memoryview | StripefsError]:
        """Several reads from one node in one round trip; each is its data or why it failed."""
        client = await self._client(node_id)
        try:
            rsp, payloads = await self._call_with_caps(client, p.ReadChunksReq(reads=reads), timeout=self.timeout, expect=p.ReadChunksRsp)
        except StripefsError as exc:
            self.suspect(node_id, exc)
            raise
        self._suspect_until.pop(node_id, None)
        if len(rsp.results) != len(reads) or len(payloads) != len(reads):
            raise StripefsError(ErrorCode.BAD_REQUEST, f"node {node_id} answered {len(rsp.results)} of {len(reads)} reads")
        out: list[memoryview | StripefsError] = []
        for read, result, data in zip(reads, rsp.results, payloads):
            if result.code:
                out.append(error_from(result.code, result.message))
            elif xxhash.xxh3_64_intdigest(data) != result.xxh3:
                out.append(StripefsError(ErrorCode.CORRUPT, f"chunk {read.chunk} from node {node_id} failed its checksum in transit"))
            else:
                out.append(data)
        return out

    async def write(self, node_id: int, request: p.WriteChunkReq, data) -> p.WriteChunkRsp:
        client = await self._client(node_id)
        try:
            rsp, _ = await self._call_with_caps(client, request, [data], expect=p.WriteChunkRsp)
        except StripefsError as exc:
            self.suspect(node_id, exc)
            raise
        return rsp

    async def write_many(
        self, node_id: int, writes: list[tuple[p.WriteChunkReq, bytes | memoryview]], *, sync: bool = False
    ) -> list[p.WriteChunkRsp | StripefsError]:
        """Several chunk writes to one node, in WriteChunksReqs of at most ``MAX_BATCH_WRITES``
        writes and ``MAX_BATCH_WRITE_BYTES`` (one round trip, and with ``sync`` one sync on the
        node, per request); each write's answer or why it failed, in order. A request that fails
        as a whole (the node is down, a refused key) raises, as ``write`` does."""
        client = await self._client(node_id)
        out: list[p.WriteChunkRsp | StripefsError] = []
        for batch in _batches(writes):
            request = p.WriteChunksReq(writes=[w for w, _ in batch], sync=sync)
            timeout = self.timeout + sum(len(d) for _, d in batch) / (64 << 20)  # a slow disk gets 1 s per 64 MiB more
            try:
                rsp, _ = await self._call_with_caps(client, request, shared_frames(batch), timeout=timeout, expect=p.WriteChunksRsp)
            except StripefsError as exc:
                self.suspect(node_id, exc)
                raise
            if len(rsp.results) != len(batch):
                raise StripefsError(ErrorCode.BAD_REQUEST, f"node {node_id} answered {len(rsp.results)} of {len(batch)} writes")
            for result in rsp.results:
                out.append(p.WriteChunkRsp(version=result.version, length=result.length) if not result.code else error_from(result.code, result.message))
        self._suspect_until.pop(node_id, None)
        return out

    async def sync(self, node_id: int, chunks: list[p.ChunkId]) -> None:
        client = await self._client(node_id)
        try:
            for i in range(0, len(chunks), p.MAX_LIST):  # a request lists at most MAX_LIST chunks
                await self._call_with_caps(client, p.SyncChunksReq(chunks=chunks[i : i + p.MAX_LIST]))
        except StripefsError as exc:
            self.suspect(node_id, exc)
            raise

    async def sync_each(self, by_node: dict[int, list[p.ChunkId]]) -> dict[int, StripefsError]:
        """``sync`` on each node, at once; the nodes that failed, with their errors."""
        failed: dict[int, StripefsError] = {}

        async def one(node_id: int, chunks: list[p.ChunkId]) -> None:
            try:
                await self.sync(node_id, chunks)
            except StripefsError as exc:
                failed[node_id] = exc

        async with trio.open_nursery() as nursery:
            for node_id, chunks in by_node.items():
                nursery.start_soon(one, node_id, chunks)
        return failed


def _inodes(request: p.Msg) -> list[int]:
    """The inodes whose chunks ``request`` touches (to renew their capabilities)."""
    if isinstance(request, p.ReadChunksReq):
        return [r.chunk.ino for r in request.reads]
    if isinstance(request, p.SyncChunksReq):
        return [c.ino for c in request.chunks]
    if isinstance(request, p.WriteChunksReq):
        return [w.chunk.ino for w in request.writes]
    chunk = getattr(request, "chunk", None)
    return [chunk.ino] if chunk is not None else []


def shared_frames(batch: list[tuple[p.WriteChunkReq, bytes | memoryview]]) -> list[zmq.Frame]:
    """A batch's payloads as frames libzmq sends from the caller's memory (zero-copy), below
    common/transport.py's ``COPY_THRESHOLD`` too. That threshold copies a lone small frame (one
    reply: cheaper than zero-copy's hand-back through pyzmq's garbage-collector thread), but a
    WriteChunksReq carries up to 64 of them: copied, each 110 KiB frame cost the sending (trio)
    thread ~76 us (libzmq's fresh buffer: allocation, page faults, memcpy), zero-copy ~6 us,
    and the whole process ~125 against ~57 us with pyzmq's collector thread counted (64 x 110 KiB
    frames a message, tcp, bench figures in bench/README.md "Transport measurements"). The
    caller's buffers are not changed while libzmq may hold them: a write-back's taken
    ``DirtyChunk`` is never merged into again (client/write_back.py), and a retry sends the same
    bytes."""
    return [zmq.Frame(d, copy=False) for _, d in batch]


def _batches(writes: list[tuple[p.WriteChunkReq, bytes | memoryview]]):
    """``writes`` cut into runs a WriteChunksReq may carry (count and payload bytes bounded)."""
    batch: list[tuple[p.WriteChunkReq, bytes | memoryview]] = []
    size = 0
    for write in writes:
        n = len(write[1])
        if batch and (len(batch) == p.MAX_BATCH_WRITES or size + n > p.MAX_BATCH_WRITE_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(write)
        size += n
    if batch:
        yield batch
